"""The /work edge against fake peers that stall (tests/wirepeer.py): one that stops
reading what it is sent, one that goes silent halfway through a frame, and one that
pings and never reads its pongs. The server must let go of each, keep serving the
others meanwhile, and lose no job; and one that was only behind for a while gets the
pong of its latest ping once it reads again.

As in test_work_wire.py, only what a worker or an operator sees is asserted: frames,
close codes, GET /workers, job states, the server's log. Real parts: a uvicorn server in
this process on loopback, raw TCP sockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import completed
from wirepeer import PING, PONG, Opener, Peer, frame, gone, listed, said
from wirepeer import fake, log, wire  # noqa: F401 (fixtures)

BIG = {"blob": "x" * 200_000}  # a job of 200 KB, under --max-args-bytes (256 KiB)
NOT_READING = "not reading what they are sent"  # why a job waits (GET /jobs/{id})


async def run_jobs(peer: Peer, capacity: int, done: list[str]) -> None:
    """A worker that reads: complete every job it is assigned, asking for ``capacity``
    more each time, until cancelled; the acks are read and let go."""
    while True:
        message = await peer.next_json(timeout=30)
        if message["type"] == "assign":
            for job in message["jobs"]:
                await peer.send(peer.beat_frame(results=[completed(job, "ok")],
                                                capacity=capacity))
                done.append(job["id"])


@pytest.mark.parametrize("live", [{
    "outbox_high_water": 64 << 10, "outbox_limit": 128 << 10, "outbox_close_after": 3.0,
    "reconnect_grace": 1.0, "heartbeat_timeout": 10.0}], indirect=True)
async def test_a_peer_that_stops_reading_gets_no_more_jobs_is_dropped_and_loses_none(
        wire: Live, fake: Opener, log: list[logging.LogRecord], tmp_path: Path) -> None:
    """One big job passes the outbox limit, held against a worker for a second; its
    jobs are kept for a second. The heartbeat timeout is long: only the backlog can end
    the connection."""
    big = write_spec(tmp_path / "specs", "big")
    await wire.push(big)
    silent = await fake("silent", rcvbuf=4096)  # a small window: the backlog stays on the server
    await silent.register([big], concurrency=1000, capacity=1000)
    silent.transport.pause_reading()  # from here on, nothing is read
    jobs: list[str] = []
    while True:  # big jobs until one waits though the silent worker has room for 1000
        jobs.append((await wire.enqueue("big", BIG))["id"])
        shown = await wire.job(jobs[-1])
        if shown["state"] == "available" and NOT_READING in (shown["waiting_reason"] or ""):
            break
        assert len(jobs) < 200, "the server kept sending to a worker that does not read"
    later = [(await wire.enqueue("big", BIG))["id"] for _ in range(3)]
    for job_id in later:  # it has room; they wait all the same
        shown = await wire.job(job_id)
        assert shown["state"] == "available" and NOT_READING in shown["waiting_reason"], shown
    reader = await fake("reader")
    await reader.register([big], concurrency=4, capacity=4)
    done: list[str] = []
    running = asyncio.create_task(run_jobs(reader, 4, done))
    try:
        for job_id in later:  # the server serves the worker that reads...
            await wire.wait_state(job_id, "completed")
        assert "silent" in await listed(wire)  # ...while the silent one is still connected
        await gone(wire, "silent", timeout=10)  # full for long enough: let go
        assert said(log, "disconnect worker=silent reason=slow_consumer")
        for job_id in jobs:  # every job ran in the end, none lost
            assert (await wire.wait_state(job_id, "completed", timeout=10))["result"] == "ok"
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    assert sorted(done) == sorted([*jobs, *later])  # each assigned to the reader once
    for job_id in later:  # those it did not get waited for the worker that reads
        assert (await wire.job(job_id))["attempt"] == 1
    taken_back = [job for job in [await wire.job(j) for j in jobs] if job["errors"]]
    assert taken_back  # at least the first one went to the silent worker, and came back
    for job in taken_back:
        assert job["attempt"] == 2 and job["errors"][0]["type"] == "worker_death", job
    # When it reads again, the connection ends: the backlog, the error and the close
    # frame come through, or the server had dropped it already.
    silent.transport.resume_reading()
    closed = await silent.closed(timeout=10)
    error = closed.error()
    # (A close frame without the error frame: the backlog, error and all, waited its
    # CLOSE_WAIT and was dropped, and the close frame went once the worker read again.)
    assert (closed.code, error and error["code"]) in (
        (1008, "slow_consumer"), (1008, None), (None, None)), (
        closed.code, closed.reason, error)


@pytest.mark.parametrize("live", [{
    "outbox_high_water": 16 << 10, "outbox_limit": 1 << 30, "outbox_close_after": 1.0,
    "reconnect_grace": 1.0, "heartbeat_timeout": 10.0}], indirect=True)
async def test_a_peer_that_stops_reading_with_little_unread_is_dropped_all_the_same(
        wire: Live, fake: Opener, log: list[logging.LogRecord], tmp_path: Path) -> None:
    """What it leaves unread stays far under --outbox-limit (here 1 GiB), and it keeps
    beating. Before, it was kept for as long as it beat, and the jobs it was sent waited
    on it until their leases ran out (30 minutes by default); now it is dropped once its
    outbox has stayed full for --outbox-close-after, and they run elsewhere."""
    small = write_spec(tmp_path / "specs", "small")
    await wire.push(small)
    silent = await fake("silent", rcvbuf=4096)
    await silent.register([small], concurrency=1000, capacity=1000)
    silent.transport.pause_reading()  # from here on, nothing is read
    beating = asyncio.create_task(beat_forever(silent))
    try:
        jobs: list[str] = []
        while True:  # jobs until one waits though the silent worker has room for 1000
            answer = await wire.http.post("/jobs/batch", json={"jobs": [
                {"spec": "small", "args": {"text": "y" * 8_000}}] * 50})
            jobs += [result["job"]["id"] for result in answer.json()["results"]]
            shown = await wire.job(jobs[-1])
            if shown["state"] == "available" and NOT_READING in (shown["waiting_reason"] or ""):
                break
            assert len(jobs) < 1000, "the server kept sending to a worker that does not read"
        await gone(wire, "silent", timeout=10)
        assert said(log, "disconnect worker=silent reason=slow_consumer")
        reader = await fake("reader")
        await reader.register([small], concurrency=50, capacity=50)
        done: list[str] = []
        running = asyncio.create_task(run_jobs(reader, 50, done))
        try:
            for job_id in jobs:
                assert (await wire.wait_state(job_id, "completed", timeout=15))["result"] == "ok"
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
    sent = [job for job in [await wire.job(j) for j in jobs] if job["errors"]]
    assert sent and all(job["errors"][0]["type"] == "worker_death" for job in sent)


async def beat_forever(peer: Peer) -> None:
    """A worker whose sender goes on while its reader is stuck: a beat every 0.2 s."""
    while True:
        await peer.send(peer.beat_frame())
        await asyncio.sleep(0.2)  # noqa: sleep-ok (a worker's pace, not a wait)


@pytest.mark.parametrize("live", [{"outbox_high_water": 64 << 10,
                                   "heartbeat_timeout": 10.0}], indirect=True)
async def test_a_peer_behind_for_a_while_gets_its_latest_pings_pong_when_it_reads_again(
        wire: Live, fake: Opener, tmp_path: Path) -> None:
    """No pong is written while the outbox is over its mark, but the latest ping's is
    kept and follows the backlog: a client whose keepalive pinged meanwhile (websockets'
    default: every 20 s, closing with 1011 if no pong in 20 s) is not cut off."""
    big = write_spec(tmp_path / "specs", "big")
    await wire.push(big)
    behind = await fake("behind", rcvbuf=4096)
    await behind.register([big], concurrency=1000, capacity=1000)
    behind.transport.pause_reading()
    jobs: list[str] = []
    while True:  # big jobs until the server holds back: its outbox is over the mark
        jobs.append((await wire.enqueue("big", BIG))["id"])
        shown = await wire.job(jobs[-1])
        if shown["state"] == "available" and NOT_READING in (shown["waiting_reason"] or ""):
            break
        assert len(jobs) < 200, "the server kept sending to a worker that does not read"
    await behind.send(frame(PING, b"first"), frame(PING, b"latest"))
    # A heartbeat behind the pings, its result seen through the API: they were read.
    await behind.send(behind.beat_frame(results=[completed({"id": jobs[0], "attempt": 1},
                                                           "ok")], capacity=1000))
    await wire.wait_state(jobs[0], "completed")
    behind.transport.resume_reading()
    assert await behind.control(PONG, timeout=10) == b"latest"
    while not all(shown["state"] == "active" for shown in [await wire.job(j) for j in jobs[1:]]):
        await behind.next_json(timeout=10)  # (the backlog read, and the rest assigned)
    assert all(kind != PONG for kind, _ in behind.controls)  # the first ping's: never


@pytest.mark.parametrize("live", [{"heartbeat_interval": 0.1, "heartbeat_timeout": 0.5,
                                   "registration_timeout": 0.5}], indirect=True)
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "unregistered"])
async def test_a_peer_silent_halfway_through_a_frame_is_dropped_after_its_timeout(
        wire: Live, fake: Opener, log: list[logging.LogRecord], registered: bool) -> None:
    bystander = await fake("bystander")
    await bystander.register()
    started = time.monotonic()  # before the server starts counting
    half = await fake("half")
    if registered:
        await half.register()
    data = half.beat_frame()
    await half.send(data[:len(data) // 2])  # header, mask and half the payload; then nothing
    # Its close frame cannot be answered (it would be read as the rest of the payload), and
    # the server waits a while for the answer before it ends the TCP connection: not here.
    closing = asyncio.create_task(half.closed(timeout=5, answer=False, end=False))
    while not closing.done():  # the other worker beats on, and is answered
        assert (await bystander.beat())["type"] == "ack"
        await asyncio.sleep(0.1)  # noqa: sleep-ok (the bystander's heartbeat cadence)
    closed = await closing
    waited = time.monotonic() - started
    code = "heartbeat_timeout" if registered else "registration_timeout"
    error = closed.error()
    assert closed.code == 1008 and error is not None and error["code"] == code, closed
    assert waited >= 0.5, waited  # not before its time
    if registered:
        await gone(wire, "half")
        assert said(log, "disconnect worker=half reason=heartbeat_timeout")
    workers: dict[str, Any] = await listed(wire)
    assert list(workers) == ["bystander"]
    assert (await bystander.beat())["type"] == "ack"


async def flood(peer: Peer, data: bytes, total: int) -> int:
    """Write ``data`` again and again, ``total`` bytes at most, for as long as the server
    takes it; return how much it took."""
    sent = 0
    try:
        while sent < total:
            peer.writer.write(data)
            await peer.writer.drain()
            sent += len(data)
    except ConnectionError:
        pass
    return sent


@pytest.mark.parametrize("live", [{
    "outbox_high_water": 64 << 10, "outbox_limit": 128 << 10, "outbox_close_after": 0.3,
    # A rate a loaded machine's server still reads pings faster than (at 20,000 a second
    # a busy server read fewer, and the flood stayed within the limits).
    "rate_limit": 1000.0, "rate_burst": 1000,
    "throttle_close_after": 0.3, "heartbeat_timeout": 10.0}], indirect=True)
async def test_a_peer_that_pings_and_never_reads_is_let_go(
        wire: Live, fake: Opener, log: list[logging.LogRecord]) -> None:
    """Pings are frames, their pongs what the server sends: §1's limits hold for them. Past
    --outbox-limit unread for --outbox-close-after the peer is a slow consumer; over the
    rate limits for --throttle-close-after it is rate-limited. Either way it is let go
    long before its heartbeat timeout."""
    pinger = await fake("pinger", rcvbuf=4096)
    await pinger.register()
    pinger.transport.pause_reading()  # from here on, nothing is read
    pings = asyncio.create_task(flood(pinger, frame(PING, b"p" * 125) * 8000, 16 << 20))
    try:
        await gone(wire, "pinger", timeout=2)
    finally:
        pinger.abort()
        await asyncio.gather(pings, return_exceptions=True)
    assert (said(log, "disconnect worker=pinger reason=slow_consumer")
            or said(log, "disconnect worker=pinger reason=rate_limited"))


def test_the_pong_kept_is_the_last_one_websockets_framed() -> None:
    from rota.server.edge import last_pong

    assert last_pong(b"\x8a\x05first\x8a\x06latest") == b"\x8a\x06latest"
    assert last_pong(b"\x8a\x00") == b"\x8a\x00"
    assert last_pong(b"") is None
    assert last_pong(b"\x88\x02\x03\xe8") is None  # a close's echo is not a pong
    assert last_pong(b"\x8a\x05first\x8a") is None  # nor a frame cut short
