"""Emptying the store for a test run: POST /ojs/v1/admin/reset, only under
``rota serve --unsafe-test-endpoints`` (docs/ojs.md). Specs, tokens and servers stay."""

from __future__ import annotations

import sqlite3

# What a reset empties: every job and what hangs on jobs, workflows, schedules, runtime
# limits and their starts, paused queues and the per-minute counts.
EMPTIED = ("jobs", "job_logs", "unique_keys", "workflows", "workflow_nodes", "schedules",
           "limits", "limit_starts", "queues", "throughput")


def empty(conn: sqlite3.Connection) -> None:
    """Delete every row of the EMPTIED tables, in one transaction (the writer's)."""
    for table in EMPTIED:
        conn.execute(f"DELETE FROM {table}")
