"""The ready index: the jobs available to workers, per queue and spec, best first. Pure.

A server may hold a million waiting jobs, and placement reads only a job's queue, spec,
priority and enqueue order. So a plain available job (no time to live, its row
committed) is kept as one int, its *key*: ``(-priority << SEQ_BITS) + seq``, in a heap
per (queue, spec), where ``seq`` is its row id. Ints order as (-priority, seq) tuples
would, and a key costs ~40 bytes where a ``JobRecord`` costs ~600. Everything else about the
job stays in its row: the store reads it when it reserves the job (a ``Claim``).

Jobs that need more than a key while they wait (a time to live, a row not yet
committed, a priority beyond the key's range) are kept whole: a ``JobRecord`` in the
scheduler's ``jobs`` and a ``(-priority, seq, id)`` entry in a second heap of the same
bucket. Entries of either heap are dropped lazily, when they reach the top.

Jobs with a concurrency key or required labels wait in buckets of their own, one per
(queue, spec, key, labels), grouped per (queue, spec) in ``Lanes``: a rotation of the
buckets that may have jobs ready (the plain bucket, the jobs with neither, is one of
them), so that keys take turns (rota/core/flow.py decides; a bucket at its limit leaves
the rotation until a release or a timer brings it back).

Producers name queues, so buckets are not kept for ever: when their number doubles,
those that hold no job any more are forgotten (``_sweep``), and a queue that gets jobs
again gets a new one.

``WorkerSlot`` lives here, below the scheduler, because a ``Claim`` names the worker it
was made for and the store reads claims; and with it ``why_waiting``, what the connected
workers say of jobs that wait.
"""

from __future__ import annotations

import heapq
import json
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from rota.base.specs import UNVERSIONED  # (re-exported: the gate below compares it)
from rota.core.model import JobRecord

SEQ_BITS = 48  # row ids stay far below 2**48; a key of priority |p| < 2**14 is a 2-digit int
SEQ_MASK = (1 << SEQ_BITS) - 1
PRIORITY_LIMIT = 1 << 14  # a job with a priority this large or larger is kept whole
FullEntry = tuple[int, int, str]  # (-priority, seq, job id)
# Where the key of a withdrawn job (a cancel of a compact job) is: its write in flight
# and the key in its heap, or popped from it since, or claimed before the cancel came;
# or the job is cancelled and its key still in the heap.
PENDING, PENDING_POPPED, PENDING_CLAIMED, DEAD = 0, 1, 2, 3
SWEEP_AT = 1024  # buckets made before the first look for empty ones


SubId = tuple[str | None, tuple[str, ...]]  # (concurrency key, labels) within a (queue, spec)
PLAIN: SubId = (None, ())


def row_labels(value: object) -> tuple[str, ...]:
    """A job's labels as a row may hold them (a JSON list as text, a list, or nothing):
    sorted, without duplicates, as ``JobRecord.labels`` keeps them."""
    if not value:
        return ()
    if isinstance(value, (bytes, str)):
        text = value.decode() if isinstance(value, bytes) else value
        items = json.loads(text) if text.lstrip().startswith("[") else text.split(",")
    else:
        items = list(value)  # type: ignore[call-overload]
    return tuple(sorted({str(item).strip() for item in items if str(item).strip()}))


def key_of(priority: int, seq: int) -> int:
    return (-priority << SEQ_BITS) + seq


def unkey(key: int) -> tuple[int, int]:
    """(priority, seq) of a key."""
    return -(key >> SEQ_BITS), key & SEQ_MASK


@dataclass(slots=True)
class WorkerSlot:
    """What the scheduler knows of one connected worker."""

    id: str
    queues: list[str]
    concurrency: int
    specs: dict[str, str]  # spec name -> checksum the worker declared
    labels: list[str] = field(default_factory=list)
    state: str = "running"
    capacity: int = 0  # free slots the worker last asked for, less what we sent since
    active: set[str] = field(default_factory=set)  # reserved for it: running or waiting there
    claims: int = 0  # compact jobs reserved for it whose rows are still being read
    prefetch: int = 0  # jobs it may hold beyond concurrency, waiting in its own line
    blocked: bool = False  # its connection's outbox is full: it is not reading what it is sent
    token: str | None = None  # the id of the token it connected with (None: no token)
    any_type: bool = False  # a pull worker (rota/core/pulls.py): it runs any unversioned type

    def free(self) -> int:
        """Slots the server may fill now: none while the worker does not read its socket,
        or every job sent would only pile up in the server's memory."""
        if self.blocked:
            return 0
        # The worker's claim is only a wish; what it may hold minus what it holds is the law.
        return max(0, min(self.capacity, self.concurrency + self.prefetch - len(self.active)
                          - self.claims))

    def running(self) -> int:
        """Held jobs that count as running: a worker starts a held job whenever one of its
        ``concurrency`` slots is free, so only what is held beyond them waits."""
        return min(len(self.active), self.concurrency)


