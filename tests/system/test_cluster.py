"""Several Rota servers on one PostgreSQL (docs/scaling.md), each a real uvicorn server
(in-process, or a `rota serve` subprocess where one must die by kill -9), with real SDK
workers: every job is assigned once, an enqueue on one server reaches a worker on
another, a push through one gates the others' workers, and a dead server's reservations
come back after its lease and the reconnect grace."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from conftest import Live, start_server, stop_server, write_spec
from helpers import (COSTLY_POLL, RawWorker, completed, end, free_port, registration,
                     spawn_serve, wait_until)

from rota import JobContext, Worker

LEASE = {"server_lease": 1.0, "reconnect_grace": 1.0}


@contextlib.asynccontextmanager
async def servers(tmp: Path, url: str, n: int, **options: Any) -> AsyncIterator[list[Live]]:
    started: list[Live] = []
    try:
        for i in range(n):
            started.append(await start_server(tmp / f"s{i}", database_url=url,
                                              server_id=f"s{i}", **options))
        yield started
    finally:
        for live in started:
            await stop_server(live)


class Runs:
    """What the workers' handlers ran: (job id, attempt, worker) per run."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int, str]] = []

    def per_job(self) -> collections.Counter[str]:
        return collections.Counter(job for job, _, _ in self.runs)

    def worker(self, specs: Path, urls: str | list[str], name: str, *, seconds: float = 0.0,
               **options: Any) -> Worker:
        worker = Worker(url=urls, specs_dir=specs, heartbeat_interval=0.1, worker_id=name,
                        **options)

        @worker.handler("echo")
        async def echo(ctx: JobContext) -> str:
            self.runs.append((ctx.id, ctx.attempt, name))
            if seconds:
                await asyncio.sleep(seconds)  # noqa: sleep-ok (the job's own work)
            return name

        return worker


@contextlib.asynccontextmanager
async def running(*workers: Worker) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(w.run(), name=f"sdk-{w.worker_id}") for w in workers]
    try:
        for worker, task in zip(workers, tasks, strict=True):
            await wait_until(lambda: worker.connected.is_set() or task.done(),
                             what=f"{worker.worker_id} to connect")
            if task.done():
                task.result()
        yield
    finally:
        for worker in workers:
            worker.stop()
        await asyncio.gather(*(asyncio.wait_for(t, 10) for t in tasks), return_exceptions=True)


async def all_in(live: Live, ids: list[str], timeout: float = 20.0) -> None:
    """Until every one of ``ids`` is completed (the test's database holds no other jobs)."""
    async def done() -> bool:
        return await _completed(live.http) >= len(ids)

    await wait_until(done, timeout=timeout, what=f"{len(ids)} jobs completed",
                     step=COSTLY_POLL)


async def test_two_servers_and_a_worker_on_each_assign_every_job_once(tmp_path: Path,
                                                                       pg_url: str):
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    runs = Runs()
    async with servers(tmp_path, pg_url, 2) as (a, b):
        await a.push(spec)
        async with running(runs.worker(specs, a.ws, "wa", concurrency=4),
                           runs.worker(specs, b.ws, "wb", concurrency=4)):
            ids = []
            for n in range(100):
                via = a if n % 2 else b
                ids.append((await via.enqueue("echo", {"n": n}))["id"])
            await all_in(a, ids)
        assert set(runs.per_job()) == set(ids)
        assert max(runs.per_job().values()) == 1, "a job ran twice"
        assert {w for _, _, w in runs.runs} == {"wa", "wb"}


async def test_an_enqueue_through_another_server_right_after_a_push_finds_the_spec(
        tmp_path: Path, pg_url: str):
    """A deploy pushes through A and producers enqueue through B at once: B reads the
    status quo when it does not know the spec yet, instead of waiting for the notice."""
    spec = write_spec(tmp_path / "specs", "echo")
    async with servers(tmp_path, pg_url, 2) as (a, b):
        cluster = b.server.config.loaded_app.app.state.cluster  # type: ignore[union-attr]
        cluster._ready = False  # B hears no spec notice: as if it had not come yet
        await a.push(spec)
        job = await b.enqueue("echo", {"n": 1})
        assert job["spec"] == "echo"
        refused = await b.http.post("/jobs", json={"spec": "ecko"})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["code"] == "unknown_spec" and "echo" in refused.text


