"""The job model: a job's states, its guarded transitions, and the records the store keeps.

At the bottom of the server's layers: the scheduler, the engine and the store all
speak in these types, and none of them needs another to describe a job.

Times come in two kinds. Fields named ``*_at`` are wall-clock seconds (what is
stored and shown); ``due``, ``expiry`` and ``lease`` are deadlines on the monotonic
clock, which is what every decision compares, so that a wall-clock step moves nothing.
They are derived from the wall-clock fields once, when a job is taken in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgspec

from rota.base.errors import RotaError
from rota.base.ojs import OjsExtras
from rota.core.unique import UniqueClaim


class Instant(NamedTuple):
    """One reading of both clocks: ``mono`` for deadlines, ``wall`` for records."""

    mono: float
    wall: float

    def deadline(self, wall_time: float) -> float:
        """The monotonic deadline of a wall-clock moment, as of this reading."""
        return self.mono + (wall_time - self.wall)

    def wall_of(self, deadline: float) -> float:
        """The wall-clock moment of a monotonic deadline, as of this reading."""
        return self.wall + (deadline - self.mono)


class ClockReading(NamedTuple):
    """The wall clock beside the machine's boot clock (CLOCK_BOOTTIME: seconds since it
    booted, a suspend included), as a store keeps it from run to run."""

    wall: float
    boot: float
    boot_id: str  # which boot ``boot`` counts from


STEP_TOLERANCE = 1.0  # seconds of disagreement between the clocks that are no step


def wall_step(last: ClockReading | None, now: ClockReading) -> float:
    """How far the wall clock stepped between the last run's reading and this one,
    beyond the time that passed (0.0: no step to speak of, or none that can be told).

    On the same boot, the boot clock says exactly how much time passed, so the rest of
    the wall clock's move is a step, either way. Across a reboot the time between is
    unknown: a wall clock behind the last reading stepped back at least that far (taken
    as that far); one ahead may only mean the machine was down, and is taken as that."""
    if last is None:
        return 0.0
    if last.boot_id == now.boot_id:
        step = (now.wall - last.wall) - (now.boot - last.boot)
    else:
        step = min(0.0, now.wall - last.wall)
    return step if abs(step) > STEP_TOLERANCE else 0.0


class JobState(enum.StrEnum):
    SCHEDULED = "scheduled"
    AVAILABLE = "available"
    ACTIVE = "active"
    RETRYABLE = "retryable"
    COMPLETED = "completed"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"
    # Held until its workflow (rota/core/workflows.py) or its schedule's previous run
    # releases it: not waiting, so no scheduler sees it until then.
    PENDING = "pending"


JOB_STATES = tuple(state.value for state in JobState)
WAITING_STATES = frozenset({JobState.SCHEDULED, JobState.AVAILABLE, JobState.RETRYABLE})
TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.DISCARDED, JobState.CANCELLED})
LATER_STATES = ("scheduled", "retryable")  # waiting, but not due yet


def waiting_and_later(counts: dict[str, int]) -> tuple[int, int]:
    """A queue's jobs by state as two counts: those that wait for a worker now (due:
    ``available``) and those not due yet (``scheduled``, or ``retryable`` until their
    backoff ends). One count of both called a job scheduled an hour out "waiting"."""
    return counts.get("available", 0), sum(counts.get(state, 0) for state in LATER_STATES)


S = JobState
# Every move a job may make. Staying put is always allowed (a job re-placed where it is).
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.AVAILABLE, S.SCHEDULED, S.DISCARDED, S.CANCELLED}),
    S.SCHEDULED: frozenset({S.AVAILABLE, S.DISCARDED, S.CANCELLED}),
    S.AVAILABLE: frozenset({S.ACTIVE, S.DISCARDED, S.CANCELLED}),
    S.RETRYABLE: frozenset({S.AVAILABLE, S.DISCARDED, S.CANCELLED}),
    S.ACTIVE: frozenset({S.COMPLETED, S.AVAILABLE, S.RETRYABLE, S.DISCARDED, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.DISCARDED: frozenset({S.AVAILABLE}),  # a manual retry
    S.CANCELLED: frozenset({S.AVAILABLE}),  # a manual retry
}


class InvalidTransition(RotaError):
    """A job was asked to make a move its lifecycle does not allow: a bug, never input."""

    def __init__(self, job_id: str, was: str, to: str) -> None:
        super().__init__("invalid_transition", f"job {job_id}: expected a state that may move"
                         f" to {to}, got {was}")


# How a backoff is spread: "rota" over [½, 1]× (never later than computed), "ojs" over
# [½, 1½]× (ojs-retry §5, capped again at backoff_max), "none" not at all.
Jitter = Literal["rota", "ojs", "none"]


@dataclass(frozen=True, slots=True)
class Limits:
    """A job's retry budget, from its spec with per-job overrides."""

    max_attempts: int
    max_fails: int | None
    backoff_base: float
    backoff_max: float
    max_worker_deaths: int = 3  # attempts in a row that kill their worker: then poison
    # The rest is Rota's own behaviour at its defaults; an OJS retry policy sets them
    # (docs/ojs.md). The n-th backoff is base × coefficient^(n−1), or base × n if linear.
    coefficient: float = 2.0
    linear: bool = False
    jitter: Jitter = "rota"
    non_retryable: tuple[str, ...] = ()  # patterns (re.fullmatch) on an error's type or code
    dead_letter: bool = False  # a job discarded by failure is marked for the dead letter