@dataclass(slots=True)
class Claim:
    """A compact job picked for a worker. Its id and the rest are in its row only: the
    store's reservation reads them (``UPDATE ... WHERE rowid IN (...) AND +state =
    'available' RETURNING ...``, rota/store/rows.py), and ``Scheduler.claimed`` takes in the
    job it makes."""

    seq: int
    queue: str
    spec: str
    priority: int
    worker: WorkerSlot
    checksum: str | None  # None: an unversioned type (rota/core/pulls.py)
    concurrency_key: str | None = None
    labels: tuple[str, ...] = ()


@dataclass(slots=True)
class Bucket:
    """The available jobs of one (queue, spec)."""

    keys: list[int] = field(default_factory=list)  # heap of compact jobs' keys
    full: list[FullEntry] = field(default_factory=list)  # heap of whole jobs
    count: int = 0  # keys that stand for a job still waiting
    compact_at: int = 64  # rebuild ``full`` when it grows to this (stale entries pile up)


@dataclass(slots=True)
class Lanes:
    """The keyed and labelled buckets of one (queue, spec), and the order they take turns
    in: ``turn`` holds those that may have a job ready and are not parked (PLAIN, the
    plain bucket, stays in it for good); a bucket found empty leaves it, a push brings it
    back."""

    subs: dict[SubId, Bucket] = field(default_factory=dict)
    turn: deque[SubId] = field(default_factory=lambda: deque([PLAIN]))
    queued: set[SubId] = field(default_factory=lambda: {PLAIN})  # those in ``turn``
    parked: set[SubId] = field(default_factory=set)  # out of turn until flow brings them back

    def enter(self, sub: SubId) -> None:
        if sub not in self.queued and sub not in self.parked:
            self.queued.add(sub)
            self.turn.append(sub)

    def leave(self, park: bool) -> SubId:
        """Take the front of the rotation out of it (``park``: until flow unparks it)."""
        sub = self.turn.popleft()
        self.queued.discard(sub)
        if park:
            self.parked.add(sub)
        return sub

    def unpark(self, sub: SubId) -> None:
        if sub in self.parked:
            self.parked.discard(sub)
            self.enter(sub)


