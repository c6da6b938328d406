"""Workflows in the store: a new one written whole in one transaction, its next steps in
the transaction that commits the ending before them (``advance``, from
rota/store/settle.py), its cancel and retry, and the reads behind its views. The
decisions are rota/core/workflows.py's; this reads the rows they need and writes what
they return. On PostgreSQL the workflow's row is locked first (``SELECT ... FOR
UPDATE``), so two servers ending two of its jobs at once advance it one after the other.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import sqlite3
from collections.abc import Sequence
from typing import Any

import msgspec

from rota.base.errors import Conflict, Invalid, UniqueConflict
from rota.base.protocol import ErrorInfo
from rota.core.jobs import error_record
from rota.core import workflows as wf
from rota.core.model import JobRecord, JobState
from rota.store import holds
from rota.store.writes import insert_jobs, insert_row

NODE_COLUMNS = ("node", "parent", "end_node", "kind", "position", "role", "state", "job_id",
                "spec", "remaining", "failed", "result", "error", "parent_results")
WORKFLOW_COLUMNS = ("id", "type", "name", "state", "digest", "created_at", "started_at",
                    "finished_at", "job_count", "completed_count", "failed_count",
                    "steps_total", "error", "created_by", "max_parent_results")
log = logging.getLogger("rota.server")
_NODES = f"SELECT {', '.join(NODE_COLUMNS)} FROM workflow_nodes WHERE workflow_id = ?"


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _text(data: bytes | None) -> str | None:
    return None if data is None else data.decode()


def _node(r: Sequence[Any]) -> wf.NodeRow:
    return wf.NodeRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10],
                      _bytes(r[11]), _bytes(r[12]), _bytes(r[13]))


class SqlRows:
    """A workflow's node rows as the open transaction sees them (rota/core/workflows.py Rows)."""

    def __init__(self, conn: sqlite3.Connection, workflow_id: str) -> None:
        self.conn, self.workflow_id = conn, workflow_id

    def _read(self, where: str, *params: Any) -> list[wf.NodeRow]:
        cursor = self.conn.execute(f"{_NODES} AND {where} ORDER BY node",
                                   (self.workflow_id, *params))
        return [_node(r) for r in cursor.fetchall()]

    def row(self, node: int) -> wf.NodeRow:
        return self._read("node = ?", node)[0]

    def span(self, first: int, last: int) -> list[wf.NodeRow]:
        return self._read("node BETWEEN ? AND ?", first, last)

    def children(self, node: int) -> list[wf.NodeRow]:
        return self._read("parent = ?", node)

    def all(self) -> list[wf.NodeRow]:
        return self._read("1 = 1")


def _head(conn: sqlite3.Connection, workflow_id: str) -> tuple[wf.Head, int] | None:
    """The workflow's changing fields and its limit, its row locked on PostgreSQL (SQLite's
    one writer holds the whole database already)."""
    lock = "" if isinstance(conn, sqlite3.Connection) else " FOR UPDATE"
    row = conn.execute("SELECT id, state, completed_count, failed_count, finished_at, error,"
                       f" max_parent_results FROM workflows WHERE id = ?{lock}",
                       (workflow_id,)).fetchone()
    if row is None:
        return None
    return wf.Head(row[0], row[1], row[2], row[3], row[4], _bytes(row[5])), row[6]


def workflow_row(conn: sqlite3.Connection, workflow_id: str) -> dict[str, Any] | None:
    row = conn.execute(f"SELECT {', '.join(WORKFLOW_COLUMNS)} FROM workflows WHERE id = ?",
                       (workflow_id,)).fetchone()
    return None if row is None else dict(zip(WORKFLOW_COLUMNS, row))


def apply(conn: sqlite3.Connection, decision: wf.Decision, now: float) -> list[JobRecord]:
    """Write a decision; the jobs it released, as their rows read now."""
    head = decision.head
    conn.execute("UPDATE workflows SET state = ?, completed_count = ?, failed_count = ?,"
                 " finished_at = ?, error = ? WHERE id = ?",
                 (head.state, head.completed_count, head.failed_count, head.finished_at,
                  _text(head.error), head.id))
    conn.executemany(
        "UPDATE workflow_nodes SET state = ?, remaining = ?, failed = ?, result = ?, error = ?,"
        " parent_results = ? WHERE workflow_id = ? AND node = ?",
        [(row.state, row.remaining, row.failed, _text(row.result), _text(row.error),
          _text(row.parent_results), head.id, row.node) for row in decision.rows])
    holds.hold_again(conn, decision.reset)
    released = holds.release(conn, [(job_id, inputs.decode())
                                    for job_id, inputs in decision.release], now)
    holds.end_pending(conn, [(job_id, error.decode()) for job_id, error in decision.discard],
                      "discarded", now)
    holds.cancel_pending(conn, decision.cancel, now)
    return released


