"""Several Rota servers on one PostgreSQL (issue 15, docs/scaling.md), measured.

Run from the repository root (needs ``pip install -e '.[test,bench]'``, PostgreSQL's
binaries in /usr/lib/postgresql/*/bin and a ``redis-server`` for the reference):

    .venv/bin/python bench/scaling.py            # the full run (~10 min)
    .venv/bin/python bench/scaling.py --quick    # smaller sizes (~2 min)

One invocation runs, in order:

1. ``backends``: one server on SQLite, then one on PostgreSQL, the same workload as
   bench/compare.py e2e (no-op jobs, one ``rota worker`` at concurrency 10, enqueued with
   ``POST /jobs/batch`` of 1,000 while the worker runs; jobs / time from the first
   enqueue sent to the last job finished), beside huey's e2e (bench/reference.py).
2. ``servers``: the same with 1, 2 and 3 servers on one PostgreSQL, a worker per server
   and one producer per server; the CPU each process used over the run (psutil).
3. ``latency``: an idle worker on server B, single jobs enqueued on server A at a steady
   rate; the handler's start time minus the enqueue's send time. Then the same with the
   enqueues sent to B (same server).
4. ``death``: kill -9 of server A while its workers run long jobs: how long until a
   worker given both URLs runs a job on B, and until the reservations of a worker that
   knew only A are recovered (back to ``available``, then running at attempt 2).

The bench starts its own PostgreSQL (tests/pgserver.py's Cluster, ``durable=True``:
fsync, synchronous commit and full page writes on, PostgreSQL's defaults) so that an
acknowledged enqueue is on disk, as with SQLite at ``synchronous=FULL``; and its own
redis for huey. Every server runs as a user runs it (``rota serve``, INFO logging). The
figures go to ``bench/results/scaling.json`` (``scaling-quick.json`` with ``--quick``;
``--only`` and ``--profile`` add their parts to the name); nothing is asserted.

    .venv/bin/python bench/scaling.py --only backends --profile   # py-spy of a server

"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
import throughput as tp  # noqa: E402  (bench/ is not a package)
from compare import reference as huey  # noqa: E402  (None where huey or redis is missing)
from pgserver import Cluster  # noqa: E402  (neither is tests/)

from rota.client.client import Client  # noqa: E402
from rota.base.specs import load_dir  # noqa: E402

RESULTS_DIR = ROOT / "bench" / "results"
POLL = 0.02  # seconds between polls of the database: the resolution of the death figures

# Worker modules, written into each run's directory. STAMP's handler returns the moment
# it started (the latency figure); TIMED's writes one line per start to RUNS_FILE (the
# death figures need starts of jobs whose result never commits) and sleeps args.seconds.
NOOP_WORKER = tp.WORKER_SOURCE
STAMP_WORKER = '''"""Written by bench/scaling.py: the handler returns the moment it started."""

import time

from rota import JobContext, Worker

worker = Worker(specs_dir={specs_dir!r}, concurrency={concurrency})


@worker.handler({spec!r})
async def noop(ctx: JobContext) -> float:
    return time.time()
'''
TIMED_WORKER = '''"""Written by bench/scaling.py: each start is a line in {runs!r}."""

import asyncio
import time

from rota import JobContext, Worker

# No prefetch: a job this worker holds is a job it runs, so that a start after the kill
# is a job given out after the kill.
worker = Worker(specs_dir={specs_dir!r}, concurrency={concurrency}, prefetch=0)


def note(ctx: JobContext, what: str) -> None:
    with open({runs!r}, "a") as out:
        out.write(f"{{time.time()!r}} {{ctx.id}} {{ctx.attempt}} {{ctx.worker_id}} {{what}}\\n")


@worker.handler({spec!r})
async def noop(ctx: JobContext) -> None:
    note(ctx, "start")
    outcome = "stopped"  # a cancel (reservation lost) ends the sleep with CancelledError
    try:
        await asyncio.sleep(ctx.args.get("seconds", 0))  # noqa: sleep-ok (the job's work)
        outcome = "end"
    finally:
        note(ctx, outcome)
'''


# -- processes ---------------------------------------------------------------------------
@dataclass
class Server:
    name: str
    url: str
    child: tp.Child


@dataclass
class Fleet:
    """Servers and workers of one run, as subprocesses, in a temp dir of their own."""

    db: str  # a postgresql:// URL, or "" for a SQLite file in the run's directory
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rota-scale-")))
    children: tp.Children = field(default_factory=tp.Children)
    servers: list[Server] = field(default_factory=list)
    specs_dir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.specs_dir = self.workdir / "specs"
        self.specs_dir.mkdir()
        (self.specs_dir / f"{tp.SPEC_NAME}.toml").write_text(tp.NOOP_SPEC)
        self.db = self.db or str(self.workdir / "rota.db")

    def serve(self, name: str, extra: tuple[str, ...] = ()) -> Server:
        port = tp.free_port()
        cwd = self.workdir / name  # its own: tp.Children names the log after the child
        cwd.mkdir()
        argv = [sys.executable, "-m", "rota", "serve", "--port", str(port), "--db", self.db]
        if self.db.startswith("postgresql"):
            argv += ["--server-id", name]
        child = self.children.start("server", [*argv, *extra], cwd)
        server = Server(name, f"http://127.0.0.1:{port}", child)
        tp.wait_until(f"{name} GET /healthz", lambda: tp._healthy(server.url), self.children,
                      tp.STARTUP_TIMEOUT)
        self.servers.append(server)
        return server

    def push(self, via: Server) -> None:
        with Client(via.url) as client:
            client.push_specs(load_dir(self.specs_dir))

    def module(self, name: str, source: str, concurrency: int) -> str:
        (self.workdir / f"{name}.py").write_text(source.format(
            specs_dir=str(self.specs_dir), concurrency=concurrency, spec=tp.SPEC_NAME,
            runs=str(self.workdir / "runs.txt")))
        return f"{name}:worker"

    def worker(self, name: str, target: str, urls: list[Server]) -> tp.Child:
        argv = [sys.executable, "-m", "rota", "worker", target, "--log-level", "warning"]
        for server in urls:
            argv += ["--url", server.url]
        return self.children.start(name, argv, self.workdir)

    def wait_workers(self, server: Server, count: int) -> None:
        tp.wait_until(f"{count} worker(s) on {server.name}",
                      lambda: tp._ready_workers(server.url) >= count, self.children,
                      tp.STARTUP_TIMEOUT)

    def problems(self) -> list[str]:
        """Warnings and errors in the servers' and workers' logs."""
        found = []
        for child in self.children.items:
            with contextlib.suppress(OSError):
                for line in child.log_path.read_text(errors="replace").splitlines():
                    # Every server here runs without tokens, and says so at start.
                    if tp.LOG_PROBLEM.search(line) and "AUTH IS OFF" not in line:
                        found.append(f"{child.log_path.parent.name}/{child.name}: {line[:300]}")
        return found[:tp.MAX_LOG_LINES]

    def count(self, text: str) -> int:
        """Lines of the servers' logs that hold ``text``."""
        found = 0
        for child in self.children.items:
            if child.name == "server":
                with contextlib.suppress(OSError):
                    found += child.log_path.read_text(errors="replace").count(text)
        return found

    def close(self) -> None:
        self.children.stop_all()
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextlib.contextmanager
def fleet(db: str) -> Iterator[Fleet]:
    made = Fleet(db)
    try:
        yield made
    finally:
        made.close()


