"""The worker SDK: register handlers by spec name, connect to /work, run what is assigned.

    worker = Worker(url="ws://127.0.0.1:8000/work", specs_dir="specs")

    @worker.handler("echo")
    async def echo(ctx: JobContext) -> dict:
        return {"message": ctx.args["message"]}

    asyncio.run(worker.run())

Async handlers run as tasks, plain functions in a thread pool. Each handler's spec
is read from ``specs_dir`` and declared with its checksum, so the server sends this
worker only jobs whose spec matches the status quo. Only ``protocol``, ``specs`` and
``ids`` are imported here: a worker needs none of the server's dependencies.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import platform
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from ssl import SSLContext
from typing import Any

import msgspec
import psutil
import websockets
from websockets.asyncio.client import ClientConnection

from rota import protocol as p
from rota.context import STATUS_BYTES_PER_BEAT, JobContext, StatusBuffer, check_level
from rota.ids import uuid7
from rota.manual import Listener
from rota.specs import JobSpec, SpecError, checksum, load_dir

log = logging.getLogger("rota.worker")
SDK = "rota-python/0.1.0"
METRICS_EVERY = 5.0  # seconds between CPU/RAM figures in heartbeats
# The server takes frames up to 1 MiB: results and status share this, and the rest of a
# heartbeat (ids, metrics, registration) fits in what is left.
FRAME_BUDGET = (1 << 20) - 64 * 1024
RESULT_BYTES_PER_BEAT = 768 * 1024
Handler = Callable[["JobContext"], Any]


@dataclass(slots=True)
class _Running:
    copy: p.JobCopy
    deadline: float  # monotonic: past it, without a ctx.heartbeat(), the run is given up
    task: asyncio.Task[None] | None = None
    cancel_reason: str | None = None  # why we cancelled it: "cancelled", "visibility_timeout"


class Worker:
    def __init__(
        self,
        *,
        url: str = "ws://127.0.0.1:8000/work",
        specs_dir: str | Path = "specs",
        queues: list[str] | None = None,
        concurrency: int = 10,
        labels: list[str] | None = None,
        worker_id: str | None = None,
        heartbeat_interval: float | None = None,
        grace_period: float = 25.0,
        reconnect: bool = True,
        reconnect_max_delay: float = 5.0,
        patience: float | None = None,
        token: str | None = None,
        ssl: SSLContext | None = None,
        handle_signals: bool = True,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.url = url
        self.specs_dir = Path(specs_dir)
        self.concurrency = concurrency
        self.labels = list(labels or [])
        self.worker_id = worker_id or uuid7()
        self.grace_period = grace_period  # SIGTERM/terminate: how long running jobs may finish
        self.reconnect = reconnect
        self.reconnect_max_delay = reconnect_max_delay
        self.patience = patience  # None: keep reconnecting forever, as Sidekiq does
        self.token = token  # a worker-scope bearer token, when the server requires one
        self.ssl = ssl  # for wss:// with a private CA; None: the system's trust store
        # SIGTERM, SIGINT, SIGTSTP and SIGCONT, while run() runs in the main thread: the
        # same for `rota worker` and for a script that calls worker.run() itself.
        self.handle_signals = handle_signals
        self._abandon = False  # a third SIGINT: stop reporting, return from run() now
        self._task: asyncio.Task[Any] | None = None  # the task running run()
        self._reconnects = 0
        self._terminate_by: float | None = None  # monotonic; then running jobs are cancelled
        self._fast = False  # SIGINT: cancel at once, do not wait for acks
        # seq -> (the state that heartbeat reported, when it was sent), until its ack comes
        self._sent_state: dict[int, tuple[str, float]] = {}
        self._queues = list(queues) if queues else None
        self._interval = heartbeat_interval  # None: take the server's from its welcome
        self._handlers: dict[str, Handler] = {}
        self._specs: dict[str, JobSpec] = {}
        self._running: dict[str, _Running] = {}
        self._results: list[p.Result] = []
        self._unacked: dict[int, list[p.Result]] = {}  # seq -> results sent, not yet acked
        self._dirty = asyncio.Event()
        self._stop = asyncio.Event()
        self._state: p.WorkerState = "running"
        self._seq = 0
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rota-job")
        self._process = psutil.Process()
        self._metrics_at = -METRICS_EVERY  # monotonic time of the last figures sent
        # With hostname and pid, this tells the server a reconnect is this very process.
        self._started_at = p.rfc3339(time.time())
        self._loop: asyncio.AbstractEventLoop | None = None
        self._status = StatusBuffer(wake=self._wake_threadsafe)
        # Batching: a heartbeat that carries results is not followed by another until its
        # ack is back (unless something urgent comes up, or the interval is due); results
        # that finish meanwhile ride the next one together.
        self._urgent = False  # a state change or an alert: beat now, whatever is in flight
        self._last_beat = 0.0  # monotonic
        self._ready_at: dict[str, float] = {}  # job id -> when its result was ready
        self.frames_sent = 0  # heartbeats sent, over all connections
        self.results_sent = 0
        self.flush_delays: collections.deque[float] = collections.deque(maxlen=100_000)
        self.welcome: p.Welcome | None = None
        self.connected = asyncio.Event()

    # -- configuration ----------------------------------------------------------------
    def handler(self, spec: str) -> Callable[[Handler], Handler]:
        """Decorator: ``fn`` runs the jobs of ``spec`` (a spec file in ``specs_dir``)."""

        def register(fn: Handler) -> Handler:
            if spec in self._handlers:
                raise ValueError(f"spec {spec!r} already has a handler")
            self._handlers[spec] = fn
            return fn

        return register

    @property
    def queues(self) -> list[str]:
        if self._queues:
            return self._queues
        ordered = dict.fromkeys(self._specs[name].queue for name in self._handlers)
        return list(ordered) or ["default"]

    def declared_specs(self) -> list[p.SpecRef]:
        if self._specs.keys() != self._handlers.keys():
            self._load_specs()
        return [p.SpecRef(name, checksum(self._specs[name])) for name in sorted(self._handlers)]

    def _load_specs(self) -> None:
        if not self._handlers:
            raise SpecError("the worker has no handlers; register one with @worker.handler(name)")
        found = {spec.name: spec for spec in load_dir(self.specs_dir)}
        missing = sorted(set(self._handlers) - set(found))
        if missing:
            raise SpecError(f"{self.specs_dir} has no spec for handler(s): {', '.join(missing)}")
        self._specs = {name: found[name] for name in self._handlers}

    # -- running ----------------------------------------------------------------------
    # -- lifecycle: running -> quiet -> terminate, never back from terminate ------------
    @property
    def state(self) -> p.WorkerState:
        return self._state

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def stopping_now(self) -> bool:
        return self._fast

    def quiet(self) -> None:
        """Take no new jobs; keep running the current ones (SIGTSTP, or the server)."""
        if self._state == "running":
            self._set_state("quiet")

    def resume(self) -> None:
        """Back to taking jobs after quiet (SIGCONT); a terminating worker stays so."""
        if self._state == "quiet":
            self._set_state("running")

    def terminate(self) -> None:
        """Take no new jobs, give running ones ``grace_period`` to finish, cancel the rest
        (reported as ``shutdown`` failures, so they are retried at once), deregister and
        return from run() (SIGTERM, or the server)."""
        if self._state != "terminate":
            self._terminate_by = time.monotonic() + self.grace_period
            self._set_state("terminate")
        self._stop.set()

    stop = terminate

    def stop_now(self) -> None:
        """The fast path (SIGINT, or a second signal): cancel running jobs at once, report
        them best-effort, deregister and leave."""
        self._fast = True
        self.terminate()
        self._terminate_by = time.monotonic()
        self._dirty.set()

    def listen(self, *specs: str) -> Listener:
        """Manual mode: ``async with worker.listen("spec", ...) as jobs: async for job in
        jobs: ... job.complete(result)`` or ``job.fail(error)``. Runs the worker for as
        long as the block lasts; see rota.manual."""
        return Listener(self, specs)

    def alert(self, message: str, level: str = "warning") -> None:
        """An alert about the worker itself (not one job): sent at once, logged by the
        server and shown with the worker in ``GET /workers``."""
        check_level(level)
        self._status.alert(message, level, None)

    def _set_state(self, state: p.WorkerState) -> None:
        log.info("state change worker=%s state=%s running_jobs=%d", self.worker_id, state,
                 len(self._running))
        self._state = state
        self._urgent = True
        self._dirty.set()  # tell the server at once

    def _wake_threadsafe(self) -> None:
        """An alert: beat at once (from any thread)."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake_urgently)
            except RuntimeError:  # the loop is closed: a thread outlived the worker
                pass

    async def run(self) -> None:
        """Connect, run what is assigned, reconnect when the connection is lost, until
        terminated (by a signal, the server, or ``terminate()``)."""
        self._load_specs()
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        signals = _Signals.join(self)
        try:
            await self._run()
        except asyncio.CancelledError:
            if not self._abandon:
                raise
            log.warning("stopped without reporting worker=%s", self.worker_id)
        finally:
            if signals is not None:
                signals.leave(self)

    def on_signal(self, sig: signal.Signals) -> None:
        """What a signal does to this worker. SIGTERM: no new jobs, running ones get
        ``grace_period``, then deregister and return. SIGINT: the same without waiting.
        A second SIGTERM or SIGINT takes the fast path; a third SIGINT gives up
        reporting. SIGTSTP: quiet; SIGCONT: resume."""
        log.info("signal %s worker=%s", sig.name, self.worker_id)
        if sig == signal.SIGTERM:
            self.stop_now() if self.stopping else self.terminate()
        elif sig == signal.SIGINT:
            if self.stopping_now and self._task is not None:  # again: give up reporting
                self._abandon = True
                self._task.cancel()
            self.stop_now()
        elif sig == signal.SIGTSTP:
            self.quiet()
        elif sig == signal.SIGCONT:
            self.resume()

    async def _run(self) -> None:
        assert self._loop is not None
        lost_at: float | None = None
        try:
            while not self._stop.is_set() or self._running:
                why = "closed by the server"
                try:
                    async with self._connect() as ws:
                        await self._session(ws)
                except websockets.InvalidStatus as exc:
                    status = exc.response.status_code
                    if status in (401, 403):  # retrying would not change the server's mind
                        raise PermissionError(f"{self.url} refused this worker ({status}):"
                                              f" {exc.response.body.decode(errors='replace')}"
                                              ) from exc
                    if not self.reconnect:
                        raise
                    why = f"HTTP {status}"
                except (OSError, websockets.ConnectionClosed, websockets.InvalidHandshake) as exc:
                    if not self.reconnect:
                        raise
                    why = str(exc) or type(exc).__name__
                self.connected.clear()
                if self._stop.is_set() and not self._running:
                    return
                lost_at = lost_at if self._reconnects else time.monotonic()
                if self.patience is not None and time.monotonic() - lost_at > self.patience:
                    raise ConnectionError(f"no connection to {self.url} for {self.patience}s")
                delay = self._reconnect_delay()
                log.warning("connection to %s lost (%s); reconnect attempt %d in %.2fs,"
                            " %d job(s) running", self.url, why, self._reconnects, delay,
                            len(self._running))
                await _wait(self._dirty if self._fast else asyncio.Event(), delay)
        finally:
            for run in self._running.values():  # only left when run() fails: nobody to
                if run.task is not None:         # report to, the server recovers them
                    run.task.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _connect(self) -> websockets.connect:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return websockets.connect(self.url, max_size=None, compression=None, ping_interval=None,
                                  additional_headers=headers, ssl=self.ssl)

    def _reconnect_delay(self) -> float:
        """Exponential, jittered, capped; below half the server's heartbeat timeout, so
        that after a server restart this worker is back in time to reclaim its jobs."""
        cap = self.reconnect_max_delay
        if self.welcome is not None:
            cap = min(cap, self.welcome.heartbeat_timeout / 2)
        delay = min(cap, 0.1 * 2.0 ** self._reconnects)
        self._reconnects += 1
        return delay * random.uniform(0.5, 1.0)

    async def _session(self, ws: ClientConnection) -> None:
        self._seq = 0
        self._sent_state.clear()
        # Results the last connection sent without an ack go again: the server accepts
        # them if it never stored them, and rejects them harmlessly if it did.
        resend = [result for seq in sorted(self._unacked) for result in self._unacked[seq]]
        self._unacked.clear()
        self._results = resend + self._results
        await self._beat(ws, registration=True)
        reader = asyncio.create_task(self._read(ws), name="rota-worker-read")
        try:
            await self._beat_loop(ws, reader)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    def _wake_urgently(self) -> None:
        self._urgent = True
        self._dirty.set()

    async def _beat_loop(self, ws: ClientConnection, reader: asyncio.Task[None]) -> None:
        while True:
            interval = self._interval or 1.0
            timeout = max(0.0, self._last_beat + interval - time.monotonic())
            if self._terminate_by is not None:
                timeout = max(0.0, min(timeout, self._terminate_by - time.monotonic()))
            await _wait(self._dirty, timeout, also=reader)
            if reader.done():
                reader.result()  # re-raise why the connection ended
                return
            self._dirty.clear()
            # Let whatever else is ready on this loop run first (other jobs finishing, an
            # assign being started), so that what it produces rides this same heartbeat.
            await asyncio.sleep(0)
            if self._hold_back():
                continue
            await self._check_server_alive(ws)
            self._give_up_lapsed()
            if self._terminate_by is not None and time.monotonic() >= self._terminate_by:
                for job_id in list(self._running):  # the grace period is over
                    self.cancel(job_id, "shutdown")
            await self._beat(ws)
            if self._stop.is_set() and self._drained():
                await self._say_goodbye(ws, reader)
                return

    async def _check_server_alive(self, ws: ClientConnection) -> None:
        """A socket can look open long after its peer is gone (a half-open TCP connection
        after a network cut). Every heartbeat gets an ack, but an ack may wait behind a
        slow commit, so an overdue ack is only a reason to ask: a ping, which the server
        answers at once from its protocol layer. No pong either: the connection is dead.
        Both waits are a quarter of the server's heartbeat timeout, so this worker is back
        before the server gives up on it."""
        if self.welcome is None or not self._sent_state:
            return
        patience = self.welcome.heartbeat_timeout / 4
        oldest = next(iter(self._sent_state.values()))[1]  # dicts keep seq order
        if time.monotonic() - oldest <= max(patience, 2 * (self._interval or 1.0)):
            return
        try:
            await asyncio.wait_for(await ws.ping(), patience)
        except (TimeoutError, websockets.ConnectionClosed):
            ws.transport.abort()  # closing politely would wait on the dead peer
            raise ConnectionError(f"no ack for {time.monotonic() - oldest:.1f}s and no answer"
                                  " to a ping") from None

    def _hold_back(self) -> bool:
        """Whether this heartbeat can wait for the ack of the one in flight: results go in
        batches, one heartbeat of them at a time, as Nagle's algorithm does with small
        TCP segments. At low load nothing is in flight and a result leaves at once; under
        load the frames per second follow the server's round trip, not the job rate."""
        if self._urgent or self._stop.is_set() or not self._unacked:
            return False
        interval = self._interval or 1.0
        return time.monotonic() - self._last_beat < interval

    def _drained(self) -> bool:
        """Nothing left to run or report (on the fast path, acks are not waited for)."""
        return not (self._running or self._results or (self._unacked and not self._fast))

    async def _say_goodbye(self, ws: ClientConnection, reader: asyncio.Task[None]) -> None:
        await self._beat(ws, goodbye=True)
        try:  # the server answers with an ack and closes
            await asyncio.wait_for(asyncio.shield(reader), timeout=2.0)
        except (TimeoutError, websockets.ConnectionClosed):
            pass
        await ws.close()
        log.info("deregistered worker=%s", self.worker_id)

    async def _beat(self, ws: ClientConnection, *, registration: bool = False,
                    goodbye: bool = False) -> None:
        results, size = self._take_results()
        now = time.monotonic()
        vouched = [job_id for job_id, run in self._running.items() if run.deadline > now]
        status = p.Status(state=self._state, active_job_ids=vouched)
        self._status.fill(status, min(STATUS_BYTES_PER_BEAT, FRAME_BUDGET - size))
        if registration or now - self._metrics_at >= METRICS_EVERY:
            self._metrics_at = now
            # cpu_percent(None) measures since the previous call: no blocking sample here.
            status.cpu_percent = self._process.cpu_percent(interval=None)
            status.memory_rss = self._process.memory_info().rss
        beat = p.Heartbeat(
            seq=self._seq, worker_id=self.worker_id,
            registration=self._registration() if registration else None,
            status=status,
            results=results, capacity=self._capacity(), goodbye=goodbye,
        )
        if results:
            self._unacked[self._seq] = results
            for result in results:
                ready = self._ready_at.pop(result.job_id, None)
                if ready is not None:
                    self.flush_delays.append(now - ready)
        self._sent_state[self._seq] = (self._state, now)
        self._seq += 1
        self._urgent = False
        self._last_beat = now
        self.frames_sent += 1
        self.results_sent += len(results)
        await ws.send(p.encode(beat))

    def _take_results(self) -> tuple[list[p.Result], int]:
        """Results for one heartbeat: as many as fit RESULT_BYTES_PER_BEAT (one at least),
        so a frame never passes the server's 1 MiB limit; the rest go in the next one."""
        taken = 0
        size = 0
        for result in self._results:
            cost = _result_size(result)
            if taken and size + cost > RESULT_BYTES_PER_BEAT:
                self._dirty.set()
                break
            taken += 1
            size += cost
        results, self._results = self._results[:taken], self._results[taken:]
        return results, size

    def _capacity(self) -> int:
        if self._state != "running":
            return 0
        return max(0, self.concurrency - len(self._running))

    def _registration(self) -> p.Registration:
        return p.Registration(
            hostname=socket.gethostname(), os=f"{platform.system()} {platform.release()}",
            pid=os.getpid(), sdk=SDK, queues=self.queues, concurrency=self.concurrency,
            specs=self.declared_specs(), labels=self.labels,
            started_at=self._started_at,
        )

    async def _read(self, ws: ClientConnection) -> None:
        async for frame in ws:
            try:
                message = p.decode_server_message(frame)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                # A newer server may send messages this SDK does not know: skip, don't die.
                log.warning("ignoring a server frame this SDK cannot read: %s", exc)
                continue
            match message:
                case p.Assign(jobs=jobs):
                    for copy in jobs:
                        self._start(copy)
                case p.Ack():
                    self._on_ack(message)
                case p.Cancel(job_ids=job_ids, reason=reason):
                    for job_id in job_ids:
                        self.cancel(job_id, reason)
                case p.Welcome():
                    self._on_welcome(message)
                case p.Error(code=code, message=text):
                    log.error("server error code=%s message=%s", code, text)

    def _on_welcome(self, welcome: p.Welcome) -> None:
        self.welcome = welcome
        self._reconnects = 0
        if self._interval is None:
            self._interval = welcome.heartbeat_interval
        for rejected in welcome.specs.rejected:
            log.warning("spec rejected spec=%s checksum=%s status_quo=%s reason=%s",
                        rejected.name, rejected.checksum[:15], (rejected.expected or "none")[:15],
                        rejected.reason)
        log.info("connected worker=%s url=%s queues=%s specs_accepted=%s", self.worker_id,
                 self.url, ",".join(self.queues), ",".join(welcome.specs.accepted) or "-")
        self.connected.set()

    def _on_ack(self, ack: p.Ack) -> None:
        # The ack's state is a directive only when stricter than what that heartbeat said:
        # an echo of an older state must not undo a SIGCONT that came since.
        said, _ = self._sent_state.pop(ack.seq, (self._state, 0.0))
        if p.STATE_RANK[ack.state] > p.STATE_RANK[said]:
            log.info("directed by the server: state=%s", ack.state)
            if ack.state == "terminate":
                self.terminate()
            else:
                self.quiet()
        sent = {r.job_id: r for r in self._unacked.pop(ack.seq, [])}
        if sent and (self._stop.is_set() or self._results):
            self._dirty.set()  # results held back for this ack go now; a stopping worker
            # waits for it before it leaves
        for rejected in ack.rejected:
            log.warning("result rejected job=%s attempt=%d reason=%s", rejected.job_id,
                        rejected.attempt, rejected.reason)
            if rejected.reason.startswith("could not be stored") and rejected.job_id in sent:
                self._results.append(sent[rejected.job_id])  # the server asks for it again
                self._dirty.set()

    # -- jobs -------------------------------------------------------------------------
    def _start(self, copy: p.JobCopy) -> None:
        if copy.id in self._running:  # a stale run of an earlier attempt: stop it
            self.cancel(copy.id, "cancelled")
        run = _Running(copy, deadline=time.monotonic() + copy.visibility_timeout)
        self._running[copy.id] = run
        run.task = asyncio.create_task(self._execute(run), name=f"rota-job-{copy.id}")

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        """Stop a running job; it is reported as failed with error type ``reason``."""
        run = self._running.get(job_id)
        if run is None or run.task is None or run.cancel_reason is not None:
            return
        log.info("cancelling job=%s reason=%s", job_id, reason)
        run.cancel_reason = reason
        run.task.cancel()

    def _give_up_lapsed(self) -> None:
        """A run silent past its lease is stopped and reported, so that the retry the
        server will schedule never races a stale copy of it."""
        now = time.monotonic()
        for job_id, run in list(self._running.items()):
            if run.deadline <= now:
                self.cancel(job_id, "visibility_timeout")

    async def _execute(self, run: _Running) -> None:
        copy = run.copy

        loop = asyncio.get_running_loop()

        def extend_now() -> None:
            run.deadline = time.monotonic() + copy.visibility_timeout
            self._dirty.set()

        def extend() -> None:  # may be called from a sync handler's thread
            loop.call_soon_threadsafe(extend_now)

        ctx = JobContext(id=copy.id, spec=copy.spec, queue=copy.queue, attempt=copy.attempt,
                         args=copy.args, priority=copy.priority, checksum=copy.checksum,
                         enqueued_at=copy.enqueued_at, worker_id=self.worker_id,
                         visibility_timeout=copy.visibility_timeout,
                         capture_logs=copy.capture_logs, _extend=extend, _status=self._status)
        try:
            result = await self._call(ctx)
        except asyncio.CancelledError:
            if run.cancel_reason is None:  # not ours: the worker itself is going down
                raise
            if run.cancel_reason == "reservation_lost":  # no longer ours to report
                log.info("stopped job=%s: its reservation was lost while disconnected", copy.id)
                return
            result = p.Result(job_id=copy.id, attempt=copy.attempt, outcome="failed",
                              error=p.ErrorInfo(type=run.cancel_reason,
                                                message=f"stopped by the worker: {run.cancel_reason}"))
        finally:
            self._forget(run)
        self._results.append(result)
        self._ready_at[copy.id] = time.monotonic()
        self._dirty.set()  # beat as soon as the loop is idle (and no batch is in flight)

    def _forget(self, run: _Running) -> None:
        if self._running.get(run.copy.id) is run:  # a newer attempt may have taken the slot
            del self._running[run.copy.id]
        self._dirty.set()

    async def _call(self, ctx: JobContext) -> p.Result:
        handler = self._handlers.get(ctx.spec)
        try:
            if handler is None:
                raise LookupError(f"this worker has no handler for spec {ctx.spec!r}")
            if inspect.iscoroutinefunction(handler):
                value = await handler(ctx)
            else:
                value = await asyncio.get_running_loop().run_in_executor(self._pool, handler, ctx)
            # Encoded once, here: a value that cannot be sent fails the job, not the
            # heartbeat, and the heartbeat carries the bytes as they are.
            encoded = msgspec.json.encode(value)
            if len(encoded) > RESULT_BYTES_PER_BEAT:
                raise ResultTooLarge(f"the result is {len(encoded)} bytes as JSON; a worker"
                                     f" sends at most {RESULT_BYTES_PER_BEAT}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("job failed job=%s spec=%s attempt=%d error=%s: %s", ctx.id, ctx.spec,
                     ctx.attempt, type(exc).__name__, exc)
            return p.Result(job_id=ctx.id, attempt=ctx.attempt, outcome="failed",
                            error=_error_info(exc))
        except BaseException as exc:  # noqa: BLE001 (SystemExit, KeyboardInterrupt, ...)
            # A handler cannot stop its worker: only signals and the server do that.
            # Its job fails, for good, since running it again would do the same.
            log.warning("job failed job=%s spec=%s attempt=%d: the handler raised %s; the"
                        " worker runs on", ctx.id, ctx.spec, ctx.attempt, type(exc).__name__)
            info = _error_info(exc)
            info.retryable = False
            info.message = (f"the handler raised {type(exc).__name__}({exc}); a handler"
                            " cannot stop its worker")
            return p.Result(job_id=ctx.id, attempt=ctx.attempt, outcome="failed", error=info)
        return p.Result(job_id=ctx.id, attempt=ctx.attempt, outcome="completed",
                        result=msgspec.Raw(encoded))


