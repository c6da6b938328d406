"""One producer enqueueing one job at a time, with a worker running the jobs (the single
producer of ``bench/compare.py producers``, without huey's run), and where the CPU goes:
the jobs a second, and the CPU microseconds a job of the server (its loop, the main
thread, and its other threads: the writer above all), of the worker and of this
producer, user and system apart.

    .venv/bin/python bench/one_producer.py [--durability full|process] [--jobs 5000]
        [--no-worker] [--runs 1]

Each run starts its own ``rota serve`` on a new SQLite file (bench/compare.py's
``rota_server``); the clock starts after the producer's first enqueue (its connection
open) and the worker's registration.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (bench/ is not a package)
import throughput as tp  # noqa: E402

from rota.client.client import Client  # noqa: E402


def _times(proc: psutil.Process) -> tuple[float, float]:
    times = proc.cpu_times()
    return times.user, times.system


def _threads(proc: psutil.Process) -> dict[int, tuple[float, float]]:
    return {t.id: (t.user_time, t.system_time) for t in proc.threads()}


def run(durability: str, jobs: int, worker: bool) -> dict[str, Any]:
    """One run: its rate, and CPU µs a job (user, system) by process and server thread."""
    compare.DURABILITY[0] = durability
    with compare.rota_server() as (setup, children):
        if worker:
            tp.start_workers(setup, 1, children)
        server = compare.server_process(children)
        procs = {"server": server, "producer": psutil.Process()}
        if worker:
            procs["worker"] = psutil.Process(next(
                c for c in children.items if c.name.startswith("worker")).proc.pid)
        with Client(setup.base_url) as client:
            client.enqueue(tp.SPEC_NAME, {})  # the connection is open before the clock starts
            before = {name: _times(proc) for name, proc in procs.items()}
            threads = _threads(server)
            started = time.perf_counter()
            for _ in range(jobs):
                client.enqueue(tp.SPEC_NAME, {})
            elapsed = time.perf_counter() - started
            after = {name: _times(proc) for name, proc in procs.items()}
            threads_after = _threads(server)

    def per_job(pair: tuple[float, float], base: tuple[float, float]) -> list[int]:
        return [round((now - then) / jobs * 1e6) for now, then in zip(pair, base)]

    loop = per_job(threads_after.get(server.pid, (0.0, 0.0)), threads.get(server.pid, (0.0, 0.0)))
    others = [0, 0]
    for tid, pair in threads_after.items():
        if tid != server.pid and tid in threads:
            others = [a + b for a, b in zip(others, per_job(pair, threads[tid]))]
    return {"durability": durability, "worker": worker, "jobs": jobs,
            "jobs_per_s": round(jobs / elapsed), "us_per_job": round(elapsed / jobs * 1e6),
            "cpu_us_per_job": {name: per_job(after[name], before[name]) for name in procs},
            "server_threads_us_per_job": {"loop": loop, "others": others}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--durability", choices=["full", "process"], default="full")
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--no-worker", action="store_true", help="only the enqueue path")
    parser.add_argument("--runs", type=int, default=1)
    opts = parser.parse_args(argv)
    for _ in range(opts.runs):
        figures = run(opts.durability, opts.jobs, not opts.no_worker)
        cpu = ", ".join(f"{name} {u}+{s}" for name, (u, s) in figures["cpu_us_per_job"].items())
        loop, others = figures["server_threads_us_per_job"].values()
        print(f"{figures['durability']}, {'a worker' if figures['worker'] else 'no worker'}:"
              f" {figures['jobs_per_s']} jobs/s ({figures['us_per_job']} µs a job); CPU µs a"
              f" job (user+system): {cpu}; the server's loop {loop[0]}+{loop[1]}, its other"
              f" threads {others[0]}+{others[1]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
