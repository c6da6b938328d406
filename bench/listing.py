"""GET /jobs against a store of 1,000,000 jobs: how long each kind of filter takes.

Run from the repository root:

    .venv/bin/python bench/listing.py                 # 1,000,000 jobs
    .venv/bin/python bench/listing.py --jobs 100000   # smaller
    .venv/bin/python bench/listing.py --db /tmp/big.db  # keep (and reuse) the filled file
    .venv/bin/python bench/listing.py --index-cost      # what the listing's indexes cost writes

What happens: a SQLite file is migrated as ``rota serve`` would, then filled with
``--jobs`` rows by plain SQL inserts (as a server that ran them would leave them: 88 %
completed, 5 % discarded with an error record, 2 % cancelled, 5 % available), spread
over 10 specs, 3 queues and 20 workers. ``rota serve`` starts on it as a subprocess and
each filter is asked ``--rounds`` times, one request at a time on one keep-alive
connection; then pages are followed by their cursor. Figures (p50 and p95 in ms,
client-side, for the whole request) are printed and written to
``bench/results/listing.json``.

``--index-cost`` measures instead what migration m011's indexes cost the writes every
job makes, in CPU time per job: its insert (batches of 1,000, one commit each,
``synchronous=FULL`` as the server runs), and the insert with its reservation (state
and worker set) and its result (state again), on a store that already holds
``--jobs`` (default here 200,000) finished ones, with and without the indexes (and
with each left out), ``--rounds`` times alternating; medians are written to
``bench/results/listing-index-cost.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from rota.store import sqlite as rota_db, migrations as db_migrations
from rota.base.ids import uuid7

RESULTS = Path(__file__).resolve().parent / "results"
SPECS = [f"spec{n}" for n in range(10)]
QUEUES = ["default", "mail", "reports"]
WORKERS = [f"worker-{n:02d}" for n in range(20)]
NEEDLE = "card-declined-4417"  # in one discarded job's error out of 1,000


def fill(path: Path, count: int) -> float:
    """``count`` jobs in a fresh, migrated store; seconds it took."""
    started = time.perf_counter()
    db_migrations.migrate(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA synchronous = OFF")
        now = time.time() - count / 100  # a hundred jobs a second, ending now

        def rows() -> Any:
            for n in range(count):
                at = now + n / 100
                spec, queue = SPECS[n % 10], QUEUES[n % 10 % 3]
                kind = n % 100
                if kind < 88:
                    state, worker, finished, errors = "completed", WORKERS[n % 20], at + 1, "[]"
                elif kind < 93:
                    message = NEEDLE if n % 1000 == 88 else f"timeout talking to db-{n % 50}"
                    errors = json.dumps([{"type": "ValueError", "message": message,
                                          "retryable": False, "attempt": 1, "at": at}])
                    state, worker, finished = "discarded", WORKERS[n % 20], at + 1
                elif kind < 95:
                    state, worker, finished, errors = "cancelled", None, at + 1, "[]"
                else:
                    state, worker, finished, errors = "available", None, None, "[]"
                yield (uuid7(), spec, queue, "{}", 0, state, 1 if worker else 0, worker, at,
                       at if worker else None, finished, errors)

        with conn:
            conn.executemany(
                "INSERT INTO jobs (id, spec, queue, args, priority, state, attempt, worker_id,"
                " enqueued_at, reserved_at, finished_at, errors)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows())
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return time.perf_counter() - started


M011_INDEXES = ("idx_jobs_state", "idx_jobs_state_spec", "idx_jobs_state_worker")
# Which of m011's indexes each variant drops.
VARIANTS = {"without": M011_INDEXES, "with": (), "no (state)": ("idx_jobs_state",),
            "no (state, spec)": ("idx_jobs_state_spec",),
            "worker's only": ("idx_jobs_state", "idx_jobs_state_spec")}


def lifecycle(path: Path, jobs: int, batch: int = 1000) -> tuple[float, float]:
    """CPU seconds to insert ``jobs`` jobs, and to insert, reserve and finish them, a
    batch per transaction for each step as the server's writer does them. CPU time, not
    wall time: on a shared machine the wall clock measures the neighbours."""
    conn = rota_db.connect(path)  # WAL, synchronous=FULL: the server's own settings
    inserting = total = 0.0
    try:
        for start in range(0, jobs, batch):
            ids = [uuid7() for _ in range(batch)]
            now = time.time()
            started = time.process_time()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO jobs (id, spec, queue, args, priority, state, attempt,"
                " enqueued_at) VALUES (?, 'spec1', 'default', '{}', 0, 'available', 0, ?)",
                [(job_id, now) for job_id in ids])
            conn.execute("COMMIT")
            inserted = time.process_time()
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("UPDATE jobs SET state = 'active', attempt = 1, worker_id = ?,"
                             " reserved_at = ? WHERE id = ?",
                             [(WORKERS[start % 20], now, job_id) for job_id in ids])
            conn.execute("COMMIT")
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("UPDATE jobs SET state = 'completed', finished_at = ?,"
                             " result = 'null' WHERE id = ?", [(now, job_id) for job_id in ids])
            conn.execute("COMMIT")
            inserting += inserted - started
            total += time.process_time() - started
        return inserting, total
    finally:
        conn.close()


def index_cost(kept: int, jobs: int, rounds: int, output: Path) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="rota-index-cost-"))
    base = workdir / "base.db"
    fill(base, kept)
    runs: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):  # alternating, so that a busy minute spoils every variant
        for variant, dropped in VARIANTS.items():
            path = workdir / "run.db"
            for leftover in workdir.glob("run.db*"):
                leftover.unlink()
            shutil.copy(base, path)
            with contextlib.closing(sqlite3.connect(path)) as conn:
                for index in dropped:
                    conn.execute(f"DROP INDEX {index}")
            runs[variant].append(lifecycle(path, jobs))
    figures = {}
    for variant, times in runs.items():
        insert = statistics.median(t[0] for t in times) / jobs * 1e6
        whole = statistics.median(t[1] for t in times) / jobs * 1e6
        figures[variant] = {"insert_us_per_job": round(insert, 2),
                            "lifecycle_us_per_job": round(whole, 2)}
    document = {"timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "kept": kept, "jobs": jobs, "rounds": rounds, "cpu_median": figures}
    output.write_text(json.dumps(document, indent=2) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(document, indent=1))
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed(http: httpx.Client, url: str, rounds: int) -> dict[str, Any]:
    times = []
    body: dict[str, Any] = {}
    for _ in range(rounds):
        started = time.perf_counter()
        response = http.get(url)
        times.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, response.text
        body = response.json()
    times.sort()
    return {"url": url, "p50_ms": round(statistics.median(times), 2),
            "p95_ms": round(times[int(0.95 * (len(times) - 1))], 2),
            "max_ms": round(times[-1], 2), "rows": len(body.get("jobs", body.get("queues", [])))}


def pages(http: httpx.Client, url: str, count: int, rounds: int) -> list[dict[str, Any]]:
    """The first ``count`` pages of ``url``, each followed by its cursor, ``rounds`` times."""
    per_page: list[list[float]] = [[] for _ in range(count)]
    for _ in range(rounds):
        cursor = None
        for n in range(count):
            started = time.perf_counter()
            response = http.get(url, params={"cursor": cursor} if cursor else None)
            per_page[n].append((time.perf_counter() - started) * 1000)
            cursor = response.json()["next_cursor"]
            if cursor is None:
                break
    return [{"page": n + 1, "p50_ms": round(statistics.median(t), 2),
             "p95_ms": round(sorted(t)[int(0.95 * (len(t) - 1))], 2)}
            for n, t in enumerate(per_page) if t]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--db", type=Path, default=None,
                        help="the store's file: filled if it does not exist, else reused")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--index-cost", action="store_true",
                        help="measure what the listing's indexes cost writes instead")
    opts = parser.parse_args(argv)
    if opts.index_cost:
        return index_cost(200_000 if opts.jobs == 1_000_000 else opts.jobs, 20_000, opts.rounds,
                          opts.output or RESULTS / "listing-index-cost.json")
    opts.output = opts.output or RESULTS / "listing.json"
    workdir = Path(tempfile.mkdtemp(prefix="rota-listing-"))
    path = opts.db or workdir / "rota.db"
    fill_seconds = None
    if not path.exists():
        fill_seconds = round(fill(path, opts.jobs), 1)
        print(f"filled {opts.jobs:,} jobs in {fill_seconds}s")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        total = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
        sample = conn.execute("SELECT id FROM jobs WHERE rowid = ?", (total // 2,)).fetchone()[0]
    port = free_port()
    log = open(workdir / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "rota", "serve", "--db", str(path),
                               "--port", str(port), "--log-level", "warning"],
                              stdout=log, stderr=subprocess.STDOUT)
    figures: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            started = time.perf_counter()
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/healthz").status_code == 200:
                        break
                if server.poll() is not None or time.perf_counter() - started > 120:
                    raise SystemExit(f"the server did not start: {workdir / 'server.log'}")
                time.sleep(0.1)  # polling a child's start
            figures["start_s"] = round(time.perf_counter() - started, 2)
            kinds = {
                "newest (no filter)": "/jobs",
                "state=discarded": "/jobs?state=discarded",
                "state=available": "/jobs?state=available",
                "state=discarded,cancelled": "/jobs?state=discarded,cancelled",
                "spec": "/jobs?spec=spec3",
                "queue": "/jobs?queue=mail",
                "worker": "/jobs?worker=worker-07",
                "state+spec": "/jobs?state=discarded&spec=spec8",
                "state+queue+worker": "/jobs?state=discarded&queue=reports&worker=worker-08",
                "q, id prefix": f"/jobs?q={sample[:23]}",
                "q, error text (rare)": f"/jobs?q={NEEDLE}",
                "q, error text (common)": "/jobs?q=db-38",
                "q + state": f"/jobs?state=discarded&q={NEEDLE}",
                "limit=500": "/jobs?limit=500",
                "GET /queues": "/queues",
            }
            figures["filters"] = {name: timed(http, url, opts.rounds)
                                  for name, url in kinds.items()}
            figures["pages"] = {
                "newest, 5 pages of 50": pages(http, "/jobs", 5, opts.rounds // 4 or 1),
                "state=discarded, 5 pages of 50": pages(http, "/jobs?state=discarded", 5,
                                                        opts.rounds // 4 or 1),
                f"q={NEEDLE}, 5 pages": pages(http, f"/jobs?q={NEEDLE}", 5,
                                              opts.rounds // 4 or 1),
            }
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    document = {"timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "jobs": total, "fill_s": fill_seconds, "cpu_count": os.cpu_count(),
                "sqlite": sqlite3.sqlite_version, **figures}
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    opts.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"{total:,} jobs; server start {figures['start_s']}s")
    for name, row in figures["filters"].items():
        print(f"  {name:28} p50 {row['p50_ms']:8.2f} ms  p95 {row['p95_ms']:8.2f} ms"
              f"  ({row['rows']} rows)")
    for name, rows in figures["pages"].items():
        print(f"  {name}: " + ", ".join(f"{r['p50_ms']:.1f}/{r['p95_ms']:.1f}" for r in rows)
              + " ms (p50/p95 per page)")
    print(f"wrote {opts.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
