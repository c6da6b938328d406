"""Rota beside a reference system (huey on a local redis), one scenario per command.

Run from the repository root (the reference needs ``pip install -e '.[bench]'`` and a
``redis-server`` on the PATH; bench/reference.py explains):

    .venv/bin/python bench/compare.py e2e        # 10,000 no-op jobs, 1 worker x 10, batch enqueue
    .venv/bin/python bench/compare.py latency    # 500 single enqueues at 100/s: enqueue -> handler start
    .venv/bin/python bench/compare.py producers  # one producer one job at a time; AsyncClient, 100 callers
    .venv/bin/python bench/compare.py growth     # e2e with 10k/100k/1M jobs kept; latency while 100k drain
    .venv/bin/python bench/compare.py idle       # 1,000 / 5,000 / 10,000 idle workers beating every 1 s, plain, lean and sparse
    .venv/bin/python bench/compare.py storm      # 10,000 workers reconnecting at once after a kill -9
    .venv/bin/python bench/compare.py backlog    # 1,000,000 waiting jobs: memory, and a restart
    .venv/bin/python bench/compare.py soak       # memory over minutes at a sustained rate
    .venv/bin/python bench/compare.py group      # a job in a workflow group beside a plain one
    .venv/bin/python bench/compare.py pull       # OJS pull workers: FETCH 1 + ACK, concurrency 10
    .venv/bin/python bench/compare.py push       # push execution: deliveries to a local endpoint, 50 in flight
    .venv/bin/python bench/compare.py all --quick

Each scenario runs Rota and then the reference in the same invocation, prints both with
their ratio, and writes ``bench/results/compare-<scenario>.json``. ``--quick`` shrinks
every size (for CI: it prints figures and asserts none). Absolute figures drift between
runs and machines; the ratio to the reference is what carries over.

Rota runs as it does for a user: ``rota serve`` with its defaults (INFO logging,
``synchronous=FULL``, an enqueue acknowledged after its commit) and ``rota worker``;
``--durability process`` starts it with ``rota serve --durability process`` instead (a
commit that survives Rota's crash, not the machine's), in every scenario but e2e and
e2e_keyed, and adds ``-process`` to the file names.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet  # noqa: E402
import pull_cost  # noqa: E402
import push_cost  # noqa: E402
import throughput as tp  # noqa: E402  (bench/ is not a package)
import workflow_cost  # noqa: E402

from rota.client.client import Client  # noqa: E402

T = TypeVar("T")
# ``--durability`` of the servers ``rota_server`` starts (every scenario but e2e and
# e2e_keyed, which bench/throughput.py runs): "full", a user's default, unless asked.
DURABILITY = ["full"]
RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The idle scenario's window per size and mode (issue 27 asks for 5 minutes: 300)
IDLE_SECONDS = float(os.environ.get("ROTA_BENCH_IDLE_SECONDS", "20"))
STAMP_WORKER = '''"""Written by bench/compare.py: its handler returns the moment it started."""

import time

from rota import JobContext, Worker

worker = Worker(specs_dir={specs_dir!r}, concurrency={concurrency})


@worker.handler({spec!r})
async def noop(ctx: JobContext) -> float:
    return time.time()
'''


# -- helpers ---------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reference() -> Any:
    """bench/reference.py, or None when huey or redis-server is missing here."""
    try:
        import reference as ref
    except ImportError as exc:
        print(f"  (reference unavailable: {exc})")
        return None
    if shutil.which("redis-server") is None:
        print("  (reference unavailable: no redis-server on the PATH)")
        return None
    return ref


def ratio(rota: float | None, ref: float | None) -> float | None:
    return round(rota / ref, 2) if rota and ref else None


@contextlib.contextmanager
def rota_server(*, concurrency: int = 10, worker_source: str = tp.WORKER_SOURCE,
                extra: list[str] | None = None) -> Iterator[tuple[tp.Setup, tp.Children]]:
    """A ``rota serve`` (default settings) in a temp dir with the no-op spec pushed."""
    workdir = Path(tempfile.mkdtemp(prefix="rota-compare-"))
    children = tp.Children()
    try:
        setup = tp.prepare(workdir, concurrency)
        (workdir / f"{tp.WORKER_MODULE}.py").write_text(worker_source.format(
            specs_dir=str(setup.specs_dir), concurrency=concurrency, spec=tp.SPEC_NAME))
        port = setup.base_url.rsplit(":", 1)[1]
        children.start("server", [sys.executable, "-m", "rota", "serve", "--port", port,
                                  "--db", str(setup.db), "--durability", DURABILITY[0],
                                  *(extra or [])], workdir)
        tp.wait_until("GET /healthz", lambda: tp._healthy(setup.base_url), children,
                      tp.STARTUP_TIMEOUT)
        tp.push_specs(setup)
        yield setup, children
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def server_process(children: tp.Children) -> psutil.Process:
    return psutil.Process(next(c for c in children.items if c.name == "server").proc.pid)


def rss_mib(proc: psutil.Process) -> float:
    return round(proc.memory_info().rss / 2**20, 1)


def cpu_percent_over(proc: psutil.Process, seconds: float) -> float:
    """Percent of one core the process used over the next ``seconds``."""
    before = proc.cpu_times()
    time.sleep(seconds)
    after = proc.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    return round(100 * used / seconds, 1)


# -- scenarios ---------------------------------------------------------------------------
def e2e(quick: bool) -> dict[str, Any]:
    """The issue's standard run: no-op jobs, one worker at concurrency 10, enqueued with
    enqueue_batch in requests of 1,000 while the worker runs."""
    jobs = 2_000 if quick else 10_000
    opts = tp.Options(jobs=jobs, workers=1, concurrency=10, producers=1, mode="stream",
                      client="httpx", timeout=300.0, batch=1000, keep=False, output=None)
    workdir = Path(tempfile.mkdtemp(prefix="rota-compare-"))
    children = tp.Children()
    try:
        try:
            figures = tp.run(opts, workdir, children)
        finally:
            children.stop_all()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rota = {"jobs": jobs, "enqueue_per_s": figures.enqueue_rate_per_s,
            "end_to_end_per_s": figures.end_to_end_throughput_per_s,
            "drain_per_s": figures.drain_throughput_per_s,
            "drain_while_enqueueing_per_s": figures.drain_while_enqueueing_per_s,
            "drain_after_enqueueing_per_s": figures.drain_after_enqueueing_per_s,
            "all_completed": figures.all_completed, "cpu_seconds": figures.cpu_seconds}
    ref = reference()
    huey = ref.huey_e2e(jobs=jobs, concurrency=10) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {
        "end_to_end": ratio(rota["end_to_end_per_s"], huey and huey.get("end_to_end_per_s")),
        "enqueue": ratio(rota["enqueue_per_s"], huey and huey.get("enqueue_per_s"))}}


def e2e_keyed(quick: bool) -> dict[str, Any]:
    """``e2e`` with per-key limits: each job carries one of 100 concurrency keys, and the
    spec allows 3 of a key at once (tp.KEYS, tp.KEY_LIMIT): the limited path's cost per
    job, beside the same huey run."""
    tp.KEYS = 100
    try:
        return e2e(quick)
    finally:
        tp.KEYS = 0


def _prefill(db_path: Path, kept: int) -> None:
    """``kept`` completed jobs in the store, as a server that has run them leaves it."""
    from rota.store import migrations as db_migrations

    db_migrations.migrate(db_path)
    with contextlib.closing(sqlite3.connect(db_path)) as conn:
        now = time.time() - 3600
        rows = ((f"{tp.KEPT_PREFIX}{n:08d}", tp.SPEC_NAME, "default", "{}", 0, "completed", 1, "w",
                 now + n / 1000, now + n / 1000, now + n / 1000, "null") for n in range(kept))
        conn.executemany("INSERT INTO jobs (id, spec, queue, args, priority, state, attempt,"
                         " worker_id, enqueued_at, reserved_at, finished_at, result)"
                         " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        conn.commit()


def growth(quick: bool) -> dict[str, Any]:
    """How the cost grows with the work: the e2e run against a store that already keeps
    10,000 / 100,000 / 1,000,000 completed jobs; then the latency of urgent jobs (priority
    10, single POST /jobs at 100/s) while a backlog of 100,000 drains."""
    sizes = [10_000, 50_000] if quick else [10_000, 100_000, 1_000_000]
    rota: dict[str, Any] = {"e2e_per_s_by_jobs_kept": {}}
    for kept in sizes:
        opts = tp.Options(jobs=2_000 if quick else 10_000, workers=1, concurrency=10,
                          producers=1, mode="stream", client="httpx", timeout=300.0,
                          batch=1000, keep=False, output=None)
        workdir = Path(tempfile.mkdtemp(prefix="rota-compare-"))
        children = tp.Children()
        try:
            _prefill(workdir / "rota.db", kept)
            try:
                figures = tp.run(opts, workdir, children)
            finally:
                children.stop_all()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        rota["e2e_per_s_by_jobs_kept"][str(kept)] = figures.end_to_end_throughput_per_s
        print(f"  kept {kept}: {figures.end_to_end_throughput_per_s} jobs/s end to end")
    backlog = 10_000 if quick else 100_000
    probes = 100 if quick else 300
    with rota_server(worker_source=STAMP_WORKER) as (setup, children):
        body = [{"spec": tp.SPEC_NAME, "args": {}} for _ in range(1000)]
        with httpx.Client(base_url=setup.base_url, timeout=120) as http:
            for _ in range(backlog // 1000):
                http.post("/jobs/batch", json={"jobs": body}).raise_for_status()
        tp.start_workers(setup, 1, children)
        sent: dict[str, float] = {}
        calls: list[float] = []
        with Client(setup.base_url) as client:
            due = time.monotonic()
            for _ in range(probes):
                due += 0.01
                while time.monotonic() < due:
                    pass
                start = time.time()
                job = client.enqueue(tp.SPEC_NAME, {}, priority=10)["job"]
                calls.append(time.time() - start)
                sent[job["id"]] = start
            draining = client.queues()["queues"][0]["counts"]["available"]
        tp.wait_for_completion(setup.db, backlog + probes, 300.0, children, setup.base_url)
        with contextlib.closing(sqlite3.connect(setup.db)) as db:
            rows = db.execute("SELECT id, result FROM jobs WHERE priority = 10").fetchall()
    waits = [json.loads(result) - sent[job_id] for job_id, result in rows]
    rota["while_draining"] = {
        "backlog": backlog, "still_waiting_after_probes": draining, "probes": probes,
        "enqueue_call_p50_ms": round(percentile(calls, 0.5) * 1e3, 3),
        "enqueue_call_p99_ms": round(percentile(calls, 0.99) * 1e3, 3),
        "handler_start_p50_ms": round(percentile(waits, 0.5) * 1e3, 3),
        "handler_start_p99_ms": round(percentile(waits, 0.99) * 1e3, 3)}
    ref = reference()
    huey = ref.huey_e2e(jobs=2_000 if quick else 10_000) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {
        kept: ratio(per_s, huey and huey.get("end_to_end_per_s"))
        for kept, per_s in rota["e2e_per_s_by_jobs_kept"].items()}}


def paced(count: int, call: Callable[[], T]) -> list[tuple[float, float, T]]:
    """``call`` made ``count`` times, 100 a second, each after a busy wait (sleep()
    overshoots by ~0.1 ms): the wall clock at each one's start, its seconds, its value."""
    made: list[tuple[float, float, T]] = []
    due = time.monotonic()
    for _ in range(count):
        due += 0.01
        while time.monotonic() < due:
            pass
        start, began = time.time(), time.perf_counter()
        value = call()
        made.append((start, time.perf_counter() - began, value))
    return made


