"""Crash safety with real processes.

``rota serve`` runs as a subprocess on the test's store and is made to die abruptly: at
each commit boundary (the hidden ``--crash-at`` switch, which calls ``os._exit(86)``)
and with kill -9 while workers are busy. Each test restarts it on the same store and
port and checks what survived (after a crash point, the restart is a server in the
test's process: what it finds is the store's, and a process would only cost a start). Workers die too: a ``rota worker`` killed or frozen
mid-job hands its job over, and a worker whose job was taken back has its late result
refused. Figures (jobs in flight, reruns, recovery times) are printed: see them with
``pytest -s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from conftest import Api, Live, start_server, stop_server, store_url, write_spec
from helpers import (COSTLY_POLL, RawWorker, RawWorkers, clean_env, completed, free_port,
                     registration, spawn_serve, wait_until)

from rota import JobContext, Worker
from rota.store import pg_connection
from rota.base.specs import JobSpec

# Crashes at a commit boundary and kill -9 run on both backends (how each keeps a commit
# whole, and takes the connections of a killed process back, is the backend's own); the
# rest, about workers, on SQLite (the restart under them is kill -9's, on both). What a restart finds in the store is the store's
# contract (tests/store/test_store_contract.py, on both).
BOTH = pytest.mark.both_backends

HEARTBEAT_TIMEOUT = 1.0
CRASH_EXIT = 86  # what os._exit() returns at a --crash-at point
TERMINAL = {"completed", "discarded", "cancelled"}

WORKER_MODULE = '''
"""Written by tests/system/test_crash.py: an echo worker. A job with "hold" takes that long."""
import asyncio
import random
from pathlib import Path

from rota import Worker

worker = Worker(specs_dir="specs", concurrency=CONCURRENCY)


@worker.handler("echo")
async def echo(ctx):
    if "hold" in ctx.args:
        Path(f"started-{ctx.id}-{ctx.attempt}").touch()  # the test waits for this
        await asyncio.sleep(ctx.args["hold"])  # noqa: sleep-ok (the job holds on)
    else:
        await asyncio.sleep(random.uniform(0, 0.05))  # noqa: sleep-ok (the job's own work)
    return ctx.args
'''


def _read_only(db: Path | str) -> Any:
    """A read-only connection to the store: the SQLite file, or a PostgreSQL database."""
    if isinstance(db, str):
        return pg_connection.connect(db, readonly=True)
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    return conn


def read_jobs(db: Path | str) -> dict[str, dict[str, Any]]:
    """Every job row, read straight from the store (read-only)."""
    conn = _read_only(db)
    try:
        return {row["id"]: dict(row) for row in conn.execute("SELECT * FROM jobs")}
    finally:
        conn.close()


def count_states(db: Path | str) -> Counter[str]:
    conn = _read_only(db)
    try:
        return Counter({row[0]: row[1] for row in
                        conn.execute("SELECT state, count(*) FROM jobs GROUP BY state")})
    finally:
        conn.close()


async def register_with(worker: RawWorker, specs: list[JobSpec], **sections: Any) -> dict[str, Any]:
    """Register carrying more sections (status, results, capacity); return the first ack."""
    await worker.beat(registration=registration(specs), **sections)
    await worker.expect("welcome")
    return await worker.expect("ack")


class ServerProcess(Api):
    """``rota serve`` as a subprocess on one port and store (the test's backend: a file,
    or a PostgreSQL database), restartable after a crash."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.db: Path | str = store_url(tmp) or tmp / "rota.db"
        self.port = free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.live: Live | None = None  # the restart in this process, if it is one
        self.http = httpx.AsyncClient(base_url=self.base, timeout=10)
        self.logs: list[Path] = []
        self.spawned_at = 0.0  # monotonic, the last start
        self.ready_at = 0.0

    async def start(self, crash_at: str | None = None, extra: tuple[str, ...] = ()) -> None:
        assert self.proc is None or self.proc.returncode is not None, "already running"
        await self.http.aclose()  # a fresh pool: no connection to a dead process is reused
        self.http = httpx.AsyncClient(base_url=self.base, timeout=10)
        log = self.tmp / f"server-{len(self.logs) + 1}.log"
        self.logs.append(log)
        args = ["--port", str(self.port), "--db", str(self.db),
                "--heartbeat-interval", "0.2", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                "--reconnect-grace", str(HEARTBEAT_TIMEOUT),
                "--log-level", "info"]
        if crash_at is not None:
            args += ["--crash-at", crash_at]
        args += extra
        self.spawned_at = time.monotonic()
        self.proc = await spawn_serve(self.http, args, log)
        self.ready_at = time.monotonic()

    async def restart_here(self) -> None:
        """Restart on the same store and port as a server in this process, with the same
        timings (its log goes to the test's, caplog)."""
        assert self.proc is not None and self.proc.returncode is not None, "still running"
        await self.http.aclose()
        self.spawned_at = time.monotonic()
        self.live = await start_server(self.tmp, port=self.port, heartbeat_interval=0.2,
                                       heartbeat_timeout=HEARTBEAT_TIMEOUT,
                                       reconnect_grace=HEARTBEAT_TIMEOUT)
        self.http = self.live.http
        self.ready_at = time.monotonic()

    async def exited(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def kill(self) -> None:
        """kill -9."""
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    async def stop(self) -> int:
        """SIGTERM: a graceful stop."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), 15)

    async def close(self) -> None:
        if self.live is not None:
            live, self.live = self.live, None
            await stop_server(live)  # raises if the server failed
        await self.http.aclose()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    def log(self, index: int = -1) -> str:
        return self.logs[index].read_text()

    # -- the HTTP API (push, enqueue, job, wait_state come from conftest.Api) ----------
    async def workers(self) -> list[dict[str, Any]]:
        return (await self.http.get("/workers")).json()["workers"]

    async def worker_id_of(self, pid: int) -> str:
        """The id the worker process ``pid`` registered under, once it is connected."""
        async def find() -> str | None:
            return next((w["id"] for w in await self.workers() if w["pid"] == pid), None)

        return await wait_until(find, timeout=15, what=f"worker pid {pid} to connect",
                                step=COSTLY_POLL)


class WorkerProcesses:
    """``rota worker`` subprocesses running WORKER_MODULE, cwd = the test's tmp dir."""

    MODULE, PREFIX = WORKER_MODULE, "crash_worker"  # (another test's workers: its own)

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[asyncio.subprocess.Process] = []
        self.logs: list[Path] = []

    async def start(self, url: str, *, concurrency: int) -> asyncio.subprocess.Process:
        module = f"{self.PREFIX}_{concurrency}"
        (self.tmp / f"{module}.py").write_text(
            self.MODULE.replace("CONCURRENCY", str(concurrency)))
        log = self.tmp / f"worker-{len(self.procs) + 1}.log"
        self.logs.append(log)
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rota", "worker", f"{module}:worker", "--url", url,
                "--log-level", "info", cwd=self.tmp, env=clean_env(), stdout=sink, stderr=sink)
        self.procs.append(proc)
        return proc

    def log_text(self) -> str:
        return "".join(log.read_text() for log in self.logs)

    async def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()  # also ends a SIGSTOPped process
                await proc.wait()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[ServerProcess]:
    proc = ServerProcess(tmp_path)
    try:
        yield proc
    finally:
        await proc.close()


