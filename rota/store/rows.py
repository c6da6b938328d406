"""Jobs as their rows: what a restart loads and what a claim reads back.

The store's reading side, kept apart from its writes: a live job rebuilt from its row
(``live_job``), a restart's snapshot (whole rows for the jobs held whole, keys made by
SQLite for plain available ones: rota/core/ready.py) and the claim, which reserves rows
only while they are still available and returns them.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rota.core.jobs import labels_of
from rota.core.observe import COUNTS
from rota.core.model import JobRecord, JobState, shared_limits
from rota.core.policy import ojs_limits
from rota.base.ojs import decode_extras
from rota.base.protocol import Registration
from rota.core.pins import Window
from rota.core.ready import PRIORITY_LIMIT, SEQ_BITS
from rota.base.specs import JobSpec, spec_from_builtins
from rota.store.writes import EXECUTED


WaitingGroup = tuple[str, str, str | None, tuple[str, ...]]


@dataclass(slots=True)
class Snapshot:
    status_quo: dict[str, JobSpec]
    checksums: dict[str, str]
    jobs: list[JobRecord]  # live jobs kept whole
    # (queue, spec, concurrency_key, labels) -> the keys of plain available jobs
    waiting: dict[WaitingGroup, list[int]]
    last_seq: int  # the highest row id
    retired: dict[str, float]  # retired specs: when (wall)
    paused: frozenset[str] = frozenset()  # paused queues (POST /queues/{name}/pause)
    clock_step: float = 0.0  # the wall clock's step since the last run, undone in the rows
    # The per-minute counts kept (writes.keep_throughput): (minute, queue, spec, *counts).
    throughput: list[tuple[Any, ...]] = field(default_factory=list)
    # Flow control (rota/store/limits.py): the rules set at runtime (rows), and the rate
    # starts within a day by (limit name, key), oldest first, for the windows to go on.
    limits: list[dict[str, Any]] = field(default_factory=list)
    limit_starts: dict[tuple[str, str | None], list[float]] = field(default_factory=dict)


def load(conn: sqlite3.Connection, server_id: str | None = None) -> Snapshot:
    """What a start takes in. ``server_id``: one of several servers on one database
    (docs/scaling.md), which takes in only the reservations its own workers held; the
    others' belong to them, or to whoever recovers them."""
    status_quo, checksums, retired = read_status_quo(conn)
    mine = "" if server_id is None else " AND server_id = ?"
    live = conn.execute(
        f"SELECT {', '.join(LIVE)} FROM jobs WHERE state IN ('scheduled', 'retryable')"
        f" OR (state = 'active'{mine}) OR (state = 'available' AND NOT ({_PLAIN}))"
        " ORDER BY rowid", () if server_id is None else (server_id,)
    )
    live.row_factory = None  # plain tuples
    jobs = [live_job(r) for r in live]
    paused = frozenset(r[0] for r in conn.execute("SELECT name FROM queues WHERE paused = 1"))
    return Snapshot(status_quo, checksums, jobs, _waiting(conn),
                    conn.execute("SELECT max(rowid) FROM jobs").fetchone()[0] or 0, retired,
                    paused, throughput=throughput(conn, server_id))


def throughput(conn: sqlite3.Connection, server_id: str | None = None) -> list[tuple[Any, ...]]:
    """The per-minute counts kept, oldest first: ``server_id``'s own on a database several
    servers share (each counts what it saw, as its /stats says), else every row (a SQLite
    file's servers were one at a time, whatever port named them)."""
    sums = ", ".join(f"sum({c})" for c in COUNTS)
    mine = "" if server_id is None else " WHERE server = ?"
    cursor = conn.execute(f"SELECT minute, queue, spec, {sums} FROM throughput{mine}"
                          " GROUP BY minute, queue, spec ORDER BY minute",
                          () if server_id is None else (server_id,))
    cursor.row_factory = None  # plain tuples
    return [(row[0], row[1], row[2], *map(int, row[3:])) for row in cursor]  # (PG: numeric)


def read_status_quo(conn: sqlite3.Connection
                    ) -> tuple[dict[str, JobSpec], dict[str, str], dict[str, float]]:
    """Each spec's status quo: (specs, checksums, retired specs and when) by name."""
    status_quo: dict[str, JobSpec] = {}
    checksums: dict[str, str] = {}
    retired: dict[str, float] = {}
    for row in conn.execute(
        "SELECT q.name, q.checksum, q.retired_at, v.body FROM status_quo q"
        " JOIN spec_versions v ON v.name = q.name AND v.checksum = q.checksum"
    ):
        status_quo[row["name"]] = spec_from_builtins(msgspec.json.decode(row["body"]))
        checksums[row["name"]] = row["checksum"]
        if row["retired_at"] is not None:
            retired[row["name"]] = row["retired_at"]
    return status_quo, checksums, retired


