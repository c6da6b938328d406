"""Cron schedules in the database: their rows (added, replaced, paused, deleted, read) and the fire transaction that makes each tick's job exactly once.

SQL on a connection, run by the store's writer or readers (rota/server/clockwork.py submits
it). ``fire`` locks the schedule's row (``FOR UPDATE`` on PostgreSQL; SQLite has one
writer), reads its last tick again and lets the pure planner (rota/core/schedules.py)
decide, so that of two servers reaching a tick the second finds it decided. The tick's job
id is the same on every server (``schedules.tick_id``) and an insert of an existing id
finds the stored row, so even a replayed decision makes no second job.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from rota.base.protocol import ErrorInfo
from rota.core.jobs import error_record
from rota.core.model import JobRecord, JobState
from rota.core.schedules import ScheduleDef, Timing, due, fields_of, of_round, overlap
from rota.store import fleet
from rota.store.holds import TTL_FROM_NOW, cancel_pending, cancel_waiting
from rota.store.rows import LIVE, live_job
from rota.store.writes import insert_jobs, insert_row

SKIPPED = "skipped: previous run still active"
MISSED = "missed"
_READ = ("SELECT s.*, j.state AS last_job_state FROM schedules s"
         " LEFT JOIN jobs j ON j.id = s.last_job_id")


def definition_text(definition: ScheduleDef) -> str:
    """The definition as stored: JSON, without ``paused`` (its own column)."""
    return msgspec.json.encode(fields_of(msgspec.structs.replace(definition, paused=False))
                               ).decode()


def definition_of(row: Mapping[str, Any]) -> ScheduleDef:
    """A row's definition, with its paused state."""
    stored = msgspec.json.decode(row["definition"], type=ScheduleDef)
    return msgspec.structs.replace(stored, paused=bool(row["paused"]))


def timing_of(row: Mapping[str, Any]) -> Timing:
    """The row's timing: @every counts from when its ticks began to count."""
    return Timing.of(definition_of(row), row["counted_from"])


def start_of(row: Mapping[str, Any]) -> float:
    """The instant after which the row's next ticks lie."""
    last = row["last_tick"]
    return row["counted_from"] if last is None else max(last, row["counted_from"])


