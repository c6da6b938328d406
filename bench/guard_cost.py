"""What the PostgreSQL guard of flow control costs a reservation (rota/store/limits.py).

A throwaway PostgreSQL (tests/pgserver.py, as the suite starts it), one store, and
rounds of reservations of ``--batch`` jobs each: once with no limit, once with a per-key
concurrency limit over 100 keys (an advisory lock and a count per key in the round), and
once with a per-key rate as well (a count of recorded starts, and a row per start).
Prints the time per reserved job of each. Figures go to docs/performance.md.

    .venv/bin/python bench/guard_cost.py [--jobs 5000] [--batch 100]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pgserver import Cluster  # noqa: E402  (the suite's throwaway PostgreSQL)

from rota.core.effects import Guard  # noqa: E402
from rota.core.limits import Rate  # noqa: E402
from rota.core.model import JobRecord, JobState, shared_limits  # noqa: E402
from rota.store.store import Store  # noqa: E402

KEYS = 100


def job(n: int) -> JobRecord:
    return JobRecord(id=f"j{n}", spec="echo", queue="default", args=msgspec.Raw(b"{}"),
                     priority=0, enqueued_at=1.0, seq=0, concurrency_key=f"k{n % KEYS}",
                     limits=shared_limits(25, None, 1.0, 3600.0, 3))


def guards_of(kind: str, key: str) -> tuple[Guard, ...]:
    if kind == "none":
        return ()
    rate = Rate(1_000_000, 3600.0) if kind == "rate" else None
    return (Guard("spec:echo", key, 1_000_000, rate),)


async def run(url: str, kind: str, jobs: int, batch: int) -> float:
    store = Store(Path(tempfile.mkdtemp()) / "unused.db", server_id="bench", database_url=url)
    await asyncio.to_thread(store.load)
    store.start(asyncio.get_running_loop())
    try:
        made = [job(n) for n in range(jobs)]
        for start in range(0, jobs, 1000):
            chunk = made[start:start + 1000]
            for one, (row, _) in zip(chunk, await store.enqueue(chunk), strict=True):
                one.seq = row["rowid"]
        took = 0.0
        for start in range(0, jobs, batch):
            round_ = made[start:start + batch]
            for one in round_:
                one.state, one.worker_id, one.attempt = JobState.ACTIVE, "w", 1
                one.checksum, one.lease_expires_at = "c", time.time() + 600
            guards = {one.id: guards_of(kind, one.concurrency_key or "")
                      for one in round_ if kind != "none"}
            began = time.perf_counter()
            got = await store.reserve(round_, time.time(), guards=guards)
            took += time.perf_counter() - began
            assert not got.refused and not got.lost
        return took / jobs
    finally:
        await asyncio.to_thread(store.close)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=100)
    opts = parser.parse_args()
    cluster = Cluster()
    cluster.start()
    try:
        for kind in ("none", "key", "rate", "none", "key", "rate"):
            per = await run(cluster.create_database(migrated=True), kind, opts.jobs, opts.batch)
            print(f"{kind:5}: {per * 1e6:7.1f} µs a reserved job ({opts.batch} a round)")
    finally:
        cluster.destroy()


if __name__ == "__main__":
    asyncio.run(main())
