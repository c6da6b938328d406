"""Unique keys in the enqueue transaction: each job that claims one (rota/core/unique.py)
takes it, or meets the job that holds it, on the writer's connection.

Strong on both backends: the key is the ``unique_keys`` table's primary key, locked
(an upsert) before the holder's state is read and judged, in the transaction that
inserts the job. On PostgreSQL a second server's upsert of the same key waits for the
first's COMMIT and then sees its holder; keys are locked in sorted order, so two
batches never wait for each other in a circle.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any, NamedTuple

from rota.base.protocol import ErrorInfo
from rota.core.jobs import error_record
from rota.core.model import JobRecord
from rota.core.unique import UniqueClaim, Verdict, decide

# The key's row, made free (job_id '') if new, locked either way, as it is now.
LOCK = ("INSERT INTO unique_keys (key, job_id, covers, until) VALUES (?, '', 'active', NULL)"
        " ON CONFLICT(key) DO UPDATE SET covers = unique_keys.covers RETURNING job_id, covers, until")
TAKE = "UPDATE unique_keys SET job_id = ?, covers = ?, until = ? WHERE key = ?"

# A waiting holder replaced: cancelled in the same transaction, fenced on its state.
REPLACE = ("UPDATE jobs SET state = 'cancelled', finished_at = ?,"
           " errors = json_insert(errors, '$[#]', json(?))"
           " WHERE id = ? AND state IN ('scheduled', 'available', 'retryable')")
FREE = "DELETE FROM unique_keys WHERE key = ? AND job_id = ''"


def shift(conn: sqlite3.Connection, step: float) -> None:
    """The wall clock stepped (one server per file): each key's period ends as far away
    as before it, so a step ahead frees no key early and a step back holds none longer."""
    conn.execute("UPDATE unique_keys SET until = until + ? WHERE until IS NOT NULL", (step,))


class Met(NamedTuple):
    """A unique job that did not go in as new: the job holding its key, and why."""

    verdict: Verdict  # "existing" | "reject" | "running"
    holder: dict[str, Any]  # its row


class Keys:
    """The unique keys of one enqueue transaction, locked and read once each."""

    def __init__(self, conn: sqlite3.Connection, jobs: list[JobRecord], now: float) -> None:
        self.conn = conn
        self.now = now
        self.held: dict[str, tuple[str, str, float | None]] = {}
        for key in sorted({job.unique.key for job in jobs if job.unique is not None}):
            row = conn.execute(LOCK, (key,)).fetchone()
            self.held[key] = (str(row[0]), str(row[1]), row[2])

    def admit(self, job: JobRecord, fetch: Callable[[str], dict[str, Any] | None]
              ) -> Met | list[dict[str, Any]]:
        """Judge ``job``'s claim against its key's holder: what it met, or the key is now
        its own (it goes in), with the holder it replaced (cancelled here) if any."""
        claim = job.unique
        assert claim is not None
        holder: dict[str, Any] | None = None
        for _ in range(2):  # a replace whose holder moved on meanwhile is judged again
            holder_id, covers, until = self.held[claim.key]
            holder = fetch(holder_id) if holder_id else None
            verdict = decide(claim, None if holder is None else holder["state"], covers,
                             until, self.now)
            if verdict == "take":
                return self._take(job.id, claim, [])
            assert holder is not None
            if verdict != "replace":
                return Met(verdict, holder)
            if holder.get("workflow_id") or holder.get("schedule"):
                # Its workflow or schedule waits for its ending: a cancel here would
                # never reach them (it is not a settled ending), so it is not replaced.
                return Met("held", holder)
            if self.conn.execute(REPLACE, (self.now, _replaced(job.id, holder, self.now),
                                           holder_id)).rowcount == 1:
                return self._take(job.id, claim, [holder])
        assert holder is not None
        return Met("running", holder)

    def _take(self, job_id: str, claim: UniqueClaim, replaced: list[dict[str, Any]]
              ) -> list[dict[str, Any]]:
        self.conn.execute(TAKE, (job_id, claim.covers, claim.until, claim.key))
        self.held[claim.key] = (job_id, claim.covers, claim.until)
        return replaced

    def done(self) -> None:
        """Keys locked as new that no job took (each of their jobs' ids existed)."""
        for key, (holder, _, _) in self.held.items():
            if not holder:
                self.conn.execute(FREE, (key,))


def _replaced(by: str, holder: dict[str, Any], now: float) -> str:
    """The record a replaced job keeps, beside its attempts' errors: who replaced it."""
    return error_record(ErrorInfo(type="replaced", retryable=False,
                                  message=f"replaced by job {by} (unique, on_conflict replace)"),
                        attempt=holder["attempt"], worker_id=None, now=now).decode()
