"""What a job's ending sets off, in the transaction that stores the ending.

A workflow's next step and a cron schedule's next queued tick wait as ``pending`` rows
until the job before them ends. The store calls ``settle`` inside every transaction that
moves a job to a terminal state, for the jobs among them that belong to a workflow or a
schedule, so the release commits with the ending or not at all: a crash between the two
cannot lose a step or run one twice. The decisions are the core's (rota/core/workflows.py,
rota/core/schedules.py); this module reads and writes the rows they name.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any, NamedTuple

from rota.core.model import TERMINAL_STATES, Change, JobRecord
from rota.store import ticks
from rota.store.rows import LIVE, live_job


class Ended(NamedTuple):
    """A job of a workflow or a schedule that just ended, as its transaction wrote it."""

    job_id: str
    state: str  # completed | discarded | cancelled
    workflow_id: str | None
    workflow_node: int | None
    schedule: str | None
    result: bytes | None  # its result as JSON (completed), else None
    error: bytes | None  # its last error as JSON, if any
    attempt: int


def ended_of(changes: Sequence[Change], stored: Sequence[int]) -> list[Ended]:
    """The changes that ended a workflow's or a schedule's job, of those whose rows took
    them (``stored``: each change's row count)."""
    return [Ended(c.job.id, str(c.job.state), c.job.workflow_id, c.job.workflow_node,
                  c.job.schedule, c.result, c.error, c.job.attempt)
            for c, n in zip(changes, stored)
            if n and c.job.state in TERMINAL_STATES
            and (c.job.workflow_id is not None or c.job.schedule is not None)]


def ended_row(conn: sqlite3.Connection, seq: int) -> list[Ended]:
    """Row ``seq`` as an ending (just cancelled by a plain write), if it belongs to a
    workflow or a schedule."""
    row = conn.execute("SELECT id, state, workflow_id, workflow_node, schedule, attempt"
                       " FROM jobs WHERE rowid = ? AND (workflow_id IS NOT NULL"
                       " OR schedule IS NOT NULL)", (seq,)).fetchone()
    if row is None:
        return []
    return [Ended(row[0], row[1], row[2], row[3], row[4], None, None, row[5])]


def settle(conn: sqlite3.Connection, ended: Sequence[Ended], now: float) -> list[JobRecord]:
    """Carry out what these endings set off; the jobs released to wait (pending ->
    available), as their rows read now, for the engine to take in after the commit."""
    released: list[JobRecord] = []
    # rota/store/flows.py (a workflow's next steps) and rota/store/ticks.py (a schedule's
    # next queued tick) add theirs here.
    for schedule in dict.fromkeys(e.schedule for e in ended if e.schedule is not None):
        released += ticks.release_next(conn, schedule, now)
    return released


_RELEASE = ("UPDATE jobs SET state = 'available', parent_results = COALESCE(?, parent_results)"
            " WHERE id = ? AND state = 'pending' RETURNING " + ", ".join(LIVE))


def release(conn: sqlite3.Connection, jobs: Sequence[tuple[str, str | None]]
            ) -> list[JobRecord]:
    """Make pending jobs wait, each with what its workflow passes it (JSON text, or None
    to keep what it has); those still pending, as their rows read now."""
    out: list[JobRecord] = []
    for job_id, parents in jobs:
        cursor = conn.execute(_RELEASE, (parents, job_id))
        cursor.row_factory = None
        out += [live_job(row) for row in cursor]
    return out


def cancel_pending(conn: sqlite3.Connection, job_ids: Sequence[str], now: float,
                   error: Any = None) -> int:
    """Cancel pending jobs (never released: nothing holds them); how many were."""
    count = 0
    for job_id in job_ids:
        count += conn.execute(
            "UPDATE jobs SET state = 'cancelled', finished_at = ?,"
            " errors = CASE WHEN ? IS NULL THEN errors ELSE json_insert(errors, '$[#]',"
            " json(?)) END WHERE id = ? AND state = 'pending'",
            (now, error, error, job_id)).rowcount
    return count
