"""What a scheduling round costs with per-key limits, against how much waits.

A pure measurement of rota/core's scheduler (no server, no store): N waiting jobs, kept as
keys, over K concurrency keys with a per-key limit of 3, and one worker with room for
them all. The first round assigns 3 per key (the worker has room for 4: the round
meets each key's limit and parks the key); then ten jobs end and a round assigns ten;
then a round with every key at its limit assigns nothing. Each is timed, beside the
same rounds with no limit and no keys (the plain path). Figures go to docs/performance.md.

    .venv/bin/python bench/flow_rounds.py [--waiting 1000000] [--keys 10000]
"""

from __future__ import annotations

import argparse
import time

import msgspec

from rota.core.limits import LimitRule
from rota.core.model import Instant, JobRecord, Limits
from rota.core.ready import Claim, WorkerSlot
from rota.core.scheduler import Scheduler

CHECKSUM = "sha256:" + "a" * 64


def loaded(waiting: int, keys: int, limited: bool) -> tuple[Scheduler, WorkerSlot]:
    sched = Scheduler(compact=True)
    sched.status_quo = {"a": CHECKSUM}
    if limited:
        sched.set_limits({("spec", "a"): LimitRule(key_concurrency=3)}, Instant(0.0, 0.0))
    per = waiting // keys
    for k in range(keys):
        seqs = list(range(k * per + 1, (k + 1) * per + 1))
        sched.ready.load("default", "a", seqs, f"k{k}" if limited else None)
    worker = WorkerSlot("w1", ["default"], concurrency=10 * keys, specs={"a": CHECKSUM},
                        capacity=4 * keys)  # room beyond the limits: the round meets them
    sched.add_worker(worker)
    return sched, worker


def end(sched: Scheduler, claims: list[Claim]) -> None:
    """The jobs of ``claims`` were read, ran and finished."""
    for claim in claims:
        job = JobRecord(id=f"j{claim.seq}", spec="a", queue="default",
                        args=msgspec.Raw(b"{}"), priority=0, enqueued_at=0.0, seq=claim.seq,
                        state="active", worker_id="w1", concurrency_key=claim.concurrency_key,
                        limits=Limits(3, None, 1.0, 60.0))
        sched.claimed(claim, job)
        sched.finish(job)


def timed(label: str, sched: Scheduler, now: float) -> list[Claim]:
    start = time.perf_counter()
    plan = sched.plan(now)
    took = time.perf_counter() - start
    got = [c for c in plan.get("w1", []) if isinstance(c, Claim)]
    per = f"{took / len(got) * 1e6:.1f} µs a job" if got else "nothing assigned"
    print(f"  {label}: {len(got):,} assigned in {took * 1000:.1f} ms ({per})")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiting", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    opts = parser.parse_args()
    for limited in (False, True):
        sched, worker = loaded(opts.waiting, opts.keys, limited)
        print(f"{'per-key limit 3' if limited else 'no limit, no keys'}:"
              f" {opts.waiting:,} waiting over {opts.keys:,} keys")
        first = timed("first round", sched, 1.0)
        end(sched, first[:10])
        worker.capacity = 10
        timed("after ten ended", sched, 2.0)
        worker.capacity = 1_000
        if limited:
            timed("every key at its limit", sched, 3.0)


if __name__ == "__main__":
    main()