class Ready:
    def __init__(self, jobs: dict[str, JobRecord]) -> None:
        self.jobs = jobs  # the scheduler's whole jobs, to judge ``full`` entries by
        self.buckets: dict[str, dict[str, Bucket]] = {}  # queue -> spec -> bucket
        self.lanes: dict[str, dict[str, Lanes]] = {}  # queue -> spec -> keyed/labelled buckets
        self.keys = 0  # compact jobs waiting, over every bucket
        # seq -> PENDING... / DEAD: keys of cancelled (or being cancelled) compact jobs,
        # skipped when they reach the top of their heap.
        self._gone: dict[int, int] = {}
        self._claiming: set[int] = set()  # keys popped for claims whose rows are being read
        self._made = 0  # buckets, over every queue
        self._sweep_at = SWEEP_AT

    def bucket(self, queue: str, spec: str, key: str | None = None,
               labels: tuple[str, ...] = ()) -> Bucket:
        if key is not None or labels:
            return self.sub_bucket(queue, spec, (key, labels))
        by_spec = self.buckets.get(queue)
        bucket = None if by_spec is None else by_spec.get(spec)
        if bucket is None:
            if self._made >= self._sweep_at:
                self._sweep()
            by_spec = self.buckets.setdefault(queue, {})
            bucket = by_spec[spec] = Bucket()
            self._made += 1
        return bucket

    def sub_bucket(self, queue: str, spec: str, sub: SubId) -> Bucket:
        """The bucket of a concurrency key and labels, in the rotation from now on."""
        lanes = self.lanes_of(queue, spec)
        bucket = lanes.subs.get(sub)
        if bucket is None:
            if self._made >= self._sweep_at:
                self._sweep()
                lanes = self.lanes_of(queue, spec)
            bucket = lanes.subs[sub] = Bucket()
            self._made += 1
        lanes.enter(sub)
        return bucket

    def lanes_of(self, queue: str, spec: str) -> Lanes:
        by_spec = self.lanes.setdefault(queue, {})
        lanes = by_spec.get(spec)
        if lanes is None:
            lanes = by_spec[spec] = Lanes()
        return lanes

    def _sweep(self) -> None:
        """Forget the buckets that hold nothing (their dead entries dropped first): a
        scan of every bucket, made when their number doubled since the last, so its
        cost per bucket made stays constant. Never called while ``plan`` walks them."""
        for queue in list(self.buckets):
            by_spec = self.buckets[queue]
            for spec in list(by_spec):
                bucket = by_spec[spec]
                if self.head(bucket) is None and not bucket.keys and not bucket.count:
                    del by_spec[spec]
                    self._made -= 1
            if not by_spec:
                del self.buckets[queue]
        for queue in list(self.lanes):
            lanes_of = self.lanes[queue]
            for spec in list(lanes_of):
                lanes = lanes_of[spec]
                for sub in list(lanes.subs):
                    bucket = lanes.subs[sub]
                    if self.head(bucket) is None and not bucket.keys and not bucket.count:
                        del lanes.subs[sub]  # (still in ``turn``: dropped when it comes up)
                        lanes.parked.discard(sub)
                        self._made -= 1
                if not lanes.subs:
                    del lanes_of[spec]
            if not lanes_of:
                del self.lanes[queue]
        self._sweep_at = max(SWEEP_AT, 2 * self._made)

    def push_job(self, job: JobRecord) -> None:
        bucket = self.bucket(job.queue, job.spec, job.concurrency_key, job.labels)
        heapq.heappush(bucket.full, (-job.priority, job.seq, job.id))
        if len(bucket.full) >= bucket.compact_at:
            live = {entry[2]: entry for entry in bucket.full if self._live(entry)}
            bucket.full[:] = live.values()
            heapq.heapify(bucket.full)
            bucket.compact_at = 2 * len(bucket.full) + 64

    def push_key(self, queue: str, spec: str, priority: int, seq: int, key: str | None = None,
                 labels: tuple[str, ...] = ()) -> None:
        bucket = self.bucket(queue, spec, key, labels)
        heapq.heappush(bucket.keys, key_of(priority, seq))
        bucket.count += 1
        self.keys += 1

    def load(self, queue: str, spec: str, keys: list[int], key: str | None = None,
             labels: tuple[str, ...] = ()) -> None:
        """Take in the keys of a restart at once: one heapify, not a push per job."""
        bucket = self.bucket(queue, spec, key, labels)
        bucket.keys.extend(keys)
        heapq.heapify(bucket.keys)
        bucket.count += len(keys)
        self.keys += len(keys)

    def _live(self, entry: FullEntry) -> bool:
        job = self.jobs.get(entry[2])
        return job is not None and job.state == "available" and job.seq == entry[1]

    def head(self, bucket: Bucket) -> tuple[int, int] | None:
        """(-priority, seq) of the bucket's best job, dropping dead entries; None if empty."""
        full, keys = bucket.full, bucket.keys
        while full and not self._live(full[0]):
            heapq.heappop(full)
        while keys and self._gone.get(keys[0] & SEQ_MASK) in (PENDING, DEAD):
            self._skip(heapq.heappop(keys) & SEQ_MASK)
        if keys:
            key = keys[0]
            best = (key >> SEQ_BITS, key & SEQ_MASK)
            return min(best, full[0][:2]) if full else best
        return full[0][:2] if full else None

    def pop(self, bucket: Bucket) -> JobRecord | tuple[int, int]:
        """Take the best job (``head`` said there is one): a whole JobRecord, or (priority, seq)."""
        full, keys = bucket.full, bucket.keys
        if keys and (not full or (keys[0] >> SEQ_BITS, keys[0] & SEQ_MASK) < full[0][:2]):
            bucket.count -= 1
            self.keys -= 1
            priority, seq = unkey(heapq.heappop(keys))
            self._claiming.add(seq)
            return priority, seq
        return self.jobs[heapq.heappop(full)[2]]

    def claimed(self, seq: int) -> None:
        """The claim of this key is decided (its row reserved, or gone)."""
        self._claiming.discard(seq)

    def unclaim(self, queue: str, spec: str, priority: int, seq: int, key: str | None = None,
                labels: tuple[str, ...] = ()) -> None:
        """The reservation of a claimed key failed: the key goes back as it was, unless
        a cancel came meanwhile (then it waits in its heap for that cancel's outcome)."""
        self._claiming.discard(seq)
        if self._gone.get(seq) == PENDING_CLAIMED:
            heapq.heappush(self.bucket(queue, spec, key, labels).keys, key_of(priority, seq))
            self._gone[seq] = PENDING
            return
        self.push_key(queue, spec, priority, seq, key, labels)

    def _skip(self, seq: int) -> None:
        # (A key pushed again after its first was popped or claimed is a live key: the
        # job came back before the cancel's outcome, and the row will say who won.)
        if self._gone[seq] == PENDING:
            self._gone[seq] = PENDING_POPPED
        else:
            del self._gone[seq]

    # -- cancels of compact jobs: the row decides, in the writer's order --------------
    def withdraw(self, queue: str, spec: str, seq: int, key: str | None = None,
                 labels: tuple[str, ...] = ()) -> None:
        """Skip this key from now on: its cancel is being written. (If the job finished
        while its row was read, the count is one short until ``withdrawn``.)"""
        if seq in self._claiming:  # the reservation is written first: it will win
            self._gone[seq] = PENDING_CLAIMED
            return
        self._gone[seq] = PENDING
        self.bucket(queue, spec, key, labels).count -= 1
        self.keys -= 1

    def withdrawn(self, queue: str, spec: str, priority: int, seq: int, cancelled: bool,
                  key: str | None = None, labels: tuple[str, ...] = ()) -> None:
        """The cancel's write is done: ``cancelled`` if the row was still available."""
        state = self._gone.pop(seq, PENDING)
        if state == PENDING_CLAIMED:  # reserved by the claim written before: not cancelled
            return
        if cancelled:
            if state == PENDING:  # its key is still in the heap: drop it when it surfaces
                self._gone[seq] = DEAD
            return
        # Not cancelled (the write failed, or the job finished first): as it was.
        bucket = self.bucket(queue, spec, key, labels)
        if state == PENDING_POPPED:
            heapq.heappush(bucket.keys, key_of(priority, seq))
        bucket.count += 1
        self.keys += 1

    def holds(self, queue: str, spec: str, priority: int, seq: int, key: str | None = None,
              labels: tuple[str, ...] = ()) -> bool:
        """Whether this key is held here, waiting or being claimed: a scan of its bucket's
        heap, for the rare withdrawal of a job another's write cancelled (a unique
        replace; on several servers it may not have reached this one yet)."""
        if seq in self._claiming:
            return True
        if key is not None or labels:  # looked up, never made: it may hold nothing here
            lanes = self.lanes.get(queue, {}).get(spec)
            bucket = None if lanes is None else lanes.subs.get((key, labels))
        else:
            bucket = self.buckets.get(queue, {}).get(spec)
        return (bucket is not None and seq not in self._gone
                and key_of(priority, seq) in bucket.keys)

    # -- reading -------------------------------------------------------------------
    def counts(self) -> dict[tuple[str, str], int]:
        counts = {(queue, spec): bucket.count for queue, by_spec in self.buckets.items()
                  for spec, bucket in by_spec.items() if bucket.count}
        for queue, lanes_of in self.lanes.items():
            for spec, lanes in lanes_of.items():
                n = sum(bucket.count for bucket in lanes.subs.values())
                if n:
                    counts[(queue, spec)] = counts.get((queue, spec), 0) + n
        return counts

    def empty(self, paused: Collection[str] = ()) -> bool:
        """No job waits in any bucket outside the ``paused`` queues (dead entries count:
        ``head`` drops them)."""
        return not any(bucket.full or bucket.keys for bucket in self.all_buckets(paused))

    def all_buckets(self, skip: Collection[str] = ()) -> Iterable[Bucket]:
        for queue, by_spec in self.buckets.items():
            if queue not in skip:
                yield from by_spec.values()
        for queue, lanes_of in self.lanes.items():
            if queue not in skip:
                for lanes in lanes_of.values():
                    yield from lanes.subs.values()

    def held_seqs(self) -> set[int]:
        """The row ids of the compact jobs held: waiting, or popped for a claim being read."""
        return self.waiting_seqs() | self._claiming

    def waiting_seqs(self) -> set[int]:
        """The row ids of the compact jobs waiting (a full scan: for checks, not for hot paths)."""
        return {key & SEQ_MASK for bucket in self.all_buckets() for key in bucket.keys
                if self._gone.get(key & SEQ_MASK) not in (PENDING, DEAD)}


