"""How one worker drains a backlog, round by round: `rota serve` as a subprocess, a
backlog of no-op jobs enqueued first, then one SDK worker in this process, so that its
own counters can be read: heartbeats sent, results per heartbeat, the round trip it
timed (a heartbeat with results to its ack), and the CPU each side spent per job.

    .venv/bin/python bench/drain.py --jobs 20000 --prefetch 0 40 160 320

Each prefetch gets a fresh server. Absolute figures drift with the machine's load;
compare figures from one invocation.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402  (bench/ is not a package)

from rota import JobContext, Worker  # noqa: E402
from rota.client.client import Client  # noqa: E402
from rota.base.specs import load_dir  # noqa: E402


def cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


async def drain(jobs: int, concurrency: int, prefetch: int) -> dict[str, float]:
    workdir = Path(tempfile.mkdtemp(prefix="rota-drain-"))
    children = tp.Children()
    try:
        setup = tp.prepare(workdir, concurrency)
        tp.start_server(setup, children)
        tp.push_specs(setup)
        with Client(setup.base_url) as client:
            for start in range(0, jobs, 1000):
                client.enqueue_batch([{"spec": tp.SPEC_NAME}] * min(1000, jobs - start))
        worker = Worker(url=setup.base_url.replace("http", "ws") + "/work",
                        specs_dir=setup.specs_dir, concurrency=concurrency, prefetch=prefetch,
                        handle_signals=False)

        @worker.handler(tp.SPEC_NAME)
        async def noop(ctx: JobContext) -> None:
            return None

        server = psutil.Process(children.items[0].proc.pid)
        me = psutil.Process()
        server_cpu, my_cpu, began = cpu(server), cpu(me), time.monotonic()
        task = asyncio.create_task(worker.run())
        async with httpx.AsyncClient(base_url=setup.base_url) as http:
            while (await http.get("/healthz")).json()["live_jobs"] > 0:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)  # noqa: sleep-ok (a poll step)
        took = time.monotonic() - began
        figures = {
            "prefetch": prefetch, "jobs_per_s": round(jobs / took),
            "heartbeats": worker.link.frames_sent,
            "results_per_heartbeat": round(worker.link.results_sent
                                           / max(1, worker.link.frames_sent), 1),
            "round_trip_ms": round(worker.link.round_trip * 1000, 2),
            "server_cpu_us_per_job": round((cpu(server) - server_cpu) / jobs * 1e6),
            "worker_cpu_us_per_job": round((cpu(me) - my_cpu) / jobs * 1e6),
        }
        worker.stop()
        await task
        return figures
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--prefetch", type=int, nargs="+", default=[0, 40, 160])
    args = parser.parse_args()
    for prefetch in args.prefetch:
        print(asyncio.run(drain(args.jobs, args.concurrency, prefetch)), flush=True)


if __name__ == "__main__":
    try:
        main()
    except subprocess.SubprocessError as exc:
        sys.exit(f"drain: {exc}")