@pytest.fixture
async def worker_procs(tmp_path: Path) -> AsyncIterator[WorkerProcesses]:
    procs = WorkerProcesses(tmp_path)
    try:
        yield procs
    finally:
        await procs.close()


# -- 1. each --crash-at point, then a restart on the same db -----------------------------
async def crash_before_enqueue_commit(server: ServerProcess, echo: JobSpec) -> None:
    body = {"spec": "echo", "args": {"n": 1}, "id": "job-1"}
    with pytest.raises(httpx.TransportError):
        await server.http.post("/jobs", json=body)
    assert await server.exited() == CRASH_EXIT

    await server.restart_here()
    assert (await server.http.get("/jobs/job-1")).status_code == 404
    assert read_jobs(server.db) == {}  # nothing of the half-done transaction is left
    again = await server.http.post("/jobs", json=body)
    assert again.status_code == 201, again.text
    assert again.json()["created"] is True and again.json()["job"]["state"] == "available"


async def crash_after_enqueue_commit(server: ServerProcess, echo: JobSpec) -> None:
    body = {"spec": "echo", "args": {"n": 1}, "id": "job-1"}
    with pytest.raises(httpx.TransportError):  # the client never heard it was stored
        await server.http.post("/jobs", json=body)
    assert await server.exited() == CRASH_EXIT

    await server.restart_here()
    stored = await server.job("job-1")
    assert (stored["state"], stored["attempt"], stored["args"]) == ("available", 0, {"n": 1})
    retry = await server.http.post("/jobs", json=body)  # the client retries by id
    assert retry.status_code == 200, retry.text
    assert retry.json()["created"] is False
    assert retry.json()["job"]["id"] == "job-1" and retry.json()["job"]["state"] == "available"
    conflict = await server.http.post("/jobs", json={**body, "args": {"n": 2}})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "id_conflict"
    assert list(read_jobs(server.db)) == ["job-1"]


