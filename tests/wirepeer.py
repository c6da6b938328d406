"""A fake /work peer on a raw TCP socket: the handshake and every frame written by hand,
so that a test decides each byte the server gets and when (tests/server/test_work_wire*.py).

``Peer`` speaks RFC 6455 from the client's side with asyncio streams and nothing else: no
WebSocket library stands between the test and the server. ``frame()`` builds any frame,
a bad one too (unmasked, a reserved bit set, a length it does not carry); ``Peer.send``
writes pieces one at a time, letting the loop turn between them, so that the server may
read each on its own. What the server sends back is read frame by frame, with a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import select
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from conftest import Live
from helpers import heartbeat, registration, wait_until

from rota.base.specs import JobSpec

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 §1.3
TEXT, BINARY, CLOSE, PING, PONG, CONTINUATION = 0x1, 0x2, 0x8, 0x9, 0xA, 0x0
MASK = b"\x5a\xc3\x0f\x96"


def masked(payload: bytes, mask: bytes = MASK) -> bytes:
    """``payload`` XORed with the 4-byte ``mask``, as a client sends it."""
    if not payload:
        return b""
    key = (mask * (len(payload) // 4 + 1))[:len(payload)]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(
        len(payload), "big")


def frame(opcode: int, payload: bytes = b"", *, fin: bool = True, mask: bytes | None = MASK,
          rsv: int = 0, length: int | None = None) -> bytes:
    """One frame as a client writes it: masked unless ``mask`` is None, with the reserved
    bits ``rsv`` (0 to 7) and a declared ``length`` (by default the payload's)."""
    size = len(payload) if length is None else length
    first = (0x80 if fin else 0) | rsv << 4 | opcode
    bit = 0x80 if mask is not None else 0
    if size < 126:
        head = bytes([first, bit | size])
    elif size < 1 << 16:
        head = bytes([first, bit | 126]) + size.to_bytes(2, "big")
    else:
        head = bytes([first, bit | 127]) + size.to_bytes(8, "big")
    return head + payload if mask is None else head + mask + masked(payload, mask)


def text(message: dict[str, Any] | str) -> bytes:
    """A whole message in one masked text frame."""
    return frame(TEXT, (message if isinstance(message, str) else json.dumps(message)).encode())


def close_payload(code: int, reason: str = "") -> bytes:
    return code.to_bytes(2, "big") + reason.encode()


@dataclass
class Closed:
    """How the server ended a connection: its close frame's code and reason (None if the
    connection ended without one) and the JSON messages that came before it."""

    code: int | None
    reason: str
    before: list[dict[str, Any]] = field(default_factory=list)

    def error(self) -> dict[str, Any] | None:
        errors = [m for m in self.before if m.get("type") == "error"]
        return errors[-1] if errors else None


class Peer:
    """One /work connection, driven by hand."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 worker_id: str) -> None:
        self.reader = reader
        self.writer = writer
        self.transport = cast(asyncio.Transport, writer.transport)
        self.worker_id = worker_id
        self.seq = 0
        self.held: list[dict[str, Any]] = []  # JSON messages read while waiting for another
        self.controls: list[tuple[int, bytes]] = []  # pings, pongs read meanwhile

    @classmethod
    async def open(cls, port: int, worker_id: str = "w1", *, piecewise: bool = False,
                   rcvbuf: int | None = None) -> Peer:
        """Connect and upgrade; ``piecewise`` writes the request one byte at a time,
        ``rcvbuf`` makes the socket's receive buffer that small (before it connects, so
        that the window is small too)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 22)
        peer = cls(reader, writer, worker_id)
        key = base64.b64encode(os.urandom(16))
        request = (b"GET /work HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUpgrade: websocket\r\n"
                   b"Connection: Upgrade\r\nSec-WebSocket-Key: %s\r\n"
                   b"Sec-WebSocket-Version: 13\r\n\r\n" % (port, key))
        await peer.send(*([request[i:i + 1] for i in range(len(request))] if piecewise
                          else [request]))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode("latin-1").split("\r\n")
        assert lines[0].startswith("HTTP/1.1 101"), head
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        accept = base64.b64encode(hashlib.sha1(key + GUID).digest()).decode()
        assert headers["sec-websocket-accept"] == accept, head
        assert "sec-websocket-extensions" not in headers, head  # none asked, none given
        return peer

    # -- writing ---------------------------------------------------------------------
    async def send(self, *pieces: bytes) -> None:
        """Write each piece on its own, the loop turning between them (the server, in this
        process, reads one before the next is written)."""
        for piece in pieces:
            self.writer.write(piece)
            await self.writer.drain()
            await asyncio.sleep(0)  # noqa: sleep-ok (one turn of the loop, not a wait)

    async def send_until_answered(self, data: bytes, piece: int = 1 << 14) -> int:
        """Write ``data`` a piece at a time until the server sends anything back; return
        how much was written. Never a write after the server's answer: one that met the
        closed socket would reset the connection, and asyncio would then fail this
        side's reads before they got the close frame that came first."""
        sock = self.writer.get_extra_info("socket")
        self.transport.pause_reading()  # what comes back stays in the kernel, seen
        try:
            sent = 0
            while sent < len(data) and not select.select([sock], [], [], 0)[0]:
                await self.send(data[sent:sent + piece])
                sent += piece
            return min(sent, len(data))
        finally:
            self.transport.resume_reading()

    def beat_frame(self, **sections: Any) -> bytes:
        """The next heartbeat (``seq`` counted here) as one text frame."""
        data = text(heartbeat(self.seq, self.worker_id, **sections))
        self.seq += 1
        return data

    def registration_frame(self, specs: Iterable[JobSpec] = (), *, concurrency: int = 1,
                           capacity: int = 0, **fields: Any) -> bytes:
        return self.beat_frame(registration=registration(specs, concurrency=concurrency,
                                                         **fields), capacity=capacity)

    async def register(self, specs: Iterable[JobSpec] = (), *, concurrency: int = 1,
                       capacity: int = 0) -> dict[str, Any]:
        """Register in one write; return the welcome (its ack checked)."""
        seq = self.seq
        await self.send(self.registration_frame(specs, concurrency=concurrency,
                                                capacity=capacity))
        welcome = await self.next_json()
        assert welcome["type"] == "welcome", welcome
        ack = await self.next_json()  # nothing may come between the two (§2)
        assert ack["type"] == "ack" and ack["seq"] == seq, ack
        return welcome

    async def beat(self, **sections: Any) -> dict[str, Any]:
        """One heartbeat; return its ack."""
        seq = self.seq
        await self.send(self.beat_frame(**sections))
        return await self.acked(seq)

    async def acked(self, seq: int, timeout: float = 5.0) -> dict[str, Any]:
        """The ack of heartbeat ``seq``; it must be the next ack to come."""
        ack = await self.expect("ack", timeout)
        assert ack["seq"] == seq, (ack, seq)
        return ack

    # -- reading ---------------------------------------------------------------------
    async def _read(self, size: int, deadline: float) -> bytes:
        return await asyncio.wait_for(self.reader.readexactly(size),
                                      max(0.01, deadline - time.monotonic()))

    async def frame(self, timeout: float = 5.0) -> tuple[bool, int, bytes]:
        """The next frame the server sends: (fin, opcode, payload). Server frames are
        never masked."""
        deadline = time.monotonic() + timeout
        first, second = await self._read(2, deadline)
        assert not second & 0x80, "the server masked a frame"
        assert not first & 0x70, "the server set a reserved bit"
        size = second & 0x7F
        if size >= 126:
            size = int.from_bytes(await self._read(2 if size == 126 else 8, deadline), "big")
        return bool(first & 0x80), first & 0x0F, await self._read(size, deadline)

    async def message(self, timeout: float = 5.0) -> tuple[int, bytes]:
        """The next whole message, or control frame, from the server: (opcode, payload)."""
        deadline = time.monotonic() + timeout
        parts: list[bytes] = []
        kind = None
        while True:
            fin, opcode, payload = await self.frame(max(0.01, deadline - time.monotonic()))
            if opcode >= CLOSE:
                assert fin, "a fragmented control frame"
                if kind is None:
                    return opcode, payload
                self.controls.append((opcode, payload))  # between two fragments
                continue
            assert (opcode == CONTINUATION) == (kind is not None), (kind, opcode)
            kind = kind if kind is not None else opcode
            parts.append(payload)
            if fin:
                return kind, b"".join(parts)

    async def next_json(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next JSON message (kept ones first); a control frame meanwhile is kept in
        ``controls``, a close fails the test."""
        if self.held:
            return self.held.pop(0)
        deadline = time.monotonic() + timeout
        while True:
            opcode, payload = await self.message(max(0.01, deadline - time.monotonic()))
            if opcode == TEXT:
                return json.loads(payload.decode())
            assert opcode in (PING, PONG), (opcode, payload)
            self.controls.append((opcode, payload))

    async def expect(self, kind: str, timeout: float = 5.0) -> dict[str, Any]:
        """The next message of type ``kind``; others are kept, in order, for later."""
        for index, message in enumerate(self.held):
            if message["type"] == kind:
                return self.held.pop(index)
        deadline = time.monotonic() + timeout
        skipped: list[dict[str, Any]] = []
        try:
            while True:
                opcode, payload = await self.message(max(0.01, deadline - time.monotonic()))
                if opcode in (PING, PONG):
                    self.controls.append((opcode, payload))
                    continue
                assert opcode == TEXT, (opcode, payload, kind)
                message = json.loads(payload.decode())
                if message["type"] == kind:
                    return message
                skipped.append(message)
        finally:
            self.held.extend(skipped)

    async def control(self, opcode: int, timeout: float = 5.0) -> bytes:
        """The payload of the next control frame ``opcode`` (pong, say); JSON messages
        meanwhile are kept."""
        deadline = time.monotonic() + timeout
        while True:
            for index, (kind, payload) in enumerate(self.controls):
                if kind == opcode:
                    del self.controls[index]
                    return payload
            got, payload = await self.message(max(0.01, deadline - time.monotonic()))
            if got == TEXT:
                self.held.append(json.loads(payload.decode()))
            else:
                assert got in (PING, PONG), (got, payload)
                self.controls.append((got, payload))

    async def closed(self, timeout: float = 5.0, *, answer: bool = True,
                     end: bool = True) -> Closed:
        """Read to the server's close frame (answered with the same code when ``answer``)
        and then, when ``end``, to the end of the connection; what came before is kept in
        order."""
        deadline = time.monotonic() + timeout
        before, self.held = self.held, []
        code: int | None = None
        reason = ""
        try:
            while True:
                opcode, payload = await self.message(max(0.01, deadline - time.monotonic()))
                if opcode == TEXT:
                    before.append(json.loads(payload.decode()))
                elif opcode == CLOSE:
                    code = int.from_bytes(payload[:2], "big") if payload else 1005
                    reason = payload[2:].decode()
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            return Closed(None, "", before)  # dropped without a close frame
        if answer:
            try:
                await self.send(frame(CLOSE, payload[:2]))
            except ConnectionError:
                pass
        if end:
            await self.ended(max(0.01, deadline - time.monotonic()))
        return Closed(code, reason, before)

    async def ended(self, timeout: float = 5.0) -> None:
        """Until the server has closed the TCP connection (what it sends meanwhile is
        discarded)."""
        deadline = time.monotonic() + timeout
        try:
            while await asyncio.wait_for(self.reader.read(1 << 16),
                                         max(0.01, deadline - time.monotonic())):
                pass
        except ConnectionError:
            pass

    def abort(self) -> None:
        self.transport.abort()


# -- the fixtures of the tests that use it, and what they ask the server ------------------
def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    """The log records that carry a traceback, or tell of one."""
    return [f"{r.levelname} {r.getMessage()[:300]}" for r in records
            if r.exc_info or "Traceback" in r.getMessage()]


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> Iterator[list[logging.LogRecord]]:
    """The log of the whole test, the server's stop included: it must hold no traceback."""
    caplog.set_level(logging.INFO)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign, assignment]
    logging.getLogger().addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger().removeHandler(handler)
    assert not tracebacks(records), tracebacks(records)


