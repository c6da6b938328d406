"""The workflow operations of ``Store`` (rota/store/store.py inherits them): rota/store/flows.py's
functions, queued on the writer in call order or run on the read pool."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any, TypeVar

from rota.core import workflows as wf
from rota.core.model import JobRecord
from rota.store import flows
from rota.store.readers import Readers
from rota.store.writer import Writer

T = TypeVar("T")


class Flowing:
    """Workflows' writes and reads, for ``Store``."""

    __slots__ = ()
    writer: Writer
    readers: Readers

    def _announce(self, conn: sqlite3.Connection, released: list[JobRecord]
                  ) -> list[JobRecord]: ...

    def _releasing(self, future: asyncio.Future[T], released: list[JobRecord]
                   ) -> asyncio.Future[T]: ...

    def create_workflow(self, row: dict[str, Any], nodes: list[wf.NodeRow],
                        jobs: list[JobRecord], paths: list[str], decision: wf.Decision
                        ) -> asyncio.Future[tuple[dict[str, Any], bool]]:
        """Store a new workflow whole (flows.create): its row and whether it is new. The
        jobs its start released go to ``on_released`` at the commit."""
        released: list[JobRecord] = []

        def op(conn: sqlite3.Connection) -> tuple[dict[str, Any], bool]:
            stored, created, out = flows.create(conn, row, nodes, jobs, paths, decision,
                                                time.time())
            released[:] = self._announce(conn, out)
            return stored, created

        return self._releasing(self.writer.submit(op), released)

    def cancel_workflow(self, workflow_id: str, now: float
                        ) -> asyncio.Future[tuple[dict[str, Any], list[dict[str, Any]],
                                                  list[str]] | None]:
        """flows.cancel: the row, the waiting jobs it cancelled, and the running ones to
        cancel the ordinary way."""
        return self.writer.submit(lambda conn: flows.cancel(conn, workflow_id, now))

    def retry_workflow(self, workflow_id: str, now: float
                       ) -> asyncio.Future[dict[str, Any] | None]:
        """flows.retry: the row; the jobs released go to ``on_released`` at the commit."""
        released: list[JobRecord] = []

        def op(conn: sqlite3.Connection) -> dict[str, Any] | None:
            found = flows.retry(conn, workflow_id, now)
            if found is None:
                return None
            released[:] = self._announce(conn, found[1])
            return found[0]

        return self._releasing(self.writer.submit(op), released)

    async def workflow(self, workflow_id: str
                       ) -> tuple[dict[str, Any], list[wf.NodeRow], dict[str, str],
                                  list[dict[str, Any]]] | None:
        """flows.read: the row, the nodes, the jobs' states, the available jobs' rows."""
        return await self.readers.run(lambda conn: flows.read(conn, workflow_id))

    async def workflows(self, *, state: str | None, name: str | None,
                        created_by: str | None, limit: int, after: str | None
                        ) -> tuple[list[dict[str, Any]], str | None]:
        """flows.page: a page of workflows, newest first, and the next page's cursor.
        Invalid (invalid_cursor) on a cursor this server did not give."""
        cursor = flows.decode_cursor(after) if after is not None else None
        return await self.readers.run(lambda conn: flows.page(
            conn, state=state, name=name, created_by=created_by, limit=limit, after=cursor))