async def crash_after_reserve_commit(server: ServerProcess, echo: JobSpec) -> None:
    w1 = await RawWorker.open(server.ws, "w1")
    try:
        await w1.register([echo], capacity=1)
        try:
            reply = await server.http.post("/jobs", json={"spec": "echo", "args": {"n": 1},
                                                          "id": "job-1"})
            assert reply.status_code == 201, reply.text
        except httpx.TransportError:
            pass  # the crash may beat the reply out; the enqueue committed before either
        with pytest.raises(websockets.ConnectionClosed):  # the server dies; no assign comes
            await w1.expect("assign", timeout=10)
    finally:
        await w1.ws.close()
    assert await server.exited() == CRASH_EXIT

    await server.restart_here()
    held = await server.job("job-1")  # kept for w1 to reclaim, for heartbeat_timeout
    assert (held["state"], held["worker_id"], held["attempt"], held["errors"]) == (
        "active", "w1", 1, [])

    async def recovered() -> float | None:
        return time.monotonic() if (await server.job("job-1"))["state"] != "active" else None

    seen_at = await wait_until(recovered, timeout=HEARTBEAT_TIMEOUT + 3, what="recovery")
    job = await server.job("job-1")
    assert (job["state"], job["attempt"], job["worker_id"]) == ("available", 1, None)
    [death] = job["errors"]
    assert (death["type"], death["attempt"], death["worker_id"]) == ("worker_death", 1, "w1")
    # Not before the grace (it starts after the spawn), and not much after it.
    assert seen_at - server.spawned_at >= HEARTBEAT_TIMEOUT
    assert seen_at - server.ready_at <= HEARTBEAT_TIMEOUT + 1.0
    print(f"\n[reserve-after-commit] orphan recovered {seen_at - server.ready_at:.2f}s after"
          f" the restarted server answered (heartbeat_timeout {HEARTBEAT_TIMEOUT}s)")

    w2 = await RawWorker.open(server.ws, "w2")
    try:
        await w2.register([echo], capacity=1)
        [copy] = await w2.jobs(1)
        assert (copy["id"], copy["attempt"]) == ("job-1", 2)
        assert (await w2.complete(copy, {"ok": True}))["accepted"] == ["job-1"]
    finally:
        await w2.ws.close()
    done = await server.job("job-1")
    assert (done["state"], done["attempt"], done["result"]) == ("completed", 2, {"ok": True})
    assert done["errors"] == [death]


