"""What recording for the operator (rota/core/observe.py) costs the engine per job.

The engine alone, in this process, no I/O: jobs enqueued in batches, scheduling rounds
committed, results reported and committed, as the shell would drive it. Each round is
run twice, alternating, with the real Observer and with one whose recording does
nothing, so that the machine's load falls on both alike; the CPU time (process_time)
per job of each is compared.

    .venv/bin/python bench/observe_cost.py --jobs 20000 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from rota.base import protocol as p
from rota.core.auth import OPEN
from rota.core.effects import Reserve, Send
from rota.core.engine import Engine
from rota.core.jobs import EnqueueRequest
from rota.core.model import Instant, JobRecord, JobState
from rota.core.observe import Observer
from rota.core.settings import ServerSettings
from rota.base.specs import checksum, parse_spec

SPEC = parse_spec('name = "noop"\nversion = "1"\nqueue = "default"\n')


class Silent(Observer):
    """Records nothing: the engine as it was before rota/core/observe.py."""

    def event(self, *args: Any, **kwargs: Any) -> None: ...
    def enqueued(self, *args: Any, **kwargs: Any) -> None: ...
    def assigned(self, *args: Any, **kwargs: Any) -> None: ...
    def ended(self, *args: Any, **kwargs: Any) -> None: ...


def drive(jobs: int, observer: Observer) -> float:
    """CPU seconds per job to take ``jobs`` through enqueue, assign and result."""
    now = Instant(1000.0, 1_800_000_000.0)
    engine = Engine(ServerSettings(), rand=lambda: 0.0)
    engine.observe = observer
    engine.load({SPEC.name: SPEC}, {SPEC.name: checksum(SPEC)}, [], now)
    reg = p.Registration(hostname="h", os="linux", pid=1, sdk="bench", queues=["default"],
                         concurrency=10, prefetch=1000,
                         specs=[p.SpecRef(SPEC.name, checksum(SPEC))], started_at="t0")
    first = p.Heartbeat(seq=0, worker_id="w", registration=reg,
                        status=p.Status(state="running", active_job_ids=[]))
    engine.register(1, first, OPEN, now)
    engine.heartbeat(1, "w", first, now)
    rows: dict[int, JobRecord] = {}
    seq = 0
    started = time.process_time()
    for start in range(0, jobs, 1000):
        batch = []
        for i in range(start, min(jobs, start + 1000)):
            job = engine.build(EnqueueRequest(spec="noop", id=f"j{i}"), OPEN, now)
            assert isinstance(job, JobRecord)
            rows[len(rows) + 1] = job
            batch.append((job, len(rows)))
        engine.enqueued_all(batch, now)
        while True:
            reserves = [e for e in engine.dispatch(now) if isinstance(e, Reserve)]
            if not reserves:
                break
            [reserve] = reserves
            read = []
            for claim in reserve.claims:
                job = rows[claim.seq]
                job.state, job.worker_id, job.checksum = JobState.ACTIVE, "w", claim.checksum
                job.attempt += 1
                job.lease_expires_at = now.wall + 60
                read.append(job)
            frames = [e for e in engine.committed(reserve.ticket, None, now, read)
                      if isinstance(e, Send)]
            copies = [c for f in frames for c in p.decode(f.frame).jobs]  # type: ignore[union-attr]
            seq += 1
            beat = p.Heartbeat(seq=seq, worker_id="w",
                               status=p.Status(state="running", active_job_ids=[]),
                               results=[p.Result(job_id=c.id, attempt=c.attempt,
                                                 outcome="completed", result=None)
                                        for c in copies])
            [save] = [e for e in engine.heartbeat(1, "w", beat, now) if hasattr(e, "ticket")
                      and getattr(e, "ticket", None)]
            engine.committed(save.ticket, None, now)  # type: ignore[attr-defined]
    return (time.process_time() - started) / jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    import logging
    logging.disable(logging.INFO)  # the engine's log lines are not what is measured
    real, silent = [], []
    for _ in range(args.rounds):
        silent.append(drive(args.jobs, Silent()) * 1e6)
        real.append(drive(args.jobs, Observer()) * 1e6)
    print(f"engine CPU per job, {args.jobs} jobs, {args.rounds} alternating rounds:")
    print(f"  without recording: median {statistics.median(silent):.1f} us"
          f" ({', '.join(f'{v:.1f}' for v in silent)})")
    print(f"  with recording:    median {statistics.median(real):.1f} us"
          f" ({', '.join(f'{v:.1f}' for v in real)})")
    print(f"  difference: {statistics.median(real) - statistics.median(silent):.1f} us a job")


if __name__ == "__main__":
    main()
