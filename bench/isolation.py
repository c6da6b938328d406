"""What ``isolation="process"`` costs a job, beside a thread (and an ``async def``
handler, the reference: a run with neither), all in the same run, rounds alternating.

Run from the repository root:

    .venv/bin/python bench/isolation.py --jobs 2000 --rounds 3 --concurrency 1 10

Two parts. **The runner alone**: the worker's Runner (rota/worker/execution.py) on an
event loop with no server, fed ``--jobs`` no-op jobs as a worker's line feeds it (a few
beyond its slots): the cost of a run itself (a thread started per run, or two pipe
messages to a child kept since the warm-up). **End to end**: a temp dir gets a SQLite db,
one no-op spec per mode and a worker module that registers them (``noop_async``,
``noop_thread`` on a thread, ``noop_process`` in a child process); one ``rota serve`` and
one ``rota worker`` run as subprocesses. Each round enqueues ``--jobs`` jobs of one spec
(batches of 1,000) and times them from the first enqueue to the last one finished
(``GET /queues``). A warm-up round of each mode comes first in both parts, so that the
children exist (a pool, kept across jobs) and the timings are the steady state. The
figures: jobs/s and wall µs per job, and end to end the CPU the worker and every process
below it (the fork server and its children) used per job. Printed, and written as JSON to
``bench/results/isolation.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncio

import httpx
import psutil
from throughput import free_port

from rota.base import protocol as p
from rota.worker.context import JobContext, StatusBuffer
from rota.worker.execution import Runner

WORKER = """
from rota import Worker

worker = Worker(specs_dir="specs", concurrency={concurrency}, heartbeat_interval=0.05)


@worker.handler("noop_async")
async def noop_async(ctx):
    return None


@worker.handler("noop_thread", isolation="thread")
def noop_thread(ctx):
    return None


@worker.handler("noop_process", isolation="process")
def noop_process(ctx):
    return None
"""
MODES = ("async", "thread", "process")  # async: the reference, a run with no thread
RESULTS = Path(__file__).resolve().parent / "results" / "isolation.json"


def noop(ctx: JobContext) -> None:
    """The runner part's handler (a child finds it in this script, as ``__mp_main__``)."""


async def anoop(ctx: JobContext) -> None:
    """The same as a coroutine: run as a task on the loop, no thread, no child."""


async def through_runner(mode: str, jobs: int, concurrency: int) -> list[float]:
    """µs per job for three rounds in one Runner, after a warm-up round whose first
    job (alone: the fork server and a child start for it) comes first in the list."""
    results: list[p.Result | None] = []
    done = asyncio.Event()
    wanted = 0
    waiting: list[p.JobCopy] = []  # fed as a worker's line is: a few beyond the slots

    def report(result: p.Result | None) -> None:
        if result is not None:
            assert result.outcome == "completed", result
            results.append(result)
            if waiting:
                runner.take(waiting.pop())
            if len(results) >= wanted:
                done.set()

    handler = anoop if mode == "async" else noop
    runner = Runner(worker_id="bench", handlers={"noop": handler}, concurrency=concurrency,
                    status=StatusBuffer(wake=lambda: None), report=report,
                    max_abandoned=1_000_000, on_wedged=lambda: None, prefetch=jobs,
                    isolation="process" if mode == "process" else "thread")
    runner.children.register("noop", handler)
    figures = []
    try:
        for round_number in range(5):  # a first job alone, then the warm-up
            count = (1, concurrency * 2)[round_number] if round_number < 2 else jobs
            wanted, done = len(results) + count, asyncio.Event()
            started = time.perf_counter()
            waiting[:] = [p.JobCopy(id=f"{round_number}-{n}", spec="noop", checksum="c",
                                    queue="default", args={}, attempt=1, priority=0,
                                    visibility_timeout=60.0,
                                    enqueued_at="2026-11-27T00:00:00.000Z")
                          for n in range(count)]
            for _ in range(min(count, 2 * concurrency)):
                runner.take(waiting.pop())
            await asyncio.wait_for(done.wait(), 120)
            if round_number != 1:
                figures.append((time.perf_counter() - started) / count * 1e6)
    finally:
        runner.stop_all()
    return figures


def wait(what: str, check: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)  # noqa: sleep-ok (a poll)


def completed(http: httpx.Client) -> int:
    queues = http.get("/queues").json()["queues"]
    return sum(q["counts"].get("completed", 0) for q in queues)


