"""The /work edge (rota/server/edge.py LeanWebSocket, rota/server/sessions.py
Session.on_text): cases the fast path handles differently from the receive loop. Fake
peers on raw TCP against a real server in this process (tests/wirepeer.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import Live, write_spec
from wirepeer import CLOSE, PING, Opener, Peer, close_payload, frame, said
from wirepeer import fake, log, wire  # noqa: F401 (fixtures)


@pytest.mark.parametrize("live", [{"rate_limit": 0.5, "rate_burst": 5}], indirect=True)
async def test_a_goodbye_within_the_burst_is_counted_once(
        wire: Live, fake: Opener, log: list[logging.LogRecord]) -> None:
    peer = await fake("bye")
    await peer.register()  # (the connection's own bucket, before the worker's)
    for _ in range(4):  # the worker's bucket: 4 of its 5 frames
        await peer.beat()
    seq = peer.seq
    await peer.send(peer.beat_frame(goodbye=True))  # the 5th: still within the burst
    closed = await peer.closed(timeout=10)
    assert closed.code == 1000, closed
    assert [m["seq"] for m in closed.before if m["type"] == "ack"] == [seq], closed
    assert not said(log, "throttled worker=bye"), "a goodbye within the burst was throttled"


BIG = {"blob": "x" * 200_000}  # one job's assign passes the outbox's high-water mark
NOT_READING = "not reading what they are sent"


@pytest.mark.parametrize("live", [{
    "outbox_high_water": 64 << 10, "outbox_limit": 8 << 20, "heartbeat_timeout": 10.0}],
    indirect=True)
async def test_a_close_after_a_ping_from_a_backed_up_peer_is_answered(
        wire: Live, fake: Opener, tmp_path: Path) -> None:
    big = write_spec(tmp_path / "specs", "big")
    await wire.push(big)
    slow = await fake("slow", rcvbuf=4096)  # a small window: the backlog stays on the server
    await slow.register([big], concurrency=1000, capacity=1000)
    slow.transport.pause_reading()  # a worker busy elsewhere for a while
    jobs: list[str] = []
    while True:  # until the server says it is not reading: its outbox is over the mark
        jobs.append((await wire.enqueue("big", BIG))["id"])
        shown = await wire.job(jobs[-1])
        if shown["state"] == "available" and NOT_READING in (shown["waiting_reason"] or ""):
            break
        assert len(jobs) < 200
    # It pings, then closes, in one write; then reads what it was sent, to the end.
    await slow.send(frame(PING, b"alive?") + frame(CLOSE, close_payload(1000, "bye")))
    slow.transport.resume_reading()
    closed = await slow.closed(timeout=20, answer=False)
    assert closed.code == 1000, f"no close frame came back (code {closed.code})"


async def test_a_failure_counting_a_ping_ends_the_connection_as_internal_error(
        live: Live, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO)
    peer = await Peer.open(live.port, "pinger")
    try:
        await peer.register()

        def broken(worker_id: str) -> object:  # a bug anywhere under the count
            raise RuntimeError("a bug under the rate limits")

        monkeypatch.setattr(live.coordinator, "buckets_for", broken)
        await peer.send(frame(PING, b"alive?"))  # its first count after registering
        closed = await peer.closed(timeout=5)
        errors = [m for m in closed.before if m.get("type") == "error"]
        assert closed.code == 1011 and errors and errors[0]["code"] == "internal_error", closed
        assert not [r for r in caplog.records if "data_received" in r.getMessage()]
    finally:
        peer.abort()
