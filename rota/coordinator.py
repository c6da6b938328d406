"""The server's core: registrations, heartbeats, results, timers, enqueues, dispatch.

It owns the store and the scheduler and never touches a socket: a worker's
connection is an ``Outbox`` it sends frames to. Every transition is committed
through the store before anyone acts on it: an ``assign`` frame, an ``ack`` that
accepts a result and an HTTP answer all wait for the COMMIT, and because the single
writer commits in order, a job made available in memory is never handed out before
the write that made it available.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import random
import time
from collections.abc import Awaitable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from rota import protocol as p
from rota.auth import OPEN, Principal, Tokens
from rota.errors import RequestError
from rota.jobs import EnqueueRequest, error_record, new_job, same_job
from rota.policy import TERMINAL_STATES, WAITING_STATES, Ending, after_attempt
from rota.scheduler import Scheduler, WorkerSlot
from rota.settings import ServerSettings
from rota.specs import JobSpec, SpecError, checksum, validate_args
from rota.store import Change, Job, SpecChange, StatusNote, Store, job_from_row

log = logging.getLogger("rota.server")
# Error types a worker may report that say the attempt ended for an outside reason, not
# because the job failed: they do not count toward max_fails and do not back off.
OUTSIDE_ENDINGS: dict[str, Ending] = {"visibility_timeout": "visibility_timeout",
                                      "shutdown": "shutdown", "cancelled": "cancelled"}
# Disconnects the worker did not choose and may recover from: its jobs stay reserved for
# reconnect_grace, so that a worker whose network blinked takes them back on reconnect.
# After any other (it closed, said goodbye, went silent, broke the protocol) they go
# back at once.
MAY_RECONNECT = frozenset({"connection_lost", "superseded", "internal_error"})
MAX_LOG_LINES = 1000  # captured log lines kept per job (per server run); later ones dropped
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}


class Outbox(Protocol):
    """What the coordinator needs of a worker's connection."""

    def send(self, frame: str | Awaitable[str]) -> None: ...

    def abort(self, code: str, message: str, close_code: int) -> None: ...


@dataclass(slots=True)
class Connection:
    worker: WorkerSlot
    outbox: Outbox
    registration: p.Registration
    connected_at: float
    last_seen: float  # monotonic
    reported: list[str] = field(default_factory=list)  # last active_job_ids
    cpu_percent: float | None = None  # the worker process's, as it last said
    memory_rss: int | None = None
    directive: str | None = None  # the state the server wants; None: whatever the worker says
    checked: bool = False  # its first status was checked for runs it no longer holds
    principal: Principal = OPEN  # the token it connected with
    alerts: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=20))  # the latest, for GET /workers


def short(checksum_: str | None) -> str:
    return (checksum_ or "none")[:15]


