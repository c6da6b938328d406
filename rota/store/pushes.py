"""The store's part of push execution: the versions of specs that run on endpoints, with
the first job row of each (rota/core/pins.py), and the key of callback tokens, one per
database so that every server and every restart accepts the same tokens. ``PushReading``
is the ``Store`` mixin that runs them."""

from __future__ import annotations

import sqlite3

from rota.store.readers import Readers
from rota.store.rows import read_windows
from rota.store.writer import Writer
from rota.core.pins import Window


class PushReading:
    readers: Readers
    writer: Writer

    async def spec_windows(self) -> dict[str, list[Window]]:
        """The pushes of specs that ever ran on an endpoint, oldest first."""
        return await self.readers.run(read_windows)

    async def callback_key(self, fresh: str) -> bytes:
        """The key of push callbacks' tokens (``fresh``, hex, if the database has none)."""
        def op(conn: sqlite3.Connection) -> bytes:
            conn.execute("INSERT INTO meta (key, value) VALUES ('callback_key', ?)"
                         " ON CONFLICT (key) DO NOTHING", (fresh,))
            row = conn.execute("SELECT value FROM meta WHERE key = 'callback_key'").fetchone()
            return bytes.fromhex(row[0])
        return await self.writer.submit(op)
