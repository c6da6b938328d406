"""What happened on the server, kept for its operator: events, per-minute counts, metrics.

Pure: the engine (and the shell, for what only it sees) records each fact here with the
wall time it was given; nothing reads a clock or does I/O. Recording is on the hot path
(three records per job at ~15,000 jobs a second), so a record is a plain tuple appended
to a bounded deque and a few integer increments: no JSON, no prometheus-client call. An
event becomes what it says (``event_data``) only when it is sent to a subscriber, and
rota/server/feeds.py puts it on the wire as a server-sent event; the numbers become Prometheus
metrics only at scrape time, there too.

Three things are kept:

- a ring of the latest events (``buffer`` of them), numbered by increasing integers
  (``first_id`` the first: the shell starts from a clock reading, so that ids keep
  growing across restarts and a client resuming from a previous run sees a gap);
- per (queue, spec), counts per minute over the last ``MINUTES`` minutes, and totals
  since the start (the Prometheus counters);
- per (queue, spec), two histograms: queue wait (due to assigned) and run time
  (assigned to result).

Producers name queues, so the (queue, spec) pairs are bounded: at most ``max_series``
are tracked one by one. A new pair past that takes the place of the pair touched least
recently if that one has been idle for the whole per-minute window (``MINUTES``; its
numbers are folded into the ``OTHER`` series, so that every total stays a sum that only
grows), and is otherwise counted under ``OTHER`` itself.
"""

from __future__ import annotations

import bisect
import collections
import functools
import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from rota.core.model import Change, JobRecord
from rota.base.protocol import rfc3339

KINDS = ("enqueue", "assign", "result", "retry", "discard", "cancel", "worker_connect",
         "worker_disconnect", "worker_state", "state_change", "alert", "cron_fire", "cron_skip",
         "cron_miss")
COUNTS = ("enqueued", "completed", "failed", "retried", "discarded", "cancelled")
ENQUEUED, COMPLETED, FAILED, RETRIED, DISCARDED, CANCELLED = range(6)
MINUTES = 60  # the per-minute counts kept
# Job states still to run: which queues a scrape or a page names first.
UNFINISHED = ("available", "scheduled", "retryable", "active")
# The (queue, spec) of what is counted beyond ``max_series``: not a name a producer can
# give (names are letters, digits and _.:-), so it never mixes with a real queue.
OTHER = "(other)"
# Attempt endings that are the job's (or its worker's) failure; others (released from a
# prefetch line, a worker's shutdown, a cancel) neither count as failed nor retried.
FAILURES = frozenset({"failed", "worker_death", "visibility_timeout"})
# Histogram bounds, seconds (Prometheus ``le``): from a drain's sub-millisecond waits to
# an hour in a backlog; from a no-op job to the default visibility timeout.
WAIT_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
               60.0, 300.0, 900.0, 3600.0)
DURATION_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 300.0, 1800.0)

# An event as recorded: (wall, kind, job, spec, checksum, queue, worker, attempt, state,
# duration, message). ``duration`` is in seconds (sent as duration_ms); ``message`` may
# be a job's stored error record (JSON bytes), decoded only if the event is sent.
Event = tuple[float, str, str | None, str | None, str | None, str | None, str | None,
              int | None, str | None, float | None, Any]
_error = msgspec.json.Decoder()


