"""uvicorn's WebSocket protocol as Rota runs it (its HTTP protocol, the one before the
upgrade, is rota/server/httpedge.py's).

LeanWebSocket, a /work connection, of which a server may hold 10,000: little kept
beyond its socket; a registered worker's text frames read by the edge itself and handed
to its session in this callback (``on_text``), its frames written here (``write_text``),
with no task and no ASGI message per frame; pings counted against the rate limits; and
how much of what it was sent the worker has not read (the wire methods), so that one
which stops reading stops getting jobs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from websockets.exceptions import (
    HeaderLineTooLong, InvalidState, RequestLineTooLong, TooManyHeaders)
from websockets.http11 import MAX_LINE_LENGTH, MAX_NUM_HEADERS
from websockets.frames import apply_mask
from websockets.protocol import State
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from rota.server.httpedge import peer, refuse
from rota.server.sessions import WIRE

log = logging.getLogger("rota.server")

PING_COST = 131  # bytes a ping is counted as: the most a control frame may take


class LeanQueue:
    """What uvicorn's WebSocket protocol uses of an asyncio.Queue (put_nowait, get, empty,
    qsize), without its four deques: 3 KiB less for every open connection."""

    __slots__ = ("_items", "_getters")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._getters: list[asyncio.Future[None]] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        if self._getters:
            for getter in self._getters:
                if not getter.done():
                    getter.set_result(None)
                    return

    async def get(self) -> Any:
        while not self._items:
            if self._getters is None:
                self._getters = []
            await _wait_in(self._getters)
        return self._items.pop(0)

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)


class LeanEvent:
    """An asyncio.Event whose waiters' list exists only while someone waits."""

    __slots__ = ("_value", "_waiters")

    def __init__(self) -> None:
        self._value = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        if self._value:
            return
        self._value = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._value = False

    async def wait(self) -> bool:
        if self._value:
            return True
        if self._waiters is None:
            self._waiters = []
        await _wait_in(self._waiters)
        return True


async def _wait_in(waiters: list[asyncio.Future[None]]) -> None:
    """Wait on a new future kept in ``waiters`` until someone sets it; gone from the list
    however the wait ends (a setter may have dropped the whole list already)."""
    waiter = asyncio.get_running_loop().create_future()
    waiters.append(waiter)
    try:
        await waiter
    finally:
        if waiter in waiters:
            waiters.remove(waiter)


# websockets' refusals of a handshake, by status: Rota's error codes (docs/protocol.md, 1)
REFUSALS = {400: "bad_handshake", 405: "method_not_allowed", 426: "upgrade_required"}


def _reason(answer: Any) -> str:
    """websockets' reason for a refusal, without its preamble."""
    text = bytes(answer.body or b"").decode("utf-8", "replace").strip().rstrip(".")
    return text.removeprefix("Failed to open a WebSocket connection: ")[:200]


def last_pong(data: bytes) -> bytes | None:
    """The last of the pong frames in ``data`` (as websockets frames them for a server:
    unmasked, a payload under 126 bytes), or None if there is none, or anything else."""
    at, last = 0, None
    while at + 2 <= len(data) and data[at] == 0x8A and data[at + 1] < 126:
        end = at + 2 + data[at + 1]
        last, at = data[at:end], end
    return last if at == len(data) else None


