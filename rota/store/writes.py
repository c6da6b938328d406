"""What the store's writes run on the writer's connection: their SQL, and the parts of
them that are functions of a connection and their arguments (rota/store/store.py queues them
on the writer thread, in call order). SQLite's SQL; rota/store/pg_sql.py translates it for
PostgreSQL.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from rota.base.ojs import encode_extras
from rota.core.jobs import labels_text
from rota.core.observe import COUNTS
from rota.core.model import WAITING_STATES, Change, ClockReading, JobRecord, StatusNote, wall_step
from rota.core.retention import Cutoff
from rota.base.specs import JobSpec
from rota.store import uniques
from rota.store.uniques import Keys, Met

log = logging.getLogger("rota.server")


@dataclass(slots=True)
class SpecChange:
    name: str
    checksum: str
    previous: str | None
    change: str  # "new" | "changed" | "unchanged"
    first_seq: int | None = None  # the first job row after the push (rota/core/pins.py)


# -- enqueue -----------------------------------------------------------------------------
# The columns insert_row gives, in order (attempt is always 0).
_INSERTED = ("id", "spec", "queue", "args", "priority", "state", "visibility_timeout",
             "enqueued_at", "run_at", "expires_at", "max_attempts", "max_fails", "backoff_base",
             "backoff_max", "capture_logs", "created_by", "max_worker_deaths",
             "concurrency_key", "labels", "workflow_id", "workflow_node", "parent_results",
             "schedule", "ojs")
_INSERT = (
    f"INSERT INTO jobs ({', '.join(_INSERTED[:6])}, attempt, {', '.join(_INSERTED[6:])})"
    f" VALUES ({', '.join('?' * 6)}, 0, {', '.join('?' * (len(_INSERTED) - 6))})"
    " ON CONFLICT(id) DO NOTHING"
)
_RETURNING_ROW = " RETURNING rowid, *"


def insert_jobs(conn: sqlite3.Connection, jobs: list[JobRecord], rows: list[tuple[Any, ...]],
                olds: Sequence[str | None], now: float = 0.0
                ) -> list[tuple[dict[str, Any], bool]]:
    """Insert jobs (``Store.enqueue``; ``rows``: their ``insert_row``s, taken when the
    write was queued): each one's row, and whether it is new (False: the id existed
    already, or ``olds`` names the row its token made before ids were scoped).
    A unique job (rota/store/uniques.py: judged as of ``now``) whose key is held comes
    back as the holder's row, not new, with ``unique_met`` saying why."""
    keys = Keys(conn, jobs, now) if any(job.unique is not None for job in jobs) else None
    outcomes: list[tuple[dict[str, Any], bool]] = []
    template: dict[str, Any] | None = None
    for job, row, old in zip(jobs, rows, olds, strict=True):
        if old is not None and (kept := _made_before(conn, job, old)) is not None:
            outcomes.append((kept, False))
            continue
        replaced: list[dict[str, Any]] = []
        if keys is not None and job.unique is not None:
            if (known := fetch_job(conn, job.id)) is not None:  # its id decides, as always
                outcomes.append((known, False))
                continue
            admitted = keys.admit(job, lambda job_id: fetch_job(conn, job_id))
            if isinstance(admitted, Met):
                outcomes.append(({**admitted.holder, "unique_met": admitted.verdict}, False))
                continue
            replaced = admitted
        _insert(conn, row, outcomes, template)
        if template is None and outcomes[-1][1]:
            template = dict(outcomes[-1][0])
        if job.unique is not None and outcomes[-1][1]:
            outcomes[-1][0].update(unique_key=job.unique.key, unique_replaced=replaced)
    if keys is not None:
        keys.done()
    return outcomes


