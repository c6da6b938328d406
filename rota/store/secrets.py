"""Endpoint signing secrets in the database: set (a rotation keeps the value it replaces valid for a window), read, list and delete; functions of a connection, and ``Secrets``, the ``Store`` mixin that runs them.

Values are kept as given, not hashed: signing needs them (HMAC). On PostgreSQL a change
tells the other servers (``rota_secrets``, rota/store/fleet.py), which read the table again.
"""

from __future__ import annotations

import asyncio
import sqlite3
from typing import Any

from rota.store import fleet
from rota.store.readers import Readers
from rota.store.writer import Writer

_COLUMNS = "name, value, previous, rotated_at, previous_until, created_at, updated_at"


def read_secrets(conn: sqlite3.Connection) -> dict[str, dict[str, Any]]:
    """Every stored secret's row, values included, by name (the server's lookup's)."""
    return {row["name"]: dict(row) for row in conn.execute(
        f"SELECT {_COLUMNS} FROM secrets ORDER BY name")}


def set_secret(conn: sqlite3.Connection, name: str, value: str, now: float, window: float,
               server_id: str | None) -> tuple[dict[str, Any], str]:
    """Store ``value`` as secret ``name``. Replacing another value is a rotation: the old
    one stays valid ``window`` seconds more (0: not at all). Setting the value it has
    already changes nothing. Its row after, and the change: "new", "rotated" or
    "unchanged"."""
    row = conn.execute(f"SELECT {_COLUMNS} FROM secrets WHERE name = ?", (name,)).fetchone()
    change = "new" if row is None else "rotated" if row["value"] != value else "unchanged"
    if row is None:
        conn.execute(f"INSERT INTO secrets ({_COLUMNS}) VALUES (?, ?, NULL, NULL, NULL, ?, ?)",
                     (name, value, now, now))
    elif row["value"] != value:
        conn.execute("UPDATE secrets SET value = ?, previous = ?, rotated_at = ?,"
                     " previous_until = ?, updated_at = ? WHERE name = ?",
                     (value, row["value"] if window > 0 else None, now,
                      now + window if window > 0 else None, now, name))
    else:
        return dict(row), change
    if server_id is not None:
        fleet.notify(conn, fleet.SECRETS, server_id, [name])
    return dict(conn.execute(f"SELECT {_COLUMNS} FROM secrets WHERE name = ?",
                             (name,)).fetchone()), change


def delete_secret(conn: sqlite3.Connection, name: str, server_id: str | None
                  ) -> dict[str, Any] | None:
    """Delete secret ``name``; its row, or None if there was none."""
    row = conn.execute(f"DELETE FROM secrets WHERE name = ? RETURNING {_COLUMNS}",
                       (name,)).fetchone()
    if row is not None and server_id is not None:
        fleet.notify(conn, fleet.SECRETS, server_id, [name])
    return dict(row) if row is not None else None


class Secrets:
    """``Store``'s secrets operations (rota/store/store.py inherits it)."""

    __slots__ = ()
    readers: Readers
    writer: Writer
    server_id: str | None
    database_url: str | None

    def _teller(self) -> str | None:
        """Who tells the other servers of a change: this server, if it shares the database."""
        return (self.server_id or "") if self.database_url is not None else None

    async def secrets(self) -> dict[str, dict[str, Any]]:
        return await self.readers.run(read_secrets)

    def set_secret(self, name: str, value: str, now: float, window: float
                   ) -> asyncio.Future[tuple[dict[str, Any], str]]:
        teller = self._teller()
        return self.writer.submit(lambda conn: set_secret(conn, name, value, now, window,
                                                          teller))

    def delete_secret(self, name: str) -> asyncio.Future[dict[str, Any] | None]:
        teller = self._teller()
        return self.writer.submit(lambda conn: delete_secret(conn, name, teller))
