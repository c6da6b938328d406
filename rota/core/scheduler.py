"""Which job goes to which worker: pure, in-memory decisions with no I/O.

Ready jobs are indexed by queue, then spec, each a heap ordered by job priority
(higher first) then enqueue order (rota/core/ready.py). With ``compact``, a plain waiting job
is kept as a key only, and ``plan()`` gives a ``Claim`` for it: the store reads the rest
of the job when it reserves it. ``plan()`` hands jobs to running workers with
free slots, following each worker's queue order, one job per worker per round so
work spreads, and only for specs the worker declared with the status-quo checksum.
It marks the chosen jobs reserved in memory; the server commits that before it
sends any ``assign`` frame.

Every time here is a monotonic deadline (``JobRecord.due``, ``JobRecord.expiry``,
``JobRecord.lease``): the caller says what time it is, on that clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import Any

from rota.core.flow import Flow
from rota.core.model import JobRecord, JobState
from rota.core.pins import Pins
from rota.core.ready import PRIORITY_LIMIT, Claim, Ready, Wait, WorkerSlot, may_take, why_waiting

__all__ = ["Claim", "Scheduler", "Wait", "WorkerSlot"]

TimerEntry = tuple[float, str]  # (when, job id); checked against the job when popped
# A timer heap is rebuilt from its live entries when it holds this many more entries than
# it did after its last rebuild: without it, every finished job would leave its lease
# entry behind until the lease ran out (30 minutes by default), a leak proportional to
# throughput. Amortised, a rebuild costs O(1) per push.
COMPACT_SLACK = 4096


class Scheduler(Flow):
    def __init__(self, visibility_timeout: float = 1800.0, *, compact: bool = False,
                 min_lease: float = 0.0) -> None:
        self.visibility_timeout = visibility_timeout  # when neither job nor spec sets one
        self.min_lease = min_lease  # the shortest lease: two heartbeat intervals
        # Keep plain available jobs as keys only (rota/core/ready.py). Needs a store that
        # answers claims: the engine's scheduler does; a bare one keeps every job whole.
        self.compact = compact
        self.status_quo: dict[str, str] = {}  # spec name -> checksum
        self.pins = Pins()  # push-executed jobs' versions, by row (rota/core/pins.py)
        self.unversioned: dict[str, Any] = {}  # OJS types with no spec: name -> JobSpec
        self.jobs: dict[str, JobRecord] = {}  # every live job kept whole, whatever its state
        self.workers: dict[str, WorkerSlot] = {}
        self.paused: set[str] = set()  # queues that keep their jobs and assign none
        self.ready = Ready(self.jobs)
        self.unstored: set[str] = set()  # jobs taken in before their rows (no row id yet)
        self.claims = 0  # claims whose rows are being read
        self._due: list[TimerEntry] = []  # scheduled and retryable jobs by run_at
        self._leases: list[TimerEntry] = []  # active jobs by lease expiry
        self._ttls: list[TimerEntry] = []  # jobs with a time to live, by expiry
        self._rotation = itertools.count()
        self._compact_at = {id(heap): COMPACT_SLACK for heap in (self._due, self._leases, self._ttls)}
        self.orphans = 0  # active jobs loaded at a restart whose worker has not reclaimed them
        # worker id -> ids of the jobs kept for it while it is away (``kept_for``)
        self._kept: dict[str, set[str]] = {}
        self.last_seq = 0  # the highest enqueue order taken in: new jobs come after it
        self._init_flow()  # limits, key turns and labels (rota/core/flow.py)

    @property
    def has_orphans(self) -> bool:
        return self.orphans > 0

    # -- jobs --------------------------------------------------------------------------
    def track(self, job: JobRecord) -> None:
        """Take in a live job in whatever state it is (new, loaded, or changed)."""
        self.jobs[job.id] = job
        self.last_seq = max(self.last_seq, job.seq)
        if job.expiry is not None:
            self._push(self._ttls, job.expiry, job.id)
        if job.state == "available":
            self.add(job)
        elif job.state in ("scheduled", "retryable"):
            self._push(self._due, job.due or 0.0, job.id)
        elif job.state == "active":
            self._push(self._leases, job.lease or 0.0, job.id)
            if self.limiter.rules and job.id not in self.limiter.held:  # it counts
                self.limiter.hold(job.id, job.queue, job.spec, job.concurrency_key)

    def held_seqs(self) -> set[int]:
        """The row ids of every live job held here, whole or compact (a full scan: for a
        catch-up after missed notices, not for hot paths)."""
        return {job.seq for job in self.jobs.values()} | self.ready.held_seqs()

    def live(self) -> int:
        """Live jobs, whole or compact (or being claimed)."""
        return len(self.jobs) + self.ready.keys + self.claims

    def add(self, job: JobRecord) -> None:
        """Make a job available to workers now: as a key only if it may be, else whole."""
        self._detach(job)
        job.move(JobState.AVAILABLE)
        job.worker_id = None
        job.run_at = job.due = None
        if (self.compact and job.expiry is None and job.id not in self.unstored
                and -PRIORITY_LIMIT < job.priority < PRIORITY_LIMIT):
            if self.jobs.get(job.id) is job:
                del self.jobs[job.id]
            self.ready.push_key(job.queue, job.spec, job.priority, job.seq, job.concurrency_key,
                                job.labels)
            return
        self.jobs[job.id] = job
        self.ready.push_job(job)

    def stored(self, job: JobRecord, seq: int) -> None:
        """The row of a job taken in early committed as row ``seq``: from now on it may
        be kept as a key."""
        self.unstored.discard(job.id)
        job.seq = seq
        if self.jobs.get(job.id) is job and job.state == "available":
            self.add(job)

    def claimed(self, claim: Claim, job: JobRecord | None) -> bool:
        """The store's answer to a claim: the reserved job as its row now reads (None: it
        was no longer available). True if the claiming worker is still here to run it."""
        worker = claim.worker
        worker.claims -= 1
        self.claims -= 1
        self.ready.claimed(claim.seq)
        if job is None:
            worker.capacity += 1  # the slot was never used
            if self.limiter.held:
                self._released(claim.seq, undo=True)  # nor the start
            return False
        if self.limiter.held:
            self.limiter.moved(claim.seq, job.id)
        self.track(job)
        if self.workers.get(worker.id) is not worker:
            return False
        worker.active.add(job.id)
        return True

    def unclaim(self, claim: Claim) -> None:
        """The reservation of a claim failed: the job is available again, as it was, and
        the worker has the slot back (nothing was sent; it will not ask again)."""
        claim.worker.claims -= 1
        claim.worker.capacity += 1
        self.claims -= 1
        self.ready.unclaim(claim.queue, claim.spec, claim.priority, claim.seq,
                           claim.concurrency_key, claim.labels)
        if self.limiter.held:
            self._released(claim.seq, undo=True)

    def defer(self, job: JobRecord, due: float) -> None:
        """Make a job wait until ``due`` (its state says scheduled or retryable)."""
        self._detach(job)
        job.worker_id = None
        job.due = due
        self._push(self._due, due, job.id)

    def unreserve(self, job: JobRecord) -> None:
        """The reservation of a whole job failed: the job is available again, as it
        was, and its worker has the slot back, as for a claim."""
        worker = self.workers.get(job.worker_id or "")
        if worker is not None:
            worker.capacity += 1
        job.attempt -= 1
        if self.limiter.held:
            self._released(job.id, undo=True)  # no start either (before it is made available)
        self.release(job)

    def let_go(self, job: JobRecord) -> None:
        """Forget a job whose reservation lost to another server's: the worker it was
        meant for has the slot back."""
        worker = self.workers.get(job.worker_id or "")
        if worker is not None:
            worker.active.discard(job.id)
            worker.capacity += 1
        if self.limiter.held:
            self._released(job.id, undo=True)  # the other server's start is its own
        if self.jobs.get(job.id) is job:
            del self.jobs[job.id]
        self.unstored.discard(job.id)
        job.worker_id = None  # so the round that reserved it sends no assign of it

    def release(self, job: JobRecord) -> None:
        """Take a job back from its worker and make it available again."""
        self.unorphan(job)
        self.add(job)

    def hold(self, job: JobRecord, until: float) -> None:
        """Keep an active job reserved until ``until`` (its lease, started again)."""
        job.lease = until
        self._push(self._leases, until, job.id)

    def finish(self, job: JobRecord) -> None:
        """The job reached a terminal state (committed): forget it."""
        self.unorphan(job)
        self._detach(job)
        self.jobs.pop(job.id, None)

    def drop(self, job: JobRecord) -> None:
        """Forget a job that was taken in before its row was written, and whose write
        failed: it never existed. Marked so that a reservation of it, failing in the same
        transaction, does not put it back."""
        self.unstored.discard(job.id)
        if self.jobs.get(job.id) is job:
            self.finish(job)
            if job.state == "active":
                worker = self.workers.get(job.worker_id or "")
                if worker is not None:
                    worker.capacity += 1
        job.state = "discarded"  # not a move: the job was never stored

    def _detach(self, job: JobRecord) -> None:
        worker = self.workers.get(job.worker_id or "")
        if worker is not None:
            worker.active.discard(job.id)
        if self.limiter.held:  # it leaves active: the limits it counted against free up
            self._released(job.id)

    # -- timers (pure: the caller says what time it is) --------------------------------
    def _push(self, heap: list[TimerEntry], when: float, job_id: str) -> None:
        heapq.heappush(heap, (when, job_id))
        if len(heap) >= self._compact_at[id(heap)]:
            self._compact(heap)

    def _compact(self, heap: list[TimerEntry]) -> None:
        """Keep one entry per job that still needs this timer, at its current deadline."""
        live: dict[str, float] = {}
        for _, job_id in heap:
            job = self.jobs.get(job_id)
            if job is None or job_id in live:
                continue
            when = self._deadline(heap, job)
            if when is not None:
                live[job_id] = when
        heap[:] = [(when, job_id) for job_id, when in live.items()]
        heapq.heapify(heap)
        self._compact_at[id(heap)] = 2 * len(heap) + COMPACT_SLACK

    def _deadline(self, heap: list[TimerEntry], job: JobRecord) -> float | None:
        """The deadline this heap still has to watch for ``job``, or None."""
        if heap is self._leases:
            return (job.lease or 0.0) if job.state == "active" else None
        if heap is self._due:
            return (job.due or 0.0) if job.state in ("scheduled", "retryable") else None
        if job.state in ("scheduled", "available", "retryable"):
            return job.expiry
        return None

    def timer_entries(self) -> int:
        """How many timer entries are held (live or not yet pruned): bounded by the live
        jobs, not by how many ever passed through."""
        return len(self._due) + len(self._leases) + len(self._ttls)

    def due(self, now: float) -> list[JobRecord]:
        """Scheduled and retryable jobs whose time has come, made available."""
        ready = [job for job in _pop_until(self._due, now, self.jobs)
                 if job.state in ("scheduled", "retryable") and (job.due or 0.0) <= now]
        for job in ready:
            self.add(job)
        return ready

    def expired_leases(self, now: float) -> list[JobRecord]:
        """Active jobs whose reservation lapsed (a renewed lease goes back on the heap)."""
        expired: dict[str, JobRecord] = {}  # a job may have several entries: judge it once
        for job in _pop_until(self._leases, now, self.jobs):
            if job.state != "active" or job.id in expired:
                continue
            if job.lease is not None and job.lease > now:
                self._push(self._leases, job.lease, job.id)
            else:
                expired[job.id] = job
        return list(expired.values())

    def expired_ttls(self, now: float) -> list[JobRecord]:
        """Waiting jobs whose time to live ran out (active ones are judged when they end)."""
        return [job for job in _pop_until(self._ttls, now, self.jobs)
                if job.state in ("scheduled", "available", "retryable")
                and job.expiry is not None and job.expiry <= now]

    def next_deadline(self) -> float | None:
        heads = [heap[0][0] for heap in (self._due, self._leases, self._ttls, self._flow_timers)
                 if heap]
        return min(heads) if heads else None

    def renew(self, worker: WorkerSlot, job_ids: Iterable[str], now: float) -> None:
        """The worker vouched for these jobs: their leases start again from now."""
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if (job is not None and job.state == "active" and job.worker_id == worker.id
                    and not job.orphaned):
                job.lease = now + self.lease_for(job)

    def shift(self, delta: float) -> None:
        """Push every live lease (held or kept for an absent worker) ``delta`` seconds
        later: the server was not listening for that long, so nobody's time ran."""
        for job in self.jobs.values():
            if job.state == "active" and job.lease is not None:
                job.lease += delta  # the heap is checked lazily: the entry is re-pushed

    def orphan(self, job: JobRecord, until: float) -> None:
        """Keep an active job reserved for its absent worker until ``until``: the worker may
        reconnect and reclaim it (``adopt``); otherwise its lease lapses then."""
        if not job.orphaned:
            job.orphaned = True
            self.orphans += 1
            self._kept.setdefault(job.worker_id or "", set()).add(job.id)
        job.lease = until
        self._push(self._leases, until, job.id)

    def adopt(self, worker: WorkerSlot, job_ids: Iterable[str], now: float) -> list[JobRecord]:
        """Give a reconnecting worker back the reservations it held before a restart or
        before its connection was lost."""
        adopted = []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or not job.orphaned or job.worker_id != worker.id:
                continue
            self.unorphan(job)
            job.lease = now + self.lease_for(job)
            worker.active.add(job.id)
            adopted.append(job)
        return adopted

    def unorphan(self, job: JobRecord) -> None:
        """The job is no longer kept for its absent worker (reclaimed, or taken back)."""
        if not job.orphaned:
            return
        job.orphaned = False
        self.orphans -= 1
        kept = self._kept.get(job.worker_id or "")
        if kept is not None:
            kept.discard(job.id)
            if not kept:
                del self._kept[job.worker_id or ""]

    def kept_for(self, worker_id: str) -> list[JobRecord]:
        """The jobs kept for an absent worker to reclaim. (An id whose job moved on by
        another way than ``unorphan``, e.g. finished by another server, is dropped here.)"""
        ids = self._kept.get(worker_id)
        if not ids:
            return []
        kept = [job for job in map(self.jobs.get, ids) if job is not None and job.orphaned
                and job.worker_id == worker_id and job.state == "active"]
        if len(kept) < len(ids):
            ids.intersection_update(job.id for job in kept)
            if not ids:
                del self._kept[worker_id]
        return kept

    def lease_for(self, job: JobRecord) -> float:
        # Never shorter than ``min_lease``: heartbeats renew leases, so one that ends
        # before the next beat lapses while its job runs well (a visibility_timeout of
        # 1e-9 had a job handed out 22 times to the worker that was running it).
        return max(job.visibility_timeout or self.visibility_timeout, self.min_lease)

    # -- workers -------------------------------------------------------------------
    def add_worker(self, worker: WorkerSlot) -> None:
        self.workers[worker.id] = worker
        if worker.labels:
            self.workers_changed()

    def remove_worker(self, worker_id: str, reported: Iterable[str] = ()) -> list[JobRecord]:
        """Forget a worker; return the jobs it held, for the caller to recover.

        Both the server's reservations and the worker's last reported ``active_job_ids``
        are consulted, so a job known to either side is not overlooked. Jobs whose result
        is being committed ("finishing") are left alone.
        """
        worker = self.workers.pop(worker_id, None)
        held = set(worker.active) if worker is not None else set()
        held.update(reported)
        jobs = (self.jobs.get(job_id) for job_id in held)
        return [job for job in jobs
                if job is not None and job.state == "active" and job.worker_id == worker_id]

    def matches(self, worker: WorkerSlot, spec: str) -> bool:
        return may_take(worker, spec, self.status_quo, self.unversioned)

    # -- planning --------------------------------------------------------------------
    def plan(self, now: float) -> dict[str, list[JobRecord | Claim]]:
        """Reserve in memory as many ready jobs as running workers can take now."""
        if self.ready.empty(self.paused):  # an idle fleet's beats wake rounds: 10,000 took 41 ms
            return {}
        start = next(self._rotation)
        # Filtered before anything else: an enqueue runs a round too, and a fleet of
        # thousands of busy or idle workers must not cost a sort each time.
        candidates = [w for w in self.workers.values() if w.state == "running" and w.free() > 0]
        if len(candidates) > 1:
            candidates.sort(key=lambda w: w.id)
            shift = start % len(candidates)
            candidates = candidates[shift:] + candidates[:shift]
        plan: dict[str, list[JobRecord | Claim]] = {}
        # Limits, key turns or labels in play: the limited path (rota/core/flow.py).
        pop = self._pop_limited if self.limited else self._pop_best
        while candidates:
            next_round = []
            for worker in candidates:
                job = pop(worker, now)
                if job is None:
                    continue
                plan.setdefault(worker.id, []).append(job)
                if worker.free() > 0:
                    next_round.append(worker)
            candidates = next_round
        return plan

    def _reserve(self, job: JobRecord, worker: WorkerSlot, now: float) -> None:
        job.move(JobState.ACTIVE)
        job.worker_id = worker.id
        job.worker_token = worker.token
        job.attempt += 1
        job.checksum = self.checksum_for(job.spec, job.seq)  # None: unversioned
        job.lease = now + self.lease_for(job)
        self._push(self._leases, job.lease, job.id)
        worker.active.add(job.id)
        worker.capacity -= 1

    def _pop_best(self, worker: WorkerSlot, now: float) -> JobRecord | Claim | None:
        """Reserve, in memory, the best job this worker may run (following its queues)."""
        for queue in worker.queues:
            by_spec = self.ready.buckets.get(queue)
            if not by_spec or queue in self.paused:
                continue
            best, best_head, best_spec = None, None, ""
            pinned = self.pins.windows  # (push execution: rota/core/pins.py)
            for spec, bucket in by_spec.items():
                if not (spec in pinned or self.matches(worker, spec)):
                    continue
                head = self.ready.head(bucket)
                if head is None or (spec in pinned and not self.may_run(worker, spec, head[1])):
                    continue
                if best_head is None or head < best_head:
                    best, best_head, best_spec = bucket, head, spec
            if best is None:
                continue
            taken = self.ready.pop(best)
            if isinstance(taken, JobRecord):
                self._reserve(taken, worker, now)
                return taken
            worker.claims, worker.capacity, self.claims = (worker.claims + 1, worker.capacity - 1,
                                                           self.claims + 1)
            return Claim(taken[1], queue, best_spec, taken[0], worker,
                         self.checksum_for(best_spec, taken[1]))
        return None

    # -- explaining ------------------------------------------------------------------
    def waiting_reason(self, queue: str, spec: str) -> str | None:  # None: they will run
        wait = self.wait(queue, spec)
        return None if wait is None else wait.reason

    def wait(self, queue: str, spec: str, now: float | None = None) -> Wait | None:
        """Why available jobs of (queue, spec) are not running, and whether that blocks
        them or only holds them in a backlog (ready.why_waiting); None if they will run.
        ``now`` (monotonic): also a queue's or spec's own limit that holds them."""
        wait = why_waiting(self.workers.values(), self.paused, self.status_quo, queue, spec,
                           self.unversioned)
        if now is not None and (wait is None or not wait.blocked):
            return self.scope_wait(queue, spec, now) or wait
        return wait

    def ready_counts(self) -> dict[tuple[str, str], int]:
        counts = self.ready.counts()
        for job in self.jobs.values():
            if job.state == "available":
                key = (job.queue, job.spec)
                counts[key] = counts.get(key, 0) + 1
        return counts

    def live_counts(self) -> dict[str, dict[str, int]]:
        """Jobs per queue in the states held in memory (scheduled, available, retryable,
        active): what the dashboard shows without counting rows (a backlog of a million
        available jobs would take SQLite half a second to count)."""
        counts: dict[str, dict[str, int]] = {}
        for (queue, _), n in self.ready_counts().items():
            per = counts.setdefault(queue, {})
            per["available"] = per.get("available", 0) + n
        for job in self.jobs.values():
            if job.state != "available":
                per = counts.setdefault(job.queue, {})
                state = str(job.state)  # (a new job's state may be a plain str)
                per[state] = per.get(state, 0) + 1
        return counts

    def mismatched_workers(self, spec: str, checksum: str) -> list[str]:  # another checksum
        return sorted(w.id for w in self.workers.values() if w.specs.get(spec, checksum) != checksum)

    def matching_workers(self, spec: str, checksum: str) -> list[str]:  # this checksum
        return sorted(w.id for w in self.workers.values() if w.specs.get(spec) == checksum)


def _pop_until(heap: list[TimerEntry], now: float, jobs: dict[str, JobRecord]) -> list[JobRecord]:
    """Pop every entry due by ``now``; the caller checks each job is still in that state."""
    popped = []
    while heap and heap[0][0] <= now:
        job = jobs.get(heapq.heappop(heap)[1])
        if job is not None:
            popped.append(job)
    return popped