def _insert(conn: sqlite3.Connection, row: tuple[Any, ...],
            outcomes: list[tuple[dict[str, Any], bool]], template: dict[str, Any] | None
            ) -> None:
    """Insert one job's row: its outcome appended (the first new row of a batch is
    ``template``, the one the others are made from)."""
    # RETURNING gives the new row in the same statement; only an id that
    # exists already needs a second look, to be judged the same job or not.
    # The first new row of a batch comes back whole; every other differs from
    # it only in what was inserted, so it is made from that (a third of the
    # cost of reading each back).
    if template is None:
        inserted = conn.execute(_INSERT + _RETURNING_ROW, row).fetchone()
        if inserted is not None:
            outcomes.append((dict(inserted), True))
            return
    else:
        inserted = conn.execute(_INSERT + " RETURNING rowid", row).fetchone()
        if inserted is not None:
            made = dict(template)
            made.update(zip(_INSERTED, row))
            made["rowid"] = inserted[0]
            outcomes.append((made, True))
            return
    outcomes.append((fetch_job(conn, row[0]), False))


def stored_rows(conn: sqlite3.Connection, jobs: list[JobRecord], olds: Sequence[str | None]
                ) -> list[dict[str, Any] | None]:
    """The rows these jobs are stored as already (None: one that is not)."""
    rows = []
    for job, old in zip(jobs, olds, strict=True):
        kept = _made_before(conn, job, old) if old is not None else None
        rows.append(kept or fetch_job(conn, job.id))
    return rows


def _made_before(conn: sqlite3.Connection, job: JobRecord, unscoped: str) -> dict[str, Any] | None:
    """The row kept under ``unscoped`` if ``job``'s own id is new and that row was
    created by the same token (a producer's job from before its ids were kept scoped)."""
    found = {row["id"]: dict(row) for row in conn.execute(
        "SELECT rowid, * FROM jobs WHERE id IN (?, ?)", (job.id, unscoped))}
    old = found.get(unscoped)
    if job.id in found or old is None or old["created_by"] != job.created_by:
        return None
    return old


def fetch_job(conn: sqlite3.Connection, job_id: str) -> dict[str, Any] | None:
    """The job's row, with the unique key it holds (``unique_key``, None if none)."""
    row = conn.execute("SELECT j.rowid, j.*, u.key AS unique_key FROM jobs j LEFT JOIN"
                       " unique_keys u ON u.job_id = j.id WHERE j.id = ?", (job_id,)).fetchone()
    return dict(row) if row else None


def insert_row(job: JobRecord) -> tuple[Any, ...]:
    lim = job.limits
    return (job.id, job.spec, job.queue, bytes(job.args).decode(), job.priority, str(job.state),
            job.visibility_timeout, job.enqueued_at, job.run_at, job.expires_at,
            lim.max_attempts, lim.max_fails, lim.backoff_base, lim.backoff_max,
            int(job.capture_logs), job.created_by, lim.max_worker_deaths, job.concurrency_key,
            labels_text(job.labels), job.workflow_id, job.workflow_node,
            None if job.parent_results is None else bytes(job.parent_results).decode(),
            job.schedule, encode_extras(job.ojs))