@contextlib.contextmanager
def postgres(durable: bool = True) -> Iterator[Cluster]:
    cluster = Cluster(durable=durable)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


# -- CPU -----------------------------------------------------------------------------------
def postgres_processes(cluster: Cluster) -> list[psutil.Process]:
    """The postmaster and every backend and helper it runs now."""
    pid = int((cluster.data / "postmaster.pid").read_text().split()[0])
    main = psutil.Process(pid)
    return [main, *main.children(recursive=True)]


def cpu_snapshot(run: Fleet, cluster: Cluster | None) -> dict[str, dict[int, float]]:
    """CPU seconds (user + system) per process, grouped by role; per pid, so that a
    PostgreSQL backend born during the run counts from zero."""
    groups: dict[str, list[psutil.Process]] = {"bench": [psutil.Process()]}
    for child in run.children.items:
        role = child.log_path.parent.name if child.name == "server" else child.name
        with contextlib.suppress(psutil.Error):
            groups[role] = [psutil.Process(child.proc.pid)]
    if cluster is not None:
        groups["postgresql"] = postgres_processes(cluster)
    snap: dict[str, dict[int, float]] = {}
    for role, procs in groups.items():
        snap[role] = {}
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                snap[role][proc.pid] = times.user + times.system
    return snap


def machine_busy(before: Any, after: Any) -> float:
    """Percent of one core the whole machine was busy between two psutil.cpu_times()
    (200 = both cores): set beside what the run's own processes used, it shows what the
    other work on the machine took."""
    def idle(t: Any) -> float:
        return float(t.idle + getattr(t, "iowait", 0.0))

    total = sum(after) - sum(before)
    busy = total - (idle(after) - idle(before))
    return round(100 * (os.cpu_count() or 1) * busy / total, 1) if total else 0.0


