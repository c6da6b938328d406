"""How long each dashboard page takes to render with a large store: `rota serve` as a
subprocess on a database filled with direct SQL inserts (1,000,000 jobs by default, most
of them finished, as on a server that has run for a while), a few connected workers, then
every page fetched in turn, sequentially, and timed from request to last byte.

    .venv/bin/python bench/dashboard.py                    # 1M jobs, 20 rounds
    .venv/bin/python bench/dashboard.py --jobs 100000 --rounds 5

Prints p50/p95/max per page, and its first render (the server's first look at the
finished jobs' counts never waits for them: rota/server/pages.py), and writes
bench/results/dashboard.json. The goal: every page under 300 ms with 1,000,000 jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402  (bench/ is not a package)

from rota import JobContext, Worker  # noqa: E402
from rota.client.client import Client  # noqa: E402
from rota.base.specs import load_dir  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BUDGET_MS = 300.0
QUEUES = ("default", "emails", "media", "reports")
SPECS = {"echo": "default", "send_email": "emails", "send_digest": "emails",
         "resize_image": "media", "transcode": "media", "monthly_report": "reports"}
# What a server that has run a while holds: mostly finished jobs, some waiting.
MIX = (("completed", 0.88), ("discarded", 0.06), ("cancelled", 0.02), ("available", 0.03),
       ("scheduled", 0.005), ("retryable", 0.005))
TRACEBACK = ('Traceback (most recent call last):\n  File "app/jobs.py", line 42, in send\n'
             '    smtp.send(message)\nConnectionRefusedError: [Errno 111] Connection refused\n')


def uuid7_at(ms: int, rand: random.Random) -> str:
    """A UUIDv7 for a given millisecond: ids sort as the jobs were enqueued."""
    tail = rand.getrandbits(74)
    value = (ms << 80) | (0x7 << 76) | ((tail >> 62) << 64) | (0b10 << 62) | (tail & ((1 << 62) - 1))
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def fill(db: Path, jobs: int, checksums: dict[str, str], seed: int = 14) -> dict[str, Any]:
    """Insert ``jobs`` rows straight into the jobs table, in one transaction."""
    rand = random.Random(seed)
    now = time.time()
    start = now - 2 * 86400  # enqueued over the last two days, in id order
    states = [state for state, share in MIX for _ in range(int(share * 1000))]
    names = list(SPECS)
    error = json.dumps([{"type": "ConnectionRefusedError", "message": "[Errno 111] refused",
                         "retryable": True, "details": {"traceback": TRACEBACK}, "attempt": 1,
                         "worker_id": "w-bench", "at": "2026-01-01T00:00:00.000Z"}])
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    began = time.monotonic()
    sample: dict[str, str] = {}

    def rows() -> Any:
        for n in range(jobs):
            enqueued = start + (now - start - 60) * n / jobs
            state = states[rand.randrange(len(states))]
            spec = names[n % len(names)]
            finished = enqueued + 0.5 if state in ("completed", "discarded", "cancelled") else None
            run_at = now + 3600 if state in ("scheduled", "retryable") else None
            job_id = uuid7_at(int(enqueued * 1000), rand)
            sample.setdefault(state, job_id)
            yield (job_id, spec, SPECS[spec], json.dumps({"n": n, "to": f"user{n}@example.com"}),
                   0, state, 1 if state != "available" else 0,
                   "w-bench" if state != "available" else None, checksums[spec], enqueued,
                   enqueued + 0.1 if finished else None, finished,
                   json.dumps({"ok": True}) if state == "completed" else None,
                   error if state in ("discarded", "retryable") else "[]", run_at)

    conn.executemany(
        "INSERT INTO jobs (id, spec, queue, args, priority, state, attempt, worker_id, checksum,"
        " enqueued_at, reserved_at, finished_at, result, errors, run_at)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows())
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return {"fill_s": round(time.monotonic() - began, 1), "sample": sample}


def write_specs(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, queue in SPECS.items():
        (directory / f"{name}.toml").write_text(
            f'name = "{name}"\nversion = "1"\nqueue = "{queue}"\n'
            f'description = "the {name.replace("_", " ")} job"\n')


def start_workers(base: str, specs_dir: Path, stale_dir: Path) -> tuple[list[Worker], Any]:
    """Workers that take none of the waiting jobs (so the figures hold still): two on a
    queue of their own, one declaring another version of the media specs."""
    loop = asyncio.new_event_loop()
    workers = [
        Worker(url=base, specs_dir=specs_dir, queues=["batch"], labels=["blue"],
               handle_signals=False, concurrency=8),
        Worker(url=base, specs_dir=specs_dir, queues=["batch"], labels=["green"],
               handle_signals=False, concurrency=8),
        Worker(url=base, specs_dir=stale_dir, queues=["media"], labels=["old"],
               handle_signals=False, concurrency=4),
    ]
    for worker, specs in zip(workers, (("echo",), ("echo",), ("resize_image", "transcode")),
                             strict=True):
        for name in specs:
            async def handler(ctx: JobContext) -> None:
                return None
            worker.handler(name)(handler)
    async def run_all() -> None:
        await asyncio.gather(*(w.run() for w in workers))

    thread = threading.Thread(target=loop.run_until_complete, args=(run_all(),), daemon=True)
    thread.start()
    return workers, (loop, thread)


def connected(base: str) -> int:
    with Client(base) as client:
        return len(client.workers()["workers"])


def time_pages(base: str, paths: list[str], rounds: int) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    with httpx.Client(base_url=base, timeout=60) as client:
        for path in paths:
            first = 0.0
            for _ in range(2):  # warm: templates compiled, pages of the file cached
                began = time.perf_counter()
                answer = client.get(path)
                first = first or (time.perf_counter() - began) * 1000
                if answer.status_code != 200:
                    raise tp.BenchError(f"GET {path}: {answer.status_code} {answer.text[:300]}")
            took = []
            for _ in range(rounds):
                began = time.perf_counter()
                answer = client.get(path)
                took.append((time.perf_counter() - began) * 1000)
                assert answer.status_code == 200, (path, answer.status_code)
            took.sort()
            figures[path] = {"p50_ms": round(took[len(took) // 2], 1),
                             "p95_ms": round(took[min(len(took) - 1, int(len(took) * 0.95))], 1),
                             "max_ms": round(took[-1], 1), "first_ms": round(first, 1),
                             "bytes": len(answer.content)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--results", type=Path, default=RESULTS)
    opts = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rota-dashboard-"))
    specs_dir, stale_dir = workdir / "specs", workdir / "stale"
    write_specs(specs_dir)
    write_specs(stale_dir)
    for name in ("resize_image", "transcode"):  # a version the status quo has moved past
        path = stale_dir / f"{name}.toml"
        path.write_text(path.read_text().replace('version = "1"', 'version = "0"'))
    setup = tp.Setup(workdir, workdir / "rota.db", specs_dir, f"http://127.0.0.1:{tp.free_port()}")
    children = tp.Children()
    workers: list[Worker] = []
    try:
        tp.start_server(setup, children)  # makes the database and its tables
        with Client(setup.base_url) as client:
            client.push_specs(load_dir(specs_dir))
            checksums = {s["name"]: s["checksum"] for s in client.specs()["specs"]}
        children.stop_all()
        print(f"filling {opts.jobs:,} jobs ...", flush=True)
        filled = fill(setup.db, opts.jobs, checksums)
        print(f"  {filled['fill_s']} s; starting the server on it ...", flush=True)
        children = tp.Children()
        began = time.monotonic()
        tp.start_server(setup, children)
        started_s = round(time.monotonic() - began, 1)
        workers, (loop, thread) = start_workers(setup.base_url, specs_dir, stale_dir)
        tp.wait_until("3 workers", lambda: connected(setup.base_url) >= 3, children, 30)
        sample = filled["sample"]
        paths = ["/ui", "/ui/queues", "/ui/specs", "/ui/workers", "/ui/jobs",
                 "/ui/jobs?state=discarded", "/ui/jobs?queue=emails&state=completed",
                 "/ui/jobs?q=ConnectionRefused", f"/ui/jobs?q={sample['completed'][:8]}",
                 f"/ui/jobs/{sample['discarded']}", f"/ui/jobs/{sample['completed']}",
                 "/ui/bulk?action=retry&state=discarded"]
        figures = time_pages(setup.base_url, paths, opts.rounds)
        worst = max(f["p95_ms"] for f in figures.values())
        report = {"timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                  "machine": tp.machine_info(), "jobs": opts.jobs, "rounds": opts.rounds,
                  "fill_s": filled["fill_s"], "server_start_s": started_s,
                  "budget_ms": BUDGET_MS, "worst_p95_ms": worst, "pages": figures}
        print(f"\nDashboard pages with {opts.jobs:,} jobs ({opts.rounds} rounds each, ms):")
        for path, f in figures.items():
            mark = "" if f["p95_ms"] < BUDGET_MS else "  OVER BUDGET"
            print(f"  {path:<48} p50 {f['p50_ms']:7.1f}  p95 {f['p95_ms']:7.1f}"
                  f"  max {f['max_ms']:7.1f}  first {f['first_ms']:7.1f}  {f['bytes']:>7} B{mark}")
        print(f"worst p95: {worst} ms (budget {BUDGET_MS:g} ms)")
        opts.results.mkdir(parents=True, exist_ok=True)
        out = opts.results / "dashboard.json"
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"written to {out}")
        for worker in workers:
            loop.call_soon_threadsafe(worker.stop_now)
        thread.join(15)
    finally:
        children.stop_all()
        if os.environ.get("KEEP_WORKDIR") is None:
            import shutil
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"workdir kept: {workdir}")


if __name__ == "__main__":
    main()