def latency(quick: bool) -> dict[str, Any]:
    """Single POST /jobs at 100 a second; from just before the call to the handler's start.
    One worker at concurrency 10, so a job never waits for a slot."""
    count = 100 if quick else 500
    with rota_server(worker_source=STAMP_WORKER) as (setup, children):
        tp.start_workers(setup, 1, children)
        sent: dict[str, float] = {}
        calls: list[float] = []
        with Client(setup.base_url) as client:
            for start, took, job in paced(count, lambda: client.enqueue(tp.SPEC_NAME, {})["job"]):
                calls.append(took)
                sent[job["id"]] = start
        tp.wait_for_completion(setup.db, count, 60.0, children, setup.base_url)
        with contextlib.closing(sqlite3.connect(setup.db)) as db:
            rows = db.execute("SELECT id, result FROM jobs").fetchall()
    waits = [json.loads(result) - sent[job_id] for job_id, result in rows]
    rota = {"jobs": count, "p50_ms": round(percentile(waits, 0.5) * 1e3, 3),
            "p99_ms": round(percentile(waits, 0.99) * 1e3, 3),
            "enqueue_call_p50_ms": round(percentile(calls, 0.5) * 1e3, 3)}
    ref = reference()
    huey = ref.huey_latency(n=count, rate=100) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {
        "p50": ratio(rota["p50_ms"], huey and huey.get("p50_ms")),
        "p99": ratio(rota["p99_ms"], huey and huey.get("p99_ms"))}}


