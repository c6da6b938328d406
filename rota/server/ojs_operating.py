"""The shell's part for the OJS binding's operations (rota/server/ojs_ops.py): queues and their
counts, pause and resume, the dead letter, and events read from the jobs' rows. A mixin
of the ``Coordinator`` and a ``ShellReads``: the routes ask it, never the store.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from rota.base.flow import MAX_PERIOD
from rota.base.ojs import OjsRateLimit
from rota.core.effects import Effect
from rota.core.engine import Engine
from rota.core.jobs import EnqueueRequest
from rota.core.limits import Rate
from rota.core.model import Instant
from rota.server.limiting import Limiting
from rota.server.shell_reads import ShellReads
from rota.store.store import Store


class OjsOperating(ShellReads):
    """A mixin of the ``Coordinator`` (with the reads it uses): what /ojs/v1's queue,
    dead-letter and event routes do."""

    if TYPE_CHECKING:
        store: Store
        engine: Engine
        clock: Callable[[], Instant]
        retry: Callable[[str], Coroutine[Any, Any, dict[str, Any]]]
        apply: Callable[[Sequence[Effect]], None]
        limiting: Limiting

    async def ojs_queues(self) -> list[tuple[str, bool]]:
        """Every queue known (of stored jobs, specs, pauses, workers), by name, and
        whether it is paused."""
        scheduler = self.engine.scheduler
        names = set(await self.queue_counts()) | set(scheduler.paused)
        names |= {s.queue for s in self.engine.specs.values()}
        names |= {q for w in scheduler.workers.values() for q in w.queues}
        return [(name, name in scheduler.paused) for name in sorted(names)]

    async def ojs_queue_stats(self, queue: str) -> tuple[dict[str, int], bool, float]:
        """The queue's jobs by state (a due scheduled or retryable job counted
        available), whether it is paused, and when this was counted (wall)."""
        now = self.clock().wall
        counts = await self.store.queue_stats(queue, now)
        return counts, queue in self.engine.scheduler.paused, now

    async def ojs_pause(self, queue: str, paused: bool) -> None:
        """Pause or resume a queue, stored first (as ``Steering.pause_queue``). OJS names
        queues freely: a new name is a new queue, never a slip of a known one, and a
        resume of a queue that is not paused leaves it as it is."""
        now = self.clock()
        await self.store.set_paused(queue, paused, now.wall)
        self.apply(self.engine.pause_queue(queue, paused, now))

    async def dead_letter(self, limit: int, offset: int, queue: str | None = None
                          ) -> tuple[list[dict[str, Any]], int]:
        """A page of the dead letter (of ``queue`` only, if given), newest first, and how
        many jobs it holds."""
        return await self.store.dead_letter(limit, offset, queue)

    async def dead_id(self, job_id: str) -> str | None:
        """The id a dead-letter job named ``job_id`` is kept under: as named, or, as the
        dead letter shows a producer's job, with its token's prefix (Principal.stored_id);
        None if no job in the dead letter has it."""
        for kept in (job_id, *await self.kept_as(job_id)):
            row = await self.store.get_job(kept)
            if row is not None and row.get("dead_letter") and row["state"] == "discarded":
                return kept
        return None

    async def retry_dead(self, job_id: str) -> dict[str, Any] | None:
        """Put a dead-letter job back (a Rota retry: a fresh attempt budget, and it
        leaves the dead letter); its row after, or None if it is not in the dead letter."""
        kept = await self.dead_id(job_id)
        return None if kept is None else await self.retry(kept)

    async def delete_dead(self, job_id: str) -> str | None:
        """Delete a dead-letter job for good: the id it was kept under, or None if it
        is not in the dead letter."""
        kept = await self.dead_id(job_id)
        return kept if kept is not None and await self.store.delete_dead(kept) else None

    async def ojs_rates(self, requests: Sequence[EnqueueRequest]) -> None:
        """Before an OJS enqueue: a job's ``rate_limit`` sets its queue's rate (the last
        job's wins: docs/ojs.md)."""
        for request in requests:
            rate = queue_rate(request.ojs.rate_limit if request.ojs is not None else None)
            if rate is not None:
                await self.limiting.queue_rate(request.queue or "default", rate)

    async def job_events(self, types: Sequence[str], queues: Sequence[str], limit: int
                         ) -> list[tuple[str, dict[str, Any]]]:
        """(event type, row) of the newest jobs per type (rota/store/ojs_reads.py)."""
        return await self.store.job_events(types, queues, limit)


def queue_rate(limit: OjsRateLimit | None) -> Rate | None:
    """The queue rate an OJS job's ``rate_limit`` asks for: starts evenly spaced (burst 1),
    ``max_per_second`` (or ``max_per_minute``) of them; None if it asks for none."""
    if limit is None:
        return None
    for per, period in ((limit.max_per_second, 1.0), (limit.max_per_minute, 60.0)):
        if per is not None and per > 0:
            if per >= 1 and float(per).is_integer():
                return Rate(limit=int(per), period=period, burst=1)
            return Rate(limit=1, period=min(MAX_PERIOD, period / per), burst=1)
    return None
