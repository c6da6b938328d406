"""uvicorn's HTTP protocol as Rota runs it: what it does per connection and per answer.

GuardedHttp: a request gets a deadline for its headers, a request the parser refuses a
JSON 400 like every other error, /healthz is answered above --max-connections, a stream
may drop its connection, a WebSocket handshake waits for its turn (rota/server/pacing.py),
and the producers' hot routes are served by the protocol itself (rota/server/direct.py).
Corked: an answer's headers leave with its body in one
write. The WebSocket protocol a /work connection continues on is rota/server/edge.py's.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from rota.base.logs import printable
from rota.server.api_base import DROP
from rota.server.direct import Direct, match
from rota.server.gate import error_body
from rota.server.pacing import pacer_for

log = logging.getLogger("rota.server")

# A request's line and headers together: tokens and names are short, and a browser's
# cookies stay well under it (nginx's default buffers hold 32 KiB, Node's 16 KiB).
MAX_HEADER_BYTES = 64 * 1024
# Answered even when --max-connections are open: a load balancer's probe must not be told
# the server is down because clients hold every slot.
ALWAYS_ANSWERED = frozenset({b"/healthz"})


class Corked:
    """A response's transport that sends its headers with the first part of its body.

    uvicorn writes a response's status line and headers, then its body, as two writes:
    two system calls and two TCP segments, and a client that reads the headers first is
    woken twice. Here the headers wait for the body when it follows in the same turn of
    the loop, as it does for every response Rota makes; a response whose body comes
    later (a stream) gets its headers at the end of the turn all the same."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = data
            self._loop.call_soon(self.flush)
            return
        held, self._held = self._held, None
        self._send(held + data)

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._send(held)

    def _send(self, data: bytes) -> None:
        # A pipelining client may leave before the request in hand is answered, and
        # uvicorn tells only the cycle it holds: uvloop refuses a write to a closed
        # transport with a RuntimeError (asyncio's loop ignores it), which reached the log
        # as an internal error with its traceback.
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> object:  # anything else uvicorn may ask of it
        return getattr(self._transport, name)


