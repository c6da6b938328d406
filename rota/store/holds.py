"""Pending jobs, held until their workflow or their schedule releases them: released to
wait, cancelled, discarded, or (a workflow's retry) held again after they ended. SQLite's
SQL, fenced on the state each move starts from."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from rota.core.model import JobRecord
from rota.store.rows import LIVE, live_job

# A held job's time to live counts from its release, not from when it was stored: a
# workflow's later step or a queued tick has not been waiting for a worker until then.
TTL_FROM_NOW = ("expires_at = CASE WHEN expires_at IS NULL THEN NULL"
                " ELSE ? + (expires_at - enqueued_at) END")
_RELEASE = ("UPDATE jobs SET state = 'available', parent_results = COALESCE(?, parent_results),"
            f" {TTL_FROM_NOW} WHERE id = ? AND state = 'pending' RETURNING " + ", ".join(LIVE))
_END = ("UPDATE jobs SET state = ?, finished_at = ?,"
        " errors = CASE WHEN ? IS NULL THEN errors ELSE json_insert(errors, '$[#]',"
        " json(?)) END WHERE id = ? AND state = 'pending'")
# A waiting job cancelled along with what it belongs to (its workflow, or its schedule's
# next tick), fenced on its state; its row's fields for the engine to let go of it.
_CANCEL_WAITING = (
    "UPDATE jobs SET state = 'cancelled', finished_at = ?,"
    " errors = json_insert(errors, '$[#]', json(?)) WHERE id = ?"
    " AND state IN ('scheduled', 'available', 'retryable')"
    " RETURNING rowid, id, spec, queue, priority, attempt, concurrency_key, labels")
_WAITING_FIELDS = ("rowid", "id", "spec", "queue", "priority", "attempt", "concurrency_key",
                   "labels")
# A finished job held again (a workflow's retry): a fresh attempt budget, as a manual retry
# gives (Intake.retry), until its workflow releases it.
_HOLD = ("UPDATE jobs SET state = 'pending', budget_start = attempt, fails = 0, deaths = 0,"
         " cancel_requested = 0, expires_at = NULL, run_at = NULL, worker_id = NULL,"
         " finished_at = NULL WHERE id = ? AND state IN ('discarded', 'cancelled')")


def release(conn: sqlite3.Connection, jobs: Sequence[tuple[str, str | None]], now: float
            ) -> list[JobRecord]:
    """Make pending jobs wait, each with what its workflow passes it (JSON text, or None
    to keep what it has); those still pending, as their rows read now."""
    out: list[JobRecord] = []
    for job_id, parents in jobs:
        cursor = conn.execute(_RELEASE, (parents, now, job_id))
        cursor.row_factory = None
        out += [live_job(row) for row in cursor]
    return out


def cancel_pending(conn: sqlite3.Connection, job_ids: Sequence[str], now: float,
                   error: Any = None) -> int:
    """Cancel pending jobs (never released: nothing holds them); how many were."""
    return end_pending(conn, [(job_id, error) for job_id in job_ids], "cancelled", now)


def end_pending(conn: sqlite3.Connection, jobs: Sequence[tuple[str, Any]], state: str,
                now: float) -> int:
    """End pending jobs (``cancelled`` or ``discarded``), each with its error (JSON text,
    or None); how many were pending."""
    return sum(conn.execute(_END, (state, now, error, error, job_id)).rowcount
               for job_id, error in jobs)


def hold_again(conn: sqlite3.Connection, job_ids: Sequence[str]) -> int:
    """Discarded or cancelled jobs pending again; how many were."""
    return sum(conn.execute(_HOLD, (job_id,)).rowcount for job_id in job_ids)


def cancel_waiting(conn: sqlite3.Connection, job_id: str, why: str, now: float
                   ) -> list[dict[str, Any]]:
    """Cancel a job if it waits for a worker, with ``why`` (an error record, JSON text):
    its row as the engine's ``replaced`` takes it, or none (it did not wait)."""
    cursor = conn.execute(_CANCEL_WAITING, (now, why, job_id))
    return [dict(zip(_WAITING_FIELDS, r)) for r in cursor.fetchall()]
