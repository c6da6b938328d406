"""What HTTP callers wait on and watch, as the shell serves it: a job's result
(``?wait=``), the pulse that wakes ``GET /events`` streams, the store's health as
events, and ``GET /stats``.

The Coordinator owns one and hands it the store, the engine and its clock; it wakes a
job's waiters when the engine says the job finished, and ends every wait at a stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rota.base import protocol as p
from rota.core.engine import Engine
from rota.core.model import TERMINAL_STATES, Instant
from rota.core.observe import busiest
from rota.store.store import Store


class Watching:
    def __init__(self, store: Store, engine: Engine, clock: Callable[[], Instant],
                 max_series: int) -> None:
        self.store = store
        self.engine = engine
        self.clock = clock
        self.started = clock().wall  # a restart's mark on the chart and in rota watch
        self.max_series = max_series
        self.waiters: dict[str, list[asyncio.Future[None]]] = {}  # by job id
        self.subscribers = 0  # GET /events streams
        self.stopping = False
        self._pulse: asyncio.Future[None] | None = None  # resolved when events come
        self._storage_seen: Any = None  # the store's degradation last reported as an event

    def stop(self) -> None:
        """A stop begins: every result wait gets its answer now, the job as it stands, and
        the event streams end (uvicorn waits for every request in flight)."""
        self.stopping = True
        for job_id in list(self.waiters):
            self.wake(job_id)
        self._events_came()

    # -- results ------------------------------------------------------------------------
    async def wait_for_result(self, job_id: str, timeout: float,
                              revoked: asyncio.Future[None] | None = None
                              ) -> dict[str, Any] | None:
        """The job's row as soon as it is terminal, or as it stands when ``timeout`` runs
        out (or at once when ``revoked`` resolves: the caller's token was revoked)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.setdefault(job_id, []).append(waiter)
        try:
            row = await self.store.get_job(job_id)
            if row is None or row["state"] in TERMINAL_STATES or timeout <= 0 or self.stopping:
                return row
            await asyncio.wait([waiter] if revoked is None else [waiter, revoked],
                               timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            return await self.store.get_job(job_id)
        finally:
            waiters = self.waiters.get(job_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self.waiters.pop(job_id, None)

    def wake(self, job_id: str) -> None:
        for waiter in self.waiters.pop(job_id, []):
            if not waiter.done():
                waiter.set_result(None)

    # -- events (rota/core/observe.py) -------------------------------------------------------
    def storage(self, now: Instant) -> None:
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
        self.subscribers += 1
        self.engine.observe.listener = self._events_came

    def unsubscribe(self) -> None:
        self.subscribers -= 1
        if not self.subscribers:  # recording goes back to costing one test
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

    # -- GET /stats -----------------------------------------------------------------------
    async def oldest_available(self) -> dict[str, float]:
        """Per queue with available jobs, since when (wall) its oldest one waits: for the
        ``max_series`` queues with the most (producers name queues; each is a probe)."""
        waiting: dict[str, int] = {}
        for (queue, _), n in self.engine.scheduler.ready_counts().items():
            waiting[queue] = waiting.get(queue, 0) + n
        return await self.store.oldest_available_since(busiest(waiting, self.max_series))

    async def stats(self, minutes: int) -> dict[str, Any]:
        """GET /stats: counts per minute over the last ``minutes`` per queue and spec,
        and the age of each queue's oldest available job."""
        now = self.clock()
        starts, series = self.engine.observe.window(minutes, now.wall)
        oldest = await self.oldest_available()
        queues = set(oldest) | {row["queue"] for row in series} | {
            q for w in self.engine.scheduler.workers.values() for q in w.queues}
        return {"now": p.rfc3339(now.wall), "started_at": p.rfc3339(self.started),
                "minute_starts": [p.rfc3339(m * 60.0) for m in starts],
                "series": [{k: row[k] for k in ("queue", "spec", "enqueued", "completed",
                                                 "failed", "discarded", "retried",
                                                 "cancelled")} for row in series],
                "oldest_available": {q: (None if oldest.get(q) is None
                                         else round(max(0.0, now.wall - oldest[q]), 3))
                                     for q in sorted(queues)}}
