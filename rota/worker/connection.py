"""The worker's connection to the server, on a thread and event loop of its own.

Heartbeats, reads and writes run here, apart from the handlers' loop, so a handler that
blocks its loop (``time.sleep`` in an ``async def``) delays nothing but itself: the
worker keeps beating and the server keeps it. What the connection learns (assigns,
cancels, directives, the welcome) is handed to the handlers' loop; what the handlers
produce (results, freed slots, state changes, alerts) is handed here. The decisions
are the sans-I/O core's (rota/worker/link.py).

The connection also watches the handlers' loop: a probe posted to it that does not run
within ``BLOCKED_AFTER`` seconds means a handler is blocking it. The handler and its job
are read off that thread's stack while the block lasts; when the loop is free again, one
WARNING says for how long and by which handlers and jobs, and each of them gets an alert.
Given several server URLs, every failed or lost connection moves to the next one
(``Servers``), and one line says where the worker goes and why it left (what to do, too)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.frames import CloseCode

from rota.base import protocol as p
from rota.base.tls import distrust, plain_answer, plain_url, speaks_tls
from rota.worker.context import STATUS_BYTES_PER_BEAT, StatusBuffer
from rota.worker.execution import Handler, Runner
from rota.worker.link import (FRAME_BUDGET, Link, Servers, drain, ids_size, refusal,
                              registration_refused)

log = logging.getLogger("rota.worker")
METRICS_EVERY = 5.0  # seconds between CPU/RAM figures in heartbeats
BLOCKED_AFTER = 0.5  # seconds the handlers' loop may not answer before it counts as blocked
PROBE_EVERY = 0.1  # how often the connection looks at the handlers' loop


class Host(Protocol):
    """What the connection needs of its worker (rota.worker.worker.Worker)."""

    servers: Servers
    worker_id: str
    reconnect: bool
    patience: float | None
    terminate_by: float | None
    connected: asyncio.Event
    runner: Runner
    status: StatusBuffer
    handlers: dict[str, Handler]

    @property
    def server_url(self) -> str: ...

    @property
    def state(self) -> p.WorkerState: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def stopping_now(self) -> bool: ...

    def connect(self) -> websockets.connect: ...

    def registration(self) -> p.Registration: ...

    def metrics(self) -> tuple[float, int]: ...

    def welcomed(self, welcome: p.Welcome) -> None: ...

    def tick(self) -> None: ...

    @property
    def handing_over(self) -> bool: ...

    def quiet(self) -> None: ...

    def resume(self) -> None: ...

    def terminate(self) -> None: ...


class ConnectionThread:
    """The worker's connection to its server, on a thread and an event loop of its own."""

    def __init__(self, worker: Host, link: Link) -> None:
        self.worker = worker
        self.link = link
        self.loop: asyncio.AbstractEventLoop | None = None
        self._handlers_loop = asyncio.get_running_loop()
        self._handlers_thread = threading.get_ident()
        self._dirty: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None
        self._done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread_handle = threading.Thread(target=self._thread, name="rota-connection",
                                               daemon=True)
        self._ws: ClientConnection | None = None  # the open connection, if any
        self._opened = False  # a connection was open since the last one was lost
        self._farewell: str | None = None  # the server's error frame on this connection
        self._metrics_at = -METRICS_EVERY
        self._ticked = 0.0  # when the handlers' side was last asked to tick
        # Jobs handed to the handlers' loop, and jobs it has taken in: each counter is
        # written by one thread only, so the handlers' side need not post back to say so
        # (a cross-thread call is a self-pipe write and a wake-up, per assign).
        self._handed = 0  # on this thread
        self._taken = 0  # on the handlers' thread
        self._probe_sent: float | None = None  # when the pending probe was posted
        # (handler, job id) seen blocking the handlers' loop since the pending probe
        self._blockers: dict[tuple[str, str | None], None] = {}

    # -- from the handlers' loop ----------------------------------------------------------
    def start(self) -> Awaitable[None]:
        """Run on a new thread; the awaitable ends when the connection is done for good."""
        self._thread_handle.start()
        return asyncio.wrap_future(self._done)

    def wake(self, *, urgent: bool = False) -> None:
        """Something to tell the server (thread-safe)."""
        self._call(self._wake, urgent)

    def add_results(self, results: list[p.Result | None]) -> None:
        """Runs ended (thread-safe); None: a slot came free with nothing to report."""
        self._call(self._add_results, results, time.monotonic())

    def abort(self, timeout: float = 1.0) -> None:
        """Stop now (a third Ctrl-C): a last heartbeat says goodbye with whatever results
        are at hand, without waiting for their ack, so that the server takes the jobs
        back at once and does not count this as a worker death; then the connection
        ends. Waits at most ``timeout`` seconds for that."""
        if self.loop is None or self._main is None:
            return
        self._call(lambda: asyncio.ensure_future(self._leave_now()))
        self._thread_handle.join(timeout)

    async def _leave_now(self) -> None:
        ws = self._ws
        if ws is not None:
            try:
                beat = self.link.heartbeat(time.monotonic(), state="terminate", active=[],
                                           capacity=0, goodbye=True)
                # Awaited in this task, not through wait_for (which would run the send in a
                # task of its own, a loop turn later): a beat the beat loop numbered after
                # this one could then leave first, and the server would refuse the goodbye
                # as out of order.
                async with asyncio.timeout(0.5):
                    await ws.send(p.encode(beat))
                async with asyncio.timeout(0.5):
                    await ws.close()
            except (TimeoutError, OSError, websockets.ConnectionClosed):
                pass
        assert self._main is not None
        self._main.cancel()

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # its loop is closed: the connection is over
            pass

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Hand ``fn(*args)`` to the handlers' loop."""
        try:
            self._handlers_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the handlers' loop is gone: so is the worker
            pass

    # -- on the connection's thread -------------------------------------------------------
    def _thread(self) -> None:
        try:
            # The connection's loop is the SDK's own (no handler runs on it), so it may
            # be uvloop's, which reads and wakes faster than the default loop.
            with asyncio.Runner(loop_factory=_fast_loop()) as runner:
                runner.run(self._run_main())
        except BaseException as exc:  # noqa: BLE001 (handed to run(), which re-raises)
            if not self._done.done():
                self._done.set_exception(exc)
        else:
            if not self._done.done():
                self._done.set_result(None)

    async def _run_main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._dirty = asyncio.Event()
        self._main = asyncio.current_task()
        try:
            await self._run()
        except asyncio.CancelledError:
            return  # aborted: the worker gave up reporting

    def _wake(self, urgent: bool) -> None:
        if urgent:
            self.link.urge()
        assert self._dirty is not None
        self._dirty.set()

    def _add_results(self, results: list[p.Result | None], at: float) -> None:
        for result in results:
            if result is not None:
                self.link.add_result(result, at)
        assert self._dirty is not None
        self._dirty.set()

    async def _run(self) -> None:
        worker = self.worker
        lost_at: float | None = None
        while not worker.stopping or worker.runner.running:
            url = worker.server_url
            self._farewell, self._welcomed, self._refused = None, False, None
            try:
                async with worker.connect() as ws:
                    await self._session(ws)
                why = self._farewell or _closed_by_server(ws.close_code, ws.close_reason)
            except websockets.InvalidStatus as exc:
                status = exc.response.status_code
                if status in (401, 403):  # retrying would not change the server's mind
                    raise PermissionError(f"{url} refused this worker ({status}"
                                          f" {refusal(exc.response.body)})") from exc
                if not worker.reconnect:
                    raise
                why = f"HTTP {status}"
            except (OSError, websockets.ConnectionClosed, websockets.InvalidHandshake) as exc:
                if not worker.reconnect:
                    raise
                # A stopping server says why in an error frame before it closes.
                why = self._farewell or str(exc) or type(exc).__name__
                if isinstance(exc, websockets.ConnectionClosed) and exc.rcvd is not None:
                    why = self._farewell or _closed_by_server(exc.rcvd.code, exc.rcvd.reason)
                if (untrusted := distrust(exc)) is not None:  # as the clients say it
                    why = f"it has {untrusted}"
                elif isinstance(exc, websockets.InvalidMessage) and await asyncio.to_thread(
                        speaks_tls, url):  # hung up on: a TLS server's plain port
                    why += "; is it wss://? It answers only TLS: give its https:// URL"
                elif plain_answer(url, exc):  # its handshake got plain text back
                    why += f"; is it ws://? It does not speak TLS: give {plain_url(url)}"
            if self._refused is not None:  # the same registration would be refused again
                raise registration_refused(url, self._refused)
            self.link.lost()
            self._post(worker.connected.clear)
            if worker.stopping and not worker.runner.running and not self._starting:
                return
            if lost_at is None or not self.link.reconnects:
                lost_at = time.monotonic()  # (a welcome sets reconnects back to 0)
            if worker.patience is not None and time.monotonic() - lost_at > worker.patience:
                urls = worker.servers.urls
                where = urls[0] if len(urls) == 1 else "any of " + ", ".join(urls)
                raise ConnectionError(f"no connection to {where} for {worker.patience}s")
            delay = self.link.reconnect_delay(len(worker.servers))
            # The first lost connection is news; the attempts after it are detail.
            level = logging.WARNING if self.link.reconnects == 1 else logging.INFO
            what = "connection to %s lost" if self._opened else "cannot connect to %s"
            self._opened = False
            running = len(worker.runner.running)
            if len(worker.servers) == 1:
                log.log(level, what + " (%s); reconnect attempt %d in %.2fs, %d job(s) running",
                        url, why, self.link.reconnects, delay, running)
            else:  # one line per switch: where it goes, and why it left
                following = worker.servers.advance()
                log.log(level, what + " (%s); switching to %s in %.2fs (reconnect attempt %d),"
                        " %d job(s) running", url, why, following, delay,
                        self.link.reconnects, running)
            assert self._dirty is not None
            await _wait(self._dirty if worker.stopping_now else asyncio.Event(), delay)

    async def _session(self, ws: ClientConnection) -> None:
        self.link.opened()
        self._ws = ws
        self._opened = True
        await self._beat(ws, registration=True)
        reader = asyncio.create_task(self._read(ws), name="rota-worker-read")
        try:
            await self._beat_loop(ws, reader)
        finally:
            self._ws = None
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _beat_loop(self, ws: ClientConnection, reader: asyncio.Task[None]) -> None:
        worker, link = self.worker, self.link
        assert self._dirty is not None
        while True:
            now = time.monotonic()
            timeout = min(link.next_beat_in(now), PROBE_EVERY)
            if worker.terminate_by is not None:
                timeout = max(0.0, min(timeout, worker.terminate_by - now))
            await _wait(self._dirty, timeout, also=reader)
            if reader.done():
                reader.result()  # re-raise why the connection ended
                return
            self._dirty.clear()
            # Let whatever else is ready on this loop run first (results handed over,
            # an assign being read), so that what it brings rides this same heartbeat.
            await asyncio.sleep(0)
            now = time.monotonic()
            if now - self._ticked >= PROBE_EVERY:
                self._ticked = now
                self._watch_handlers()
                self._post(worker.tick)  # lapsed leases, the grace period: handlers' side
            capacity = worker.runner.capacity(worker.state, link.round_trip)
            # Stopping forces a beat only once nothing runs (to say goodbye): while a job
            # still runs, every ack would wake this loop into another beat at once.
            if not link.due(now, capacity=capacity,
                            stopping=worker.stopping and not worker.runner.running):
                continue
            await self._check_server_alive(ws)
            await self._beat(ws)
            if (worker.stopping and not worker.runner.running and not self._starting
                    and not worker.handing_over):
                # A run hands its result over before it frees its slot: let what was
                # handed over land here before judging that nothing is left to report.
                await asyncio.sleep(0)
                if link.drained(running=len(worker.runner.running), fast=worker.stopping_now):
                    await self._say_goodbye(ws, reader)
                    return

    async def _check_server_alive(self, ws: ClientConnection) -> None:
        """A socket can look open long after its peer is gone (a half-open TCP connection
        after a network cut): when an ack is overdue, ask with a ping, which the server
        answers at once from its protocol layer. No pong either: the connection is dead."""
        patience = self.link.ping_patience(time.monotonic())
        if patience is None:
            return
        try:
            await asyncio.wait_for(await ws.ping(), patience)
        except (TimeoutError, websockets.ConnectionClosed):
            ws.transport.abort()  # closing politely would wait on the dead peer
            raise ConnectionError(f"no ack for {self.link.oldest_unanswered(time.monotonic()):.1f}s"
                                  " and no answer to a ping") from None

    async def _say_goodbye(self, ws: ClientConnection, reader: asyncio.Task[None]) -> None:
        await self._beat(ws, goodbye=True)
        try:  # the server answers with an ack and closes
            await asyncio.wait_for(asyncio.shield(reader), timeout=2.0)
        except (TimeoutError, websockets.ConnectionClosed):
            pass
        await ws.close()
        log.info("deregistered worker=%s", self.worker.worker_id)

    async def _beat(self, ws: ClientConnection, *, registration: bool = False,
                    goodbye: bool = False) -> None:
        worker, link = self.worker, self.link
        now = time.monotonic()
        status = p.Status(state=worker.state)
        active, waiting = worker.runner.vouched(now), worker.runner.prefetched(now)
        status.prefetched_job_ids = waiting
        # Starts since the last beat, and jobs given back from the line (take_back).
        status.started = drain(worker.runner.starts, p.MAX_STARTED)
        status.given_back = drain(worker.runner.given, p.MAX_PREFETCH)
        # The ids take their share of the frame first: a deep line's can be 100 KiB.
        reserve = sum(map(ids_size, (active, waiting, status.started, status.given_back)))
        worker.status.fill(status, min(STATUS_BYTES_PER_BEAT, FRAME_BUDGET - reserve
                                       - link.results_size(reserve)))
        if registration or now - self._metrics_at >= METRICS_EVERY:
            self._metrics_at = now
            status.cpu_percent, status.memory_rss = worker.metrics()
        beat = link.heartbeat(
            now, state=worker.state, active=active,
            capacity=worker.runner.capacity(worker.state, link.round_trip), status=status,
            registration=worker.registration() if registration else None, goodbye=goodbye,
            reserve=reserve)
        await ws.send(p.encode(beat))

    async def _read(self, ws: ClientConnection) -> None:
        worker = self.worker
        async for frame in ws:
            self.link.heard(time.monotonic())
            try:
                message = p.decode_server_message(frame)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:  # skip, don't die:
                log.warning("ignoring a server frame this SDK cannot read: %s", exc)  # (a newer server's)
                continue
            match message:
                case p.Assign(jobs=jobs):
                    self._handed += len(jobs)  # in transit until the handlers' side has them
                    self._post(self._start, jobs)
                case p.Ack():
                    self._on_ack(message)
                case p.Cancel(job_ids=job_ids, reason=reason):
                    for job_id in job_ids:
                        self._post(worker.runner.cancel, job_id, reason)
                case p.TakeBack(job_ids=job_ids):
                    self._post(self._take_back, job_ids)
                case p.Welcome():
                    self._welcomed = True
                    self.link.on_welcome(message)
                    worker.welcomed(message)
                    self._post(worker.connected.set)
                case p.Error(code=code, message=text):
                    self._farewell = f"{code}: {text}"
                    self._refused = text if code == "invalid_message" and not self._welcomed else None
                    log.error("server error code=%s message=%s", code, text)

    def _start(self, jobs: list[p.JobCopy]) -> None:
        """On the handlers' loop: start the runs (or line them up)."""
        try:
            for copy in jobs:
                self.worker.runner.take(copy)
        finally:
            self._taken += len(jobs)

    def _take_back(self, job_ids: list[str]) -> None:
        """On the handlers' loop: out of the line, and said at once (a worker is idle)."""
        self.worker.runner.take_back(job_ids)
        self.wake(urgent=True)

    @property
    def _starting(self) -> int:
        """Jobs assigned and handed to the handlers' loop, not yet taken in there."""
        return self._handed - self._taken

    def _on_ack(self, ack: p.Ack) -> None:
        outcome = self.link.on_ack(ack, time.monotonic())
        if outcome.directive is not None:
            log.info("directed by the server: state=%s", outcome.directive)
            self._post({"terminate": self.worker.terminate, "running": self.worker.resume}
                       .get(outcome.directive, self.worker.quiet))
        for rejected in outcome.rejected:
            log.warning("result rejected job=%s attempt=%d reason=%s", rejected.job_id,
                        rejected.attempt, rejected.reason)
        if self.link.pending() or self.worker.stopping:
            assert self._dirty is not None
            self._dirty.set()  # results held back for this ack go now

    # -- watching the handlers' loop ---------------------------------------------------------
    def _watch_handlers(self) -> None:
        now = time.monotonic()
        if self._probe_sent is None:
            self._probe_sent = now
            self._post(self._call, self._probe_answered, now)
            return
        stuck = now - self._probe_sent
        if stuck > BLOCKED_AFTER:  # sampled all along: one block may span several handlers
            found = self._find_blocker()
            if found is not None:
                self._blockers.setdefault(found)

    def _probe_answered(self, sent: float) -> None:
        stuck = time.monotonic() - sent
        blockers, self._blockers, self._probe_sent = list(self._blockers), {}, None
        if stuck <= BLOCKED_AFTER:
            return
        blockers = blockers or [("unknown code", None)]
        log.warning("event loop blocked worker=%s for=%.1fs by %s", self.worker.worker_id,
                    stuck, ", ".join(f"handler={h} job={j or '-'}" for h, j in blockers))
        for handler, job_id in blockers:
            self.worker.status.alert(
                f"the handlers' event loop was blocked for {stuck:.1f}s by {handler}"
                f"{f' (job {job_id})' if job_id else ''}: an async handler must not block;"
                " use a plain function, or await asyncio.to_thread(...)", "warning", job_id)
        self.link.urge()

    def _find_blocker(self) -> tuple[str, str | None] | None:
        """Which handler is on the handlers' thread's stack now, and for which job."""
        frame = sys._current_frames().get(self._handlers_thread)
        codes = {getattr(fn, "__code__", None): name
                 for name, fn in self.worker.handlers.items()}
        while frame is not None:
            if frame.f_code in codes:
                ctx = frame.f_locals.get("ctx")
                return (f"the handler of {codes[frame.f_code]!r}"
                        f" ({frame.f_code.co_name})", getattr(ctx, "id", None))
            frame = frame.f_back
        return None


def _fast_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # Windows, or installed without it: the default loop
        return None
    return uvloop.new_event_loop


async def _wait(event: asyncio.Event, timeout: float,
                also: Awaitable[Any] | None = None) -> None:
    """Wait for ``event`` (or ``also`` finishing) at most ``timeout`` seconds."""
    waiter = asyncio.ensure_future(event.wait())
    pending = {waiter} | ({asyncio.ensure_future(also)} if also is not None else set())
    try:
        await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


def _closed_by_server(code: int | None, reason: str | None) -> str:
    """Why the server closed the connection, in words: a server that stops is the usual
    reason to move to another one, and its close code alone does not say so plainly."""
    said = f"{code}{f' {reason}' if reason else ''}"
    if code in (CloseCode.GOING_AWAY, CloseCode.SERVICE_RESTART):
        return f"the server is stopping: close code {said}"
    return f"closed by the server: close code {said}"