def cpu(proc: psutil.Process) -> float:
    """CPU seconds of the worker and of every process below it (the fork server and the
    children it started are the worker's descendants)."""
    total = 0.0
    for each in [proc, *proc.children(recursive=True)]:
        try:
            times = each.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def round_(http: httpx.Client, worker: psutil.Process, mode: str, jobs: int,
           done_before: int) -> dict[str, float]:
    cpu_before = cpu(worker)
    started = time.perf_counter()
    for start in range(0, jobs, 1000):
        body = {"jobs": [{"spec": f"noop_{mode}"} for _ in range(min(1000, jobs - start))]}
        assert http.post("/jobs/batch", json=body).status_code == 200
    wait(f"{jobs} {mode} jobs", lambda: completed(http) >= done_before + jobs)
    took = time.perf_counter() - started
    return {"jobs_per_s": jobs / took, "us_per_job": took / jobs * 1e6,
            "worker_cpu_us_per_job": (cpu(worker) - cpu_before) / jobs * 1e6}


def measure(concurrency: int, jobs: int, rounds: int, keep: bool) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="rota-isolation-"))
    (tmp / "specs").mkdir()
    for mode in MODES:
        (tmp / "specs" / f"noop_{mode}.toml").write_text(
            f'name = "noop_{mode}"\nversion = "1"\nqueue = "default"\n')
    (tmp / "bench_worker.py").write_text(WORKER.format(concurrency=concurrency))
    url = f"http://127.0.0.1:{free_port()}"
    rota = [sys.executable, "-m", "rota"]
    logs = [open(tmp / name, "w") for name in ("server.log", "worker.log")]
    procs = [subprocess.Popen([*rota, "serve", "--port", url.rsplit(":", 1)[1], "--db",
                               str(tmp / "rota.db"), "--log-level", "warning"],
                              cwd=tmp, stdout=logs[0], stderr=subprocess.STDOUT)]
    try:
        with httpx.Client(base_url=url, timeout=10) as http:
            wait("the server", lambda: _up(http))
            subprocess.run([*rota, "specs", "push", "specs", "--url", url], cwd=tmp,
                           check=True, capture_output=True)
            procs.append(subprocess.Popen([*rota, "worker", "bench_worker:worker", "--url", url,
                                           "--log-level", "warning"], cwd=tmp,
                                          stdout=logs[1], stderr=subprocess.STDOUT))
            wait("the worker", lambda: bool(http.get("/workers").json()["workers"]))
            worker = psutil.Process(procs[1].pid)
            done = 0
            for mode in MODES:  # warm-up: the fork server and the children start here
                round_(http, worker, mode, min(jobs, 200), done)
                done += min(jobs, 200)
            figures: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for _ in range(rounds):
                for mode in MODES:
                    figures[mode].append(round_(http, worker, mode, jobs, done))
                    done += jobs
            return {"concurrency": concurrency, "jobs": jobs, "rounds": figures}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(30)
        for log in logs:
            log.close()
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _up(http: httpx.Client) -> bool:
    try:
        return http.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each mode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    alone = {f"{mode}, concurrency {c}": asyncio.run(through_runner(mode, args.jobs, c))
             for c in args.concurrency for mode in MODES}
    for name, (first, *figures) in alone.items():
        print(f"runner alone, {name}: " + ", ".join(f"{f:,.0f}" for f in figures)
              + f" µs a job ({1e6 / statistics.median(figures):,.0f} jobs/s); the first job"
              f" {first / 1000:,.1f} ms")
    runs = [measure(c, args.jobs, args.rounds, args.keep) for c in args.concurrency]
    machine = {"python": platform.python_version(), "cpus": os.cpu_count(),
               "machine": platform.machine(), "system": platform.platform(),
               "load_1m": os.getloadavg()[0]}
    for run in runs:
        print(f"concurrency {run['concurrency']}, {run['jobs']} jobs a round:")
        for mode in MODES:
            rounds = run["rounds"][mode]
            rates = ", ".join(f"{r['jobs_per_s']:,.0f}" for r in rounds)
            median = statistics.median(r["us_per_job"] for r in rounds)
            cpu_median = statistics.median(r["worker_cpu_us_per_job"] for r in rounds)
            print(f"  {mode:8} jobs/s {rates}; median {median:,.0f} µs a job, worker CPU"
                  f" {cpu_median:,.0f} µs a job")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine, "runner_alone_us_per_job": alone,
                                   "end_to_end": runs}, indent=1) + "\n")
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
