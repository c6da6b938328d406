"""Several servers on one PostgreSQL on a bad day (docs/scaling.md, Server death): one
server stopped (SIGSTOP) inside a transaction, and the database itself away, each under
a stream of jobs with handlers that record every run. A stalled server costs the others
a bounded wait, a healthy server's lease never lapses, and no job runs twice on a worker
whose server stayed healthy.

Both runs last several leases of real time by design (the stall and the outage are the
test): they are soak runs (-m soak, run by .ci/run after the main suite)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import psycopg
import pytest
from conftest import start_server, stop_server, write_spec
from helpers import free_port, spawn_serve, wait_until
from pgserver import Cluster
from test_cluster import Runs, running, servers

LEASE, GRACE = 3.0, 2.0
CLUSTER = {"server_lease": LEASE, "reconnect_grace": GRACE}
FINISHED = "state IN ('completed', 'discarded', 'cancelled')"


class Stream:
    """Producers enqueueing to each server, one job every ``every`` seconds, until
    stopped: the ids each server accepted, and how long each of its answers took."""

    def __init__(self) -> None:
        self.accepted: list[str] = []
        self.waits: dict[str, list[tuple[float, float, int]]] = {}  # (at, seconds, status)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, name: str, http: httpx.AsyncClient, every: float = 0.05) -> None:
        self.waits[name] = []
        self._tasks.append(asyncio.create_task(self._run(name, http, every)))

    async def _run(self, name: str, http: httpx.AsyncClient, every: float) -> None:
        n = 0
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                response = await http.post("/jobs", json={"spec": "echo",
                                                           "args": {"via": name, "n": n}})
            except httpx.TransportError:  # a server stopped, or the wait ran out
                self.waits[name].append((began, time.monotonic() - began, 0))
                continue
            self.waits[name].append((began, time.monotonic() - began, response.status_code))
            if response.status_code in (200, 201):
                self.accepted.append(response.json()["job"]["id"])
            n += 1
            # The stream's pace, not a synchronisation.
            await asyncio.sleep(every)  # noqa: sleep-ok

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def scalar(admin: psycopg.AsyncConnection[Any], sql: str) -> Any:
    row = await (await admin.execute(sql)).fetchone()
    return None if row is None else row[0]


async def all_finished(admin: psycopg.AsyncConnection[Any], accepted: list[str]) -> None:
    async def done() -> bool:
        return await scalar(admin, f"SELECT count(*) FROM jobs WHERE NOT {FINISHED}") == 0

    try:
        await wait_until(done, timeout=60, what="every job to finish")
    except AssertionError:
        # Say which jobs are left, and where: the timeout alone names no cause.
        rows = await (await admin.execute(
            "SELECT state, worker_id, server_id, attempt, count(*), min(id::text), max(id::text)"
            f" FROM jobs WHERE NOT {FINISHED} GROUP BY state, worker_id, server_id, attempt"
        )).fetchall()
        servers = await (await admin.execute(
            "SELECT id, lease_expires_at - EXTRACT(EPOCH FROM clock_timestamp())"
            " FROM servers")).fetchall()
        raise AssertionError(f"jobs left unfinished: {rows}; servers: {servers}") from None
    finished = await scalar(admin, f"SELECT count(*) FROM jobs WHERE {FINISHED}")
    assert finished >= len(set(accepted))


def ran_twice_only_after_a_stalled_server(runs: Runs, stalled: str = "") -> None:
    """No job that ran on a worker of a healthy server ran again, anywhere; a job that
    ran twice first ran on the worker of the server ``stalled`` past its lease and the
    grace (docs/scaling.md: the runs that may be repeated)."""
    by_job: dict[str, list[tuple[int, str]]] = {}
    for job, attempt, worker in runs.runs:
        by_job.setdefault(job, []).append((attempt, worker))
    twice = {job: seen for job, seen in by_job.items() if len(seen) > 1}
    for job, seen in twice.items():
        assert stalled and all(worker == stalled for _, worker in seen[:-1]), (
            f"job {job} ran {len(seen)} times: {seen}")


@contextlib.asynccontextmanager
async def admin_of(url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        yield admin


@pytest.mark.soak
@pytest.mark.timeout(180)
async def test_a_server_stopped_inside_a_transaction_costs_the_others_a_bounded_wait(
        tmp_path, pg_url: str, caplog: pytest.LogCaptureFixture):
    """A (`rota serve`, its connections named rota-a) is stopped with SIGSTOP while its
    backend is idle in transaction, holding the rows of a claim, for 2.7 leases. B keeps
    enqueueing, each answer within a lease; PostgreSQL ends A's session; B's lease never
    lapses, and once A runs again it does not declare B dead. (A itself was stalled past
    its lease and the grace: B recovers its workers' jobs, the documented case.)"""
    caplog.set_level(logging.INFO, logger="rota.server")
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    port = free_port()
    runs = Runs()
    stream = Stream()
    async with (httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1) as a_http,
                admin_of(pg_url) as admin):
        # The test switch --hold-reserve keeps each of A's reservations inside its
        # transaction for a moment, for the test to catch it there.
        proc = await spawn_serve(a_http, [
            "--db", f"{pg_url}?application_name=rota-a", "--port", str(port),
            "--server-id", "A", "--server-lease", str(LEASE), "--reconnect-grace", str(GRACE),
            "--heartbeat-interval", "0.2", "--hold-reserve", "0.2"], tmp_path / "a.log")
        b = await start_server(tmp_path / "b", database_url=pg_url, server_id="B", **CLUSTER)
        try:
            await b.push(spec)
            async with running(runs.worker(specs, f"http://127.0.0.1:{port}", "wa",
                                           concurrency=4, seconds=0.05),
                               runs.worker(specs, b.base, "wb", concurrency=4, seconds=0.05)):
                b.http.timeout = httpx.Timeout(30)
                stream.start("a", a_http)
                stream.start("b", b.http)

                async def a_inside() -> tuple[int, str] | None:
                    """A's session idle inside a transaction that wrote: its pid and xid."""
                    cursor = await admin.execute(
                        "SELECT pid, backend_xid::text FROM pg_stat_activity WHERE"
                        " application_name = 'rota-a' AND backend_xid IS NOT NULL AND"
                        " state = 'idle in transaction'")
                    row = await cursor.fetchone()
                    return None if row is None else (row[0], row[1])

                async def fate(pid: int, xid: str) -> str | None:
                    """What became of the session: ended by PostgreSQL ("ended"), out of
                    that transaction ("left"), or None while it holds it."""
                    cursor = await admin.execute("SELECT state, backend_xid::text FROM"
                                                 " pg_stat_activity WHERE pid = %s", (pid,))
                    row = await cursor.fetchone()
                    if row is None:
                        return "ended"
                    return None if tuple(row) == ("idle in transaction", xid) else "left"

                try:
                    # Until A is stopped inside its transaction and PostgreSQL ends that
                    # session (within its bound, a quarter lease). A COMMIT that A sent just
                    # before it stopped may reach the session after the look that found it
                    # inside (a loaded machine): the session then leaves the transaction,
                    # nothing ends it, and A is let go and caught again.
                    for _ in range(20):
                        pid, xid = await wait_until(a_inside, timeout=30,
                                                    what="A inside a claim")
                        proc.send_signal(signal.SIGSTOP)
                        stopped_at = time.monotonic()
                        found = await wait_until(lambda pid=pid, xid=xid: fate(pid, xid),
                                                 timeout=LEASE, what="PostgreSQL to end A's"
                                                 " stalled session, or it to leave")
                        if found == "ended":
                            break
                        proc.send_signal(signal.SIGCONT)
                    else:
                        raise AssertionError("A was never stopped inside its transaction")
                    b_left = []
                    while time.monotonic() < stopped_at + 2.7 * LEASE:
                        b_left.append(await scalar(
                            admin, "SELECT lease_expires_at - EXTRACT(EPOCH FROM"
                            " clock_timestamp()) FROM servers WHERE id = 'B'"))
                        # Sampling B's lease as it stands, not a synchronisation.
                        await asyncio.sleep(0.2)  # noqa: sleep-ok
                finally:
                    proc.send_signal(signal.SIGCONT)
                # A runs again: long enough for it to judge B's lease, were it to.
                await asyncio.sleep(LEASE + GRACE + 2)  # noqa: sleep-ok (the run itself)
                await stream.stop()
                await all_finished(admin, stream.accepted)
        finally:
            await stop_server(b)
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()
    a_log = (tmp_path / "a.log").read_text()
    during = [(s, status) for at, s, status in stream.waits["b"] if at >= stopped_at]
    assert during and all(status == 201 for _, status in during), during
    slowest = max(stream.waits["b"], key=lambda wait: wait[1])
    assert slowest[1] < LEASE, slowest
    assert min(b_left) > 0, b_left
    assert "recovered server=B" not in a_log and "lease had lapsed" not in caplog.text
    ran_twice_only_after_a_stalled_server(runs, stalled="wa")
    assert {w for _, _, w in runs.runs} == {"wa", "wb"}


