"""How many frames a worker sends for the jobs it runs, and what batching costs in delay.

Run from the repository root:

    .venv/bin/python bench/heartbeats.py --rate 1000 --seconds 5
    .venv/bin/python bench/heartbeats.py --rate 0 --jobs 20000 --workers 2 --concurrency 100
    .venv/bin/python bench/heartbeats.py --rate 1000 --sdk /tmp/rota-before   # another SDK

A ``rota serve`` subprocess (temp dir, free port) and ``--workers`` worker processes
(an SDK ``Worker`` with one async no-op handler, run by a small script) are started;
jobs are enqueued with ``Client.enqueue_batch`` paced at ``--rate`` jobs a second (0: as
fast as the server takes them, in batches of 1,000). The frames each worker sent are read
from the server's ``GET /workers`` (``heartbeats``), so an SDK from another checkout
(``--sdk``, put first on its PYTHONPATH) is measured the same way. Each worker counts the
runs of every job id (every job must run exactly once), and a new SDK also reports how
long each result waited between being ready and leaving in a heartbeat.

The frames-per-second figure is specific to Rota's protocol: no other queue has this
measure, so there is no reference system here (bench/throughput.py has the end-to-end
comparison). Figures go to bench/results/heartbeats-<rate>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORKER = '''
import asyncio, collections, json, os, random, signal, sys
from rota.worker.worker import Worker

WORK = float(sys.argv[5]) / 1000  # each job sleeps a uniform [0, WORK] seconds

runs = collections.Counter()
worker = Worker(url=sys.argv[1], specs_dir=sys.argv[2], concurrency=int(sys.argv[3]),
                worker_id=sys.argv[4])

@worker.handler("noop")
async def noop(ctx):
    runs[ctx.id] += 1
    if WORK:
        await asyncio.sleep(random.uniform(0, WORK))

async def main():
    if os.environ.get("SWITCH"):
        sys.setswitchinterval(float(os.environ["SWITCH"]))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, worker.terminate)
    await worker.run()
    delays = sorted(getattr(worker, "flush_delays", []))
    print(json.dumps({"runs": len(runs), "duplicates": sum(runs.values()) - len(runs),
                      "delays_ms": [d * 1000 for d in delays]}))

asyncio.run(main())
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise SystemExit(f"timed out waiting for {what}")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=1000.0, help="jobs/s (0: as fast as possible)")
    parser.add_argument("--seconds", type=float, default=5.0, help="paced: how long to enqueue")
    parser.add_argument("--jobs", type=int, default=20_000, help="unpaced: how many jobs")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--producers", type=int, default=0,
                        help="unpaced: this many threads enqueue one job per request"
                        " (0: batches of 1,000 from one thread)")
    parser.add_argument("--work-ms", type=float, default=0.0,
                        help="each job sleeps a uniform [0, this] ms (0: a no-op)")
    parser.add_argument("--sdk", help="a checkout whose rota package the workers import")
    parser.add_argument("--output", help="JSON file (default bench/results/heartbeats-<rate>.json)")
    args = parser.parse_args()

    from rota.client.client import Client  # noqa: E402 (the producer; this checkout's)

    tmp = Path(tempfile.mkdtemp(prefix="rota-hb-"))
    specs = tmp / "specs"
    specs.mkdir()
    (specs / "noop.toml").write_text('name = "noop"\nversion = "1"\n')
    (tmp / "worker.py").write_text(WORKER)
    port = free_port()
    rota = str(Path(sys.executable).parent / "rota")
    server_log = open(tmp / "server.log", "w")
    server = subprocess.Popen([rota, "serve", "--port", str(port), "--db", str(tmp / "rota.db")],
                              stdout=server_log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    if args.sdk:
        env["PYTHONPATH"] = args.sdk
    workers: list[subprocess.Popen[str]] = []
    try:
        wait_for(lambda: _ok(base), 20, "the server")
        subprocess.run([rota, "specs", "push", str(specs), "--url", base], check=True,
                       capture_output=True)
        for n in range(args.workers):
            workers.append(subprocess.Popen(
                [sys.executable, str(tmp / "worker.py"), f"ws://127.0.0.1:{port}/work",
                 str(specs), str(args.concurrency), f"w{n}", str(args.work_ms)],
                env=env, stdout=subprocess.PIPE, stderr=open(tmp / f"worker{n}.log", "w"),
                text=True))
        wait_for(lambda: len(_workers(base)) == args.workers, 20, "the workers")
        before = sum(w["heartbeats"] for w in _workers(base))
        client = Client(base)
        started = time.monotonic()
        total = 0
        if args.rate > 0:
            tick = 0.01
            per_tick = args.rate * tick
            owed = 0.0
            while time.monotonic() - started < args.seconds:
                owed += per_tick
                n = int(owed)
                owed -= n
                if n:
                    client.enqueue_batch([{"spec": "noop"} for _ in range(n)])
                    total += n
                next_at = started + tick * (round((time.monotonic() - started) / tick) + 1)
                time.sleep(max(0.0, next_at - time.monotonic()))
        elif args.producers:
            import concurrent.futures

            def produce(count: int) -> int:
                with Client(base) as own:
                    for _ in range(count):
                        own.enqueue("noop")
                return count

            share = [args.jobs // args.producers] * args.producers
            share[0] += args.jobs - sum(share)
            with concurrent.futures.ThreadPoolExecutor(args.producers) as pool:
                total = sum(pool.map(produce, share))
        else:
            while total < args.jobs:
                n = min(1000, args.jobs - total)
                client.enqueue_batch([{"spec": "noop"} for _ in range(n)])
                total += n
        enqueued_in = time.monotonic() - started

        def finished() -> bool:
            counts = httpx.get(f"{base}/queues").json()["queues"]
            done = sum(q["counts"].get("completed", 0) for q in counts)
            return done >= total

        wait_for(finished, 300, "every job to finish")
        elapsed = time.monotonic() - started
        after = sum(w["heartbeats"] for w in _workers(base))
        reports = []
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
            reports.append(json.loads(out.strip().splitlines()[-1]))
        delays = sorted(d for r in reports for d in r["delays_ms"])
        frames = after - before
        figures = {
            "benchmark": "rota heartbeats", "sdk": args.sdk or "this checkout",
            "rate_asked": args.rate, "producers": args.producers or 1, "jobs": total, "workers": args.workers,
            "concurrency": args.concurrency, "work_ms": args.work_ms, "seconds": round(elapsed, 3),
            "enqueue_seconds": round(enqueued_in, 3),
            "jobs_per_second": round(total / elapsed, 1),
            "frames": frames, "frames_per_second": round(frames / elapsed, 1),
            "frames_per_second_per_worker": round(frames / elapsed / args.workers, 1),
            "results_per_frame": round(total / max(1, frames), 2),
            "runs": sum(r["runs"] for r in reports),
            "duplicate_runs": sum(r["duplicates"] for r in reports),
            "batch_delay_ms": None if not delays else {
                "p50": round(percentile(delays, 0.5) or 0, 4),
                "p90": round(percentile(delays, 0.9) or 0, 4),
                "p99": round(percentile(delays, 0.99) or 0, 4),
                "mean": round(statistics.fmean(delays), 4)},
            "server_warnings": [line.strip() for line in (tmp / "server.log").read_text()
                                .splitlines() if " WARNING " in line or " ERROR " in line
                                if "AUTH IS OFF" not in line],
        }
        print(json.dumps(figures, indent=2))
        name = f"heartbeats-{int(args.rate)}.json" if args.rate else "heartbeats-max.json"
        out_path = Path(args.output or ROOT / "bench" / "results" / name)
        out_path.write_text(json.dumps(figures, indent=2) + "\n")
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def _ok(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _workers(base: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base}/workers").json()["workers"]


if __name__ == "__main__":
    main()
