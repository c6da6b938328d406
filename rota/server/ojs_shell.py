"""The OJS binding's own calls into the engine and the store: activate a scheduled job,
and the test switch that empties everything (POST /ojs/v1/admin/reset). A shell part, as
rota/server/steering.py is: the routes (rota/server/ojs_api.py) call it, never the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from rota.base.errors import Conflict, NoSuchJob
from rota.core.effects import Effect
from rota.server.coordinator import Coordinator
from rota.store import resets

log = logging.getLogger("rota.server")


class OjsShell:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.store, self.engine, self.clock = (coordinator.store, coordinator.engine,
                                               coordinator.clock)
        self.run: Callable[[list[Effect]], Coroutine[Any, Any, Any]] = coordinator.run

    async def activate(self, job_id: str) -> dict[str, Any]:
        """Make a scheduled job available now; its row. 409 in any other state."""
        outcome, effects = self.engine.activate(job_id, self.clock())
        if outcome == "activated":
            await self.run(effects)
        row = await self.store.get_job(job_id)
        if row is None:
            raise NoSuchJob(job_id)
        if outcome != "activated":
            held = " (held by another server)" if outcome == "not_live" else ""
            raise Conflict("not_scheduled", f"job {job_id} is {row['state']}{held}: only a"
                           " scheduled job held by this server can be activated")
        return row

    async def reset(self) -> None:
        """Empty the store's jobs, workflows, schedules, limits and paused queues, and
        forget them, as a start on that store would (a test switch)."""
        await self.store.writer.submit(resets.empty)
        self.coordinator.apply(self.engine.forget_all(self.clock()))
        self.engine.forget_pulls()
        await self.coordinator.limiting.reread()
        self.coordinator.clockwork.wake()
        log.warning("reset: the store's jobs, workflows, schedules and limits were emptied"
                    " (--unsafe-test-endpoints)")
