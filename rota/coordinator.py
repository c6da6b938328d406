"""The server's core: registrations, heartbeats, results, enqueues, spec pushes, dispatch.

It owns the store and the scheduler and never touches a socket: a worker's
connection is an ``Outbox`` it sends frames to. Every change is committed through
the store before anyone is told about it (an ``assign`` frame, an ``ack`` that
accepts a result, an HTTP answer to an enqueue).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from rota import protocol as p
from rota.ids import uuid7
from rota.scheduler import Scheduler, WorkerSlot
from rota.settings import ServerSettings
from rota.specs import JobSpec, Name, SpecError, checksum, validate_args
from rota.store import TERMINAL_STATES, Finish, Job, SpecChange, Store

log = logging.getLogger("rota.server")


class Outbox(Protocol):
    """What the coordinator needs of a worker's connection."""

    def send(self, frame: str | Awaitable[str]) -> None: ...

    def abort(self, code: str, message: str, close_code: int) -> None: ...


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class EnqueueRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    spec: str
    args: dict[str, Any] = {}
    id: str | None = None
    queue: Name | None = None
    priority: int | None = None


@dataclass(slots=True)
class Connection:
    worker: WorkerSlot
    outbox: Outbox
    registration: p.Registration
    connected_at: float
    last_seen: float  # monotonic
    directive: str | None = None  # the state the server wants; None: whatever the worker says


def short(checksum_: str | None) -> str:
    return (checksum_ or "none")[:15]