def read_windows(conn: sqlite3.Connection) -> dict[str, list[Window]]:
    """Every push, with its first job row, of the specs one of whose versions has an
    ``[execute]`` table, oldest first (rota/core/pins.py)."""
    windows: dict[str, list[Window]] = {}
    for row in conn.execute(
        "SELECT p.name, p.checksum, p.first_seq, v.body FROM spec_pushes p"
        " JOIN spec_versions v ON v.name = p.name AND v.checksum = p.checksum"
        " WHERE p.event = 'push' AND p.first_seq IS NOT NULL AND p.name IN"
        " (SELECT name FROM spec_versions WHERE body LIKE ?) ORDER BY p.id", (EXECUTED,)
    ):
        spec = spec_from_builtins(msgspec.json.decode(row["body"]))
        windows.setdefault(row["name"], []).append(Window(int(row["first_seq"]),
                                                          row["checksum"], spec))
    return windows


# A plain available job: kept as a key only (rota/core/ready.py). Anything else is kept whole.
_PLAIN = f"expires_at IS NULL AND priority > -{PRIORITY_LIMIT} AND priority < {PRIORITY_LIMIT}"


def _waiting(conn: sqlite3.Connection) -> dict[WaitingGroup, list[int]]:
    """The keys of the plain available jobs, by (queue, spec, concurrency_key, labels):
    one int per job, made by SQLite, so a restart builds no object per waiting job but
    the int itself. A (queue, spec) with no key or label reads only the keys."""
    waiting: dict[WaitingGroup, list[int]] = {}
    pairs: dict[tuple[str, str], set[tuple[str | None, str | None]]] = {}
    for queue, spec, key, labels in conn.execute(
            "SELECT DISTINCT queue, spec, concurrency_key, labels FROM jobs"
            " WHERE state = 'available'").fetchall():
        pairs.setdefault((sys.intern(queue), sys.intern(spec)), set()).add((key, labels))
    select = (f"SELECT (-priority << {SEQ_BITS}) + rowid{{}} FROM jobs"
              f" WHERE state = 'available' AND queue = ? AND spec = ? AND {_PLAIN}")
    for (queue, spec), kinds in pairs.items():
        if kinds == {(None, None)}:
            keys = conn.execute(select.format(""), (queue, spec))
            keys.row_factory = None
            found = [key for (key,) in keys]
            if found:
                waiting[(queue, spec, None, ())] = found
            continue
        rows = conn.execute(select.format(", concurrency_key, labels"), (queue, spec))
        rows.row_factory = None
        groups: dict[tuple[str | None, str | None], list[int]] = {}
        for key, concurrency_key, labels in rows:
            groups.setdefault((concurrency_key, labels), []).append(key)
        for (concurrency_key, labels), found in groups.items():
            waiting[(queue, spec, concurrency_key, labels_of(labels))] = found
    return waiting


# The columns a live job is rebuilt from at a restart, in live_job's order.
LIVE = ("rowid", "id", "spec", "queue", "args", "priority", "enqueued_at", "max_attempts",
         "max_fails", "backoff_base", "backoff_max", "max_worker_deaths", "visibility_timeout",
         "state", "attempt", "worker_id", "checksum", "run_at", "expires_at",
         "lease_expires_at", "fails", "deaths", "budget_start", "cancel_requested",
         "capture_logs", "created_by", "reserved_at", "worker_token", "concurrency_key",
         "labels", "workflow_id", "workflow_node", "parent_results", "schedule", "ojs")


# Claims: rows reserved only if they are still available, and read back whole.
_CLAIM = (
    "UPDATE jobs SET state = 'active', attempt = attempt + 1, worker_id = ?, worker_token = ?,"
    " checksum = ?, server_id = ?, reserved_at = ?,"
    " lease_expires_at = ? + MAX(COALESCE(NULLIF(visibility_timeout, 0), ?), ?)"
    " WHERE rowid IN ({}) AND +state = 'available' RETURNING " + ", ".join(LIVE)
)  # "+state": look the rows up by rowid, never by the (state, queue) index (a scan of
# every available job: 150 µs a job at 20,000 waiting instead of a few)


