"""What happened on the server, kept for its operator: events, per-minute counts, metrics.

Pure: the engine (and the shell, for what only it sees) records each fact here with the
wall time it was given; nothing reads a clock or does I/O. Recording is on the hot path
(three records per job at ~15,000 jobs a second), so a record is a plain tuple appended
to a bounded deque and a few integer increments: no JSON, no prometheus-client call. An
event becomes JSON only when it is sent to a subscriber (``encode``), and the numbers
become Prometheus metrics only at scrape time (rota/feeds.py).

Three things are kept:

- a ring of the latest events (``buffer`` of them), numbered by increasing integers
  (``first_id`` the first: the shell starts from a clock reading, so that ids keep
  growing across restarts and a client resuming from a previous run sees a gap);
- per (queue, spec), counts per minute over the last ``MINUTES`` minutes, and totals
  since the start (the Prometheus counters);
- per (queue, spec), two histograms: queue wait (due to assigned) and run time
  (assigned to result).
"""

from __future__ import annotations

import bisect
import collections
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from rota.protocol import rfc3339

KINDS = ("enqueue", "assign", "result", "retry", "discard", "cancel", "worker_connect",
         "worker_disconnect", "worker_state", "state_change", "alert")
COUNTS = ("enqueued", "completed", "failed", "retried", "discarded", "cancelled")
ENQUEUED, COMPLETED, FAILED, RETRIED, DISCARDED, CANCELLED = range(6)
MINUTES = 60  # the per-minute counts kept
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
# duration_ms, message). ``message`` may be a job's stored error record (JSON bytes),
# decoded only if the event is sent.
Event = tuple[float, str, str | None, str | None, str | None, str | None, str | None,
              int | None, str | None, float | None, Any]