def producers(quick: bool) -> dict[str, Any]:
    """One producer enqueueing one job at a time with the sync Client (a worker running
    them, as in the e2e run), then 100 concurrent callers of one AsyncClient (no worker:
    only the enqueue path). Every enqueue is acknowledged after its commit."""
    try:
        from rota.client.producer import AsyncClient
    except ImportError:  # an older checkout (--label before): only the sync client
        AsyncClient = None  # noqa: N806

    single_n = 1_000 if quick else 5_000
    many_n = 4_000 if quick else 20_000
    callers = 100
    with rota_server() as (setup, children):
        tp.start_workers(setup, 1, children)
        with Client(setup.base_url) as client:
            client.enqueue(tp.SPEC_NAME, {})  # the connection is open before the clock starts
            started = time.perf_counter()
            for _ in range(single_n):
                client.enqueue(tp.SPEC_NAME, {})
            single = single_n / (time.perf_counter() - started)
    concurrent, requests = 0.0, 0
    with rota_server() as (setup, children):
        async def many() -> tuple[float, int]:
            assert AsyncClient is not None
            async with AsyncClient(setup.base_url) as client:
                await client.enqueue(tp.SPEC_NAME, {})
                per = many_n // callers

                async def caller() -> None:
                    for _ in range(per):
                        await client.enqueue(tp.SPEC_NAME, {})

                started = time.perf_counter()
                await asyncio.gather(*(caller() for _ in range(callers)))
                return per * callers / (time.perf_counter() - started), client.requests - 1

        if AsyncClient is not None:
            concurrent, requests = asyncio.run(many())
    rota = {"single_producer_per_s": round(single), "single_jobs": single_n,
            "async_client_100_callers_per_s": round(concurrent), "async_jobs": many_n,
            "async_requests": requests}
    ref = reference()
    huey = ({"single": ref.huey_single_producer(single_n),
             "concurrent": ref.huey_concurrent_producers(many_n, callers)} if ref else None)
    return {"rota": rota, "reference": huey, "ratio": {
        "single": ratio(rota["single_producer_per_s"], huey and huey["single"]["jobs_per_s"]),
        "concurrent": ratio(rota["async_client_100_callers_per_s"],
                            huey and huey["concurrent"]["jobs_per_s"])}}