class Histogram:
    """Counts per bucket (the last is +Inf) and their sum: plain numbers."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Series:
    """One (queue, spec): totals, counts per minute (minute number -> counts), histograms."""

    __slots__ = ("totals", "minutes", "wait", "duration", "touched")

    def __init__(self) -> None:
        self.totals = [0] * len(COUNTS)
        self.minutes: dict[int, list[int]] = {}
        self.wait = Histogram(WAIT_BOUNDS)
        self.duration = Histogram(DURATION_BOUNDS)
        self.touched = 0  # the minute number it was last recorded in

    def fold(self, other: Series) -> None:
        """Add ``other``'s totals and histograms to these (not its minutes: it is folded
        only once they are all older than the window kept)."""
        for i, n in enumerate(other.totals):
            self.totals[i] += n
        for mine, theirs in ((self.wait, other.wait), (self.duration, other.duration)):
            for i, n in enumerate(theirs.counts):
                mine.counts[i] += n
            mine.sum += theirs.sum

    def row(self, minute: int) -> list[int]:
        """The counts of minute number ``minute`` (wall // 60)."""
        row = self.minutes.get(minute)
        if row is None:  # a new minute: forget those that left the window
            row = self.minutes[minute] = [0] * len(COUNTS)
            for old in [m for m in self.minutes if m <= minute - MINUTES]:
                del self.minutes[old]
        return row


@dataclass(frozen=True, slots=True)
class Filter:
    """A subscriber's server-side filter: None matches anything."""

    kinds: frozenset[str] | None = None
    spec: str | None = None
    queue: str | None = None
    worker: str | None = None

    def matches(self, event: Event) -> bool:
        return ((self.kinds is None or event[1] in self.kinds)
                and (self.spec is None or event[3] == self.spec)
                and (self.queue is None or event[5] == self.queue)
                and (self.worker is None or event[6] == self.worker))


class Observer:
    def __init__(self, buffer: int = 10_000, first_id: int = 1, max_series: int = 1000) -> None:
        self.ring: collections.deque[Event] = collections.deque(maxlen=max(1, buffer))
        self.next_id = first_id  # the id the next event gets
        # Least recently touched first (a series touched in a new minute moves to the end).
        self.series: dict[tuple[str, str], Series] = {}
        self.max_series = max(1, max_series)
        self.other: Series | None = None  # what is counted beyond max_series
        # Called after events are recorded, while someone listens (the shell wakes its
        # subscribers); None otherwise, so that recording costs one test.
        self.listener: Any = None
        self.latest = 0.0  # the latest wall time recorded: for callers that have none
        # Events as subscribers receive them, by id, made and bounded by rota/server/feeds.py
        # (``encoding``): several subscribers at the same place (as they are in a burst)
        # encode each event once. Emptied by the shell when the last subscriber goes.
        self.encoded: dict[int, bytes] = {}
        # The per-minute counts as last written to the store (``unsaved``, ``saved``): the
        # minute of that write, and each (queue, spec)'s counts of it and of any later one.
        self.kept_minute = 0
        self.kept: dict[tuple[str, str, int], list[int]] = {}

    # -- recording (the hot path) -----------------------------------------------------
    # The batch methods take the engine's own objects (no tuple built per job to call
    # them) and look up a job's (queue, spec) series and minute row only when it differs
    # from the previous job's: a batch is usually all of one spec.
    def _series(self, queue: str, spec: str, minute: int) -> Series:
        key = (queue, spec)
        series = self.series.get(key)
        if series is None:
            return self._new_series(key, minute)
        if series.touched != minute:  # at most once a minute per series: keep the order
            series.touched = minute
            del self.series[key]
            self.series[key] = series
        return series

    def _new_series(self, key: tuple[str, str], minute: int) -> Series:
        """A series for a pair not tracked yet, within ``max_series`` (see the top)."""
        if len(self.series) >= self.max_series:
            other = self.other
            if other is None:
                other = self.other = Series()
            other.touched = minute
            stalest = next(iter(self.series))
            idle = self.series[stalest]
            if idle.touched > minute - MINUTES:  # none idle: counted under OTHER
                return other
            other.fold(self.series.pop(stalest))
        series = self.series[key] = Series()
        series.touched = minute
        return series

    def _wake(self, wall: float) -> None:
        self.latest = wall
        if self.listener is not None:
            self.listener()

    def event(self, wall: float, kind: str, *, job: str | None = None, spec: str | None = None,
              checksum: str | None = None, queue: str | None = None, worker: str | None = None,
              attempt: int | None = None, state: str | None = None,
              duration: float | None = None, message: Any = None) -> None:
        """One event of any kind (the rarer ones: workers, state changes, alerts)."""
        self.ring.append((wall, kind, job, spec, checksum, queue, worker, attempt, state,
                          duration, message))
        self.next_id += 1
        self._wake(wall)

    def enqueued(self, jobs: Iterable[JobRecord], wall: float) -> None:
        """New jobs, taken in."""
        append = self.ring.append
        minute = int(wall // 60)
        queue = spec = ""
        totals = row = [0]
        n = 0
        for job in jobs:
            append((wall, "enqueue", job.id, job.spec, None, job.queue, None, 0, job.state,
                    None, None))
            if job.queue != queue or job.spec != spec:
                queue, spec = job.queue, job.spec
                series = self._series(queue, spec, minute)
                totals, row = series.totals, series.row(minute)
            totals[ENQUEUED] += 1
            row[ENQUEUED] += 1
            n += 1
        self.next_id += n
        self._wake(wall)

    def assigned(self, jobs: Iterable[JobRecord], worker: str, wall: float) -> None:
        """Jobs sent to ``worker``: each waited from its ``run_at`` (or its enqueue)."""
        append = self.ring.append
        bisect_left = bisect.bisect_left
        minute = int(wall // 60)
        queue = spec = ""
        wait = Histogram(())
        n = 0
        for job in jobs:
            append((wall, "assign", job.id, job.spec, job.checksum, job.queue, worker,
                    job.attempt, "active", None, None))
            if job.queue != queue or job.spec != spec:
                queue, spec = job.queue, job.spec
                wait = self._series(queue, spec, minute).wait
            waited = wall - (job.run_at or job.enqueued_at)
            if waited < 0.0:
                waited = 0.0
            wait.counts[bisect_left(wait.bounds, waited)] += 1
            wait.sum += waited
            n += 1
        self.next_id += n
        self._wake(wall)

    def ended(self, changes: Iterable[Change], wall: float, *, worker: str | None = None,
              reported: bool) -> None:
        """Attempts that ended, committed (``reported``: by their worker's result, else by
        the server: a lapsed lease, a worker gone, a time to live run out), each job gone
        to its state; ``worker``: the results' worker (else each job's last holder)."""
        append = self.ring.append
        bisect_left = bisect.bisect_left
        minute = int(wall // 60)
        queue = spec = ""
        series = Series()
        row = series.totals
        for change in changes:
            job = change.job
            if job.queue != queue or job.spec != spec:
                queue, spec = job.queue, job.spec
                series = self._series(queue, spec, minute)
                row = series.row(minute)
            duration = None
            started = job.reserved_at
            if reported and started is not None and change.ending != "released":
                duration = wall - started  # (a released job never ran)
                if duration < 0.0:
                    duration = 0.0
                histogram = series.duration
                histogram.counts[bisect_left(histogram.bounds, duration)] += 1
                histogram.sum += duration
            state = job.state
            if state == "completed":  # the common case, first
                append((wall, "result", job.id, spec, None, queue, worker, job.attempt,
                        state, duration, None))
                self.next_id += 1
                series.totals[COMPLETED] += 1
                row[COMPLETED] += 1
                continue
            holder = worker if reported else job.worker_id
            if reported:
                append((wall, "result", job.id, spec, None, queue, holder, job.attempt,
                        state, duration, change.error))
                self.next_id += 1
            failure = change.ending in FAILURES
            if failure:
                series.totals[FAILED] += 1
                row[FAILED] += 1
            if state == "discarded":
                what, kind = DISCARDED, "discard"
            elif state == "cancelled":
                what, kind = CANCELLED, "cancel"
            elif failure:
                what, kind = RETRIED, "retry"
            else:
                continue
            series.totals[what] += 1
            row[what] += 1
            append((wall, kind, job.id, spec, None, queue, holder, job.attempt, state, None,
                    change.error))
            self.next_id += 1
        self._wake(wall)

    def counted(self, wall: float, kind: str, job: str, spec: str, queue: str, *,
                attempt: int | None = None, message: Any = None) -> None:
        """A job moved by an operator or a timer: "retry" (a manual retry), "cancel"
        (a waiting job cancelled), "discard" (its time to live ran out)."""
        what = {"retry": RETRIED, "cancel": CANCELLED, "discard": DISCARDED}[kind]
        minute = int(wall // 60)
        series = self._series(queue, spec, minute)
        series.totals[what] += 1
        series.row(minute)[what] += 1
        state = {"retry": "available", "cancel": "cancelled", "discard": "discarded"}[kind]
        self.event(wall, kind, job=job, spec=spec, queue=queue, attempt=attempt, state=state,
                   message=message)

    # -- kept in the store: the shell writes them, a restart loads them back -----------------
    def restore(self, rows: Iterable[tuple[Any, ...]], wall: float) -> None:
        """Counts an earlier run kept, oldest first, as (minute, queue, spec, *counts in
        COUNTS' order): those of the window are taken in (the totals since the start are
        not: they are this run's), and are not written again."""
        now = int(wall // 60)
        kept: dict[tuple[str, str, int], list[int]] = {}
        for minute, queue, spec, *counts in rows:
            if now - MINUTES < minute <= now:
                if queue == OTHER:
                    series = self.other = self.other or Series()
                else:
                    series = self._series(queue, spec, minute)
                row = series.row(minute)
                for i, n in enumerate(counts[:len(COUNTS)]):
                    row[i] += n
                if minute == now:  # still counting: only what comes next is to write
                    kept[queue, spec, minute] = list(counts[:len(COUNTS)])
        self.saved((now, kept))

    def unsaved(self, wall: float) -> tuple[list[tuple[Any, ...]], Any]:
        """What was counted since the last write ``saved`` was told of, as rows to add to
        the store's ((minute, queue, spec, *counts)), and the mark to give ``saved`` once
        they are written. Minutes before the last write's are whole and written."""
        now = int(wall // 60)
        since = self.kept_minute
        rows: list[tuple[Any, ...]] = []
        kept: dict[tuple[str, str, int], list[int]] = {}
        for queue, spec, series in self.totals():
            if series.touched < since and series is not self.other:
                continue
            for minute in reversed(series.minutes):  # newest first: the few that matter
                if minute < since:
                    break
                counts = series.minutes[minute]
                before = self.kept.get((queue, spec, minute))
                delta = counts if before is None else [a - b for a, b in zip(counts, before)]
                if any(delta):
                    rows.append((minute, queue, spec, *delta))
                if minute >= now:  # still counting (or ahead of a wall clock set back)
                    kept[queue, spec, minute] = list(counts)
        return rows, (now, kept)

    def saved(self, mark: Any) -> None:
        """The rows ``unsaved`` gave with ``mark`` are in the store."""
        self.kept_minute, self.kept = mark

    # -- reading ------------------------------------------------------------------------
    @property
    def first_kept(self) -> int:
        """The id of the oldest event still in the ring (``next_id`` if it is empty)."""
        return self.next_id - len(self.ring)

    def after(self, last_id: int, limit: int) -> tuple[int, list[tuple[int, Event]]]:
        """Events with ids above ``last_id``, oldest first, at most ``limit``; and the
        first id that was wanted but is no longer kept (0: none was missed)."""
        first = self.first_kept
        missed = 0
        if last_id + 1 < first:
            missed, last_id = last_id + 1, first - 1
        start = last_id + 1 - first
        stop = min(len(self.ring), start + limit)
        if start >= stop:
            return missed, []
        picked = itertools.islice(self.ring, start, stop)  # C speed, even from the far end
        return missed, [(first + i, ev) for i, ev in zip(range(start, stop), picked,
                                                        strict=True)]

    def window(self, minutes: int, wall: float) -> tuple[list[int], list[dict[str, Any]]]:
        """The last ``minutes`` minute numbers (the current one last) and, per (queue,
        spec) seen in them, the counts of each minute."""
        now = int(wall // 60)
        starts = list(range(now - minutes + 1, now + 1))
        rows = []
        for queue, spec, series in self.totals():
            picked = [series.minutes.get(m) for m in starts]
            if not any(picked):
                continue
            row: dict[str, Any] = {"queue": queue, "spec": spec}
            for what, name in enumerate(COUNTS):
                row[name] = [0 if counts is None else counts[what] for counts in picked]
            rows.append(row)
        return starts, rows

    def totals(self) -> Iterator[tuple[str, str, Series]]:
        """Every series by (queue, spec), then OTHER's if anything was counted there."""
        for (queue, spec), series in sorted(self.series.items()):
            yield queue, spec, series
        if self.other is not None:
            yield OTHER, OTHER, self.other


def busiest(weights: Mapping[str, Any], limit: int) -> list[str]:
    """The ``limit`` names of greatest weight (ties by name), by name: which queues a
    scrape or a stats page names one by one."""
    if len(weights) <= limit:
        return sorted(weights)
    return sorted(heapq.nsmallest(limit, weights, key=lambda name: (_negated(weights[name]),
                                                                    name)))


def _negated(weight: Any) -> Any:
    return tuple(-w for w in weight) if isinstance(weight, tuple) else -weight


def fold_queues(counts: Mapping[str, Mapping[str, int]], limit: int,
                unfinished: Iterable[str]) -> dict[str, dict[str, int]]:
    """Counts per queue and state for at most ``limit`` queues, those with the most
    jobs in the ``unfinished`` states (then the most jobs), and the rest summed under
    OTHER."""
    if len(counts) <= limit:
        return {queue: dict(per) for queue, per in counts.items()}
    live = tuple(unfinished)
    weights = {queue: (sum(per.get(s, 0) for s in live), sum(per.values()))
               for queue, per in counts.items()}
    kept = busiest(weights, limit)
    folded = {queue: dict(counts[queue]) for queue in kept}
    rest: dict[str, int] = folded.setdefault(OTHER, {})
    for queue in counts.keys() - set(kept):
        for state, n in counts[queue].items():
            rest[state] = rest.get(state, 0) + n
    return folded


class EventData(msgspec.Struct, omit_defaults=True):
    """An event's ``data``: what does not apply is left out (msgspec omits the Nones,
    faster than building a dict of what is set)."""

    at: str
    kind: str
    job: str | None = None
    spec: str | None = None
    checksum: str | None = None
    queue: str | None = None
    worker: str | None = None
    attempt: int | None = None
    state: str | None = None
    duration_ms: float | None = None
    level: str | None = None
    message: str | None = None


# The events of a batch share their time: its text is made once (rfc3339 is ~1 us).
_at = functools.lru_cache(maxsize=256)(rfc3339)


def event_data(event: Event) -> EventData:
    """What an event says to an operator: only what applies, an error record reduced to
    its message, an alert's level apart. Made only for a subscriber that reads the event
    (rota/server/feeds.py puts it on the wire)."""
    wall, kind, job, spec, checksum, queue, worker, attempt, state, duration, message = event
    level = None
    if message is not None:
        if isinstance(message, bytes):  # a stored error record: its message
            try:
                message = _error.decode(message).get("message")
            except (msgspec.DecodeError, AttributeError):
                message = None
        elif isinstance(message, tuple):  # an alert's (level, text)
            level, message = message
    return EventData(_at(wall), kind, job, spec, checksum, queue, worker, attempt, state,
                     None if duration is None else round(duration * 1000, 3), level, message)
