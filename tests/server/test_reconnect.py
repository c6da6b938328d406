"""Connection loss without loss of work: a lost connection keeps its worker's jobs
reserved for ``reconnect_grace``; the worker reconnects under the same id, takes them
back and reports what finished meanwhile. Raw clients pin the protocol down; SDK workers
run behind a TCP relay that the tests cut or silence under load."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import websockets
from conftest import Live, Proxy, start_server, stop_server, write_spec
from helpers import RawWorker, registration, wait_until

from rota import JobContext, Worker
from rota.store import pg_connection
from rota.base.specs import JobSpec

# The server's scenarios run on SQLite; what they rely on the store for runs on both
# backends in tests/store/test_store_contract.py.

STARTED = "2026-11-23T09:00:00.000Z"


async def open_raw(live: Live, worker_id: str) -> RawWorker:
    return await RawWorker.open(live.ws, worker_id)


def running(*job_ids: str) -> dict[str, Any]:
    return {"state": "running", "active_job_ids": list(job_ids)}


async def holding_a_job(live: Live, tmp_path: Path, open_worker: Callable[[str], Awaitable[RawWorker]]
                        ) -> tuple[JobSpec, RawWorker, dict[str, Any], dict[str, Any]]:
    """Worker w1 (concurrency 1) connected and running one echo job: (spec, w1, job, copy)."""
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    first = await open_worker("w1")
    await first.register([echo], concurrency=1, started_at=STARTED)
    job = await live.enqueue("echo")
    [copy] = await first.jobs(1)
    return echo, first, job, copy


@pytest.fixture
async def grace_server(tmp_path: Path):
    """A server whose lost connections keep their jobs for 0.4 s."""
    live = await start_server(tmp_path, reconnect_grace=0.4)
    try:
        yield live
    finally:
        await stop_server(live)


# -- the protocol, with raw clients ------------------------------------------------------
async def test_lost_connection_keeps_the_reservation_for_its_worker(live: Live, connect,
                                                                    tmp_path: Path):
    echo, first, job, copy = await holding_a_job(live, tmp_path, connect)
    first.ws.transport.abort()  # no close frame: the connection is lost, not closed
    await wait_until(lambda: "w1" not in live.coordinator.connections, what="the server to notice")
    held = await live.job(job["id"])
    assert (held["state"], held["worker_id"], held["errors"]) == ("active", "w1", [])
    other = await connect("w2")
    await other.register([echo])
    await other.assert_no_assign(0.2)  # still w1's

    again = await connect("w1")
    await again.register([echo], concurrency=1, capacity=0, status=running(job["id"]))
    assert live.coordinator.scheduler.workers["w1"].active == {job["id"]}  # counts again
    ack = await again.complete(copy, result="after the blink")
    assert ack["accepted"] == [job["id"]]
    done = await live.job(job["id"])
    assert (done["state"], done["attempt"], done["result"], done["errors"]) == (
        "completed", 1, "after the blink", [])


async def test_results_finished_while_away_are_accepted_on_reconnect(live: Live, connect,
                                                                     tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    first = await connect("w1")
    await first.register([echo], concurrency=2)
    jobs = [await live.enqueue("echo", {"n": n}) for n in range(2)]
    copies = await first.jobs(2)
    first.ws.transport.abort()
    await wait_until(lambda: "w1" not in live.coordinator.connections, what="the server to notice")
    again = await connect("w1")
    results = [{"job_id": c["id"], "attempt": c["attempt"], "outcome": "completed",
                "result": c["args"]} for c in copies]
    await again.register([echo], concurrency=2, results=results)  # acked after the commit
    for job in jobs:
        done = await live.job(job["id"])
        assert (done["state"], done["attempt"], done["errors"]) == ("completed", 1, [])


async def test_after_the_grace_jobs_go_back_and_the_late_worker_is_told(grace_server: Live,
                                                                        tmp_path: Path):
    live = grace_server
    echo, first, job, copy = await holding_a_job(live, tmp_path, lambda w: open_raw(live, w))
    lost_at = time.monotonic()
    first.ws.transport.abort()
    back = await live.wait_state(job["id"], "available")
    assert time.monotonic() - lost_at >= 0.4
    [death] = back["errors"]
    assert (death["type"], death["attempt"], death["worker_id"]) == ("worker_death", 1, "w1")
    assert "did not reconnect" in death["message"]

    rescuer = await open_raw(live, "w2")
    await rescuer.register([echo], concurrency=1)
    [second] = await rescuer.jobs(1)
    assert second["attempt"] == 2
    late = await open_raw(live, "w1")  # still running attempt 1, it says so
    await late.register([echo], concurrency=1, capacity=0, status=running(job["id"]))
    cancel = await late.expect("cancel")
    assert cancel == {"type": "cancel", "job_ids": [job["id"]], "reason": "reservation_lost"}
    ack = await late.complete(copy, result="too late")
    assert "accepted" not in ack and "not reserved by this worker" in ack["rejected"][0]["reason"]
    await rescuer.complete(second, result="rescued")
    done = await live.wait_state(job["id"], "completed")
    assert (done["attempt"], done["worker_id"], done["result"]) == (2, "w2", "rescued")
    for raw in (late, rescuer):
        await raw.ws.close()


async def test_a_closed_connection_gives_its_jobs_back_at_once(grace_server: Live,
                                                               tmp_path: Path):
    live = grace_server
    _, first, job, _ = await holding_a_job(live, tmp_path, lambda w: open_raw(live, w))
    await first.ws.close()  # a close frame: the worker chose to leave
    back = await live.wait_state(job["id"], "available", timeout=0.3)
    assert "(closed)" in back["errors"][0]["message"]


async def test_reconnect_of_the_same_process_replaces_a_half_open_connection(
        live: Live, connect, tmp_path: Path):
    echo, old, job, copy = await holding_a_job(live, tmp_path, connect)
    # The old socket stays open on the server (its peer vanished without a word).
    imposter = await connect("w1")
    await imposter.beat(registration=registration(started_at="2026-11-23T10:00:00.000Z"))
    assert (await imposter.expect("error"))["code"] == "worker_id_in_use"  # another process

    new = await connect("w1")
    await new.register([echo], concurrency=1, capacity=0, started_at=STARTED,
                       status=running(job["id"]))
    error = await old.expect("error")
    assert error["code"] == "superseded"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await old.recv()
    assert closed.value.rcvd.code == 1008
    assert live.coordinator.scheduler.workers["w1"].active == {job["id"]}
    assert (await new.complete(copy))["accepted"] == [job["id"]]
    done = await live.job(job["id"])
    assert (done["state"], done["attempt"], done["errors"]) == ("completed", 1, [])


# -- SDK workers behind a relay the test breaks ---------------------------------------------
class Tally:
    """What a worker's handlers did: runs per job, and the most running at once."""

    def __init__(self) -> None:
        self.runs: collections.Counter[str] = collections.Counter()
        self.now = 0
        self.most = 0
        self.finished = 0

    def build(self, specs: Path, *, concurrency: int, seconds: float = 0.0,
              gate: asyncio.Event | None = None, prefetch: int | None = None) -> Worker:
        """A worker whose jobs take ``seconds``, or wait for ``gate`` when given (but
        for jobs whose args say ``quick``)."""
        worker = Worker(specs_dir=specs, concurrency=concurrency, heartbeat_interval=0.1,
                        prefetch=prefetch)

        @worker.handler("work")
        async def work(ctx: JobContext) -> int:
            self.runs[ctx.id] += 1
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                if gate is not None and not ctx.args.get("quick"):
                    await gate.wait()
                else:
                    await asyncio.sleep(seconds)  # noqa: sleep-ok (the job's own work)
            finally:
                self.now -= 1
            self.finished += 1
            return ctx.attempt

        return worker


