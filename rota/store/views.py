"""How the HTTP API shows stored things: rows in, JSON-ready dicts out."""

from __future__ import annotations

from typing import Any

import msgspec

from rota.base.protocol import rfc3339


def job_view(row: dict[str, Any]) -> dict[str, Any]:
    """A stored job as the HTTP API shows it."""

    def when(value: float | None) -> str | None:
        return rfc3339(value) if value is not None else None

    return {
        "id": row["id"],
        "spec": row["spec"],
        "queue": row["queue"],
        "state": row["state"],
        "priority": row["priority"],
        "attempt": row["attempt"],
        # Those max_attempts counts: since enqueue or the last manual retry (issue 22).
        "attempts_used": row["attempt"] - row["budget_start"],
        # Stored JSON goes out as it is (Raw): decoding it only to encode it again cost
        # a batch enqueue's answer a fifth of its time.
        "args": msgspec.Raw(row["args"]),
        "worker_id": row["worker_id"],
        "checksum": row["checksum"],
        "visibility_timeout": row["visibility_timeout"],
        "enqueued_at": when(row["enqueued_at"]),
        "reserved_at": when(row["reserved_at"]),
        "finished_at": when(row["finished_at"]),
        "result": msgspec.Raw(row["result"]) if row["result"] is not None else None,
        "errors": msgspec.json.decode(row["errors"] or "[]"),
        "run_at": when(row["run_at"]),
        "expires_at": when(row["expires_at"]),
        "fails": row["fails"],
        "deaths": row["deaths"],
        "max_attempts": row["max_attempts"],
        "max_fails": row["max_fails"],
        "cancel_requested": bool(row["cancel_requested"]),
        # Whether an active job's worker started it (False: it waits in its worker's line,
        # prefetched); null in any other state. The row does not know: the server that
        # holds the job says (rota/core/lines.py), and an active row counts as started.
        "started": row.get("started", True) if row["state"] == "active" else None,
        "capture_logs": bool(row["capture_logs"]),
        "unique_key": row.get("unique_key"),  # the unique key it holds (rota/core/unique.py)
        "concurrency_key": row.get("concurrency_key"),
        "labels": msgspec.json.decode(row.get("labels") or "[]"),
        # Where it came from (issue 24): the workflow it is a step of, its node there, and
        # the cron schedule whose tick made it; null for a job enqueued on its own.
        "workflow_id": row.get("workflow_id"),
        "workflow_node": row.get("workflow_node"),
        "schedule": row.get("schedule"),
        "progress": None if row["progress_at"] is None else {
            "percent": row["progress_percent"], "message": row["progress_message"],
            "at": rfc3339(row["progress_at"])},
    }
