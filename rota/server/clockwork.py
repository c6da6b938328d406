"""Cron schedules as the shell carries them out: the tick loop, which sleeps until the earliest next fire and fires each due tick in one store transaction, and the operations of the API and of a push.

Every server runs the loop. A tick's job is built here with the ordinary intake
validation (``Engine.build``), then rota/store/ticks.py's ``fire`` decides in the
transaction, from the schedule's row as locked, which of the built jobs are made; the
engine takes the new ones in after the commit, as an enqueue's. What to fire is the pure
planner's (rota/core/schedules.py). Logs go to ``rota.cron``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec

from rota.base.errors import DomainError, Invalid, NotFound, StorageError
from rota.base.specs import JobSpec, SpecError, validate_args
from rota.core.auth import OPEN
from rota.core.effects import Effect
from rota.core.engine import Engine
from rota.core.jobs import EnqueueRequest
from rota.core.model import Instant, JobRecord
from rota.core.schedules import (ScheduleDef, Timing, check, due, jitter_offset, tick_id,
                                 unreadable, view, waiting_reason)
from rota.store import ticks
from rota.store.store import Store

log = logging.getLogger("rota.cron")
IDLE = 60.0  # seconds the loop sleeps at most with nothing due (a change wakes it)
SHARED_IDLE = 2.0  # on a shared database: how soon another server's change is seen
RETRY = 1.0  # after a failed read or fire
BUSY_EXCUSE = 60.0  # seconds of a round's own work that make the next one's ticks no misses


class _DryRun(Exception):
    """Raised inside a dry run's write so that its savepoint rolls back."""

    def __init__(self, changes: list[dict[str, Any]]) -> None:
        super().__init__("dry run")
        self.changes = changes


class _Plan:
    """A schedule's definition and timing as parsed, and its next tick after the last
    instant asked about (a round asks each schedule the same until it fires)."""

    __slots__ = ("definition", "timing", "_after", "_next")

    def __init__(self, definition: ScheduleDef, timing: Timing) -> None:
        self.definition = definition  # (its paused state is the row's)
        self.timing = timing
        self._after: float | None = None
        self._next: float | None = None

    def next_after(self, moment: float) -> float | None:
        if moment != self._after:
            upcoming = self.timing.after(moment, 1)
            self._after, self._next = moment, upcoming[0] if upcoming else None
        return self._next


def _key(row: dict[str, Any]) -> tuple[str, float]:
    return row["definition"], row["counted_from"]