def cpu_used(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]],
             seconds: float) -> dict[str, float]:
    """Percent of one core each role used between two snapshots (200 = both cores)."""
    used = {}
    for role, pids in after.items():
        total = sum(t - before.get(role, {}).get(pid, 0.0) for pid, t in pids.items())
        used[role] = round(100 * total / seconds, 1)
    return used


# -- the database, read directly -------------------------------------------------------------
class Store:
    """Read-only queries on the run's store, SQLite or PostgreSQL, with one SQL text."""

    def __init__(self, db: str) -> None:
        self.pg = db.startswith("postgresql")
        self.conn: Any = (psycopg.connect(db, autocommit=True) if self.pg else
                          tp.read_only(Path(db)))

    def all(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        if self.pg:
            sql = sql.replace("?", "%s")
        return list(self.conn.execute(sql, args).fetchall())

    def one(self, sql: str, *args: Any) -> Any:
        return self.all(sql, *args)[0][0]

    def close(self) -> None:
        self.conn.close()


def wait_completed(store: Store, count: int, run: Fleet, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while store.one("SELECT count(*) FROM jobs WHERE state = 'completed'") < count:
        run.children.check_alive()
        if time.monotonic() > deadline:
            states = store.all("SELECT state, count(*) FROM jobs GROUP BY state")
            raise tp.BenchError(f"not all {count} jobs completed after {timeout}s: {states}")
        time.sleep(0.05)


# -- 1 and 2: end to end -----------------------------------------------------------------
async def produce(servers: list[Server], jobs: int, batch: int) -> tuple[float, list[str]]:
    """One producer per server, each POSTing batches in turn from one shared count (as
    producers behind a load balancer would); the wall clock of the first send."""
    counter = itertools.count(0, batch)
    failures: list[str] = []
    body_of = {n: b'{"jobs":[' + b",".join([tp.ENQUEUE_BODY] * n) + b"]}" for n in {batch}}

    async def one(http: httpx.AsyncClient) -> None:
        while (start := next(counter)) < jobs:
            n = min(batch, jobs - start)
            body = body_of.get(n) or b'{"jobs":[' + b",".join([tp.ENQUEUE_BODY] * n) + b"]}"
            response = await http.post("/jobs/batch", content=body,
                                       headers={"content-type": "application/json"})
            if response.status_code != 200:
                failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
                continue
            failures.extend(f"job {r['index']}: {r.get('error')}"
                            for r in response.json()["results"] if r["status"] != 201)

    async with contextlib.AsyncExitStack() as stack:
        # Clients exist before the clock starts (an httpx client takes ms to build).
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            base_url=s.url, timeout=120, limits=httpx.Limits(max_connections=1)))
            for s in servers]
        first = time.time()
        await asyncio.gather(*(one(c) for c in clients))
    return first, failures


