"""Several servers on one database: their leases, the notices they send one another, and
the recovery of a dead server's reservations (docs/scaling.md).

SQL on a connection, run by the store's writer or readers, plus the pure judgement of
which servers are gone. Every server holds the waiting jobs in memory and the rows
decide who gets one (fenced reservations, rota/store/store.py); what a server must hear of
the others' work travels as notices, sent inside the transaction that made it true
(PostgreSQL's NOTIFY delivers them at its COMMIT, never before, never if it rolls
back):

- ``rota_jobs``: row ids that may wait now (new, retried, back from a worker, due);
- ``rota_specs``: the status quo changed (a push or a retirement);
- ``rota_queues``: a queue was paused or resumed;
- ``rota_limits``: a limit was set or cleared at runtime ("<kind>:<name>");
- ``rota_secrets``: a signing secret was set or deleted ("<name>");
- ``rota_cancel``: a running job is to be cancelled by the server that holds it;
- ``rota_workers``: an operator's directive (quiet, terminate, resume) for workers
  connected to other servers: "<state> id=<worker>", "<state> label=<label>" or
  "<state> all" (the name percent-encoded);
- ``rota_sync``: a server's own barrier, "<origin> <n>": heard back, every notice
  committed before it has been heard (rota/server/cluster.py ``barrier``).

A payload is the sending server's id, then words: "<origin> <word> <word> ...".
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

import msgspec

from rota.base.protocol import rfc3339

JOBS, SPECS, QUEUES, CANCEL = "rota_jobs", "rota_specs", "rota_queues", "rota_cancel"
WORKERS, LIMITS, SYNC = "rota_workers", "rota_limits", "rota_sync"
SECRETS = "rota_secrets"
CHANNELS = (JOBS, SPECS, QUEUES, CANCEL, WORKERS, LIMITS, SYNC, SECRETS)
# PostgreSQL refuses a payload of 8,000 bytes or more: longer lists go as several.
MAX_PAYLOAD = 7_000


# -- notices ---------------------------------------------------------------------------
def notify(conn: sqlite3.Connection, channel: str, origin: str, words: Iterable[str] = ()
           ) -> None:
    """Queue notices on ``channel`` in the open transaction (sent at its COMMIT)."""
    for payload in payloads(origin, words):
        conn.execute("SELECT pg_notify(?, ?)", (channel, payload))


def payloads(origin: str, words: Iterable[str]) -> list[str]:
    """``origin`` and the words, split into payloads under MAX_PAYLOAD bytes (one at least)."""
    out: list[str] = []
    current = origin
    for word in words:
        if len(current) + 1 + len(word) > MAX_PAYLOAD and current != origin:
            out.append(current)
            current = origin
        current += " " + word
    out.append(current)
    return out


def parse(payload: str) -> tuple[str, list[str]]:
    """(origin, words) of a payload."""
    origin, *words = payload.split(" ")
    return origin, words


def server_url(conn: sqlite3.Connection, server_id: str) -> str | None:
    """Where a server listens (``servers.url``, host:port), None if it is not known."""
    row = conn.execute("SELECT url FROM servers WHERE id = ?", (server_id,)).fetchone()
    return row[0] if row is not None and row[0] else None


# -- leases ----------------------------------------------------------------------------
# Leases run on the database's clock, read when the statement runs: one clock for every
# server, whatever their own say, and a renewal that waited (a slow commit, a lock)
# holds its lease from when it ran, not from when it was asked for. (SQLite's julianday;
# rota/store/pg_sql.py turns it into PostgreSQL's clock_timestamp().)
DB_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


def renew(conn: sqlite3.Connection, server_id: str, *, host: str, pid: int, url: str,
          now: float, lease: float, starting: bool) -> bool:
    """Hold this server's lease for ``lease`` seconds from now, on the database's clock.
    False if the others had already declared it gone (its reservations were recovered):
    it holds none of them now. (``now``, this server's wall clock, is when it started.)"""
    if starting:  # a restart under the same id begins a new life
        conn.execute(
            "INSERT INTO servers (id, host, pid, url, started_at, lease_expires_at, stopped_at)"
            f" VALUES (?, ?, ?, ?, ?, {DB_NOW} + ?, NULL) ON CONFLICT(id) DO UPDATE SET"
            " host = excluded.host, pid = excluded.pid, url = excluded.url,"
            " started_at = excluded.started_at,"
            " lease_expires_at = excluded.lease_expires_at, stopped_at = NULL",
            (server_id, host, pid, url, now, lease))
        return True
    # (The url too: the lease taken as the store loads knows none yet.)
    cursor = conn.execute(f"UPDATE servers SET lease_expires_at = {DB_NOW} + ?,"
                          " url = COALESCE(NULLIF(?, ''), url) WHERE id = ?"
                          " AND stopped_at IS NULL", (lease, url, server_id))
    if cursor.rowcount == 1:
        return True
    renew(conn, server_id, host=host, pid=pid, url=url, now=now, lease=lease, starting=True)
    return False


def let_lapse(conn: sqlite3.Connection, server_id: str) -> None:
    """A clean stop: the lease ends now, so the others recover what this server's
    workers still hold after the reconnect grace, not after a whole lease."""
    conn.execute(f"UPDATE servers SET lease_expires_at = {DB_NOW} WHERE id = ?"
                 " AND stopped_at IS NULL", (server_id,))


def lapsed(conn: sqlite3.Connection, me: str) -> dict[str, float]:
    """Servers whose lease has ended and whose reservations nobody has recovered yet,
    with how many seconds ago it ended (on the database's clock)."""
    return {str(r[0]): float(r[1]) for r in conn.execute(
        f"SELECT id, {DB_NOW} - lease_expires_at FROM servers WHERE stopped_at IS NULL"
        f" AND lease_expires_at < {DB_NOW} AND id <> ?", (me,))}


def recover(conn: sqlite3.Connection, dead: str, me: str, now: float, grace: float
            ) -> list[int] | None:
    """Take a dead server's reservations back: its active jobs wait again, each with an
    error record that says why (a run of it may still finish on a worker that lost its
    server: the attempt fence turns away a result of it once another attempt began).
    Fenced on the lease, so only one server recovers it, and not one that came back:
    its lease must have ended more than ``grace`` seconds ago on the database's clock.
    The row ids that wait again (also sent as a ``rota_jobs`` notice); None if another
    server recovered it first, or it renewed its lease meanwhile. (``now``: this
    server's wall clock, for the records.)"""
    claimed = conn.execute("UPDATE servers SET stopped_at = ? WHERE id = ? AND stopped_at IS NULL"
                           f" AND lease_expires_at < {DB_NOW} - ?", (now, dead, grace))
    if claimed.rowcount != 1:
        return None
    held = conn.execute("SELECT rowid, id, attempt, worker_id FROM jobs WHERE server_id = ?"
                        " AND state = 'active'", (dead,)).fetchall()
    seqs: list[int] = []
    for seq, job_id, attempt, worker_id in (tuple(r) for r in held):
        record = msgspec.json.encode({
            "type": "server_lost", "retryable": True, "details": None,
            "message": f"server {dead} held no lease any more (it stopped or died) while"
                       " its worker ran the job, and the worker did not come back to"
                       " another server in time; recovered by server " + me,
            "attempt": attempt, "worker_id": worker_id, "at": rfc3339(now)}).decode()
        conn.execute("UPDATE jobs SET state = 'available', worker_id = NULL, server_id = NULL,"
                     " lease_expires_at = NULL, run_at = NULL,"
                     " errors = json_insert(errors, '$[#]', json(?))"
                     " WHERE id = ? AND attempt = ? AND state = 'active'",
                     (record, job_id, attempt))
        seqs.append(seq)
    notify(conn, JOBS, me, map(str, seqs))
    return seqs


def take_back(conn: sqlite3.Connection, me: str,
              jobs: list[tuple[str, int, str, str | None, float | None, float | None]]
              ) -> list[str]:
    """After this server's lease lapsed and another recovered its reservations: the
    jobs the workers here run that are still this server's. Those the recovery made wait
    (same attempt, no worker) are taken back; those reserved here after the recovery
    are this server's already (their rows name it). Each is ``(id, attempt, worker,
    worker's token id, reserved_at, lease_expires_at)``; the ids kept. The others were given out again (or
    ended): another server's reservation moved them on first."""
    kept: list[str] = []
    for job_id, attempt, worker_id, token, reserved_at, lease_expires_at in jobs:
        cursor = conn.execute(
            "UPDATE jobs SET state = 'active', worker_id = ?, worker_token = ?, server_id = ?,"
            " reserved_at = COALESCE(reserved_at, ?),"
            " lease_expires_at = COALESCE(lease_expires_at, ?) WHERE id = ? AND attempt = ?"
            " AND ((state = 'available' AND worker_id IS NULL)"
            " OR (state = 'active' AND server_id = ? AND worker_id = ?))",
            (worker_id, token, me, reserved_at, lease_expires_at, job_id, attempt, me,
             worker_id))
        if cursor.rowcount == 1:
            kept.append(job_id)
    return kept


# -- what a notice names -----------------------------------------------------------------
def paused_queues(conn: sqlite3.Connection) -> frozenset[str]:
    return frozenset(r[0] for r in conn.execute("SELECT name FROM queues WHERE paused = 1"))


def waiting_seqs(conn: sqlite3.Connection) -> list[int]:
    """The row ids of every job that waits: after notices were missed, a server compares
    them with the jobs it holds (rota/server/cluster.py's catch-up)."""
    return [int(r[0]) for r in conn.execute(
        "SELECT rowid FROM jobs WHERE state IN ('available', 'scheduled', 'retryable')")]


def cancels_requested(conn: sqlite3.Connection, me: str) -> list[str]:
    """Jobs running on this server's workers whose cancel another server asked for."""
    return [str(r[0]) for r in conn.execute(
        "SELECT id FROM jobs WHERE server_id = ? AND state = 'active'"
        " AND cancel_requested = 1", (me,))]


def request_cancel(conn: sqlite3.Connection, job_id: str, me: str) -> str | None:
    """Mark a running job's cancel as requested and ask its server to pass it on to the
    worker; that server's id, or None if the job is not running on another server."""
    row = conn.execute("SELECT server_id FROM jobs WHERE id = ? AND state = 'active'",
                       (job_id,)).fetchone()
    if row is None or row[0] is None or row[0] == me:
        return None
    conn.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ? AND state = 'active'",
                 (job_id,))
    notify(conn, CANCEL, me, [row[0], job_id])
    return str(row[0])


