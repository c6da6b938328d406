"""The async shell around the engine: it owns the store, the clock and the sockets.

Every decision is the engine's (rota/core/engine.py) or a verdict's (rota/core/verdicts.py).
This feeds the engine events, timed by the injected clock, and applies the effects it
returns in order: writes go to the single writer as they come (they commit in decision
order), a write with a ticket reports its outcome back, and a frame goes out only when the
engine releases it (after its COMMIT), to a socket or a pull worker's mailbox (mailbox.py);
and it dispatches (a round when woken) and ticks (timers). Parts: admission.py and siblings."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import socket
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from rota.base import protocol as p
from rota.server.admission import Admission
from rota.server.composing import Composing
from rota.server.mailbox import Mailbox, Outbox
from rota.server.pushing import Pusher
from rota.core.auth import OPEN, Principal, Tokens
from rota.core.effects import (Abort, Arm, Deliver, Effect, Finished, Note, Reserve, Save, Send,
                          Wake, Withdraw, WorkerGone, WorkerSeen)
from rota.core.engine import MAX_LOG_LINES, Engine
from rota.base.errors import failure_level
from rota.core.model import Change, Instant, JobRecord
from rota.core.policy import RateLimits
from rota.core.registry import ConnectedWorker
from rota.core.scheduler import Scheduler
from rota.core.settings import ServerSettings
from rota.server.shell_directives import ShellDirectives
from rota.server.ojs_operating import OjsOperating
from rota.base.specs import JobSpec
from rota.server.secretbook import SecretBook
from rota.server.steering import Steering
from rota.store.health import Health
from rota.store.store import Store
from rota.server.tokenwatch import TokenWatch
from rota.server.upkeep import Upkeep, clock_reading, system_clock
from rota.core.verdicts import MAX_BULK
from rota.server.watching import Watching

__all__ = ["Coordinator", "MAX_BULK", "MAX_LOG_LINES", "Outbox", "system_clock"]
log = logging.getLogger("rota.server")
LOOPS = ("rota-dispatch", "rota-timers", "rota-tokens", "rota-retention", "rota-clock", "rota-counts", "rota-cron", "rota-webhooks")
MAX_BUCKETS = 100_000  # workers whose rate-limit state is kept across connections


class Coordinator(OjsOperating, ShellDirectives):  # (OjsOperating is a ShellReads)
    def __init__(self, settings: ServerSettings,
                 clock: Callable[[], Instant] = system_clock) -> None:
        self.settings = settings
        self.clock = clock
        self.store = Store(settings.db,
                           crash_before_commit=settings.crash_at == "enqueue-before-commit",
                           durability=settings.durability, max_db_size=settings.max_db_size,
                           database_url=settings.database_url, db_pool=settings.db_pool,
                           lease=settings.server_lease, hold_reserve=settings.hold_reserve,
                           health=Health(hold=settings.recover_after))
        self.server_id = settings.server_id or f"{socket.gethostname()}:{settings.port}"
        self.store.server_id = self.server_id  # (docs/scaling.md: reservations carry it)
        self.engine = engine = Engine(settings)
        self.store.on_released = lambda jobs: self.apply(engine.taken_in(jobs, self.clock()))
        self.sockets: collections.Counter[str | None] = collections.Counter()  # per token id
        self._outboxes: dict[int, Outbox] = {}
        self._conns = 0
        self.mailbox = Mailbox(lambda conn, ids: self.apply(  # (rota/server/mailbox.py)
            self.engine.pull_unheard(conn, ids, self.clock())))
        self._inflight: dict[int, asyncio.Future[Any]] = {}  # conn -> its latest results write
        self.pending_writes = 0  # handed to the writer, outcome not yet applied
        self._wake = asyncio.Event()
        self._timers = asyncio.Event()
        self._timers_wake_at = 0.0  # when the timer loop will next look, unless poked
        self._tasks: set[asyncio.Task[Any]] = set()
        self._no_connections = asyncio.Event()
        self._no_connections.set()
        self.started = clock()
        # Event ids go on from the start's clock (µs since the epoch), growing across
        # restarts: a client resuming with an old run's id hears of the gap, skips nothing.
        engine.observe.next_id = int(self.started.wall * 1_000_000)
        # Run at a stop after the connections, before the store closes (the cluster's lease).
        self.on_stop: list[Callable[[], Coroutine[Any, Any, None]]] = []
        # The shell's parts, each handed what it uses.
        store = self.store
        self.tokenwatch = TokenWatch(
            store, every=settings.heartbeat_interval, max_holds=settings.max_waits_per_token,
            monotonic=lambda: self.clock().mono,
            on_change=lambda valid: self.apply(engine.revoked(valid)))
        self.secrets = SecretBook(store, lambda: self.clock().wall)  # endpoint signing secrets
        self.steering = Steering(store, engine, clock, self.run, self.apply, secrets=self.secrets)
        self.admission = Admission(store, engine, clock, self.apply, self.crash_point)
        self.watching = Watching(store, engine, clock, settings.max_series)
        self.upkeep = Upkeep(settings, store, engine, clock, self.apply, self.steering, self.watching)
        self.clockwork, self.webhooks = self.upkeep.clockwork, self.upkeep.webhooks  # routes'
        # What the parts do, under the names the routes call (bound: same signatures).
        self.enqueue, self.take_over = self.admission.enqueue, self.admission.take_over
        steering = self.steering
        self.cancel, self.retry, self.bulk = steering.cancel, steering.retry, steering.bulk
        self.retire_spec, self.push_specs = steering.retire_spec, steering.push_specs
        self.pause_queue, self.limiting = steering.pause_queue, steering.limiting
        self.composing = Composing(settings, store, engine, clock, steering.cancel,  # workflows
                                   self.admission._read_status_quo, self.apply, self.job_waiting_reason)
        watching = self.watching
        self.wait_for_result, self.stats = watching.wait_for_result, watching.stats
        self.oldest_available, self.events_pulse = watching.oldest_available, watching.events_pulse
        self.subscribe, self.unsubscribe = watching.subscribe, watching.unsubscribe
        tokens = self.tokenwatch
        self.hold, self.release, self.reread_tokens = tokens.hold, tokens.release, tokens.reread
        self.create_token, self.revoke_token = tokens.create, tokens.revoke
        self.buckets_for = RateLimits((settings.rate_limit, settings.rate_burst), (
            settings.rate_bytes, settings.rate_bytes_burst), MAX_BUCKETS).of
        self.pusher = Pusher(settings, store, engine, self.apply, clock, self.secrets.secret_values)
        self.on_stop.append(self.pusher.stop)  # (push execution: rota/server/pushing.py)

    # -- what routes and tests read --------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def connections(self) -> dict[str, ConnectedWorker]:
        return self.engine.connections

    @property
    def specs(self) -> dict[str, JobSpec]:
        return self.engine.specs

    @property
    def tokens(self) -> Tokens:
        return self.tokenwatch.tokens

    @property
    def waits(self) -> collections.Counter[str | None]:  # open HTTP requests per token id
        return self.tokenwatch.waits

    @property
    def stopping(self) -> bool:
        return self.watching.stopping

    def uptime(self) -> float:
        return self.clock().mono - self.started.mono

    # -- lifecycle -----------------------------------------------------------------
    async def start(self) -> None:
        # One server per SQLite file: its stored moments are its own clock's, checked
        # against the last run's (docs/reliability.md §7). Servers sharing PostgreSQL
        # keep their clocks in step instead (docs/scaling.md).
        kept = not self.store.shared
        snapshot = await asyncio.to_thread(self.store.load, clock_reading() if kept else None)
        if snapshot.clock_step:
            log.warning("wall clock stepped %+.1fs since the last run: the live jobs' stored"
                        " deadlines are moved by it, so each is as far away as the last run"
                        " left it", snapshot.clock_step)
        self.store.start(asyncio.get_running_loop())
        try:
            await self.tokenwatch.refresh()
            await self.secrets.reload()
        except BaseException:  # no stop() follows a failed start: end the store's threads
            await asyncio.to_thread(self.store.close)
            raise
        if not self.tokens.required:
            log.warning("AUTH IS OFF: no tokens exist, so anyone who can reach this server may"
                        " take jobs and give orders. Create one: rota tokens create --scope admin")
        self.apply(self.engine.load(snapshot.status_quo, snapshot.checksums, snapshot.jobs,
                                    self.clock(), snapshot.waiting, snapshot.last_seq,
                                    snapshot.retired, snapshot.paused))
        await self.pusher.start()
        self.limiting.load(snapshot.limits, snapshot.limit_starts)
        self.secrets.announce()
        log.info("store db=%s durability=%s specs=%d live_jobs=%d", self.store.where,
                 self.settings.durability, len(self.specs), self.scheduler.live())
        self.spawn(self._dispatch_loop(), "rota-dispatch")
        self.spawn(self._timer_loop(), "rota-timers")
        self.spawn(self.tokenwatch.loop(), "rota-tokens")
        for loop, name in self.upkeep.loops(readings=kept, counts=snapshot.throughput):
            self.spawn(loop, name)

    def begin_shutdown(self) -> None:
        self.engine.begin_shutdown()
        # A request held by a commit in doubt (PostgreSQL away) would hold the stop.
        self.store.writer.begin_stop()
        # uvicorn waits for every request in flight before the lifespan ends: a long poll
        # (?wait= up to max_result_wait) would hold a deploy's restart for minutes. Each
        # gets its answer now, the job as it stands (202 if not finished).
        self.watching.stop()  # and GET /events streams end

    async def stop(self) -> None:
        self.begin_shutdown()
        for outbox in list(self._outboxes.values()):
            outbox.abort("shutting_down", "server is shutting down", p.CLOSE_GOING_AWAY)
        try:  # let sessions run their disconnect path so its writes are queued
            await asyncio.wait_for(self._no_connections.wait(), timeout=2.0)
        except TimeoutError:
            log.warning("shutdown: %d connection(s) did not close", len(self.connections))
        for task in list(self._tasks):
            if task.get_name() in LOOPS:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for hook in self.on_stop:
            await hook()
        await self.upkeep.at_stop(reading=not self.store.shared)  # for the next start
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

    def crash_point(self, name: str | None) -> None:
        """Test switch (--crash-at): die here as kill -9 would."""
        if name is not None and self.settings.crash_at == name:
            log.critical("crash point %s: exiting now", name)
            os._exit(86)

    # -- applying effects ----------------------------------------------------------
    def apply(self, effects: Iterable[Effect], source: int | None = None,
              linger: bool = False) -> None:
        """Carry out effects in order, without waiting on any of them. ``source``: the
        connection whose frame they answer; its ticketed writes are what ``settled``
        waits for. ``linger``: their job transitions may wait for company (Writer.submit)."""
        for effect in effects:
            match effect:
                case Send(conn, frame):
                    if (outbox := self._outboxes.get(conn) or self.mailbox.box(conn)) is not None:
                        outbox.send(frame)
                case Save(changes, ticket, point):
                    self._finishing(changes)
                    future = self.store.save(changes, linger)
                    if source is not None and ticket is not None:
                        self._inflight[source] = future
                    if ticket is None:  # the engine still hears what the rows refused
                        self.pending_writes += 1
                        future.add_done_callback(functools.partial(self._saved, changes))
                    else:
                        self._write(future, ticket, point)
                case Reserve(jobs, wall, ticket, claims, lease, min_lease, guards):
                    self._write(self.store.reserve(jobs, wall, claims, lease, min_lease,
                                                   guards), ticket, "reserve-after-commit")
                case Withdraw():  # a cancel request awaits it (run); anywhere else, a task
                    self.spawn(self.run([effect]), "rota-withdraw")
                case Wake():
                    self._wake.set()
                case Arm(deadline):
                    if deadline < self._timers_wake_at:
                        self._timers.set()
                case Deliver(delivery):
                    self.pusher.deliver(delivery)
                case Finished(job_ids):
                    for job_id in job_ids:
                        self.watching.wake(job_id)
                case Abort(conn, code, message, close_code):
                    if (outbox := self._outboxes.get(conn)) is not None:
                        outbox.abort(code, message, close_code)
                case Note(notes):
                    self._write(self.store.note_status(notes), None, None)
                case WorkerSeen(worker_id, registration, at):
                    self._write(self.store.worker_connected(worker_id, registration, at),
                                None, None)
                case WorkerGone(worker_id, connected_at, wall):
                    self._write(self.store.worker_disconnected(worker_id, connected_at, wall),
                                None, None)

    async def run(self, effects: Iterable[Effect]) -> dict[str, JobRecord | None]:
        """Carry out effects in order, waiting for each plain Save to commit before going
        on: for a request whose answer, or whose frames, depend on it. Returns the
        changes the rows refused (``Store.save``), which the engine has heard of."""
        refused: dict[str, JobRecord | None] = {}
        for effect in effects:
            if isinstance(effect, Save) and effect.ticket is None:
                self._finishing(effect.changes)
                found = await self.store.save(effect.changes)
                if found:
                    refused.update(found)
                    self.apply(self.engine.refused(effect.changes, found, self.clock()))
            elif isinstance(effect, Withdraw):
                self.upkeep.seen([effect.wall])
                try:
                    cancelled = await self.store.withdraw(effect.seq, effect.wall)
                except BaseException:
                    self.apply(self.engine.withdrawn(effect, False))
                    raise
                self.apply(self.engine.withdrawn(effect, cancelled))
            else:
                self.apply([effect])
        return refused

    def _finishing(self, changes: list[Change]) -> None:
        finished = [c.finished_at for c in changes if c.finished_at is not None]
        if finished:
            self.upkeep.seen(finished)

    def _saved(self, changes: list[Change], future: asyncio.Future[dict[str, JobRecord | None]]
               ) -> None:
        """A Save nobody waits on committed: the engine hears what the rows refused."""
        self.pending_writes -= 1
        if future.cancelled():
            return
        if (error := future.exception()) is not None:
            log.log(failure_level(error), "a background write failed: %s", error)
        elif refused := future.result():
            self.apply(self.engine.refused(changes, refused, self.clock()))

    def _write(self, future: asyncio.Future[Any], ticket: int | None, point: str | None) -> None:
        self.pending_writes += 1
        if ticket is None:
            future.add_done_callback(self._written)
        else:  # what the engine releases on this commit goes out before anything else
            self.store.writer.on_settle(future, functools.partial(self._committed, ticket, point))

    def _written(self, future: asyncio.Future[Any]) -> None:
        self.pending_writes -= 1
        if not future.cancelled() and (error := future.exception()) is not None:
            log.log(failure_level(error), "a background write failed: %s", error)

    def _committed(self, ticket: int, point: str | None, future: asyncio.Future[Any]) -> None:
        self.pending_writes -= 1
        error = None if future.cancelled() else future.exception()
        if future.cancelled():
            error = asyncio.CancelledError()
        read = None
        if error is None:
            self.crash_point(point)
            read = future.result()
        self.apply(self.engine.committed(ticket, error, self.clock(), read))

    # -- sockets ---------------------------------------------------------------------
    def attach(self, outbox: Outbox) -> int:
        self._conns += 1
        self._outboxes[self._conns] = outbox
        return self._conns

    def detach(self, conn: int) -> None:
        self._outboxes.pop(conn, None)
        self._inflight.pop(conn, None)

    def receive(self, conn: int, hb: p.Heartbeat, principal: Principal = OPEN, *,
                first: bool = False) -> None:
        """A heartbeat read from connection ``conn`` (``first``: it registers)."""
        now = self.clock()
        effects = []
        if first:
            effects = self.engine.register(conn, hb, principal, now)
            self._no_connections.clear()
        effects += self.engine.heartbeat(conn, hb.worker_id, hb, now)
        self.apply(effects, source=conn, linger=True)  # (results: a worker's ack may wait)

    def repeat(self, conn: int, worker_id: str, seq: int, now: Instant) -> bool:
        """A heartbeat the same as the connection's last but for its seq, read at
        ``now``: False if it must be decoded and received after all (``Heartbeats.repeat``)."""
        effects = self.engine.repeat(conn, worker_id, seq, now)
        if effects:
            self.apply(effects, source=conn)
        return effects is not None

    async def settled(self, conn: int) -> None:
        """Until the results this connection sent are committed and answered."""
        future = self._inflight.get(conn)
        if future is not None:
            await asyncio.wait([future])

    def disconnect(self, conn: int, worker_id: str, reason: str) -> None:
        self.apply(self.engine.disconnect(conn, worker_id, reason, self.clock()))
        if all(c.conn < 0 for c in self.connections.values()):  # (pull workers: no socket)
            self._no_connections.set()

    def outbox(self, conn: int, worker_id: str, full: bool, over: bool) -> None:  # a mark crossed
        self.apply(self.engine.outbox(conn, worker_id, full, over, self.clock()))

    # -- loops -------------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self.apply(self.engine.dispatch(self.clock()))

    async def _timer_loop(self) -> None:
        every = self.engine.tick_every
        while True:
            now = self.clock()
            self.apply(self.engine.tick(now), linger=True)
            self.watching.storage(now)
            deadline = self.engine.next_deadline()
            wait = every if deadline is None else min(every, max(0.0, deadline - now.mono))
            self._timers_wake_at = now.mono + wait
            try:
                await asyncio.wait_for(self._timers.wait(), wait)
            except TimeoutError:
                pass
            self._timers.clear()