class _Signals:
    """The signal handlers of one event loop, shared by every worker running on it: a
    signal goes to each of them, and the handlers go when the last one leaves."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGTSTP, signal.SIGCONT)
    _by_loop: dict[asyncio.AbstractEventLoop, _Signals] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.workers: list[Worker] = []
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._deliver, sig)

    @classmethod
    def join(cls, worker: Worker) -> _Signals | None:
        if not worker.handle_signals or threading.current_thread() is not threading.main_thread():
            return None
        loop = asyncio.get_running_loop()
        signals = cls._by_loop.get(loop) or cls._by_loop.setdefault(loop, cls(loop))
        signals.workers.append(worker)
        return signals

    def leave(self, worker: Worker) -> None:
        self.workers.remove(worker)
        if not self.workers:
            for sig in self.SIGNALS:
                self.loop.remove_signal_handler(sig)
            self._by_loop.pop(self.loop, None)

    def _deliver(self, sig: signal.Signals) -> None:
        for worker in list(self.workers):
            worker.on_signal(sig)


class ResultTooLarge(Exception):
    """A result too large to send: running the job again would not make it smaller."""

    retryable = False
    error_type = "result_too_large"  # the name the server gives the same failure


def _result_size(result: p.Result) -> int:
    """A result's encoded size, near enough: its value's bytes (already encoded) plus its
    envelope, or an error's bound (messages and tracebacks are cut to a few KiB)."""
    value = len(result.result) if isinstance(result.result, msgspec.Raw) else 0
    return value + (16 * 1024 if result.error is not None else 256)


def _error_info(exc: BaseException) -> p.ErrorInfo:
    return p.ErrorInfo(
        type=getattr(exc, "error_type", type(exc).__name__), message=p.cut_text(str(exc)),
        retryable=bool(getattr(exc, "retryable", True)),
        details={"traceback": "".join(traceback.format_exception(exc))[-4000:]},
    )


async def _wait(event: asyncio.Event, timeout: float,
                also: Awaitable[Any] | None = None) -> None:
    """Wait for ``event`` (or ``also`` finishing) at most ``timeout`` seconds."""
    waiter = asyncio.ensure_future(event.wait())
    pending = {waiter} | ({asyncio.ensure_future(also)} if also is not None else set())
    try:
        await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