@pytest.mark.soak
@pytest.mark.timeout(180)
async def test_a_database_away_for_twice_the_lease_makes_no_server_recover_another(
        tmp_path, pg_cluster: Cluster, pg_url: str, caplog: pytest.LogCaptureFixture):
    """Two servers, a worker on each running jobs that take a while, a stream to both;
    PostgreSQL stops (pg_ctl stop) for two leases and comes back. Neither server was
    dead: neither recovers the other's running jobs, and every job runs once."""
    caplog.set_level(logging.INFO, logger="rota.server")
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    runs = Runs()
    stream = Stream()
    async with servers(tmp_path, pg_url, 2, **CLUSTER) as (a, b):
        await a.push(spec)
        async with running(runs.worker(specs, a.base, "wa", concurrency=4, seconds=1.0),
                           runs.worker(specs, b.base, "wb", concurrency=4, seconds=1.0)):
            stream.start("a", a.http, every=0.1)
            stream.start("b", b.http, every=0.1)

            await wait_until(lambda: busy_on(a, "wa") and busy_on(b, "wb"), timeout=20,
                             what="jobs running on both workers")
            await asyncio.to_thread(pg_cluster.stop)
            try:
                # The outage itself, not a synchronisation.
                await asyncio.sleep(2 * LEASE)  # noqa: sleep-ok
            finally:
                await asyncio.to_thread(pg_cluster.start)
            await asyncio.sleep(LEASE + GRACE + 2)  # noqa: sleep-ok (the run after it)
            await stream.stop()
            async with admin_of(pg_url) as admin:
                await all_finished(admin, stream.accepted)
    assert "recovered server=" not in caplog.text
    assert "lease had lapsed" not in caplog.text
    ran_twice_only_after_a_stalled_server(runs)
    assert set(stream.accepted) <= set(runs.per_job())


def busy_on(live: Any, worker: str) -> bool:
    """Whether ``worker`` runs a job for server ``live`` now."""
    slot = live.coordinator.scheduler.workers.get(worker)
    return slot is not None and len(slot.active) > 0
