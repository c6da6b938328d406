"""The worker registry: who is connected, whether a registration is let in, directives.

Pure: no socket and no clock. A connection is known by the number the shell gave it
(``conn``), so that effects aimed at an old connection never reach the new one that
replaced it under the same worker id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rota.base import protocol as p
from rota.core.auth import OPEN, Principal
from rota.base.errors import FrameError
from rota.base.logs import printable
from rota.base.specs import UNVERSIONED
from rota.core.policy import TokenBucket
from rota.core.scheduler import WorkerSlot

log = logging.getLogger("rota.server")


def short(checksum_: str | None) -> str:
    return (checksum_ or "none")[:15]


MAX_ALERTS_KEPT = 20  # per connection, for GET /workers
ALERT_LINES = 5.0  # alerts logged a second per connection, on average
# A worker token could flood the log by registering again and again: at most
# REGISTER_LINES registrations logged a second per token (in bursts of REGISTER_BURST, so
# that a fleet restarting under one token is logged whole); the rest are counted.
REGISTER_LINES = 10.0
REGISTER_BURST = 100
MAX_LINE_BUDGETS = 10_000  # tokens whose registration lines are counted (the least recent go)
NAMED_REJECTIONS = 3  # rejected specs a registration line names; it counts the others


@dataclass(slots=True)
class ConnectedWorker:
    """A worker connected to this server: one /work socket and what it said about itself."""

    conn: int  # the shell's number for this socket
    worker: WorkerSlot
    registration: p.Registration
    connected_at: float  # wall
    last_seen: float  # monotonic: the last frame the server read from it
    principal: Principal = OPEN  # the token it connected with
    reported: list[str] = field(default_factory=list)  # last active and prefetched job ids
    cpu_percent: float | None = None  # the worker process's, as it last said
    memory_rss: int | None = None
    directive: str | None = None  # the state the server wants; None: whatever the worker says
    checked: bool = False  # its first status was checked for runs it no longer holds
    frames: int = 0  # heartbeats read from this connection
    plain: bool = False  # its last full heartbeat was plain (rota/core/heartbeats.py)
    beat_capacity: int | None = None  # the capacity its last full heartbeat gave
    last_ack: float = float("-inf")  # monotonic: when the last ack was made (lean acks)
    quiet_acks: int = 0  # idle heartbeats left unanswered (lean acks)
    # Lean acks: an idle beat within this many seconds of the last ack gets none (§4.2).
    ack_window: float = 0.0
    logged: bool = True  # its registration was logged (and so its disconnect will be)
    # Monotonic: since when its outbox is full (over the high-water mark, not drained
    # below a quarter of it), and whether it is over the limit too.
    full_since: float | None = None
    over: bool = False
    # Lists, not deques: an empty deque takes 760 bytes, and 10,000 idle connections
    # each held two (both stay short: 20 alerts at most, acks one or two).
    alerts: list[dict[str, Any]] = field(default_factory=list)  # the latest, for GET /workers
    # Acks in the order their heartbeats came: [ticket, frame]; a frame is None while the
    # results it answers are being committed, and acks behind it wait their turn.
    acks: list[list[Any]] = field(default_factory=list)
    # Alerts are logged, so a worker could flood the log with them: at most ALERT_LINES a
    # second (in bursts of MAX_ALERTS_KEPT) per connection; the rest are counted, and kept
    # for GET /workers as ever. Made on the first alert: most connections never send one.
    alert_lines: TokenBucket | None = None
    alerts_unlogged: int = 0
    # Kept jobs it named and may not reclaim (logged once). Made on the first: an empty
    # set takes 216 bytes, and almost no connection ever has one.
    refused: set[str] | None = None

    def alert(self, entry: dict[str, Any]) -> None:
        self.alerts.append(entry)
        if len(self.alerts) > MAX_ALERTS_KEPT:
            del self.alerts[0]

    def may_log_alert(self, now: float) -> bool:
        """Whether an alert may be logged now; if not, it is counted as unlogged."""
        if self.alert_lines is None:
            self.alert_lines = TokenBucket(ALERT_LINES, MAX_ALERTS_KEPT)
        if self.alert_lines.take(now):
            return True
        self.alerts_unlogged += 1
        return False


@dataclass(slots=True)
class LineBudget:
    """One token's registration lines: how fast they may come, and how many were not."""

    bucket: TokenBucket = field(default_factory=lambda: TokenBucket(REGISTER_LINES,
                                                                     REGISTER_BURST))
    unlogged: int = 0


