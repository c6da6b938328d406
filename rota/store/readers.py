"""SQLite's pool of readers: WAL lets them read while the writer commits. rota/store/pg.py's
Readers are these on PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rota.store.sqlite import connect, storage_error
from rota.store.health import Health
from rota.base.errors import StorageError

T = TypeVar("T")


class Readers:
    """A small pool of read-only connections; WAL lets them read while the writer commits."""

    def __init__(self, path: Any, size: int = 2, health: Health | None = None) -> None:
        self._path = path  # a file here; a URL for rota/store/pg.py's
        self._health = health or Health()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="rota-reader")
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, fn)

    # -- what a backend provides (rota/store/pg.py's Readers: PostgreSQL) ----------------
    def _open(self) -> Any:
        return connect(self._path, readonly=True)

    def _usable(self, conn: Any) -> bool:
        return True

    def _classify(self, exc: BaseException) -> StorageError | None:
        return storage_error(exc)

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            conn = getattr(self._local, "conn", None)
            if conn is not None and not self._usable(conn):  # its server went away
                self._local.conn = conn = self._forget(conn)
            if conn is None:
                conn = self._open()
                self._local.conn = conn
                with self._lock:
                    self._conns.append(conn)
            return fn(conn)
        except Exception as exc:
            if (failure := self._classify(exc)) is None:
                raise
            raise self._health.failed(failure) from exc

    def _forget(self, conn: Any) -> None:
        """Close a broken connection and drop it from the pool (a new one is opened at
        this thread's next use, which may fail again while the server is away)."""
        with self._lock:
            self._conns.remove(conn)
        with contextlib.suppress(Exception):
            conn.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
