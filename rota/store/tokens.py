"""Tokens in the database: the SQL the server's store runs (``Store.create_token`` and
the rest, for the API) and the CLI's own operations (``rota token create|list|revoke``),
which go straight to the database so that the first token needs no server. Only a hash
of each token's secret is stored (rota/core/auth.py). The CLI's one other look straight at
the database is here too: whether a server id is in use (``rota serve``'s start-up
check on a shared database).
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import msgspec

from rota.store import fleet, sqlite
from rota.store.urls import is_url
from rota.base.errors import Conflict
from rota.base.protocol import rfc3339


def live_tokens(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT id, name, scope, queues, hash, created_at FROM tokens"
                        " WHERE revoked_at IS NULL ORDER BY created_at, id")
    return [{**dict(r), "queues": msgspec.json.decode(r["queues"]) if r["queues"] else None}
            for r in rows]


def token_view(row: dict[str, Any]) -> dict[str, Any]:
    """A token as the API and the CLI show it: never its hash."""
    return {"id": row["id"], "name": row["name"], "scope": row["scope"],
            "queues": row["queues"], "created_at": rfc3339(row["created_at"])}


# One statement each for the server's writer (the API) and the CLI's own connection.
def insert_token(conn: sqlite3.Connection, *, name: str, scope: str,
                 queues: list[str] | None, token_id: str, hashed: str) -> dict[str, Any]:
    if conn.execute("SELECT 1 FROM tokens WHERE name = ? AND revoked_at IS NULL",
                    (name,)).fetchone():
        raise Conflict("token_name_taken", f"a live token is already named {name!r}")
    now = time.time()
    conn.execute("INSERT INTO tokens (id, name, scope, queues, hash, created_at)"
                 " VALUES (?, ?, ?, ?, ?, ?)",
                 (token_id, name, scope, msgspec.json.encode(queues).decode() if queues else None,
                  hashed, now))
    return {"id": token_id, "name": name, "scope": scope, "queues": queues, "created_at": now}


def revoke_tokens(conn: sqlite3.Connection, id_or_name: str) -> list[dict[str, Any]]:
    rows = conn.execute("UPDATE tokens SET revoked_at = ? WHERE revoked_at IS NULL"
                        " AND (id = ? OR name = ?) RETURNING id, name, scope, queues, created_at",
                        (time.time(), id_or_name, id_or_name)).fetchall()
    return [{**dict(r), "queues": msgspec.json.decode(r["queues"]) if r["queues"] else None}
            for r in rows]


def open_database(target: Path | str) -> Any:
    """A connection to the database, migrated first: the SQLite file at ``target``, or
    the PostgreSQL database a URL names (a sqlite3-like rota/store/pg_connection.py connection).
    The CLI's way in, and the store's at start (``Store.load``)."""
    if is_url(target):
        from rota.store import pg, pg_connection  # psycopg: only for PostgreSQL

        assert isinstance(target, str)
        pg.migrate(target)
        return pg_connection.connect(target)
    conn = sqlite.connect(Path(target))
    if sqlite.up_to_date(conn):
        return conn
    conn.close()
    # sqlite_utils, which runs the migrations, costs a start 28 ms to import: only a file
    # that needs them, or that a newer Rota migrated (refused there), imports it.
    from rota.store import migrations

    migrations.migrate(Path(target))
    return sqlite.connect(Path(target))


# -- tokens, from the CLI: straight to the database, so the first token needs no server --
def create_token(path: Path | str, *, name: str, scope: str, queues: list[str] | None,
                 token_id: str, hashed: str) -> None:
    """Raises Conflict (token_name_taken) if a live token has this name. ``path``: the
    file, or a PostgreSQL URL."""
    conn = open_database(path)
    try:
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            insert_token(conn, name=name, scope=scope, queues=queues, token_id=token_id,
                         hashed=hashed)
    finally:
        conn.close()


def list_tokens(path: Path | str) -> list[dict[str, Any]]:
    conn = open_database(path)
    try:
        return live_tokens(conn)
    finally:
        conn.close()


def revoke_token(path: Path | str, id_or_name: str) -> int:
    """Revoke the live token with this id or name; returns how many were revoked."""
    conn = open_database(path)
    try:
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            return len(revoke_tokens(conn, id_or_name))
    finally:
        conn.close()


# -- rota serve's start-up check, on a shared database ----------------------------------
def server_id_in_use(url: str, server_id: str) -> str | None:
    """Why another live server holds ``server_id`` on this database, or None. A server
    on this host whose process is gone (a crash, restarted under the same name) does
    not count: it takes its own reservations back."""
    conn = open_database(url)
    try:
        held = fleet.holder(conn, server_id)
    finally:
        conn.close()
    if held is None:
        return None
    host, pid, left = held
    if host == socket.gethostname() and (pid == os.getpid() or not _alive(pid)):
        return None
    return (f"server id {server_id} is in use by rota serve pid {pid} on {host} (its lease"
            f" runs {max(0.0, left):.1f}s more): give this one another"
            " --server-id")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    return True