BUSY = "workers_busy"  # a backlog: capable workers run, all of them full
# Also backlogs: the jobs run as a limit frees up (rota/core/flow.py); not "blocked".
CONCURRENCY_LIMIT, RATE_LIMIT, NO_LABEL = "concurrency_limit", "rate_limit", "no_label"
BACKLOG = frozenset({BUSY, CONCURRENCY_LIMIT, RATE_LIMIT})


class Wait(NamedTuple):
    """Why available jobs of one queue and spec wait: ``kind``, a word (queue_paused,
    no_worker, no_status_quo, checksum_mismatch, not_implemented, workers_stopped: the
    ``reason`` label of GET /metrics' rota_jobs_blocked; no_label, for a job that needs
    worker labels; or a backlog: workers_busy, concurrency_limit, rate_limit), and
    ``reason``, a sentence."""

    kind: str
    reason: str

    @property
    def blocked(self) -> bool:
        """Nothing will take these jobs as things stand: no capable worker runs (none
        serves the queue, none declares the status-quo checksum, the capable ones are
        quiet or terminating) or the queue is paused, an operator's to look at. Jobs
        behind busy workers or a limit are only a backlog: they run as the workers or
        the limit free up."""
        return self.kind not in BACKLOG


def may_take(worker: WorkerSlot, spec: str, status_quo: Mapping[str, str],
             unversioned: Collection[str]) -> bool:
    """The one gate between a worker and a spec's jobs: the status-quo checksum declared;
    or, for a type with no status quo that OJS made (unversioned), a pull worker, or a
    /work worker that declares it ``"unversioned"``."""
    expected = status_quo.get(spec)
    if expected is None:
        return spec in unversioned and (worker.any_type or worker.specs.get(spec) == UNVERSIONED)
    return worker.specs.get(spec) == expected