@pytest.fixture
async def wire(log: list[logging.LogRecord], live: Live) -> Live:
    """The server (``live``, stopped before ``log`` is checked)."""
    return live


Opener = Callable[..., Awaitable[Peer]]


@pytest.fixture
async def fake(wire: Live) -> AsyncIterator[Opener]:
    """``await fake(worker_id, **options)``: a fake peer on ``wire``, dropped at the end."""
    opened: list[Peer] = []

    async def open_peer(worker_id: str, **options: Any) -> Peer:
        opened.append(await Peer.open(wire.port, worker_id, **options))
        return opened[-1]

    yield open_peer
    for each in opened:
        each.abort()


async def listed(live: Live) -> dict[str, dict[str, Any]]:
    """GET /workers, by worker id."""
    answer = await live.http.get("/workers")
    assert answer.status_code == 200, answer.text
    return {w["id"]: w for w in answer.json()["workers"]}


async def gone(live: Live, worker_id: str, timeout: float = 3.0) -> None:
    async def absent() -> bool:
        return worker_id not in await listed(live)

    await wait_until(absent, timeout=timeout, what=f"{worker_id} to leave GET /workers")


def said(records: list[logging.LogRecord], fragment: str) -> bool:
    return any(fragment in r.getMessage() for r in records)