async def crash_after_result_commit(server: ServerProcess, echo: JobSpec) -> None:
    result = {"answer": 42}
    w1 = await RawWorker.open(server.ws, "w1")
    try:
        await w1.register([echo], capacity=1)
        reply = await server.http.post("/jobs", json={"spec": "echo", "args": {}, "id": "job-1"})
        assert reply.status_code == 201, reply.text
        [copy] = await w1.jobs(1)
        await w1.beat(results=[completed(copy, result)], capacity=0)
        with pytest.raises(websockets.ConnectionClosed):  # committed, then dead: no ack
            await w1.expect("ack", timeout=10)
    finally:
        await w1.ws.close()
    assert await server.exited() == CRASH_EXIT

    await server.restart_here()
    done = await server.job("job-1")
    assert (done["state"], done["attempt"], done["result"], done["errors"]) == (
        "completed", 1, result, [])
    stored = read_jobs(server.db)["job-1"]

    # w1 comes back under its id and sends the unacked result again, as the SDK does.
    again = await RawWorker.open(server.ws, "w1")
    try:
        ack = await register_with(again, [echo], status={"state": "running", "active_job_ids": []},
                                  results=[completed(copy, {"answer": "again"})], capacity=0)
    finally:
        await again.ws.close()
    assert "accepted" not in ack
    assert ack["rejected"] == [{"job_id": "job-1", "attempt": 1,
                                "reason": "unknown job, or it already finished"}]
    assert await server.job("job-1") == done
    assert read_jobs(server.db)["job-1"] == stored  # stored once, untouched


CRASH_POINTS = {
    "enqueue-before-commit": crash_before_enqueue_commit,
    "enqueue-after-commit": crash_after_enqueue_commit,
    "reserve-after-commit": crash_after_reserve_commit,
    "result-after-commit": crash_after_result_commit,
}


@BOTH
@pytest.mark.parametrize("point", list(CRASH_POINTS))
async def test_crash_point_then_restart(server: ServerProcess, tmp_path: Path, point: str,
                                        caplog: pytest.LogCaptureFixture):
    echo = write_spec(tmp_path / "specs", "echo")
    await server.start(crash_at=point)
    await server.push(echo)
    await CRASH_POINTS[point](server, echo)
    assert f"crash point {point}: exiting now" in server.log(0)
    await server.close()  # the restarted server stops cleanly
    assert any(r.name == "rota.server" for r in caplog.records)  # its log is read here
    assert not [r.getMessage() for r in caplog.records if r.exc_info], "a traceback"


# -- 2. kill -9 the server under load ---------------------------------------------------
TOTAL = 300
BATCH = 50


# On PostgreSQL once, with a worker killed too: what the server alone checks it checks.
@pytest.mark.parametrize(("backend", "with_worker"), [
    ("sqlite", False), pytest.param("sqlite", True, marks=pytest.mark.soak), ("postgres", True)],
    ids=["sqlite-server", "sqlite-server+worker", "postgres-server+worker"], indirect=["backend"])