async def test_an_enqueue_on_one_server_reaches_an_idle_worker_on_another(tmp_path: Path,
                                                                           pg_url: str):
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    runs = Runs()
    async with servers(tmp_path, pg_url, 2) as (a, b):
        await a.push(spec)
        async with running(runs.worker(specs, b.ws, "wb")):
            for n in range(20):  # one at a time: each must reach the idle worker on B
                job = await a.enqueue("echo", {"n": n})
                done = await a.wait_state(job["id"], "completed", timeout=5)
                assert done["result"] == "wb"
            # Delayed and retried jobs reach it too (held whole, not as keys).
            later = await a.enqueue("echo", delay=0.3)
            assert (await a.wait_state(later["id"], "completed"))["result"] == "wb"


async def test_a_spec_push_through_one_server_gates_a_worker_on_another(tmp_path: Path,
                                                                        pg_url: str):
    specs = tmp_path / "specs"
    v1 = write_spec(specs, "echo", version="1")
    runs = Runs()
    async with servers(tmp_path, pg_url, 2) as (a, b):
        await a.push(v1)
        async with running(runs.worker(specs, b.ws, "wb")):
            job = await a.enqueue("echo")
            await a.wait_state(job["id"], "completed")
            v2 = write_spec(tmp_path / "v2", "echo", version="2")
            await a.push(v2)  # through A; the worker on B still runs version 1

            async def b_knows() -> bool:
                return b.coordinator.scheduler.status_quo.get("echo") == \
                    a.coordinator.scheduler.status_quo["echo"]

            await wait_until(b_knows, what="B to hear of the push through A")
            gated = await b.enqueue("echo")
            reason = await wait_until(
                lambda: _reason(b, gated["id"]), what="a waiting reason on B")
            assert "checksum" in reason or "match" in reason, reason
            assert (await b.job(gated["id"]))["state"] == "available"
        assert [j for j, _, _ in runs.runs] == [job["id"]]


async def test_a_limit_set_through_one_server_holds_on_another(tmp_path: Path, pg_url: str):
    """As a pause does: a limit set or cleared through A (and a spec file's, pushed
    through A) is in force on B once B hears the notice."""
    from rota.core.limits import LimitRule, Rate

    spec = write_spec(tmp_path / "specs", "echo", extra="[limits]\nconcurrency = 4\n")
    async with servers(tmp_path, pg_url, 2) as (a, b):
        await a.push(spec)
        held = [LimitRule(concurrency=4)]

        async def b_holds() -> bool:
            return b.coordinator.limiting.in_force == {("spec", "echo"): held[0]}

        await wait_until(b_holds, what="B to hold the pushed spec file's limit")
        put = await a.http.put("/limits/spec/echo", json={"key_concurrency": 2,
                                                          "rate": "5/s"})
        assert put.status_code == 200, put.text
        held[0] = LimitRule(key_concurrency=2, rate=Rate(5, 1.0))
        await wait_until(b_holds, what="B to hold the limit set through A")
        assert (await b.http.get("/limits")).json()["limits"][0]["source"] == "runtime"
        assert (await b.http.delete("/limits/spec/echo")).status_code == 200
        held[0] = LimitRule(concurrency=4)

        async def a_holds() -> bool:
            return a.coordinator.limiting.in_force == {("spec", "echo"): held[0]}

        await wait_until(a_holds, what="A to hear of the clear through B")


async def _reason(live: Live, job_id: str) -> str | None:
    return (await live.job(job_id)).get("waiting_reason")


