"""Scheduling rounds and their commits: what workers are sent, and when. Pure.

A part of the engine (``Engine`` inherits it). A round reserves jobs in memory and
returns one ``Reserve``; its commit's outcome comes back to ``_reserve_committed``,
which alone releases the ``assign`` frames (commit before send). Whole jobs are
reserved as memory holds them; a job kept as a key only (rota/core/ready.py) is a ``Claim``,
and the store reserves its row only if it is still available and reads it back in the
same transaction: the assign is built from what was read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rota.base import protocol as p
from rota.core.effects import Arm, Effect, Reserve, Reserved, Send, Wake
from rota.base.errors import failure_level
from rota.base.logs import log_lines
from rota.base.specs import UNVERSIONED
from rota.core.model import Instant, JobRecord, JobState
from rota.core.observe import Observer
from rota.core.ready import Claim
from rota.core.registry import Registry, short
from rota.core.scheduler import Scheduler
from rota.core.settings import ServerSettings
from rota.core.standing import Standing

log = logging.getLogger("rota.server")
# Seconds without a scheduling round after one whose commit failed. Its jobs and the
# workers' slots are back at once, and a round at once would most likely fail on the
# same disk, and the next, spinning as fast as the disk fails.
PAUSE_AFTER_FAILED_ROUND = 1.0
# An assign frame's jobs' args, in bytes, before the next job opens another frame (a job
# larger than that goes in a frame of its own); and a job copy's size beyond its args.
ASSIGN_BYTES = 1 << 20
COPY_OVERHEAD = 300


class Reservations:
    settings: ServerSettings
    scheduler: Scheduler
    registry: Registry
    stopping: bool
    observe: Observer
    standing: Standing
    _ticket: Callable[[str, Any], int]
    _recover: Callable[..., list[Effect]]  # (jobs, ending, message, now, *, death)
    _assigned: Callable[..., None]  # (connection, jobs): Lines
    _take_backs: Callable[[Instant], list[Effect]]  # (Lines)
    _unanswered: Callable[[dict[str, Any]], list[Effect]]  # (Pulls)
    _leased: Callable[..., list[Effect]]  # (connection, jobs, now): Pulls
    _deliveries: Callable[..., list[Effect] | None]  # (connection, jobs, now): Endpoints
    _endpoint_queues: Callable[[], None]  # (Endpoints)
    endpoints: dict[str, Any]  # (Endpoints)
    _paused_until = 0.0  # monotonic: no round before it (a failed round's pause)

    def dispatch(self, now: Instant) -> list[Effect]:
        """A scheduling round: reserve what the workers can take, in memory now, and
        send the assigns (one per worker) once the reservations are committed. None once
        a shutdown has begun: a job reserved then would be assigned on a connection about
        to close, and wait out a reclaim after the restart instead of simply waiting."""
        if self.stopping or now.mono < self._paused_until:
            return []  # (after a pause, ``resume_rounds`` wakes the dispatch)
        if not self.standing.may_hand_out(now.mono):
            # Its lease may lapse before a reservation made now would be used: another
            # server could then recover the job and give it out a second time. The next
            # renewal wakes the dispatch (``lease_renewed``).
            if self.standing.handing_out:
                self.standing.handing_out = False
                log.warning("cluster: this server's lease has %.1fs left and is not renewed"
                            " yet: it hands out no new work until it is",
                            self.standing.left(now.mono))
            return []
        if self.endpoints:
            self._endpoint_queues()  # (rota/core/endpoints.py)
        plan = self.scheduler.plan(now.mono)
        # A limit parked jobs until a time: the timer must fire then (rota/core/flow.py).
        deadline = self.scheduler.flow_deadline()
        armed: list[Effect] = [] if deadline is None else [Arm(deadline)]
        # Workers the round left with free slots have nothing ready they may run: jobs
        # waiting in other workers' lines may come back for them (rota/core/lines.py).
        taken = self._take_backs(now)
        if not plan:
            return taken + armed
        jobs = [job for batch in plan.values() for job in batch if isinstance(job, JobRecord)]
        claims = [claim for batch in plan.values() for claim in batch
                  if isinstance(claim, Claim)]
        for job in jobs:
            job.lease_expires_at = now.wall_of(job.lease or now.mono)
        ticket = self._ticket("reserve", (plan, jobs, claims, now))
        reserve = Reserve(jobs, now.wall, ticket, claims, self.scheduler.visibility_timeout,
                          self.scheduler.min_lease)
        if self.scheduler.limiter.held:  # the limits each counts against, for the store
            for ident in [*(job.id for job in jobs), *(claim.seq for claim in claims)]:
                guards = self.scheduler.guards(ident)
                if guards:
                    reserve.guards[ident] = guards
        effects: list[Effect] = [*taken, reserve, *armed]
        # A claimed job's lease is known once its row is read: armed then.
        return effects + ([Arm(min(j.lease or 0.0 for j in jobs))] if jobs else [])

    def _reserve_committed(self, payload: Any, error: BaseException | None,
                           outcome: Reserved, now: Instant) -> list[Effect]:
        plan, jobs, claims, at = payload
        read = outcome.read
        if error is not None:
            log.log(failure_level(error), "reservation commit failed; returning %d jobs: %s",
                    len(jobs) + len(claims), error)
            for job in jobs:
                if job.state == JobState.ACTIVE:
                    self.scheduler.unreserve(job)
            for claim in claims:
                self.scheduler.unclaim(claim)
            self._paused_until = now.mono + PAUSE_AFTER_FAILED_ROUND
            return self._unanswered(plan)  # (a pull worker's request waits for an assign)
        effects: list[Effect] = []
        if outcome.refused:
            effects += self._refused_by_guard(jobs, claims, outcome.refused, outcome.full,
                                              now)
        for job in jobs:
            if job.id in outcome.lost:
                effects += self._lost_race(job)
        got: dict[int, JobRecord] = {}  # claim's seq -> the job its worker holds now
        for claim, job in zip(claims, read, strict=True):
            if claim.seq in outcome.refused:
                continue  # back in its bucket already
            if job is not None:
                job.clocks(at)  # its lease, from the lease_expires_at the store wrote
            if self.scheduler.claimed(claim, job):
                assert job is not None
                got[claim.seq] = job
                effects.append(Arm(job.lease or 0.0))
            elif job is not None:  # its worker left while the row was read: as it would
                effects += self._lost_claim(job, now)  # have, had the job been in memory
            else:
                effects.append(Wake())  # cancelled meanwhile: its slot is free again
        if self.scheduler.limiter.held:  # the rates' starts are made now (limits.Window)
            for ident in [*(j.id for j in jobs if j.id not in outcome.refused
                            and j.id not in outcome.lost), *(j.id for j in got.values())]:
                self.scheduler.made(ident, now.mono)
        for worker_id, batch in plan.items():
            connection = self.registry.get(worker_id)
            # A job taken back meanwhile (the worker left) is no longer this worker's.
            held = [got.get(j.seq) if isinstance(j, Claim) else j for j in batch]
            # (A job whose key was known twice, claimed twice in this round, went once.)
            live = list({j.id: j for j in held if j is not None and j.worker_id == worker_id
                         and j.state == JobState.ACTIVE and not j.orphaned}.values())
            if connection is None or not (live or connection.conn < 0):  # a pull: always
                continue
            copies: list[p.JobCopy] = []
            size = 0
            log_lines(log, logging.INFO, "assign job=%s spec=%s@%s queue=%s worker=%s"
                      " attempt=%d%s", [(job.id, job.spec, short(job.checksum), job.queue,
                                         worker_id, job.attempt, job.budget())
                                        for job in live])
            # Its start is now, its assign's moment, as its rate's window has it.
            for job in live:
                job.reserved_at = now.wall
            self._assigned(connection, live)
            effects += self._leased(connection, live, now)  # (rota/core/pulls.py)
            self.observe.assigned(live, worker_id, now.wall)
            delivered = self._deliveries(connection, live, now)  # (rota/core/endpoints.py)
            if delivered is not None:
                effects += delivered
                continue
            for job in live:
                # Frames of about ASSIGN_BYTES at most: a round for a worker with a long
                # line of large jobs would otherwise be one frame of many megabytes, built
                # whole in memory and past what most WebSocket clients accept by default.
                if copies and size + len(job.args) > ASSIGN_BYTES and connection.conn > 0:
                    effects.append(Send(connection.conn, p.encode(p.Assign(jobs=copies))))
                    copies, size = [], 0
                size += len(job.args) + COPY_OVERHEAD
                copies.append(p.JobCopy(
                    id=job.id, spec=job.spec, checksum=job.checksum or UNVERSIONED, queue=job.queue,
                    args=job.args, attempt=job.attempt, priority=job.priority,
                    visibility_timeout=self.scheduler.lease_for(job),
                    enqueued_at=p.rfc3339(job.enqueued_at), capture_logs=job.capture_logs,
                    workflow_id=job.workflow_id, parent_results=job.parent_results))
            effects.append(Send(connection.conn, p.encode(p.Assign(jobs=copies))))
        return effects

    def _refused_by_guard(self, jobs: list[JobRecord], claims: list[Claim],
                          refused: frozenset[str | int],
                          full: frozenset[tuple[str, str | None]], now: Instant) -> list[Effect]:
        """Jobs the store's guard turned away: a limit they count against is full with
        other servers' reservations. They wait again, as they were (no attempt used),
        and the limits found full are held off until a release or a short while; their
        workers' slots are free for other keys at once (a round)."""
        taken: list[JobRecord | Claim] = [j for j in jobs if j.id in refused and j.state
                                          == JobState.ACTIVE]
        taken += [c for c in claims if c.seq in refused]
        if not taken:
            return []
        log_lines(log, logging.INFO, "limit held elsewhere %s spec=%s queue=%s key=%s worker=%s:"
                  " not reserved, it waits", [
                      (f"job={t.id}" if isinstance(t, JobRecord) else f"row={t.seq}", t.spec,
                       t.queue, t.concurrency_key, t.worker_id if isinstance(t, JobRecord)
                       else t.worker.id) for t in taken])
        until = max(self.scheduler.refuse(t, now.mono, full) for t in taken)
        return [Arm(until), Wake()]

    def resume_rounds(self, now: Instant) -> list[Effect]:
        """From ``tick``: a scheduling round once a failed round's pause is over."""
        if not self._paused_until or now.mono < self._paused_until:
            return []
        self._paused_until = 0.0
        return [Wake()]

    def _lost_race(self, job: JobRecord) -> list[Effect]:
        """A whole job whose row had moved on when its reservation was written: another
        server reserved, cancelled or finished it first (each server holds the jobs that
        wait; the row decides). This copy is stale: forget it, and the worker has the
        slot back. Its assign is never sent."""
        log.info("lost race job=%s spec=%s queue=%s worker=%s attempt=%d: its row moved on"
                 " (another server holds it)", job.id, job.spec, job.queue, job.worker_id,
                 job.attempt)
        self.scheduler.let_go(job)
        return [Wake()]

    def _lost_claim(self, job: JobRecord, now: Instant) -> list[Effect]:
        """A claimed job reserved for a worker that left before the row was read: what
        its disconnect would have done with it (it was never sent, so it is no death)."""
        if self.stopping:
            self.scheduler.orphan(job, now.mono + self.settings.heartbeat_timeout)
            return []
        return self._recover([job], "worker_death", f"worker {job.worker_id} is gone"
                             " (before its assign was sent)", now, death=False)
