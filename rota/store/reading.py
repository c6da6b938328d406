"""What the store reads for the API and the views, on the read pool (never the writer).

``Store`` inherits these: each is a read of a committed snapshot, so a slow listing never
waits behind a write, nor a write behind it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rota.core.listing import JobFilter, decode_cursor
from rota.core.model import JOB_STATES
from rota.store import limits, lookup, reads
from rota.store import writes as sql
from rota.store.readers import Readers
from rota.store.tokens import live_tokens
from rota.store.views import job_view


class Reading:
    """The reads of ``Store`` (rota/store/store.py) that go through its read pool."""

    __slots__ = ()
    readers: Readers

    # -- reads ---------------------------------------------------------------------
    async def get_job(self, job_id: str) -> dict[str, Any] | None:
        return await self.readers.run(lambda conn: sql.fetch_job(conn, job_id))

    async def live_tokens(self) -> list[dict[str, Any]]:
        return await self.readers.run(live_tokens)

    async def job_logs(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """The job's last ``limit`` log lines and alerts, oldest first."""
        return await self.readers.run(lambda conn: reads.job_logs(conn, job_id, limit))

    async def queue_counts(self, states: Sequence[str] = JOB_STATES
                           ) -> dict[str, dict[str, int]]:
        """reads.queue_counts: jobs per queue and state."""
        return await self.readers.run(lambda conn: reads.queue_counts(conn, states))

    async def oldest_available_since(self, queues: Iterable[str]) -> dict[str, float]:
        """reads.oldest_available_since: per queue, when its first job could run."""
        names = list(queues)  # (read here, on the loop: the thread gets a copy)
        return await self.readers.run(
            lambda conn: reads.oldest_available_since(conn, names))

    # -- what an operator looks for (rota/store/lookup.py) --------------------------------
    async def list_jobs(self, flt: JobFilter, limit: int, cursor: str | None
                        ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of matching jobs, newest first, as the API shows them, and the cursor
        of the next page (None: this is the last). RequestError on a bad cursor."""
        before = decode_cursor(cursor) if cursor is not None else None
        found, after = await self.readers.run(
            lambda conn: lookup.page(conn, flt, limit, before))
        return [job_view(row) for _, row in found], after

    async def match_jobs(self, flt: JobFilter, limit: int, pages: int = 20
                         ) -> tuple[list[tuple[str, str]], bool]:
        """(id, state) of up to ``limit + 1`` matching jobs, newest first (one more than
        ``limit`` says more match), and whether a bounded search (q) stopped after
        ``pages`` scans with rows left unexamined."""
        return await self.readers.run(lambda conn: lookup.match(conn, flt, limit, pages))

    async def count_jobs(self, flt: JobFilter) -> int:
        """Matching jobs, counted up to lookup.COUNT_CAP (100,000)."""
        return await self.readers.run(lambda conn: lookup.count(conn, flt))

    async def state_counts(self) -> dict[str, int]:
        return await self.readers.run(lookup.state_counts)

    async def oldest_available(self, now: float) -> dict[str, float | None]:
        """Per queue, seconds its longest-waiting available job has waited."""
        return await self.readers.run(lambda conn: lookup.oldest_available(conn, now))

    async def job_states(self, ids: list[str]) -> dict[str, str]:
        """The state of each of these jobs that exists."""
        return await self.readers.run(lambda conn: reads.job_states(conn, ids))

    async def runtime_limits(self) -> list[dict[str, Any]]:
        return await self.readers.run(limits.read_limits)

    async def spec_jobs(self, name: str) -> tuple[dict[str, int], list[str]]:
        """Unfinished jobs of spec ``name``: counts by state, and the ids of waiting ones."""
        return await self.readers.run(lambda conn: reads.spec_jobs(conn, name))

    async def spec_history(self, name: str) -> list[dict[str, Any]]:
        return await self.readers.run(lambda conn: reads.spec_history(conn, name))