def e2e(cluster: Cluster | None, servers: int, jobs: int,
        profile: Path | None = None) -> dict[str, Any]:
    """``servers`` servers on a fresh database of ``cluster`` (SQLite without one), a worker
    (concurrency 10) on each, ``jobs`` no-op jobs in batches of 1,000 spread over the
    servers; jobs/s and each process's CPU. With ``profile``, py-spy samples the first
    server's threads (idle ones too) into that file, summarised in the figures."""
    with fleet(cluster.create_database() if cluster else "") as run:
        for i in range(servers):
            run.serve(f"s{i}")
        run.push(run.servers[0])  # one push: the others hear of it (rota_specs)
        target = run.module("noop_worker", NOOP_WORKER, 10)
        for i, server in enumerate(run.servers):
            run.worker(f"worker-{i}", target, [server])
        for server in run.servers:
            run.wait_workers(server, 1)
        store = Store(run.db)
        try:
            spy = None
            if profile is not None:
                spy = subprocess.Popen(
                    [str(Path(sys.executable).with_name("py-spy")), "record", "--format", "raw",
                     "--idle", "--threads", "--rate", "100", "--output", str(profile),
                     "--pid", str(run.servers[0].child.proc.pid)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            before, machine_before = cpu_snapshot(run, cluster), psutil.cpu_times()
            started = time.monotonic()
            first, failures = asyncio.run(produce(run.servers, jobs, 1000))
            wait_completed(store, jobs, run, 300.0)
            seconds = time.monotonic() - started
            after, busy = cpu_snapshot(run, cluster), machine_busy(machine_before,
                                                                    psutil.cpu_times())
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(60)
            last = store.one("SELECT max(finished_at) FROM jobs")
            states = dict(store.all("SELECT state, count(*) FROM jobs GROUP BY state"))
            reruns = store.one("SELECT count(*) FROM jobs WHERE attempt > 1")
            per_worker = dict(store.all("SELECT worker_id, count(*) FROM jobs GROUP BY worker_id"))
        finally:
            store.close()
        figures = {
            "servers": servers, "jobs": jobs, "end_to_end_per_s": round(jobs / (last - first)),
            "states": states, "jobs_run_more_than_once": reruns,
            "jobs_per_worker": sorted(per_worker.values()), "enqueue_failures": failures[:10],
            "cpu_percent_of_one_core": cpu_used(before, after, seconds),
            "machine_busy_percent_of_one_core": busy,
            # Every server offers every waiting job to its own workers; the row decides.
            # A claim that lost is a round trip spent for nothing: the price of N servers.
            "claims_lost_to_another_server": run.count("lost race job="),
            "transactions_run_again": run.count("ran into another server's"),
            "log_problems": run.problems()}
        if profile is not None:
            figures["profile_of_s0"] = summarise_profile(profile)
    cpu = figures["cpu_percent_of_one_core"]
    print(f"  {servers} server(s) on {'PostgreSQL' if cluster else 'SQLite'}: "
          f"{figures['end_to_end_per_s']} jobs/s; CPU % of a core: {cpu}; whole machine:"
          f" {figures['machine_busy_percent_of_one_core']}; claims lost:"
          f" {figures['claims_lost_to_another_server']}; transactions run again:"
          f" {figures['transactions_run_again']}")
    return figures


def summarise_profile(path: Path) -> dict[str, Any]:
    """Per thread of a py-spy raw (collapsed) profile taken with --idle: the share of
    samples spent waiting for PostgreSQL (psycopg's wait), idle (waiting for work), or
    on the CPU; and, for the writer, which store operation each share belongs to."""
    threads: dict[str, dict[str, int]] = {}
    writer: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1].rstrip(")").strip()
        leaf = frames[-1]
        # The writer waits for work in a C call (its queue's get), so its own frame is
        # the leaf then; the event loop waits inside uvloop, below asyncio's runner.
        kind = ("postgresql" if "psycopg/connection.py" in leaf and "wait" in leaf else
                "idle" if any(w in leaf for w in ("Condition.wait", "queue.py", "runners.py",
                                                  "thread.py", "selectors.py", "Writer._run"))
                else "cpu")
        bucket = threads.setdefault(name, {})
        bucket[kind] = bucket.get(kind, 0) + int(count)
        if "writer" in name:
            ops = [f.split(" (")[0] for f in frames if "rota/store/store.py" in f or "rota/store/rows.py" in f]
            key = f"{kind}: {ops[-1] if ops else '-'}"
            writer[key] = writer.get(key, 0) + int(count)

    def shares(counts: dict[str, int]) -> dict[str, float]:
        total = sum(counts.values()) or 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        return {k: round(100 * v / total, 1) for k, v in ranked if 100 * v / total >= 1}

    return {"percent_of_samples_per_thread": {t: shares(c) for t, c in threads.items()},
            "writer_thread_by_operation": shares(writer)}


# -- 3: push latency ---------------------------------------------------------------------
def paced(count: int, rate: float, send: Callable[[], None]) -> None:
    due = time.monotonic()
    for _ in range(count):
        due += 1.0 / rate
        time.sleep(max(0.0, due - time.monotonic()))  # noqa: sleep-ok (a paced producer)
        send()


def distribution(values_s: list[float]) -> dict[str, float]:
    ordered = sorted(values_s)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 2)

    return {"count": len(ordered), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "max_ms": round(ordered[-1] * 1e3, 2)}