class Registry:
    def __init__(self) -> None:
        self.connections: dict[str, ConnectedWorker] = {}
        self._lines: dict[str | None, LineBudget] = {}  # by token id; None: no tokens

    def log_registration(self, connection: ConnectedWorker, verdict: p.SpecVerdict,
                         now: float) -> None:
        """One line for a registration, with its rejected specs counted and the first few
        named; WARNING when any was rejected. Within the token's budget only (the rest
        are counted, and said at the next line logged)."""
        token = connection.principal.token_id
        budget = self._lines.pop(token, None) or LineBudget()
        self._lines[token] = budget  # the most recent last
        if len(self._lines) > MAX_LINE_BUDGETS:
            self._lines.pop(next(iter(self._lines)))
        if not budget.bucket.take(now):
            budget.unlogged += 1
            connection.logged = False
            return
        if budget.unlogged:
            log.warning("registrations token=%s: %d not logged, nor their disconnects (over %g"
                        " a second; GET /workers lists the connected)", token or "-",
                        budget.unlogged, REGISTER_LINES)
            budget.unlogged = 0
        reg, slot = connection.registration, connection.worker
        rejected = [f"{r.name}@{short(r.checksum)}(status_quo={short(r.expected)})"
                    for r in verdict.rejected[:NAMED_REJECTIONS]]
        if len(verdict.rejected) > NAMED_REJECTIONS:
            rejected.append(f"+{len(verdict.rejected) - NAMED_REJECTIONS} more")
        log.log(logging.WARNING if rejected else logging.INFO,
                "register worker=%s host=%s pid=%d queues=%s concurrency=%d prefetch=%d"
                " specs_ok=%d specs_rejected=%d%s", slot.id, printable(reg.hostname), reg.pid,
                ",".join(reg.queues), reg.concurrency, reg.prefetch, len(verdict.accepted),
                len(verdict.rejected), f" rejected={','.join(rejected)}" if rejected else "")

    def get(self, worker_id: str, conn: int | None = None) -> ConnectedWorker | None:
        """The worker's connection (only if it is ``conn``, when that is given)."""
        found = self.connections.get(worker_id)
        if found is None or (conn is not None and found.conn != conn):
            return None
        return found

    def admit(self, worker_id: str, reg: p.Registration, principal: Principal,
              kept: Iterable[str | None] = ()) -> ConnectedWorker | None:
        """Check a registration. Raise FrameError if it is refused; return the connection
        it replaces (a half-open one of the same process), if any. ``kept``: the token
        ids of the workers that held the jobs kept for this worker id while it is away.

        A worker id belongs to the token its worker connected with, while it is
        connected or jobs are kept for it: a worker of another token may neither
        replace it nor take its jobs (one token limited to some queues must not reach
        another token's jobs by naming its worker id)."""
        refused = [q for q in reg.queues if not principal.may_use_queue(q)]
        if refused:
            raise FrameError("queue_not_allowed", f"this token may not serve queue(s)"
                             f" {', '.join(refused)}", p.CLOSE_POLICY)
        names = [ref.name for ref in reg.specs]
        if len(set(names)) != len(names):
            raise FrameError("invalid_message", "a spec is declared twice in the registration",
                             p.CLOSE_INVALID_PAYLOAD)
        old = self.connections.get(worker_id)
        claim_worker_id(worker_id, [old.principal.token_id] if old is not None else kept,
                        principal)
        if old is None:
            return None
        # A second connection under a connected id is refused, unless it comes from the
        # same process (hostname, pid and started_at): then the old connection is dead
        # but not yet noticed (half-open), and the new one replaces it at once.
        was = old.registration
        if reg.started_at is None or (was.hostname, was.pid, was.started_at) != (
                reg.hostname, reg.pid, reg.started_at):
            raise FrameError("worker_id_in_use", f"worker {worker_id} is already connected",
                             p.CLOSE_POLICY)
        return old

    def add(self, connection: ConnectedWorker) -> None:
        self.connections[connection.worker.id] = connection

    def remove(self, worker_id: str, conn: int | None = None) -> ConnectedWorker | None:
        found = self.get(worker_id, conn)
        if found is not None:
            del self.connections[worker_id]
        return found

    def silent(self, now: float, timeout: float) -> list[ConnectedWorker]:
        """Connections the server has heard nothing from for longer than ``timeout``. Not a
        pull worker's (a negative conn): its jobs' leases tell when it is gone."""
        return [c for c in self.connections.values() if c.conn > 0 and now - c.last_seen > timeout]

    def backed_up(self, now: float, limit: float) -> list[ConnectedWorker]:
        """Connections whose outbox has been full for longer than ``limit``."""
        return [c for c in self.connections.values()
                if c.full_since is not None and now - c.full_since > limit]

    def shift(self, delta: float, now: float) -> None:
        """The server was not listening for ``delta`` seconds: that silence is its own,
        not the workers'. (Never past ``now``: a frame read since is not moved later.) Nor
        could it see an outbox drain meanwhile: that time is not held against it either."""
        for connection in self.connections.values():
            connection.last_seen = min(now, connection.last_seen + delta)
            if connection.full_since is not None:
                connection.full_since = min(now, connection.full_since + delta)

    def direct(self, worker_ids: Iterable[str], state: str) -> list[str]:
        """Ask workers to go quiet or terminate, or quiet ones to run again (``resume``);
        returns those that were asked. A worker never goes back from terminate."""
        directed = []
        if state == "running":
            return self.resume(worker_ids)
        for worker_id in worker_ids:
            connection = self.connections.get(worker_id)
            if connection is None or p.STATE_RANK[connection.worker.state] >= p.STATE_RANK[state]:
                continue
            connection.directive = state
            connection.worker.state = state  # no new jobs from this moment
            directed.append(worker_id)
            log.info("state change worker=%s state=%s by=server", worker_id, state)
        return directed

    def resume(self, worker_ids: Iterable[str]) -> list[str]:
        """Ask quiet workers to run again (as SIGCONT would); returns those asked. The
        server keeps scheduling by the state the worker reports: it takes jobs again once
        a heartbeat says running, so a worker that never heard the ask gets nothing."""
        resumed = []
        for worker_id in worker_ids:
            connection = self.connections.get(worker_id)
            if connection is None or connection.worker.state != "quiet":
                continue
            connection.directive = "running"
            resumed.append(worker_id)
            log.info("state change worker=%s state=running by=server", worker_id)
        return resumed

    def select(self, *, label: str | None = None, every: bool = False) -> list[str]:
        """Connected workers with ``label``, or all of them."""
        if every:
            return sorted(self.connections)
        return sorted(w for w, c in self.connections.items() if label in c.worker.labels)

    def report(self, connection: ConnectedWorker, status: p.Status) -> None:
        """Take in what a status says of the worker itself."""
        if connection.directive == "running":  # a resume: done when it runs (or ends)
            if status.state != "quiet":
                connection.directive = None
            connection.worker.state = status.state  # no jobs before it says it runs
        else:
            if connection.directive and (p.STATE_RANK[status.state]
                                         >= p.STATE_RANK[connection.directive]):
                connection.directive = None  # the worker got there: the directive is done
            # Until it does, schedule by the stricter of what it says and what we asked.
            connection.worker.state = connection.directive or status.state
        connection.reported = held_ids(status)
        if status.cpu_percent is not None:
            connection.cpu_percent = status.cpu_percent
        if status.memory_rss is not None:
            connection.memory_rss = status.memory_rss