def idle(quick: bool) -> dict[str, Any]:
    """Idle workers that only beat, once a second each, from bench/fleet.py's clients (raw
    sockets over two processes, cheap enough to really send N beats a second): the
    server's CPU and memory, the beats really sent, and the WARNING/ERROR lines (stall
    warnings among them) its log gained over the window. Each size runs three times:
    plain (an ack for every beat), ``--lean`` (registered with ``"lean_acks": true``) and
    ``--sparse`` (with ``"idle_ack_interval": 10`` too, as the Python SDK registers)."""
    fleet.raise_nofile()  # inherited by the server
    sizes = [200, 1000] if quick else [1000, 5000, 10000]
    seconds = 3.0 if quick else IDLE_SECONDS
    rota: dict[str, Any] = {"plain": {}, "lean": {}, "sparse": {}}
    for size in sizes:
        for mode in rota:
            with rota_server(extra=["--max-connections", str(size + 500),
                                    "--max-worker-connections-per-token", str(size + 500)]
                             ) as (setup, children):
                proc = server_process(children)
                server = next(c for c in children.items if c.name == "server")
                url = setup.base_url.replace("http", "ws", 1) + "/work"
                figures = fleet.measure_idle(url, size, seconds, lean=mode == "lean",
                                             sparse=mode == "sparse", server_pid=proc.pid,
                                             log_path=server.log_path)
            rota[mode][str(size)] = figures
            print(f"  rota, {size} idle workers, {mode}: {figures['server_cpu_percent']} % of"
                  f" a core, {figures['server_rss_mib']} MiB, {figures['beats_per_s']} beats/s,"
                  f" {figures['server_log_window']['stall_warnings']} stall warnings,"
                  f" client failures {figures['client_failures']}")
    ref = reference()
    redis = {str(size): ref.redis_idle(size) for size in sizes} if ref else None
    return {"rota": rota, "reference": redis, "ratio": {
        f"{mode}_{size}": ratio(rota[mode][size]["server_cpu_percent"],
                                redis and redis[size].get("cpu_percent"))
        for mode in rota for size in rota[mode]}}


