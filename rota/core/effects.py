"""What the engine decides, for the shell to carry out, in order.

The engine returns a list of these from every event. The shell applies them in the
order given: a ``Save`` or ``Reserve`` is handed to the single writer at once (so
commits happen in decision order), and when it carries a ticket the shell reports its
outcome back with ``Engine.committed``. The engine never returns a ``Send`` that
depends on a commit that has not happened: such a frame comes out of ``committed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rota.core.limits import Rate
from rota.core.model import Change, JobRecord, StatusNote
from rota.base.protocol import Registration
from rota.core.ready import Claim


@dataclass(slots=True)
class Save:
    """Commit these job transitions (one transaction with whatever else is queued)."""

    changes: list[Change]
    ticket: int | None = None  # report the outcome back to the engine
    crash_point: str | None = None  # test switch: the --crash-at name after this commit


@dataclass(frozen=True, slots=True)
class Guard:
    """A limit one reservation counts against, for the store to hold exactly across
    servers (rota/store/limits.py): ``name`` "spec:send_email" or "queue:emails", ``key``
    a concurrency key (None: the scope's own count), and what it may not exceed."""

    name: str
    key: str | None
    concurrency: int | None = None
    rate: Rate | None = None


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
    # The limits each whole job (by id) or claim (by seq) counts against: the store
    # refuses those that would pass one (``Reserved.refused``), and records rate starts.
    guards: dict[str | int, tuple[Guard, ...]] = field(default_factory=dict)


@dataclass(slots=True)
class Reserved:
    """A ``Reserve``'s outcome: each claim's job as its row read after the claim (None:
    no longer available), and the whole jobs whose rows had moved on meanwhile (another
    server reserved, cancelled or finished them first), which this server must let go."""

    read: list[JobRecord | None] = field(default_factory=list)
    lost: frozenset[str] = frozenset()
    # Whole jobs (ids) and claims (seqs) the database guard refused: not reserved, still
    # available (a limit was reached through another server).
    refused: frozenset[str | int] = frozenset()


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


Effect = Save | Reserve | Withdraw | Note | WorkerSeen | WorkerGone | Send | Abort | Wake | Arm | Finished