# -- a new workflow ------------------------------------------------------------------------
def create(conn: sqlite3.Connection, row: dict[str, Any], nodes: list[wf.NodeRow],
           jobs: list[JobRecord], paths: list[str], decision: wf.Decision, now: float
           ) -> tuple[dict[str, Any], bool, list[JobRecord]]:
    """Store a workflow whole: its row, every node, every job (pending, but those its start
    releases). An existing id is that workflow if its definition is the same (not new),
    else a Conflict. A step whose unique key is held refuses the whole workflow."""
    # The insert decides, not a read before it: of two servers creating one id at once on
    # PostgreSQL, the second's insert waits for the first's commit, then finds its row.
    if not conn.execute(f"INSERT INTO workflows ({', '.join(row)}) VALUES"
                        f" ({', '.join('?' * len(row))}) ON CONFLICT(id) DO NOTHING",
                        tuple(row.values())).rowcount:
        existing = workflow_row(conn, row["id"])
        if existing is None or (existing["digest"], existing["created_by"]) != (
                row["digest"], row["created_by"]):
            raise Conflict("workflow_exists", f"workflow {row['id']} exists already, with"
                           " another definition or made with another token: give this one"
                           " another id")
        return existing, False, []
    conn.executemany(
        f"INSERT INTO workflow_nodes (workflow_id, {', '.join(NODE_COLUMNS)}) VALUES"
        f" ({', '.join('?' * (len(NODE_COLUMNS) + 1))})",
        [(row["id"], n.node, n.parent, n.end, n.kind, n.position, n.role, n.state, n.job_id,
          n.spec, n.remaining, n.failed, _text(n.result), _text(n.error),
          _text(n.parent_results)) for n in nodes])
    # The jobs its start releases go in waiting at once (one write each, not an insert
    # and then a release): the same rows the release would make. The decision is left as
    # it came: the writer runs a transaction again from the start after a deadlock with
    # another server's, and the second run must release what the first did (it once
    # found the list emptied, stored the step waiting and told no server of it).
    first = {job_id: inputs for job_id, inputs in decision.release}
    for job in jobs:
        if (inputs := first.get(job.id)) is not None:
            job.state, job.parent_results = JobState.AVAILABLE, msgspec.Raw(inputs)
    stored = insert_jobs(conn, jobs, [insert_row(job) for job in jobs], [None] * len(jobs), now)
    for (job_row, new), path, job in zip(stored, paths, jobs, strict=True):
        if not new:  # (a job id is new by construction: only a unique key can meet one)
            holder = job_row["id"]
            raise UniqueConflict(f"{path}: job {holder} holds this step's unique key"
                                 f" ({job_row['state']}); a workflow's step cannot be"
                                 " skipped", {"job_id": holder, "state": job_row["state"]})
        job.seq = job_row["rowid"]
    rest = dataclasses.replace(decision, release=[])  # (those went in waiting above)
    return row, True, apply(conn, rest, now) + [job for job in jobs if job.id in first]


# -- endings ---------------------------------------------------------------------------------
def advance(conn: sqlite3.Connection, ended: Sequence[Any], now: float) -> list[JobRecord]:
    """Carry the endings of workflows' jobs (rota/store/settle.py ``Ended``, which imports
    this module) up their trees (rota/core/workflows.py Flow):
    the jobs released to wait, as their rows read now. Workflows are locked in id order,
    so two servers' transactions never wait for each other in a circle."""
    by_workflow: dict[str, list[Any]] = {}
    for ending in ended:
        by_workflow.setdefault(str(ending.workflow_id), []).append(ending)
    released: list[JobRecord] = []
    for workflow_id in sorted(by_workflow):
        found = _head(conn, workflow_id)
        if found is None:
            continue  # (deleted with its jobs kept: nothing to advance)
        head, limit = found
        was = head.state
        flow = wf.Flow(head, SqlRows(conn, workflow_id), limit=limit, now=now)
        for e in by_workflow[workflow_id]:
            flow.end(wf.Ending(int(e.workflow_node or 0), e.state, e.result, e.error,
                               e.attempt))
        decision = flow.done()
        if decision.rows:
            released += apply(conn, decision, now)
        if head.state != was:  # it ended (logged in its transaction: a rerun says it again)
            log.info("workflow %s id=%s completed=%d failed=%d", head.state, workflow_id,
                     head.completed_count, head.failed_count)
    return released