async def test_kill_9_server_under_load_loses_no_job(server: ServerProcess,
                                                     worker_procs: WorkerProcesses,
                                                     tmp_path: Path, with_worker: bool,
                                                     caplog: pytest.LogCaptureFixture):
    """kill -9 the server (and, in the second case, one of the two workers with it, as when
    a machine dies) while jobs are queued, running and completing; restart it; every job
    must complete once, with a worker_death record for each attempt the crash cost."""
    echo = write_spec(tmp_path / "specs", "echo")
    await server.start()
    await server.push(echo)
    procs = [await worker_procs.start(server.base, concurrency=8) for _ in range(2)]
    ids_by_pid = {proc.pid: await server.worker_id_of(proc.pid) for proc in procs}

    jobs = {f"job-{n:03d}": {"n": n} for n in range(TOTAL)}
    ids = list(jobs)
    for start in range(0, TOTAL, BATCH):  # enqueued while the workers run
        body = {"jobs": [{"spec": "echo", "args": jobs[i], "id": i}
                         for i in ids[start:start + BATCH]]}
        reply = await server.http.post("/jobs/batch", json=body)
        assert reply.status_code == 200, reply.text
        assert {item["status"] for item in reply.json()["results"]} == {201}
    await wait_until(lambda: count_states(server.db)["completed"] >= TOTAL // 3, timeout=20,
                     what="a third of the jobs to complete", step=COSTLY_POLL)
    await server.kill()
    killed_at = time.monotonic()
    dead_id = None
    if with_worker:
        procs[0].kill()
        await procs[0].wait()
        dead_id = ids_by_pid[procs[0].pid]
    survivors = procs[1:] if with_worker else procs
    at_kill = read_jobs(server.db)  # what was committed when the server died
    states = Counter(row["state"] for row in at_kill.values())
    # Running and completing at the kill. (Queued too, most often; but where commits are
    # slower, as on PostgreSQL on a busy machine, the workers' prefetch may have reserved
    # every job already: the kill then hits no waiting job, and the test still holds.)
    assert states["active"] > 0 and states["completed"] < TOTAL
    orphans_of_dead = {i for i, row in at_kill.items()
                       if row["state"] == "active" and row["worker_id"] == dead_id}
    assert orphans_of_dead or not with_worker

    caplog.set_level(logging.INFO, logger="rota")  # the reclaims, counted below
    await server.restart_here()  # same db, same port; the workers reconnect by themselves
    await wait_until(lambda: sum(n for s, n in count_states(server.db).items() if s in TERMINAL)
                     == TOTAL, timeout=30, what="every job to be terminal", step=COSTLY_POLL)
    done_at = time.monotonic()

    rows = read_jobs(server.db)
    assert sorted(rows) == sorted(jobs)  # none lost, none made up
    assert Counter(row["state"] for row in rows.values()) == {"completed": TOTAL}
    for job_id, row in rows.items():
        assert json.loads(row["result"]) == jobs[job_id], job_id
        assert row["attempt"] >= 1 and row["worker_id"] in ids_by_pid.values(), job_id
        errors = json.loads(row["errors"])
        # every attempt but the last ended with the crash (one worker_death record each),
        # or was taken back unstarted from a busy worker's line for an idle one (released)
        assert [e["attempt"] for e in errors] == list(range(1, row["attempt"])), (job_id, errors)
        assert {e["type"] for e in errors} <= {"worker_death", "released"}, (job_id, errors)
    for job_id in orphans_of_dead:  # nobody came back for them: rerun by the survivor
        row = rows[job_id]
        assert row["attempt"] == at_kill[job_id]["attempt"] + 1, job_id
        assert json.loads(row["errors"])[-1]["worker_id"] == dead_id, job_id
    queues = (await server.http.get("/queues")).json()["queues"]
    assert [(q["name"], q["counts"]["completed"], q["counts"]["active"]) for q in queues] == [
        ("default", TOTAL, 0)]
    assert (await server.http.get("/healthz")).json()["live_jobs"] == 0

    restart_log = caplog.text
    assert not [r.getMessage() for r in caplog.records if r.exc_info], "a traceback"
    assert "Traceback" not in worker_procs.log_text()
    reran = sum(1 for row in rows.values() if row["attempt"] > 1)
    deaths = sum(len(json.loads(row["errors"])) for row in rows.values())
    reclaimed = restart_log.count(" reclaim job=")
    print(f"\n[kill -9 {'server and 1 of 2 workers' if with_worker else 'server'}] {TOTAL} jobs,"
          f" 2 worker processes x 8 slots. At the kill: completed={states['completed']}"
          f" in_flight(active)={states['active']} queued(available)={states['available']}"
          f" (of the dead worker: {len(orphans_of_dead)})."
          f" After the restart: reclaimed_by_reconnecting_workers={reclaimed}"
          f" ran_twice(attempt>1)={reran} worker_death_errors={deaths}"
          f" stale_results_rejected={worker_procs.log_text().count('result rejected')}."
          f" Recovery: restart->all terminal {done_at - server.spawned_at:.2f}s"
          f" (server ready->all terminal {done_at - server.ready_at:.2f}s,"
          f" kill->all terminal {done_at - killed_at:.2f}s)")

    for proc in survivors:  # they came through the crash and still stop cleanly
        assert proc.returncode is None
        proc.send_signal(signal.SIGTERM)
    assert [await asyncio.wait_for(proc.wait(), 15) for proc in survivors] == [0] * len(survivors)
    await server.close()  # the restarted server stops cleanly


