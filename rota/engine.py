"""The server's state machine, with no I/O: events in, effects out.

Each method takes an event (a registration, a heartbeat, a disconnect, a commit's
outcome, a timer tick, a producer's request) and an ``Instant`` (both clocks, read by
the caller), changes the in-memory state, and returns what must happen next as a list
of effects (rota/effects.py). It never awaits, never touches a socket or the disk and
never reads a clock, so every decision is tested by feeding it events
(tests/test_engine.py).

Deadlines (leases, grace periods, heartbeat silence, timers) are monotonic; wall time
is only what gets stored and shown. When the engine sees that it was not called for
longer than the shell promised (``tick_every``), the server itself stalled: it pushes
every liveness deadline back by the stall before judging anyone.
"""

from __future__ import annotations

import collections
import logging
import random
from collections.abc import Callable, Iterable
from typing import Any

from rota import protocol as p
from rota.attempts import MAX_LOG_LINES, end_attempt, held_by, result_problem, settle, status_notes
from rota.auth import Principal
from rota.effects import (Abort, Arm, Effect, Finished, Note, Reserved, Save, Send, Wake, WorkerGone,
                          WorkerSeen)
from rota.errors import RotaError, failure_level
from rota.intake import Intake
from rota.jobs import error_record
from rota.logs import log_lines, printable
from rota.model import TERMINAL_STATES, Change, Instant, JobRecord, JobState
from rota.observe import Observer
from rota.policy import Ending
from rota.registry import ConnectedWorker, Registry, held_ids, judge_specs, may_reclaim, short
from rota.reservations import Reservations
from rota.scheduler import Scheduler, WorkerSlot
from rota.settings import ServerSettings
from rota.specs import JobSpec
from rota.standing import Standing

__all__ = ["Engine", "MAX_LOG_LINES", "MAY_RECONNECT"]
log = logging.getLogger("rota.server")
# Disconnects the worker did not choose and may recover from: its jobs stay reserved for
# reconnect_grace, so that a worker whose network blinked (or that the server closed
# for its own reasons: a flood, a backlog it did not read) takes them back on reconnect.
# After any other (it closed, said goodbye, went silent, broke the protocol) they go back
# at once.
MAY_RECONNECT = frozenset({"connection_lost", "superseded", "internal_error", "rate_limited",
                           "slow_consumer"})
# Ends of a connection that count toward a job's poison tally (max_worker_deaths) when
# its jobs go back at once: the worker process closed without a goodbye or went silent.
# A goodbye, a protocol error or a revoked token says nothing about the job. (Jobs kept
# for the reconnect grace count when it lapses: their worker did not come back.)
DEATHS = frozenset({"closed", "heartbeat_timeout"})
RECENT_RESULTS = 10_000  # accepted results remembered, to ack a resend of one quietly
# Why a result is rejected whose row refused it at commit (docs/protocol.md §5.1).
ROW_REFUSED = "the job's row moved on (another attempt or server holds it, or it ended)"
STALL = 0.1  # seconds a tick may be late before the lateness counts as a server stall