def latency(url: str, count: int, rate: float) -> dict[str, Any]:
    """An idle worker (concurrency 10) on B; ``count`` single enqueues at ``rate``/s on A,
    then as many on B; enqueue send to handler start."""
    with fleet(url) as run:
        a, b = run.serve("A"), run.serve("B")
        run.push(a)
        run.worker("worker-b", run.module("stamp_worker", STAMP_WORKER, 10), [b])
        run.wait_workers(b, 1)
        figures: dict[str, Any] = {"jobs_per_phase": count, "rate_per_s": rate}
        store = Store(url)
        try:
            for phase, via in (("cross_server", a), ("same_server", b)):
                sent: dict[str, float] = {}
                acked: dict[str, float] = {}
                calls: list[float] = []
                with Client(via.url) as client:
                    client.queues()  # the connection is open before the first send

                    def send() -> None:
                        at = time.time()
                        job = client.enqueue(tp.SPEC_NAME, {})["job"]  # noqa: B023
                        calls.append(time.time() - at)  # noqa: B023
                        sent[job["id"]] = at  # noqa: B023
                        acked[job["id"]] = at + calls[-1]  # noqa: B023

                    paced(count, rate, send)
                done = len(sent) if phase == "cross_server" else 2 * count
                wait_completed(store, done, run, 60.0)
                rows = [(job, json.loads(result), reserved) for job, result, reserved in
                        store.all("SELECT id, result, reserved_at FROM jobs"
                                  " WHERE state = 'completed'") if job in sent]
                figures[phase] = {
                    **distribution([start - sent[job] for job, start, _ in rows]),
                    "enqueue_call": distribution(calls),
                    # From the acknowledgement on: what the push adds to the commit, split
                    # at the reservation (the serving server's clock when it reserved).
                    "from_the_acknowledgement": distribution(
                        [start - acked[job] for job, start, _ in rows]),
                    "acknowledgement_to_reservation": distribution(
                        [reserved - acked[job] for job, _, reserved in rows]),
                    "reservation_to_handler_start": distribution(
                        [start - reserved for _, start, reserved in rows])}
                print(f"  {phase}: {figures[phase]}")
        finally:
            store.close()
        figures["log_problems"] = run.problems()
    return figures


# -- 4: server death ----------------------------------------------------------------------
LEASE, GRACE = 2.0, 2.0
LONG_JOB = 10.0


def read_runs(path: Path, what: str = "start") -> list[tuple[float, str, int, str]]:
    """(wall clock, job id, attempt, worker id) per handler start (or end, or stop)."""
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5 and parts[4] == what:  # a line being written is skipped
                out.append((float(parts[0]), parts[1], int(parts[2]), parts[3]))
    return out