# -- an operator's ---------------------------------------------------------------------------
def cancel(conn: sqlite3.Connection, workflow_id: str, now: float
           ) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]] | None:
    """Cancel a workflow (rota/core/workflows.py cancel), in one transaction with its held
    jobs and its released jobs that still wait: its row, those waiting jobs' rows (for the
    engine to let go of), and the running ones, to cancel through their workers once this
    commits. None: no such workflow."""
    found = _head(conn, workflow_id)
    if found is None:
        return None
    decision = wf.cancel(found[0], SqlRows(conn, workflow_id).all(), now=now)
    apply(conn, decision, now)
    why = error_record(ErrorInfo(type="cancelled", retryable=False,
                                 message=f"its workflow {workflow_id} was cancelled"),
                       attempt=0, worker_id=None, now=now).decode()
    waiting: list[dict[str, Any]] = []
    for job_id in decision.live:
        waiting += holds.cancel_waiting(conn, job_id, why, now)
    gone = {r["id"] for r in waiting}
    row = workflow_row(conn, workflow_id)
    assert row is not None
    return row, waiting, [job_id for job_id in decision.live if job_id not in gone]


def retry(conn: sqlite3.Connection, workflow_id: str, now: float
          ) -> tuple[dict[str, Any], list[JobRecord]] | None:
    """Retry a failed workflow (rota/core/workflows.py retry): its row, and the jobs
    released. None: no such workflow."""
    found = _head(conn, workflow_id)
    if found is None:
        return None
    head, limit = found
    decision = wf.retry(head, SqlRows(conn, workflow_id).all(), limit=limit, now=now)
    if gone := _gone(conn, decision.reset):
        raise Conflict("not_retryable", f"workflow {workflow_id} cannot run again: the"
                       f" job of a step that must rerun was deleted ({gone[0]}"
                       f"{f' and {len(gone) - 1} more' if len(gone) > 1 else ''}; retention,"
                       " rota serve --retain-discarded / --retain-cancelled)")
    released = apply(conn, decision, now)
    row = workflow_row(conn, workflow_id)
    assert row is not None
    return row, released


def _gone(conn: sqlite3.Connection, job_ids: Sequence[str]) -> list[str]:
    """Those of ``job_ids`` whose rows are gone (deleted by retention once finished)."""
    found: set[str] = set()
    for start in range(0, len(job_ids), 500):  # SQLite's limit on parameters
        chunk = job_ids[start:start + 500]
        found.update(r[0] for r in conn.execute(
            f"SELECT id FROM jobs WHERE id IN ({', '.join('?' * len(chunk))})", chunk))
    return [job_id for job_id in job_ids if job_id not in found]


# -- reads -------------------------------------------------------------------------------
def read(conn: sqlite3.Connection, workflow_id: str
         ) -> tuple[dict[str, Any], list[wf.NodeRow], dict[str, str],
                    list[dict[str, Any]]] | None:
    """A workflow's row, its nodes in preorder, its jobs' states (by id), and the rows of
    those available (id, queue, spec, concurrency key, labels: why they wait is asked)."""
    row = workflow_row(conn, workflow_id)
    if row is None:
        return None
    nodes = SqlRows(conn, workflow_id).all()
    states: dict[str, str] = {}
    waiting: list[dict[str, Any]] = []
    for r in conn.execute("SELECT id, state, queue, spec, concurrency_key, labels FROM jobs"
                          " WHERE workflow_id = ?", (workflow_id,)).fetchall():
        states[r[0]] = r[1]
        if r[1] == "available":
            waiting.append({"id": r[0], "queue": r[2], "spec": r[3],
                            "concurrency_key": r[4], "labels": r[5]})
    return row, nodes, states, waiting


def encode_cursor(row: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode([row["created_at"], row["id"]])
                                    ).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[float, str]:
    try:
        at, workflow_id = msgspec.json.decode(
            base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)), type=tuple[float, str])
    except (ValueError, msgspec.DecodeError) as exc:
        raise Invalid("invalid_cursor", "after is not a cursor this server gave") from exc
    return at, workflow_id


def page(conn: sqlite3.Connection, *, state: str | None, name: str | None,
         created_by: str | None, limit: int, after: tuple[float, str] | None
         ) -> tuple[list[dict[str, Any]], str | None]:
    """Workflows, newest first, those matching; and the cursor of the next page."""
    where, params = ["1 = 1"], []
    for column, value in (("state", state), ("name", name), ("created_by", created_by)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if after is not None:
        where.append("(created_at < ? OR (created_at = ? AND id < ?))")
        params += [after[0], after[0], after[1]]
    rows = [dict(zip(WORKFLOW_COLUMNS, r)) for r in conn.execute(
        f"SELECT {', '.join(WORKFLOW_COLUMNS)} FROM workflows WHERE {' AND '.join(where)}"
        " ORDER BY created_at DESC, id DESC LIMIT ?", (*params, limit + 1)).fetchall()]
    more = len(rows) > limit
    return rows[:limit], encode_cursor(rows[limit - 1]) if more else None