class LeanWebSocket(WebSocketsSansIOProtocol):
    """websockets' sans-I/O protocol under uvicorn, lighter per idle connection: lean
    queue and event, and the handshake's request and response (their headers, ~3 KiB)
    let go once the connection is accepted. Frames, limits and closes are uvicorn's.

    Its transport pauses writing at ``outbox_high_water`` bytes, not asyncio's 64 KiB:
    uvicorn's send then waits, which is how the session learns that the worker does not
    read, at no cost to a send that does not wait."""

    outbox_high_water = 1 << 20  # set from the server's settings (rota/server/app.py)
    closed = 0  # /work connections ended in this process, in all

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue = LeanQueue()  # type: ignore[assignment]
        self.writable = LeanEvent()  # type: ignore[assignment]
        self.writable.set()
        # The session's handler for a text message, called here as the message is
        # parsed (rota/server/sessions.py Session.on_text); None: every message goes to
        # the app's receive, as uvicorn does it.
        self.on_text: Callable[[str], dict[str, object] | None] | None = None
        # The session's count of a control frame against its rate limits (Session.on_control).
        self.on_control: Callable[[int], None] | None = None
        # Where websockets' frame parser is (``_follow``): the start of a frame header it
        # holds, and how many bytes of a frame it still waits for; ``_lost``: not known.
        self._carry: bytes | None = None
        self._left = 0
        self._pong: bytes | None = None  # the latest ping's pong, owed until writable
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport.set_write_buffer_limits(high=self.outbox_high_water)  # low: a quarter

    def handle_connect(self, event: Any) -> None:
        # websockets' own refusals (no key, another version, not a GET) in JSON, as every
        # other error. (uvicorn's handle_connect asks it again: 9 us a handshake.)
        answer = self.conn.accept(event)
        if answer.status_code != 101:
            version = event.headers.get("Sec-WebSocket-Version")
            if version is not None and version.strip() != "13":  # RFC 6455, section 4.4
                self._refuse(426, "unsupported_version", "this server speaks WebSocket"
                             f" version 13, not {version[:20]!r}",
                             (("Sec-WebSocket-Version", "13"), ("Upgrade", "websocket")))
            else:
                status = answer.status_code
                self._refuse(status, REFUSALS.get(status, "bad_handshake"), _reason(answer),
                             tuple((name, value) for name, value in answer.headers.raw_items()
                                   if name.lower() in ("allow", "upgrade")))
            return
        super().handle_connect(event)
        scope = getattr(self, "scope", None)  # none if the handshake was refused
        if scope is not None:
            scope["extensions"][WIRE] = self  # type: ignore[index]

    def _unreadable(self, exc: Exception) -> None:
        """A handshake websockets could not read, though the HTTP parser did (its limits
        are lower: a line of 8 KiB, 128 headers, and no body). uvicorn would write nothing
        and keep the connection, before any token was asked for."""
        if isinstance(exc, RequestLineTooLong):
            self._refuse(414, "url_too_long", f"a WebSocket handshake's request line is at"
                         f" most {MAX_LINE_LENGTH} bytes")
        elif isinstance(exc, HeaderLineTooLong | TooManyHeaders):
            self._refuse(431, "headers_too_large", f"a WebSocket handshake has at most"
                         f" {MAX_NUM_HEADERS} headers of at most {MAX_LINE_LENGTH} bytes each")
        else:
            cause = exc.__cause__ or exc
            self._refuse(400, "bad_handshake",
                         f"not a WebSocket handshake this server can read: {str(cause)[:200]}")

    def _refuse(self, status: int, code: str, message: str,
                headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.handshake_complete = self.close_sent = True  # (uvicorn's marks of an answer)
        refuse(self.transport, status, code, message, headers, app=self.config.app,
               client=self.client)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        LeanWebSocket.closed += 1  # (the gc steward's measure of churn)
        scope = getattr(self, "scope", None)
        if scope is not None:  # no cycle left for the garbage collector to find
            scope["extensions"].pop(WIRE, None)  # type: ignore[union-attr]

    def send_receive_event_to_app(self) -> None:
        """A whole message arrived: hand it to the app. Written here for one case: a text
        message that is not UTF-8 ends the connection with 1007, as in uvicorn, but with
        one WARNING line instead of an ERROR and a traceback that any client could make
        the server write at will."""
        if self.curr_msg_data_type != "text":
            super().send_receive_event_to_app()
            return
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        if self.close_sent:
            return  # closing: the message is dropped, the reads go on until the reply
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            log.warning("closing a /work connection from %s: a text frame that is not"
                        " UTF-8 (byte %d); close 1007", peer(self.client), exc.start)
            self.conn.send_close(1007)
            self.handle_parser_exception()
            return
        self._deliver(text)

    def _deliver(self, text: str) -> None:
        message = ({"type": "websocket.receive", "text": text} if self.on_text is None
                   or self.queue._items else self.on_text(text))  # (handled here, or not)
        if message is None:
            return
        self.queue.put_nowait(message)
        if not self.read_paused:  # the app reads one message at a time
            self.read_paused = True
            self.transport.pause_reading()

    def data_received(self, data: bytes) -> None:
        """Whole, unfragmented, masked text frames, the heartbeats, are read here while
        the session takes them in the callback (``on_text``) and websockets' parser sits
        between frames with nothing buffered: its generator-driven parse was a third of
        what an idle beat cost the server. Anything else from the first frame that is
        not one (a control frame, a fragment, a long frame, text that is not UTF-8), and
        all that follows it, goes to websockets as before, which is where every error
        and close is judged."""
        conn = self.conn
        if not self.handshake_complete:
            if getattr(self, "scope", None) is not None:
                self._lost = True  # frames before the 101: their boundaries are not followed
            super().data_received(data)
            if not self.handshake_complete and self.conn.handshake_exc is not None:
                self._unreadable(self.conn.handshake_exc)
            return
        if (self.on_text is not None and not self.close_sent and not self._lost
                and self._carry is None and not self._left and conn.state is State.OPEN
                and conn.current_size is None and conn.parser_exc is None):
            taken = self._read_texts(data)
            if taken == len(data):
                return
            data = data[taken:]
        self._follow(data)
        super().data_received(data)

    def _follow(self, data: bytes) -> None:
        """Follow the frame boundaries through what websockets is given, so that the fast
        read starts only where websockets' parser sits between frames (it may have taken
        a frame's header and wait for its payload with nothing buffered)."""
        if self._lost:
            return
        if self._left:  # the rest of a frame's payload
            if len(data) <= self._left:
                self._left -= len(data)
                return
            data, self._left = data[self._left:], 0
        buf = data if self._carry is None else self._carry + data
        at, size = 0, len(buf)
        while at < size:
            if size - at < 2:
                break
            second = buf[at + 1]
            length, head = second & 0x7F, 2
            if length == 126:
                head = 4
            elif length == 127:
                head = 10
            head += 4 if second & 0x80 else 0
            if size - at < head:
                break
            if length >= 126:
                length = int.from_bytes(buf[at + 2:at + (4 if length == 126 else 10)], "big")
            if size - at < head + length:
                self._left, at = head + length - (size - at), size
                self._carry = None
                return
            at += head + length
        self._carry = buf[at:] if at < size else None

    def _read_texts(self, data: bytes) -> int:
        """Deliver the text frames at the start of ``data``; how many bytes they took."""
        at, size = 0, len(data)
        while at + 6 <= size and data[at] == 0x81 and self.on_text is not None:
            length = data[at + 1] ^ 0x80  # (FIN, TEXT, no RSV bit; MASK set, or a miss)
            if length < 126:
                start = at + 6
            elif length == 126 and at + 8 <= size:
                length, start = int.from_bytes(data[at + 2:at + 4], "big"), at + 8
            else:
                break  # unmasked (>= 128), 64-bit length, or a header cut short
            end = start + length
            if end > size:
                break
            try:
                text = apply_mask(data[start:end], data[start - 4:start]).decode()
            except UnicodeDecodeError:
                break  # websockets and send_receive_event_to_app close it with 1007
            at = end
            self._deliver(text)
            if self.close_sent:
                break
        return at

    def handle_ping(self) -> None:
        """A ping is a frame like any other for the rate limits, and its pong is sent
        only to a peer that reads: one that pings and never reads would otherwise make
        the server buffer every pong (135 MB in 6 s, measured), past the outbox limit.
        While the outbox is over its mark, the latest ping's pong is kept and sent once
        it drains (RFC 6455 lets an endpoint answer only the latest): a peer that was
        behind for a moment is not then taken for dead by its own keepalive."""
        if self.on_control is not None:
            self.on_control(PING_COST)
        if (not self.writable.is_set() or self.close_sent) and self.conn.close_rcvd is None:
            # The pongs websockets queued for this read's pings (and only those: a close
            # that came in the same read would have its echo there) are not written now;
            # the last is kept unless the connection is closing.
            pong = last_pong(b"".join(self.conn.data_to_send()))
            if self.close_sent:
                self._pong = None
            elif pong is not None:
                self._pong = pong
            return
        super().handle_ping()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._pong is not None:
            pong, self._pong = self._pong, None
            # (not after a close either way: no frame may follow a close frame)
            if (self.conn.state is State.OPEN and not self.close_sent
                    and not self.transport.is_closing()):
                self.transport.write(pong)

    # -- the wire, as the session sees it -------------------------------------------
    def buffered(self) -> int:
        """Bytes written and not yet taken by the kernel."""
        return self.transport.get_write_buffer_size()

    def backed_up(self) -> bool:
        """Over the high-water mark, and not yet back under the low one: a send waits."""
        return not self.writable.is_set()

    async def drained(self) -> None:
        await self.writable.wait()

    def drop(self) -> None:
        """End the connection now, discarding what is buffered: for a peer that does not
        read, to which even a close frame would wait behind the rest for ever."""
        self.transport.abort()

    def write_text(self, text: str) -> bool:
        """Frame and write a text message now, as uvicorn's send does, but without its
        ASGI message and coroutine. False when that send would wait (the buffer is over
        its mark) or fail (closing, gone): the caller then goes through it."""
        if (self.close_sent or self.disconnected or not self.handshake_complete
                or not self.writable.is_set()):
            return False
        try:
            self.conn.send_text(text.encode())
        except InvalidState:  # the peer's close came in: the ASGI send says so
            return False
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True

    async def send(self, message: Any) -> None:
        await super().send(message)
        if (message["type"] == "websocket.http.response.body" and self.close_sent
                and not self.handshake_complete):
            # A handshake refused with an HTTP answer (401, 403, 429, 500) is answered:
            # uvicorn does not mark it so, and logged an ERROR ("returned without
            # completing handshake") for each refusal, a line anyone could repeat.
            self.handshake_complete = True
        if self.handshake_complete and getattr(self, "request", None) is not None:
            # websockets' parser keeps the request for the connection's life (in its
            # generator's frame): its headers, ~1.5 KiB, are read by nobody from here on.
            self.request.headers.clear()
            self.request = None  # type: ignore[assignment]
            self.response = None  # type: ignore[assignment]
