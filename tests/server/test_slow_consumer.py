"""A worker that stops reading its socket (issue 12). The server stops giving it jobs once
what it sent and the worker has not read passes --outbox-high-water, and closes it once
that stays over --outbox-limit for --outbox-close-after; its jobs then come back after
the reconnect grace, as a lost connection's do. Real parts: a uvicorn server on loopback,
raw workers that register with concurrency 1000, keep beating and never read again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import Live, start_server, stop_server, write_spec
from helpers import RawWorker, silent_worker, spawn_serve, stop_silent, wait_until

from rota.server.app import listen_socket
from rota.base.specs import JobSpec

BIG = {"blob": "x" * 200_000}  # a job of 200 KB, under --max-args-bytes (256 KiB)


@pytest.fixture
def spec(tmp_path: Path) -> JobSpec:
    return write_spec(tmp_path / "specs", "big")


@pytest.fixture
async def tight(tmp_path: Path, spec: JobSpec) -> AsyncIterator[Live]:
    """A server whose outbox limit is crossed by one big job, and is held against a worker
    for half a second; a lost connection's jobs are kept for one second."""
    live = await start_server(tmp_path, outbox_high_water=64 << 10, outbox_limit=128 << 10,
                              outbox_close_after=0.5, reconnect_grace=1.0)
    await live.push(spec)
    try:
        yield live
    finally:
        await stop_server(live)


async def test_a_worker_that_stops_reading_gets_no_more_jobs_and_one_that_reads_gets_them(
        tmp_path: Path, spec: JobSpec):
    live = await start_server(tmp_path, outbox_high_water=256 << 10)
    await live.push(spec)
    silent, beating = await silent_worker(live.ws, "silent", [spec])
    reader = None
    try:
        slot = live.coordinator.scheduler.workers["silent"]
        for _ in range(200):  # big jobs until the kernel's buffer is full and the server's
            await live.enqueue("big", BIG)
            if slot.blocked:
                break
        assert slot.blocked
        later = [(await live.enqueue("big", BIG))["id"] for _ in range(10)]
        for job_id in later:  # it asked for 1000 and has room: they wait all the same
            shown = await live.job(job_id)
            assert shown["state"] == "available", shown
            assert "not reading what they are sent" in shown["waiting_reason"]
        reader = await RawWorker.open(live.ws, "reader")
        await reader.register([spec], concurrency=4)
        done: set[str] = set()
        while not set(later) <= done:  # the reader gets every job that waited, and runs it
            for job in await reader.jobs(1):
                await reader.complete(job, capacity=4)
                done.add(job["id"])
        assert (await waiting(live.http))[0] == 0
        for job_id in later:
            assert (await live.job(job_id))["worker_id"] == "reader"
        assert slot.blocked and "silent" in live.coordinator.connections  # beating, kept
    finally:
        await stop_silent(silent, beating)
        if reader is not None:
            await reader.ws.close()
        await stop_server(live)


async def waiting(http: httpx.AsyncClient) -> tuple[int, str]:
    """Jobs available in the default queue, and why they wait."""
    [queue] = (await http.get("/queues")).json()["queues"]
    reasons = [w["reason"] or "" for w in queue["waiting"]]
    return queue["counts"]["available"], " ".join(reasons)


async def over_the_limit(live: Live, spec: JobSpec
                         ) -> tuple[RawWorker, asyncio.Task[None], list[str]]:
    """A silent worker sent big jobs until the server closed it; those it was sent."""
    silent, beating = await silent_worker(live.ws, "silent", [spec])
    slot = live.coordinator.scheduler.workers["silent"]
    jobs = []
    while not slot.blocked:  # big jobs until the kernel's buffer is full and the server's
        jobs.append((await live.enqueue("big", BIG))["id"])
        assert len(jobs) < 200
    await wait_until(lambda: "silent" not in live.coordinator.connections, timeout=15,
                     what="the server to close the worker that does not read")
    sent = [job_id for job_id in jobs if (await live.job(job_id))["attempt"] == 1]
    assert sent  # it had room for 1000: at least the first one went to it
    return silent, beating, sent


async def came_back_after_the_grace(live: Live, job_ids: list[str]) -> None:
    for job_id in job_ids:
        job = await live.wait_state(job_id, "available", timeout=10)
        [error] = job["errors"]
        assert error["type"] == "worker_death" and "did not reconnect in time" in error["message"]


async def test_a_worker_over_the_limit_too_long_is_closed_and_hears_why_if_it_reads_again(
        tight: Live, spec: JobSpec, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("rota.server.sessions.CLOSE_WAIT", 60.0)  # the test decides when it reads
    silent, beating, sent = await over_the_limit(tight, spec)
    try:
        await came_back_after_the_grace(tight, sent)
        beating.cancel()
        silent.ws.transport.resume_reading()
        error = await silent.expect("error", timeout=10)
        assert error["code"] == "slow_consumer" and "not read" in error["message"]
        await asyncio.wait_for(silent.ws.wait_closed(), 10)
        assert silent.ws.close_code == 1008 and silent.ws.close_reason == "slow_consumer"
    finally:
        await stop_silent(silent, beating)


async def test_a_worker_that_never_reads_again_is_dropped_with_what_it_left_unread(
        tight: Live, spec: JobSpec, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("rota.server.sessions.CLOSE_WAIT", 0.1)
    silent, beating, sent = await over_the_limit(tight, spec)
    try:
        # Its error and close frames wait behind what it does not read: after CLOSE_WAIT
        # each, the connection is dropped, and the session with it.
        await wait_until(lambda: not tight.coordinator._outboxes, timeout=10,
                         what="the session of the closed worker to end")
        await came_back_after_the_grace(tight, sent)
    finally:
        await stop_silent(silent, beating)


@pytest.mark.soak  # ten silent peers; one is the quick case above
async def test_ten_workers_that_stop_reading_cost_the_server_little_memory(tmp_path: Path,
                                                                           spec: JobSpec):
    """Before the outbox limits, one such worker took a server from 47 to 283 MiB with 500
    of these jobs; ten now cost it tens of MiB (docs/performance.md has the figures)."""
    with listen_socket() as sock:
        port = sock.getsockname()[1]
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
    server = await spawn_serve(http, ["--port", str(port), "--db", str(tmp_path / "rota.db"),
                                      "--durability", "process", "--log-level", "warning"],
                               tmp_path / "serve.log")
    silent = []
    try:
        assert (await http.put("/specs", json={"specs": [
            {"name": "big", "version": "1", "queue": "default"}]})).status_code == 200
        url = f"ws://127.0.0.1:{port}/work"
        silent = [await silent_worker(url, f"silent-{n}", [spec]) for n in range(10)]
        before = psutil.Process(server.pid).memory_info().rss
        for _ in range(50):  # 500 jobs, 100 MB: what one such worker took before
            answers = await asyncio.gather(*(http.post("/jobs", json={"spec": "big", "args": BIG})
                                             for _ in range(10)))
            assert all(a.status_code == 201 for a in answers)

        async def settled() -> bool:  # every worker left unread what it could: none takes more
            available, why = await waiting(http)
            return available == 0 or "not reading what they are sent" in why

        await wait_until(settled, timeout=15, what="every silent worker to be seen not reading")
        grown = (psutil.Process(server.pid).memory_info().rss - before) / (1 << 20)
        assert grown < 150, f"the server grew by {grown:.0f} MiB"
    finally:
        for raw, beating in silent:
            await stop_silent(raw, beating)
        server.terminate()
        await server.wait()
        await http.aclose()
