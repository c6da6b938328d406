"""The /work edge against a fake peer that writes every byte itself (tests/wirepeer.py):
a frame in pieces, frames run together in one write, a message in fragments with pings
between them, pings, the close handshake, and each way a frame can break the protocol.

Only what a worker or an operator can see is asserted: the frames that come back, close
codes, GET /workers, job states and the server's log (never a traceback). Peers that
stall (stop reading, go silent mid-frame) are in test_work_wire_stalls.py. Real parts: a
uvicorn server in this process on loopback, raw TCP sockets.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Live, write_spec
from helpers import heartbeat, registration
from wirepeer import (BINARY, CLOSE, CONTINUATION, PING, PONG, TEXT, Opener, Peer, close_payload,
                      frame, gone, listed, said, text)
from wirepeer import fake, log, wire  # noqa: F401 (fixtures)

from rota.server.app import MAX_FRAME


async def test_a_registration_written_in_pieces_is_welcomed_and_acked(
        wire: Live, fake: Opener) -> None:
    peer = await fake("pieces", piecewise=True)  # the request byte by byte
    data = peer.registration_frame(hostname="in-pieces")
    assert data[1] & 0x7F == 126  # a 16-bit length: the header is 4 bytes, then the mask
    head, mask, payload = data[:4], data[4:8], data[8:]
    third = len(payload) // 3
    await peer.send(head[:3], head[3:] + mask[:2], mask[2:],  # mid-length, mid-mask
                    payload[:third], payload[third:2 * third], payload[2 * third:])
    welcome = await peer.next_json()
    assert welcome["type"] == "welcome" and welcome["worker_id"] == "pieces", welcome
    ack = await peer.next_json()
    assert ack["type"] == "ack" and ack["seq"] == 0, ack
    assert (await listed(wire))["pieces"]["hostname"] == "in-pieces"
    await peer.send(*(bytes([b]) for b in peer.beat_frame()))  # a later beat byte by byte
    assert (await peer.next_json())["seq"] == 1


async def test_frames_run_together_in_one_write_are_each_acked_in_order(
        wire: Live, fake: Opener) -> None:
    peer = await fake("coalesced")
    await peer.register()
    one, two = peer.beat_frame(), peer.beat_frame()
    await peer.send(one + two)  # two whole frames in one write
    three, four = peer.beat_frame(), peer.beat_frame()
    await peer.send(three + four[:1], four[1:])  # the next one's header cut after a byte
    five, six = peer.beat_frame(), peer.beat_frame(capacity=0)
    half = len(six) // 2
    await peer.send(five + six[:half], six[half:])  # the next one's first half
    seven, eight, nine = peer.beat_frame(), peer.beat_frame(), peer.beat_frame()
    await peer.send(seven + eight + nine[:5], nine[5:])  # through the mask
    acks = [await peer.next_json() for _ in range(9)]
    assert [(a["type"], a["seq"]) for a in acks] == [("ack", n) for n in range(1, 10)]


async def test_a_message_in_fragments_with_pings_between_them_is_one_heartbeat(
        wire: Live, fake: Opener) -> None:
    peer = await fake("fragments")
    hostname = "hôte-☃"  # the snowman's three bytes are split between two fragments
    body = json.dumps(heartbeat(0, "fragments", capacity=0,
                                registration=registration(hostname=hostname)),
                      ensure_ascii=False).encode()
    snowman = body.index("☃".encode())
    peer.seq = 1
    await peer.send(frame(TEXT, body[:20], fin=False), frame(PING, b"first"),
                    frame(CONTINUATION, body[20:snowman + 1], fin=False),
                    frame(PING, b"second"), frame(CONTINUATION, body[snowman + 1:]))
    assert await peer.control(PONG) == b"first"
    assert await peer.control(PONG) == b"second"
    assert (await peer.next_json())["type"] == "welcome"
    assert (await peer.next_json())["seq"] == 0  # one ack: one message
    assert (await listed(wire))["fragments"]["hostname"] == hostname
    # A later heartbeat in four fragments, the last one empty: it says quiet.
    later = json.dumps(heartbeat(1, "fragments", status={"state": "quiet"})).encode()
    peer.seq = 2
    await peer.send(frame(TEXT, later[:1], fin=False), frame(CONTINUATION, later[1:9], fin=False),
                    frame(PING, b"third") + frame(CONTINUATION, later[9:], fin=False),
                    frame(CONTINUATION, b""))
    assert await peer.control(PONG) == b"third"
    ack = await peer.next_json()
    assert ack["type"] == "ack" and ack["seq"] == 1 and ack["state"] == "quiet", ack
    assert (await listed(wire))["fragments"]["state"] == "quiet"
    tiny = json.dumps(heartbeat(2, "fragments")).encode()  # a fragment per byte, one write
    await peer.send(b"".join(frame(CONTINUATION if n else TEXT, tiny[n:n + 1],
                                   fin=n == len(tiny) - 1) for n in range(len(tiny))))
    assert (await peer.next_json())["seq"] == 2
    peer.seq = 3
    assert (await peer.beat())["seq"] == 3  # and the connection goes on
    assert peer.controls == [] and peer.held == []  # nothing else came


async def test_a_ping_before_registration_and_after_gets_its_payload_back(
        wire: Live, fake: Opener) -> None:
    peer = await fake("pinger")
    await peer.send(frame(PING, b"before registration"))
    assert await peer.control(PONG) == b"before registration"
    await peer.register()
    for payload in (b"after", b"", bytes(range(125))):  # 125 bytes: the most a ping holds
        await peer.send(frame(PING, payload))
        assert await peer.control(PONG) == payload
    await peer.send(frame(PONG, b"unasked"))  # a pong nobody asked for is ignored
    await peer.send(frame(PING, b"a") + frame(PING, b"b"))  # two in one write, in order
    assert [await peer.control(PONG), await peer.control(PONG)] == [b"a", b"b"]
    assert (await peer.beat())["type"] == "ack"
    assert peer.held == []  # the pings got pongs, nothing else


async def test_a_close_from_the_worker_is_answered_and_its_job_goes_back_at_once(
        wire: Live, fake: Opener, log: list[logging.LogRecord], tmp_path: Path) -> None:
    echo = write_spec(tmp_path / "specs", "echo")
    await wire.push(echo)
    peer = await fake("leaver")
    await peer.register([echo], concurrency=1, capacity=1)
    job = await wire.enqueue("echo", {"n": 1})
    [copy] = (await peer.expect("assign"))["jobs"]
    assert copy["id"] == job["id"]
    await peer.send(frame(CLOSE, close_payload(1000, "done")))
    closed = await peer.closed(answer=False)  # the server's close, then the end of TCP
    assert closed.code == 1000 and closed.before == [], closed
    await gone(wire, "leaver")
    back = await wire.wait_state(job["id"], "available", timeout=3)  # at once, no grace
    [error] = back["errors"]
    assert error["type"] == "worker_death" and "(closed)" in error["message"], error
    assert said(log, "disconnect worker=leaver reason=closed")


def stale_seq(peer: Peer) -> bytes:
    return text(heartbeat(0, peer.worker_id))  # it registered with seq 0


HEARTBEAT = json.dumps(heartbeat(7, "bad")).encode()
# (case, the bytes the peer sends, the error code the server sends first or None where
# §7 names none, the close code)
BREAKS: list[tuple[str, Callable[[Peer], bytes], str | None, int]] = [
    ("seq not increasing", stale_seq, "seq_not_increasing", 1008),
    ("a binary frame", lambda _: frame(BINARY, HEARTBEAT), "binary_not_supported", 1003),
    ("text that is not UTF-8", lambda _: frame(TEXT, b'{"type": "heartbeat\xff"}'), None, 1007),
    ("text cut inside a character", lambda _: frame(TEXT, "\"☃\"".encode()[:3]), None, 1007),
    ("an unmasked frame", lambda _: frame(TEXT, HEARTBEAT, mask=None), None, 1002),
    ("a reserved bit set (no extension agreed)", lambda _: frame(TEXT, HEARTBEAT, rsv=4),
     None, 1002),
    ("RSV3 set on a ping", lambda _: frame(PING, b"x", rsv=1), None, 1002),
    ("an unknown opcode", lambda _: frame(0x3, b"x"), None, 1002),
    ("a continuation with nothing to continue", lambda _: frame(CONTINUATION, b"{}"),
     None, 1002),
    ("a new text frame inside a fragmented one",
     lambda _: frame(TEXT, HEARTBEAT[:5], fin=False) + frame(TEXT, HEARTBEAT), None, 1002),
    ("a fragmented ping", lambda _: frame(PING, b"x", fin=False), None, 1002),
    ("a ping over 125 bytes", lambda _: frame(PING, b"x" * 126), None, 1002),
    ("a close frame of one byte", lambda _: frame(CLOSE, b"\x03"), None, 1002),
    ("a close code no peer may send (1005)", lambda _: frame(CLOSE, close_payload(1005)),
     None, 1002),
    ("a close reason that is not UTF-8", lambda _: frame(CLOSE, b"\x03\xe8\xff"), None, 1007),
]


# Some of them as a new connection's first frame, where they need no registration.
FIRST = [b for b in BREAKS if b[0] in ("a binary frame", "text that is not UTF-8",
                                       "an unmasked frame", "a fragmented ping",
                                       "a reserved bit set (no extension agreed)")]


@pytest.mark.parametrize(("case", "make", "code", "close_code", "registered"),
                         [(*b, True) for b in BREAKS] + [(*b, False) for b in FIRST],
                         ids=[b[0] for b in BREAKS] + [f"first: {b[0]}" for b in FIRST])
async def test_a_frame_that_breaks_the_protocol_closes_that_connection_only(
        wire: Live, fake: Opener, case: str, make: Callable[[Peer], bytes], code: str | None,
        close_code: int, registered: bool) -> None:
    good = await fake("good")
    await good.register()
    bad = await fake("bad")
    if registered:
        await bad.register()
    await bad.send(make(bad))
    closed = await bad.closed()
    assert closed.code == close_code, closed
    if code is not None:  # documented (§7): its error frame, then a close whose reason is it
        error = closed.error()
        assert error is not None and error["code"] == code and error["message"], closed
        assert closed.before[-1] is error and closed.reason == code, closed
    await gone(wire, "bad")
    for _ in range(3):  # the other worker is untouched
        assert (await good.beat())["type"] == "ack"
    assert list(await listed(wire)) == ["good"]


def over_the_limit(size: int, fragments: bool) -> bytes:
    """A message of ``size`` bytes: one frame whose header says so at once, or two
    fragments each under the limit, only their sum over it. (Its payload is left as it
    is, unmasked: the server must refuse the message, whatever it holds.)"""
    if not fragments:
        return frame(TEXT, b"", length=size) + b"a" * size
    half = size // 2
    return (frame(TEXT, b"a" * half, fin=False)
            + frame(CONTINUATION, b"", length=size - half) + b"a" * (size - half))


@pytest.mark.parametrize("fragments", [False, True], ids=["one frame", "two fragments"])
async def test_a_message_over_the_size_limit_is_refused_with_1009(wire: Live, fake: Opener,
                                                                  fragments: bool) -> None:
    good = await fake("good")
    await good.register()
    bad = await fake("big")
    await bad.register()
    sent = await bad.send_until_answered(over_the_limit(MAX_FRAME + 1, fragments))
    closed = await bad.closed(answer=False)
    assert closed.code == 1009, (closed, sent)
    await gone(wire, "big")
    assert (await good.beat())["type"] == "ack"