@contextlib.asynccontextmanager
async def behind_proxy(port: int, specs: Path, *, concurrency: int, seconds: float = 0.0,
                       tally: Tally | None = None, gate: asyncio.Event | None = None,
                       prefetch: int = 0) -> AsyncIterator[tuple[Tally, Worker, Proxy]]:
    """An SDK worker connected to the server on ``port`` through a relay the test breaks.
    No prefetch unless asked for: a cut while an assign is on its way loses that assign,
    and its jobs come back only after the reconnect grace, at attempt 2."""
    proxy = await Proxy(port).start()
    tally = tally or Tally()
    worker = tally.build(specs, concurrency=concurrency, seconds=seconds, gate=gate,
                         prefetch=prefetch)
    worker.url = proxy.ws
    task = asyncio.create_task(worker.run(), name="sdk-behind-proxy")
    try:
        await wait_until(lambda: worker.connected.is_set() or task.done(), what="SDK connect")
        if task.done():
            task.result()
        yield tally, worker, proxy
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await proxy.close()


async def break_when_busy(tally: Tally, worker: Worker, busy: int, how: Callable[[], None]) -> None:
    await wait_until(lambda: tally.now == busy, timeout=20, what=f"{busy} slots busy")
    worker.connected.clear()
    how()


async def reconnected(worker: Worker, proxy: Proxy, connections: int) -> float:
    """Wait for the worker's next connection through the relay; return how long it took."""
    began = time.monotonic()
    await wait_until(lambda: proxy.accepted >= connections and worker.connected.is_set(),
                     timeout=10, what="the worker to reconnect")
    return time.monotonic() - began