async def test_fifty_concurrent_enqueues_of_one_id_over_two_servers_give_one_job(
        tmp_path: Path, pg_url: str):
    async with servers(tmp_path, pg_url, 2) as (a, b):
        await a.push(write_spec(tmp_path / "specs", "echo"))
        body = {"spec": "echo", "id": "order-17", "args": {"n": 1}}
        answers = await asyncio.gather(*(
            (a if n % 2 else b).http.post("/jobs", json=body) for n in range(50)))
        assert sorted({r.status_code for r in answers}) in ([200, 201], [201])
        assert sum(r.status_code == 201 for r in answers) == 1  # created once, found 49 times
        assert {r.json()["job"]["id"] for r in answers} == {"order-17"}
        listed = (await b.http.get("/jobs", params={"q": "order-17"})).json()["jobs"]
        assert [j["id"] for j in listed] == ["order-17"]


@contextlib.asynccontextmanager
async def worker_on_b(tmp: Path, url: str, **options: Any
                      ) -> AsyncIterator[tuple[Live, Live, RawWorker]]:
    """Two servers, the spec pushed through A, and a raw worker registered on B."""
    spec = write_spec(tmp / "specs", "echo")
    async with servers(tmp, url, 2, **options) as (a, b):
        await a.push(spec)
        # B hears of the push by a notice: its worker must find the status quo there.
        await wait_until(lambda: "echo" in b.coordinator.scheduler.status_quo,
                         what="B to hear of the push through A")
        worker = await RawWorker.open(b.ws, "wb")
        await worker.register([spec])
        try:
            yield a, b, worker
        finally:
            await worker.ws.close()


async def test_a_cancel_through_one_server_reaches_the_worker_on_another(tmp_path: Path,
                                                                         pg_url: str):
    async with worker_on_b(tmp_path, pg_url) as (a, _, worker):
        job = await a.enqueue("echo")
        [copy] = await worker.jobs(1)
        assert copy["id"] == job["id"]
        response = await a.http.delete(f"/jobs/{job['id']}")
        assert response.status_code in (200, 202), response.text
        cancel = await worker.expect("cancel")
        assert cancel["job_ids"] == [job["id"]]


async def test_a_server_that_could_not_hear_the_others_catches_up_when_it_listens_again(
        tmp_path: Path, pg_url: str, caplog: pytest.LogCaptureFixture):
    """B's LISTEN connection is down while A enqueues a job, cancels one that B's worker
    runs, and pushes a new version of the spec: those notices are lost. When B listens
    again it reads what they would have said: its worker gets the new job and the
    cancel, and B's status quo is A's. A job B holds already (waiting in a queue no
    worker takes) is not taken in a second time."""
    caplog.set_level(logging.INFO, logger="rota.server")
    # The raw worker sends no heartbeats: a timeout it cannot reach on a loaded machine.
    async with worker_on_b(tmp_path, pg_url, heartbeat_timeout=30.0) as (a, b, worker):
        listener = b.server.config.loaded_app.app.state.cluster.listener  # type: ignore[union-attr]
        await b.enqueue("echo", queue="nobody")  # held by B as a key only
        live = b.coordinator.scheduler.live()
        running_job = await a.enqueue("echo")
        [copy] = await worker.jobs(1)
        assert copy["id"] == running_job["id"]
        await listener.stop()  # deaf from here on
        response = await a.http.delete(f"/jobs/{running_job['id']}")
        assert response.status_code in (200, 202), response.text
        missed = await a.enqueue("echo")
        assert missed["id"] not in b.coordinator.scheduler.jobs
        listener.start()
        cancel = await worker.expect("cancel")
        assert cancel["job_ids"] == [running_job["id"]]
        [late] = await worker.jobs(1)
        assert late["id"] == missed["id"]
        assert "caught up: 1 waiting job(s) taken in, 1 cancel(s) passed on" in caplog.text
        assert b.coordinator.scheduler.live() == live + 2  # the running job and the late one

        await listener.stop()
        await a.push(write_spec(tmp_path / "v2", "echo", version="2"))
        assert b.coordinator.scheduler.status_quo != a.coordinator.scheduler.status_quo
        listener.start()
        await wait_until(lambda: b.coordinator.scheduler.status_quo
                         == a.coordinator.scheduler.status_quo,
                         what="B to read the status quo pushed while it could not hear")


