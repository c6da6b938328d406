"""The shell's housekeeping on the clocks: readings of the wall and boot clocks kept in
the store for the next start, the wall clock's steps while the server runs, the
deletion of finished jobs past their retention (which judges each job by the clock that
stored it), the per-minute counts (rota/core/observe.py) kept for the next start, and
the tick loop of cron schedules (rota/server/clockwork.py).

The Coordinator owns one ``Upkeep`` and hands it the store, the engine, its clock and
its way of applying effects; it runs the loops ``loops`` names.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

from rota.core.effects import Effect
from rota.core.engine import Engine
from rota.base.errors import StorageError
from rota.core.model import ClockReading, Instant
from rota.core.observe import MINUTES
from rota.core.retention import BATCH, STEP, Frames, PruneTally, Retention, due, next_pass
from rota.core.settings import ServerSettings
from rota.server.clockwork import Clockwork
from rota.server.hooks import Webhooks
from rota.server.steering import Steering
from rota.server.watching import Watching
from rota.store.store import Store

log = logging.getLogger("rota.server")
CLOCK_EVERY = 5.0  # seconds between the clock readings a store keeps for the next start


def system_clock() -> Instant:
    return Instant(time.monotonic(), time.time())


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


def _said(future: asyncio.Future[None]) -> None:
    """A background write's failure, said (the store's health says it too)."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.warning("the stored moments were not restamped after the step: %s", exc)


class Upkeep:
    def __init__(self, settings: ServerSettings, store: Store, engine: Engine,
                 clock: Callable[[], Instant], apply: Callable[[Iterable[Effect]], None],
                 steering: Steering, watching: Watching) -> None:
        self.store = store
        self.engine = engine
        self.clock = clock
        self.apply = apply
        self.retrying = steering.retrying  # rows a manual retry read and is about to write back
        # Cron schedules' tick loop, which cancels through the ordinary path (cancel_previous)
        self.clockwork = Clockwork(store, engine, clock, apply, steering.cancel)
        # Webhooks out: fed by the observer's events, never awaited by the engine
        self.webhooks = Webhooks(settings, store, engine.observe, watching.subscribe,
                                 watching.events_pulse)
        self.counts_every = settings.counts_every
        self.retention = Retention.from_rules(
            {"completed": settings.retain_completed, "discarded": settings.retain_discarded,
             "cancelled": settings.retain_cancelled}, settings.retain_queues)
        self.frames = Frames()  # the wall clock's steps this run, for retention
        now = clock()
        self.frames.look(now.wall, now.mono)

    def loops(self, *, readings: bool, counts: Iterable[tuple[Any, ...]] = ()
              ) -> list[tuple[Coroutine[Any, Any, None], str]]:
        """The loops to run, named: clock readings (``readings``: the store keeps them,
        one server per SQLite file), the per-minute counts (``counts``: those the last run
        kept, taken in first), retention (unless every rule keeps jobs forever), cron
        schedules' ticks (rota/server/clockwork.py) and webhooks (rota/server/hooks.py)."""
        self.engine.observe.restore(counts, self.clock().wall)
        loops = [(self.counts_loop(), "rota-counts"), (self.clockwork.loop(), "rota-cron"),
                 (self.webhooks.run(), "rota-webhooks")]
        if readings:
            loops.append((self.clock_loop(), "rota-clock"))
        log.info("retention %s", self.retention.describe())
        if self.retention.durations():
            loops.append((self.retention_loop(), "rota-retention"))
        return loops

    def seen(self, finished: Iterable[float] = (), *, now: bool = False) -> None:
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
            self._restamp(reading, step)
        else:
            asyncio.get_running_loop().call_soon(lambda: self._restamp(self.clock(), step))

    def _restamp(self, reading: Instant, step: float) -> None:
        """The stored moments judged by the wall clock, written again on the stepped
        one: the waiting jobs' deadlines, the rates' recent starts; the rest moved by the
        step (``writes.follow_step``: one made since it, before it was seen, moves too)."""
        self.apply(self.engine.restamp(reading))
        starts = self.engine.rate_starts(reading)
        log.info("restamped rate_starts=%d: the rates' starts, the unique keys' periods,"
                 " the webhooks' next tries%s follow the stepped wall clock",
                 sum(map(len, starts.values())), " and the schedules' last ticks"
                 if step < 0 else "")
        written = self.store.restamp(starts, step)
        written.add_done_callback(_said)
        written.add_done_callback(lambda _: (self.clockwork.wake(), self.webhooks.stepped()))

    async def at_stop(self, *, reading: bool) -> None:
        """What the next start reads: the counts since the last write, and (``reading``)
        the clocks' reading. A store that fails loses them, and the stop goes on."""
        try:
            await asyncio.wait_for(self.keep_counts(), 2.0)
        except Exception as exc:  # noqa: BLE001 (those counts are lost)
            log.warning("per-minute counts not stored at stop: %s", exc)
        if reading:
            await self.keep_reading()

    async def keep_counts(self) -> None:
        """Add what was counted since the last write to the store's rows: a row per
        (queue, spec) and minute that changed, nothing per job; the minutes before the
        window (the hour shown) are deleted."""
        now = self.clock()
        rows, mark = self.engine.observe.unsaved(now.wall)
        if rows:
            await self.store.keep_throughput(rows, int(now.wall // 60) - MINUTES + 1)
        self.engine.observe.saved(mark)

    async def counts_loop(self) -> None:
        """``keep_counts`` every ``counts_every`` seconds (15): a kill -9 loses at most
        what was counted since the last."""
        while True:
            await asyncio.sleep(self.counts_every)
            try:
                await self.keep_counts()
            except StorageError as exc:  # the store's health says so; the next write adds them
                log.debug("per-minute counts not stored: %s", exc)

    async def keep_reading(self) -> None:
        """At a stop: the latest reading, for the next start. A step not yet seen (no
        restamp written) leaves the last reading, on the clock the rows were written
        with: the next start then sees the step and undoes it."""
        reading = self.clock()
        if abs(reading.wall - reading.mono - self.frames.frames[-1].offset) > STEP:
            return
        try:
            await self.store.note_clock(clock_reading())
        except Exception as exc:  # noqa: BLE001 (a stop goes on: the last reading stays)
            log.debug("clock reading not stored at stop: %s", exc)

    async def clock_loop(self) -> None:
        """Keep a clock reading in the store every CLOCK_EVERY seconds: the next start
        tells a step of the wall clock from the time that passed by it."""
        while True:
            await asyncio.sleep(CLOCK_EVERY)
            self.seen(now=True)  # the rows follow a step before the reading is kept
            try:
                await self.store.note_clock(clock_reading())
            except StorageError as exc:  # the next reading tries again
                log.debug("clock reading not stored: %s", exc)

    async def retention_loop(self) -> None:
        """Delete finished jobs past their retention, one batch per writer transaction:
        each batch is queued behind the writes already waiting, so none waits long."""
        tally = PruneTally()
        wait: float | None = 0.0
        while wait is not None:
            await asyncio.sleep(wait)
            self.seen()
            now = self.clock()
            try:
                deleted = await self.store.prune(
                    due(self.retention, now.wall, self.frames, now.mono), BATCH, self.retrying)
            except StorageError:  # the store's health says so; try again later
                deleted = {}
            if (line := tally.add(deleted, now.mono)) is not None:
                log.info("%s", line)
            wait = next_pass(sum(deleted.values()), self.retention)