class Engine(Intake, Reservations):
    def __init__(self, settings: ServerSettings, rand: Callable[[], float] | None = None) -> None:
        self.settings = settings
        self.scheduler = Scheduler(settings.visibility_timeout, compact=True,
                                   min_lease=2 * settings.heartbeat_interval)
        self.registry = Registry()
        self.specs: dict[str, JobSpec] = {}
        self.retired: dict[str, float] = {}  # retired specs (no new jobs) -> when (wall)
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
        # Its lease among several servers on one database (rota/standing.py): whether it
        # may hand out work, and judge the others'. Not shared: no lease, no limit.
        self.standing = Standing(settings.server_lease)

    @property
    def connections(self) -> dict[str, ConnectedWorker]:
        return self.registry.connections

    # -- start -------------------------------------------------------------------------
    def load(self, specs: dict[str, JobSpec], checksums: dict[str, str], jobs: list[JobRecord],
             now: Instant, waiting: dict[tuple[str, str], list[int]] | None = None,
             last_seq: int = 0, retired: dict[str, float] | None = None,
             paused: Iterable[str] = ()) -> list[Effect]:
        """Take in what the store holds: whole jobs, and the keys of plain available ones
        by (queue, spec) (rota/ready.py). Active jobs wait heartbeat_timeout for their
        workers to reconnect and reclaim them."""
        self.specs = dict(specs)
        self.retired = dict(retired or {})
        self.scheduler.paused = set(paused)
        self.scheduler.status_quo = dict(checksums)
        self.scheduler.last_seq = max(self.scheduler.last_seq, last_seq)
        for (queue, spec), keys in (waiting or {}).items():
            self.scheduler.ready.load(queue, spec, keys)
        grace = now.mono + self.settings.heartbeat_timeout
        orphans = 0
        for job in jobs:
            job.clocks(now)
            self.scheduler.track(job)
            if job.state == JobState.ACTIVE:
                self.scheduler.orphan(job, grace)
                orphans += 1
        if orphans:
            log.warning("recovery active_jobs=%d wait=%.1fs for their workers to reclaim them",
                        orphans, self.settings.heartbeat_timeout)
        self._last_tick = now.mono
        return [Wake()]

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

    # -- workers ---------------------------------------------------------------------
    def register(self, conn: int, hb: p.Heartbeat, principal: Principal, now: Instant
                 ) -> list[Effect]:
        """A registration (the first heartbeat of a connection; the caller then feeds the
        same heartbeat to ``heartbeat``). Raises FrameError if it is refused."""
        reg = hb.registration
        assert reg is not None
        effects: list[Effect] = []
        kept = {job.worker_token for job in self.scheduler.kept_for(hb.worker_id)}
        old = self.registry.admit(hb.worker_id, reg, principal, kept)
        if old is not None:
            effects.append(Abort(old.conn, "superseded", "the worker reconnected on a new"
                                 " connection", p.CLOSE_POLICY))
            effects += self.disconnect(old.conn, hb.worker_id, "superseded", now)
        verdict = judge_specs(self.scheduler.status_quo, reg.specs)
        slot = WorkerSlot(id=hb.worker_id, queues=list(reg.queues), concurrency=reg.concurrency,
                          specs={s.name: s.checksum for s in reg.specs}, labels=list(reg.labels),
                          prefetch=reg.prefetch, token=principal.token_id)
        self.scheduler.add_worker(slot)
        connection = ConnectedWorker(conn, slot, reg, now.wall, now.mono, principal)
        self.registry.add(connection)
        self.registry.log_registration(connection, verdict, now.mono)
        effects.append(WorkerSeen(hb.worker_id, reg, now.wall))
        self.observe.event(now.wall, "worker_connect", worker=slot.id, state=slot.state,
                           message=f"host {printable(reg.hostname)} pid {reg.pid}")
        effects.append(Send(conn, p.encode(p.Welcome(
            worker_id=slot.id, server_time=p.rfc3339(now.wall),
            heartbeat_interval=self.settings.heartbeat_interval,
            heartbeat_timeout=self.settings.heartbeat_timeout,
            visibility_timeout=self.settings.visibility_timeout, specs=verdict))))
        return effects

    def disconnect(self, conn: int, worker_id: str, reason: str, now: Instant) -> list[Effect]:
        """Connection ``conn`` of the worker ended: forget it (not a newer connection of
        the same worker) and decide what becomes of its jobs."""
        connection = self.registry.remove(worker_id, conn)
        if connection is None:
            return []
        held = self.scheduler.remove_worker(worker_id, connection.reported)
        effects: list[Effect] = [WorkerGone(worker_id, connection.connected_at, now.wall)]
        self.observe.event(now.wall, "worker_disconnect", worker=worker_id, message=reason)
        quiet = not (connection.logged or held)  # its registration was not logged either
        if self.stopping:
            if not quiet:
                log.info("disconnect worker=%s reason=%s jobs_kept_for_reclaim=%d", worker_id,
                         reason, len(held))
        elif reason not in MAY_RECONNECT or not held:
            if not quiet:
                log.info("disconnect worker=%s reason=%s jobs_recovered=%d", worker_id, reason,
                         len(held))
            effects += self._recover(held, "worker_death", f"worker {worker_id} is gone"
                                     f" ({reason})", now, death=reason in DEATHS)
        else:
            grace = self.settings.reconnect_grace
            for job in held:
                self.scheduler.orphan(job, now.mono + grace)
            effects.append(Arm(now.mono + grace))
            log.warning("disconnect worker=%s reason=%s jobs_held_for_reconnect=%d grace=%gs",
                        worker_id, reason, len(held), grace)
        return effects

    def outbox(self, conn: int, worker_id: str, full: bool, over: bool, now: Instant
               ) -> list[Effect]:
        """What the shell saw of connection ``conn``'s outbox (what it sent that the worker
        has not read): ``full``, above the high-water mark, and ``over``, above the limit.

        A full outbox gets no new jobs, since each would only wait in the server's memory;
        when it drains, a round runs for the jobs that waited meanwhile. One over the
        limit is closed by ``tick`` if it stays there ``outbox_close_after`` seconds."""
        connection = self.registry.get(worker_id, conn)
        if connection is None:
            return []
        worker = connection.worker
        effects: list[Effect] = []
        if full != worker.blocked:
            worker.blocked = full
            log.info("outbox %s worker=%s", "full: no new jobs until it reads" if full
                     else "drained", worker_id)
            if not full and worker.free() > 0:
                effects.append(Wake())
        if not over:
            connection.over_since = None
        elif connection.over_since is None:
            connection.over_since = now.mono
            log.warning("outbox over %d bytes worker=%s: closed if it stays over for %gs",
                        self.settings.outbox_limit, worker_id, self.settings.outbox_close_after)
        return effects

    def revoked(self, valid: Callable[[Principal], bool]) -> list[Effect]:
        """The live tokens changed: close connections whose token is no longer valid."""
        effects: list[Effect] = []
        for connection in list(self.connections.values()):
            if not valid(connection.principal):
                log.warning("token revoked worker=%s token=%s: closing its connection",
                            connection.worker.id, connection.principal.token_id or "none")
                effects.append(Abort(connection.conn, "token_revoked", "the token this worker"
                                     " connected with is no longer valid", p.CLOSE_POLICY))
        return effects

    # -- heartbeats and results -------------------------------------------------------
    def heartbeat(self, conn: int, worker_id: str, hb: p.Heartbeat, now: Instant
                  ) -> list[Effect]:
        """Apply a heartbeat. Its ack goes out now, or, if it carries results, once they
        are committed (``committed``); acks leave in the order of their heartbeats."""
        connection = self.registry.get(worker_id, conn)
        if connection is None:
            return []
        connection.last_seen = now.mono
        connection.frames += 1
        worker = connection.worker
        effects: list[Effect] = []
        # Jobs it held before a restart or a lost connection, still running or finished:
        # it reclaims them by naming them, in whichever heartbeat it does so.
        if self.scheduler.has_orphans:
            effects += self._reclaim(connection, hb, now)
        if hb.status is not None:
            if not connection.checked:
                effects += self._stop_lost_runs(connection, held_ids(hb.status))
            self.registry.report(connection, hb.status)
            # A job waiting in the worker's line is vouched for as much as a running one.
            self.scheduler.renew(worker, connection.reported, now.mono)
            if hb.status.progress or hb.status.logs or hb.status.alerts:
                notes = status_notes(self.scheduler.jobs, connection, hb.status, now)
                effects += [Note(notes)] if notes else []
                for alert in hb.status.alerts:
                    self.observe.event(now.wall, "alert", job=alert.job_id, worker=worker.id,
                                       message=(alert.level, p.cut_text(alert.message)))
        if hb.capacity is not None:
            worker.capacity = hb.capacity
        again, _, rejected, changes = self._take_results(worker, hb.results, now)
        desired = connection.directive or worker.state
        if not changes:
            if worker.free() > 0:
                effects.append(Wake())
            connection.acks.append([None, self._ack(hb.seq, desired, again, rejected, now)])
            return effects + self._flush_acks(connection)
        ticket = self._ticket("results", (worker_id, conn, hb.seq, desired, changes, again,
                                          rejected))
        connection.acks.append([ticket, None])
        effects.append(Save(changes, ticket, crash_point="result-after-commit"))
        if worker.free() > 0:
            effects.append(Wake())
        return effects

    def _flush_acks(self, connection: ConnectedWorker) -> list[Effect]:
        sends: list[Effect] = []
        while connection.acks and connection.acks[0][1] is not None:
            sends.append(Send(connection.conn, connection.acks.pop(0)[1]))
        return sends

    def _reclaim(self, connection: ConnectedWorker, hb: p.Heartbeat, now: Instant) -> list[Effect]:
        named = held_ids(hb.status) if hb.status is not None else []
        worker = connection.worker
        # Only what its token may take (Registry.admit refused it if another token's
        # jobs were kept under this worker id; this holds for any that came since): a job
        # of a queue its token may not serve (reserved by a worker without a token, before
        # auth was on) stays kept, and lapses.
        allowed: list[JobRecord] = []
        refused: list[JobRecord] = []
        for job_id in [*named, *(r.job_id for r in hb.results)]:
            job = self.scheduler.jobs.get(job_id)
            if job is None or not job.orphaned or job.worker_id != worker.id:
                continue
            if may_reclaim(job.worker_token, job.queue, connection.principal):
                allowed.append(job)
            elif connection.refused is None or job.id not in connection.refused:
                connection.refused = connection.refused or set()
                connection.refused.add(job.id)  # logged once, not at every heartbeat
                refused.append(job)
        log_lines(log, logging.WARNING, "reclaim refused job=%s queue=%s worker=%s token=%s:"
                  " not its token's job or queue", [(j.id, j.queue, worker.id,
                                                    connection.principal.token_id)
                                                   for j in refused])
        adopted = self.scheduler.adopt(worker, [j.id for j in allowed], now.mono)
        effects: list[Effect] = []
        for job in adopted:
            log.info("reclaim job=%s spec=%s@%s queue=%s worker=%s attempt=%d", job.id, job.spec,
                     short(job.checksum), job.queue, worker.id, job.attempt)
            if job.cancel_requested:  # asked for while its worker was away
                effects.append(Send(connection.conn, p.encode(
                    p.Cancel(job_ids=[job.id], reason="cancelled"))))
        return effects

    def _stop_lost_runs(self, connection: ConnectedWorker, named: list[str]) -> list[Effect]:
        """The first status after a (re)connect: jobs the worker says it runs but no longer
        holds (recovered while it was away, maybe running elsewhere) are wasted work at
        best and a duplicate side effect at worst: tell it to stop them."""
        connection.checked = True
        lost = [job_id for job_id in named if held_by(self.scheduler.jobs, connection, job_id) is None]
        if not lost:
            return []
        log.warning("reservation lost worker=%s jobs=%s: recovered while it was away",
                    connection.worker.id, ",".join(lost))
        return [Send(connection.conn, p.encode(p.Cancel(job_ids=lost, reason="reservation_lost")))]

    def _take_results(self, worker: WorkerSlot, results: list[p.Result], now: Instant
                      ) -> tuple[list[str], list[str], list[p.ResultRejection], list[Change]]:
        """(results stored before and sent again, results to store, rejections, changes)."""
        again: list[str] = []
        accepted: list[str] = []
        rejected: list[p.ResultRejection] = []
        changes: list[Change] = []
        seen: set[tuple[str, int]] = set()
        for result in results:
            if (result.job_id, result.attempt) in seen:
                reason: str | None = ("this heartbeat already carries a result for this"
                                      " attempt of this job")
            else:
                seen.add((result.job_id, result.attempt))
                reason = result_problem(self.scheduler.jobs, worker.id, result)
                if reason is not None and self._recent.get(result.job_id) == (
                        worker.id, result.attempt):
                    again.append(result.job_id)  # stored already; its ack was lost
                    continue
            if reason is not None:
                rejected.append(p.ResultRejection(job_id=result.job_id, attempt=result.attempt,
                                                  reason=reason))
                log.warning("result rejected job=%s worker=%s attempt=%d reason=%s",
                            result.job_id, worker.id, result.attempt, reason)
                continue
            job = self.scheduler.jobs[result.job_id]
            # What settling changes, put back if the commit fails.
            undo = (job.fails, job.deaths, job.budget_start, job.run_at, job.due)
            accepted.append(job.id)
            changes.append(settle(job, result, now, rand=self._rand,
                                  max_result_bytes=self.settings.max_result_bytes))
            changes[-1].undo = undo
            # The worker no longer runs it, whatever becomes of the commit: its slot is
            # free now, so the next reservation can share this result's commit.
            worker.active.discard(job.id)
        return again, accepted, rejected, changes

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

    def _ack(self, seq: int, state: str, accepted: list[str],
             rejected: list[p.ResultRejection], now: Instant) -> str:
        return p.encode(p.Ack(seq=seq, state=state,  # type: ignore[arg-type]
                              server_time=p.rfc3339(now.wall),
                              accepted=accepted, rejected=rejected))

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

    # -- this server's lease (several servers on one database) ----------------------
    def lease_taken(self, started: float, now: Instant) -> list[Effect]:
        """One of several servers on one database: it took its lease as it started (a
        renewal begun at monotonic ``started``). From now on it hands out work only while
        it holds the lease."""
        self.standing.shared = True
        return self.lease_renewed(started, now)

    def lease_renewed(self, started: float, now: Instant) -> list[Effect]:
        """A renewal of this server's lease, begun at monotonic ``started``, committed.
        If rounds had stopped for want of a lease, they start again."""
        if self.standing.renewed(started, now.mono):
            log.warning("cluster: this server's lease renewal failed, came late, or it"
                        " stalled: it judges no other server's lease for %gs, so that each"
                        " has a whole lease to renew in first", self.standing.lease)
        if self.standing.handing_out or not self.standing.may_hand_out(now.mono):
            return []
        self.standing.handing_out = True
        log.warning("cluster: lease renewed (%.1fs left): handing out work again",
                    self.standing.left(now.mono))
        return [Wake()]

    def lease_failed(self) -> None:
        """A renewal of this server's lease failed: the others are not judged until one
        works again (rota/standing.py)."""
        self.standing.failed()

    # -- timers ----------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        return self.scheduler.next_deadline()

    def tick(self, now: Instant) -> list[Effect]:
        """Fire whatever is due: timers, lapsed leases, expired jobs, silent workers.
        Nothing once a shutdown began: the jobs held stay reserved as they are, and the
        restart judges every deadline again from the rows (a reclaim grace that ran out
        during the stop would otherwise take back jobs the restart keeps for their
        workers)."""
        if self.stopping:
            return []
        effects: list[Effect] = []
        if self._last_tick is not None:
            stall = now.mono - self._last_tick - self.tick_every
            if stall > STALL:
                # The server did not run for that long: nobody's heartbeat could be read
                # and no lease could be renewed. Judge only time it was listening.
                log.warning("server stalled for %.1fs: liveness deadlines extended by it", stall)
                self.registry.shift(stall, now.mono)
                self.scheduler.shift(stall)
                self.standing.stalled()  # and it judges no other server's lease for now
        self._last_tick = now.mono
        effects += self.resume_rounds(now)
        due = self.scheduler.due(now.mono)
        if due:
            effects += [Save([Change(job) for job in due]), Wake()]
        for job in self.scheduler.expired_leases(now.mono):
            effects += self._lease_lapsed(job, now)
        expired = self.scheduler.expired_ttls(now.mono)
        if expired:
            effects += self._expire(expired, now)
        timeout = self.settings.heartbeat_timeout
        for connection in self.registry.silent(now.mono, timeout):
            log.warning("heartbeat timeout worker=%s silent_for=%.1fs", connection.worker.id,
                        now.mono - connection.last_seen)
            effects += self._abort("heartbeat_timeout", f"no heartbeat for {timeout}s",
                                   connection, now)
        after = self.settings.outbox_close_after
        for connection in self.registry.backed_up(now.mono, after):
            log.warning("slow consumer worker=%s: outbox over %d bytes for %.1fs",
                        connection.worker.id, self.settings.outbox_limit,
                        now.mono - (connection.over_since or now.mono))
            effects += self._abort("slow_consumer", f"over {self.settings.outbox_limit} bytes"
                                   f" sent and not read for {after:g}s", connection, now)
        return effects

    def _abort(self, code: str, message: str, connection: ConnectedWorker, now: Instant
               ) -> list[Effect]:
        """The server ends a connection: an ``error`` frame, then what its disconnect
        decides for its jobs (by ``code``, see MAY_RECONNECT)."""
        return [Abort(connection.conn, code, message, p.CLOSE_POLICY),
                *self.disconnect(connection.conn, connection.worker.id, code, now)]

    def _lease_lapsed(self, job: JobRecord, now: Instant) -> list[Effect]:
        holder = job.worker_id or ""
        if job.orphaned:
            self.scheduler.unorphan(job)
            return self._recover([job], "worker_death",
                                 f"worker {holder} did not reconnect in time", now)
        effects: list[Effect] = []
        connection = self.registry.get(holder)
        if connection is not None:  # stop the stale run, so it does not race the retry
            effects.append(Send(connection.conn, p.encode(
                p.Cancel(job_ids=[job.id], reason="visibility_timeout"))))
        lease = self.scheduler.lease_for(job)
        return effects + self._recover([job], "visibility_timeout",
                                       f"no result or heartbeat for {lease:g}s", now)

    def _expire(self, jobs: list[JobRecord], now: Instant) -> list[Effect]:
        changes = []
        for job in jobs:
            job.move(JobState.DISCARDED)
            record = error_record(p.ErrorInfo(type="expired", message="its time to live ran out",
                                              retryable=False),
                                  attempt=job.attempt, worker_id=None, now=now.wall)
            changes.append(Change(job, error=record, finished_at=now.wall))
            self.scheduler.finish(job)
            log.info("expired job=%s spec=%s queue=%s", job.id, job.spec, job.queue)
        return [Save(changes, self._ticket("finish", changes))]