class Coordinator:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.store = Store(settings.db)
        self.scheduler = Scheduler()
        self.specs: dict[str, JobSpec] = {}
        self.connections: dict[str, Connection] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._no_connections = asyncio.Event()
        self._no_connections.set()
        self.started_at = time.time()

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        snapshot = await asyncio.to_thread(self.store.load)
        self.store.start(asyncio.get_running_loop())
        self.specs = snapshot.status_quo
        self.scheduler.status_quo = dict(snapshot.checksums)
        for job in snapshot.jobs:
            self.scheduler.add(job)
        if snapshot.requeued:
            log.warning("recovery requeued=%d reason=server_restart", snapshot.requeued)
        log.info("store db=%s specs=%d live_jobs=%d", self.settings.db, len(self.specs),
                 len(snapshot.jobs))
        self.spawn(self._dispatch_loop(), "rota-dispatch")
        self.spawn(self._reap_loop(), "rota-reaper")

    async def stop(self) -> None:
        for conn in list(self.connections.values()):
            conn.outbox.abort("shutting_down", "server is shutting down", p.CLOSE_GOING_AWAY)
        try:  # let sessions run their disconnect path so its writes are queued
            await asyncio.wait_for(self._no_connections.wait(), timeout=2.0)
        except TimeoutError:
            log.warning("shutdown: %d connection(s) did not close", len(self.connections))
        for task in list(self._tasks):
            if task.get_name() in ("rota-dispatch", "rota-reaper"):
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

    # -- workers ---------------------------------------------------------------------
    async def register(self, hb: p.Heartbeat, outbox: Outbox) -> str:
        reg = hb.registration
        assert reg is not None
        if hb.worker_id in self.connections:
            raise p.FrameError("worker_id_in_use",
                               f"worker {hb.worker_id} is already connected", p.CLOSE_POLICY)
        names = [ref.name for ref in reg.specs]
        if len(set(names)) != len(names):
            raise p.FrameError("invalid_message", "a spec is declared twice in the registration",
                               p.CLOSE_INVALID_PAYLOAD)
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
        if hb.worker_id in self.connections:  # lost a race with a twin while committing
            raise p.FrameError("worker_id_in_use",
                               f"worker {hb.worker_id} is already connected", p.CLOSE_POLICY)
        slot = WorkerSlot(id=hb.worker_id, queues=list(reg.queues), concurrency=reg.concurrency,
                          specs={s.name: s.checksum for s in reg.specs}, labels=list(reg.labels))
        self.scheduler.add_worker(slot)
        self.connections[slot.id] = Connection(slot, outbox, reg, now, time.monotonic())
        self._no_connections.clear()
        log.info("register worker=%s host=%s pid=%d queues=%s concurrency=%d specs_ok=%d"
                 " specs_rejected=%d", slot.id, reg.hostname, reg.pid, ",".join(reg.queues),
                 reg.concurrency, len(verdict.accepted), len(verdict.rejected))
        welcome = p.Welcome(
            worker_id=slot.id, server_time=p.rfc3339(now),
            heartbeat_interval=self.settings.heartbeat_interval,
            heartbeat_timeout=self.settings.heartbeat_timeout,
            visibility_timeout=self.settings.visibility_timeout, specs=verdict,
        )
        return p.encode(welcome)

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

    def disconnect(self, worker_id: str, reason: str) -> None:
        conn = self.connections.pop(worker_id, None)
        if conn is None:
            return
        if not self.connections:
            self._no_connections.set()
        returned = self.scheduler.remove_worker(worker_id)
        log.info("disconnect worker=%s reason=%s requeued=%d", worker_id, reason, len(returned))
        for job in returned:
            log.info("requeue job=%s spec=%s queue=%s worker=%s attempt=%d reason=disconnect",
                     job.id, job.spec, job.queue, worker_id, job.attempt)
        self.spawn(self._record_disconnect(worker_id, returned), f"rota-disconnect-{worker_id}")
        self.kick()

    async def _record_disconnect(self, worker_id: str, returned: list[Job]) -> None:
        if returned:
            await self.store.requeue(returned, worker_id)
        await self.store.worker_disconnected(worker_id, time.time())

    # -- heartbeats and results -------------------------------------------------------
    def heartbeat(self, worker_id: str, hb: p.Heartbeat) -> str | Awaitable[str]:
        """Apply a heartbeat; return its ack, or an awaitable one if results must commit first."""
        conn = self.connections[worker_id]
        worker = conn.worker
        if hb.status is not None:
            worker.state = hb.status.state
        if hb.capacity is not None:
            worker.capacity = hb.capacity
        accepted, rejected, finishes = self._check_results(worker, hb.results)
        desired = conn.directive or worker.state
        if not finishes:
            if worker.free() > 0:
                self.kick()
            return self._ack(hb.seq, desired, accepted, rejected)
        task = self.spawn(self._commit_results(hb.seq, desired, worker_id, finishes, rejected),
                          f"rota-results-{worker_id}-{hb.seq}")
        return task

    def _check_results(self, worker: WorkerSlot, results: list[p.Result]
                       ) -> tuple[list[str], list[p.ResultRejection], list[Finish]]:
        accepted: list[str] = []
        rejected: list[p.ResultRejection] = []
        finishes: list[Finish] = []
        now = time.time()
        for result in results:
            reason = self._result_problem(worker, result)
            if reason is not None:
                rejected.append(p.ResultRejection(job_id=result.job_id, attempt=result.attempt,
                                                  reason=reason))
                log.warning("result rejected job=%s worker=%s attempt=%d reason=%s",
                            result.job_id, worker.id, result.attempt, reason)
                continue
            self.scheduler.jobs[result.job_id].state = "finishing"
            accepted.append(result.job_id)
            finishes.append(_finish(result, worker.id, now))
        return accepted, rejected, finishes

    def _result_problem(self, worker: WorkerSlot, result: p.Result) -> str | None:
        job = self.scheduler.jobs.get(result.job_id)
        if job is None:
            return "unknown job, or it already finished"
        if job.worker_id != worker.id or job.state != "active":
            return "job is not reserved by this worker"
        if job.attempt != result.attempt:
            return f"attempt {result.attempt} is not the current attempt {job.attempt}"
        return None

    async def _commit_results(self, seq: int, desired: str, worker_id: str,
                              finishes: list[Finish], rejected: list[p.ResultRejection]) -> str:
        try:
            await self.store.finish(finishes)
        except Exception as exc:
            # Nothing was stored: the jobs stay reserved, and the worker hears that it may
            # report them again rather than believing they were recorded.
            log.exception("storing %d result(s) from worker=%s failed", len(finishes), worker_id)
            for finish in finishes:
                job = self.scheduler.jobs[finish.job_id]  # "finishing" jobs are never dropped
                job.state = "active"
                rejected.append(p.ResultRejection(
                    job_id=job.id, attempt=job.attempt,
                    reason=f"could not be stored ({exc}); report it again"))
            return self._ack(seq, desired, [], rejected)
        for finish in finishes:
            job = self.scheduler.jobs.get(finish.job_id)
            if job is not None:
                log.info("result job=%s spec=%s@%s queue=%s worker=%s attempt=%d outcome=%s",
                         job.id, job.spec, short(job.checksum), job.queue, worker_id,
                         job.attempt, finish.state)
                self.scheduler.finish(job)
            self._wake_waiters(finish.job_id)
        self.kick()
        return self._ack(seq, desired, [f.job_id for f in finishes], rejected)

    def _ack(self, seq: int, state: str, accepted: list[str],
             rejected: list[p.ResultRejection]) -> str:
        return p.encode(p.Ack(seq=seq, state=state,  # type: ignore[arg-type]
                              server_time=p.rfc3339(time.time()),
                              accepted=accepted, rejected=rejected))

    # -- dispatch --------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            plan = self.scheduler.plan()
            if plan:
                self.spawn(self._commit_and_assign(plan), "rota-assign")

    async def _commit_and_assign(self, plan: dict[str, list[Job]]) -> None:
        jobs = [job for batch in plan.values() for job in batch]
        try:
            await self.store.reserve(jobs, time.time())
        except Exception:
            log.exception("reservation commit failed; returning %d jobs", len(jobs))
            for job in jobs:
                if job.state == "active":
                    self.scheduler.release(job)
            self.kick()
            return
        for worker_id, batch in plan.items():
            self._send_assign(worker_id, batch)

    def _send_assign(self, worker_id: str, batch: list[Job]) -> None:
        conn = self.connections.get(worker_id)
        # A job taken back meanwhile (the worker left) is no longer this worker's.
        live = [j for j in batch if j.worker_id == worker_id and j.state == "active"]
        if conn is None or not live:
            return
        copies = []
        for job in live:
            log.info("assign job=%s spec=%s@%s queue=%s worker=%s attempt=%d",
                     job.id, job.spec, short(job.checksum), job.queue, worker_id, job.attempt)
            copies.append(p.JobCopy(
                id=job.id, spec=job.spec, checksum=job.checksum or "", queue=job.queue,
                args=job.args, attempt=job.attempt, priority=job.priority,
                visibility_timeout=job.visibility_timeout or self.settings.visibility_timeout,
                enqueued_at=p.rfc3339(job.enqueued_at)))
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
    async def enqueue(self, request: EnqueueRequest) -> tuple[dict[str, Any], bool]:
        spec = self.specs.get(request.spec)
        if spec is None:
            raise RequestError(422, "unknown_spec",
                               f"spec {request.spec!r} has no status quo; push it with"
                               " 'rota specs push' first")
        try:
            validate_args(spec, request.args)
        except SpecError as exc:
            raise RequestError(422, "invalid_args", str(exc)) from exc
        job = Job(id=request.id or uuid7(), spec=spec.name, queue=request.queue or spec.queue,
                  args=msgspec.Raw(msgspec.json.encode(request.args)),
                  priority=spec.priority if request.priority is None else request.priority,
                  enqueued_at=time.time(), seq=0, visibility_timeout=spec.visibility_timeout)
        row, created = await self.store.enqueue(job)
        if not created:
            _check_same_job(row, job, request.args)
            return row, False
        job.seq = row["rowid"]
        self.scheduler.add(job)
        log.info("enqueue job=%s spec=%s queue=%s priority=%d", job.id, job.spec, job.queue,
                 job.priority)
        self.kick()
        return row, True

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


def _finish(result: p.Result, worker_id: str, now: float) -> Finish:
    if result.outcome == "completed":
        return Finish(result.job_id, "completed", msgspec.json.encode(result.result), None, now)
    error = result.error or p.ErrorInfo(type="error", message="the worker gave no error")
    record = {"type": error.type, "message": error.message, "retryable": error.retryable,
              "details": error.details, "attempt": result.attempt, "worker_id": worker_id,
              "at": p.rfc3339(now)}
    return Finish(result.job_id, "failed", None, msgspec.json.encode(record), now)


def _check_same_job(row: dict[str, Any], job: Job, args: dict[str, Any]) -> None:
    same = (row["spec"] == job.spec and row["queue"] == job.queue
            and row["priority"] == job.priority and msgspec.json.decode(row["args"]) == args)
    if not same:
        raise RequestError(409, "id_conflict",
                           f"job {job.id} exists with a different spec, queue, priority or args")
