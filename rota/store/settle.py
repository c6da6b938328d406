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
from typing import NamedTuple

from rota.core.model import TERMINAL_STATES, Change, JobRecord
from rota.store import flows, ticks  # (the moves of a held job: rota/store/holds.py)


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


def ended_of(changes: Sequence[Change]) -> list[tuple[int, Ended]]:
    """The changes that end a workflow's or a schedule's job, by their index in
    ``changes``, as they are now (the writer runs later; the job may move on)."""
    return [(i, Ended(c.job.id, str(c.job.state), c.job.workflow_id, c.job.workflow_node,
                      c.job.schedule, c.result, c.error, c.job.attempt))
            for i, c in enumerate(changes)
            if (c.job.workflow_id is not None or c.job.schedule is not None)
            and c.job.state in TERMINAL_STATES]


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
    steps = [e for e in ended if e.workflow_id is not None and e.workflow_node is not None]
    if steps:
        released += flows.advance(conn, steps, now)
    for schedule in dict.fromkeys(e.schedule for e in ended if e.schedule is not None):
        released += ticks.release_next(conn, schedule, now)
    return released