# -- reservations and transitions --------------------------------------------------------
RESERVE = (
    "UPDATE jobs SET state = 'active', attempt = ?, worker_id = ?, worker_token = ?,"
    " checksum = ?, server_id = ?, reserved_at = ?, lease_expires_at = ?"
    " WHERE id = ? AND attempt = ?"
    " AND state IN ('available', 'scheduled', 'retryable')"
)
SAVE = (
    "UPDATE jobs SET state = ?, worker_id = ?, server_id = CASE WHEN ? THEN NULL ELSE server_id END,"
    " run_at = ?, fails = ?, deaths = ?, budget_start = ?,"
    " cancel_requested = ?, expires_at = ?, finished_at = ?, dead_letter = ?,"
    " result = COALESCE(?, result),"
    " errors = CASE WHEN ? IS NULL THEN errors ELSE json_insert(errors, '$[#]', json(?)) END"
    " WHERE id = ? AND attempt = ? AND (CASE WHEN ? = 0"
    " THEN state NOT IN ('completed', 'discarded', 'cancelled')"
    " ELSE state IN ('discarded', 'cancelled') END)"
)  # "attempt = ?": the fence. Only a reservation moves a row's attempt on, so a server
# whose copy of the job is stale (another one reserved it since) changes nothing. A
# retry keeps the attempt: it is fenced on the state instead, whatever the holder, so of
# two retries of one job (two servers, each from its own read) only the first is stored.
# Only a retry moves a finished row: a copy of a waiting job that another server (or a
# unique enqueue's replace) cancelled, coming due here, does not bring it back.
# Servers sharing a database (rota/store/fleet.py) also fence on the holder: a job another
# server took over from this one (its worker moved there) is not this one's to change.
# A retry is any server's to write (a finished row keeps its last holder, for the audit).
SAVE_SHARED = SAVE + " AND (server_id IS NULL OR server_id = ? OR ? = 1)"


def moved_on(conn: sqlite3.Connection, jobs: list[JobRecord]) -> list[str]:
    """Of jobs just reserved, those whose rows another reservation did not come from
    here (the row's attempt, worker or state differs from what was written)."""
    lost = []
    for job in jobs:
        row = conn.execute("SELECT attempt, worker_id, state FROM jobs WHERE id = ?",
                           (job.id,)).fetchone()
        if row is None or tuple(row) != (job.attempt, job.worker_id, "active"):
            lost.append(job.id)
    return lost


def change_row(change: Change) -> tuple[Any, ...]:
    job = change.job
    error = _text(change.error)
    # A waiting job belongs to no worker; a finished one keeps who ran it, for audit.
    worker_id = None if job.state in WAITING_STATES else job.worker_id
    return (str(job.state), worker_id, worker_id is None, job.run_at, job.fails, job.deaths,
            job.budget_start,
            int(job.cancel_requested), job.expires_at, change.finished_at,
            int(change.dead_letter), _text(change.result), error, error, job.id, job.attempt,
            int(change.retry))


def withdraw(conn: sqlite3.Connection, seq: int, now: float) -> bool:
    """Cancel row ``seq`` if it is still available; whether it was."""
    return conn.execute("UPDATE jobs SET state = 'cancelled', finished_at = ?"
                        " WHERE rowid = ? AND +state = 'available'",
                        (now, seq)).rowcount == 1


