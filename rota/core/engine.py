"""The server's state machine, with no I/O: events in, effects out.

Each method takes an event (a registration, a heartbeat, a disconnect, a commit's
outcome, a timer tick, a producer's request) and an ``Instant`` (both clocks, read by
the caller), changes the in-memory state, and returns what must happen next as a list
of effects (rota/core/effects.py). It never awaits, never touches a socket or the disk and
never reads a clock, so every decision is tested by feeding it events
(tests/unit/test_engine.py).

``Engine`` holds the state and inherits its parts, each a mixin of one concern: what
producers ask (rota/core/intake.py), scheduling rounds (rota/core/reservations.py), what workers
tell it (rota/core/heartbeats.py), its clock (rota/core/timers.py) and the workers' prefetch
lines (rota/core/lines.py: started jobs, take-back). Here: the start, the commits'
outcomes, and attempts that ended without a result.

Deadlines (leases, grace periods, heartbeat silence, timers) are monotonic; wall time
is only what gets stored and shown. When the engine sees that it was not called for
longer than the shell promised (``tick_every``), the server itself stalled: it pushes
every liveness deadline back by the stall before judging anyone.
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from rota.base import protocol as p
from rota.core.attempts import MAX_LOG_LINES, end_attempt
from rota.core.effects import Arm, Effect, Finished, Reserved, Save, Wake
from rota.base.errors import RotaError, failure_level
from rota.core.heartbeats import MAY_RECONNECT, Heartbeats
from rota.core.intake import Intake
from rota.core.limits import LimitRule, LimitUse, Scope, limit_name
from rota.core.lines import Lines
from rota.base.logs import log_lines
from rota.core.model import TERMINAL_STATES, Change, Instant, JobRecord, JobState
from rota.core.observe import Observer
from rota.core.policy import Ending
from rota.core.endpoints import Endpoints, is_endpoint
from rota.core.pulls import Pulls, is_pull
from rota.core.registry import ConnectedWorker, Registry, short
from rota.core.reservations import Reservations
from rota.core.scheduler import Scheduler
from rota.core.settings import ServerSettings
from rota.base.specs import MAX_EXECUTE_TIMEOUT, JobSpec
from rota.core.standing import Standing
from rota.core.timers import Timers

__all__ = ["Engine", "MAX_LOG_LINES", "MAY_RECONNECT"]
log = logging.getLogger("rota.server")
RECENT_RESULTS = 10_000  # accepted results remembered, to ack a resend of one quietly
# Why a result is rejected whose row refused it at commit (docs/protocol.md §5.1).
ROW_REFUSED = "the job's row moved on (another attempt or server holds it, or it ended)"


class Engine(Intake, Reservations, Heartbeats, Timers, Lines, Pulls, Endpoints):
    def __init__(self, settings: ServerSettings, rand: Callable[[], float] | None = None) -> None:
        self.settings = settings
        self.scheduler = Scheduler(settings.visibility_timeout, compact=True,
                                   min_lease=2 * settings.heartbeat_interval)
        self.registry = Registry()
        self.specs: dict[str, JobSpec] = {}
        self.retired: dict[str, float] = {}  # retired specs (no new jobs) -> when (wall)
        # OJS types no spec describes (docs/ojs.md), made by Intake.build: in memory only.
        self.unversioned: dict[str, JobSpec] = {}
        self.scheduler.unversioned = self.unversioned
        self.observe = Observer(settings.events_buffer, max_series=settings.max_series)
        self.stopping = False
        self._rand = rand or random.Random().random
        self._tickets = 0
        self._pending: dict[int, tuple[str, Any]] = {}
        self._last_tick: float | None = None
        # job id -> (worker, attempt) of results committed lately: a worker that lost an
        # ack sends the result again on its next connection; that is no error.
        self._recent: collections.OrderedDict[str, tuple[str, int]] = collections.OrderedDict()
        # The shell promises a tick at least this often; a longer gap is a stall.
        self.tick_every = max(0.05, min(1.0, settings.heartbeat_timeout / 4))
        # Its lease among several servers on one database (rota/core/standing.py): whether it
        # may hand out work, and judge the others'. Not shared: no lease, no limit.
        self.standing = Standing(settings.server_lease)
        self._lines: dict[str, dict[str, None]] = {}  # prefetch lines (rota/core/lines.py)
        self._taking: dict[str, str] = {}
        self._init_pulls()  # pull workers (rota/core/pulls.py)
        self._init_endpoints()  # push endpoints (rota/core/endpoints.py)

    @property
    def connections(self) -> dict[str, ConnectedWorker]:
        return self.registry.connections

    # -- start -------------------------------------------------------------------------
    def load(self, specs: dict[str, JobSpec], checksums: dict[str, str], jobs: list[JobRecord],
             now: Instant, waiting: Mapping[tuple[Any, ...], list[int]] | None = None,
             last_seq: int = 0, retired: dict[str, float] | None = None,
             paused: Iterable[str] = ()) -> list[Effect]:
        """Take in what the store holds: whole jobs, and the keys of plain available ones
        by (queue, spec), or by (queue, spec, concurrency key, labels) (rota/core/ready.py).
        Active jobs wait heartbeat_timeout for their workers to reconnect and reclaim
        them (and count against the limits meanwhile)."""
        self.specs = dict(specs)
        self.retired = dict(retired or {})
        self.scheduler.paused = set(paused)
        self.scheduler.status_quo = dict(checksums)
        self.scheduler.last_seq = max(self.scheduler.last_seq, last_seq)
        for group, keys in (waiting or {}).items():
            queue, spec, key, labels = (*group, None, ())[:4] if len(group) == 2 else group
            self.scheduler.ready.load(queue, spec, keys, key, tuple(labels))
        self.unversioned.clear()  # live jobs of types no spec describes: unversioned again
        for spec in {job.spec for job in jobs} | {group[1] for group in waiting or {}}:
            if spec not in self.specs:
                self.unversioned[spec] = JobSpec.unversioned(spec)
        grace = now.mono + self.settings.heartbeat_timeout
        orphans = 0
        for job in jobs:
            job.clocks(now)
            self.scheduler.track(job)
            if job.state == JobState.ACTIVE:
                # Start reports are kept in memory: counted as started. An endpoint's job
                # has no start: its delivery's answer is lost, and its retry not counted.
                job.started = not is_endpoint(job.worker_id)
                self.scheduler.orphan(job, self._reclaim_grace(job, grace, now))
                orphans += 1
        if orphans:
            log.warning("recovery active_jobs=%d wait=%.1fs for their workers to reclaim them",
                        orphans, self.settings.heartbeat_timeout)
        self._last_tick = now.mono
        return [Wake()]

    def _reclaim_grace(self, job: JobRecord, grace: float, now: Instant) -> float:
        """Until when (monotonic) a loaded active job waits for its worker to reclaim it:
        a /work worker's, heartbeat_timeout (it reconnects at once); a pull worker's, its
        stored lease at least, as it may be silent until its next request (docs/ojs.md)."""
        if is_endpoint(job.worker_id):  # its delivery's answer is lost: retried after its
            spec = self.specs.get(job.spec)  # timeout, unless it calls back meanwhile
            execute = spec.execute if spec is not None else None
            return grace + (execute.timeout if execute is not None else MAX_EXECUTE_TIMEOUT)
        if not is_pull(job.worker_id) or job.lease_expires_at is None:
            return grace
        return max(grace, now.mono + (job.lease_expires_at - now.wall))

    def set_limits(self, rules: Mapping[Scope, LimitRule], now: Instant,
                   starts: Mapping[tuple[str, str | None], list[float]] | None = None
                   ) -> list[Effect]:
        """The whole table of limits in force (spec files' rules overlaid by runtime
        ones), at a start and whenever it changes; ``starts``: the rates' recent starts
        as stored (wall times by limit name and key), read back at a start so that a
        restart does not reset a window."""
        self.scheduler.set_limits(rules, now, starts)
        if rules:
            log.info("limits in force: %s", ", ".join(
                f"{limit_name(scope)}={msgspec.json.encode(rule).decode()}"
                for scope, rule in sorted(rules.items())))
        return [Wake()]

    def limit_use(self, now: Instant) -> list[LimitUse]:
        """Every limit in force with its current use (rota/core/flow.py)."""
        return self.scheduler.limit_use(now.mono)

    def pause_queue(self, queue: str, paused: bool, now: Instant) -> list[Effect]:
        """Pause a queue (its jobs stay, none is assigned) or resume it (its jobs go to
        workers from the next round). Already-assigned jobs run on."""
        was = queue in self.scheduler.paused
        if paused:
            self.scheduler.paused.add(queue)
        else:
            self.scheduler.paused.discard(queue)
        if was != paused:
            word = "paused" if paused else "resumed"
            log.info("queue %s queue=%s", word, queue)
            self.observe.event(now.wall, "state_change", queue=queue, state=word,
                               message=f"queue {queue} {word}")
        return [] if paused else [Wake()]

    def begin_shutdown(self) -> None:
        """From here on, a closing connection keeps its jobs reserved: after the restart
        its worker reconnects and reclaims them, instead of each losing an attempt."""
        if not self.stopping:
            self.stopping = True
            log.info("shutting down: running jobs stay reserved for their workers to reclaim")

    def _ticket(self, kind: str, payload: Any) -> int:
        self._tickets += 1
        self._pending[self._tickets] = (kind, payload)
        return self._tickets

    def _place(self, job: JobRecord) -> list[Effect]:
        """Put a job where its (committed) state says it belongs."""
        if job.state in TERMINAL_STATES:
            self.scheduler.finish(job)
            return [Finished([job.id])]
        if job.state == JobState.AVAILABLE:
            self.scheduler.add(job)
            return []
        due = job.due if job.due is not None else 0.0  # scheduled or retryable
        self.scheduler.defer(job, due)
        return [Arm(due)]

    # -- commits ---------------------------------------------------------------------
    def committed(self, ticket: int, error: BaseException | None, now: Instant,
                  read: Reserved | list[JobRecord | None] | dict[str, JobRecord | None]
                  | None = None) -> list[Effect]:
        """The outcome of a ``Save`` or ``Reserve`` that carried ``ticket``; ``read``: a
        reservation's claimed jobs as their rows read after it (None where a row was no
        longer available), or a save's changes that their rows refused (by job id, with
        the row if it now waits: ``Store.save``)."""
        kind, payload = self._pending.pop(ticket)
        refused = read if isinstance(read, dict) else {}
        if kind == "results":
            return self._results_committed(ticket, payload, error, now, refused)
        if kind == "reserve":
            if not isinstance(read, Reserved):
                read = Reserved(read if isinstance(read, list) else [])
            return self._reserve_committed(payload, error, read, now)
        # "finish": attempts ended by the server; wake whoever waits on a final state
        if error is not None:
            log.log(failure_level(error), "storing %d job transition(s) failed: %s",
                    len(payload), error)
            return []
        effects = self._refused(payload, refused, "ending", now)
        stored = [c for c in payload if c.job.id not in refused]
        self.observe.ended(stored, now.wall, reported=False)
        return effects + [Finished([c.job.id for c in stored if c.job.state in TERMINAL_STATES])]

    def restamp(self, now: Instant) -> list[Effect]:
        """The wall clock stepped while the server ran: write the waiting jobs' stored
        deadlines (``run_at``, ``expires_at``) again, from their monotonic ones, on the
        clock as it reads now, so that a restart reads them as far away as they are.
        Only waiting jobs: a reserved one's row is written when its attempt ends, and a
        restart gives it the reclaim grace whatever its row says."""
        jobs = [job for job in self.scheduler.jobs.values()
                if job.state in (JobState.SCHEDULED, JobState.RETRYABLE, JobState.AVAILABLE)
                and (job.due is not None or job.expiry is not None)]
        for job in jobs:
            if job.due is not None:
                job.run_at = now.wall_of(job.due)
            if job.expiry is not None:
                job.expires_at = now.wall_of(job.expiry)
        if jobs:
            log.info("restamped jobs=%d: their stored deadlines follow the stepped wall clock",
                     len(jobs))
        return [Save([Change(job) for job in jobs])] if jobs else []

    def rate_starts(self, now: Instant) -> dict[tuple[str, str | None], list[float]]:
        """The rates' recent starts on the wall clock as it reads now, by limit name and
        key: what the store should hold after a step, for a restart's windows."""
        return {name: [now.wall_of(at) for at in times] for name, times
                in self.scheduler.limiter.recent_starts(now.mono).items()}

    def refused(self, changes: list[Change], refused: dict[str, JobRecord | None], now: Instant
                ) -> list[Effect]:
        """A ``Save`` without a ticket (a cancel, a retry, jobs come due) committed, and
        its rows refused these changes (``Store.save``): memory follows the rows."""
        return self._refused(changes, refused, "transition", now)

    def _refused(self, changes: list[Change], refused: dict[str, JobRecord | None], what: str,
                 now: Instant) -> list[Effect]:
        """Changes whose rows refused them (the attempt fence, or, with several servers,
        the holder): the row moved on behind this server's copy (another server ran
        another attempt or took the job back, or someone wrote the row directly). The
        copy is stale: it is forgotten, and the row, if it waits, is held as it reads."""
        gone = [c.job for c in changes if c.job.id in refused]
        if not gone:
            return []
        log_lines(log, logging.WARNING, "refused by the row job=%s spec=%s queue=%s"
                  " worker=%s attempt=%d: the %s was not stored (its row moved on: another"
                  " attempt or server holds it, or it ended)",
                  [(j.id, j.spec, j.queue, j.worker_id, j.attempt, what) for j in gone])
        for job in gone:
            # A copy placed again before the commit (recovered: waiting, or reserved in a
            # round since) stays: that reservation is fenced by the same row and hears
            # that it lost (_lost_race).
            if self.scheduler.jobs.get(job.id) is job and job.state != JobState.ACTIVE:
                self.scheduler.finish(job)
            row = refused[job.id]
            if row is not None and row.id not in self.scheduler.jobs:
                self._hold_as_read(row, now)
        return [Wake()]

    def _results_committed(self, ticket: int, payload: Any, error: BaseException | None,
                           now: Instant, refused: dict[str, JobRecord | None]) -> list[Effect]:
        worker_id, conn, seq, desired, changes, again, rejected = payload
        effects: list[Effect] = []
        accepted = list(again)
        if error is None and refused:
            # Turned away as a stale attempt is: nothing was stored, and the worker must
            # not send it again (no other answer would be true).
            effects += self._refused(changes, refused, "result", now)
            rejected += [p.ResultRejection(job_id=c.job.id, attempt=c.job.attempt,
                                           reason=ROW_REFUSED)
                         for c in changes if c.job.id in refused]
            changes = [c for c in changes if c.job.id not in refused]
        if error is not None:
            # Nothing was stored: the jobs stay reserved, and the worker hears that it may
            # report them again rather than believing they were recorded.
            log.log(failure_level(error), "storing %d result(s) from worker=%s failed: %s",
                    len(changes), worker_id, error)
            # A storage error names its code (storage_full ...): a worker or an operator
            # reading the reason knows the disk is at fault, not the result.
            detail = f"{error.code}: {error}" if isinstance(error, RotaError) else str(error)
            for change in changes:
                effects += self._undo(change, worker_id, conn, now)
                rejected.append(p.ResultRejection(
                    job_id=change.job.id, attempt=change.job.attempt,
                    reason=f"could not be stored ({detail}); report it again"))
        else:
            completed = []
            self.observe.ended(changes, now.wall, worker=worker_id, reported=True)
            for change in changes:
                job = change.job
                if job.state == JobState.COMPLETED:
                    completed.append((job.id, job.spec, short(job.checksum), job.queue,
                                      worker_id, job.attempt,
                                      job.took_ms(change.finished_at or now.wall)))
                self._remember(job.id, worker_id, job.attempt)
                effects += self._place(job)
            log_lines(log, logging.INFO, "result job=%s spec=%s@%s queue=%s worker=%s"
                      " attempt=%d outcome=completed duration_ms=%s", completed)
            effects.append(Wake())
            accepted += [c.job.id for c in changes]
        connection = self.registry.get(worker_id, conn)
        if connection is not None:
            for entry in connection.acks:
                if entry[0] == ticket:
                    entry[1] = self._ack(seq, desired, accepted, rejected, now)
            effects += self._flush_acks(connection)
        return effects

    def _undo(self, change: Change, worker_id: str, conn: int, now: Instant) -> list[Effect]:
        """A result whose commit failed: the job is reserved by its worker again, as if
        the result had never come; if that worker left meanwhile, it is kept for it for
        the reconnect grace, like any job of a lost connection."""
        job = change.job
        job.state = JobState.ACTIVE  # undone, not a move: the move never happened
        job.fails, job.deaths, job.budget_start, job.run_at, job.due = change.undo  # type: ignore[misc]
        job.started = change.ending != "released"  # a run that reported a result started
        holder = self.scheduler.workers.get(worker_id)
        if holder is not None and self.registry.get(worker_id, conn) is not None:
            holder.active.add(job.id)
            self.scheduler.hold(job, now.mono + self.scheduler.lease_for(job))
            return []
        until = now.mono + self.settings.reconnect_grace
        self.scheduler.orphan(job, until)
        return [Arm(until)]

    def _remember(self, job_id: str, worker_id: str, attempt: int) -> None:
        self._recent[job_id] = (worker_id, attempt)
        if len(self._recent) > RECENT_RESULTS:
            self._recent.popitem(last=False)

    def _recover(self, jobs: Iterable[JobRecord], ending: Ending, message: str, now: Instant, *,
                 death: bool = True) -> list[Effect]:
        """Attempts that ended without a result: retry or discard them, record why.
        ``death``: a worker_death that counts toward the job's poison tally."""
        changes = [end_attempt(job, ending, p.ErrorInfo(type=ending, message=message), now,
                               self._rand, death=death) for job in jobs]
        if not changes:
            return []
        effects: list[Effect] = []
        for change in changes:
            # Placed before the commit: the writer commits in order, so any reservation
            # of this job is written after this change.
            if change.job.state not in TERMINAL_STATES:
                effects += self._place(change.job)
            else:
                self.scheduler.finish(change.job)
        effects.insert(0, Save(changes, self._ticket("finish", changes)))
        effects.append(Wake())
        return effects
