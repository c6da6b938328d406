"""The store's reads (and one delete) for the OJS binding's operations: a queue's counts,
the dead letter, and events derived from the jobs' rows (docs/ojs.md). Functions of a
connection, and ``OjsReading``, the ``Store`` mixin that runs them (reads on the read pool,
the delete on the writer). SQLite's SQL; rota/store/pg_sql.py translates it.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from typing import Any

from rota.core.model import JOB_STATES
from rota.store.readers import Readers
from rota.store.writes import newest_kept
from rota.store.writer import Writer

# OJS event types, and the column that says when each happened (docs/ojs.md, Events): a
# job's row keeps its last moment of each kind, so each job gives at most one event a type.
# A retrying job's moment is its last error record's ("at" in ``errors``).
EVENT_TIMES: dict[str, str] = {
    "job.enqueued": "enqueued_at", "job.started": "reserved_at",
    "job.completed": "finished_at", "job.discarded": "finished_at",
    "job.cancelled": "finished_at", "job.retrying": "errors",
}
_EVENT_COLUMNS = ("id, created_by, spec, queue, state, attempt, budget_start, enqueued_at,"
                  " reserved_at, finished_at, run_at")


def queue_stats(conn: sqlite3.Connection, queue: str, now: float) -> dict[str, int]:
    """Jobs of ``queue`` by state, every state named. A scheduled or retryable job that is
    due counts as available, as the OJS view shows it (the engine may not have moved it
    yet). One probe of the (state, queue) index per state."""
    counts = dict.fromkeys(JOB_STATES, 0)
    for state, due, n in conn.execute(
            "SELECT state, state IN ('scheduled', 'retryable') AND run_at IS NOT NULL"
            " AND run_at <= ?, count(*) FROM jobs WHERE state IN"
            f" ({', '.join('?' * len(JOB_STATES))}) AND queue = ? GROUP BY 1, 2",
            (now, *JOB_STATES, queue)):
        counts["available" if due else state] += n
    return counts


def dead_letter_page(conn: sqlite3.Connection, limit: int, offset: int,
                     queue: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """A page of the dead letter (discarded jobs marked ``dead_letter``; of ``queue``
    only, if given), newest first, and how many it holds in all (both by the partial
    index jobs_dead_letter)."""
    where = "dead_letter = 1 AND state = 'discarded'" + ("" if queue is None else
                                                         " AND queue = ?")
    named = () if queue is None else (queue,)
    rows = conn.execute(f"SELECT rowid, * FROM jobs WHERE {where}"
                        " ORDER BY finished_at DESC, rowid DESC LIMIT ? OFFSET ?",
                        (*named, limit, offset)).fetchall()
    total = conn.execute(f"SELECT count(*) FROM jobs WHERE {where}", named).fetchone()[0]
    return [dict(row) for row in rows], total


def delete_dead(conn: sqlite3.Connection, job_id: str) -> bool:
    """Delete a dead-letter job with its log lines and a unique key it holds, as retention
    does (writes.prune); False if it is not in the dead letter (now)."""
    if newest_kept(conn, job_id):  # (rota/core/pins.py): out of the dead letter, row kept
        return conn.execute("UPDATE jobs SET dead_letter = 0 WHERE id = ? AND dead_letter = 1"
                            " AND state = 'discarded'", (job_id,)).rowcount > 0
    if conn.execute("DELETE FROM jobs WHERE id = ? AND dead_letter = 1 AND state = 'discarded'",
                    (job_id,)).rowcount == 0:
        return False
    for table in ("job_logs", "unique_keys"):
        conn.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
    return True


def job_events(conn: sqlite3.Connection, types: Sequence[str], queues: Sequence[str],
               limit: int) -> list[tuple[str, dict[str, Any]]]:
    """Up to ``limit`` (event type, row) of each type, the newest of each first: one query
    per type, over the index its state gives (the finished ones) or row order."""
    found: list[tuple[str, dict[str, Any]]] = []
    where_queue = f" AND queue IN ({', '.join('?' * len(queues))})" if queues else ""
    for kind in types:
        column = EVENT_TIMES[kind]
        if kind == "job.enqueued":  # rows go in as they are enqueued
            sql, params = "SELECT {c} FROM jobs WHERE 1 = 1{q} ORDER BY rowid DESC", []
        elif kind == "job.started":
            sql, params = ("SELECT {c} FROM jobs WHERE reserved_at IS NOT NULL{q}"
                           " ORDER BY reserved_at DESC"), []
        elif kind == "job.retrying":  # (its time: its last error's, in the row's errors)
            sql, params = ("SELECT {c}, errors FROM jobs WHERE state = 'retryable'{q}"
                           " ORDER BY rowid DESC"), []
        else:
            sql, params = (f"SELECT {{c}} FROM jobs WHERE state = ?{{q}} ORDER BY {column} DESC",
                           [kind.removeprefix("job.")])
        rows = conn.execute(sql.format(c=_EVENT_COLUMNS, q=where_queue) + " LIMIT ?",
                            (*params, *queues, limit))
        found.extend((kind, dict(row)) for row in rows)
    return found


class OjsReading:
    """``Store``'s OJS operations (rota/store/store.py inherits it)."""

    __slots__ = ()
    readers: Readers
    writer: Writer

    async def queue_stats(self, queue: str, now: float) -> dict[str, int]:
        return await self.readers.run(lambda conn: queue_stats(conn, queue, now))

    async def dead_letter(self, limit: int, offset: int, queue: str | None = None
                          ) -> tuple[list[dict[str, Any]], int]:
        return await self.readers.run(lambda conn: dead_letter_page(conn, limit, offset,
                                                                    queue))

    def delete_dead(self, job_id: str) -> asyncio.Future[bool]:
        return self.writer.submit(lambda conn: delete_dead(conn, job_id))

    async def job_events(self, types: Sequence[str], queues: Sequence[str], limit: int
                         ) -> list[tuple[str, dict[str, Any]]]:
        kinds, names = list(types), list(queues)  # (copies for the reader's thread)
        return await self.readers.run(lambda conn: job_events(conn, kinds, names, limit))