def storm(quick: bool) -> dict[str, Any]:
    """A reconnect storm (bench/fleet.py): N workers registered and beating, the server
    killed with SIGKILL and started again on its port and database, every worker
    reconnecting at once with the SDK's backoff. Until all are registered again, and
    what went wrong on either side. No reference: a redis client has no such storm."""
    rota = fleet.storm(1000 if quick else 10000)
    print(f"  rota, storm of {rota['workers']} ({rota['registered_before_kill']} registered"
          f" before the kill, {rota['registered_after']} after):"
          f" all back {rota['kill_to_all_registered_s']} s"
          f" after the kill ({rota['healthz_to_all_registered_s']} s after /healthz),"
          f" client failures {rota['client_failures_in_storm']},"
          f" server log {rota['server_log_after_restart']['warning_or_error_lines']} WARNING/"
          f"ERROR lines, {rota['server_log_after_restart']['stall_warnings']} stalls")
    return {"rota": rota, "reference": None, "ratio": {}}


def backlog(quick: bool) -> dict[str, Any]:
    """N waiting jobs (no worker): the server's memory, and how soon a restart answers."""
    count = 50_000 if quick else 1_000_000
    with rota_server() as (setup, children):
        proc = server_process(children)
        before = rss_mib(proc)
        started = time.monotonic()
        body = [{"spec": tp.SPEC_NAME, "args": {"n": 0}} for _ in range(1000)]
        with httpx.Client(base_url=setup.base_url, timeout=120) as http:
            for _ in range(count // 1000):
                response = http.post("/jobs/batch", json={"jobs": body})
                response.raise_for_status()
        enqueue_s = time.monotonic() - started
        held = rss_mib(proc)
        server = next(c for c in children.items if c.name == "server")
        server.proc.terminate()
        server.proc.wait(60)
        children.items.remove(server)
        server.log_file.close()
        port = setup.base_url.rsplit(":", 1)[1]
        restarted = time.monotonic()
        again = children.start("server-again", [sys.executable, "-m", "rota", "serve",
                                                "--port", port, "--db", str(setup.db)],
                               setup.workdir)
        tp.wait_until("GET /healthz after restart", lambda: tp._healthy(setup.base_url),
                      children, 120)
        restart_s = time.monotonic() - restarted
        after_restart = rss_mib(psutil.Process(again.proc.pid))
    rota = {"jobs": count, "enqueue_s": round(enqueue_s, 1), "rss_mib_empty": before,
            "rss_mib_holding": held, "kib_per_job": round((held - before) * 1024 / count, 3),
            "restart_to_healthz_s": round(restart_s, 2), "rss_mib_after_restart": after_restart}
    ref = reference()
    redis = ref.redis_backlog(jobs=count) if ref else None
    return {"rota": rota, "reference": redis, "ratio": {
        "memory": ratio(held, redis and redis.get("rss_mib"))}}


def soak(quick: bool, minutes: float | None = None) -> dict[str, Any]:
    """Jobs stream through at the highest rate the machine sustains (one worker at
    concurrency 50, a producer keeping ~5,000 jobs waiting); the server's RSS is sampled
    every 5 s. After warm-up it must stay flat: nothing may be kept per finished job."""
    seconds = 30.0 if quick else 60.0 * (minutes or 10.0)
    curve: list[tuple[float, float, int]] = []  # (elapsed s, RSS MiB, completed jobs)
    with rota_server(concurrency=50) as (setup, children):
        tp.start_workers(setup, 1, children)
        proc = server_process(children)
        body = [{"spec": tp.SPEC_NAME, "args": {}} for _ in range(1000)]
        started = time.monotonic()
        next_sample = started
        with httpx.Client(base_url=setup.base_url, timeout=60) as http:
            while (now := time.monotonic()) - started < seconds:
                if http.get("/healthz").json()["live_jobs"] < 5000:  # cheap: from memory
                    http.post("/jobs/batch", json={"jobs": body}).raise_for_status()
                if now >= next_sample:
                    with contextlib.closing(sqlite3.connect(setup.db)) as db:
                        done = db.execute("SELECT count(*) FROM jobs WHERE state = 'completed'"
                                          ).fetchone()[0]
                    curve.append((round(now - started, 1), rss_mib(proc), done))
                    next_sample += 5.0
                else:
                    time.sleep(0.02)
    warm = [rss for elapsed, rss, _ in curve if elapsed >= min(60.0, seconds / 3)]
    rate = (curve[-1][2] - curve[0][2]) / max(1e-9, curve[-1][0] - curve[0][0])
    rota = {"seconds": seconds, "jobs_per_s": round(rate), "curve": curve,
            "rss_after_warmup_min_mib": min(warm) if warm else None,
            "rss_after_warmup_max_mib": max(warm) if warm else None,
            "growth_after_warmup_mib": round(max(warm) - warm[0], 1) if warm else None}
    ref = reference()
    # The reference runs at most 2 minutes: long enough to see a trend, short enough to
    # keep one invocation of the full soak under a quarter of an hour.
    huey = ref.huey_soak(min(seconds, 120.0)) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {}}


