"""What comes in to be held: the jobs producers enqueue, and, on a database several
servers share, the jobs a registering worker holds that another server reserved.

The engine decides (``Engine.build``, ``enqueued_all``, ``taken_over``); this writes the
rows and applies what the engine returns. The Coordinator owns one and hands it the
store, the engine, its clock, its way of applying effects and its crash switch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from rota.base import protocol as p
from rota.core.auth import OPEN, Principal
from rota.core.effects import Effect
from rota.core.engine import Engine
from rota.base.errors import Conflict, DomainError, Invalid, StorageError
from rota.core.jobs import EnqueueRequest, same_job
from rota.core.model import Instant, JobRecord
from rota.core.registry import claim_worker_id, held_ids
from rota.core.unique import conflict
from rota.store.store import Store
from rota.store.writes import Unstored
from rota.server.shell_reads import new_queue_problems

log = logging.getLogger("rota.server")
NEW_QUEUE = "; to make it anyway, give \"new_queue\": true ('rota enqueue --new-queue')"
REREAD_EVERY = 0.1  # seconds: the most often an unknown spec makes the server read the status quo


class Admission:
    def __init__(self, store: Store, engine: Engine, clock: Callable[[], Instant],
                 apply: Callable[[Iterable[Effect]], None],
                 crash_point: Callable[[str], None]) -> None:
        self.store = store
        self.engine = engine
        self.clock = clock
        self.apply = apply
        self.crash_point = crash_point  # the --crash-at test switch
        self._read_at = float("-inf")  # when the last read of the status quo for an enqueue began
        self._read_done = float("-inf")  # and when it was applied
        self._reading: asyncio.Future[None] | None = None  # that read, while it runs
        # Several servers: until every notice committed before the call is handled here
        # (rota/server/cluster.py sets it), so a push through another server is known.
        self.barrier: Callable[[], Awaitable[None]] | None = None

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
        held = {*named, *(r.job_id for r in hb.results)} - self.engine.scheduler.jobs.keys()
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


    async def enqueue(self, requests: list[EnqueueRequest], principal: Principal = OPEN, *,
                      all_or_nothing: bool = False
                      ) -> list[tuple[dict[str, Any], bool] | DomainError]:
        """Store jobs in one transaction; per request the row and whether it is new, or why not.
        ``all_or_nothing`` (OJS's batch): if any is refused, none is stored (an id stored
        already is a refusal then), and each of the others says so (``unstored``)."""
        now = self.clock()
        built = [self.engine.build(request, principal, now) for request in requests]
        if self._unknown_spec(built) and await self._read_status_quo(now):
            now = self.clock()  # a spec pushed through another server a moment ago
            built = [self.engine.build(request, principal, now) for request in requests]
        built = await self._slipped_queues(requests, built)
        if all_or_nothing:
            return await self._all_or_nothing(requests, built, principal)
        jobs = [job for job in built if not isinstance(job, DomainError)]
        # A job whose id the server made cannot collide with a stored row: it is taken
        # in at once, and a scheduling round now queues its reservation right behind its
        # row (see Intake.enqueued). A producer's id waits for the commit to say whether
        # the job is new.
        # A unique job waits for the commit too: its key may be held (rota/store/uniques.py).
        # A push-executed job on a database several servers share waits too: its version
        # follows from its row (rota/core/pins.py), and a push through another server
        # just before it may not be known here yet (``_pins_known``).
        pinned = {job.id for job in jobs if self.barrier is not None
                  and job.spec in self.engine.scheduler.pins.windows}
        early = [job for request, job in zip(requests, built, strict=True)
                 if request.id is None and not isinstance(job, DomainError)
                 and job.unique is None and job.id not in pinned]
        # A producer's id new under its kept form may name a job this token enqueued
        # before ids were kept so (rota/core/auth.py): the store answers with that one.
        unscoped = [principal.unscoped_id(request.id) if request.id is not None else None
                    for request, job in zip(requests, built, strict=True)
                    if not isinstance(job, DomainError)]
        written = (self.store.enqueue(jobs, live=self.engine.scheduler.live(), unscoped=unscoped)
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
        if pinned:
            await self._pins_known()
        outcomes: list[tuple[dict[str, Any], bool] | DomainError] = []
        admitted = {id(job) for job in early}
        taken_in: list[tuple[JobRecord, int | None]] = []  # new rows with producers' ids
        replaced: list[tuple[list[dict[str, Any]], str]] = []  # by unique jobs: theirs
        for request, job in zip(requests, built, strict=True):
            if isinstance(job, DomainError):
                outcomes.append(job)
                continue
            row, created = next(stored)
            if id(job) in admitted:
                self.engine.stored(job, row["rowid"])
                outcomes.append((row, created))
                continue
            if (met := row.get("unique_met")) is not None:  # its key is held by this one
                outcomes.append((row, False) if met == "existing" else conflict(met, row))
                continue
            if created and row.get("unique_replaced"):
                replaced.append((row["unique_replaced"], job.id))
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
        for rows, by in replaced:
            self.apply(self.engine.replaced(rows, by, now))
        return outcomes

    async def _all_or_nothing(self, requests: list[EnqueueRequest],
                              built: list[JobRecord | DomainError], principal: Principal
                              ) -> list[tuple[dict[str, Any], bool] | DomainError]:
        """``enqueue`` when one refusal stores nothing: every job waits for the commit
        (none is taken in early), and a refusal in the store rolls the whole insert back."""
        if any(isinstance(job, DomainError) for job in built):
            return unstored(built)
        jobs = [job for job in built if not isinstance(job, DomainError)]
        unscoped = [principal.unscoped_id(r.id) if r.id is not None else None for r in requests]
        try:
            stored = await self.store.enqueue(jobs, live=self.engine.scheduler.live(),
                                              unscoped=unscoped, all_or_nothing=True)
        except Unstored as refused:
            return unstored([conflict(met, row) if (met := row.get("unique_met")) not in (
                                 None, "existing")
                             else Conflict("id_conflict", f"job {row['id']} exists already")
                             if not new and met is None else job
                             for job, (row, new) in zip(jobs, refused.outcomes, strict=True)])
        if self.barrier is not None and any(job.spec in self.engine.scheduler.pins.windows
                                            for job in jobs):
            await self._pins_known()
        now = self.clock()
        self.apply(self.engine.enqueued_all([(job, row["rowid"]) for job, (row, new)
                                             in zip(jobs, stored, strict=True) if new], now))
        for row, new in stored:
            if new and row.get("unique_replaced"):
                self.apply(self.engine.replaced(row["unique_replaced"], row["id"], now))
        return list(stored)

    async def _pins_known(self) -> None:
        """After push-executed jobs' rows committed, before they are taken in: every
        push committed before them is known here (the barrier waits for the other
        servers' notices, and for the reads of the status quo and pins they started), so
        each job goes to the endpoint of the version it was enqueued under."""
        assert self.barrier is not None
        await self.barrier()

    async def _slipped_queues(self, requests: list[EnqueueRequest],
                              built: list[JobRecord | DomainError]
                              ) -> list[JobRecord | DomainError]:
        """The jobs built, but those whose queue, given at enqueue, is a slip for a
        known one refused (listing.new_queue_problem): such a job would wait forever.
        A request that says its queue is new (``new_queue``) is taken at its word."""
        asked = [r.queue if not r.new_queue else None for r in requests]
        problems = await new_queue_problems(self.store, self.engine,
                                            {q for q in asked if q is not None})
        if not problems:
            return built
        return [Invalid("unknown_queue", problems[queue] + NEW_QUEUE)
                if queue is not None and queue in problems and not isinstance(job, DomainError)
                else job for queue, job in zip(asked, built, strict=True)]

    def _unknown_spec(self, built: list[JobRecord | DomainError]) -> bool:
        return any(isinstance(job, DomainError) and job.code == "unknown_spec" for job in built)

    async def _read_status_quo(self, now: Instant) -> bool:
        """On a database several servers share, a spec pushed through another server
        reaches this one by a notice, a moment later: an enqueue that names a spec this
        server does not know yet reads the status quo first. Enqueues that arrive while a
        read runs wait for it; a new read starts at most every REREAD_EVERY seconds, so
        names that are unknown everywhere cost no read each. Whether the status quo was
        read since ``now`` (then the enqueue builds its jobs again)."""
        if not self.store.shared:
            return False
        if self._reading is None and now.mono - self._read_at >= REREAD_EVERY:
            self._read_at = now.mono
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(self._read_ended)
        if self._reading is not None:
            await asyncio.shield(self._reading)
        return self._read_done >= now.mono

    async def _read(self) -> None:
        try:
            specs, checksums, retired = await self.store.status_quo()
            windows = await self.store.spec_windows()  # (push execution's pins)
        except StorageError:
            return  # the refusal stands; the notice still comes
        reading = self.clock()
        self.apply(self.engine.status_quo_read(specs, checksums, retired, reading))
        self.apply(self.engine.load_pins(windows, reading))
        self._read_done = reading.mono

    def _read_ended(self, future: asyncio.Future[None]) -> None:
        self._reading = None


def unstored(built: list[Any]) -> list[tuple[dict[str, Any], bool] | DomainError]:
    """An all-or-nothing enqueue that stored nothing: each refusal as it is, and each
    other job refused for their sake (409 ``unstored``, naming the first refused)."""
    first = next(i for i, job in enumerate(built) if isinstance(job, DomainError))
    why = Conflict("unstored", f"nothing was stored: job {first} of the batch (from 0) was"
                   f" refused: {built[first].message}")
    return [job if isinstance(job, DomainError) else why for job in built]