async def test_a_listening_connection_killed_by_postgresql_comes_back_and_catches_up(
        tmp_path: Path, pg_url: str, caplog: pytest.LogCaptureFixture):
    """PostgreSQL itself ends the servers' LISTEN connections (pg_terminate_backend, as
    an operator or a failover would): each server says so, connects again, and reads
    what it may have missed."""
    caplog.set_level(logging.INFO, logger="rota.server")
    async with servers(tmp_path, pg_url, 2) as (a, _):
        await a.push(write_spec(tmp_path / "specs", "echo"))
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            cursor = await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE"
                " datname = current_database() AND query LIKE 'LISTEN %'")
            assert len(await cursor.fetchall()) == 2  # one per server

        def caught_up() -> bool:
            return caplog.text.count("cluster: caught up:") == 2

        await wait_until(caught_up, timeout=15, what="both servers to listen again")
        assert caplog.text.count("LISTEN connection lost") == 2


async def test_a_server_whose_lease_lapsed_takes_back_what_nobody_gave_out_again(
        tmp_path: Path, pg_url: str):
    """Server A stalls past its lease (here: its lease is ended in the database) and B
    recovers the two jobs A's worker runs; B's worker gets one of them at attempt 2, and
    A (not knowing yet) gives its worker a third. When A renews, it holds a new lease,
    takes back the second, keeps the third (both runs go on, and their results are
    taken), and tells its worker to drop the one given out again."""
    spec = write_spec(tmp_path / "specs", "echo")
    quiet = {"database_url": pg_url, "heartbeat_timeout": 30.0}  # raw workers send no beats
    a = await start_server(tmp_path / "a", server_id="A", server_lease=30.0, **quiet)
    b = await start_server(tmp_path / "b", server_id="B", server_lease=1.0, **quiet)
    try:
        await a.push(spec)
        wa = await RawWorker.open(a.ws, "wa")
        await wa.register([spec], concurrency=3)
        jobs = [await a.enqueue("echo") for _ in range(2)]
        assert sorted(c["id"] for c in await wa.jobs(2)) == sorted(j["id"] for j in jobs)
        wb = await RawWorker.open(b.ws, "wb")
        await wb.register([spec], concurrency=1)
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin:
            await admin.execute("UPDATE servers SET lease_expires_at = 0 WHERE id = 'A'")
        [again] = await wb.jobs(1, timeout=10)  # B recovered both and gave out one
        assert again["attempt"] == 2
        [other] = [j["id"] for j in jobs if j["id"] != again["id"]]
        third = await a.enqueue("echo")  # reserved by A after the recovery: its own
        [copy] = await wa.jobs(1)
        assert copy["id"] == third["id"]

        await a.server.config.loaded_app.app.state.cluster.renew()  # type: ignore[union-attr]
        cancel = await wa.expect("cancel")
        assert cancel == {"type": "cancel", "job_ids": [again["id"]],
                          "reason": "reservation_lost"}
        for kept in (other, third["id"]):
            row = await a.job(kept)
            assert (row["state"], row["attempt"], row["worker_id"]) == ("active", 1, "wa")
        await wa.beat(results=[completed({"id": other, "attempt": 1}, "done"),
                               completed({"id": third["id"], "attempt": 1}, "done")])
        await a.wait_state(other, "completed")
        await a.wait_state(third["id"], "completed")
        await wb.ws.close()
        await wa.ws.close()
    finally:
        await stop_server(a)
        await stop_server(b)