def death(url: str) -> dict[str, Any]:
    """Servers A and B (``--server-lease 2 --reconnect-grace 2``). Worker X knows only A;
    worker W knows A then B. Each holds 4 jobs of 10 s from A when A is killed with -9.
    Then one short job a second goes to B until W runs one: (a). X's jobs wait for the
    recovery: back to ``available`` (b), then started again at attempt 2 by W."""
    extra = ("--server-lease", str(LEASE), "--reconnect-grace", str(GRACE))
    with fleet(url) as run:
        a, b = run.serve("A", extra), run.serve("B", extra)
        run.push(b)
        runs_file = run.workdir / "runs.txt"
        store = Store(url)
        try:
            def enqueue_long(n: int) -> list[str]:
                with Client(a.url) as client:
                    return [client.enqueue(tp.SPEC_NAME, {"seconds": LONG_JOB})["job"]["id"]
                            for _ in range(n)]

            def wait_starts(n: int) -> None:
                tp.wait_until(f"{n} starts", lambda: len(read_runs(runs_file)) >= n,
                              run.children, 30.0)

            # X first, alone, so that it (and only it) takes the first 4 jobs.
            run.worker("worker-x", run.module("x_worker", TIMED_WORKER, 4), [a])
            run.wait_workers(a, 1)
            held_by_x = enqueue_long(4)
            wait_starts(4)
            run.worker("worker-w", run.module("w_worker", TIMED_WORKER, 8), [a, b])
            run.wait_workers(a, 2)
            held_by_w = enqueue_long(4)
            wait_starts(8)
            server_a = next(c for c in run.children.items if c.proc.pid == a.child.proc.pid)
            killed_at = time.time()
            os.kill(server_a.proc.pid, signal.SIGKILL)
            server_a.proc.wait()
            run.children.items.remove(server_a)  # dead on purpose: no failure to report
            server_a.log_file.close()

            probes: set[str] = set()
            first_probe: float | None = None
            back_at: float | None = None  # all of X's jobs available again (or beyond)
            again: dict[str, float] = {}  # X's job -> start of its attempt 2
            next_probe = time.monotonic()
            deadline = time.monotonic() + LEASE + GRACE + 30.0
            with Client(b.url) as client:
                while (first_probe is None or back_at is None or len(again) < 4) \
                        and time.monotonic() < deadline:
                    run.children.check_alive()
                    if first_probe is None and time.monotonic() >= next_probe:
                        with contextlib.suppress(Exception):  # B may be busy; try again
                            probes.add(client.enqueue(tp.SPEC_NAME, {})["job"]["id"])
                        next_probe += 0.1
                    starts = read_runs(runs_file)
                    if first_probe is None:
                        first_probe = min((t for t, job, _, _ in starts if job in probes),
                                          default=None)
                    if back_at is None:
                        rows = store.all("SELECT id, state, attempt FROM jobs WHERE id IN"
                                         " (?, ?, ?, ?)", *held_by_x)
                        if all(state != "active" or attempt > 1 for _, state, attempt in rows):
                            back_at = time.time()
                    again.update({job: t for t, job, attempt, _ in starts
                                  if job in held_by_x and attempt > 1 and job not in again})
                    time.sleep(POLL)
            starts = read_runs(runs_file)
            w_jobs = store.all("SELECT id, state, attempt, errors FROM jobs WHERE id IN"
                               " (?, ?, ?, ?)", *held_by_w)
            lease = store.one("SELECT lease_expires_at FROM servers WHERE id = 'A'")
            errors = [(json.loads(e) or [{"type": None}])[-1]["type"] for (e,) in
                      store.all("SELECT errors FROM jobs WHERE id IN (?, ?, ?, ?)", *held_by_x)]
        finally:
            store.close()
        # Kill the workers: a SIGTERM would wait for their 10 s jobs to end.
        for child in run.children.items:
            if child.name.startswith("worker") and child.proc.poll() is None:
                child.proc.kill()
        figures = {
            "settings": {"server_lease_s": LEASE, "reconnect_grace_s": GRACE,
                         "long_job_s": LONG_JOB, "probe_every_s": 0.1, "poll_s": POLL,
                         "heartbeat": "server defaults"},
            "a_worker_with_both_urls_runs_a_job_on_b_after_s":
                round(first_probe - killed_at, 3) if first_probe else None,
            "a_lease_expired_after_kill_s": round(lease - killed_at, 3) if lease else None,
            "reservations_of_a_worker_of_a_only_available_after_s":
                round(back_at - killed_at, 3) if back_at else None,
            "those_jobs_running_at_attempt_2_after_s":
                [round(t - killed_at, 3) for t in sorted(again.values())],
            "their_last_error_type": errors,
            "jobs_held_by_the_worker_with_both_urls_after": [
                {"state": state, "attempt": attempt} for _, state, attempt, _ in w_jobs],
            "their_runs": sorted(
                {f"attempt {attempt} by {worker[:8]}: {what}" for what in ("start", "stopped")
                 for _, job, attempt, worker in read_runs(runs_file, what) if job in held_by_w}),
            "their_attempt_1_stopped_after_s": sorted(
                round(t - killed_at, 3) for t, job, attempt, _ in read_runs(runs_file, "stopped")
                if job in held_by_w and attempt == 1),
            "their_attempt_2_started_after_s": sorted(
                round(t - killed_at, 3) for t, job, attempt, _ in starts
                if job in held_by_w and attempt == 2),
            "their_last_error": [json.loads(e)[-1] if json.loads(e) else None
                                 for _, _, _, e in w_jobs],
            "log_problems": run.problems()}
    print(f"  death: {json.dumps({k: v for k, v in figures.items() if k != 'log_problems'})}")
    return figures