async def each_ran_once(live: Live, jobs: list[dict[str, Any]], tally: Tally,
                        concurrency: int) -> None:
    """Every job completed on its first attempt, ran once, and never over concurrency."""
    for job in jobs:
        done = await live.wait_state(job["id"], "completed", timeout=10)
        assert (done["attempt"], done["errors"]) == (1, []), done
    assert all(tally.runs[job["id"]] == 1 for job in jobs)
    assert tally.most <= concurrency


async def test_busy_worker_survives_cuts_and_keeps_every_job(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "work"))
    async with behind_proxy(live.settings.port, tmp_path, concurrency=4,
                            seconds=0.15) as (tally, worker, proxy):
        jobs = [await live.enqueue("work", {"n": n}) for n in range(24)]
        took = []
        for cut in range(2):
            await break_when_busy(tally, worker, 4, proxy.cut)
            took.append(await reconnected(worker, proxy, cut + 2))
        await each_ran_once(live, jobs, tally, 4)
    print(f"\n[reconnect] after a cut, back in {', '.join(f'{t * 1000:.0f} ms' for t in took)}")


async def test_half_open_connection_is_noticed_and_replaced(live: Live, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture):
    await live.push(write_spec(tmp_path, "work"))
    async with behind_proxy(live.settings.port, tmp_path, concurrency=2,
                            seconds=0.6) as (tally, worker, proxy):
        jobs = [await live.enqueue("work", {"n": n}) for n in range(2)]
        await break_when_busy(tally, worker, 2, proxy.blackhole)  # only silence tells
        took = await reconnected(worker, proxy, 2)
        # It came back before the server's heartbeat timeout and replaced the old socket.
        assert took < live.settings.heartbeat_timeout
        assert f"disconnect worker={worker.worker_id} reason=superseded" in caplog.text
        await each_ran_once(live, jobs, tally, 2)
    print(f"\n[reconnect] half-open connection noticed and replaced in {took * 1000:.0f} ms")


async def test_cut_then_server_restart_loses_no_result(tmp_path: Path):
    live = await start_server(tmp_path)
    port = live.settings.port
    try:
        await live.push(write_spec(tmp_path, "work"))
        async with behind_proxy(port, tmp_path, concurrency=3,
                                seconds=0.3) as (tally, worker, proxy):
            jobs = [await live.enqueue("work", {"n": n}) for n in range(6)]
            await break_when_busy(tally, worker, 3, proxy.cut)
            await stop_server(live)  # its jobs stay reserved for the worker across the restart
            await wait_until(lambda: tally.finished >= 3, what="the running jobs to finish offline")
            live = await start_server(tmp_path, port=port)
            took = await reconnected(worker, proxy, 2)
            await each_ran_once(live, jobs, tally, 3)
    finally:
        await stop_server(live)
    print(f"\n[reconnect] back {took * 1000:.0f} ms after the restarted server was up")


async def test_a_slow_commit_is_not_taken_for_a_dead_server(live: Live, tmp_path: Path):
    """An ack waits behind its results' commit. Another process holding the store's write
    lock (SQLite's; on PostgreSQL a lock on the jobs table that lets reads through) makes
    that commit slow for real: the worker must ask (ping), not reconnect."""
    await live.push(write_spec(tmp_path, "work"))
    async with behind_proxy(live.settings.port, tmp_path, concurrency=1,
                            seconds=0.3) as (tally, worker, proxy):
        job = await live.enqueue("work")
        await wait_until(lambda: tally.now == 1, what="the job to start")
        if live.settings.database_url is None:
            blocker: Any = sqlite3.connect(live.settings.db, isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")  # the server's writer now waits on this lock
        else:
            blocker = pg_connection.connect(live.settings.database_url)
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE jobs IN SHARE MODE")  # writes wait, reads do not
        try:
            await wait_until(lambda: tally.finished == 1, what="the job to finish")
            await asyncio.sleep(1.5)  # noqa: sleep-ok (the slow commit: 3x the ack patience)
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        done = await live.wait_state(job["id"], "completed")
        assert (done["attempt"], done["errors"]) == (1, [])
        assert proxy.accepted == 1 and worker.connected.is_set()  # never reconnected