async def test_a_killed_servers_jobs_come_back_after_its_lease_and_the_grace(
        tmp_path: Path, pg_url: str):
    """Server A (a subprocess) dies by kill -9 while its worker holds a job; B sees A's
    lease lapse, recovers the job after the grace, and its own worker runs attempt 2.
    The first run's worker comes back to B with a result: the attempt fence turns it
    away, as on one server."""
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    port = free_port()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        proc = await spawn_serve(http, ["--db", pg_url, "--port", str(port), "--server-id", "A",
                                        "--server-lease", "1", "--reconnect-grace", "1",
                                        "--heartbeat-interval", "0.2",
                                        "--heartbeat-timeout", "2"], tmp_path / "a.log")
        try:
            async with servers(tmp_path, pg_url, 1, **LEASE) as (b,):
                await b.push(spec)
                held = await RawWorker.open(f"ws://127.0.0.1:{port}/work", "wa")
                await held.register([spec])
                job = await b.enqueue("echo")  # through B: A's worker is the only one
                [copy] = await held.jobs(1)
                assert copy["id"] == job["id"] and copy["attempt"] == 1
                killed_at = time.monotonic()
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
                back = await b.wait_state(job["id"], "available", timeout=10)
                recovered_after = time.monotonic() - killed_at
                assert back["errors"][-1]["type"] == "server_lost"
                assert recovered_after >= 1.0  # not before the lease and the grace
                late = await RawWorker.open(b.ws, "wb")
                await late.register([spec])
                got = await late.jobs(1)
                print("GOT", got)
                [again] = got
                assert again["id"] == job["id"] and again["attempt"] == 2
                await late.ws.close()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.mark.timeout(120)
