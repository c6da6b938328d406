"""What the engine decides, for the shell to carry out, in order.

The engine returns a list of these from every event. The shell applies them in the
order given: a ``Save`` or ``Reserve`` is handed to the single writer at once (so
commits happen in decision order), and when it carries a ticket the shell reports its
outcome back with ``Engine.committed``. The engine never returns a ``Send`` that
depends on a commit that has not happened: such a frame comes out of ``committed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from rota.core.limits import Rate
from rota.core.model import Change, JobRecord, StatusNote
from rota.base.protocol import Registration
from rota.base.push import Delivery
from rota.core.ready import Claim


@dataclass(slots=True)
class Save:
    """Commit these job transitions (one transaction with whatever else is queued)."""

    changes: list[Change]
    ticket: int | None = None  # report the outcome back to the engine
    crash_point: str | None = None  # test switch: the --crash-at name after this commit


class Guard(NamedTuple):
    """A limit a reserved job counts against, for the store to check in the reservation's
    transaction (PostgreSQL: under an advisory lock per name and key, so that several
    servers stay within it): ``name`` is ``queue:emails`` or ``spec:send_email``, ``key``
    the job's concurrency key for a per-key limit (None: the scope's own), then the
    running jobs allowed and the rate of starts allowed (None: not limited that way)."""

    name: str
    key: str | None
    concurrency: int | None
    rate: Rate | None


@dataclass(slots=True)
class Reserve:
    """Commit these reservations; the assigns that depend on them follow the ticket. A
    claim reserves its row only if it is still available, and reads it back: the
    outcome carries the jobs read (``Engine.committed``)."""

    jobs: list[JobRecord]
    wall: float
    ticket: int
    claims: list[Claim] = field(default_factory=list)
    lease: float = 1800.0  # seconds, for a claimed job whose row sets no visibility_timeout
    min_lease: float = 0.0  # and the shortest, whatever the row sets (Scheduler.lease_for)
    # The limits each job or claim counts against: job id (whole jobs) or claim seq
    # (claims) -> its guards; absent: none. The store refuses those that would exceed one
    # (``Reserved.refused``) and records a start for each guard with a rate.
    guards: dict[str | int, tuple[Guard, ...]] = field(default_factory=dict)

    def starts(self, refused: frozenset[str | int] = frozenset()) -> list[tuple[str, str | None]]:
        """The rate starts this reservation makes, at ``wall``, one per guard with a rate
        of each job not refused: (limit name, key), for the store to record."""
        return [(guard.name, guard.key) for ident, guards in self.guards.items()
                if ident not in refused for guard in guards if guard.rate is not None]


@dataclass(slots=True)
class Reserved:
    """A ``Reserve``'s outcome: each claim's job as its row read after the claim (None:
    no longer available, or refused), one per claim in order; the whole jobs whose rows
    had moved on meanwhile (another server reserved, cancelled or finished them first),
    which this server must let go; and the jobs a guard refused (``refused``)."""

    read: list[JobRecord | None] = field(default_factory=list)
    lost: frozenset[str] = frozenset()
    # Jobs the store's guard turned away (a limit held by another server's reservations):
    # their rows stay available; job ids (whole jobs) and claim seqs (claims).
    refused: frozenset[str | int] = frozenset()
    # The limits (limit name, concurrency key or None) found full when it refused them:
    # only those are held off (empty: every limit the refused jobs count against).
    full: frozenset[tuple[str, str | None]] = frozenset()


@dataclass(slots=True)
class Withdraw:
    """Cancel a job kept only as a key, if its row is still available (the row decides:
    the job may be being reserved). The shell awaits it and reports to ``withdrawn``."""

    job_id: str
    seq: int
    queue: str
    spec: str
    priority: int
    wall: float
    concurrency_key: str | None = None  # which bucket its key waits in (rota/core/ready.py)
    labels: tuple[str, ...] = ()


@dataclass(slots=True)
class Note:
    """Store progress and captured lines: in the background, nothing waits on it."""

    notes: list[StatusNote]


@dataclass(slots=True)
class WorkerSeen:
    """Record a worker's registration (for operators; no job depends on it). The store
    makes its row (rota/store/rows.py ``worker_row``): the engine knows no table."""

    worker_id: str
    registration: Registration
    connected_at: float  # wall


@dataclass(slots=True)
class WorkerGone:
    worker_id: str
    connected_at: float
    wall: float


@dataclass(slots=True)
class Send:
    """Send a frame on connection ``conn`` (nothing, if that connection is gone)."""

    conn: int
    frame: str


@dataclass(slots=True)
class Abort:
    """Close connection ``conn`` with an ``error`` frame and a close code."""

    conn: int
    code: str
    message: str
    close_code: int


@dataclass(slots=True)
class Wake:
    """Run a scheduling round soon: jobs or free slots appeared."""


@dataclass(slots=True)
class Arm:
    """Call ``Engine.tick`` no later than this monotonic deadline."""

    deadline: float


@dataclass(slots=True)
class Finished:
    """These jobs reached a terminal state, committed: wake whoever waits on them."""

    job_ids: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Deliver:
    """POST one job to its endpoint (rota/core/endpoints.py); the shell hands the answer
    back to ``Engine.endpoint_result``."""

    delivery: Delivery


Effect = (Save | Reserve | Withdraw | Note | WorkerSeen | WorkerGone | Send | Abort | Wake | Arm
          | Finished | Deliver)