# -- 3. a worker process killed or frozen mid-job --------------------------------------
@pytest.mark.parametrize("how", ["kill-9", "sigstop"])
async def test_worker_lost_mid_job_hands_it_over(server: ServerProcess,
                                                 worker_procs: WorkerProcesses,
                                                 tmp_path: Path, how: str):
    specs = tmp_path / "specs"
    echo = write_spec(specs, "echo")
    await server.start()
    await server.push(echo)
    victim = await worker_procs.start(server.base, concurrency=1)
    victim_id = await server.worker_id_of(victim.pid)
    reply = await server.http.post("/jobs", json={"spec": "echo", "args": {"hold": 5},
                                                  "id": "slow"})
    assert reply.status_code == 201, reply.text
    await wait_until(lambda: (tmp_path / "started-slow-1").exists(), timeout=10,
                     what="the victim to start the job")

    starts: list[tuple[float, int]] = []  # (monotonic, attempt) as the rescuer starts a job
    rescuer = Worker(url=server.ws, specs_dir=specs, concurrency=1, heartbeat_interval=0.2)

    @rescuer.handler("echo")
    async def run_at_once(ctx: JobContext) -> Any:
        starts.append((time.monotonic(), ctx.attempt))
        return ctx.args

    task = asyncio.create_task(rescuer.run(), name="rescuer")
    try:
        await wait_until(lambda: rescuer.connected.is_set() or task.done(), what="rescuer connect")
        assert not task.done()
        lost_at = time.monotonic()
        if how == "kill-9":
            victim.kill()
        else:  # frozen: its socket stays open, only the heartbeats stop
            victim.send_signal(signal.SIGSTOP)
        await wait_until(lambda: starts, timeout=HEARTBEAT_TIMEOUT + 5, what="the handover")
        latency = starts[0][0] - lost_at
        assert starts[0][1] == 2
        assert latency <= HEARTBEAT_TIMEOUT + 1.0
        if how == "sigstop":  # noticed through the heartbeat timeout, not earlier
            assert latency >= HEARTBEAT_TIMEOUT / 2
        done = await server.wait_state("slow", "completed")
    finally:
        rescuer.stop()
        await asyncio.wait_for(task, 10)
    assert (done["attempt"], done["worker_id"], done["result"]) == (2, rescuer.worker_id,
                                                                    {"hold": 5})
    [death] = done["errors"]
    assert (death["type"], death["attempt"], death["worker_id"]) == ("worker_death", 1, victim_id)
    # kill -9 looks like a lost connection: held for the reconnect grace, then recovered
    assert ("heartbeat_timeout" if how == "sigstop" else "did not reconnect") in death["message"]
    print(f"\n[worker {how}] job reassigned to another worker {latency * 1000:.0f} ms after"
          f" the worker was lost (heartbeat_timeout {HEARTBEAT_TIMEOUT}s)")