# Soak only (-m soak, .ci/run): the default run kills a server with -9 in
# tests/system/test_flow_live.py, test_crash.py and the lease tests below.
@pytest.mark.soak
@pytest.mark.parametrize("total", [300, 5000])
async def test_chaos_three_servers_four_workers_one_killed_and_restarted(
        tmp_path: Path, pg_url: str, total: int):
    """3 servers (subprocesses), 4 SDK workers spread over them, each given every URL,
    300 or 5,000 jobs (both soak runs); one server is killed with -9 mid-run
    and restarted. Every job ends
    completed and none is lost; a job that ran twice is counted, and each is explained:
    its first run was on a worker that lost its server."""
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[asyncio.subprocess.Process] = []
    clients = [httpx.AsyncClient(base_url=u, timeout=30) for u in urls]

    async def serve(i: int, log: str = "") -> asyncio.subprocess.Process:
        return await spawn_serve(clients[i], [
            "--db", pg_url, "--port", str(ports[i]), "--server-id", f"s{i}",
            "--server-lease", "1", "--reconnect-grace", "1", "--heartbeat-interval", "0.2",
            "--heartbeat-timeout", "2"], tmp_path / (log or f"s{i}.log"))

    runs = Runs()
    try:
        for i in range(3):
            procs.append(await serve(i))
        body = {"specs": [{"name": spec.name, "version": spec.version, "queue": spec.queue}]}
        assert (await clients[0].put("/specs", json=body)).status_code == 200
        # Worker k starts at server k % 3 and rotates through the others.
        # Jobs that take a little while, so that the killed server's workers hold some.
        workers = [runs.worker(specs, urls[k % 3:] + urls[:k % 3], f"w{k}", concurrency=8,
                               seconds=0.005) for k in range(4)]
        async with running(*workers):
            ids: list[str] = []
            batch = total // 20
            for start in range(0, total, batch):
                via = clients[(start // batch) % 3]
                response = await via.post("/jobs/batch", json={"jobs": [
                    {"spec": "echo", "args": {"n": n}} for n in range(start, start + batch)]})
                assert response.status_code == 200, response.text
                ids += [r["job"]["id"] for r in response.json()["results"]]
                if start == total // 2:  # mid-run: kill server 1, then bring it back
                    procs[1].send_signal(signal.SIGKILL)
                    await procs[1].wait()
                    procs[1] = await serve(1, "s1-restarted.log")

            async def finished() -> bool:
                return await _completed(clients[0]) >= total

            await wait_until(finished, timeout=90, what=f"{total} jobs completed",
                             step=COSTLY_POLL)
        twice = {job: n for job, n in runs.per_job().items() if n > 1}
        assert set(runs.per_job()) == set(ids), "a job never ran"
        # Each job that ran twice was first given out by a server that lost its lease: the
        # one killed, or one that stalled past its lease and the grace on this busy
        # machine, so that another recovered its workers' jobs (it logs so at ERROR).
        logs = {name: (tmp_path / f"{name}.log").read_text()
                for name in ("s0", "s1", "s2", "s1-restarted")}
        lost = {"s1"} | {name for name, text in logs.items() if "lease had lapsed" in text}
        for job in twice:
            _, attempt, worker = next(run for run in runs.runs if run[0] == job)
            assigned = f"assign job={job} "
            by = [name for name, text in logs.items() if any(
                line.endswith(f"worker={worker} attempt={attempt}")
                for line in text.splitlines() if assigned in line)]
            assert by and set(by) <= lost, (
                f"job {job} ran twice, first on {worker} (attempt {attempt}) through {by};"
                f" servers that lost their lease: {sorted(lost)}")
        recovered = [line for text in logs.values() for line in text.splitlines()
                     if "recovered server=" in line]
        print(f"chaos: {total} jobs, {len(twice)} ran twice (each first given out by a server"
              f" that lost its lease: {sorted(lost)}); recovery: {recovered}")
    finally:
        await end(procs, clients)


async def _completed(http: httpx.AsyncClient) -> int:
    """Jobs completed, as the database counts them (GET /queues)."""
    response = await http.get("/queues")
    assert response.status_code == 200, (response.status_code, response.text)
    return sum(q["counts"].get("completed", 0) for q in response.json()["queues"])


async def test_a_directive_through_one_server_reaches_a_worker_on_another(tmp_path: Path,
                                                                         pg_url: str):
    async with worker_on_b(tmp_path, pg_url) as (a, b, _):
        async def quieted() -> httpx.Response | None:  # once B's record of it is committed
            response = await a.http.post("/workers/wb/state", json={"state": "quiet"})
            return response if response.status_code != 404 else None

        response = await wait_until(quieted, what="A to know wb is connected to a server")
        assert response.status_code == 202, response.text
        assert response.json() == {"workers": ["wb"], "state": "quiet", "forwarded": True}
        await wait_until(lambda: b.coordinator.connections["wb"].directive == "quiet",
                         what="B to quiet its worker")
        every = await a.http.post("/workers/state", json={"state": "terminate", "all": True})
        assert every.json() == {"workers": [], "state": "terminate", "forwarded": True}
        await wait_until(lambda: b.coordinator.connections["wb"].directive == "terminate",
                         what="B to terminate its worker")
        missing = await a.http.post("/workers/nobody/state", json={"state": "quiet"})
        assert missing.status_code == 404


async def labelled(port: int, worker_id: str, label: str, token: str) -> RawWorker:
    """A raw worker with ``label``, registered (serving no spec) on the server at ``port``."""
    worker = await RawWorker.open(f"ws://127.0.0.1:{port}/work", worker_id,
                                  additional_headers={"Authorization": f"Bearer {token}"})
    await worker.beat(registration=registration([], labels=[label]), capacity=1)
    await worker.expect("welcome")
    await worker.expect("ack")
    return worker


async def told(worker: RawWorker) -> str:
    """The state the server asks of ``worker`` in the ack to its next heartbeat."""
    await worker.beat()
    return str((await worker.expect("ack"))["state"])


async def state_on(server: httpx.AsyncClient, worker_id: str, state: str, *,
                   field: str = "state") -> bool:
    """Whether the server's GET /workers shows ``worker_id`` in ``state`` (or, with
    ``field="directive"``, told to go to it)."""
    views = (await server.get("/workers")).json()["workers"]
    return any(w["id"] == worker_id and w[field] == state for w in views)


async def test_the_dashboards_and_the_apis_directive_by_label_reach_both_servers_workers(
        tmp_path: Path, pg_url: str):
    """Issue 21, one operation, one behaviour: two `rota serve` processes on one
    PostgreSQL, a worker labelled eu on each and one labelled us on A. The dashboard's
    quiet-by-label form, posted to A with its login cookie, quiets both eu workers (B's
    through the notice A sends); the API's terminate-by-label through B then terminates
    both. The us worker is left running."""
    ports = [free_port() for _ in range(2)]
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{p}", timeout=30) for p in ports]
    procs: list[asyncio.subprocess.Process] = []
    workers: list[RawWorker] = []
    try:
        for i, port in enumerate(ports):
            procs.append(await spawn_serve(clients[i], [  # tokens read again every 0.2 s
                "--db", pg_url, "--port", str(port), "--server-id", f"s{i}",
                "--heartbeat-interval", "0.2"], tmp_path / f"s{i}.log"))
        a, b = clients
        made = await a.post("/tokens", json={"scope": "admin", "name": "ops"})  # the first
        assert made.status_code == 201, made.text
        admin = made.json()["token"]

        async def b_knows_it() -> bool:  # B reads the tokens again within 0.2 s
            return (await b.get("/workers")).status_code == 401

        await wait_until(b_knows_it, what="B to know the servers have tokens now")
        for client in clients:
            client.headers["Authorization"] = f"Bearer {admin}"
        workers = [await labelled(ports[0], "a-eu", "eu", admin),
                   await labelled(ports[0], "a-us", "us", admin),
                   await labelled(ports[1], "b-eu", "eu", admin)]

        async with httpx.AsyncClient(base_url=str(a.base_url)) as browser:
            same = {"Sec-Fetch-Site": "same-origin"}
            login = await browser.post("/ui/login", data={"token": admin, "next": "/ui"},
                                       headers=same)
            assert login.status_code == 303 and "rota_session" in browser.cookies

            async def dashboard(path: str, **form: str) -> str:
                """Post a form of A's dashboard: the message the page shows after it."""
                posted = await browser.post(path, headers=same,
                                            data={**form, "back": "/ui/workers"})
                assert posted.status_code == 303, posted.text
                return (await browser.get(posted.headers["location"])).text

            shown = await dashboard("/ui/workers/state", label="eu", state="quiet")
            assert ("1 worker(s) labelled &#39;eu&#39; were told to go quiet, and those of the"
                    " other servers on the database") in shown
            await wait_until(lambda: state_on(b, "b-eu", "quiet"), timeout=10,
                             what="B to quiet its eu worker")
            assert [await told(w) for w in workers] == ["quiet", "running", "quiet"]

            # B's worker named on A's dashboard: passed on, as through the API, once B's
            # record of it is committed (before, refused as connected nowhere).
            async def resumed() -> bool:
                shown = await dashboard("/ui/workers/b-eu/state", state="running")
                assert "was told to resume" in shown or "no connected worker b-eu" in shown
                return "told to resume (through the server it is connected to)" in shown

            await wait_until(resumed, timeout=10, what="A to know b-eu is connected to B")
            await wait_until(lambda: state_on(b, "b-eu", "running", field="directive"),
                             timeout=10, what="B to resume its eu worker")
            assert [await told(w) for w in workers] == ["quiet", "running", "running"]

        through_b = await b.post("/workers/state", json={"state": "terminate", "label": "eu"})
        assert through_b.json() == {"workers": ["b-eu"], "state": "terminate", "forwarded": True}
        await wait_until(lambda: state_on(a, "a-eu", "terminate"), timeout=10,
                         what="A to terminate its eu worker")
        assert [await told(w) for w in workers] == ["terminate", "running", "terminate"]
    finally:
        for worker in workers:
            await worker.ws.close()
        await end(procs, clients)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
async def test_a_worker_that_moves_to_another_server_keeps_its_running_job(
        tmp_path: Path, pg_url: str, how: signal.Signals, caplog: pytest.LogCaptureFixture):
    """Its server dies (or stops) while the worker runs a job: the worker moves to B,
    which takes the reservation over, and the run started on A finishes there, once, as
    attempt 1."""
    caplog.set_level(logging.INFO, logger="rota.server")
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    port = free_port()
    gate = asyncio.Event()
    started: list[str] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        proc = await spawn_serve(http, ["--db", pg_url, "--port", str(port), "--server-id", "A",
                                        "--heartbeat-interval", "0.2", "--heartbeat-timeout",
                                        "2"], tmp_path / "a.log")
        try:
            async with servers(tmp_path, pg_url, 1) as (b,):
                await b.push(spec)
                worker = Worker(url=[f"http://127.0.0.1:{port}", b.base], specs_dir=specs,
                                heartbeat_interval=0.1, worker_id="mover")

                @worker.handler("echo")
                async def echo(ctx: JobContext) -> int:
                    started.append(ctx.id)
                    await gate.wait()
                    return ctx.attempt

                async with running(worker):
                    job = await b.enqueue("echo")
                    await wait_until(lambda: started, what="the job to start on A's worker")
                    proc.send_signal(how)
                    await proc.wait()
                    await wait_until(lambda: worker.server_url.startswith(b.ws.rsplit("/", 1)[0]),
                                     what="the worker to move to B")
                    await wait_until(lambda: "mover" in b.coordinator.connections,
                                     what="the worker to register on B")
                    gate.set()
                    done = await b.wait_state(job["id"], "completed", timeout=10)
                assert done["attempt"] == 1 and done["result"] == 1 and done["errors"] == []
                assert started == [job["id"]]
                assert "take over job=" in caplog.text
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_a_second_live_server_under_the_same_id_refuses_to_start(tmp_path: Path,
                                                                       pg_url: str):
    """Two live servers under one --server-id would renew one lease, and a crash of
    either would strand its workers' jobs: the second refuses, in one line. (One whose
    process is gone, on this host, is a restart: that one starts.)"""
    async with servers(tmp_path, pg_url, 1):  # s0's lease: this host, this live process
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rota", "serve", "--db", pg_url, "--port", str(free_port()),
            "--server-id", "s0", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    text = out.decode()
    assert proc.returncode != 0 and "Traceback" not in text
    assert "server id s0 is in use by rota serve pid" in text and "--server-id" in text


async def test_another_tokens_worker_cannot_take_over_a_job_through_another_server(
        tmp_path: Path, pg_url: str):
    """Issue 20, item 3, across servers: a worker of a token limited to acc-low registers
    on B under the worker id of an acc-high worker running jobs on A, naming them. B
    takes nothing over (not even a job reserved before tokens, which no token holds:
    the rows still name A) and refuses the registration; the jobs go on on A."""
    async with servers(tmp_path, pg_url, 2) as (a, b):
        admin, _ = await a.coordinator.create_token("admin", "ops", None)
        high, high_row = await a.coordinator.create_token("worker", "high", ["acc-high"])
        low, low_row = await a.coordinator.create_token("worker", "low", ["acc-low"])
        for live in (a, b):
            live.http.headers["Authorization"] = f"Bearer {admin}"
            await wait_until(lambda live=live: all(live.coordinator.tokens.valid_id(r["id"])
                                                   for r in (high_row, low_row)),
                             what="every server to know the tokens")
        pay = write_spec(tmp_path / "specs", "pay", queue="acc-high")
        await a.push(pay)
        victim = await RawWorker.open(a.ws, "payer",
                                      additional_headers={"Authorization": f"Bearer {high}"})
        await victim.register([pay], queues=["acc-high"], concurrency=2)
        job = await a.enqueue("pay", {"amount": 10})
        [copy] = await victim.jobs(1)
        older = await a.enqueue("pay", {"amount": 20})
        [old_copy] = await victim.jobs(1)
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
            # As a reservation from before tokens left it: held by no token.
            await conn.execute("UPDATE jobs SET worker_token = NULL WHERE id = %s",
                               (older["id"],))

        thief = await RawWorker.open(b.ws, "payer",
                                     additional_headers={"Authorization": f"Bearer {low}"})
        await thief.beat(registration={"hostname": "test", "os": "linux", "pid": 1,
                                       "sdk": "raw", "queues": ["acc-low"], "concurrency": 1,
                                       "specs": []},
                         status={"state": "running",
                                 "active_job_ids": [job["id"], older["id"]]},
                         results=[completed(copy, "forged")])
        error = await thief.expect("error")
        assert error["code"] == "worker_id_taken"
        assert "payer" not in b.coordinator.connections
        async with await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as conn:
            cursor = await conn.execute("SELECT id, server_id FROM jobs ORDER BY id")
            assert sorted(await cursor.fetchall()) == sorted([(job["id"], "s0"),
                                                              (older["id"], "s0")])
        for held, name in ((copy, job["id"]), (old_copy, older["id"])):
            assert (await victim.complete(held, "paid"))["accepted"] == [name]
            done = await b.job(name)
            assert (done["state"], done["attempt"], done["result"]) == ("completed", 1, "paid")