def claim_rows(conn: sqlite3.Connection, worker_id: str, checksum: str, now: float,
               lease: float, min_lease: float, seqs: list[int], server_id: str | None = None,
               token: str | None = None) -> list[tuple[Any, ...]]:
    """Reserve these rows for a worker (``token``: the id of the token it connected
    with) where they are still available; the rows reserved, as live_job reads them (in
    no particular order)."""
    cursor = conn.execute(_CLAIM.format(", ".join("?" * len(seqs))),
                          (worker_id, token, checksum, server_id, now, now, lease, min_lease,
                           *seqs))
    cursor.row_factory = None
    return cursor.fetchall()


def waiting_rows(conn: sqlite3.Connection, seqs: list[int]) -> list[tuple[Any, ...]]:
    """The rows of these ids that wait (as live_job reads them): jobs another server
    made wait (rota/store/fleet.py)."""
    out: list[tuple[Any, ...]] = []
    for start in range(0, len(seqs), 500):  # SQLite's limit on parameters
        chunk = seqs[start:start + 500]
        cursor = conn.execute(f"SELECT {', '.join(LIVE)} FROM jobs WHERE rowid IN"
                              f" ({', '.join('?' * len(chunk))})"
                              " AND state IN ('available', 'scheduled', 'retryable')", chunk)
        cursor.row_factory = None
        out += [tuple(r) for r in cursor.fetchall()]
    return out


def take_over(conn: sqlite3.Connection, server_id: str, worker_id: str, job_ids: list[str],
              token: str | None, queues: Collection[str] | None
              ) -> tuple[list[JobRecord], set[str]]:
    """``Store.take_over``: the jobs taken, or none and the other tokens whose workers
    hold some of them under this worker id."""
    others = set() if token is None else other_tokens(conn, worker_id, job_ids, token)
    if others:
        return [], others
    return [live_job(r) for r in take_over_rows(conn, server_id, worker_id, job_ids, token,
                                                queues)], others


def take_over_rows(conn: sqlite3.Connection, server_id: str, worker_id: str,
                   job_ids: list[str], token: str | None = None,
                   queues: Collection[str] | None = None) -> list[tuple[Any, ...]]:
    """Make the reservations this worker holds through other servers this server's:
    only rows still active for that worker (a job taken back meanwhile stays where it
    is), and, when it connected with a token (``token``, its id), reserved by a worker
    of that token (or of none): a worker id is no key to another token's jobs; of a
    token limited to ``queues``, only jobs of those (None: any). So exactly the jobs a
    reclaim on this server would give it (Registry.may_reclaim). The rows taken, as
    live_job reads them."""
    if queues is not None:  # a job's queue never changes: read first, then the fenced move
        job_ids = _of_queues(conn, job_ids, queues)
    out: list[tuple[Any, ...]] = []
    fence, extra = ("", ()) if token is None else (
        " AND (worker_token IS NULL OR worker_token = ?)", (token,))
    for start in range(0, len(job_ids), 500):  # SQLite's limit on parameters
        chunk = job_ids[start:start + 500]
        cursor = conn.execute(
            f"UPDATE jobs SET server_id = ? WHERE id IN ({', '.join('?' * len(chunk))})"
            " AND worker_id = ? AND state = 'active' AND (server_id IS NULL OR server_id <> ?)"
            + fence + " RETURNING " + ", ".join(LIVE),
            (server_id, *chunk, worker_id, server_id, *extra))
        cursor.row_factory = None
        out += [tuple(r) for r in cursor.fetchall()]
    return out


def _of_queues(conn: sqlite3.Connection, job_ids: list[str], queues: Collection[str]
               ) -> list[str]:
    """Of these jobs, those of one of ``queues``."""
    found: list[str] = []
    for start in range(0, len(job_ids), 500):  # SQLite's limit on parameters
        chunk = job_ids[start:start + 500]
        found += [r[0] for r in conn.execute(
            f"SELECT id, queue FROM jobs WHERE id IN ({', '.join('?' * len(chunk))})", chunk)
            if r[1] in queues]
    return found


def other_tokens(conn: sqlite3.Connection, worker_id: str, job_ids: list[str], token: str
                 ) -> set[str]:
    """The tokens (ids) other than ``token`` whose workers hold, under this worker id,
    any of these jobs (a worker id another token's worker is using)."""
    found: set[str] = set()
    for start in range(0, len(job_ids), 500):  # SQLite's limit on parameters
        chunk = job_ids[start:start + 500]
        found.update(r[0] for r in conn.execute(
            f"SELECT DISTINCT worker_token FROM jobs WHERE id IN ({', '.join('?' * len(chunk))})"
            " AND worker_id = ? AND state = 'active' AND worker_token IS NOT NULL"
            " AND worker_token <> ?", (*chunk, worker_id, token)))
    return found


