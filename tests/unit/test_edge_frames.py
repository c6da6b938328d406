"""The /work edge's fast read of text frames (rota/server/edge.py LeanWebSocket
``data_received``): whatever way a stream of frames is cut into reads, the session gets
the same messages in the same order, pings are answered, and the frames the fast read
leaves to websockets (control frames, fragments, long frames) are parsed by websockets
from the right place. Driven byte for byte with websockets' own sans-I/O protocol in
its open state; no socket."""

from __future__ import annotations

import random
from websockets.frames import Frame, Opcode
from websockets.protocol import Protocol, Side, State

from rota.server.edge import LeanEvent, LeanQueue, LeanWebSocket


class Transport:
    def __init__(self) -> None:
        self.written = bytearray()
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def edge(seen: list[str]) -> LeanWebSocket:
    ws = LeanWebSocket.__new__(LeanWebSocket)  # the protocol's state alone, no uvicorn
    ws.conn = Protocol(Side.SERVER, state=State.OPEN, max_size=1 << 20)  # type: ignore[assignment]
    ws.transport = Transport()  # type: ignore[assignment]
    ws.queue, ws.writable = LeanQueue(), LeanEvent()  # type: ignore[assignment]
    ws.writable.set()
    ws.read_paused = ws.close_sent = False
    ws.handshake_complete = True
    ws.frames, ws.curr_msg_data_type = [], "bytes"
    ws.scope = {"extensions": {}}  # type: ignore[typeddict-item]
    ws.client = None
    ws.on_control = None
    ws._carry, ws._left, ws._lost = None, 0, False

    def on_text(text: str) -> dict[str, object] | None:
        seen.append(text)
        return None

    ws.on_text = on_text
    return ws


def client(opcode: Opcode, data: bytes, fin: bool = True) -> bytes:
    return Frame(opcode, data, fin).serialize(mask=True, extensions=[])


def stream(rand: random.Random) -> tuple[bytes, list[str]]:
    parts: list[bytes] = []
    texts: list[str] = []
    for n in range(40):
        kind = rand.choice(["short", "short", "short", "long", "ping", "fragments"])
        body = f'{{"type":"heartbeat","seq":{n},"pad":"{"é" * rand.randrange(0, 200)}"}}'
        if kind == "long":
            body = body[:-1] + ',"more":"' + "x" * rand.randrange(126, 70_000) + '"}'
        if kind == "ping":
            parts.append(client(Opcode.PING, b"p%d" % n))
            continue
        texts.append(body)
        raw = body.encode()
        if kind == "fragments":
            cut = rand.randrange(0, len(raw))
            parts += [client(Opcode.TEXT, raw[:cut], fin=False), client(Opcode.PING, b"mid"),
                      client(Opcode.CONT, raw[cut:])]
        else:
            parts.append(client(Opcode.TEXT, raw))
    return b"".join(parts), texts


def feed(ws: LeanWebSocket, data: bytes, cuts: list[int]) -> None:
    at = 0
    for cut in [*sorted(cuts), len(data)]:
        if cut > at:
            ws.data_received(data[at:cut])
            at = cut


def test_every_cut_of_a_stream_gives_the_same_messages_in_order() -> None:
    rand = random.Random(27)
    for _ in range(60):
        data, texts = stream(rand)
        seen: list[str] = []
        ws = edge(seen)
        feed(ws, data, [rand.randrange(len(data)) for _ in range(rand.randrange(1, 60))])
        assert seen == texts
        assert ws.conn.parser_exc is None and not ws._lost


def test_a_read_that_ends_after_a_header_and_its_mask_is_followed() -> None:
    """The case that needs the boundaries followed: websockets takes a frame's header and
    mask and waits for its payload with nothing buffered."""
    first, second = '{"seq":1}', '{"seq":2}'
    one, two = client(Opcode.TEXT, first.encode()), client(Opcode.TEXT, second.encode())
    # A ping whose payload, unmasked by a key of zeros, looks like a text frame: read as
    # one, it would be a message nobody sent.
    decoy = b"\x81\x82\x00\x00\x00\x00{}"
    ping = bytes([0x89, 0x80 | len(decoy)]) + b"\x00" * 4 + decoy
    for cut in range(1, len(ping + one)):
        seen: list[str] = []
        ws = edge(seen)
        feed(ws, ping + one + two, [cut])  # a ping first: websockets parses from there
        assert seen == [first, second], cut


def test_pings_are_answered_and_text_that_is_not_utf8_is_left_to_websockets() -> None:
    seen: list[str] = []
    ws = edge(seen)
    ws.data_received(client(Opcode.PING, b"hi") + client(Opcode.TEXT, b'{"a":1}'))
    assert seen == ['{"a":1}'] and b"hi" in ws.transport.written  # type: ignore[attr-defined]
    bad = edge(seen := [])
    bad.data_received(client(Opcode.TEXT, b"\xff\xfe") + client(Opcode.TEXT, b"{}"))
    assert seen == []  # 1007, from the usual path; nothing after it is read
    assert bad.close_sent

