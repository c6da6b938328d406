"""A workflow as GET /workflows shows it: its row as a summary, and with its node rows as a
tree of steps with their states and job ids (the CLI and the dashboard draw that). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from rota.base import protocol as p
from rota.core.workflows import NodeRow


def _time(value: float | None) -> str | None:
    return None if value is None else p.rfc3339(value)


def summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """A workflow's row, as GET /workflows lists it."""
    return {"id": row["id"], "type": row["type"], "name": row["name"], "state": row["state"],
            "created_at": _time(row["created_at"]), "started_at": _time(row["started_at"]),
            "finished_at": _time(row["finished_at"]), "job_count": row["job_count"],
            "completed_count": row["completed_count"], "failed_count": row["failed_count"],
            "steps_total": row["steps_total"]}


def view(row: Mapping[str, Any], nodes: list[NodeRow],
         job_states: Mapping[str, str] | None = None,
         reasons: Mapping[str, str] | None = None) -> dict[str, Any]:
    """GET /workflows/{id}: the summary, the error record of a failed workflow (OJS §9.6)
    and the tree. ``job_states`` (job id -> state) shows a running step as ``active``;
    ``reasons`` (job id -> sentence) says why a released step's job is not taken."""
    error = row["error"]
    return {**summary(row),
            "error": msgspec.json.decode(error) if error else None,
            "root": tree(nodes, job_states or {}, reasons or {})}


def tree(nodes: list[NodeRow], job_states: Mapping[str, str],
         reasons: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The nodes (in preorder) as nested trees, the root's returned."""
    root: dict[str, Any] = {}
    open_: list[tuple[int, dict[str, Any]]] = []  # (end, tree) of the nodes around this one
    for node in nodes:
        state = node.state
        if state == "pending" and job_states.get(str(node.job_id)) == "active":
            state = "active"  # released, and a worker has it
        shown: dict[str, Any] = {"node": node.node, "kind": node.kind, "state": state,
                                 "position": node.position}
        if node.role is not None:
            shown["role"] = node.role
        if node.job_id is not None:
            shown["job_id"], shown["spec"] = node.job_id, node.spec
            if reasons and (reason := reasons.get(node.job_id)) is not None:
                shown["waiting_reason"] = reason  # (a released step no worker takes)
        shown["children"] = []
        while open_ and open_[-1][0] < node.node:
            open_.pop()
        if open_:
            open_[-1][1]["children"].append(shown)
        else:
            root = shown
        open_.append((node.end, shown))
    return root
