"""The async shell around the engine: it owns the store, the clock and the sockets.

Every decision is the engine's (rota/engine.py). This module feeds it events, with
the time read from the injected clock, and applies the effects it returns, in order:
writes go to the single writer as they come (so they commit in decision order), a
write that carries a ticket reports its outcome back to the engine, and a frame is
sent only when the engine releases it, which for anything that depends on a write is
after its COMMIT. Three loops run beside the sockets: dispatch (a scheduling round
when woken), timers (the engine's ``tick``, at least every ``tick_every``) and tokens.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rota import protocol as p
from rota.auth import OPEN, Principal, Tokens, new_token
from rota.effects import (Abort, Arm, Effect, Finished, Note, Reserve, Save, Send, Wake,
                          Withdraw, WorkerGone, WorkerSeen)
from rota.engine import MAX_LOG_LINES, Engine
from rota.errors import Conflict, DomainError, Invalid, NotFound, StorageError, failure_level
from rota.jobs import EnqueueRequest, same_job
from rota.listing import JobFilter
from rota.model import TERMINAL_STATES, Change, ClockReading, Instant, JobRecord
from rota.observe import busiest
from rota.policy import TokenBucket
from rota.registry import ConnectedWorker, claim_worker_id, held_ids
from rota.retention import BATCH, STEP, Frames, PruneTally, Retention, due, next_pass
from rota.scheduler import Scheduler
from rota.settings import ServerSettings
from rota.shell_directives import ShellDirectives
from rota.shell_reads import ShellReads
from rota.specs import JobSpec, checksum
from rota.store import Store, job_from_row

__all__ = ["Coordinator", "MAX_LOG_LINES", "Outbox", "system_clock"]
log = logging.getLogger("rota.server")
REREAD_EVERY = 0.1  # seconds: the most often an unknown token makes the server look
LOOPS = ("rota-dispatch", "rota-timers", "rota-tokens", "rota-retention", "rota-clock")
MAX_BUCKETS = 100_000  # workers whose rate-limit state is kept across connections
MAX_BULK = 10_000  # jobs one bulk action may touch (its ``limit``)
SHOWN = 100  # ids and skipped jobs a bulk action's answer lists
BULK_CHUNK = 200  # jobs a bulk action handles at once: their writes share commits
BULK_OK = {"retry": frozenset({"discarded", "cancelled"}),
           "cancel": frozenset({"scheduled", "available", "retryable", "active"})}


class Outbox(Protocol):
    """What the shell needs of a worker's connection."""

    def send(self, frame: str) -> None: ...

    def abort(self, code: str, message: str, close_code: int) -> None: ...


@dataclass(eq=False, slots=True)
class Hold:
    """An HTTP request that stays open, of one token (Coordinator.hold)."""

    principal: Principal
    revoked: asyncio.Future[None]


def system_clock() -> Instant:
    return Instant(time.monotonic(), time.time())


CLOCK_EVERY = 5.0  # seconds between the clock readings a store keeps for the next start