def why_waiting(workers: Iterable[WorkerSlot], paused: Collection[str],
                status_quo: Mapping[str, str], queue: str, spec: str,
                unversioned: Collection[str] = ()) -> Wait | None:
    """Why available jobs of (queue, spec) are not running; None if they will be."""
    if queue in paused:
        return Wait("queue_paused", "queue paused")
    serving = [w for w in workers if queue in w.queues]
    if not serving:
        return Wait("no_worker", f"no connected worker serves queue {queue!r}")
    expected = status_quo.get(spec)
    if expected is None and spec not in unversioned:
        return Wait("no_status_quo", f"spec {spec!r} has no status quo")
    capable = [w for w in serving if may_take(w, spec, status_quo, unversioned)]
    if not capable and expected is None:
        return Wait("no_worker", f"no connected worker serves queue {queue!r} and runs"
                    f" unversioned type {spec!r}")
    if not capable:
        other = sum(1 for w in serving if spec in w.specs)
        if other:
            return Wait("checksum_mismatch", f"{other} worker(s) serve the queue but declare"
                        f" another checksum for spec {spec!r} (status quo {expected[:19]})")
        return Wait("not_implemented", f"{len(serving)} worker(s) serve the queue but none"
                    f" implements spec {spec!r}")
    running = [w for w in capable if w.state == "running"]
    if not running:
        said = "the 1 capable worker is" if len(capable) == 1 else \
            f"all {len(capable)} capable workers are"
        return Wait("workers_stopped", f"{said} quiet or terminating: none takes jobs")
    if not any(w.free() > 0 for w in running):
        unread = " or not reading what they are sent" if any(w.blocked for w in running) else ""
        said = "the 1 running capable worker is" if len(running) == 1 else \
            f"all {len(running)} running capable workers are"
        return Wait(BUSY, f"{said} full{unread}")
    return None
