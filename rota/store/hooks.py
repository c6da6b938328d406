"""Webhooks in the database: the subscriptions, and their deliveries (the outbox while
pending, the log once finished). Each function is one operation run on the store's
writer or a reader (rota/server/hooks.py submits them); the SQL is SQLite's, translated
for PostgreSQL as every statement is.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection
from typing import Any

import msgspec

from rota.core.webhooks import KEEP, MAX_PENDING

SUB_COLUMNS = ("id, url, kinds, filter, secret, previous_secret, rotated_at, enabled,"
               " created_at")
LOG_COLUMNS = ("id, subscription_id, event_id, kind, state, attempts, created_at, next_at,"
               " last_at, status, ms, error, response")
# What may change by PATCH: the column, and how its value is stored.
PATCHABLE = ("url", "kinds", "filter", "enabled")


def _sub(row: Any) -> dict[str, Any]:
    out = dict(row)
    out["kinds"] = msgspec.json.decode(out["kinds"])
    out["filter"] = msgspec.json.decode(out["filter"]) if out["filter"] else {}
    return out


def subscriptions(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = conn.execute(f"SELECT {SUB_COLUMNS} FROM webhook_subscriptions"
                        " ORDER BY created_at, id")
    return [_sub(r) for r in rows]


def subscription(conn: sqlite3.Connection, sub_id: str) -> dict[str, Any] | None:
    row = conn.execute(f"SELECT {SUB_COLUMNS} FROM webhook_subscriptions WHERE id = ?",
                       (sub_id,)).fetchone()
    return None if row is None else _sub(row)


def insert_subscription(conn: sqlite3.Connection, row: dict[str, Any]) -> dict[str, Any]:
    conn.execute("INSERT INTO webhook_subscriptions (id, url, kinds, filter, secret, enabled,"
                 " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                 (row["id"], row["url"], msgspec.json.encode(row["kinds"]).decode(),
                  msgspec.json.encode(row["filter"]).decode() if row["filter"] else None,
                  row["secret"], 1 if row["enabled"] else 0, row["created_at"]))
    return subscription(conn, row["id"]) or row


def update_subscription(conn: sqlite3.Connection, sub_id: str, changes: dict[str, Any]
                        ) -> dict[str, Any] | None:
    sets, values = [], []
    for key in PATCHABLE:
        if key in changes:
            value = changes[key]
            if key in ("kinds", "filter"):
                value = msgspec.json.encode(value).decode() if value else None
            elif key == "enabled":
                value = 1 if value else 0
            sets.append(f"{key} = ?")
            values.append(value)
    if sets:
        conn.execute(f"UPDATE webhook_subscriptions SET {', '.join(sets)} WHERE id = ?",
                     (*values, sub_id))
    return subscription(conn, sub_id)


def rotate_secret(conn: sqlite3.Connection, sub_id: str, secret: str, now: float
                  ) -> dict[str, Any] | None:
    conn.execute("UPDATE webhook_subscriptions SET previous_secret = secret, secret = ?,"
                 " rotated_at = ? WHERE id = ?", (secret, now, sub_id))
    return subscription(conn, sub_id)


def delete_subscription(conn: sqlite3.Connection, sub_id: str) -> dict[str, Any] | None:
    """Delete it and its deliveries (the pending ones are not sent: ojs-webhooks §6.5)."""
    row = subscription(conn, sub_id)
    if row is not None:
        conn.execute("DELETE FROM webhook_deliveries WHERE subscription_id = ?", (sub_id,))
        conn.execute("DELETE FROM webhook_subscriptions WHERE id = ?", (sub_id,))
    return row


# -- the outbox ----------------------------------------------------------------------------
def add_deliveries(conn: sqlite3.Connection, rows: list[tuple[str, str, str, str, bytes]],
                   now: float, marks: Collection[tuple[str, str]] = (), *,
                   recovered: bool = False, checked: Collection[str] = ()
                   ) -> tuple[dict[str, int], dict[str, int]]:
    """Pending deliveries (id, subscription, event id, kind, body), due now. ``marks``:
    (key, value) pairs kept in meta, the pump's progress, in the same transaction.
    ``recovered``: events found in the jobs' rows, left out where a delivery of the same
    event id exists. The subscriptions in ``checked`` (each about once a second: both
    walk an index) get none past MAX_PENDING waiting, and their logs are pruned to the
    KEEP latest finished. Returns what was dropped, and how many wait, per checked
    subscription."""
    for key, value in marks:
        keep_mark(conn, key, value)
    by_sub: dict[str, list[tuple[str, str, str, str, bytes]]] = {sub: [] for sub in checked}
    for row in rows:
        by_sub.setdefault(row[1], []).append(row)
    dropped: dict[str, int] = {}
    waiting: dict[str, int] = {}
    for sub_id, batch in by_sub.items():
        if recovered:
            batch = _unseen(conn, sub_id, batch)
        if sub_id in checked:
            waiting[sub_id] = conn.execute(
                "SELECT COUNT(*) FROM webhook_deliveries WHERE subscription_id = ? AND"
                " state = 'pending'", (sub_id,)).fetchone()[0]
            room = max(0, MAX_PENDING - waiting[sub_id])
            if room < len(batch):
                dropped[sub_id] = len(batch) - room
                batch = batch[:room]
            waiting[sub_id] += len(batch)
            prune(conn, sub_id)
        conn.executemany("INSERT INTO webhook_deliveries (id, subscription_id, event_id, kind,"
                         " body, state, attempts, created_at, next_at) VALUES"
                         " (?, ?, ?, ?, ?, 'pending', 0, ?, ?)",
                         [(i, s, e, k, b.decode(), now, now) for i, s, e, k, b in batch])
    return dropped, waiting


def _unseen(conn: sqlite3.Connection, sub_id: str, batch: list[tuple[str, str, str, str, bytes]]
            ) -> list[tuple[str, str, str, str, bytes]]:
    seen: set[str] = set()
    for start in range(0, len(batch), 500):
        ids = [r[2] for r in batch[start:start + 500]]
        seen.update(r[0] for r in conn.execute(
            f"SELECT event_id FROM webhook_deliveries WHERE subscription_id = ? AND event_id"
            f" IN ({', '.join('?' * len(ids))})", (sub_id, *ids)))
    return [r for r in batch if r[2] not in seen]


def keep_mark(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))


def read_mark(conn: sqlite3.Connection, key: str) -> float | None:
    value = read_meta(conn, key)
    return None if value is None else float(value)


def read_meta(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def recent_jobs(conn: sqlite3.Connection, since: float, limit: int) -> list[dict[str, Any]]:
    """Jobs enqueued or ended at or after ``since`` (at most ``limit`` of each)."""
    columns = "id, spec, queue, worker_id, attempt, state, enqueued_at, finished_at"
    found = {r["id"]: dict(r) for r in conn.execute(
        f"SELECT {columns} FROM jobs WHERE enqueued_at >= ? LIMIT ?", (since, limit))}
    for state in ("completed", "discarded", "cancelled"):
        found.update((r["id"], dict(r)) for r in conn.execute(
            f"SELECT {columns} FROM jobs WHERE state = ? AND finished_at >= ? LIMIT ?",
            (state, since, limit)))
    return list(found.values())


def prune(conn: sqlite3.Connection, sub_id: str) -> None:
    """Keep the KEEP latest finished deliveries of a subscription."""
    cut = conn.execute("SELECT created_at FROM webhook_deliveries WHERE subscription_id = ?"
                       " AND state != 'pending' ORDER BY created_at DESC LIMIT 1 OFFSET ?",
                       (sub_id, KEEP)).fetchone()
    if cut is not None:
        conn.execute("DELETE FROM webhook_deliveries WHERE subscription_id = ? AND"
                     " state != 'pending' AND created_at <= ?", (sub_id, cut[0]))


def claim(conn: sqlite3.Connection, sub_id: str, now: float, hold: float, limit: int
          ) -> list[dict[str, Any]]:
    """Up to ``limit`` due deliveries of a subscription, oldest first, held ``hold``
    seconds (another server, or this one after a crash, takes them after that)."""
    ids = [r[0] for r in conn.execute(
        "SELECT id FROM webhook_deliveries WHERE subscription_id = ? AND state = 'pending'"
        " AND next_at <= ? ORDER BY next_at, created_at, id LIMIT ?", (sub_id, now, limit))]
    if not ids:
        return []
    # Only those still due as the row is written: a server sharing the database that
    # claimed one first (PostgreSQL re-reads a row it waited for) keeps it.
    ids = [r[0] for r in conn.execute(
        f"UPDATE webhook_deliveries SET next_at = ? WHERE id IN ({', '.join('?' * len(ids))})"
        " AND state = 'pending' AND next_at <= ? RETURNING id", (now + hold, *ids, now))]
    if not ids:
        return []
    rows = conn.execute(f"SELECT id, event_id, kind, body, attempts FROM webhook_deliveries"
                        f" WHERE id IN ({', '.join('?' * len(ids))}) ORDER BY created_at, id",
                        ids)
    return [dict(r) for r in rows]


def next_due(conn: sqlite3.Connection, sub_id: str) -> float | None:
    row = conn.execute("SELECT MIN(next_at) FROM webhook_deliveries WHERE subscription_id = ?"
                       " AND state = 'pending'", (sub_id,)).fetchone()
    return None if row is None else row[0]


def record(conn: sqlite3.Connection, outcomes: list[tuple[Any, ...]], sub_id: str,
           now: float, receiver_back: bool) -> None:
    """Each attempt's outcome: (id, state, attempts, next_at, status, ms, error,
    response). ``receiver_back``: one was delivered, so the subscription's deliveries
    waiting out a backoff are due now (the receiver answers again)."""
    conn.executemany("UPDATE webhook_deliveries SET state = ?, attempts = ?, next_at = ?,"
                     " last_at = ?, status = ?, ms = ?, error = ?, response = ? WHERE id = ?",
                     [(state, attempts, next_at, now, status, ms, error, response, i)
                      for i, state, attempts, next_at, status, ms, error, response in outcomes])
    if receiver_back:
        conn.execute("UPDATE webhook_deliveries SET next_at = ? WHERE subscription_id = ? AND"
                     " state = 'pending' AND next_at > ? AND attempts > 0",
                     (now, sub_id, now))


def add_finished(conn: sqlite3.Connection, row: tuple[Any, ...]) -> None:
    """A test delivery, already made: (id, subscription, event id, kind, body, state,
    now, status, ms, error, response)."""
    i, sub, event, kind, body, state, now, status, ms, error, response = row
    conn.execute("INSERT INTO webhook_deliveries (id, subscription_id, event_id, kind, body,"
                 " state, attempts, created_at, last_at, status, ms, error, response) VALUES"
                 " (?, ?, ?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?)",
                 (i, sub, event, kind, body.decode(), state, now, now, status, ms, error,
                  response))
    prune(conn, sub)


def deliveries(conn: sqlite3.Connection, sub_id: str, limit: int, state: str | None
               ) -> list[dict[str, Any]]:
    """The latest deliveries of a subscription, newest first."""
    where, args = "subscription_id = ?", [sub_id]
    if state is not None:
        where += " AND state = ?"
        args.append(state)
    rows = conn.execute(f"SELECT {LOG_COLUMNS} FROM webhook_deliveries WHERE {where}"
                        " ORDER BY created_at DESC, id DESC LIMIT ?", (*args, limit))
    return [dict(r) for r in rows]