def connected_somewhere(conn: sqlite3.Connection, worker_id: str) -> bool:
    """Whether a worker of this id is connected to some server (its last connection has
    not ended, as the servers record it)."""
    return conn.execute("SELECT 1 FROM workers WHERE id = ? AND disconnected_at IS NULL",
                        (worker_id,)).fetchone() is not None


def holder(conn: sqlite3.Connection, server_id: str) -> tuple[str, int, float] | None:
    """(host, pid, seconds its lease runs on) of a server that holds ``server_id``'s lease
    now, if any."""
    row = conn.execute(f"SELECT host, pid, lease_expires_at - {DB_NOW} FROM servers WHERE id = ?"
                       f" AND stopped_at IS NULL AND lease_expires_at > {DB_NOW}",
                       (server_id,)).fetchone()
    return None if row is None else (str(row[0]), int(row[1]), float(row[2]))


def set_paused(conn: sqlite3.Connection, queue: str, paused: bool, now: float,
               server_id: str | None) -> None:
    """Pause or resume ``queue``; ``server_id``: one of several servers, which tell the
    others."""
    conn.execute("INSERT INTO queues (name, paused, updated_at) VALUES (?, ?, ?)"
                 " ON CONFLICT(name) DO UPDATE SET paused = excluded.paused,"
                 " updated_at = excluded.updated_at", (queue, int(paused), now))
    if server_id is not None:
        notify(conn, QUEUES, server_id, [queue])