# -- the run ---------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "sqlite": sqlite3.sqlite_version,
            "postgresql": _pg_version(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def commit_latency(cluster: Cluster) -> dict[str, float]:
    """200 one-row INSERTs, each its own transaction, straight to the bench's PostgreSQL:
    what one durable commit costs on this disk, beside which the figures are read."""
    with psycopg.connect(cluster.create_database(), autocommit=True) as conn:
        conn.execute("CREATE TABLE probe (n integer)")
        times = []
        for n in range(200):
            started = time.perf_counter()
            conn.execute("INSERT INTO probe VALUES (%s)", (n,))
            times.append(time.perf_counter() - started)
    return distribution(times)


def _pg_version() -> str:
    from pgserver import find_bin
    return find_bin().parent.name


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median end-to-end rate, with every run's rate beside it."""
    ordered = sorted(runs, key=lambda r: r["end_to_end_per_s"])
    return {**ordered[len(ordered) // 2],
            "end_to_end_per_s_every_run": [r["end_to_end_per_s"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (~2 min)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy the server of one 1-server PostgreSQL run (idle threads"
                             " too), summary in the JSON (needs pip install py-spy)")
    parser.add_argument("--only", choices=["backends", "servers", "latency", "death"],
                        action="append", help="run only these parts (repeatable)")
    opts = parser.parse_args(argv)
    parts = opts.only or ["backends", "servers", "latency", "death"]
    jobs = 3_000 if opts.quick else 10_000
    # Other work shares this machine: each end-to-end setting runs `rounds` times,
    # interleaved (so that a busy minute touches every setting), and the median is kept.
    rounds = 1 if opts.quick else 3
    results: dict[str, Any] = {
        "command": " ".join(["bench/scaling.py", *(sys.argv[1:] if argv is None else argv)]),
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine_before": machine(), "rounds": rounds,
        "postgresql_settings": "fsync, synchronous_commit, full_page_writes on (defaults)",
        "sqlite_settings": "rota serve defaults: --durability full (synchronous=FULL)"}
    with postgres() as cluster:
        results["postgresql_commit"] = commit_latency(cluster)
        print(f"one durable PostgreSQL commit: {results['postgresql_commit']}")
        if "backends" in parts:
            print(f"backends: {jobs} no-op jobs, 1 worker x 10, batches of 1,000")
            ref = huey()
            by: dict[str, list[Any]] = {"sqlite": [], "postgresql": [], "huey": []}
            for _ in range(rounds):
                by["sqlite"].append(e2e(None, 1, jobs))
                by["postgresql"].append(e2e(cluster, 1, jobs))
                if ref:
                    by["huey"].append(ref.huey_e2e(jobs=jobs, concurrency=10))
                    print(f"  huey: {by['huey'][-1]}")
            results["backends"] = {"sqlite": median_run(by["sqlite"]),
                                   "postgresql": median_run(by["postgresql"]),
                                   "huey": median_run(by["huey"]) if by["huey"] else None}
        if "servers" in parts:
            print(f"servers: {jobs} no-op jobs, a worker x 10 per server, producers spread")
            runs: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 3: []}
            for _ in range(rounds):
                for n, done in runs.items():
                    done.append(e2e(cluster, n, jobs))
            results["servers"] = [median_run(done) for done in runs.values()]
        if opts.profile:
            print("profile: one server on PostgreSQL, under py-spy")
            RESULTS_DIR.mkdir(exist_ok=True)
            raw = RESULTS_DIR / "scaling-profile.txt"
            results["profile"] = e2e(cluster, 1, jobs, profile=raw)
            print(json.dumps(results["profile"]["profile_of_s0"], indent=1))
        if "latency" in parts:
            count = 150 if opts.quick else 500
            print(f"latency: {count} single enqueues at 50/s, worker idle on B")
            results["latency"] = latency(cluster.create_database(), count, 50.0)
        if "death" in parts:
            print("death: kill -9 of server A")
            results["death"] = death(cluster.create_database())
    if "latency" in parts:
        # The same path without the disk (the suite's settings): what the push itself
        # costs, beside what the two durable commits on its way cost.
        with postgres(durable=False) as fast:
            print("latency again, PostgreSQL with fsync off")
            results["latency_fsync_off"] = latency(fast.create_database(), count, 50.0)
    results["machine_after"] = {"load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}
    RESULTS_DIR.mkdir(exist_ok=True)
    # A partial run (--only, --profile) keeps the whole run's file as it is.
    name = "-".join(["scaling", *(opts.only or []), *(["profile"] if opts.profile else []),
                     *(["quick"] if opts.quick else [])])
    out = RESULTS_DIR / f"{name}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