class Clockwork:
    def __init__(self, store: Store, engine: Engine, clock: Callable[[], Instant],
                 apply: Callable[[Iterable[Effect]], None],
                 cancel: Callable[[str], Awaitable[Any]]) -> None:
        self.store = store
        self.engine = engine
        self.clock = clock
        self.apply = apply
        self.cancel = cancel  # the ordinary cancel path (cancel_previous)
        self.refused: dict[str, str] = {}  # schedules whose jobs intake refuses, and why
        self._wake = asyncio.Event()
        self._plans: dict[tuple[str, float], _Plan] = {}  # the last round's, by _key
        self._meant: float | None = None  # when the last round meant the next to start
        self._busy = False  # the last round ran past that

    def wake(self) -> None:
        """A schedule changed: the loop looks again now."""
        self._wake.set()

    # -- the loop --------------------------------------------------------------------------
    async def loop(self) -> None:
        while True:
            try:
                wait = await self.round()
            except StorageError as exc:  # the store says so too; the next round tries again
                log.warning("cron round failed: %s", exc)
                wait = RETRY
            except Exception:  # a bug: said, and the loop goes on (its schedules must)
                log.exception("cron round failed")
                wait = RETRY
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, wait))
            except TimeoutError:
                pass
            self._wake.clear()

    async def round(self) -> float:
        """Fire what is due; seconds until the next look. The round's due schedules fire
        together (their transactions share the writer's commits), each still in its own
        transaction with its row locked."""
        rows = await self.store.readers.run(ticks.read_all)
        now = self.clock().wall
        # a round the last one ran into (it was busy past the wake it meant) judges its
        # ticks' lateness from that wake, excusing at most BUSY_EXCUSE of work (a longer
        # one is a stall: its ticks are missed); after a sleep, a failed round or none,
        # from now (downtime, an oversleep)
        reached = now
        if self._meant is not None and self._busy:
            reached = max(self._meant, now - BUSY_EXCUSE)
        self._busy = False  # (until this round ends, and if it does)
        soonest = now + (SHARED_IDLE if self.store.shared else IDLE)
        plans: dict[tuple[str, float], _Plan] = {}
        firing: list[tuple[dict[str, Any], _Plan, float]] = []
        for row in rows:
            if row["paused"]:
                continue
            try:
                plan = plans[_key(row)] = self._plan(row)
            except (Invalid, msgspec.DecodeError, msgspec.ValidationError) as exc:
                # (a row this Rota cannot read, or a zone the system no longer has)
                self._waits(row["name"], f"it cannot be read: {exc}")
                continue
            upcoming = plan.next_after(ticks.start_of(row))
            if upcoming is not None and upcoming <= now:
                firing.append((row, plan, upcoming))
            elif upcoming is not None:
                soonest = min(soonest, upcoming)
        self._plans = plans  # (those of rows gone or changed are dropped)
        results = await asyncio.gather(*(self.fire(row, now, plan=plan, first=first,
                                                   reached=reached)
                                         for row, plan, first in firing),
                                       return_exceptions=True)
        for (row, plan, _), result in zip(firing, results, strict=True):
            if isinstance(result, BaseException):
                soonest = min(soonest, now + RETRY)
                if isinstance(result, StorageError):  # the store says so too
                    log.warning("cron fire failed schedule=%s: %s", row["name"], result)
                elif isinstance(result, Exception):  # a bug: said; the others fired
                    log.error("cron fire failed schedule=%s", row["name"], exc_info=result)
                else:
                    raise result
            upcoming = plan.next_after(now)  # fired, or waits: its next tick is after now
            if upcoming is not None:
                soonest = min(soonest, upcoming)
        self._meant = soonest
        wait = soonest - self.clock().wall
        self._busy = wait <= 0  # the next round starts late through this one's work
        return wait

    def _plan(self, row: dict[str, Any]) -> _Plan:
        """The row's parsed definition and timing: parsed once per (definition,
        counted_from), not each round."""
        plan = self._plans.get(_key(row))
        if plan is None:
            stored = msgspec.json.decode(row["definition"], type=ScheduleDef)
            plan = _Plan(stored, Timing.of(stored, row["counted_from"]))
        return plan

    def _waits(self, name: str, reason: str) -> None:
        """Schedule ``name`` cannot fire now: said once per reason."""
        if self.refused.get(name) != reason:
            log.warning("cron wait schedule=%s reason=%s", name, reason)
        self.refused[name] = reason

    async def fire(self, row: dict[str, Any], wall: float, *, plan: _Plan | None = None,
                   first: float | None = None, reached: float | None = None) -> bool:
        """Fire a schedule's due ticks; whether it could (False: it waits). ``first``: its
        first due tick; ``reached``: when the loop meant to wake for them."""
        plan = plan or self._plan(row)
        definition, name = plan.definition, plan.definition.name
        reason = self._reason(definition)
        if reason is not None:
            self._waits(name, reason)
            return False
        now = self.clock()
        start = ticks.start_of(row)
        first = plan.next_after(start) if first is None else first
        # a refused one is found by one job's build, before its due ticks are counted
        # (a per-second schedule refused for hours has many)
        probe = self._build(definition, first, now) if first is not None else None
        if isinstance(probe, DomainError):
            self._waits(name, f"its jobs are refused: {probe.message}")
            return False
        decided = due(plan.timing, start, wall, reached)
        jobs: dict[float, JobRecord] = {}
        for tick in decided.fire:
            built = probe if tick == first and probe is not None else self._build(
                definition, tick, now)
            if isinstance(built, DomainError):
                self._waits(name, f"its jobs are refused: {built.message}")
                return False
            jobs[tick] = built
        if self.refused.pop(name, None) is not None:
            log.info("cron ready schedule=%s", name)
        server = self.store.server_id or "" if self.store.shared else None
        fired = await self.store.writer.submit(
            lambda conn: ticks.fire(conn, name, row["definition"], wall, jobs, server,
                                    reached=reached, timing=plan.timing))
        self._report(definition, fired, now)
        if fired.replaced:  # (cancelled in the fire transaction: the engine lets go)
            self.apply(self.engine.replaced(fired.replaced, name, now, reason=f"its schedule"
                                            f" {name}'s next tick came (overlap"
                                            " cancel_previous)"))
        for job_id in fired.cancel:  # (requested in the fire transaction: told the worker)
            try:
                await self.cancel(job_id)
            except DomainError as exc:  # it ended meanwhile (not found, or finished)
                log.info("cron cancel_previous schedule=%s job=%s: %s", name, job_id, exc)
        return True

    def _build(self, definition: ScheduleDef, tick: float, now: Instant
               ) -> JobRecord | DomainError:
        """A tick's job, through the ordinary intake (spec, args, queue checked)."""
        offset = jitter_offset(definition.name, tick, definition.jitter)
        delay = tick + offset - now.wall
        ojs = definition.ojs  # (an /ojs/v1/cron registration's: its queue named freely)
        request = EnqueueRequest(  # (checked by the intake, as a producer's)
            spec=definition.spec, args=definition.args, id=tick_id(definition.name, tick),
            queue=definition.queue, priority=definition.priority,
            max_attempts=definition.max_attempts, delay=delay if delay > 0 else None,
            ojs=ojs, new_queue=ojs is not None,
            visibility_timeout=ojs.visibility_timeout_ms / 1000
            if ojs is not None and ojs.visibility_timeout_ms else None)
        built = self.engine.build(request, OPEN, now)
        if not isinstance(built, DomainError):
            built.schedule = definition.name  # its row names its schedule
        return built

    def _report(self, definition: ScheduleDef, fired: ticks.Fired, now: Instant) -> None:
        """Take the new jobs in (as an enqueue's, after the commit), log the fire and tell
        /events (ojs-cron §9: cron.triggered and cron.skipped; and the misses)."""
        name, event = definition.name, self.engine.observe.event
        if fired.missed:
            counted = "" if fired.counted else "+"  # (more than were counted: a long downtime)
            log.warning("cron miss schedule=%s missed=%d%s fired=%d policy=%s", name,
                        fired.missed, counted, fired.caught, definition.misfire)
            event(now.wall, "cron_miss", spec=definition.spec, message=f"schedule {name}"
                  f" missed {fired.missed}{counted} ticks; {definition.misfire} fired"
                  f" {fired.caught}")
        if fired.held > 2:  # (ojs-cron §6: a backlog grows; its runs outlast its interval)
            log.warning("cron backlog schedule=%s held=%d: its runs last longer than its"
                        " interval (overlap enqueue)", name, fired.held)
        for tick in fired.skipped:
            at = tick_id(name, tick).rsplit("-", 1)[1]
            log.info("cron skip schedule=%s tick=%s reason=previous run still active", name, at)
            event(now.wall, "cron_skip", spec=definition.spec,
                  message=f"schedule {name} tick {at}: previous run still active")
        taken: list[tuple[JobRecord, int | None]] = []
        for job, stored, new in fired.made:
            if not new:
                continue
            if stored.get("unique_replaced"):  # its unique key replaced waiting jobs
                self.apply(self.engine.replaced(stored["unique_replaced"], job.id, now))
            checksum = self.engine.scheduler.status_quo.get(job.spec, "-")
            at = job.id.rsplit("-", 1)[1]
            log.info("cron fire schedule=%s tick=%s job=%s spec=%s@%s queue=%s state=%s",
                     name, at, job.id, job.spec, checksum[:19], job.queue, stored["state"])
            event(now.wall, "cron_fire", job=job.id, spec=job.spec, queue=job.queue,
                  state=stored["state"], message=f"schedule {name} tick {at}")
            if stored["state"] != "pending":
                taken.append((job, stored["rowid"]))
        if taken:
            self.apply(self.engine.enqueued_all(taken, now))

    def _reason(self, definition: ScheduleDef) -> str | None:
        if definition.ojs is not None and definition.spec not in self.engine.retired:
            return None  # an OJS type with no spec runs unversioned (docs/ojs.md)
        return waiting_reason(definition.spec, self.engine.specs, self.engine.retired)

    # -- the API's -------------------------------------------------------------------------
    def _view(self, row: dict[str, Any]) -> dict[str, Any]:
        try:  # a row stored before a rule refused it (@every 10**9 h) is shown, waiting
            definition = ticks.definition_of(row)
            fires = ticks.timing_of(row).after(max(self.clock().wall, ticks.start_of(row)), 5)
        except (Invalid, msgspec.DecodeError, msgspec.ValidationError, ValueError,
                OverflowError) as exc:
            return unreadable(row, str(exc))
        waiting = self._reason(definition) or self.refused.get(definition.name)
        return view(definition, row, waiting, fires)

    async def list(self) -> dict[str, Any]:
        rows = await self.store.readers.run(ticks.read_all)
        return {"schedules": [self._view(row) for row in rows]}

    async def get(self, name: str) -> dict[str, Any]:
        row = await self.store.readers.run(lambda conn: ticks.read_one(conn, name))
        if row is None:
            raise _no_such(name)
        return self._view(row)

    async def put(self, name: str, data: Any) -> tuple[dict[str, Any], str]:
        """Add or replace schedule ``name``: its view, and new/changed/unchanged."""
        if isinstance(data, dict):
            data = {"name": name, **data}
        definition = check(data)
        if definition.name != name:
            raise Invalid("invalid_schedule", f"the body names schedule {definition.name!r},"
                          f" the path {name!r}")
        self._check_args(definition, self.engine.specs)
        if definition.ojs is not None:  # (an OJS type runs unversioned: its job, built
            built = self._build(definition, self.clock().wall, self.clock())  # now, says
            if isinstance(built, DomainError):  # what the intake refuses of it)
                raise built
        wall = self.clock().wall
        change, row = await self.store.writer.submit(lambda conn: (
            ticks.upsert(conn, definition, wall), ticks.read_one(conn, name)))
        self._changed(name, change, "put")
        return self._view(row), change

    async def delete(self, name: str) -> dict[str, Any]:
        wall = self.clock().wall
        row = await self.store.writer.submit(lambda conn: ticks.delete(conn, name, wall))
        if row is None:
            raise _no_such(name)
        self.refused.pop(name, None)
        log.info("cron delete schedule=%s%s", name, _cancelled(row))
        return {**self._view(row), "deleted": True}

    async def pause(self, name: str, paused: bool) -> dict[str, Any]:
        wall = self.clock().wall
        row = await self.store.writer.submit(
            lambda conn: ticks.set_paused(conn, name, paused, wall))
        if row is None:
            raise _no_such(name)
        log.info("cron %s schedule=%s%s", "pause" if paused else "resume", name,
                 _cancelled(row))
        self.wake()
        return self._view(row)

    def check_push(self, tables: list[Any], specs: list[JobSpec]) -> list[ScheduleDef]:
        """A push's schedules, checked before anything of the push is stored: each
        valid, named once, and its args fit for its spec (as pushed, or the status quo)."""
        known = {**self.engine.specs, **{s.name: s for s in specs}}
        checked: list[ScheduleDef] = []
        for i, table in enumerate(tables):
            definition = check(table, where=f"schedules[{i}]")
            if definition.ojs is not None:
                raise Invalid("invalid_schedule", f"schedules[{i}]: ojs is set by"
                              " /ojs/v1/cron only")
            if any(d.name == definition.name for d in checked):
                raise Invalid("invalid_schedule", f"schedules[{i}]: schedule"
                              f" {definition.name!r} is declared twice")
            self._check_args(definition, known)
            checked.append(definition)
        return checked

    async def args_refused(self, specs: list[JobSpec], pushed: list[ScheduleDef]
                           ) -> list[dict[str, str]]:
        """The stored schedules (those of the push aside, checked already) whose args
        the pushed ``specs`` refuse. A push does not refuse them: they wait, their jobs
        refused by the intake, until their args or their spec fit again."""
        new = {spec.name: spec for spec in specs}
        named = {definition.name for definition in pushed}
        refused: list[dict[str, str]] = []
        for row in await self.store.readers.run(ticks.read_all):
            try:
                definition = self._plan(row).definition
            except (Invalid, msgspec.DecodeError, msgspec.ValidationError):
                continue  # (it waits already, and says why)
            spec = new.get(definition.spec)
            if spec is None or definition.name in named:
                continue
            try:
                validate_args(spec, definition.args)
            except SpecError as exc:
                refused.append({"name": definition.name, "spec": spec.name,
                                "message": str(exc)})
        return refused

    async def push(self, definitions: list[ScheduleDef], *, dry_run: bool
                   ) -> list[dict[str, Any]]:
        """A push's schedules added or changed (never deleted, never un-paused)."""
        wall = self.clock().wall

        def op(conn: Any) -> list[dict[str, Any]]:
            changes = [{"name": d.name, "change": ticks.upsert(conn, d, wall, push=True)}
                       for d in definitions]
            if dry_run:
                raise _DryRun(changes)
            return changes

        try:
            changes = await self.store.writer.submit(op)
        except _DryRun as dry:  # the savepoint rolled it back
            return dry.changes
        for item in changes:
            self._changed(item["name"], item["change"], "push")
        return changes

    def _changed(self, name: str, change: str, how: str) -> None:
        if change != "unchanged":
            self.refused.pop(name, None)
            log.info("cron %s schedule=%s change=%s", how, name, change)
            self.wake()

    @staticmethod
    def _check_args(definition: ScheduleDef, known: dict[str, JobSpec]) -> None:
        spec = known.get(definition.spec)
        if spec is None:  # it waits for its spec, and says so
            return
        try:
            validate_args(spec, definition.args)
        except SpecError as exc:
            raise Invalid("invalid_args", f"schedule {definition.name!r}: {exc}") from None


def _cancelled(row: dict[str, Any]) -> str:
    """A pause's or a delete's log words for the held ticks it cancelled, if any."""
    held = row.get("cancelled") or []
    return f" cancelled={len(held)} held tick(s), first={held[0]}" if held else ""


def _no_such(name: str) -> NotFound:
    return NotFound("no_such_schedule", f"no schedule {name!r} (`rota schedules` lists them)")
