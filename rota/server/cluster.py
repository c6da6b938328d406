"""One of several servers on one PostgreSQL database: the shell of that (docs/scaling.md).

It holds this server's lease (a row of ``servers``, renewed a few times per lease),
watches the others' and recovers the reservations of one whose lease lapsed more than
the reconnect grace ago, and turns the notices the others' writes send (rota/store/fleet.py)
into engine events: jobs that wait again are taken in, a changed status quo or paused
queue is read again, a cancel for a job this server's worker runs is passed on.
Every decision stays the engine's; this only reads, listens and applies.

``barrier`` waits until every notice committed before it was called has been handled
here: an OJS FETCH (rota/server/pulling.py) waits on it, so that a job pushed, or a
queue paused, through another server a moment before is seen as the worker expects.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rota.store import fleet
from rota.server.coordinator import Coordinator
from rota.core.engine import Engine
from rota.store.pg import Listener
from rota.store.store import Store
from rota.core.verdicts import parse_target

log = logging.getLogger("rota.server")
T = TypeVar("T")
BARRIER_WAIT = 1.0  # seconds a barrier waits for its notice to come back (then goes on)
READS = ("rota-cluster-specs", "rota-cluster-queues", "rota-cluster-limits",
         "rota-cluster-secrets")


class Cluster:
    def __init__(self, coordinator: Coordinator, database_url: str, *, store: Store,
                 engine: Engine, url: str = "") -> None:
        self.coordinator = coordinator  # the shell: its clock, and it applies effects
        self.store = store
        self.engine = engine
        self.me = coordinator.server_id
        self.lease = coordinator.settings.server_lease
        self.grace = coordinator.settings.reconnect_grace
        self.url = url  # where this server's workers reach it, for the operator
        self.listener = Listener(database_url, fleet.CHANNELS, self._heard,
                                 on_connect=self._connected)
        self._pending: set[int] = set()  # row ids heard of, not yet read
        self._arrived = asyncio.Event()
        self._missed: set[str] = set()  # servers seen past their lease, not yet recovered
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = False  # the coordinator has started: notices may become events
        self._lapsed = False  # this server's lease was found lapsed, not yet settled
        # The barrier: job notices heard, and of them taken in; the barriers waiting.
        self._heard_jobs = self._taken_jobs = 0
        self._took = asyncio.Event()
        self._syncs: dict[str, asyncio.Future[None]] = {}
        self._sync_count = 0
        coordinator.mailbox.barrier = self.barrier  # (a FETCH's: rota/server/pulling.py)
        coordinator.admission.barrier = self.barrier  # (a push-executed job's enqueue)

    @classmethod
    def of(cls, coordinator: Coordinator, database_url: str, *, url: str = "") -> Cluster:
        """The cluster shell of ``coordinator``, handed the store and the engine it owns."""
        return cls(coordinator, database_url, store=coordinator.store,
                   engine=coordinator.engine, url=url)

    async def listen(self) -> None:
        """Before the coordinator reads its snapshot: a job another server makes wait
        from now on is heard (and taken in once ``start`` runs), so none falls between
        the snapshot and the first notice."""
        self.listener.start()
        try:
            await asyncio.wait_for(self.listener.listening.wait(), timeout=15)
        except TimeoutError:
            log.warning("cluster: not listening yet; other servers' work is heard once it is")

    def start(self) -> None:
        """Once the coordinator started: take in what was heard meanwhile, and watch the
        leases."""
        self._ready = True
        coordinator = self.coordinator
        # Its lease was taken as the store loaded, after the coordinator was made.
        coordinator.apply(self.engine.lease_taken(coordinator.started.mono, coordinator.clock()))
        self._spawn(self._take_in_loop(), "rota-cluster-jobs")
        self._spawn(self._lease_loop(), "rota-cluster-leases")
        if self._pending:
            self._arrived.set()
        log.info("cluster server=%s lease=%gs grace=%gs: sharing the database with any"
                 " other server on it", self.me, self.lease, self.grace)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.listener.stop()

    async def let_go(self) -> None:
        """A clean stop, before the store closes: the lease ends now, so the others
        recover what this server's workers still hold after the grace alone."""
        try:
            await self.store.let_lease_lapse()
        except Exception as exc:  # the database is gone too: the lease lapses by itself
            log.warning("could not end this server's lease at stop: %s", exc)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    # -- notices ---------------------------------------------------------------------
    def _connected(self) -> None:
        """LISTEN holds (again). Before ``start`` the snapshot still to be read covers what
        came before; after it, notices sent while nobody listened are lost, so read what
        they would have said."""
        if self._ready:
            # (The listener said at WARNING that it listens again.)
            log.info("cluster: reading what other servers changed while this server could"
                     " not hear them")
            self._spawn(self._catch_up(), "rota-cluster-catch-up")

    def _heard(self, channel: str, payload: str) -> None:
        origin, words = fleet.parse(payload)
        if channel == fleet.SYNC:
            if origin == self.me and words:
                self._synced(words[0])
            return
        if origin == self.me:  # this server's own writes: its engine knows already
            return
        if channel == fleet.JOBS:
            self._heard_jobs += 1
            self._pending.update(int(w) for w in words if w.isdigit())
            self._arrived.set()
        elif not self._ready:  # the snapshot being read holds the status quo and pauses
            return
        elif channel == fleet.SPECS:
            self._spawn(self._read_status_quo(), "rota-cluster-specs")
        elif channel == fleet.QUEUES:
            self._spawn(self._read_paused(), "rota-cluster-queues")
        elif channel == fleet.LIMITS:
            self._spawn(self._read_limits(), "rota-cluster-limits")
        elif channel == fleet.SECRETS:  # a signing secret set or deleted there
            self._spawn(self._persist(self.coordinator.secrets.reload, "read the secrets"),
                        "rota-cluster-secrets")
        elif channel == fleet.WORKERS and len(words) == 2:
            self._direct(origin, words[0], words[1])
        elif channel == fleet.CANCEL and len(words) == 2 and words[0] == self.me:
            self._pass_cancel(words[1], f"server={origin}")

    def _pass_cancel(self, job_id: str, source: str) -> None:
        """A cancel another server stored for a job this server's worker runs."""
        outcome, effects = self.engine.cancel(job_id, self.coordinator.clock())
        log.info("cancel job=%s from %s: %s", job_id, source, outcome)
        self.coordinator.apply(effects)

    def _direct(self, origin: str, state: str, target: str) -> None:
        """An operator's directive given through another server, for the workers here."""
        coordinator = self.coordinator
        kind, name = parse_target(target)
        if kind == "id":
            chosen = [name] if name in self.engine.connections else []
        else:
            chosen = coordinator.select_workers(label=name if kind == "label" else None,
                                                every=kind == "all")
        directed = coordinator.direct(chosen, state)
        if directed:
            log.info("directive state=%s workers=%s from server=%s", state,
                     ",".join(directed), origin)

    async def _take_in_loop(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            heard = self._heard_jobs
            seqs, self._pending = sorted(self._pending), set()
            jobs = await self._persist(lambda: self.store.waiting_jobs(seqs),
                                       f"read {len(seqs)} job(s) another server made wait")
            coordinator = self.coordinator
            coordinator.apply(self.engine.taken_in(jobs, coordinator.clock()))
            self._taken_jobs = heard
            self._took.set()

    # -- the barrier -------------------------------------------------------------------
    async def barrier(self) -> None:
        """Until every notice committed before this call has been handled here: this
        server NOTIFYs itself, and PostgreSQL delivers notices in commit order, so when
        its own comes back the others' are heard; then until the jobs they named are
        taken in and the reads they started are done. One round trip, at most
        BARRIER_WAIT seconds (then it logs and goes on)."""
        self._sync_count += 1
        token = str(self._sync_count)
        heard = self._syncs[token] = asyncio.get_running_loop().create_future()
        try:
            await self.store.writer.submit(
                lambda conn: fleet.notify(conn, fleet.SYNC, self.me, [token]))
            await asyncio.wait_for(heard, BARRIER_WAIT)
        except Exception as exc:  # (TimeoutError included) late is better than never
            log.warning("cluster: barrier %s not back in %gs (%s): going on", token,
                        BARRIER_WAIT, exc or type(exc).__name__)
        finally:
            self._syncs.pop(token, None)

    def _synced(self, token: str) -> None:
        heard = self._syncs.get(token)
        if heard is None:
            return
        reads = [t for t in self._tasks if t.get_name() in READS]
        self._spawn(self._settle_barrier(heard, self._heard_jobs, reads), "rota-cluster-sync")

    async def _settle_barrier(self, heard: asyncio.Future[None], jobs: int,
                              reads: list[asyncio.Task[Any]]) -> None:
        await asyncio.gather(*reads, return_exceptions=True)
        while self._taken_jobs < jobs:
            self._took.clear()
            await self._took.wait()
        if not heard.done():
            heard.set_result(None)

    async def _catch_up(self) -> None:
        """What missed notices would have said: the status quo and the paused queues as
        they are, the waiting jobs this server does not hold, and the cancels asked for
        its workers' jobs. (A directive given to workers by name or label meanwhile is
        not stored anywhere: it is lost, and the operator's tools show it was.)"""
        await self._read_status_quo()
        await self._read_paused()
        await self._read_limits()
        await self._persist(self.coordinator.secrets.reload, "read the secrets")
        seqs = await self._persist(self.store.waiting_seqs, "read which jobs wait")
        coordinator = self.coordinator
        held = self.engine.scheduler.held_seqs()
        missed = [seq for seq in seqs if seq not in held]
        cancels = await self._persist(self.store.cancels_requested,
                                      "read the cancels asked for")
        passed = 0
        for job_id in cancels:
            job = self.engine.scheduler.jobs.get(job_id)
            if job is not None and not job.cancel_requested:
                self._pass_cancel(job_id, "another server, heard late")
                passed += 1
        log.info("cluster: caught up: %d waiting job(s) taken in, %d cancel(s) passed on",
                 len(missed), passed)
        if missed:
            self._pending.update(missed)
            self._arrived.set()

    async def _read_status_quo(self) -> None:
        specs, checksums, retired = await self._persist(self.store.status_quo,
                                                        "read the status quo")
        coordinator = self.coordinator
        coordinator.apply(self.engine.status_quo_read(specs, checksums, retired,
                                                      coordinator.clock()))
        await coordinator.pusher.reread()  # its pins and endpoints (rota/core/pins.py)
        coordinator.limiting.refresh()  # a spec file's limits may have changed

    async def _read_limits(self) -> None:
        """A limit set or cleared through another server."""
        rows = await self._persist(self.store.runtime_limits, "read the limits")
        self.coordinator.limiting.load(rows)

    async def _read_paused(self) -> None:
        paused = await self._persist(self.store.paused_queues, "read the paused queues")
        coordinator = self.coordinator
        held = set(self.engine.scheduler.paused)
        for queue in paused ^ held:
            coordinator.apply(self.engine.pause_queue(queue, queue in paused,
                                                      coordinator.clock()))

    async def _persist(self, read: Callable[[], Awaitable[T]], what: str) -> T:
        """``read()``, again until it works: what another server did must take effect
        here (a status quo above all), so a database that is down delays it, never
        drops it."""
        failures = 0
        while True:
            try:
                return await read()
            except Exception as exc:
                failures += 1
                if failures == 1:
                    log.warning("cluster: could not %s, trying again until it works: %s",
                                what, exc)
            # Pacing the retries of a database that is down, not a synchronisation.
            await asyncio.sleep(min(2.0, 0.1 * 2 ** failures))  # noqa: sleep-ok

    # -- leases ----------------------------------------------------------------------
    async def _lease_loop(self) -> None:
        while True:
            # At once first: a start that read a large snapshot may have used much of
            # the lease it took before, and hands out no work until it renews.
            await self.renew()
            # A timer, not a synchronisation: a few renewals per lease ride out one slow
            # commit.
            await asyncio.sleep(self.lease / 4)  # noqa: sleep-ok

    async def renew(self) -> None:
        """Renew this server's lease and, from a vantage (rota/core/standing.py), watch the
        others'. A lease found lapsed (this server stalled past it and the grace, and
        another recovered its workers' jobs) is taken again, and with it the jobs its
        workers still run that nobody gave out again; the rest are cancelled on the
        workers here."""
        coordinator, engine = self.coordinator, self.engine
        started = coordinator.clock().mono
        try:
            held = await self.store.renew_lease(host=socket.gethostname(), pid=os.getpid(),
                                                url=self.url, now=time.time(), lease=self.lease)
        except Exception as exc:  # the database is unreachable: try again next time
            engine.lease_failed()
            log.warning("cluster: lease renewal failed (%.1fs of the lease left): %s",
                        engine.standing.left(coordinator.clock().mono), exc)
            return
        coordinator.apply(engine.lease_renewed(started, coordinator.clock()))
        try:
            if not held:
                self._lapsed = True
            if self._lapsed:  # settled once, even if the database failed the first try
                await self._after_lapse()
                self._lapsed = False
            await self._watch()
        except Exception as exc:  # the database went away meanwhile: next time
            log.warning("cluster: settling a lapse or watching the other servers' leases"
                        " failed (again at the next renewal): %s", exc)

    async def _after_lapse(self) -> None:
        coordinator = self.coordinator
        running = self.engine.running_here()
        taken = set(await self.store.take_back(running)) if running else set()
        lost = [job.id for job in running if job.id not in taken]
        log.error("cluster: this server's lease had lapsed and another server recovered the"
                  " jobs its workers held; it holds a new lease, took back %d of their %d"
                  " running job(s), and cancels the %d given out again", len(taken),
                  len(running), len(lost))
        coordinator.apply(self.engine.lapse_settled(lost, coordinator.clock()))

    async def _watch(self) -> None:
        """Say which servers missed their lease, and recover those past the grace; only
        from a vantage: after a failed renewal or a stall of its own, this server first
        gives the others a whole lease of the database to renew in."""
        if not self.engine.standing.may_judge(self.coordinator.clock().mono):
            return  # (the engine said so, at the renewal that broke the vantage)
        lapsed = await self.store.lapsed_servers()  # on the database's clock
        for server in lapsed.keys() - self._missed:
            log.warning("cluster: server=%s holds no lease (it stopped, or died); its"
                        " workers' jobs come back after %gs unless it returns", server,
                        self.grace)
        self._missed = set(lapsed)
        for server in [s for s, ago in lapsed.items() if ago > self.grace]:
            seqs = await self.store.recover_server(server, time.time(), self.grace)
            self._missed.discard(server)
            if seqs is None:  # another server was first, or it came back
                continue
            log.log(logging.WARNING if seqs else logging.INFO,
                    "recovered server=%s jobs=%d: they wait again", server, len(seqs))
            if seqs:
                jobs = await self.store.waiting_jobs(seqs)
                coordinator = self.coordinator
                coordinator.apply(self.engine.taken_in(jobs, coordinator.clock()))