def status_rows(notes: list[StatusNote]
                ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """What ``note_status`` writes of these notes: progress, and log lines and alerts."""
    return ([(n.progress[0], n.progress[1], n.at, n.job_id) for n in notes if n.progress],
            [(n.job_id, n.attempt, n.at, *n.line) for n in notes if n.line])


def note_status(conn: sqlite3.Connection, progress: list[tuple[Any, ...]],
                lines: list[tuple[Any, ...]]) -> None:
    """Store progress (the latest wins) and captured log lines and alerts."""
    conn.executemany("UPDATE jobs SET progress_percent = ?, progress_message = ?,"
                     " progress_at = ? WHERE id = ?", progress)
    conn.executemany("INSERT INTO job_logs (job_id, attempt, at, kind, level, message)"
                     " VALUES (?, ?, ?, ?, ?, ?)", lines)


def worker_connected(conn: sqlite3.Connection, row: dict[str, Any]) -> None:
    cols = ", ".join(row)
    marks = ", ".join("?" for _ in row)
    conn.execute(f"INSERT OR REPLACE INTO workers ({cols}) VALUES ({marks})", list(row.values()))


def worker_disconnected(conn: sqlite3.Connection, worker_id: str, connected_at: float,
                        now: float) -> None:
    """Mark that connection ended (not a newer one of the same worker, if it came)."""
    conn.execute("UPDATE workers SET disconnected_at = ? WHERE id = ? AND connected_at = ?",
                 (now, worker_id, connected_at))


# -- retention ---------------------------------------------------------------------------
_DUE = "SELECT rowid, id, workflow_id FROM jobs WHERE state = ? AND finished_at < ?"


def prune(conn: sqlite3.Connection, cutoffs: Sequence[Cutoff], limit: int,
          keep: Container[str]) -> dict[str, int]:
    """Delete at most ``limit`` finished jobs that are due (``Store.prune``); deleted rows
    by state."""
    deleted: dict[str, int] = {}
    flows: set[str] = set()  # workflows of deleted jobs
    left = limit
    newest = _newest_if_pinned(conn)  # (kept: see there)
    for cut in cutoffs:
        if left <= 0:
            break
        sql, params = _DUE, [cut.state, cut.before]
        if cut.spans:  # the wall clock stepped while the server ran
            sql, params = _due_in(cut.spans), [cut.state, *_bounds(cut.spans)]
        if cut.queue is not None:
            sql, params = sql + " AND queue = ?", [*params, cut.queue]
        elif cut.others:
            sql += f" AND queue NOT IN ({', '.join('?' * len(cut.others))})"
            params += cut.others
        rows = [(rowid, job_id) for rowid, job_id, flow in
                conn.execute(sql + " ORDER BY finished_at LIMIT ?", [*params, left])
                if job_id not in keep and rowid != newest
                and (flow is None or flows.add(flow) is None)]
        if rows:
            for table in ("job_logs", "unique_keys"):  # its lines, and a key it holds
                conn.executemany(f"DELETE FROM {table} WHERE job_id = ?",
                                 [(job_id,) for _, job_id in rows])
            conn.executemany("DELETE FROM jobs WHERE rowid = ?",
                             [(rowid,) for rowid, _ in rows])
            deleted[cut.state] = deleted.get(cut.state, 0) + len(rows)
            left -= len(rows)
    _prune_workflows(conn, flows)
    return deleted


def _prune_workflows(conn: sqlite3.Connection, flows: set[str]) -> None:
    """Of the workflows whose jobs were just deleted, those finished with no job left go
    too (their rows and nodes): a workflow is kept as long as a job of it is."""
    for workflow_id in sorted(flows):
        if conn.execute("SELECT 1 FROM jobs WHERE workflow_id = ? LIMIT 1",
                        (workflow_id,)).fetchone() is not None:
            continue
        if conn.execute("DELETE FROM workflows WHERE id = ? AND state IN"
                        " ('completed', 'failed', 'cancelled')", (workflow_id,)).rowcount:
            conn.execute("DELETE FROM workflow_nodes WHERE workflow_id = ?", (workflow_id,))


def _due_in(spans: Sequence[tuple[float, float]]) -> str:
    """_DUE for rows finished within any of these [from, to) spans."""
    terms = [("finished_at < ?" if math.isinf(low) else "(finished_at >= ? AND finished_at < ?)")
             for low, _ in spans]
    return "SELECT rowid, id, workflow_id FROM jobs WHERE state = ? AND (" + " OR ".join(terms) + ")"


def _bounds(spans: Sequence[tuple[float, float]]) -> list[float]:
    return [x for low, high in spans for x in ((high,) if math.isinf(low) else (low, high))]


# -- the clocks across a restart ---------------------------------------------------------
# A wall-clock step between runs, undone in the live rows' stored moments (deadlines, and
# the enqueue and reservation times beside them): each deadline is again as far away as
# the last run left it. Rows with no deadline (plain waiting jobs, finished ones) keep
# theirs: shown, never judged by.
_SHIFT = (
    "UPDATE jobs SET run_at = run_at + ?, expires_at = expires_at + ?,"
    " lease_expires_at = lease_expires_at + ?, enqueued_at = enqueued_at + ?,"
    " reserved_at = reserved_at + ?"
    " WHERE state IN ('scheduled', 'available', 'retryable', 'active')"
    " AND (run_at IS NOT NULL OR expires_at IS NOT NULL OR lease_expires_at IS NOT NULL)"
)


def undo_step(conn: sqlite3.Connection, reading: ClockReading) -> float:
    """Compare the clocks now with the last run's reading (one server per file: its
    own); shift the live rows' deadlines by a step found (model.wall_step); keep the
    reading. The step, 0.0 if none."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'clock'").fetchone()
    try:
        last = None if row is None else ClockReading(
            *msgspec.json.decode(row[0], type=tuple[float, float, str]))
    except msgspec.DecodeError:
        last = None  # unreadable: as if there were none
    step = wall_step(last, reading)
    try:
        conn.execute("BEGIN IMMEDIATE")
        if step:
            conn.execute(_SHIFT, (step,) * 5)
            follow_step(conn, step)
        keep_reading(conn, msgspec.json.encode(tuple(reading)).decode())
        conn.execute("COMMIT")
    except sqlite3.Error as exc:  # a full or read-only disk: start as before, unshifted
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        log.warning("the clock reading could not be checked at start: %s", exc)
        return 0.0
    return step


def follow_step(conn: sqlite3.Connection, step: float, starts: bool = True) -> None:
    """The stored moments besides the jobs' that a wall-clock step must not move in real
    time: the rates' starts (``starts``: at a restart; while running they are written
    from the windows instead), the unique keys' periods, the webhook deliveries' next
    tries; and, after a step back, the schedules' last ticks, so that they go on ticking
    rather than wait for the old clock's moment (ahead, a step is as downtime: their
    misfire rules)."""
    if starts:
        conn.execute("UPDATE limit_starts SET at = at + ?", (step,))
    uniques.shift(conn, step)
    conn.execute("UPDATE webhook_deliveries SET next_at = next_at + ? WHERE state = 'pending'"
                 " AND next_at IS NOT NULL", (step,))
    if step < 0:
        conn.execute("UPDATE schedules SET counted_from = counted_from + ?,"
                     " last_tick = last_tick + ?", (step, step))


def keep_reading(conn: sqlite3.Connection, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('clock', ?)", (value,))


# -- the per-minute counts (rota/core/observe.py) -----------------------------------------
# Each write adds what the server counted since its last one to the minute's row (several
# writes make one minute when it was written in its course); the table is the hour shown.
_KEEP_COUNTS = (
    f"INSERT INTO throughput (minute, server, queue, spec, {', '.join(COUNTS)})"
    f" VALUES (?, ?, ?, ?{', ?' * len(COUNTS)}) ON CONFLICT (minute, server, queue, spec)"
    f" DO UPDATE SET {', '.join(f'{c} = throughput.{c} + excluded.{c}' for c in COUNTS)}")


def keep_throughput(conn: sqlite3.Connection, server: str,
                    rows: Sequence[tuple[Any, ...]], oldest: int) -> None:
    """Add ``rows`` ((minute, queue, spec, *counts in COUNTS' order)) to ``server``'s,
    and delete every minute before ``oldest``."""
    conn.executemany(_KEEP_COUNTS, [(row[0], server, *row[1:]) for row in rows])
    conn.execute("DELETE FROM throughput WHERE minute < ?", (oldest,))


class Unstored(Exception):
    """Raised to roll an all-or-nothing enqueue's savepoint back (a job of it was refused:
    its id or its unique key is held), carrying each job's outcome as it would have been."""

    def __init__(self, outcomes: list[tuple[dict[str, Any], bool]]) -> None:
        super().__init__("a job of an all-or-nothing enqueue was refused")
        self.outcomes = outcomes


def refused_any(outcomes: list[tuple[dict[str, Any], bool]]) -> bool:
    """Whether any job of an enqueue was refused: its id was stored already, or its
    unique key is held (a held key whose on_conflict gives the holder is no refusal)."""
    return any(not new and row.get("unique_met") != "existing" for row, new in outcomes)


EXECUTED = '%"execute":{%'  # a stored spec body with an [execute] table


def _newest_if_pinned(conn: sqlite3.Connection) -> int | None:
    """The newest job row, which no delete may take once a spec runs on an endpoint:
    SQLite gives a new row MAX(rowid) + 1, and a job's row must come after every push
    before it, which is how its version is known (rota/core/pins.py). None: no such spec."""
    if conn.execute("SELECT 1 FROM spec_versions WHERE body LIKE ? LIMIT 1",
                    (EXECUTED,)).fetchone() is None:
        return None
    return conn.execute("SELECT MAX(rowid) FROM jobs").fetchone()[0]


def newest_kept(conn: sqlite3.Connection, job_id: str) -> bool:
    """Whether ``job_id``'s row is the newest, kept (``_newest_if_pinned``)."""
    newest = _newest_if_pinned(conn)
    return newest is not None and conn.execute(
        "SELECT 1 FROM jobs WHERE id = ? AND rowid = ?", (job_id, newest)).fetchone() is not None
# -- specs -------------------------------------------------------------------------------
class DryRun(Exception):
    """Raised to roll a dry run's savepoint back, carrying what it would have changed."""

    def __init__(self, changes: list[SpecChange]) -> None:
        super().__init__("dry run")
        self.changes = changes


def push_one(conn: sqlite3.Connection, spec: JobSpec, checksum: str, now: float) -> SpecChange:
    row = conn.execute("SELECT checksum, retired_at FROM status_quo WHERE name = ?",
                       (spec.name,)).fetchone()
    previous = row[0] if row else None
    retired = row is not None and row[1] is not None
    if previous == checksum and not retired:
        return SpecChange(spec.name, checksum, previous, "unchanged")
    conn.execute(
        "INSERT OR IGNORE INTO spec_versions (name, checksum, version, body, first_pushed_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (spec.name, checksum, spec.version, msgspec.json.encode(spec).decode(), now),
    )
    conn.execute(
        "INSERT INTO status_quo (name, checksum, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT(name) DO UPDATE SET checksum = excluded.checksum,"
        " updated_at = excluded.updated_at, retired_at = NULL",
        (spec.name, checksum, now),
    )
    # Jobs from the next row on were enqueued under this version (rota/core/pins.py).
    first_seq = conn.execute("SELECT COALESCE(MAX(rowid), 0) + 1 FROM jobs").fetchone()[0]
    conn.execute(
        "INSERT INTO spec_pushes (name, checksum, previous, pushed_at, first_seq)"
        " VALUES (?, ?, ?, ?, ?)", (spec.name, checksum, previous, now, first_seq),
    )
    # Pushing a retired spec again brings it back: "restored" when it is the same version.
    change = ("new" if previous is None else "restored" if previous == checksum
              else "changed")
    return SpecChange(spec.name, checksum, previous, change, first_seq)


def retire(conn: sqlite3.Connection, name: str, now: float) -> tuple[str, float, bool] | None:
    """Retire spec ``name``: (its checksum, when it was retired, whether it was already);
    None if it has no status quo."""
    row = conn.execute("SELECT checksum, retired_at FROM status_quo WHERE name = ?",
                       (name,)).fetchone()
    if row is None:
        return None
    if row[1] is not None:
        return row[0], row[1], True
    conn.execute("UPDATE status_quo SET retired_at = ? WHERE name = ?", (now, name))
    conn.execute("INSERT INTO spec_pushes (name, checksum, previous, pushed_at, event)"
                 " VALUES (?, ?, ?, ?, 'retire')", (name, row[0], row[0], now))
    return row[0], now, False


def crash(point: str) -> None:
    """Die at once, as a power cut or kill -9 would (crash-point tests only)."""
    log.critical("crash point %s: exiting now", point)
    os._exit(86)


def _text(data: bytes | None) -> str | None:
    return data.decode() if data is not None else None