def claim_worker_id(worker_id: str, holders: Iterable[str | None], principal: Principal
                    ) -> None:
    """Refuse (FrameError) a registration under ``worker_id`` whose worker is held by
    another token: ``holders`` are the token ids of the workers using it (connected, or
    holding jobs kept for it)."""
    if not all(same_token(holder, principal) for holder in holders):
        raise FrameError("worker_id_taken", f"worker {worker_id} belongs to another token;"
                         " register under a worker_id of your own", p.CLOSE_POLICY)


def same_token(holder: str | None, principal: Principal) -> bool:
    """Whether a worker of ``principal`` may stand in for one that connected with token
    ``holder`` (an id; None: none). By id, not by object: a token read again from the
    store (a reload, a restart) is the same token. A server without tokens has no
    owners to tell apart, nor has a job reserved by a worker without a token (reserved
    before auth was turned on): as before tokens, anyone under that worker id."""
    return principal.token_id is None or holder is None or holder == principal.token_id


def may_reclaim(holder: str | None, queue: str, principal: Principal) -> bool:
    """Whether a worker of ``principal`` may reclaim a job of ``queue`` kept for its worker
    id, which a worker of token ``holder`` held: the same token, and a queue it may serve."""
    return same_token(holder, principal) and principal.may_use_queue(queue)


def held_ids(status: p.Status) -> list[str]:
    """The jobs a status says the worker holds: running, then waiting to start."""
    if not status.prefetched_job_ids:
        return status.active_job_ids
    return [*status.active_job_ids, *status.prefetched_job_ids]


def judge_specs(status_quo: dict[str, str], declared: list[p.SpecRef]) -> p.SpecVerdict:
    """Which declared specs match the status quo, and why the others do not (the
    registration's one line counts them: ``Registry.log_registration``)."""
    accepted: list[str] = []
    rejected: list[p.SpecRejection] = []
    for ref in declared:
        expected = status_quo.get(ref.name)
        if expected == ref.checksum or (expected is None and ref.checksum == UNVERSIONED):
            accepted.append(ref.name)
            continue
        reason = "spec has no status quo" if expected is None else "checksum differs from the status quo"
        rejected.append(p.SpecRejection(name=ref.name, checksum=ref.checksum,
                                        expected=expected, reason=reason))
    return p.SpecVerdict(accepted=accepted, rejected=rejected)