def live_job(r: tuple[Any, ...]) -> JobRecord:
    """job_from_row for a restart: positional, and the names that repeat from row to row
    (spec, queue, state, worker, checksum, token) shared rather than held once per job."""
    (seq, job_id, spec, queue, args, priority, enqueued_at, max_attempts, max_fails,
     backoff_base, backoff_max, max_deaths, visibility_timeout, state, attempt, worker_id,
     checksum, run_at, expires_at, lease_expires_at, fails, deaths, budget_start,
     cancel_requested, capture_logs, created_by, reserved_at, worker_token, concurrency_key,
     labels, workflow_id, workflow_node, parent_results, schedule, ojs) = r
    intern = sys.intern
    extras = decode_extras(ojs)
    limits = ojs_limits(shared_limits(max_attempts or 25, max_fails, backoff_base or 1.0,
                                      backoff_max or 3600.0, max_deaths or 3), extras)
    return JobRecord(id=job_id, spec=intern(spec), queue=intern(queue),
                     args=msgspec.Raw(args.encode()), priority=priority, enqueued_at=enqueued_at,
                     seq=seq, limits=limits, visibility_timeout=visibility_timeout,
                     state=JobState(state), attempt=attempt,
                     worker_id=None if worker_id is None else intern(worker_id),
                     checksum=None if checksum is None else intern(checksum), run_at=run_at,
                     expires_at=expires_at, lease_expires_at=lease_expires_at, fails=fails,
                     deaths=deaths, budget_start=budget_start,
                     cancel_requested=bool(cancel_requested), capture_logs=bool(capture_logs),
                     created_by=None if created_by is None else intern(created_by),
                     reserved_at=reserved_at,
                     worker_token=None if worker_token is None else intern(worker_token),
                     concurrency_key=concurrency_key, labels=labels_of(labels),
                     workflow_id=workflow_id, workflow_node=workflow_node,
                     parent_results=None if parent_results is None
                     else msgspec.Raw(parent_results.encode()), schedule=schedule,
                     ojs=extras)


def worker_row(worker_id: str, reg: Registration, connected_at: float) -> dict[str, Any]:
    """A registration as its ``workers`` row (what operators see of the workers that came)."""
    return {"id": worker_id, "hostname": reg.hostname, "pid": reg.pid,
            "queues": msgspec.json.encode(reg.queues).decode(),
            "labels": msgspec.json.encode(reg.labels).decode(),
            "concurrency": reg.concurrency, "specs": msgspec.json.encode(reg.specs).decode(),
            "connected_at": connected_at, "disconnected_at": None}


def job_from_row(r: sqlite3.Row | dict[str, Any]) -> JobRecord:
    extras = decode_extras(r["ojs"])
    limits = ojs_limits(shared_limits(r["max_attempts"] or 25, r["max_fails"],
                                      r["backoff_base"] or 1.0, r["backoff_max"] or 3600.0,
                                      r["max_worker_deaths"] or 3), extras)
    return JobRecord(id=r["id"], spec=r["spec"], queue=r["queue"],
                     args=msgspec.Raw(r["args"].encode()),
                     priority=r["priority"], enqueued_at=r["enqueued_at"], seq=r["rowid"],
                     limits=limits, visibility_timeout=r["visibility_timeout"], state=r["state"],
                     attempt=r["attempt"], worker_id=r["worker_id"], checksum=r["checksum"],
                     run_at=r["run_at"], expires_at=r["expires_at"],
                     lease_expires_at=r["lease_expires_at"], fails=r["fails"], deaths=r["deaths"],
                     budget_start=r["budget_start"], cancel_requested=bool(r["cancel_requested"]),
                     capture_logs=bool(r["capture_logs"]), created_by=r["created_by"],
                     reserved_at=r["reserved_at"], concurrency_key=r["concurrency_key"],
                     labels=labels_of(r["labels"]), workflow_id=r["workflow_id"],
                     workflow_node=r["workflow_node"],
                     parent_results=None if r["parent_results"] is None
                     else msgspec.Raw(r["parent_results"].encode()), schedule=r["schedule"],
                     ojs=extras)
