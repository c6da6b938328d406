"""The producers' ``POST /jobs``, ``POST /jobs/batch`` and ``GET /jobs/{id}/result``,
served by the HTTP protocol itself (issue 27): no ASGI scope, no middleware, no Starlette
request (a result's answer is still a Starlette response, made by the route's function).

One enqueue through the ASGI stack went through uvicorn's request cycle, the safety net,
the gate and Express (rota/server/express.py) before its route ran, then built a
Starlette response and sent it as two ASGI messages: about a third of the loop's time per
call (docs/performance.md). Here the protocol (rota/server/httpedge.py) hands the parsed
request to a ``Direct``, which runs one coroutine: the gate's own decision (``Door``),
the route's scope check, the body within ``max_body_bytes`` and ``body_timeout``, the
same function the ASGI route calls (``api.enqueued``, ``api.result_of``), and the answer
written in one piece. Refusals get the same statuses and bodies as through the router (they are
made by the same functions), and a bug gets the safety net's JSON 500 with an incident
id, logged once.

A ``Direct`` stands where uvicorn keeps its request cycle, so that the protocol's own
bookkeeping applies unchanged: pipelined requests wait their turn, a graceful shutdown
lets the answer finish, a lost connection is seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple
from urllib.parse import parse_qsl

import msgspec
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from rota.base.errors import RequestError
from rota.base.logs import printable
from rota.core.auth import Principal
from rota.server import api
from rota.server.api_base import declared_over, forbidden, refusal_answer, too_large
from rota.server.coordinator import Coordinator
from rota.server.gate import Door, denial
from rota.server.safety import incident_id, internal_body

log = logging.getLogger("rota.server")

SCOPES = ("producer",)
JSON_TYPE = [(b"content-type", b"application/json")]
Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
RESULT = (b"/jobs/", b"/result")  # GET /jobs/{job_id}/result


class Route(NamedTuple):
    serve: Callable[[Coordinator, Principal, Direct], Awaitable[Answer]]
    posted: bool  # a POST: its caller's scope is checked here, then its body read


async def _enqueue(coordinator: Coordinator, principal: Principal, request: Direct) -> Answer:
    content, status = await api.enqueued(coordinator, principal, request.body)
    return status, JSON_TYPE, msgspec.json.encode(content)


async def _enqueue_batch(coordinator: Coordinator, principal: Principal, request: Direct
                         ) -> Answer:
    content, status = await api.enqueued_batch(coordinator, principal, request.body)
    return status, JSON_TYPE, msgspec.json.encode(content)


async def _result(coordinator: Coordinator, principal: Principal, request: Direct) -> Answer:
    wait = "0"
    if request.query:  # as Starlette reads a query: blanks kept, the last of a name wins
        wait = dict(parse_qsl(request.query.decode("latin-1"), keep_blank_values=True)
                    ).get("wait", "0")
    response = await api.result_of(coordinator, principal, request.target, wait, request.path)
    return response.status_code, response.raw_headers, bytes(response.body)


POSTS = {b"/jobs": Route(_enqueue, True), b"/jobs/batch": Route(_enqueue_batch, True)}
RESULTS = Route(_result, False)


def match(method: bytes, url: bytes) -> tuple[Route, str, str, bytes] | None:
    """The direct route for a request (with its path, the job id in it, and its query),
    or None for one the ASGI app serves: any other, and any path with a "%" in it (the
    app decodes it, and the gate judges what it decodes to)."""
    raw, _, query = url.partition(b"#")[0].partition(b"?")  # (a fragment is no part of either)
    if method == b"POST":
        route = POSTS.get(raw)
        return None if route is None else (route, raw.decode(), "", query)
    if (method != b"GET" or not raw.startswith(RESULT[0]) or not raw.endswith(RESULT[1])
            or b"%" in raw or not raw.isascii()):
        return None
    job_id = raw[len(RESULT[0]):-len(RESULT[1])]
    if not job_id or b"/" in job_id:  # Starlette's {job_id}: one non-empty segment
        return None
    return RESULTS, raw.decode(), job_id.decode(), query


class Direct:
    """One request to a direct route, from its parsed headers to its answer."""

    __slots__ = ("protocol", "route", "path", "target", "query", "headers", "keep_alive",
                 "limit", "more_body", "answered", "response_complete", "disconnected",
                 "overflow", "admitted", "chunks", "size", "body", "waiter", "task")

    def __init__(self, protocol: HttpToolsProtocol, route: Route, path: str, target: str,
                 query: bytes, headers: list[tuple[bytes, bytes]], keep_alive: bool,
                 limit: int) -> None:
        self.protocol = protocol
        self.route = route
        self.path = path
        self.target = target  # the job id in the path, for a result
        self.query = query
        self.headers = headers
        self.keep_alive = keep_alive
        self.limit = limit  # max_body_bytes
        self.more_body = True
        self.answered = False  # its answer is written (and complete once it has left)
        self.response_complete = False
        self.disconnected = False
        self.overflow = False
        self.admitted = False  # the gate and the scope check have let it in
        self.chunks: list[bytes] = []
        self.size = 0
        self.body = b""
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    # -- what the protocol tells it (its parser's callbacks, a lost connection) -----------

    def feed(self, body: bytes) -> None:
        if self.answered or self.overflow:
            return  # answered already (refused early): the rest is read and dropped
        self.size += len(body)
        if self.size > self.limit:
            self.overflow = True
            self.chunks = []
            self._wake()
            return
        self.chunks.append(body)
        if not self.admitted and self.size > HIGH_WATER_LIMIT:
            # Not read further until the caller is let in (uvicorn's cycle does the same
            # until its app reads): a caller about to be refused holds 64 KiB, not a body.
            self.protocol.flow.pause_reading()

    def complete(self) -> None:
        self.more_body = False
        self._wake()

    @property
    def message_event(self) -> Direct:
        return self  # uvicorn sets its cycle's message_event when the connection is lost

    def set(self) -> None:
        self._wake()
        if (self.disconnected and not self.route.posted and not self.answered
                and self.task is not None):
            # A result's wait whose client left: nobody is left to answer, and the wait
            # held one of its token's --max-waits-per-token until it ran out. (Not an
            # enqueue's: its write goes on, and is answered to nobody.)
            self.task.cancel()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    # -- the request ----------------------------------------------------------------------

    def start(self) -> None:
        protocol = self.protocol
        task = self.task = protocol.loop.create_task(self.run())
        protocol.tasks.add(task)  # counted against --max-connections, awaited at shutdown
        task.add_done_callback(protocol.tasks.discard)

    async def run(self) -> None:
        try:
            answer = await self.answer()
        except Exception as exc:  # noqa: BLE001 (a refusal, or the safety net's case)
            answer = self.refusal(exc)
        if answer is None:
            log.debug("POST %s: the client went away before its body arrived",
                      printable(self.path))
            return  # nothing was done, and nobody is left to answer
        await self.respond(*answer)

    async def answer(self) -> Answer | None:
        protocol = self.protocol
        state = protocol.config.app.state  # (the Starlette app's: rota/server/app.py)
        door: Door = state.door
        coordinator: Coordinator = state.coordinator
        method = "POST" if self.route.posted else "GET"
        scope: dict[str, Any] = {"type": "http", "method": method, "path": self.path,
                                 "raw_path": self.path.encode(), "headers": self.headers,
                                 "client": _client(protocol, self.headers)}
        refusal, _ = await door.check(scope)
        if refusal is not None:
            return refusal[0], *denial(self.path, *refusal)
        principal: Principal = scope["rota.principal"]
        if not self.route.posted:
            return await self.route.serve(coordinator, principal, self)
        if not principal.may(*SCOPES):
            raise forbidden(principal, method, self.path, SCOPES)
        self.admitted = True
        limit = self.limit
        if self.overflow or declared_over(self._header(b"content-length"), limit):
            raise too_large(limit)
        if self.more_body:
            if not await self._rest(coordinator.settings.body_timeout):
                return None
            if self.overflow:
                raise too_large(limit)
        self.body, self.chunks = b"".join(self.chunks), []
        return await self.route.serve(coordinator, principal, self)

    def _header(self, wanted: bytes) -> bytes:
        """A header's value (the first, as read: names come lower-cased), or b""."""
        for name, value in self.headers:
            if name == wanted:
                return value
        return b""

    async def _rest(self, timeout: float) -> bool:
        """Wait for the rest of the body (False: the client went away first). A body sent
        a byte a minute would hold its connection for ever: it has a deadline, as in
        ``api_base.read_body``."""
        self.waiter = self.protocol.loop.create_future()
        self.protocol.flow.resume_reading()
        try:
            async with asyncio.timeout(timeout):
                while self.more_body and not self.overflow and not self.disconnected:
                    await self.waiter
                    self.waiter = self.protocol.loop.create_future()
        except TimeoutError:
            raise RequestError(408, "body_timeout", f"the request body did not arrive within"
                               f" {timeout:g}s (body_timeout)") from None
        finally:
            self.waiter = None
        return not self.disconnected

    def refusal(self, exc: Exception) -> Answer:
        response = refusal_answer(exc)
        if response is not None:
            return response.status_code, response.raw_headers, bytes(response.body)
        incident = incident_id()  # a bug: what rota/server/safety.py does for the others
        log.error("internal error id=%s on %s %s: %s", incident,
                  "POST" if self.route.posted else "GET", printable(self.path),
                  type(exc).__name__, exc_info=exc)
        return 500, list(JSON_TYPE), internal_body(incident)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes
                      ) -> None:
        """The answer in one write; then the connection goes on to its next request, or
        closes (the client's ``Connection: close``, HTTP/1.0, a refusal that says so)."""
        if self.answered:
            return
        self.answered = True
        self.chunks, self.body = [], b""  # (the connection may idle a while, kept alive)
        protocol = self.protocol
        closing = (b"connection", b"close") in headers
        keep_alive = self.keep_alive and not closing
        transport = protocol.transport
        if not transport.is_closing() and not self.disconnected:
            parts = [STATUS_LINE[status]]
            for name, value in (*protocol.server_state.default_headers, *headers):
                if name not in (b"content-length", b"connection"):
                    parts += [name, b": ", value, b"\r\n"]
            parts.append(b"content-length: %d\r\n" % len(body))
            if not keep_alive:
                parts.append(b"connection: close\r\n")
            parts += [b"\r\n", body]
            transport.write(b"".join(parts))
            if protocol.flow.write_paused:
                # A client that does not read: its next request waits (and the socket is
                # not read) until this answer has left, as uvicorn's own cycle does.
                await protocol.flow.drain()
                keep_alive = self.keep_alive and not closing  # (a shutdown began meanwhile?)
        self.response_complete = True
        if not keep_alive:
            transport.close()
        protocol.on_response_complete()


def _client(protocol: HttpToolsProtocol, headers: list[tuple[bytes, bytes]]
            ) -> tuple[str, int] | None:
    """The caller's address as the ASGI app sees it (for the gate's log lines): behind a
    proxy uvicorn trusts (``--forwarded-allow-ips``), the one its X-Forwarded-For names."""
    client = protocol.client
    proxy = protocol.config.loaded_app
    if client is None or not isinstance(proxy, ProxyHeadersMiddleware) \
            or client[0] not in proxy.trusted_hosts:
        return client
    forwarded = [value for name, value in headers if name == b"x-forwarded-for"]
    if not forwarded:
        return client
    host, port = proxy.trusted_hosts.get_trusted_client_address(
        b", ".join(forwarded).decode("latin-1"))
    return (host, port) if host else client