_LIMITS: dict[tuple[Any, ...], Limits] = {}


def shared_limits(max_attempts: int, max_fails: int | None, backoff_base: float,
                  backoff_max: float, max_worker_deaths: int, coefficient: float = 2.0,
                  linear: bool = False, jitter: Jitter = "rota",
                  non_retryable: tuple[str, ...] = (), dead_letter: bool = False) -> Limits:
    """One Limits object for every job with the same budget (frozen, so safe to share):
    a million waiting jobs of one spec hold one, not a million."""
    key = (max_attempts, max_fails, backoff_base, backoff_max, max_worker_deaths,
           coefficient, linear, jitter, non_retryable, dead_letter)
    limits = _LIMITS.get(key)
    if limits is None:
        if len(_LIMITS) >= 10_000:  # per-job overrides are rare; never let them pile up
            _LIMITS.clear()
        limits = _LIMITS[key] = Limits(*key)
    return limits


@dataclass(slots=True)
class JobRecord:
    """A live (not yet terminal) job as the server holds it in memory."""

    id: str
    spec: str
    queue: str
    args: msgspec.Raw
    priority: int
    enqueued_at: float
    seq: int
    limits: Limits
    visibility_timeout: float | None = None
    state: str = JobState.AVAILABLE
    attempt: int = 0
    worker_id: str | None = None
    worker_token: str | None = None  # the id of the token its worker connected with
    checksum: str | None = None
    run_at: float | None = None  # wall: scheduled or retryable until then
    expires_at: float | None = None  # wall: its time to live runs out
    lease_expires_at: float | None = None  # wall: when its reservation lapses (as shown)
    reserved_at: float | None = None  # wall: when it was last assigned (as its row says)
    due: float | None = None  # monotonic run_at
    expiry: float | None = None  # monotonic expires_at
    lease: float | None = None  # monotonic: when its reservation lapses
    fails: int = 0
    deaths: int = 0  # attempts in a row that ended in worker_death
    budget_start: int = 0  # attempts before a manual retry do not count against limits
    cancel_requested: bool = False
    orphaned: bool = False  # its worker is away (restart, lost connection): kept to reclaim
    started: bool = False  # its worker said this attempt started (memory: rota/core/lines.py)
    capture_logs: bool = False  # the producer asked for the job's log lines
    created_by: str | None = None  # the id of the token that enqueued it
    log_lines: int = 0  # captured lines taken (this server run)
    concurrency_key: str | None = None  # the key its spec's per-key limits count it under
    labels: tuple[str, ...] = ()  # worker labels it needs, all of them (sorted, deduplicated)
    unique: UniqueClaim | None = None  # the key its enqueue claims (until its row is in)
    workflow_id: str | None = None  # the workflow it is a step of (rota/core/workflows.py)
    workflow_node: int | None = None  # its node in that workflow
    parent_results: msgspec.Raw | None = None  # what its workflow passes it (JSON)
    schedule: str | None = None  # the cron schedule whose tick made it
    ojs: OjsExtras | None = None  # its OJS-only parts (rota/base/ojs.py); None: a Rota job

    def move(self, to: JobState) -> None:
        """Change state, refusing a move the lifecycle does not allow."""
        if to != self.state and to not in TRANSITIONS[JobState(self.state)]:
            raise InvalidTransition(self.id, self.state, to)
        self.state = to

    def budget(self) -> str:
        """For a log line after ``attempt=``: nothing while every attempt counts against
        max_attempts; else `` budget=3/3``, those that do (a manual retry starts afresh)."""
        if not self.budget_start:
            return ""
        return f" budget={self.attempt - self.budget_start}/{self.limits.max_attempts}"

    def took_ms(self, until: float) -> int | None:
        """Milliseconds from its attempt's assignment to ``until`` (wall), for the log;
        None if the assignment is not known."""
        if self.reserved_at is None:
            return None
        return max(0, round((until - self.reserved_at) * 1000))

    def clocks(self, now: Instant) -> None:
        """Derive the monotonic deadlines from the stored wall-clock moments."""
        self.due = None if self.run_at is None else now.deadline(self.run_at)
        self.expiry = None if self.expires_at is None else now.deadline(self.expires_at)
        self.lease = (None if self.lease_expires_at is None
                      else now.deadline(self.lease_expires_at))


@dataclass(slots=True)
class Change:
    """A job's new state (already set on ``job``), with what to append or store."""

    job: JobRecord
    error: bytes | None = None
    result: bytes | None = None
    finished_at: float | None = None
    undo: tuple[int, int, float | None, float | None] | None = None  # see Engine._undo
    ending: str | None = None  # why an attempt did not complete (rota/core/policy.py Ending)
    retry: bool = False  # an operator's retry of a finished job (any server may write it)
    dead_letter: bool = False  # discarded by failure under Limits.dead_letter (jobs.dead_letter)


@dataclass(slots=True)
class StatusNote:
    """What a heartbeat's status says about one job: its progress, or a line to keep."""

    job_id: str
    attempt: int
    at: float
    progress: tuple[float, str | None] | None = None  # (percent, message)
    line: tuple[str, str, str] | None = None  # (kind "log" | "alert", level, message)
