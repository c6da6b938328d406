"""Pull workers (OJS FETCH, ACK, NACK and heartbeat over HTTP) as virtual connected
workers on the one scheduler. Pure.

A part of the engine (``Engine`` inherits it). Each OJS ``worker_id`` is a
``ConnectedWorker`` named ``ojs:<worker_id>`` with a negative ``conn``: the shell
(rota/server/pulling.py) delivers a ``Send`` to it into the HTTP request that waits,
not to a socket. Its slot is closed (``blocked``) except during the one scheduling round
a FETCH runs with ``count`` open slots; the round reserves, commits and sends an
``assign`` as for any worker. ACK and NACK are a one-result heartbeat on that
connection, answered by its ``ack``. There is no second scheduler and no second lease
table: a pull worker that dies is found by its jobs' leases lapsing (never by silence),
and one that holds nothing and asks nothing for ``PULL_IDLE`` seconds is forgotten.

A job's ``timeout_ms`` (OJS) is an execution deadline beside the lease: when it passes,
the attempt ends as ``"timeout"``, whatever heartbeats said.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rota.base import protocol as p
from rota.base.errors import Conflict, Forbidden
from rota.core.auth import OPEN, Principal
from rota.core.effects import Arm, Effect, Reserve, Send
from rota.core.model import Instant, JobRecord, JobState
from rota.core.ready import Claim
from rota.core.registry import (ConnectedWorker, Registry, judge_specs, may_reclaim, same_token,
                                short)
from rota.core.scheduler import Scheduler, WorkerSlot
from rota.core.settings import ServerSettings

log = logging.getLogger("rota.server")
PREFIX = "ojs:"  # a pull worker's id in the registry: "ojs:" + its OJS worker_id
ANONYMOUS = "anonymous"  # the worker_id of a FETCH that names none
PULL_IDLE = 60.0  # seconds a pull worker holding no job may ask nothing before it is forgotten
MAX_FETCH = 100  # jobs one FETCH may ask for
TEST_DIRECTIVES = ("quiet", "terminate")  # options.metadata.test_directive (test hook)
EMPTY_ASSIGN = p.encode(p.Assign(jobs=[]))


@dataclass(slots=True)
class PullState:
    """What the engine keeps of one pull worker beside its connection."""

    conn: int
    last: float  # monotonic: its last request
    visibility: float | None = None  # seconds: its last FETCH's visibility_timeout
    leases: dict[str, float] = field(default_factory=dict)  # job id -> lease seconds
    seq: int = 0  # the last synthetic heartbeat seq (an ACK or NACK)


class Fetched(NamedTuple):
    """A FETCH's round: the connection whose ``assign`` answers it, the effects to
    apply, the verdict on the checksums it declared (None: it declared none), and
    whether the round reserved anything for it (an empty assign then means it lost the
    race for its rows: another server took them, and the next round looks further)."""

    conn: int
    effects: list[Effect]
    verdict: p.SpecVerdict | None
    planned: bool = False
    # Versioned types with jobs waiting in its queues that it did not declare at their
    # status quo's checksum: why it got nothing (X-Rota-Waiting-Specs).
    undeclared: tuple[p.SpecRejection, ...] = ()


class Settled(NamedTuple):
    """An ACK or NACK: taken (``conn`` and ``seq`` of the ``ack`` that answers it; seq
    None for a requeue, answered once its write commits), or refused (``refusal``: why;
    ``state``: the job's state in memory, None if it is not held here)."""

    conn: int | None
    seq: int | None
    effects: list[Effect]
    refusal: str | None = None
    state: str | None = None


class Beat(NamedTuple):
    state: str  # the directive or "running"
    extended: list[str]  # the jobs whose leases were renewed
    verdict: p.SpecVerdict | None


def pull_id(worker_id: str | None) -> str:
    """The registry id of an OJS worker_id."""
    return PREFIX + (worker_id or ANONYMOUS)


def is_pull(worker_id: str | None) -> bool:
    return worker_id is not None and worker_id.startswith(PREFIX)


def nack_error(error: dict[str, Any] | None) -> p.ErrorInfo:
    """An OJS NACK's ``error`` as Rota's ErrorInfo: its type is ``details.error_class``
    when given, else ``code``; its ``code`` as given."""
    error = error or {}
    details = error.get("details")
    kind = details.get("error_class") if isinstance(details, dict) else None
    kind = kind or error.get("code") or error.get("type") or "error"
    retryable = error.get("retryable", True)
    code = error.get("code")  # kept in the record beside the type (non_retryable_errors)
    return p.ErrorInfo(type=str(kind), message=str(error.get("message") or "no message"),
                       retryable=retryable if isinstance(retryable, bool) else True,
                       details=details, code=None if code is None else str(code))


def ojs_timeout(job: JobRecord) -> float | None:
    """A job's OJS ``timeout_ms``, in seconds (None: none)."""
    extras = getattr(job, "ojs", None)
    timeout = getattr(extras, "timeout_ms", None)
    return timeout / 1000.0 if isinstance(timeout, (int, float)) and timeout > 0 else None


def test_directive(job: JobRecord) -> str | None:
    """``options.metadata.test_directive`` of a job (the conformance suites' hook)."""
    extras = getattr(job, "ojs", None)
    metadata = getattr(extras, "metadata", None)
    found = metadata.get("test_directive") if isinstance(metadata, dict) else None
    return found if found in TEST_DIRECTIVES else None


class Pulls:
    settings: ServerSettings
    scheduler: Scheduler
    registry: Registry
    pulls: dict[str, PullState]
    _pull_conns: int
    _timeouts: list[tuple[float, str, int]]  # (monotonic deadline, job id, attempt)
    dispatch: Callable[[Instant], list[Effect]]  # (Reservations)
    heartbeat: Callable[[int, str, p.Heartbeat, Instant], list[Effect]]  # (Heartbeats)
    _recover: Callable[..., list[Effect]]  # (jobs, ending, message, now, *, death)

    def _init_pulls(self) -> None:
        self.pulls = {}
        self._pull_conns = 0
        self._timeouts = []

    # -- the virtual worker ----------------------------------------------------------
    def _pull_worker(self, worker_id: str | None, principal: Principal, now: Instant
                     ) -> tuple[ConnectedWorker, PullState]:
        """The pull worker's connection and state, made on its first request."""
        rid = pull_id(worker_id)
        connection = self.registry.get(rid)
        state = self.pulls.get(rid)
        if connection is not None and state is None:  # a /work worker named "ojs:..."
            raise Conflict("worker_id_in_use", f"worker {rid} is connected on /work")
        if connection is not None and state is not None:
            if not same_token(connection.principal.token_id, principal):
                raise Forbidden("worker_id_taken", f"worker {rid} belongs to another token"
                                " until it has been idle 60 s; send a worker_id of your own")
            state.last = now.mono
            return connection, state
        self._pull_conns += 1
        conn = -self._pull_conns
        reg = p.Registration(hostname="-", os="-", pid=0, sdk="ojs-http", queues=[],
                             concurrency=0, specs=[])
        # Its slots are closed outside its own FETCH's round (``blocked``): a slot given
        # back by a failed claim must not take a job nobody waits for.
        slot = WorkerSlot(id=rid, queues=[], concurrency=p.MAX_COUNT, specs={},
                          token=principal.token_id, any_type=True, blocked=True)
        self.scheduler.add_worker(slot)
        connection = ConnectedWorker(conn, slot, reg, now.wall, now.mono, principal)
        self.registry.add(connection)
        state = self.pulls[rid] = PullState(conn, now.mono)
        log.info("pull worker seen worker=%s", rid)
        return connection, state

    def _declare(self, connection: ConnectedWorker, declared: dict[str, str] | None
                 ) -> p.SpecVerdict | None:
        """Take in the checksums a pull worker declared (``x_rota_specs``): they replace
        the last set; None leaves it."""
        if declared is None:
            return None
        slot = connection.worker
        refs = [p.SpecRef(name=name, checksum=checksum) for name, checksum in declared.items()]
        verdict = judge_specs(self.scheduler.status_quo, refs)
        if slot.specs != declared:
            for rejection in verdict.rejected:
                log.warning("spec mismatch worker=%s spec=%s checksum=%s status_quo=%s",
                            slot.id, rejection.name, short(rejection.checksum),
                            short(rejection.expected))
        slot.specs = dict(declared)
        connection.registration.specs = refs
        return verdict

    @staticmethod
    def _directed(connection: ConnectedWorker) -> str:
        """The state a pull worker is asked to be in (a resume takes effect at once: no
        status of its own follows)."""
        slot = connection.worker
        if connection.directive == "running":
            connection.directive = None
            slot.state = "running"
        return slot.state

    # -- FETCH ---------------------------------------------------------------------
    def pull_fetch(self, worker_id: str | None, principal: Principal, queues: list[str],
                   count: int, visibility: float | None, declared: dict[str, str] | None,
                   now: Instant) -> Fetched:
        """One scheduling round with ``count`` slots open for this worker, then closed.
        Its answer is an ``assign`` sent to the returned conn: after the reservation's
        commit, or at once (empty) when the round gave it nothing."""
        refused = [q for q in queues if not principal.may_use_queue(q)]
        if refused:
            raise Forbidden("queue_not_allowed", f"this token may not serve queue(s)"
                            f" {', '.join(refused)}")
        connection, state = self._pull_worker(worker_id, principal, now)
        slot = connection.worker
        slot.queues = list(dict.fromkeys(queues))  # in order: the first is served first
        connection.registration.queues = slot.queues
        verdict = self._declare(connection, declared)
        state.visibility = visibility
        connection.last_seen = now.mono
        connection.frames += 1
        if self._directed(connection) != "running":
            return Fetched(state.conn, [Send(state.conn, EMPTY_ASSIGN)], verdict)
        slot.capacity, slot.blocked = max(1, min(count, MAX_FETCH)), False
        try:
            effects = self.dispatch(now)
        finally:
            slot.capacity, slot.blocked = 0, True
        planned = any(_planned_for(e, slot) for e in effects)
        if not planned:
            effects.append(Send(state.conn, EMPTY_ASSIGN))
            return Fetched(state.conn, effects, verdict, planned, self._undeclared(slot))
        return Fetched(state.conn, effects, verdict, planned)

    def _undeclared(self, slot: WorkerSlot) -> tuple[p.SpecRejection, ...]:
        """Versioned types whose jobs wait in the worker's queues while it does not
        declare their status quo's checksum: a new worker author's silent trap."""
        status_quo = self.scheduler.status_quo
        waiting = {(queue, spec) for queue, spec in self.scheduler.ready.counts()
                   if queue in slot.queues and spec in status_quo
                   and slot.specs.get(spec) != status_quo[spec]}
        return tuple(p.SpecRejection(
            name=spec, checksum=slot.specs.get(spec, ""), expected=status_quo[spec],
            reason=f"its jobs wait in queue {queue}: declare its checksum in x_rota_specs")
            for queue, spec in sorted(waiting))

    def _unanswered(self, plan: dict[str, list[Any]]) -> list[Effect]:
        """A round whose commit failed: its pull workers hear an empty assign (their
        requests wait for one)."""
        return [Send(c.conn, EMPTY_ASSIGN) for worker_id in plan
                if (c := self.registry.get(worker_id)) is not None and c.conn < 0]

    def _leased(self, connection: ConnectedWorker, jobs: list[JobRecord], now: Instant
                ) -> list[Effect]:
        """Jobs just assigned: a pull worker's lease is its FETCH's visibility (when it
        set one); a job with an OJS ``timeout_ms`` gets its execution deadline."""
        effects: list[Effect] = []
        state = self.pulls.get(connection.worker.id) if connection.conn < 0 else None
        for job in jobs:
            if state is not None:
                seconds = self._lease_of(state, job, state.visibility)
                state.leases[job.id] = seconds
                job.lease_expires_at = now.wall + seconds
                self.scheduler.hold(job, now.mono + seconds)
                effects.append(Arm(now.mono + seconds))
            timeout = ojs_timeout(job)
            if timeout is not None:
                heapq.heappush(self._timeouts, (now.mono + timeout, job.id, job.attempt))
                effects.append(Arm(now.mono + timeout))
        return effects

    def _lease_of(self, state: PullState, job: JobRecord, asked: float | None) -> float:
        """Seconds of lease: what the request asks, else what its FETCH asked, else the
        job's (or its spec's, or the server's); never under ``min_lease``."""
        seconds = asked or state.leases.get(job.id)
        if seconds is None:
            return self.scheduler.lease_for(job)
        return max(seconds, self.scheduler.min_lease)

    # -- ACK and NACK ----------------------------------------------------------------
    def pull_result(self, worker_id: str | None, job_id: str, outcome: p.Outcome, *,
                    result: Any = None, error: p.ErrorInfo | None = None,
                    attempt: int | None = None, requeue: bool = False,
                    principal: Principal = OPEN, now: Instant) -> Settled:
        """An ACK (``completed``) or NACK (``failed``) of a job a pull worker holds: its
        holder (``worker_id``, when given), its token, and its attempt (``attempt``, as
        OJS counts it: Rota's less ``budget_start``; when given) must match. A requeue
        gives it back, its attempt not counted."""
        job = self.scheduler.jobs.get(job_id)
        if job is not None and job.orphaned and is_pull(job.worker_id):
            self._reclaim_pulled(job, worker_id, principal, now)
        state = None if job is None else str(job.state)
        if job is None or job.state != JobState.ACTIVE:
            return Settled(None, None, [], f"the job is not active (it is {state or 'not held'})",
                           state)
        holder = job.worker_id or ""
        if not is_pull(holder):
            return Settled(None, None, [], "the job is held by a /work worker", state)
        if worker_id is not None and holder != pull_id(worker_id):
            return Settled(None, None, [], f"the job is held by another worker"
                           f" ({holder[len(PREFIX):]})", state)
        shown = job.attempt - job.budget_start  # the attempt as OJS counts it
        if attempt is not None and attempt != shown:
            return Settled(None, None, [], f"attempt {attempt} is not the job's current"
                           f" attempt {shown}", state)
        connection = self.registry.get(holder)
        pulled = self.pulls.get(holder)
        if connection is None or pulled is None or job.orphaned:
            return Settled(None, None, [], "the job's worker is gone", state)
        if not may_reclaim(job.worker_token, job.queue, principal):
            return Settled(None, None, [], "the job is held by another token's worker", state)
        pulled.last = connection.last_seen = now.mono
        pulled.leases.pop(job.id, None)
        if requeue:
            connection.worker.active.discard(job.id)
            log.info("requeue job=%s worker=%s attempt=%d", job.id, holder, job.attempt)
            effects = self._recover([job], "released", f"worker {holder} gave it back"
                                    " (NACK with requeue): not counted against max_attempts",
                                    now, death=False)
            return Settled(pulled.conn, None, effects)
        pulled.seq += 1
        report = p.Result(job_id=job.id, attempt=job.attempt, outcome=outcome,
                          result=result, error=error)
        beat = p.Heartbeat(seq=pulled.seq, worker_id=holder, results=[report])
        return Settled(pulled.conn, pulled.seq, self.heartbeat(pulled.conn, holder, beat, now))

    def pull_unheard(self, conn: int, job_ids: list[str], now: Instant) -> list[Effect]:
        """A FETCH's assign that found nobody waiting (the request timed out or went away
        before its round's commit): its jobs go back at once, the attempt not counted, as
        a requeue does; else they would sit reserved to nobody until their leases lapse."""
        rid = next((rid for rid, state in self.pulls.items() if state.conn == conn), None)
        connection = self.registry.get(rid) if rid is not None else None
        if rid is None or connection is None:
            return []
        jobs = [job for job_id in job_ids if (job := self.scheduler.jobs.get(job_id)) is not None
                and job.state == JobState.ACTIVE and job.worker_id == rid and not job.orphaned]
        for job in jobs:
            connection.worker.active.discard(job.id)
            self.pulls[rid].leases.pop(job.id, None)
            log.info("unheard job=%s worker=%s attempt=%d: given back", job.id, rid,
                     job.attempt)
        if not jobs:
            return []
        return self._recover(jobs, "released", f"worker {rid} did not hear its FETCH's"
                             " answer (the request ended first): not counted against"
                             " max_attempts", now, death=False)

    def _reclaim_pulled(self, job: JobRecord, worker_id: str | None, principal: Principal,
                        now: Instant) -> None:
        """A job a pull worker held before this server restarted (kept for it, as for
        any worker, until the reclaim grace): its ACK, NACK or heartbeat takes it back."""
        holder = job.worker_id or ""
        if worker_id is not None and holder != pull_id(worker_id):
            return
        if not may_reclaim(job.worker_token, job.queue, principal):
            return
        connection, _ = self._pull_worker(holder[len(PREFIX):], principal, now)
        for taken in self.scheduler.adopt(connection.worker, [job.id], now.mono):
            log.info("reclaim job=%s queue=%s worker=%s attempt=%d", taken.id, taken.queue,
                     holder, taken.attempt)

    # -- heartbeat -------------------------------------------------------------------
    def pull_beat(self, worker_id: str | None, principal: Principal, active_jobs: list[str],
                  visibility: float | None, declared: dict[str, str] | None, now: Instant
                  ) -> Beat:
        """A pull worker vouches for the jobs it holds: their leases start again (for
        ``visibility`` seconds, or what their FETCH asked); it hears its directive."""
        connection, state = self._pull_worker(worker_id, principal, now)
        verdict = self._declare(connection, declared)
        connection.last_seen = now.mono
        connection.frames += 1
        extended: list[str] = []
        hook = getattr(self.settings, "unsafe_test_endpoints", False)
        for job_id in dict.fromkeys(active_jobs):
            job = self.scheduler.jobs.get(job_id)
            if job is not None and job.orphaned and job.worker_id == connection.worker.id:
                self._reclaim_pulled(job, worker_id, principal, now)
            if (job is None or job.state != JobState.ACTIVE or job.orphaned
                    or job.worker_id != connection.worker.id):
                continue
            seconds = self._lease_of(state, job, visibility)
            state.leases[job.id] = seconds
            self.scheduler.hold(job, now.mono + seconds)
            job.lease_expires_at = now.wall + seconds
            extended.append(job.id)
            if hook and (directive := test_directive(job)) is not None:
                self.registry.direct([connection.worker.id], directive)
        return Beat(self._directed(connection), extended, verdict)

    # -- clock -----------------------------------------------------------------------
    def _pulls_tick(self, now: Instant) -> list[Effect]:
        """From ``tick``: attempts past their ``timeout_ms`` end as "timeout"; idle pull
        workers are forgotten."""
        effects: list[Effect] = []
        while self._timeouts and self._timeouts[0][0] <= now.mono:
            _, job_id, attempt = heapq.heappop(self._timeouts)
            job = self.scheduler.jobs.get(job_id)
            if (job is None or job.state != JobState.ACTIVE or job.attempt != attempt
                    or job.orphaned):
                continue
            effects += self._timed_out(job, now)
        for rid, state in list(self.pulls.items()):
            connection = self.registry.get(rid, state.conn)
            if connection is None:
                del self.pulls[rid]
            elif now.mono - state.last > PULL_IDLE and not connection.worker.active:
                self._forget(rid)
        return effects

    def _timed_out(self, job: JobRecord, now: Instant) -> list[Effect]:
        timeout = ojs_timeout(job) or 0.0
        holder = job.worker_id or ""
        connection = self.registry.get(holder)
        effects: list[Effect] = []
        if connection is not None:
            connection.worker.active.discard(job.id)
            if connection.conn > 0:  # a /work worker stops the run
                effects.append(Send(connection.conn, p.encode(
                    p.Cancel(job_ids=[job.id], reason="timeout"))))
        log.warning("timeout job=%s spec=%s queue=%s worker=%s attempt=%d timeout=%gs",
                    job.id, job.spec, job.queue, holder, job.attempt, timeout)
        return effects + self._recover([job], "timeout", f"the attempt ran past its"
                                       f" timeout of {timeout:g}s", now)

    def _forget(self, rid: str) -> None:
        state = self.pulls.pop(rid, None)
        if state is None:
            return
        self.registry.remove(rid, state.conn)
        self.scheduler.remove_worker(rid)
        log.info("pull worker forgotten worker=%s: no job and no request for %gs", rid,
                 PULL_IDLE)

    def forget_pulls(self) -> None:
        """A reset (POST /ojs/v1/admin/reset, a test switch): every pull worker forgotten."""
        for rid, state in list(self.pulls.items()):
            del self.pulls[rid]
            self.registry.remove(rid, state.conn)
            self.scheduler.remove_worker(rid)
        self._timeouts.clear()

    def pull_deadline(self) -> float | None:
        """The next ``timeout_ms`` deadline (monotonic), for the timer loop."""
        return self._timeouts[0][0] if self._timeouts else None

    def pull_workers(self) -> Iterable[str]:
        return self.pulls.keys()

    def pull_lease(self, job: JobRecord) -> float | None:
        """The lease (seconds) a pull worker holds ``job`` on, as its FETCH or heartbeat
        asked; None for a job no pull worker holds."""
        state = self.pulls.get(job.worker_id or "")
        return state.leases.get(job.id) if state is not None else None

    def kept_ids(self, worker_id: str | None, given: Iterable[str]) -> dict[str, str]:
        """The id each job this pull worker names (``given``, as FETCH showed it) is kept
        under: a producer token's job is kept as ``<token id>:<id>`` and shown without the
        prefix (rota/core/ojs_map.py). An id it holds no job by, or holds two by (two
        producers gave the same id), maps to itself: found under no id, refused, never
        mistaken for the other one."""
        connection = self.registry.get(pull_id(worker_id))
        shown: dict[str, list[str]] = {}
        for job_id in connection.worker.active if connection is not None else ():
            shown.setdefault(job_id.partition(":")[2] or job_id, []).append(job_id)
        found: dict[str, str] = {}
        for job_id in given:
            held = shown.get(job_id, [])
            found[job_id] = held[0] if len(held) == 1 and job_id not in self.scheduler.jobs \
                else job_id
        return found


def _planned_for(effect: Effect, slot: WorkerSlot) -> bool:
    """Whether a round's ``Reserve`` holds a job or a claim for this worker."""
    if not isinstance(effect, Reserve):
        return False
    return (any(job.worker_id == slot.id for job in effect.jobs)
            or any(isinstance(c, Claim) and c.worker is slot for c in effect.claims))