# -- rows ------------------------------------------------------------------------------------
def read_all(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every schedule's row, by name, with its last job's state (``last_job_state``)."""
    return [dict(row) for row in conn.execute(_READ + " ORDER BY s.name")]


def read_one(conn: sqlite3.Connection, name: str) -> dict[str, Any] | None:
    row = conn.execute(_READ + " WHERE s.name = ?", (name,)).fetchone()
    return dict(row) if row is not None else None


def upsert(conn: sqlite3.Connection, definition: ScheduleDef, now: float, *,
           push: bool = False) -> str:
    """Add or replace a schedule: ``new``, ``changed`` or ``unchanged``. A push (``push``)
    never un-pauses one; a change of its expression or zone counts its ticks from now
    (the missed ones of the old expression are no misfires of the new)."""
    text = definition_text(definition)
    row = conn.execute("SELECT definition, paused FROM schedules WHERE name = ?",
                       (definition.name,)).fetchone()
    if row is None:
        conn.execute("INSERT INTO schedules (name, definition, paused, created_at, updated_at,"
                     " counted_from, run_count) VALUES (?, ?, ?, ?, ?, ?, 0)",
                     (definition.name, text, int(definition.paused), now, now,
                      float(math.floor(now))))
        return "new"
    paused = bool(row["paused"]) or definition.paused if push else definition.paused
    if text == row["definition"] and paused == bool(row["paused"]):
        return "unchanged"
    old = msgspec.json.decode(row["definition"], type=ScheduleDef)
    # a resume counts from now, as POST .../resume does: a pause is meant, not missed
    moved = not old.same_firing(definition) or (bool(row["paused"]) and not paused)
    conn.execute("UPDATE schedules SET definition = ?, paused = ?, updated_at = ?,"
                 " counted_from = CASE WHEN ? = 1 THEN ? ELSE counted_from END WHERE name = ?",
                 (text, int(paused), now, int(moved), float(math.floor(now)), definition.name))
    return "changed"


def set_paused(conn: sqlite3.Connection, name: str, paused: bool, now: float
               ) -> dict[str, Any] | None:
    """Pause or resume; the row after (None: no such schedule), with the held ticks a
    pause cancelled (``cancelled``: their ids). A resumed schedule counts its ticks from
    now: those of its pause were meant not to run, and are no misfires."""
    changed = conn.execute(
        "UPDATE schedules SET paused = ?, updated_at = ?, counted_from = CASE WHEN ? = 1 AND"
        " paused = 1 THEN ? ELSE counted_from END WHERE name = ?",
        (int(paused), now, int(not paused), float(math.floor(now)), name)).rowcount
    if not changed:
        return None
    cancelled = _cancel_held(conn, name, "paused", now) if paused else []
    return {**(read_one(conn, name) or {}), "cancelled": cancelled}


def delete(conn: sqlite3.Connection, name: str, now: float) -> dict[str, Any] | None:
    """Delete a schedule (its jobs stay, but its held ticks are cancelled); its last row,
    with those ticks' ids (``cancelled``), or None if there was none."""
    row = read_one(conn, name)
    if row is None:
        return None
    conn.execute("DELETE FROM schedules WHERE name = ?", (name,))
    return {**row, "cancelled": _cancel_held(conn, name, "deleted", now)}


def _cancel_held(conn: sqlite3.Connection, name: str, how: str, now: float) -> list[str]:
    """A paused or deleted schedule's held ticks (overlap enqueue), cancelled: nothing
    would release them in its stead, and DELETE /jobs leaves a held job to its schedule."""
    held = [str(r[0]) for r in conn.execute(_HELD, (name,))]
    why = error_record(ErrorInfo(type="cancelled", retryable=False,
                                 message=f"its schedule {name} was {how}"),
                       attempt=0, worker_id=None, now=now).decode()
    cancel_pending(conn, held, now, why)
    return held


# -- firing ----------------------------------------------------------------------------------
@dataclass
class Fired:
    """What one fire transaction did."""

    made: list[tuple[JobRecord, dict[str, Any], bool]] = field(default_factory=list)
    # cancel_previous: a running previous job, its cancel requested here, to pass on to its
    # worker after the commit; a waiting one, cancelled here (its row, for the engine)
    cancel: list[str] = field(default_factory=list)
    replaced: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[float] = field(default_factory=list)  # ticks the overlap policy skipped
    missed: int = 0  # ticks reached past their grace
    caught: int = 0  # of those, how many made a job (the misfire and overlap policies)
    counted: bool = True
    held: int = 0  # the schedule's held ticks (overlap enqueue), if this fire held one
    stale: bool = False  # the row changed since the jobs were built: build again


def fire(conn: sqlite3.Connection, name: str, seen: str, now: float,
         jobs: Mapping[float, JobRecord], server_id: str | None, *,
         reached: float | None = None, timing: Timing | None = None) -> Fired:
    """The fire transaction of schedule ``name`` at ``now``: ``jobs`` are its ticks' jobs
    as built from definition ``seen`` (the stored JSON) on the server's loop; which of them
    are made is decided here, from the row as locked. ``server_id``: one of several
    servers, which hear of the new jobs by a notice. ``reached``: when the loop meant to
    wake for them (``schedules.due``); ``timing``: ``seen``'s, as the loop parsed it
    (used if the row still counts from its anchor)."""
    row = _locked(conn, "*", name)
    if row is None or row["paused"] or row["definition"] != seen:
        return Fired(stale=row is not None and not row["paused"])
    definition = definition_of(row)
    if timing is None or timing.anchor != row["counted_from"]:
        timing = timing_of(row)
    decided = due(timing, start_of(row), now, reached)
    fired = Fired(missed=decided.missed, counted=decided.counted)
    if decided.last is None:
        return fired
    previous = row["last_job_id"]
    state = _state(conn, previous)
    outcome = MISSED if decided.passed else row["last_outcome"]
    # the missed ticks it fires come first (an older tick is never less late)
    late = set(decided.fire[:decided.missed - decided.passed])
    for tick in of_round(definition.overlap, decided.fire):
        job = jobs.get(tick)
        if job is None:  # (built for the ticks due as the loop saw them: a superset)
            continue
        verdict = overlap(definition.overlap, state)
        if verdict == "skip":
            fired.skipped.append(tick)
            outcome = SKIPPED
            continue
        if verdict == "cancel_previous" and previous is not None:
            _cancel_previous(conn, fired, name, previous, now, server_id)
        if verdict == "pending":  # held until the live one ends (release_next)
            # a copy: the writer runs this op again after a deadlock, and the caller's
            # job must then be judged afresh (its previous may have ended meanwhile)
            job = replace(job, state=JobState.PENDING, run_at=None)
        [(stored, new)] = insert_jobs(conn, [job], [insert_row(job)], [None], now)
        fired.made.append((job, stored, new))
        fired.caught += int(new and tick in late)
        previous, state, outcome = stored["id"], stored["state"], None
    made = sum(1 for _, _, new in fired.made if new)
    conn.execute("UPDATE schedules SET last_tick = ?, last_job_id = ?, last_outcome = ?,"
                 " run_count = run_count + ? WHERE name = ?",
                 (decided.last, previous, outcome, made, name))
    if any(stored["state"] == "pending" for _, stored, _ in fired.made):
        fired.held = int(conn.execute("SELECT COUNT(*) FROM jobs WHERE schedule = ? AND"
                                      " state = 'pending'", (name,)).fetchone()[0])
    told = [str(stored["rowid"]) for _, stored, new in fired.made
            if new and stored["state"] != "pending"]
    if server_id is not None and told:
        fleet.notify(conn, fleet.JOBS, server_id, told)
    return fired


_REQUEST = "UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND state = 'active'"


def _cancel_previous(conn: sqlite3.Connection, fired: Fired, name: str, job_id: str,
                     now: float, server_id: str | None) -> None:
    """Overlap ``cancel_previous``, in the fire transaction (a crash after its commit must
    not leave both running): the previous job cancelled if it waits (or is held), its
    cancel requested if it runs; a server restarted, or the one its worker is on, reads
    the request from the row (rota/store/fleet.py cancels_requested). A row another
    transaction holds (its ending, which next waits for this schedule's row in
    release_next: waiting for it would deadlock) is cancelled after the commit instead,
    the ordinary way."""
    if not isinstance(conn, sqlite3.Connection) and conn.execute(
            "SELECT 1 FROM jobs WHERE id = ? FOR UPDATE SKIP LOCKED", (job_id,)).fetchone() is None:
        fired.cancel.append(job_id)
        return
    why = error_record(ErrorInfo(type="cancelled", retryable=False,
                                 message=f"its schedule {name}'s next tick came (overlap"
                                 " cancel_previous)"), attempt=0, worker_id=None, now=now)
    waiting = cancel_waiting(conn, job_id, why.decode(), now)
    if waiting:
        fired.replaced += waiting
    elif conn.execute(_REQUEST, (job_id,)).rowcount:
        fired.cancel.append(job_id)
        if server_id is not None:  # its server is told now, if another runs it
            fleet.request_cancel(conn, job_id, server_id)
    else:
        cancel_pending(conn, [job_id], now, why.decode())


def _locked(conn: sqlite3.Connection, columns: str, name: str) -> Any:
    """Schedule ``name``'s row, locked until the transaction ends (``FOR UPDATE`` on
    PostgreSQL; SQLite's one writer serialises already): a fire and the release of its
    held ticks, each reading the other's jobs, take turns on it."""
    lock = "" if isinstance(conn, sqlite3.Connection) else " FOR UPDATE"
    return conn.execute(f"SELECT {columns} FROM schedules WHERE name = ?{lock}",
                        (name,)).fetchone()


def _state(conn: sqlite3.Connection, job_id: str | None) -> str | None:
    if job_id is None:
        return None
    row = conn.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return None if row is None else row[0]


# -- the enqueue overlap: a schedule's held ticks, released one at a time ---------------------
_BUSY = ("SELECT 1 FROM jobs WHERE schedule = ? AND state IN"
         " ('scheduled', 'available', 'active', 'retryable') LIMIT 1")
_HELD = "SELECT id FROM jobs WHERE schedule = ? AND state = 'pending' ORDER BY rowid"
_RELEASE = (f"UPDATE jobs SET state = 'available', {TTL_FROM_NOW} WHERE id = ?"
            " AND state = 'pending' RETURNING " + ", ".join(LIVE))


def release_next(conn: sqlite3.Connection, schedule: str, now: float) -> list[JobRecord]:
    """A job of ``schedule`` ended (rota/store/settle.py, in its transaction): its oldest
    held tick (overlap ``enqueue``) waits now, unless another of its jobs is still live;
    the job released, as its row reads, or none. It locks the schedule's row first, as
    ``fire`` does (never a job's row: no deadlock), so that on PostgreSQL a fire that
    holds a tick (its previous job seemed live) and the ending of that job on another
    server cannot both miss each other's write, nor two endings of the schedule's jobs."""
    _locked(conn, "1", schedule)
    if conn.execute(_BUSY, (schedule,)).fetchone() is not None:
        return []
    held = conn.execute(_HELD + " LIMIT 1", (schedule,)).fetchone()
    if held is None:
        return []
    cursor = conn.execute(_RELEASE, (now, held[0]))
    cursor.row_factory = None
    return [live_job(row) for row in cursor]
