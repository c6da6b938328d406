"""The engine's clock: timers, lapsed leases, expired jobs, silent workers, stalls, and
this server's own lease among several. Pure: ``tick`` is fed the time, never reads it.

A part of the engine (``Engine`` inherits it). Deadlines are monotonic; when the engine
sees that it was not called for longer than the shell promised (``tick_every``), the
server itself stalled: it pushes every liveness deadline back by the stall before judging
anyone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rota.base import protocol as p
from rota.core.effects import Abort, Effect, Save, Send, Wake
from rota.core.jobs import error_record
from rota.core.model import Change, Instant, JobRecord, JobState
from rota.core.registry import ConnectedWorker, Registry
from rota.core.scheduler import Scheduler
from rota.core.settings import ServerSettings
from rota.core.standing import Standing

log = logging.getLogger("rota.server")
STALL = 0.1  # seconds a tick may be late before the lateness counts as a server stall


class Timers:
    settings: ServerSettings
    scheduler: Scheduler
    registry: Registry
    standing: Standing
    stopping: bool
    tick_every: float  # the shell promises a tick at least this often
    _last_tick: float | None
    _ticket: Callable[[str, Any], int]
    _recover: Callable[..., list[Effect]]  # (jobs, ending, message, now, *, death)
    resume_rounds: Callable[[Instant], list[Effect]]  # (Reservations)
    disconnect: Callable[[int, str, str, Instant], list[Effect]]  # (Heartbeats)
    _pulls_tick: Callable[[Instant], list[Effect]]  # (Pulls)
    _endpoints_tick: Callable[[Instant], list[Effect]]  # (Endpoints)
    pull_lease: Callable[[JobRecord], float | None]  # (Pulls)
    pull_deadline: Callable[[], float | None]  # (Pulls)

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
        works again (rota/core/standing.py)."""
        self.standing.failed()

    # -- timers ----------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        return min((d for d in (self.scheduler.next_deadline(), self.pull_deadline())
                    if d is not None), default=None)

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
        if self.scheduler.unpark_due(now.mono):  # a limit allows starts again
            effects.append(Wake())
        due = self.scheduler.due(now.mono)
        if due:
            effects += [Save([Change(job) for job in due]), Wake()]
        for job in self.scheduler.expired_leases(now.mono):
            effects += self._lease_lapsed(job, now)
        effects += self._pulls_tick(now)  # timeout_ms, idle pull workers (rota/core/pulls.py)
        effects += self._endpoints_tick(now)  # breakers (rota/core/endpoints.py)
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
            log.warning("slow consumer worker=%s: outbox full for %.1fs", connection.worker.id,
                        now.mono - (connection.full_since or now.mono))
            effects += self._abort("slow_consumer", f"over {self.settings.outbox_high_water}"
                                   f" bytes sent and not read for {after:g}s", connection, now)
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
            if not job.started:  # still in its line: no death of its doing, no attempt used
                said = (f"its delivery to {holder} was cut by a restart and not called back"
                        " in time") if holder.startswith("http:") else \
                    f"worker {holder} did not reconnect in time, and had not started the job"
                return self._recover([job], "released", f"{said}: not counted", now,
                                     death=False)
            return self._recover([job], "worker_death",
                                 f"worker {holder} did not reconnect in time", now)
        effects: list[Effect] = []
        connection = self.registry.get(holder)
        if connection is not None:  # stop the stale run, so it does not race the retry
            effects.append(Send(connection.conn, p.encode(
                p.Cancel(job_ids=[job.id], reason="visibility_timeout"))))
        lease = self.pull_lease(job) or self.scheduler.lease_for(job)
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