class GuardedHttp(HttpToolsProtocol):
    """uvicorn waits as long as a client likes for a request's headers (and cuts only idle
    keep-alive connections): a slow sender could hold connections open for ever. This
    gives every request ``header_timeout`` seconds from its first byte, or from the
    connection's start, to finish its headers."""

    header_timeout = 10.0
    _early: bytearray | None = None  # while a handshake waits for its turn: what came since
    _deadline: asyncio.TimerHandle | None = None
    _header_bytes = 0
    _headers_too_large = False
    _in_body = False  # the request's headers are complete: what comes is its body
    _body_deadline: asyncio.TimerHandle | None = None
    _refused_upgrade = False
    _refusal: tuple[int, str, str] | None = None  # owed once the answers before it are out

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        self._in_body = False
        super().on_message_begin()
        self._unset_keepalive_if_required()  # a request begun in the same read: not idle
        self._header_bytes = 0
        self._arm()

    # uvicorn's parser keeps a request's URL and headers however long they grow: 20 MB of
    # headers cost 17 MiB on one connection. Past MAX_HEADER_BYTES the request is refused.
    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        if self._in_body:
            # A chunked body's trailer: uvicorn would add it to the request's headers,
            # where an Authorization or an Origin in it counted or not as the TCP reads
            # fell (RFC 9110, section 6.5: a trailer is not a header to act on).
            return
        super().on_header(name, value)

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_BYTES:
            self._headers_too_large = True
            # An exception in a callback stops the parser; uvicorn then answers with
            # send_400_response, which says 431 instead.
            raise ValueError("request headers too large")

    def on_headers_complete(self) -> None:
        self._in_body = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self.parser.should_upgrade() and self._unreadable_body():
            return
        if self._direct():
            return
        # (weak: no cycle from the protocol through its scope back to it)
        self.scope[DROP] = weakref.WeakMethod(self.drop)  # type: ignore[literal-required]
        limit = self.limit_concurrency
        if (limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit)
                and self.url.split(b"?", 1)[0] in ALWAYS_ANSWERED):
            self.limit_concurrency = None  # this one request only
        try:
            super().on_headers_complete()
        finally:
            self.limit_concurrency = limit
        cycle = getattr(self, "cycle", None)
        if cycle is not None and getattr(cycle, "transport", None) is self.transport:
            cycle.transport = Corked(self.transport, self.loop)

    def _unreadable_body(self) -> bool:
        """Whether this is an Upgrade to something other than a WebSocket (h2c: what
        ``curl --http2`` sends to an http:// URL) with a body, which is then refused. The
        HTTP parser hands everything after an Upgrade's headers to the new protocol, so
        its body would never be read: the route got none ("the body is empty")."""
        headers = dict(self.headers)
        if headers.get(b"upgrade", b"").lower() == b"websocket" or not (
                headers.get(b"content-length", b"0").strip() not in (b"", b"0")
                or b"transfer-encoding" in headers):
            return False
        self._refused_upgrade = True
        refusal = (400, "upgrade_not_supported", "this server speaks HTTP/1.1 only: send the"
                   " request without its Upgrade header (curl: --http1.1)")
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            refuse(self.transport, *refusal)
        else:  # answered after the requests pipelined before it, in order
            self._refusal = refusal
            self.flow.pause_reading()  # (nothing after it can be read as a request)
        return True

    def _unsupported_upgrade_warning(self) -> None:
        # An Upgrade to anything but a WebSocket is ignored, as RFC 9110 lets a server do,
        # or refused above: uvicorn's WARNING for each was a line anyone could repeat.
        pass

    def _direct(self) -> bool:
        """Whether this request is one the protocol serves itself (rota/server/direct.py);
        if so, it is on its way, or waits behind the requests pipelined before it."""
        if self.expect_100_continue:
            return False  # (uvicorn's cycle answers it as the body is read)
        found = match(self.parser.get_method(), self.url)
        if found is None or self.parser.should_upgrade():
            return False
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return False  # uvicorn's 503, as for every other route
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        request = Direct(self, *found, self.headers, keep_alive,
                         self.config.app.state.coordinator.settings.max_body_bytes)
        existing, self.cycle = self.cycle, request  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            request.start()
        else:
            self.flow.pause_reading()
            self.pipeline.appendleft((request, self.app))  # type: ignore[arg-type]
        return True

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        # (uvicorn's way to start a request that waited in the pipeline)
        if isinstance(cycle, Direct):
            cycle.start()
        else:
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        if self._refused_upgrade:
            return  # (answered, and no cycle was made for it)
        cycle = self.cycle
        if isinstance(cycle, Direct):
            cycle.feed(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._refused_upgrade:
            return
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None
        cycle = self.cycle
        if isinstance(cycle, Direct):
            cycle.complete()
        else:
            super().on_message_complete()
        if (cycle is not None and cycle.response_complete and not self.pipeline
                and self.timeout_keep_alive_task is None and not self.transport.is_closing()):
            # Answered before its body ended (a refusal, a 413): the keep-alive timer armed
            # then was cancelled by the rest's arrival, and an idle connection would stay
            # open for ever. It is idle from here.
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if (self._in_body and cycle is not None and cycle.response_complete
                and self._body_deadline is None and not self.transport.is_closing()):
            # The request just answered is the one whose body is still coming (answered
            # before it ended: a refusal at the door, a 413): the rest must still come
            # within --body-timeout. Each byte of it put off the keep-alive timer, so a
            # refused client could trickle a long body for ever. (A request pipelined
            # behind, not yet answered, has its route's own deadline.)
            settings = self.config.app.state.coordinator.settings
            self._body_deadline = self.loop.call_later(settings.body_timeout,
                                                       self._body_too_slow)
        if self._refusal is not None and not self.pipeline:
            refusal, self._refusal = self._refusal, None
            refuse(self.transport, *refusal)  # (its turn: the answers before it are out)

    def _body_too_slow(self) -> None:
        self._body_deadline = None
        if self._in_body:
            log.debug("closing a connection from %s: the rest of an answered request's body"
                      " did not arrive in time", peer(self.client))
            self.transport.close()

    def handle_websocket_upgrade(self) -> None:
        """The handshake waits for its turn (rota/server/pacing.py): a reconnect storm
        must not hold the loop. The socket is still read meanwhile, so that a client that
        gives up waiting is seen to go, and its turn costs nothing; what it sends before
        the 101 (a compliant client sends nothing) is kept for the WebSocket protocol."""
        if self.parser.get_http_version() != "1.1":  # (uvicorn would pass it on as 1.1)
            refuse(self.transport, 400, "bad_handshake",
                   "a WebSocket handshake is an HTTP/1.1 request (RFC 6455, section 4.1)",
                   app=self.config.app, client=self.client)
            return
        self._early = bytearray()
        pacer_for(self.loop).admit(self.loop, self._upgrade)

    def data_received(self, data: bytes) -> None:
        if self._early is None:
            if not self.transport.is_closing():  # (refused and closing: the rest is moot)
                super().data_received(data)
            return
        self._early += data
        if len(self._early) > MAX_HEADER_BYTES:  # not a client waiting for its 101
            self.transport.close()

    def _upgrade(self) -> None:
        early, self._early = self._early, None
        if self.transport.is_closing():
            return  # the client gave up while it waited
        super().handle_websocket_upgrade()
        if early:
            self.transport.get_protocol().data_received(bytes(early))

    def send_400_response(self, msg: str) -> None:
        # A request the HTTP parser refuses (a control character in a header, a bad
        # Content-Length) is answered before Rota sees it; in JSON, as every other error.
        if self._headers_too_large:
            refuse(self.transport, 431, "headers_too_large", "the request line and headers"
                   f" are over {MAX_HEADER_BYTES} bytes")
        else:
            refuse(self.transport, 400, "bad_http_request",
                   f"the request is not valid HTTP/1.1 ({msg})")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if self._body_deadline is not None:
            self._body_deadline.cancel()
        super().connection_lost(exc)

    def drop(self) -> None:
        """End the connection now, discarding what is buffered: for a client that does
        not read, to which even the end of a response would wait behind the rest."""
        self.transport.abort()

    def _arm(self) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(self.header_timeout, self._too_slow)

    def _too_slow(self) -> None:
        log.warning("closing a connection from %s: no request headers within %gs",
                    peer(self.client), self.header_timeout)
        self.transport.close()


def refuse(transport: asyncio.Transport, status: int, code: str, message: str,
           headers: tuple[tuple[str, str], ...] = (), *, app: Any = None,
           client: tuple[str, int] | None = None) -> None:
    """Answer what the edge refuses before any route sees it, in Rota's JSON error shape,
    and close the connection. With ``app``, a refused WebSocket handshake: logged at the
    rate of the gate's refusals (rota/server/gate.py), as anyone may send one."""
    door = getattr(getattr(app, "state", None), "door", None)
    if door is not None:
        door.refused("refused a WebSocket handshake client=%s: %d %s (%s)", peer(client),
                     status, code, printable(message))
    body = error_body(code, message)
    head = "".join(f"{name}: {value}\r\n" for name, value in headers)
    transport.write(STATUS_LINE[status] + (
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{head}\r\n").encode("latin-1", "replace") + body)
    transport.close()


def peer(client: tuple[str, int] | None) -> str:
    return "%s:%d" % client if client else "-"