@functools.cache
def _boot_id() -> str:
    """Which boot the boot clock counts from: read once, since it cannot change while
    the process lives (an unknown boot matches no other process's reading)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"unknown:{os.getpid()}:{time.monotonic_ns()}"


def clock_reading() -> ClockReading:
    """The wall clock beside the boot clock, and which boot that counts from."""
    return ClockReading(time.time(), time.clock_gettime(time.CLOCK_BOOTTIME), _boot_id())


class Coordinator(ShellReads, ShellDirectives):
    def __init__(self, settings: ServerSettings,
                 clock: Callable[[], Instant] = system_clock) -> None:
        self.settings = settings
        self.clock = clock
        self.store = Store(settings.db,
                           crash_before_commit=settings.crash_at == "enqueue-before-commit",
                           durability=settings.durability, max_db_size=settings.max_db_size,
                           database_url=settings.database_url, db_pool=settings.db_pool,
                           lease=settings.server_lease, hold_reserve=settings.hold_reserve)
        # Its name among the servers sharing a database (docs/scaling.md): reservations
        # carry it, so that the others know whose workers hold what.
        self.server_id = settings.server_id or f"{socket.gethostname()}:{settings.port}"
        self.store.server_id = self.server_id
        self.engine = Engine(settings)
        self.retention = Retention.from_rules(
            {"completed": settings.retain_completed, "discarded": settings.retain_discarded,
             "cancelled": settings.retain_cancelled}, settings.retain_queues)
        self.tokens = Tokens()
        self.frames = Frames()  # the wall clock's steps this run, for retention
        self.sockets: collections.Counter[str | None] = collections.Counter()  # per token id
        self.waits: collections.Counter[str | None] = collections.Counter()  # per token id
        self._holds: set[Hold] = set()
        self._token_rows: list[dict[str, Any]] = []
        self._outboxes: dict[int, Outbox] = {}
        self._conns = 0
        self._inflight: dict[int, asyncio.Future[Any]] = {}  # conn -> its latest results write
        self.pending_writes = 0  # handed to the writer, outcome not yet applied
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}  # by worker id
        self._wake = asyncio.Event()
        self._timers = asyncio.Event()
        self._timers_wake_at = 0.0  # when the timer loop will next look, unless poked
        self._tasks: set[asyncio.Task[Any]] = set()
        self._waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._retrying: set[str] = set()  # retries whose row is being written
        self._reread: asyncio.Future[None] | None = None  # see reread_tokens
        self._reread_at = 0.0
        self._no_connections = asyncio.Event()
        self._no_connections.set()
        self._stopping = False
        self.started = clock()
        self.frames.look(self.started.wall, self.started.mono)
        # Event ids go on from a clock reading (microseconds since the epoch, as of the
        # start), so that they keep growing across restarts: a client that resumes with an
        # id of the previous run hears of the gap instead of skipping the new events.
        self.engine.observe.next_id = int(self.started.wall * 1_000_000)
        self._pulse: asyncio.Future[None] | None = None  # resolved when events come
        self._subscribers = 0
        self._storage_seen: Any = None  # the store's degradation last reported as an event
        # Run at a stop once the connections are closed, before the store closes (the
        # cluster ends its lease there).
        self.on_stop: list[Callable[[], Coroutine[Any, Any, None]]] = []

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
    def stopping(self) -> bool:
        return self._stopping

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
            await self._refresh_tokens()
        except BaseException:  # no stop() follows a failed start: end the store's threads
            await asyncio.to_thread(self.store.close)
            raise
        if not self.tokens.required:
            log.warning("AUTH IS OFF: no tokens exist, so anyone who can reach this server may"
                        " take jobs and give orders. Create one: rota tokens create --scope admin")
        self.apply(self.engine.load(snapshot.status_quo, snapshot.checksums, snapshot.jobs,
                                    self.clock(), snapshot.waiting, snapshot.last_seq,
                                    snapshot.retired, snapshot.paused))
        log.info("store db=%s durability=%s specs=%d live_jobs=%d", self.store.where,
                 self.settings.durability, len(self.specs), self.scheduler.live())
        self.spawn(self._dispatch_loop(), "rota-dispatch")
        self.spawn(self._timer_loop(), "rota-timers")
        self.spawn(self._token_loop(), "rota-tokens")
        if kept:
            self.spawn(self._clock_loop(), "rota-clock")
        log.info("retention %s", self.retention.describe())
        if self.retention.durations():
            self.spawn(self._retention_loop(), "rota-retention")

    def begin_shutdown(self) -> None:
        self.engine.begin_shutdown()
        # uvicorn waits for every request in flight before the lifespan ends: a long poll
        # (?wait= up to max_result_wait) would hold a deploy's restart for minutes. Each
        # gets its answer now, the job as it stands (202 if not finished).
        self._stopping = True
        for job_id in list(self._waiters):
            self._wake_waiters(job_id)
        self._events_came()  # and GET /events streams end

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
        # A step not yet seen (no restamp written) leaves the last reading, on the clock
        # the rows were written with: the next start then sees the step and undoes it.
        if not self.store.shared and not self._step_unseen():
            try:  # the latest reading, for the next start
                await self.store.note_clock(clock_reading())
            except Exception as exc:  # noqa: BLE001 (a stop goes on: the last reading stays)
                log.debug("clock reading not stored at stop: %s", exc)
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
    def apply(self, effects: Iterable[Effect], source: int | None = None) -> None:
        """Carry out effects in order, without waiting on any of them. ``source``: the
        connection whose frame they answer; its ticketed writes are what ``settled``
        waits for."""
        for effect in effects:
            match effect:
                case Send(conn, frame):
                    if (outbox := self._outboxes.get(conn)) is not None:
                        outbox.send(frame)
                case Save(changes, ticket, point):
                    self._finishing(changes)
                    future = self.store.save(changes)
                    if source is not None and ticket is not None:
                        self._inflight[source] = future
                    if ticket is None:  # the engine still hears what the rows refused
                        self.pending_writes += 1
                        future.add_done_callback(functools.partial(self._saved, changes))
                    else:
                        self._write(future, ticket, point)
                case Reserve(jobs, wall, ticket, claims, lease, min_lease):
                    self._write(self.store.reserve(jobs, wall, claims, lease, min_lease),
                                ticket, "reserve-after-commit")
                case Withdraw():  # a cancel request awaits it (run); anywhere else, a task
                    self.spawn(self.run([effect]), "rota-withdraw")
                case Wake():
                    self._wake.set()
                case Arm(deadline):
                    if deadline < self._timers_wake_at:
                        self._timers.set()
                case Finished(job_ids):
                    for job_id in job_ids:
                        self._wake_waiters(job_id)
                case Abort(conn, code, message, close_code):
                    if (outbox := self._outboxes.get(conn)) is not None:
                        outbox.abort(code, message, close_code)
                case Note(notes):
                    self._write(self.store.note_status(notes), None, None)
                case WorkerSeen(worker_id, registration, connected_at):
                    self._write(self.store.worker_connected(worker_id, registration,
                                                            connected_at), None, None)
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
                self._clock_seen([effect.wall])
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
            self._clock_seen(finished)

    def _clock_seen(self, finished: Iterable[float] = (), *, now: bool = False) -> None:
        """A reading of the clocks for retention (``Frames``), with the moments of jobs
        about to be stored as finished; a step of the wall clock is logged once, and the
        waiting jobs' stored deadlines follow it (``Engine.restamp``): ``now``, or, from
        inside ``apply``, after the writes being handed over."""
        reading = self.clock()
        step = self.frames.seen(finished, reading.wall, reading.mono)
        if not step:
            return
        log.warning("wall clock stepped %+.1fs while running: no deadline moves (they are"
                    " monotonic); retention judges each finished job by the clock that"
                    " stored it", step)
        if self.store.shared:  # servers sharing a database keep their clocks in step
            return
        if now:
            self.apply(self.engine.restamp(reading))
        else:
            asyncio.get_running_loop().call_soon(
                lambda: self.apply(self.engine.restamp(self.clock())))

    def _step_unseen(self) -> bool:
        """Whether the wall clock stepped since the last look (``Frames``)."""
        reading = self.clock()
        return abs(reading.wall - reading.mono - self.frames.frames[-1].offset) > STEP

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
        self.apply(effects, source=conn)

    async def take_over(self, hb: p.Heartbeat, principal: Principal = OPEN) -> None:
        """Before a registration is handled: on a database several servers share, the
        jobs the worker holds that another server reserved become this server's (their
        rows say so, fenced on the worker and the attempt's state), so the worker goes
        on with them here instead of being told they were lost. Only the jobs a worker
        of the caller's token holds, of queues it may serve: a worker id taken by another
        token takes nothing, and is refused before any row moves."""
        if not self.store.shared:
            return
        named = held_ids(hb.status) if hb.status is not None else []
        held = {*named, *(r.job_id for r in hb.results)} - self.scheduler.jobs.keys()
        if not held:
            return
        here = self.engine.registry.get(hb.worker_id)  # connected here: its token's id
        if here is not None:
            claim_worker_id(hb.worker_id, [here.principal.token_id], principal)
        try:
            jobs, others = await self.store.take_over(hb.worker_id, sorted(held),
                                                      principal.token_id, principal.queues)
        except StorageError as exc:  # then as on one server: they come back later
            log.warning("take over jobs=%d worker=%s failed: %s", len(held), hb.worker_id, exc)
            return
        # Jobs it names that another token's worker holds through another server: the
        # worker id is that token's, as if they were kept here (Registry.admit). The
        # store moved no row then.
        claim_worker_id(hb.worker_id, others, principal)
        self.apply(self.engine.taken_over(jobs, hb.worker_id, self.clock()))

    async def settled(self, conn: int) -> None:
        """Until the results this connection sent are committed and answered."""
        future = self._inflight.get(conn)
        if future is not None:
            await asyncio.wait([future])

    def disconnect(self, conn: int, worker_id: str, reason: str) -> None:
        self.apply(self.engine.disconnect(conn, worker_id, reason, self.clock()))
        if not self.connections:
            self._no_connections.set()

    def outbox(self, conn: int, worker_id: str, full: bool, over: bool) -> None:
        """What connection ``conn`` has not read crossed a mark (rota/sessions.py)."""
        self.apply(self.engine.outbox(conn, worker_id, full, over, self.clock()))

    def buckets_for(self, worker_id: str) -> tuple[TokenBucket, TokenBucket]:
        """A worker's rate-limit buckets (frames, bytes), the same on every connection it
        opens; the least recently used go when there are too many."""
        buckets = self._buckets.pop(worker_id, None)
        if buckets is None:
            settings = self.settings
            buckets = (TokenBucket(settings.rate_limit, settings.rate_burst),
                       TokenBucket(settings.rate_bytes, settings.rate_bytes_burst))
        self._buckets[worker_id] = buckets
        if len(self._buckets) > MAX_BUCKETS:
            self._buckets.pop(next(iter(self._buckets)))
        return buckets

    def direct(self, worker_ids: Iterable[str], state: str) -> list[str]:
        directed = self.engine.registry.direct(worker_ids, state)
        wall = self.clock().wall
        for worker_id in directed:
            self.engine.observe.event(wall, "worker_state", worker=worker_id, state=state)
        return directed

    def select_workers(self, *, label: str | None = None, every: bool = False) -> list[str]:
        return self.engine.registry.select(label=label, every=every)

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
            self.apply(self.engine.tick(now))
            self._watch_storage(now)
            deadline = self.engine.next_deadline()
            wait = every if deadline is None else min(every, max(0.0, deadline - now.mono))
            self._timers_wake_at = now.mono + wait
            try:
                await asyncio.wait_for(self._timers.wait(), wait)
            except TimeoutError:
                pass
            self._timers.clear()

    async def _token_loop(self) -> None:
        """Tokens are created and revoked from the CLI, straight into the file: look every
        heartbeat interval, so that a revoked worker is gone within one."""
        failed = ""
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                await self._refresh_tokens()
            except StorageError:  # the store's health says so; the last table stands
                pass
            except Exception as exc:  # a bug: said once, and the loop goes on, or a
                # revoked token would keep working and a new one never be required
                if str(exc) != failed:
                    log.exception("reading the tokens failed; the last table stands")
                failed = str(exc)
            else:
                failed = ""

    async def _clock_loop(self) -> None:
        """Keep a clock reading in the store every CLOCK_EVERY seconds: the next start
        tells a step of the wall clock from the time that passed by it."""
        while True:
            await asyncio.sleep(CLOCK_EVERY)
            self._clock_seen(now=True)  # the rows follow a step before the reading is kept
            try:
                await self.store.note_clock(clock_reading())
            except StorageError as exc:  # the next reading tries again
                log.debug("clock reading not stored: %s", exc)

    async def _retention_loop(self) -> None:
        """Delete finished jobs past their retention, one batch per writer transaction:
        each batch is queued behind the writes already waiting, so none waits long."""
        tally = PruneTally()
        wait: float | None = 0.0
        while wait is not None:
            await asyncio.sleep(wait)
            self._clock_seen()
            now = self.clock()
            try:  # _retrying: rows a manual retry read and is about to write back
                deleted = await self.store.prune(
                    due(self.retention, now.wall, self.frames, now.mono), BATCH, self._retrying)
            except StorageError:  # the store's health says so; try again later
                deleted = {}
            if (line := tally.add(deleted, now.mono)) is not None:
                log.info("%s", line)
            wait = next_pass(sum(deleted.values()), self.retention)

    async def reread_tokens(self) -> None:
        """Read the tokens now, for a request whose token is not known yet: `rota tokens
        create` writes the file, and a token used at once was refused until the next
        look (up to a heartbeat interval). Reads are shared by the requests that come
        while one runs, and made at most every REREAD_EVERY seconds (an unknown id costs
        a caller nothing more than that)."""
        if self._reread is None:
            now = time.monotonic()
            if now - self._reread_at < REREAD_EVERY:
                return
            self._reread_at = now
            self._reread = asyncio.ensure_future(self._refresh_tokens())
            self._reread.add_done_callback(self._reread_done)
        await asyncio.shield(self._reread)

    def _reread_done(self, future: asyncio.Future[None]) -> None:
        self._reread = None
        if not future.cancelled() and future.exception() is not None:
            log.warning("reading tokens failed: %s", future.exception())

    async def _refresh_tokens(self) -> None:
        rows = await self.store.live_tokens()
        if rows == self._token_rows:
            return
        was_required = self.tokens.required
        self._token_rows, self.tokens = rows, Tokens(rows)
        log.info("tokens live=%d auth=%s", len(rows), "on" if self.tokens.required else "off")
        if was_required and not self.tokens.required:
            log.warning("AUTH IS OFF: the last token was revoked")
        self.apply(self.engine.revoked(self.tokens.valid))
        ended: collections.Counter[str | None] = collections.Counter()
        for hold in self._holds:
            if not hold.revoked.done() and not self.tokens.valid(hold.principal):
                hold.revoked.set_result(None)
                ended[hold.principal.token_id] += 1
        for token_id, n in ended.items():
            log.warning("token revoked token=%s: ending %d HTTP stream(s) and wait(s)",
                        token_id or "none", n)

    # -- HTTP requests that stay open (GET /events, result waits) ---------------------
    def hold(self, principal: Principal) -> Hold | None:
        """Count an HTTP request that stays open against its token's share (None: the
        token has max_waits_per_token open already); its ``revoked`` resolves if the
        token is revoked meanwhile. ``release`` it when it ends."""
        if self.waits[principal.token_id] >= self.settings.max_waits_per_token:
            return None
        self.waits[principal.token_id] += 1
        hold = Hold(principal, asyncio.get_running_loop().create_future())
        self._holds.add(hold)
        if not self.tokens.valid(principal):  # revoked since the request was let in
            hold.revoked.set_result(None)
        return hold

    def release(self, hold: Hold) -> None:
        if hold in self._holds:
            self._holds.remove(hold)
            token_id = hold.principal.token_id
            self.waits[token_id] -= 1
            if self.waits[token_id] <= 0:
                del self.waits[token_id]

    async def create_token(self, scope: str, name: str | None, queues: list[str] | None
                           ) -> tuple[str, dict[str, Any]]:
        """A new token (POST /tokens): its secret, shown this once, and its row. In force
        at once: the first one turns authentication on before the answer leaves."""
        token_id, secret, hashed = new_token()
        row = await self.store.create_token(name=name or f"{scope}-{token_id}", scope=scope,
                                            queues=queues, token_id=token_id, hashed=hashed)
        await self._refresh_tokens()
        return secret, row

    async def revoke_token(self, id_or_name: str) -> list[dict[str, Any]]:
        """Revoke tokens (DELETE /tokens/{token}), at once: their workers are closed."""
        rows = await self.store.revoke_token(id_or_name)
        if not rows:
            raise NotFound("not_found", f"no live token with id or name {id_or_name!r}")
        await self._refresh_tokens()
        return rows

    # -- producers -------------------------------------------------------------------
    async def enqueue(self, requests: list[EnqueueRequest], principal: Principal = OPEN
                      ) -> list[tuple[dict[str, Any], bool] | DomainError]:
        """Store jobs in one transaction; per request the row and whether it is new, or why not."""
        now = self.clock()
        built = [self.engine.build(request, principal, now) for request in requests]
        jobs = [job for job in built if not isinstance(job, DomainError)]
        # A job whose id the server made cannot collide with a stored row: it is taken
        # in at once, and a scheduling round now queues its reservation right behind its
        # row (see Intake.enqueued). A producer's id waits for the commit to say whether
        # the job is new.
        early = [job for request, job in zip(requests, built, strict=True)
                 if request.id is None and not isinstance(job, DomainError)]
        # A producer's id new under its kept form may name a job this token enqueued
        # before ids were kept so (rota/auth.py): the store answers with that one.
        unscoped = [principal.unscoped_id(request.id) if request.id is not None else None
                    for request, job in zip(requests, built, strict=True)
                    if not isinstance(job, DomainError)]
        written = (self.store.enqueue(jobs, live=self.scheduler.live(), unscoped=unscoped)
                   if jobs else None)
        if early:
            effects = self.engine.enqueued_all([(job, None) for job in early], now)
            self.apply(effects + self.engine.dispatch(now))
        try:
            stored = iter(await written if written is not None else [])
        except Exception as exc:
            self.apply(self.engine.not_stored(early, exc))
            raise
        self.crash_point("enqueue-after-commit")
        outcomes: list[tuple[dict[str, Any], bool] | DomainError] = []
        admitted = {id(job) for job in early}
        taken_in: list[tuple[JobRecord, int | None]] = []  # new rows with producers' ids
        for request, job in zip(requests, built, strict=True):
            if isinstance(job, DomainError):
                outcomes.append(job)
                continue
            row, created = next(stored)
            if id(job) in admitted:
                self.engine.stored(job, row["rowid"])
                outcomes.append((row, created))
                continue
            if not created:
                # A producer's ids are its own: a row under one that it did not make (an
                # admin chose that id) is not shown to it either.
                theirs = principal.owns_ids and row["created_by"] != principal.token_id
                if theirs or not same_job(row, job, request.args):
                    outcomes.append(Conflict("id_conflict", f"job {request.id} exists with a"
                                             " different spec, queue, priority or args"))
                    continue
            else:
                taken_in.append((job, row["rowid"]))
            outcomes.append((row, created))
        if taken_in:
            self.apply(self.engine.enqueued_all(taken_in, now))
        return outcomes

    async def cancel(self, job_id: str) -> tuple[dict[str, Any], bool]:
        """Cancel a job: at once if it waits, through its worker if it runs.
        Returns the stored job and whether it is cancelled already."""
        for look in range(2):
            job = self.engine.scheduler.jobs.get(job_id)
            was = (job.state, job.cancel_requested) if job is not None else None
            outcome, effects = self.engine.cancel(job_id, self.clock())
            if outcome != "not_live":
                break
            row = await self.store.get_job(job_id)
            if row is None:
                raise NotFound("not_found", f"no job {job_id}")
            if row["state"] == "available":  # kept as a key only: its row decides
                outcome, effects = self.engine.cancel_waiting(row, self.clock())
                break
            if (self.store.shared and row["state"] == "active"
                    and await self.store.request_cancel(job_id) is not None):
                # Its worker is another server's: that server passes the cancel on.
                return await self._row(job_id), False
            if row["state"] in TERMINAL_STATES or look:
                raise Conflict("not_cancellable", f"job {job_id} is {row['state']}")
            # Held as a key while its row still says otherwise, or reserved from its
            # key since cancel() looked: once the writes queued before now are
            # committed and reported, memory and row agree. Look again.
            await self.store.barrier()
        try:
            refused = await self.run(effects)
        except StorageError:
            if job is not None and was is not None:
                self.apply(self.engine.cancel_not_stored(job, was))
            raise
        row = await self._row(job_id)
        if job_id in refused:  # the row moved on behind this server's copy
            return await self._cancel_moved_on(job_id, row)
        if outcome == "withdrawing":
            if row["state"] == "cancelled":
                return row, True
            # Reserved before the cancel was written: cancel it where it runs now.
            outcome, effects = self.engine.cancel(job_id, self.clock())
            if outcome == "not_live":
                raise Conflict("not_cancellable", f"job {job_id} is {row['state']}")
            await self.run(effects)
            row = await self._row(job_id)
        return row, outcome == "cancelled" and row["state"] == "cancelled"

    async def _cancel_moved_on(self, job_id: str, row: dict[str, Any]
                               ) -> tuple[dict[str, Any], bool]:
        """A cancel the job's row refused: another server reserved or finished the job
        first (or the row was written directly). The cancel goes where the job runs now,
        as for any job another server's worker holds; a finished one is not cancellable."""
        if (self.store.shared and row["state"] == "active"
                and await self.store.request_cancel(job_id) is not None):
            return await self._row(job_id), False
        if row["state"] == "cancelled":
            return row, True
        if row["state"] in TERMINAL_STATES:
            raise Conflict("not_cancellable", f"job {job_id} is {row['state']}")
        return row, False

    async def retry(self, job_id: str) -> dict[str, Any]:
        """Put a discarded or cancelled job back, with a fresh attempt budget."""
        if job_id in self._retrying:
            raise Conflict("not_retryable", f"job {job_id} is being retried already")
        # The row is written before workers see the job: until then a second retry, which
        # may have read the row as it was, must not put the job back a second time. And
        # marked before it is read, and read in the writer's order, so that retention
        # cannot delete the row between this read and the write that puts it back: a
        # prune queued after the read skips ids marked here (Store.prune).
        self._retrying.add(job_id)
        try:
            row = await self.store.get_job_in_order(job_id)
            if row is None:
                raise NotFound("not_found", f"no job {job_id}")
            if row["state"] not in ("discarded", "cancelled") or self.engine.is_live(job_id):
                raise Conflict("not_retryable", f"job {job_id} is {row['state']}; only"
                               " discarded or cancelled jobs can be retried")
            job = job_from_row(row)
            if await self.run(self.engine.retry(job)):
                # The row moved on since it was read (another server retried it first).
                raise Conflict("not_retryable", f"job {job_id} changed while it was being"
                               " retried; read it again")
            self.apply(self.engine.retried(job, self.clock()))
        finally:
            self._retrying.discard(job_id)
        return await self._row(job_id)

    async def _row(self, job_id: str) -> dict[str, Any]:
        row = await self.store.get_job(job_id)
        assert row is not None
        return row

    async def wait_for_result(self, job_id: str, timeout: float,
                              revoked: asyncio.Future[None] | None = None
                              ) -> dict[str, Any] | None:
        """The job's row as soon as it is terminal, or as it stands when ``timeout`` runs
        out (or at once when ``revoked`` resolves: the caller's token was revoked)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(job_id, []).append(waiter)
        try:
            row = await self.store.get_job(job_id)
            if row is None or row["state"] in TERMINAL_STATES or timeout <= 0 or self._stopping:
                return row
            await asyncio.wait([waiter] if revoked is None else [waiter, revoked],
                               timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
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

    async def retire_spec(self, name: str, *, cancel_waiting: bool) -> dict[str, Any]:
        """Refuse new jobs of spec ``name`` from now on; say what becomes of its jobs.
        Those waiting still run on workers that match its status quo, unless
        ``cancel_waiting``: then each is cancelled as ``DELETE /jobs/{id}`` would."""
        retired = await self.store.retire_spec(name, self.clock().wall)
        if retired is None:
            raise NotFound("not_found", f"spec {name!r} has no status quo")
        checksum_, at, already = retired
        matching = self.engine.retire(name, checksum_, at)
        counts, waiting = await self.store.spec_jobs(name)
        cancelled = 0
        if cancel_waiting:
            for job_id in waiting:
                try:
                    _, done = await self.cancel(job_id)
                except (NotFound, Conflict):  # it finished or started meanwhile
                    continue
                cancelled += done
            counts, _ = await self.store.spec_jobs(name)
        return {"name": name, "checksum": checksum_, "retired_at": p.rfc3339(at),
                "already_retired": already, "jobs": counts, "cancelled": cancelled,
                "matching_workers": matching}

    async def push_specs(self, specs: list[JobSpec], *, dry_run: bool) -> list[dict[str, Any]]:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise Invalid("duplicate_spec", "a spec name appears twice in the push")
        changes = await self.store.push_specs([(s, checksum(s)) for s in specs], dry_run=dry_run)
        if not dry_run:
            self.apply(self.engine.status_quo_changed(specs, changes, self.clock()))
        return [self.engine.change_report(c) for c in changes]

    # -- what the operator watches (rota/observe.py) -----------------------------------
    def _watch_storage(self, now: Instant) -> None:
        """A state_change event when the store becomes degraded or recovers (seen at
        each timer tick: the store's health has no listener, and a tick is often enough)."""
        degraded = self.store.health.degraded
        if degraded is self._storage_seen:
            return
        if degraded is None:
            self.engine.observe.event(now.wall, "state_change", state="storage_ok",
                                      message="storage recovered: writes succeed again")
        elif self._storage_seen is None or degraded.code != self._storage_seen.code:
            self.engine.observe.event(now.wall, "state_change", state="storage_degraded",
                                      message=f"{degraded.code}: {degraded.message}")
        self._storage_seen = degraded

    def subscribe(self) -> None:
        """A GET /events subscriber starts listening: events wake it from now on."""
        self._subscribers += 1
        self.engine.observe.listener = self._events_came

    def unsubscribe(self) -> None:
        self._subscribers -= 1
        if not self._subscribers:  # recording goes back to costing one test
            self.engine.observe.listener = None
            self.engine.observe.encoded.clear()

    def _events_came(self) -> None:
        pulse = self._pulse
        if pulse is not None:
            self._pulse = None
            if not pulse.done():
                pulse.set_result(None)

    def events_pulse(self) -> asyncio.Future[None]:
        """Resolved when the next events are recorded: shared by every subscriber."""
        if self._pulse is None:
            self._pulse = asyncio.get_running_loop().create_future()
        return self._pulse

    async def oldest_available(self) -> dict[str, float]:
        """Per queue with available jobs, since when (wall) its oldest one waits: for the
        ``max_series`` queues with the most (producers name queues; each is a probe)."""
        waiting: dict[str, int] = {}
        for (queue, _), n in self.scheduler.ready_counts().items():
            waiting[queue] = waiting.get(queue, 0) + n
        return await self.store.oldest_available_since(
            busiest(waiting, self.settings.max_series))

    async def stats(self, minutes: int) -> dict[str, Any]:
        """GET /stats: counts per minute over the last ``minutes`` per queue and spec,
        and the age of each queue's oldest available job."""
        now = self.clock()
        starts, series = self.engine.observe.window(minutes, now.wall)
        oldest = await self.oldest_available()
        queues = set(oldest) | {row["queue"] for row in series} | {
            q for w in self.scheduler.workers.values() for q in w.queues}
        return {"now": p.rfc3339(now.wall),
                "minute_starts": [p.rfc3339(m * 60.0) for m in starts],
                "series": [{k: row[k] for k in ("queue", "spec", "enqueued", "completed",
                                                 "failed", "discarded", "retried",
                                                 "cancelled")} for row in series],
                "oldest_available": {q: (None if oldest.get(q) is None
                                         else round(max(0.0, now.wall - oldest[q]), 3))
                                     for q in sorted(queues)}}

    # -- operators: queues, bulk actions ----------------------------------------------
    async def pause_queue(self, name: str, paused: bool) -> dict[str, Any]:
        """Pause or resume a queue: stored first, so a restart keeps it; then no round
        assigns its jobs (or, resumed, the next round does)."""
        now = self.clock()
        await self.store.set_paused(name, paused, now.wall)
        self.apply(self.engine.pause_queue(name, paused, now))
        return {"queue": name, "paused": paused}

    async def bulk(self, action: str, ids: list[str] | None = None,
                   flt: JobFilter | None = None, dry_run: bool = False,
                   limit: int = 1000) -> dict[str, Any]:
        """Retry or cancel the jobs named by ``ids`` or matching ``flt``, at most ``limit``
        of them (newest first), each as its single-job route would. A dry run says what
        would be touched and changes nothing."""
        if action not in BULK_OK:
            raise Invalid("invalid_request", f"unknown bulk action {action!r}")
        if (ids is None) == (flt is None):
            raise Invalid("invalid_request", "give either ids or filter")
        if not 1 <= limit <= MAX_BULK:
            raise Invalid("invalid_request", f"limit must be between 1 and {MAX_BULK}")
        if ids is not None:
            unique = list(dict.fromkeys(ids))
            chosen, truncated, matched = unique[:limit], len(unique) > limit, len(unique)
            states = await self.store.job_states(chosen)
            found = [(job_id, states.get(job_id)) for job_id in chosen]
        else:
            assert flt is not None
            rows, stopped = await self.store.match_jobs(flt, limit)
            found = rows[:limit]
            matched = len(found)
            truncated = stopped or len(rows) > limit
            if len(rows) > limit:  # more than the cap: counted (up to lookup.COUNT_CAP)
                matched = max(await self.store.count_jobs(flt), limit + 1)
        eligible: list[str] = []
        skipped: list[dict[str, str]] = []
        for job_id, state in found:
            if state in BULK_OK[action]:
                eligible.append(job_id)
            else:
                skipped.append({"id": job_id, "reason": "no such job" if state is None
                                else f"job is {state}"})
        touched = eligible
        if not dry_run:
            touched = []
            for start in range(0, len(eligible), BULK_CHUNK):
                chunk = eligible[start:start + BULK_CHUNK]
                outcomes = await asyncio.gather(*(self._bulk_one(action, job_id)
                                                  for job_id in chunk))
                for job_id, refused in zip(chunk, outcomes, strict=True):
                    if refused is None:
                        touched.append(job_id)
                    else:  # it changed since it was read
                        skipped.append({"id": job_id, "reason": refused})
        return {"action": action, "dry_run": dry_run, "matched": matched,
                "touched": len(touched), "ids": touched[:SHOWN], "skipped": skipped[:SHOWN],
                "truncated": truncated}

    async def _bulk_one(self, action: str, job_id: str) -> str | None:
        """One job of a bulk action: None if done, else why not."""
        try:
            if action == "retry":
                await self.retry(job_id)
            else:
                await self.cancel(job_id)
        except (NotFound, Conflict) as exc:
            return exc.message
        return None