# -- 4. a late result from a worker whose job was taken back ------------------------------
async def test_result_after_recovery_and_reassignment_is_rejected(tmp_path: Path):
    live = await start_server(tmp_path, heartbeat_timeout=0.5)
    connect = RawWorkers(live.ws)
    try:
        echo = write_spec(tmp_path / "specs", "echo")
        await live.push(echo)
        w1 = await connect("w1")
        await w1.register([echo], capacity=1)
        await live.enqueue("echo", {"n": 1}, id="contested")
        [first] = await w1.jobs(1)
        assert first["attempt"] == 1
        # w1 stalls: no heartbeat. The server drops it and takes the job back.
        assert (await w1.expect("error", timeout=3))["code"] == "heartbeat_timeout"
        recovered = await live.wait_state("contested", "available", timeout=3)
        [death] = recovered["errors"]
        assert (death["type"], death["attempt"], death["worker_id"]) == ("worker_death", 1, "w1")

        w2 = await connect("w2")
        await w2.register([echo], capacity=1)
        [second] = await w2.jobs(1)
        assert (second["id"], second["attempt"]) == ("contested", 2)

        # w1 comes back under the same id, with the result of attempt 1.
        w1_again = await connect("w1")
        ack = await register_with(w1_again, [echo],
                                  status={"state": "running", "active_job_ids": ["contested"]},
                                  results=[completed(first, {"by": "w1"})], capacity=0)
        assert "accepted" not in ack
        assert ack["rejected"] == [{"job_id": "contested", "attempt": 1,
                                    "reason": "job is not reserved by this worker"}]
        running = await live.job("contested")
        assert (running["state"], running["worker_id"], running["attempt"]) == ("active", "w2", 2)

        assert (await w2.complete(second, {"by": "w2"}))["accepted"] == ["contested"]
        # And once more after the job finished.
        await w1_again.beat(results=[completed(first, {"by": "w1"})])
        ack = await w1_again.expect("ack")
        assert ack["rejected"] == [{"job_id": "contested", "attempt": 1,
                                    "reason": "unknown job, or it already finished"}]
        final = await live.job("contested")
        assert (final["state"], final["attempt"], final["worker_id"], final["result"]) == (
            "completed", 2, "w2", {"by": "w2"})
        assert final["errors"] == [death]
    finally:
        await connect.close()
        await stop_server(live)


# -- 5. found while writing these (fixed): an orphan listed after the registration -------
async def test_orphan_listed_after_registration_is_reclaimed_or_recovered(server: ServerProcess,
                                                                          tmp_path: Path):
    echo = write_spec(tmp_path / "specs", "echo")
    await server.start()
    await server.push(echo)
    w1 = await RawWorker.open(server.ws, "w1")
    try:
        await w1.register([echo], capacity=1)
        reply = await server.http.post("/jobs", json={"spec": "echo", "args": {}, "id": "orphan"})
        assert reply.status_code == 201, reply.text
        [copy] = await w1.jobs(1)
        await server.kill()
    finally:
        await w1.ws.close()

    await server.restart_here()
    w1 = await RawWorker.open(server.ws, "w1")
    try:
        # Status is optional in the registration heartbeat (protocol.md 3.1); this worker
        # reports its running job in the heartbeats that follow, as a live worker does.
        await register_with(w1, [echo], capacity=0)
        beat_until = time.monotonic() + HEARTBEAT_TIMEOUT + 1.0
        while time.monotonic() < beat_until:
            await w1.beat(status={"state": "running", "active_job_ids": ["orphan"]})
            await w1.expect("ack")
            await asyncio.sleep(0.2)  # noqa: sleep-ok (the worker's heartbeat cadence)
        ack = await w1.complete(copy, {"done": True})
        job = await server.job("orphan")  # before w1 leaves: its leaving recovers the job
    finally:
        await w1.ws.close()
    if ack.get("accepted") == ["orphan"]:  # reclaimed by listing it
        assert (job["state"], job["attempt"], job["result"]) == ("completed", 1, {"done": True})
    else:  # or recovered when the grace ran out, like a job whose worker never came back
        assert job["state"] == "available", job
        assert [(e["type"], e["attempt"]) for e in job["errors"]] == [("worker_death", 1)]
