"""What workers tell the engine: registrations, heartbeats (and the results they carry),
disconnects, outbox marks, revoked tokens. Pure.

A part of the engine (``Engine`` inherits it), kept apart because it answers workers'
connections; what producers ask is in rota/core/intake.py, rounds in rota/core/reservations.py,
timers in rota/core/timers.py. Results are settled here and committed by the shell; their
commit's outcome comes back to ``Engine.committed``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

from rota.base import protocol as p
from rota.core.attempts import held_by, result_problem, settle, status_notes
from rota.core.auth import Principal
from rota.core.effects import Abort, Arm, Effect, Note, Save, Send, Wake, WorkerGone, WorkerSeen
from rota.base.logs import log_lines, printable
from rota.core.model import Change, Instant, JobRecord
from rota.core.observe import Observer
from rota.core.registry import ConnectedWorker, Registry, held_ids, judge_specs, may_reclaim, short
from rota.core.scheduler import Scheduler, WorkerSlot
from rota.core.settings import ServerSettings

log = logging.getLogger("rota.server")
# Disconnects the worker did not choose and may recover from: its jobs stay reserved for
# reconnect_grace, so that a worker whose network blinked (or that the server closed
# for its own reasons: a flood, a backlog it did not read) takes them back on reconnect.
# After any other (it closed, said goodbye, went silent, broke the protocol) they go back
# at once.
MAY_RECONNECT = frozenset({"connection_lost", "superseded", "internal_error", "rate_limited",
                           "slow_consumer"})
# The longest a worker may ask to go without an ack while idle (sparse acks, §4.2): the
# server's own sign of life; a worker that wants to know sooner asks for less.
MAX_IDLE_ACK_INTERVAL = 60.0
# Ends of a connection that count toward a job's poison tally (max_worker_deaths) when
# its jobs go back at once: the worker process closed without a goodbye or went silent.
# A goodbye, a protocol error or a revoked token says nothing about the job. (Jobs kept
# for the reconnect grace count when it lapses: their worker did not come back.)
DEATHS = frozenset({"closed", "heartbeat_timeout"})


class Heartbeats:
    settings: ServerSettings
    scheduler: Scheduler
    registry: Registry
    observe: Observer
    stopping: bool
    _rand: Callable[[], float]
    # job id -> (worker, attempt) of results committed lately (Engine._remember)
    _recent: collections.OrderedDict[str, tuple[str, int]]
    _ticket: Callable[[str, Any], int]
    _recover: Callable[..., list[Effect]]  # (jobs, ending, message, now, *, death)
    # (Lines, rota/core/lines.py)
    _at_death: Callable[..., tuple[list[JobRecord], list[JobRecord]]]
    _starts: Callable[[ConnectedWorker, p.Status], None]
    _given_back: Callable[[ConnectedWorker, list[str], Instant], list[Effect]]

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
        connection.ack_window = self._ack_window(reg)
        self.registry.add(connection)
        self.registry.log_registration(connection, verdict, now.mono)
        effects.append(WorkerSeen(hb.worker_id, reg, now.wall))
        self.observe.event(now.wall, "worker_connect", worker=slot.id, state=slot.state,
                           message=f"host {printable(reg.hostname)} pid {reg.pid}")
        effects.append(Send(conn, p.encode(p.Welcome(
            worker_id=slot.id, server_time=p.rfc3339(now.wall),
            heartbeat_interval=self.settings.heartbeat_interval,
            heartbeat_timeout=self.settings.heartbeat_timeout,
            visibility_timeout=self.settings.visibility_timeout, specs=verdict,
            idle_ack_interval=(connection.ack_window if reg.lean_acks
                               and reg.idle_ack_interval is not None else None),
        ))))
        return effects

    def _ack_window(self, reg: p.Registration) -> float:
        """How long a worker that holds no job goes without an ack (docs/protocol.md
        §4.2): none without lean acks; a quarter of the heartbeat timeout by default; what
        it asked for within [that, MAX_IDLE_ACK_INTERVAL] when it said (sparse acks)."""
        if not reg.lean_acks:
            return 0.0
        least = self.settings.heartbeat_timeout / 4
        if reg.idle_ack_interval is None:
            return least
        return min(max(reg.idle_ack_interval, least), max(least, MAX_IDLE_ACK_INTERVAL))

    def disconnect(self, conn: int, worker_id: str, reason: str, now: Instant) -> list[Effect]:
        """Connection ``conn`` of the worker ended: forget it (not a newer connection of
        the same worker) and decide what becomes of its jobs."""
        connection = self.registry.remove(worker_id, conn)
        if connection is None:
            return []
        held = self.scheduler.remove_worker(worker_id, connection.reported)
        started, unstarted = self._at_death(connection.worker, worker_id, held)
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
            # Only a job that started can be blamed for its worker's end; one still
            # waiting in its line goes back unused (rota/core/lines.py).
            effects += self._recover(started, "worker_death", f"worker {worker_id} is gone"
                                     f" ({reason})", now, death=reason in DEATHS)
            effects += self._recover(unstarted, "released", f"worker {worker_id} is gone"
                                     f" ({reason}) before it started the job", now, death=False)
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
        when it drains, a round runs for the jobs that waited meanwhile. One that stays
        full ``outbox_close_after`` seconds is closed by ``tick``: its worker stopped
        reading, however little it left unread, and the jobs it was sent wait on it."""
        connection = self.registry.get(worker_id, conn)
        if connection is None:
            return []
        worker = connection.worker
        effects: list[Effect] = []
        if full != worker.blocked:
            worker.blocked = full
            if full:
                log.info("outbox full worker=%s: no new jobs until it reads (closed if it"
                         " stays full for %gs)", worker_id, self.settings.outbox_close_after)
            else:
                log.info("outbox drained worker=%s", worker_id)
            if not full and worker.free() > 0:
                effects.append(Wake())
        if not full:
            connection.full_since = None
        elif connection.full_since is None:
            connection.full_since = now.mono
        if over and not connection.over:
            log.warning("outbox over %d bytes worker=%s", self.settings.outbox_limit, worker_id)
        connection.over = over
        return effects

    def revoked(self, valid: Callable[[Principal], bool]) -> list[Effect]:
        """The live tokens changed: close connections whose token is no longer valid."""
        effects: list[Effect] = []
        for connection in list(self.registry.connections.values()):
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
        connection.plain = plain(hb)
        connection.beat_capacity = hb.capacity
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
            self._starts(connection, hb.status)
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
        if hb.status is not None and hb.status.given_back:  # (lowers the capacity just set)
            effects += self._given_back(connection, hb.status.given_back, now)
        again, _, rejected, changes = self._take_results(worker, hb.results, now)
        desired = connection.directive or worker.state
        if not changes:
            if worker.free() > 0:
                effects.append(Wake())
            if self._quiet(connection, hb, rejected, now):
                connection.quiet_acks += 1
                return effects
            connection.last_ack = now.mono
            connection.acks.append([None, self._ack(hb.seq, desired, again, rejected, now)])
            return effects + self._flush_acks(connection)
        connection.last_ack = now.mono
        ticket = self._ticket("results", (worker_id, conn, hb.seq, desired, changes, again,
                                          rejected))
        connection.acks.append([ticket, None])
        effects.append(Save(changes, ticket, crash_point="result-after-commit"))
        if worker.free() > 0:
            effects.append(Wake())
        return effects

    def repeat(self, conn: int, worker_id: str, seq: int, now: Instant) -> list[Effect] | None:
        """A heartbeat the same as this connection's last but for its ``seq`` (the shell
        compared the frames): what ``heartbeat`` would do with it, without decoding it
        again, or None if it must take that path. Only a plain beat (``plain``) may
        repeat, and only while nothing waits that a full one would settle (a directive,
        an ack behind a commit, jobs kept for reclaim): then a beat changes no state but
        the connection's clock and the worker's capacity (set again, as the full path
        sets it: an assign since may have lowered it), and costs far less (§3.6)."""
        connection = self.registry.get(worker_id, conn)
        if (connection is None or not connection.plain or not connection.checked
                or connection.directive is not None or connection.acks
                or self.scheduler.has_orphans):
            return None
        connection.last_seen = now.mono
        connection.frames += 1
        worker = connection.worker
        if connection.beat_capacity is not None:  # as the full path: an assign lowered it
            worker.capacity = connection.beat_capacity
        effects: list[Effect] = [Wake()] if worker.free() > 0 else []
        if self._quiet(connection, None, [], now):
            connection.quiet_acks += 1
            return effects
        connection.last_ack = now.mono
        effects.append(Send(connection.conn, self._ack(seq, worker.state, [], [], now)))
        return effects

    def _quiet(self, connection: ConnectedWorker, hb: p.Heartbeat | None,
               rejected: list[p.ResultRejection], now: Instant) -> bool:
        """Whether a heartbeat goes unanswered (docs/protocol.md §4.2): its worker asked
        for lean acks, it carried no result, no directive waits for the worker, no ack is
        ahead of it, and an ack went out within its window (``_ack_window``), so the
        worker still hears from the server as often as it asked to. A worker that holds
        a job, in its own view or the server's, gets a quarter of the timeout at most: it
        must learn of a dead connection before the server gives its jobs to another."""
        window = connection.ack_window
        if window > self.settings.heartbeat_timeout / 4 and (
                connection.reported or connection.worker.active or connection.worker.claims):
            window = self.settings.heartbeat_timeout / 4
        return (now.mono - connection.last_ack < window and not rejected
                and (hb is None or not (hb.results or hb.goodbye))
                and connection.directive is None and not connection.acks)

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

    def _ack(self, seq: int, state: str, accepted: list[str],
             rejected: list[p.ResultRejection], now: Instant) -> str:
        return p.encode(p.Ack(seq=seq, state=state,  # type: ignore[arg-type]
                              server_time=p.rfc3339(now.wall),
                              accepted=accepted, rejected=rejected))


def plain(hb: p.Heartbeat) -> bool:
    """Whether a heartbeat only says the worker is there: no registration, result,
    goodbye or held job, and a status with no news (its figures may be there: the same
    again is still no news). Such a beat, repeated, may take ``Heartbeats.repeat``."""
    status = hb.status
    return (hb.registration is None and not hb.results and not hb.goodbye
            and status is not None and not (
                status.active_job_ids or status.prefetched_job_ids or status.progress
                or status.logs or status.alerts or status.started or status.given_back))