def group(quick: bool) -> dict[str, Any]:
    """A job in a group against a plain job (bench/workflow_cost.py)."""
    return workflow_cost.group(quick, rota_server, reference, ratio)


def pull(quick: bool) -> dict[str, Any]:
    """OJS pull workers, FETCH of 1 and ACK at concurrency 10 (bench/pull_cost.py)."""
    return pull_cost.pull(quick, rota_server, server_process, reference, ratio)


def push(quick: bool) -> dict[str, Any]:
    """Push execution, 50 deliveries in flight to a local endpoint (bench/push_cost.py)."""
    return push_cost.push(quick, rota_server, server_process, reference, ratio)


SCENARIOS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "e2e": e2e, "e2e_keyed": e2e_keyed, "latency": latency, "producers": producers, "growth": growth, "idle": idle, "storm": storm, "backlog": backlog, "soak": soak,
    "group": group, "pull": pull, "push": push}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--quick", action="store_true", help="small sizes (for CI)")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR,
                        help="where the JSON goes (default bench/results)")
    parser.add_argument("--label", default="",
                        help="added to the file names (e.g. 'before', for another checkout)")
    parser.add_argument("--durability", choices=["full", "process"], default="full",
                        help="rota serve's --durability, in every scenario but e2e and"
                             " e2e_keyed (default full, as a user runs it)")
    opts = parser.parse_args(argv)
    DURABILITY[0] = opts.durability
    names = list(SCENARIOS) if opts.scenario == "all" else [opts.scenario]
    opts.results.mkdir(parents=True, exist_ok=True)
    for name in names:
        print(f"== {name}{' (quick)' if opts.quick else ''}")
        figures = SCENARIOS[name](opts.quick)
        document = {"scenario": name, "quick": opts.quick,
                    "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "machine": tp.machine_info(), **figures}
        print(json.dumps({k: figures[k] for k in ("rota", "reference", "ratio")}, indent=1)
              [:4000])
        document["durability"] = opts.durability
        suffix = (("-quick" if opts.quick else "") + (f"-{opts.label}" if opts.label else "")
                  + ("-process" if opts.durability == "process" else ""))
        path = opts.results / f"compare-{name}{suffix}.json"
        path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2) + b"\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
