"""How long finished jobs are kept, and which are due to go: pure, no clock, no I/O.

A finished job (completed, discarded or cancelled) is deleted, with its captured log
lines, once it has been finished longer than its state's retention: by default 7 days
completed, 30 days discarded, 7 days cancelled. ``rota serve`` sets the defaults
(``--retain-completed`` …) and overrides them per queue (``--retain
queue=emails:completed=1d``). The shell (rota/server/upkeep.py) asks ``due`` for the
cutoffs of now, deletes at most ``BATCH`` rows per writer transaction, and asks
``next_pass`` when to look again; ``PruneTally`` decides when a log line is due.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["BATCH", "DEFAULTS", "KEPT_STATES", "Cutoff", "Frame", "Frames", "PruneTally",
           "Retention", "due",
           "format_duration", "next_pass", "parse_duration", "parse_rule"]

DAY = 86400.0
KEPT_STATES = ("completed", "discarded", "cancelled")
# Completed: a week to look at results is what most teams use, and a busy queue's rows are
# most of the file. Discarded: a month, because a discarded job is a failure somebody must
# look at and may retry (POST /jobs/{id}/retry), which needs the row. Cancelled: a week,
# like completed: somebody asked for it, so there is rarely anything to investigate, but
# a cancel by mistake can still be retried for a while.
DEFAULTS: Mapping[str, float | None] = {"completed": 7 * DAY, "discarded": 30 * DAY,
                                        "cancelled": 7 * DAY}
# Rows deleted per writer transaction: about 2-5 ms of the writer's time (with their
# log lines), so enqueues and results queued meanwhile commit right after, not later.
BATCH = 500
PASS_EVERY = 60.0  # seconds between looks when the last batch found less than BATCH
MIN_WAIT = 0.1  # ... but never more often than this, however short a retention is
LOG_EVERY = 10.0  # seconds: at most one prune log line this often; counts add up meanwhile

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY, "w": 7 * DAY}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_NEVER = ("never", "forever")


def parse_duration(text: str) -> float | None:
    """Seconds from ``"7d"``, ``"12h"``, ``"30m"``, ``"0.5s"`` or ``"90"`` (seconds);
    ``None`` from ``"never"`` (kept forever). ValueError for anything else."""
    if text.strip().lower() in _NEVER:
        return None
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration: use a number with s, m, h, d or w"
                         " (7d, 12h, 0.5s), or never")
    seconds = float(match[1]) * _UNITS[match[2] or "s"]
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is too long")
    return seconds


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    for unit in ("d", "h", "m"):
        if seconds >= _UNITS[unit] and seconds % _UNITS[unit] == 0:
            return f"{int(seconds // _UNITS[unit])}{unit}"
    return f"{seconds:g}s"


def parse_rule(text: str) -> tuple[str, dict[str, float | None]]:
    """``"queue=emails:completed=1d:discarded=never"`` as (queue, {state: seconds})."""
    parts = [part.strip() for part in text.split(":")]
    head = parts[0].split("=", 1)
    if len(head) != 2 or head[0] != "queue" or not head[1] or len(parts) < 2:
        raise ValueError(f"{text!r}: expected queue=NAME:STATE=DURATION[:STATE=DURATION],"
                         " e.g. queue=emails:completed=1d")
    durations: dict[str, float | None] = {}
    for part in parts[1:]:
        state, _, duration = part.partition("=")
        if state not in KEPT_STATES:
            raise ValueError(f"{text!r}: {state!r} is not one of {', '.join(KEPT_STATES)}")
        durations[state] = parse_duration(duration)
    return head[1], durations


@dataclass(frozen=True, slots=True)
class Retention:
    """Seconds each finished state is kept (None: forever), and per-queue overrides."""

    default: Mapping[str, float | None] = field(default_factory=lambda: dict(DEFAULTS))
    queues: Mapping[str, Mapping[str, float | None]] = field(default_factory=dict)

    @classmethod
    def from_rules(cls, default: Mapping[str, float | None],
                   rules: Iterable[tuple[str, str, float | None]]) -> Retention:
        """From (queue, state, seconds) triples; a later rule for the same pair wins."""
        queues: dict[str, dict[str, float | None]] = {}
        for queue, state, seconds in rules:
            queues.setdefault(queue, {})[state] = seconds
        return cls({**DEFAULTS, **default}, queues)

    def durations(self) -> list[float]:
        """Every finite retention in force."""
        found = [s for s in self.default.values() if s is not None]
        found += [s for rules in self.queues.values() for s in rules.values() if s is not None]
        return found

    def describe(self) -> str:
        text = " ".join(f"{state}={format_duration(self.default.get(state))}"
                        for state in KEPT_STATES)
        for queue, rules in sorted(self.queues.items()):
            text += f" queue={queue}:" + ":".join(f"{state}={format_duration(seconds)}"
                                                  for state, seconds in rules.items())
        return text


@dataclass(frozen=True, slots=True)
class Cutoff:
    """Rows in ``state`` finished before ``before`` (wall-clock seconds) are due: in
    ``queue`` only, or, when ``queue`` is None, in every queue but ``others`` (which
    have their own rule for this state). ``spans``, if any, say it instead: rows whose
    ``finished_at`` lies in one of these [from, to) ranges (the wall clock stepped while
    the server ran: ``Frames``)."""

    state: str
    before: float
    queue: str | None = None
    others: tuple[str, ...] = ()
    spans: tuple[tuple[float, float], ...] = ()


# -- the wall clock's steps while the server runs ----------------------------------------
STEP = 1.0  # seconds the wall clock may move against the monotonic one and be no step
MAX_FRAMES = 64  # frames kept per run; past that the two oldest merge (keeping rows longer)


@dataclass(slots=True)
class Frame:
    """A stretch of the run with one wall-clock ``offset`` (wall minus monotonic), and
    the range of the ``finished_at`` moments written in it (the first frame's reaches
    back to every row of earlier runs)."""

    offset: float
    low: float = math.inf
    high: float = -math.inf


@dataclass(slots=True)
class Frames:
    """What retention must know of wall-clock steps (a finished job's age is judged by
    the clock its ``finished_at`` was written with, not the one that reads it now). Pure:
    the shell passes every ``finished_at`` it writes, with the monotonic clock then."""

    frames: list[Frame] = field(default_factory=list)

    def look(self, wall: float, mono: float) -> float:
        """A reading of both clocks: the step of the wall clock it reveals (a new frame
        begins), else 0.0. The first reading (the start) begins the first frame, which
        claims every row stored before it."""
        offset = wall - mono
        if not self.frames:
            self.frames.append(Frame(offset, -math.inf, wall))
            return 0.0
        step = offset - self.frames[-1].offset
        if abs(step) <= STEP:
            return 0.0
        self.frames.append(Frame(offset))
        if len(self.frames) > MAX_FRAMES:
            first, second = self.frames[0], self.frames.pop(1)
            first.offset = min(first.offset, second.offset)
            first.high = max(first.high, second.high)
        return step

    def seen(self, finished: Iterable[float], wall: float, mono: float) -> float:
        """Note ``finished_at`` moments about to be stored, with a reading of both clocks
        taken after them (a moment read before a step and noted after it is put in the
        new frame, which only keeps its row longer); the step this reveals, else 0.0."""
        step = self.look(wall, mono)
        frame = self.frames[-1]
        for moment in finished:
            frame.low, frame.high = min(frame.low, moment), max(frame.high, moment)
        return step

    def spans(self, seconds: float, mono: float, wall: float) -> tuple[tuple[float, float], ...]:
        """The ``finished_at`` ranges that are due after ``seconds`` as of (``mono``,
        ``wall``); () while no step was seen (then ``wall - seconds`` says it all).

        A row written in a frame is due once ``mono - (finished_at - offset)`` reaches
        ``seconds``. Where the frames' ranges overlap (a step back), which frame wrote
        a row cannot be told, and it waits for the latest of their cutoffs: kept a
        little long, never deleted early. A row no frame wrote (another program's) is
        judged by the clock now."""
        if len(self.frames) < 2:
            return ()
        claims = [(f.low, f.high, mono + f.offset - seconds) for f in self.frames
                  if f.low <= f.high]
        now_cut = wall - seconds

        def due_at(at: float) -> bool:
            return at < min([cut for low, high, cut in claims if low <= at <= high]
                            or [now_cut])

        edges = sorted({-math.inf, math.inf, now_cut, *(
            x for claim in claims for x in claim if math.isfinite(x))})
        pieces: list[tuple[float, float]] = []
        for start, end in zip(edges, edges[1:]):
            after = math.nextafter(start, math.inf)
            if math.isfinite(start) and due_at(start):  # the edge itself (a row's moment)
                pieces.append((start, after))
            if due_at(_inside(start, end)):
                pieces.append((after if math.isfinite(start) else start, end))
        spans: list[tuple[float, float]] = []
        for low, high in pieces:
            if spans and spans[-1][1] >= low:
                spans[-1] = (spans[-1][0], high)
            else:
                spans.append((low, high))
        return tuple(spans)


def _inside(start: float, end: float) -> float:
    """A point strictly between two edges (one of them may be infinite)."""
    if math.isinf(start):
        return end - 1.0
    if math.isinf(end):
        return start + 1.0
    return (start + end) / 2


def due(retention: Retention, now: float, frames: Frames | None = None,
        mono: float = 0.0) -> list[Cutoff]:
    """What is due for deletion at wall-clock ``now``: one cutoff per (state, rule)
    with a finite retention, in KEPT_STATES order (the shell prunes them in turn).
    ``frames`` (with the monotonic ``mono`` of ``now``): the wall clock's steps while
    the server ran, which each cutoff's spans allow for."""
    cutoffs: list[Cutoff] = []

    def cutoff(state: str, seconds: float, queue: str | None, others: tuple[str, ...] = ()
               ) -> Cutoff:
        spans = () if frames is None else frames.spans(seconds, mono, now)
        return Cutoff(state, now - seconds, queue, others, spans)

    for state in KEPT_STATES:
        own = tuple(sorted(q for q, rules in retention.queues.items() if state in rules))
        seconds = retention.default.get(state)
        if seconds is not None:
            cutoffs.append(cutoff(state, seconds, None, own))
        for queue in own:
            seconds = retention.queues[queue][state]
            if seconds is not None:
                cutoffs.append(cutoff(state, seconds, queue))
    return cutoffs


def next_pass(deleted: int, retention: Retention, batch: int = BATCH) -> float | None:
    """Seconds until the next batch. A full batch means more are due: at once (the
    writer commits whatever was queued meanwhile first). Otherwise in PASS_EVERY, or a
    quarter of the shortest retention if that is sooner, so that a short retention is
    kept to within about a quarter of itself. None: nothing is ever pruned."""
    durations = retention.durations()
    if not durations:
        return None
    if deleted >= batch:
        return 0.0
    return max(MIN_WAIT, min(PASS_EVERY, min(durations) / 4))


@dataclass(slots=True)
class PruneTally:
    """Counts deleted rows and says when a log line is due: at most one every
    ``every`` seconds (monotonic), carrying the counts of the batches since the last."""

    every: float = LOG_EVERY
    counts: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    last: float | None = None

    def add(self, deleted: Mapping[str, int], mono: float) -> str | None:
        """Record one batch's deletions; the log line to write now, if one is due."""
        if any(deleted.values()):
            self.batches += 1
            for state, count in deleted.items():
                self.counts[state] = self.counts.get(state, 0) + count
        if not self.batches or (self.last is not None and mono - self.last < self.every):
            return None
        line = ("prune " + " ".join(f"{state}={self.counts.get(state, 0)}"
                                    for state in KEPT_STATES) + f" batches={self.batches}")
        self.counts, self.batches, self.last = {}, 0, mono
        return line