_FIELDS = ("job", "spec", "checksum", "queue", "worker", "attempt", "state", "duration_ms")
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

    __slots__ = ("totals", "minutes", "wait", "duration")

    def __init__(self) -> None:
        self.totals = [0] * len(COUNTS)
        self.minutes: dict[int, list[int]] = {}
        self.wait = Histogram(WAIT_BOUNDS)
        self.duration = Histogram(DURATION_BOUNDS)

    def count(self, what: int, wall: float, n: int = 1) -> None:
        self.totals[what] += n
        minute = int(wall // 60)
        row = self.minutes.get(minute)
        if row is None:  # a new minute: forget those that left the window
            row = self.minutes[minute] = [0] * len(COUNTS)
            for old in [m for m in self.minutes if m <= minute - MINUTES]:
                del self.minutes[old]
        row[what] += n


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
    def __init__(self, buffer: int = 10_000, first_id: int = 1) -> None:
        self.ring: collections.deque[Event] = collections.deque(maxlen=max(1, buffer))
        self.next_id = first_id  # the id the next event gets
        self.series: dict[tuple[str, str], Series] = {}
        # Called after events are recorded, while someone listens (the shell wakes its
        # subscribers); None otherwise, so that recording costs one test.
        self.listener: Any = None
        self.latest = 0.0  # the latest wall time recorded: for callers that have none

    # -- recording (the hot path) -----------------------------------------------------
    def _series(self, queue: str, spec: str) -> Series:
        series = self.series.get((queue, spec))
        if series is None:
            series = self.series[(queue, spec)] = Series()
        return series

    def event(self, wall: float, kind: str, *, job: str | None = None, spec: str | None = None,
              checksum: str | None = None, queue: str | None = None, worker: str | None = None,
              attempt: int | None = None, state: str | None = None,
              duration_ms: float | None = None, message: Any = None) -> None:
        """One event of any kind (the rarer ones: workers, state changes, alerts)."""
        self.ring.append((wall, kind, job, spec, checksum, queue, worker, attempt, state,
                          duration_ms, message))
        self.next_id += 1
        self.latest = wall
        if self.listener is not None:
            self.listener()

    def enqueued(self, jobs: list[tuple[str, str, str, str]], wall: float) -> None:
        """New jobs: (id, spec, queue, state) each."""
        append = self.ring.append
        for job_id, spec, queue, state in jobs:
            append((wall, "enqueue", job_id, spec, None, queue, None, 0, state, None, None))
            self._series(queue, spec).count(ENQUEUED, wall)
        self.next_id += len(jobs)
        self.latest = wall
        if self.listener is not None:
            self.listener()

    def assigned(self, jobs: list[tuple[str, str, str | None, str, str, int, float]],
                 wall: float) -> None:
        """Jobs sent to a worker: (id, spec, checksum, queue, worker, attempt, due) each,
        ``due`` the wall time since which each could have run."""
        append = self.ring.append
        for job_id, spec, checksum, queue, worker, attempt, due in jobs:
            append((wall, "assign", job_id, spec, checksum, queue, worker, attempt, "active",
                    None, None))
            self._series(queue, spec).wait.observe(max(0.0, wall - due))
        self.next_id += len(jobs)
        self.latest = wall
        if self.listener is not None:
            self.listener()

    def ended(self, wall: float, job: str, spec: str, queue: str, worker: str | None,
              attempt: int, state: str, *, ending: str | None, reported: bool,
              started: float | None, error: Any = None) -> None:
        """An attempt ended (``reported``: by its worker's result, else by the server: a
        lapsed lease, a worker gone, a time to live run out) and the job went to
        ``state``; ``ending`` is why it did not complete (None: it did), ``started`` when
        it was assigned (wall), ``error`` its stored error record."""
        series = self._series(queue, spec)
        append = self.ring.append
        duration = None
        if started is not None and reported and ending != "released":  # (it never ran)
            duration = max(0.0, wall - started)
            series.duration.observe(duration)
            duration = round(duration * 1000, 3)
        if reported:
            append((wall, "result", job, spec, None, queue, worker, attempt, state, duration,
                    error))
            self.next_id += 1
        if state == "completed":
            series.count(COMPLETED, wall)
        elif ending in FAILURES:
            series.count(FAILED, wall)
        if state == "discarded":
            series.count(DISCARDED, wall)
            kind: str | None = "discard"
        elif state == "cancelled":
            series.count(CANCELLED, wall)
            kind = "cancel"
        elif state != "completed" and ending in FAILURES:
            series.count(RETRIED, wall)
            kind = "retry"
        else:
            kind = None
        if kind is not None:
            append((wall, kind, job, spec, None, queue, worker, attempt, state, None,
                    error))
            self.next_id += 1
        self.latest = wall
        if self.listener is not None:
            self.listener()

    def counted(self, wall: float, kind: str, job: str, spec: str, queue: str, *,
                attempt: int | None = None, message: Any = None) -> None:
        """A job moved by an operator or a timer: "retry" (a manual retry), "cancel"
        (a waiting job cancelled), "discard" (its time to live ran out)."""
        what = {"retry": RETRIED, "cancel": CANCELLED, "discard": DISCARDED}[kind]
        self._series(queue, spec).count(what, wall)
        state = {"retry": "available", "cancel": "cancelled", "discard": "discarded"}[kind]
        self.event(wall, kind, job=job, spec=spec, queue=queue, attempt=attempt, state=state,
                   message=message)

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
        for (queue, spec), series in sorted(self.series.items()):
            picked = [series.minutes.get(m) for m in starts]
            if not any(picked):
                continue
            row: dict[str, Any] = {"queue": queue, "spec": spec}
            for what, name in enumerate(COUNTS):
                row[name] = [0 if counts is None else counts[what] for counts in picked]
            rows.append(row)
        return starts, rows

    def totals(self) -> Iterator[tuple[str, str, Series]]:
        for (queue, spec), series in sorted(self.series.items()):
            yield queue, spec, series


def encode(event_id: int, event: Event) -> bytes:
    """One event as a server-sent event: its id, kind and a JSON object."""
    wall, kind = event[0], event[1]
    data: dict[str, Any] = {"at": rfc3339(wall), "kind": kind}
    for name, value in zip(_FIELDS, event[2:10], strict=True):
        if value is not None:
            data[name] = value
    message = event[10]
    if isinstance(message, bytes):  # a stored error record: its message
        try:
            message = _error.decode(message).get("message")
        except (msgspec.DecodeError, AttributeError):
            message = None
    if kind == "alert" and isinstance(message, tuple):  # (level, text)
        data["level"], message = message
    if message is not None:
        data["message"] = message
    return frame(event_id, kind, data)


def gap(missed_from: int, missed_to: int, wall: float) -> bytes:
    """What a subscriber that fell behind the ring gets before the events it can have."""
    return frame(missed_to, "gap", {"at": rfc3339(wall), "kind": "gap",
                                    "missed_from": missed_from, "missed_to": missed_to})


def frame(event_id: int, kind: str, data: Mapping[str, Any]) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event_id, kind.encode(),
                                                 msgspec.json.encode(data))