class Coordinator:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.store = Store(settings.db,
                           crash_before_commit=settings.crash_at == "enqueue-before-commit")
        self.scheduler = Scheduler(settings.visibility_timeout)
        self.specs: dict[str, JobSpec] = {}
        self.connections: dict[str, Connection] = {}
        self._wake = asyncio.Event()
        self._timers = asyncio.Event()
        self._timers_wake_at = 0.0  # when the timer loop will next look, unless poked
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._no_connections = asyncio.Event()
        self._no_connections.set()
        self._random = random.Random()
        self._stopping = False
        self.started_at = time.time()
        self.tokens = Tokens()
        self.sockets: collections.Counter[str | None] = collections.Counter()  # per token id
        self._token_rows: list[dict[str, Any]] = []

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        snapshot = await asyncio.to_thread(self.store.load)
        self.store.start(asyncio.get_running_loop())
        await self._refresh_tokens()
        if not self.tokens.required:
            log.warning("AUTH IS OFF: no tokens exist, so anyone who can reach this server may"
                        " take jobs and give orders. Create one: rota tokens create --scope admin")
        self.specs = snapshot.status_quo
        self.scheduler.status_quo = dict(snapshot.checksums)
        grace = time.time() + self.settings.heartbeat_timeout
        orphans = 0
        for job in snapshot.jobs:
            self.scheduler.track(job)
            if job.state == "active":
                # Its worker may come back: it has heartbeat_timeout to reclaim the job.
                self.scheduler.orphan(job, grace)
                orphans += 1
        if orphans:
            log.warning("recovery active_jobs=%d wait=%.1fs for their workers to reclaim them",
                        orphans, self.settings.heartbeat_timeout)
        log.info("store db=%s specs=%d live_jobs=%d", self.settings.db, len(self.specs),
                 len(snapshot.jobs))
        self.spawn(self._dispatch_loop(), "rota-dispatch")
        self.spawn(self._reap_loop(), "rota-reaper")
        self.spawn(self._timer_loop(), "rota-timers")
        self.spawn(self._token_loop(), "rota-tokens")

    def begin_shutdown(self) -> None:
        """From here on, a closing connection keeps its jobs reserved: after the restart
        its worker reconnects and reclaims them, instead of each losing an attempt."""
        if not self._stopping:
            self._stopping = True
            log.info("shutting down: running jobs stay reserved for their workers to reclaim")

    async def stop(self) -> None:
        self.begin_shutdown()
        for conn in list(self.connections.values()):
            conn.outbox.abort("shutting_down", "server is shutting down", p.CLOSE_GOING_AWAY)
        try:  # let sessions run their disconnect path so its writes are queued
            await asyncio.wait_for(self._no_connections.wait(), timeout=2.0)
        except TimeoutError:
            log.warning("shutdown: %d connection(s) did not close", len(self.connections))
        for task in list(self._tasks):
            if task.get_name() in ("rota-dispatch", "rota-reaper", "rota-timers", "rota-tokens"):
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self.store.close)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    def kick(self) -> None:
        self._wake.set()

    def crash_point(self, name: str) -> None:
        """Test switch (--crash-at): die here as kill -9 would."""
        if self.settings.crash_at == name:
            log.critical("crash point %s: exiting now", name)
            os._exit(86)

    # -- tokens ------------------------------------------------------------------------
    async def _token_loop(self) -> None:
        """Tokens are created and revoked from the CLI, straight into the file: look every
        heartbeat interval, so that a revoked worker is gone within one."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            await self._refresh_tokens()

    async def _refresh_tokens(self) -> None:
        rows = await self.store.live_tokens()
        if rows == self._token_rows:
            return
        was_required = self.tokens.required
        self._token_rows, self.tokens = rows, Tokens(rows)
        log.info("tokens live=%d auth=%s", len(rows), "on" if self.tokens.required else "off")
        if was_required and not self.tokens.required:
            log.warning("AUTH IS OFF: the last token was revoked")
        for conn in list(self.connections.values()):
            if not self.tokens.valid(conn.principal):
                log.warning("token revoked worker=%s token=%s: closing its connection",
                            conn.worker.id, conn.principal.token_id or "none")
                conn.outbox.abort("token_revoked", "the token this worker connected with is"
                                  " no longer valid", p.CLOSE_POLICY)

    # -- workers ---------------------------------------------------------------------
    async def register(self, hb: p.Heartbeat, outbox: Outbox, principal: Principal = OPEN) -> str:
        reg = hb.registration
        assert reg is not None
        refused = [q for q in reg.queues if not principal.may_use_queue(q)]
        if refused:
            raise p.FrameError("queue_not_allowed", f"this token may not serve queue(s)"
                               f" {', '.join(refused)}", p.CLOSE_POLICY)
        names = [ref.name for ref in reg.specs]
        if len(set(names)) != len(names):
            raise p.FrameError("invalid_message", "a spec is declared twice in the registration",
                               p.CLOSE_INVALID_PAYLOAD)
        self._take_over_or_refuse(hb.worker_id, reg)
        verdict = self._judge_specs(hb.worker_id, reg.specs)
        now = time.time()
        await self.store.worker_connected({
            "id": hb.worker_id, "hostname": reg.hostname, "pid": reg.pid,
            "queues": msgspec.json.encode(reg.queues).decode(),
            "labels": msgspec.json.encode(reg.labels).decode(),
            "concurrency": reg.concurrency,
            "specs": msgspec.json.encode(reg.specs).decode(),
            "connected_at": now, "disconnected_at": None,
        })
        self._take_over_or_refuse(hb.worker_id, reg)  # it may have come while we committed
        slot = WorkerSlot(id=hb.worker_id, queues=list(reg.queues), concurrency=reg.concurrency,
                          specs={s.name: s.checksum for s in reg.specs}, labels=list(reg.labels))
        self.scheduler.add_worker(slot)
        self.connections[slot.id] = Connection(slot, outbox, reg, now, time.monotonic(),
                                               principal=principal)
        self._no_connections.clear()
        log.info("register worker=%s host=%s pid=%d queues=%s concurrency=%d specs_ok=%d"
                 " specs_rejected=%d", slot.id, reg.hostname, reg.pid, ",".join(reg.queues),
                 reg.concurrency, len(verdict.accepted), len(verdict.rejected))
        return p.encode(p.Welcome(
            worker_id=slot.id, server_time=p.rfc3339(now),
            heartbeat_interval=self.settings.heartbeat_interval,
            heartbeat_timeout=self.settings.heartbeat_timeout,
            visibility_timeout=self.settings.visibility_timeout, specs=verdict,
        ))

    def _take_over_or_refuse(self, worker_id: str, reg: p.Registration) -> None:
        """A second connection under a connected worker id is refused, unless it comes from
        the same process (hostname, pid and started_at): then the old connection is dead
        but not yet noticed (half-open), and the new one replaces it at once."""
        old = self.connections.get(worker_id)
        if old is None:
            return
        was = old.registration
        if reg.started_at is None or (was.hostname, was.pid, was.started_at) != (
                reg.hostname, reg.pid, reg.started_at):
            raise p.FrameError("worker_id_in_use", f"worker {worker_id} is already connected",
                               p.CLOSE_POLICY)
        old.outbox.abort("superseded", "the worker reconnected on a new connection",
                         p.CLOSE_POLICY)
        self.disconnect(worker_id, "superseded")

    def _judge_specs(self, worker_id: str, declared: list[p.SpecRef]) -> p.SpecVerdict:
        accepted: list[str] = []
        rejected: list[p.SpecRejection] = []
        for ref in declared:
            expected = self.scheduler.status_quo.get(ref.name)
            if expected == ref.checksum:
                accepted.append(ref.name)
                continue
            reason = "spec has no status quo" if expected is None else "checksum differs from the status quo"
            rejected.append(p.SpecRejection(name=ref.name, checksum=ref.checksum,
                                            expected=expected, reason=reason))
            log.warning("spec mismatch worker=%s spec=%s checksum=%s status_quo=%s",
                        worker_id, ref.name, short(ref.checksum), short(expected))
        return p.SpecVerdict(accepted=accepted, rejected=rejected)

    def touch(self, worker_id: str) -> None:
        conn = self.connections.get(worker_id)
        if conn is not None:
            conn.last_seen = time.monotonic()

    def disconnect(self, worker_id: str, reason: str, outbox: Outbox | None = None) -> None:
        """Forget a worker's connection (only ``outbox``'s, if given: a newer connection
        of the same worker may have replaced it) and decide what becomes of its jobs."""
        conn = self.connections.get(worker_id)
        if conn is None or (outbox is not None and conn.outbox is not outbox):
            return
        del self.connections[worker_id]
        if not self.connections:
            self._no_connections.set()
        held = self.scheduler.remove_worker(worker_id, conn.reported)
        if self._stopping:
            log.info("disconnect worker=%s reason=%s jobs_kept_for_reclaim=%d", worker_id,
                     reason, len(held))
        elif reason not in MAY_RECONNECT or not held:
            log.info("disconnect worker=%s reason=%s jobs_recovered=%d", worker_id, reason,
                     len(held))
            self._recover(held, "worker_death", f"worker {worker_id} is gone ({reason})")
        else:
            grace = self.settings.reconnect_grace
            until = time.time() + grace
            for job in held:
                self.scheduler.orphan(job, until)
            self._arm(until)
            log.warning("disconnect worker=%s reason=%s jobs_held_for_reconnect=%d grace=%gs",
                        worker_id, reason, len(held), grace)
        self.spawn(self.store.worker_disconnected(worker_id, conn.connected_at, time.time()),
                   f"rota-disconnect-{worker_id}")

    def direct(self, worker_ids: Iterable[str], state: str) -> list[str]:
        """Ask workers to go quiet or terminate; returns those that were asked.

        A worker never goes back from terminate, and running is its own decision (SIGCONT),
        so the only directions are forward."""
        directed = []
        for worker_id in worker_ids:
            conn = self.connections.get(worker_id)
            if conn is None or p.STATE_RANK[conn.worker.state] >= p.STATE_RANK[state]:
                continue
            conn.directive = state
            conn.worker.state = state  # no new jobs from this moment
            directed.append(worker_id)
            log.info("state change worker=%s state=%s by=server", worker_id, state)
        return directed

    def select_workers(self, *, label: str | None = None, every: bool = False) -> list[str]:
        """Connected workers with ``label``, or all of them."""
        if every:
            return sorted(self.connections)
        return sorted(w for w, c in self.connections.items() if label in c.worker.labels)

    # -- heartbeats and results -------------------------------------------------------
    def heartbeat(self, worker_id: str, hb: p.Heartbeat) -> str | Awaitable[str]:
        """Apply a heartbeat; return its ack, or an awaitable one if results must commit first."""
        conn = self.connections[worker_id]
        worker = conn.worker
        now = time.time()
        # Jobs it held before a restart or a lost connection, still running or finished:
        # it reclaims them by naming them, in whichever heartbeat it does so.
        if self.scheduler.has_orphans:
            self._reclaim(conn, hb, now)
        if hb.status is not None and not conn.checked:
            self._stop_lost_runs(conn, hb.status.active_job_ids)
        if hb.status is not None:
            reported = hb.status.state
            if conn.directive and p.STATE_RANK[reported] >= p.STATE_RANK[conn.directive]:
                conn.directive = None  # the worker got there: the directive is done
            # Until it does, schedule by the stricter of what it says and what we asked.
            worker.state = conn.directive or reported
            conn.reported = hb.status.active_job_ids
            if hb.status.cpu_percent is not None:
                conn.cpu_percent = hb.status.cpu_percent
            if hb.status.memory_rss is not None:
                conn.memory_rss = hb.status.memory_rss
            self.scheduler.renew(worker, hb.status.active_job_ids, now)
            if hb.status.progress or hb.status.logs or hb.status.alerts:
                self._note_status(conn, hb.status, now)
        if hb.capacity is not None:
            worker.capacity = hb.capacity
        accepted, rejected, changes = self._take_results(worker, hb.results)
        desired = conn.directive or worker.state
        if not changes:
            if worker.free() > 0:
                self.kick()
            return self._ack(hb.seq, desired, accepted, rejected)
        return self.spawn(self._commit_results(hb.seq, desired, worker_id, changes, rejected),
                          f"rota-results-{worker_id}-{hb.seq}")

    def _reclaim(self, conn: Connection, hb: p.Heartbeat, now: float) -> None:
        named = hb.status.active_job_ids if hb.status is not None else []
        adopted = self.scheduler.adopt(conn.worker, [*named, *(r.job_id for r in hb.results)], now)
        for job in adopted:
            log.info("reclaim job=%s spec=%s@%s queue=%s worker=%s attempt=%d", job.id, job.spec,
                     short(job.checksum), job.queue, conn.worker.id, job.attempt)
            if job.cancel_requested:  # asked for while its worker was away
                conn.outbox.send(p.encode(p.Cancel(job_ids=[job.id], reason="cancelled")))

    def _stop_lost_runs(self, conn: Connection, named: list[str]) -> None:
        """The first status after a (re)connect: jobs the worker says it runs but no longer
        holds (recovered while it was away, maybe running elsewhere) are wasted work at
        best and a duplicate side effect at worst: tell it to stop them."""
        conn.checked = True
        jobs = self.scheduler.jobs
        lost = [job_id for job_id in named
                if (job := jobs.get(job_id)) is None or job.worker_id != conn.worker.id
                or job.state != "active" or job.orphaned]
        if lost:
            log.warning("reservation lost worker=%s jobs=%s: recovered while it was away",
                        conn.worker.id, ",".join(lost))
            conn.outbox.send(p.encode(p.Cancel(job_ids=lost, reason="reservation_lost")))

    def _note_status(self, conn: Connection, status: p.Status, now: float) -> None:
        """Keep progress and captured lines of jobs this worker holds; log alerts. Stored in
        the background: losing a progress figure in a crash costs no job anything."""
        notes: list[StatusNote] = []
        for item in status.progress:
            if (job := self._held_by(conn, item.job_id)) is not None:
                notes.append(StatusNote(job.id, job.attempt, now, progress=(
                    item.percent, None if item.message is None else p.cut_text(item.message))))
        for line in status.logs:
            job = self._held_by(conn, line.job_id)
            if job is not None and job.capture_logs and job.log_lines < MAX_LOG_LINES:
                job.log_lines += 1
                notes.append(StatusNote(job.id, job.attempt, now,
                                        line=("log", line.level, p.cut_text(line.message))))
        for alert in status.alerts:
            job = self._held_by(conn, alert.job_id) if alert.job_id else None
            # %r: the worker's text is quoted and escaped, so it cannot forge log lines
            log.log(LEVELS[alert.level], "alert worker=%s job=%s level=%s message=%r",
                    conn.worker.id, alert.job_id or "-", alert.level, alert.message[:200])
            conn.alerts.append({"at": p.rfc3339(now), "level": alert.level,
                                "job_id": alert.job_id, "message": p.cut_text(alert.message)})
            if job is not None:
                notes.append(StatusNote(job.id, job.attempt, now,
                                        line=("alert", alert.level, p.cut_text(alert.message))))
        if notes:
            self.spawn(self.store.note_status(notes), "rota-status")

    def _held_by(self, conn: Connection, job_id: str) -> Job | None:
        job = self.scheduler.jobs.get(job_id)
        if job is None or job.worker_id != conn.worker.id or job.state != "active":
            return None
        return job

    def _take_results(self, worker: WorkerSlot, results: list[p.Result]
                      ) -> tuple[list[str], list[p.ResultRejection], list[Change]]:
        accepted: list[str] = []
        rejected: list[p.ResultRejection] = []
        changes: list[Change] = []
        now = time.time()
        for result in results:
            reason = self._result_problem(worker, result)
            if reason is not None:
                rejected.append(p.ResultRejection(job_id=result.job_id, attempt=result.attempt,
                                                  reason=reason))
                log.warning("result rejected job=%s worker=%s attempt=%d reason=%s",
                            result.job_id, worker.id, result.attempt, reason)
                continue
            job = self.scheduler.jobs[result.job_id]
            before = (job.fails, job.run_at)  # to put back if the commit fails
            accepted.append(job.id)
            changes.append(self._settle(job, result, now))
            changes[-1].undo = before
        return accepted, rejected, changes

    def _result_problem(self, worker: WorkerSlot, result: p.Result) -> str | None:
        job = self.scheduler.jobs.get(result.job_id)
        if job is None or job.state in TERMINAL_STATES:  # (or its result is being stored)
            return "unknown job, or it already finished"
        if job.worker_id != worker.id or job.state != "active" or job.orphaned:
            return "job is not reserved by this worker"
        if job.attempt != result.attempt:
            return f"attempt {result.attempt} is not the current attempt {job.attempt}"
        return None

    def _settle(self, job: Job, result: p.Result, now: float) -> Change:
        """Decide an accepted result's outcome; the job stays put in memory until commit."""
        if result.outcome == "completed":
            encoded = msgspec.json.encode(result.result)
            limit = self.settings.max_result_bytes
            if len(encoded) <= limit:
                job.state = "completed"
                return Change(job, result=encoded, finished_at=now)
            # Running it again would only make the same result: fail it for good.
            result = p.Result(job_id=job.id, attempt=result.attempt, outcome="failed",
                              error=p.ErrorInfo(type="result_too_large", retryable=False,
                                                message=f"the result is {len(encoded)} bytes as"
                                                f" JSON; the limit (max_result_bytes) is {limit}"))
        error = result.error or p.ErrorInfo(type="error", message="the worker gave no error")
        return self._end_attempt(job, OUTSIDE_ENDINGS.get(error.type, "failed"), error, now)

    def _end_attempt(self, job: Job, ending: Ending, error: p.ErrorInfo, now: float) -> Change:
        """Apply the retry policy to an attempt that did not complete."""
        if ending == "failed":
            job.fails += 1
        decision = after_attempt(
            ending=ending, retryable=error.retryable, attempts_used=job.attempt - job.budget_start,
            fails=job.fails, limits=job.limits, expires_at=job.expires_at,
            cancel_requested=job.cancel_requested, now=now, rand=self._random.random())
        record = error_record(error, attempt=job.attempt, worker_id=job.worker_id, now=now)
        job.state = decision.state
        job.run_at = decision.run_at
        log.info("attempt ended job=%s spec=%s@%s queue=%s worker=%s attempt=%d ending=%s"
                 " next=%s%s", job.id, job.spec, short(job.checksum), job.queue, job.worker_id,
                 job.attempt, ending, decision.state,
                 f" reason={decision.reason!r}" if decision.reason else "")
        terminal = decision.state in TERMINAL_STATES
        return Change(job, error=record, finished_at=now if terminal else None)

    def _place(self, job: Job) -> None:
        """Put a job where its (committed) state says it belongs."""
        if job.state in TERMINAL_STATES:
            self.scheduler.finish(job)
            self._wake_waiters(job.id)
        elif job.state == "available":
            self.scheduler.add(job)
        else:  # scheduled or retryable
            self.scheduler.defer(job, job.run_at or time.time())
            self._arm(job.run_at)

    async def _commit_results(self, seq: int, desired: str, worker_id: str,
                              changes: list[Change], rejected: list[p.ResultRejection]) -> str:
        try:
            await self.store.save(changes)
        except Exception as exc:
            # Nothing was stored: the jobs stay reserved, and the worker hears that it may
            # report them again rather than believing they were recorded.
            log.exception("storing %d result(s) from worker=%s failed", len(changes), worker_id)
            for change in changes:
                change.job.state = "active"
                change.job.fails, change.job.run_at = change.undo or (change.job.fails, None)
                rejected.append(p.ResultRejection(
                    job_id=change.job.id, attempt=change.job.attempt,
                    reason=f"could not be stored ({exc}); report it again"))
            return self._ack(seq, desired, [], rejected)
        self.crash_point("result-after-commit")
        for change in changes:
            if change.job.state == "completed":
                log.info("result job=%s spec=%s@%s queue=%s worker=%s attempt=%d outcome=completed",
                         change.job.id, change.job.spec, short(change.job.checksum),
                         change.job.queue, worker_id, change.job.attempt)
            self._place(change.job)
        self.kick()
        return self._ack(seq, desired, [c.job.id for c in changes], rejected)

    def _ack(self, seq: int, state: str, accepted: list[str],
             rejected: list[p.ResultRejection]) -> str:
        return p.encode(p.Ack(seq=seq, state=state,  # type: ignore[arg-type]
                              server_time=p.rfc3339(time.time()),
                              accepted=accepted, rejected=rejected))

    # -- recovery and timers ------------------------------------------------------------
    def _recover(self, jobs: Iterable[Job], ending: Ending, message: str) -> None:
        """Attempts that ended without a result: retry or discard them, record why."""
        now = time.time()
        changes = [self._end_attempt(job, ending, p.ErrorInfo(type=ending, message=message), now)
                   for job in jobs]
        for change in changes:
            # Safe before the commit: the writer commits in order, so any reservation of
            # this job is written after this change.
            if change.job.state not in TERMINAL_STATES:
                self._place(change.job)
            else:
                self.scheduler.finish(change.job)
        if changes:
            self.spawn(self._save_then_wake(changes), "rota-recover")
            self.kick()

    async def _save_then_wake(self, changes: list[Change]) -> None:
        await self.store.save(changes)
        for change in changes:
            if change.job.state in TERMINAL_STATES:
                self._wake_waiters(change.job.id)

    def _arm(self, deadline: float | None) -> None:
        """Wake the timer loop early if ``deadline`` comes before it would look anyway."""
        if deadline is not None and deadline < self._timers_wake_at:
            self._timers.set()

    async def _timer_loop(self) -> None:
        while True:
            deadline = self.scheduler.next_deadline()
            wait = 1.0 if deadline is None else min(1.0, max(0.0, deadline - time.time()))
            self._timers_wake_at = time.time() + wait
            try:
                await asyncio.wait_for(self._timers.wait(), wait)
            except TimeoutError:
                pass
            self._timers.clear()
            self._fire_timers(time.time())

    def _fire_timers(self, now: float) -> None:
        due = self.scheduler.due(now)
        if due:
            self.spawn(self.store.save([Change(job) for job in due]), "rota-due")
            self.kick()
        for job in self.scheduler.expired_leases(now):
            self._lease_lapsed(job)
        expired = self.scheduler.expired_ttls(now)
        if expired:
            self._expire(expired, now)

    def _lease_lapsed(self, job: Job) -> None:
        holder = job.worker_id or ""
        if job.orphaned:
            self.scheduler.orphans -= 1
            job.orphaned = False
            self._recover([job], "worker_death", f"worker {holder} did not reconnect in time")
            return
        conn = self.connections.get(holder)
        if conn is not None:  # stop the stale run, so it does not race the retry
            conn.outbox.send(p.encode(p.Cancel(job_ids=[job.id], reason="visibility_timeout")))
        lease = self.scheduler.lease_for(job)
        self._recover([job], "visibility_timeout", f"no result or heartbeat for {lease:g}s")

    def _expire(self, jobs: list[Job], now: float) -> None:
        changes = []
        for job in jobs:
            job.state = "discarded"
            record = error_record(p.ErrorInfo(type="expired", message="its time to live ran out",
                                              retryable=False),
                                  attempt=job.attempt, worker_id=None, now=now)
            changes.append(Change(job, error=record, finished_at=now))
            self.scheduler.finish(job)
            log.info("expired job=%s spec=%s queue=%s", job.id, job.spec, job.queue)
        self.spawn(self._save_then_wake(changes), "rota-expire")

    # -- dispatch --------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            plan = self.scheduler.plan(time.time())
            if plan:
                self._arm(min(j.lease_expires_at or 0.0 for b in plan.values() for j in b))
                self.spawn(self._commit_and_assign(plan), "rota-assign")

    async def _commit_and_assign(self, plan: dict[str, list[Job]]) -> None:
        jobs = [job for batch in plan.values() for job in batch]
        try:
            await self.store.reserve(jobs, time.time())
        except Exception:
            log.exception("reservation commit failed; returning %d jobs", len(jobs))
            for job in jobs:
                if job.state == "active":
                    job.attempt -= 1
                    self.scheduler.release(job)
            self.kick()
            return
        self.crash_point("reserve-after-commit")
        for worker_id, batch in plan.items():
            self._send_assign(worker_id, batch)

    def _send_assign(self, worker_id: str, batch: list[Job]) -> None:
        conn = self.connections.get(worker_id)
        # A job taken back meanwhile (the worker left) is no longer this worker's.
        live = [j for j in batch
                if j.worker_id == worker_id and j.state == "active" and not j.orphaned]
        if conn is None or not live:
            return
        copies = []
        for job in live:
            log.info("assign job=%s spec=%s@%s queue=%s worker=%s attempt=%d",
                     job.id, job.spec, short(job.checksum), job.queue, worker_id, job.attempt)
            copies.append(p.JobCopy(
                id=job.id, spec=job.spec, checksum=job.checksum or "", queue=job.queue,
                args=job.args, attempt=job.attempt, priority=job.priority,
                visibility_timeout=self.scheduler.lease_for(job),
                enqueued_at=p.rfc3339(job.enqueued_at), capture_logs=job.capture_logs))
        conn.outbox.send(p.encode(p.Assign(jobs=copies)))

    async def _reap_loop(self) -> None:
        """Drop workers that stopped beating; their sockets may still look open."""
        period = max(0.05, min(1.0, self.settings.heartbeat_timeout / 4))
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.settings.heartbeat_timeout
            for conn in list(self.connections.values()):
                if conn.last_seen < deadline:
                    log.warning("heartbeat timeout worker=%s silent_for=%.1fs", conn.worker.id,
                                time.monotonic() - conn.last_seen)
                    conn.outbox.abort("heartbeat_timeout",
                                      f"no heartbeat for {self.settings.heartbeat_timeout}s",
                                      p.CLOSE_POLICY)
                    self.disconnect(conn.worker.id, "heartbeat_timeout")

    # -- producers -------------------------------------------------------------------
    async def enqueue(self, requests: list[EnqueueRequest], principal: Principal = OPEN
                      ) -> list[tuple[dict[str, Any], bool] | RequestError]:
        """Store jobs in one transaction; per request the row and whether it is new, or why not."""
        now = time.time()
        built = [self._build(request, now, principal) for request in requests]
        jobs = [job for job in built if isinstance(job, Job)]
        stored = iter(await self.store.enqueue(jobs) if jobs else [])
        self.crash_point("enqueue-after-commit")
        outcomes: list[tuple[dict[str, Any], bool] | RequestError] = []
        for request, job in zip(requests, built, strict=True):
            if isinstance(job, RequestError):
                outcomes.append(job)
                continue
            row, created = next(stored)
            outcomes.append(self._accept(job, row, created, request))
        return outcomes

    def _build(self, request: EnqueueRequest, now: float, principal: Principal
               ) -> Job | RequestError:
        spec = self.specs.get(request.spec)
        if spec is None:
            return RequestError(422, "unknown_spec", f"spec {request.spec!r} has no status quo;"
                                " push it with 'rota specs push' first")
        queue = request.queue or spec.queue
        if not principal.may_use_queue(queue):
            return RequestError(403, "queue_not_allowed",
                                f"this token may not enqueue into queue {queue!r}")
        try:
            validate_args(spec, request.args)
            job = new_job(request, spec, now)
        except SpecError as exc:
            return RequestError(422, "invalid_args", str(exc))
        except RequestError as exc:
            return exc
        limit = self.settings.max_args_bytes
        if len(job.args) > limit:
            return RequestError(413, "args_too_large", f"args are {len(job.args)} bytes as JSON;"
                                f" the limit (max_args_bytes) is {limit}")
        job.created_by = principal.token_id
        return job

    def _accept(self, job: Job, row: dict[str, Any], created: bool, request: EnqueueRequest
                ) -> tuple[dict[str, Any], bool] | RequestError:
        if not created:
            if not same_job(row, job, request.args):
                return RequestError(409, "id_conflict", f"job {job.id} exists with a different"
                                    " spec, queue, priority or args")
            return row, False
        job.seq = row["rowid"]
        self.scheduler.track(job)
        log.info("enqueue job=%s spec=%s queue=%s priority=%d state=%s", job.id, job.spec,
                 job.queue, job.priority, job.state)
        self._arm(job.run_at)
        self._arm(job.expires_at)
        self.kick()
        return row, True

    async def cancel(self, job_id: str) -> tuple[dict[str, Any], bool]:
        """Cancel a job: at once if it waits, through its worker if it runs.
        Returns the stored job and whether it is cancelled already."""
        job = self.scheduler.jobs.get(job_id)
        if job is None or job.state not in WAITING_STATES | {"active"}:
            row = await self.store.get_job(job_id)
            if row is None:
                raise RequestError(404, "not_found", f"no job {job_id}")
            raise RequestError(409, "not_cancellable", f"job {job_id} is {row['state']}")
        if job.state == "active":
            job.cancel_requested = True
            await self.store.save([Change(job)])
            conn = self.connections.get(job.worker_id or "")
            if conn is not None:
                conn.outbox.send(p.encode(p.Cancel(job_ids=[job.id], reason="cancelled")))
            log.info("cancel requested job=%s worker=%s", job.id, job.worker_id)
            return await self._row(job_id), False
        job.state = "cancelled"
        self.scheduler.finish(job)
        await self.store.save([Change(job, finished_at=time.time())])
        self._wake_waiters(job.id)
        log.info("cancelled job=%s spec=%s queue=%s", job.id, job.spec, job.queue)
        return await self._row(job_id), True

    async def retry(self, job_id: str) -> dict[str, Any]:
        """Put a discarded or cancelled job back, with a fresh attempt budget."""
        row = await self.store.get_job(job_id)
        if row is None:
            raise RequestError(404, "not_found", f"no job {job_id}")
        if row["state"] not in ("discarded", "cancelled") or job_id in self.scheduler.jobs:
            raise RequestError(409, "not_retryable",
                               f"job {job_id} is {row['state']}; only discarded or cancelled"
                               " jobs can be retried")
        job = job_from_row(row)
        job.budget_start, job.fails, job.cancel_requested = job.attempt, 0, False
        job.expires_at = None
        self.scheduler.add(job)
        await self.store.save([Change(job)])
        log.info("retry job=%s spec=%s queue=%s", job.id, job.spec, job.queue)
        self.kick()
        return await self._row(job_id)

    async def _row(self, job_id: str) -> dict[str, Any]:
        row = await self.store.get_job(job_id)
        assert row is not None
        return row

    async def wait_for_result(self, job_id: str, timeout: float) -> dict[str, Any] | None:
        """The job's row as soon as it is terminal, or as it stands when ``timeout`` runs out."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, []).append(waiter)
        try:
            row = await self.store.get_job(job_id)
            if row is None or row["state"] in TERMINAL_STATES or timeout <= 0:
                return row
            try:
                await asyncio.wait_for(waiter, timeout)
            except TimeoutError:
                pass
            return await self.store.get_job(job_id)
        finally:
            waiters = self._waiters.get(job_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiters.pop(job_id, None)

    def _wake_waiters(self, job_id: str) -> None:
        for waiter in self._waiters.pop(job_id, []):
            if not waiter.done():
                waiter.set_result(None)

    # -- specs -----------------------------------------------------------------------
    async def push_specs(self, specs: list[JobSpec], *, dry_run: bool) -> list[dict[str, Any]]:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise RequestError(422, "duplicate_spec", "a spec name appears twice in the push")
        changes = await self.store.push_specs([(s, checksum(s)) for s in specs], dry_run=dry_run)
        if not dry_run:
            self._apply_status_quo(specs, changes)
        return [self._change_report(c) for c in changes]

    def _apply_status_quo(self, specs: list[JobSpec], changes: list[SpecChange]) -> None:
        by_name = {s.name: s for s in specs}
        for change in changes:
            if change.change == "unchanged":
                continue
            self.specs[change.name] = by_name[change.name]
            self.scheduler.status_quo[change.name] = change.checksum
            log.info("status quo spec=%s checksum=%s previous=%s", change.name,
                     short(change.checksum), short(change.previous))
            for worker_id in self.scheduler.mismatched_workers(change.name, change.checksum):
                declared = self.scheduler.workers[worker_id].specs[change.name]
                log.warning("spec mismatch worker=%s spec=%s checksum=%s status_quo=%s",
                            worker_id, change.name, short(declared), short(change.checksum))
        self.kick()  # queued jobs may now have (other) capable workers

    def _change_report(self, change: SpecChange) -> dict[str, Any]:
        mismatched = self.scheduler.mismatched_workers(change.name, change.checksum)
        matching = [w for w in self.scheduler.workers.values()
                    if w.specs.get(change.name) == change.checksum]
        return {"name": change.name, "change": change.change, "checksum": change.checksum,
                "previous": change.previous, "mismatched_workers": len(mismatched),
                "matching_workers": len(matching)}
