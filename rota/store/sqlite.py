"""SQLite as Rota opens it: a connection, what its errors mean, the room a quota leaves.

The rest of SQLite's plumbing stands on this: the schema's migrations
(rota/store/migrations.py), the store's health (rota/store/health.py), the one writer thread
(rota/store/writer.py) and the pool of readers (rota/store/readers.py). Nothing here runs on
the event loop.

A disk that is full, read-only or failing is an expected fault: its SQLite errors
become ``StorageError`` (``storage_error``).
"""

from __future__ import annotations

import importlib.metadata
import sqlite3
from pathlib import Path
from typing import Any

from rota.base.errors import RotaError, StorageError
from rota.store.schema import MIGRATIONS

# -- a full or failing disk ------------------------------------------------------------
# SQLite's primary result codes that blame the storage rather than the statement: what
# the client is told (code, sentence) and how many seconds it should wait before asking
# again (HTTP Retry-After). The waits stay below db_health.RECOVER_AFTER, so that
# producers that honour them keep a degraded store's state steady rather than letting
# it seem to recover between two attempts.
STORAGE_ERRORS: dict[str, tuple[str, str, int]] = {
    "SQLITE_FULL": ("storage_full", "the database or its disk is full", 3),
    "SQLITE_READONLY": ("storage_read_only", "the database file cannot be written", 3),
    "SQLITE_IOERR": ("storage_io_error", "the disk failed a read or a write", 3),
    "SQLITE_CANTOPEN": ("storage_io_error", "a database file could not be opened", 3),
    "SQLITE_BUSY": ("storage_busy", "the database is locked by another process", 1),
    "SQLITE_LOCKED": ("storage_busy", "the database is locked by another process", 1),
    "SQLITE_CORRUPT": ("storage_corrupt", "the database file is damaged", 3),
    "SQLITE_NOTADB": ("storage_corrupt", "the database file is not an SQLite database", 3),
}
# Bytes of a --max-db-size quota kept free for each job not yet finished, so that the
# jobs accepted can still be reserved and finish once new ones are refused: measured, a
# reservation and a small result grow a job's row by about 170 bytes, and page splits
# can double that.
ROOM_PER_JOB = 1024


def classify(errorname: str | None) -> tuple[str, str, int] | None:
    """What an SQLite error name means for clients, or None if the storage is not at
    fault (a constraint, a bug). Names are a primary code with an optional extended
    part: ``SQLITE_IOERR_WRITE`` is an ``SQLITE_IOERR``."""
    for primary, meaning in STORAGE_ERRORS.items():
        if errorname is not None and (errorname == primary or
                                      errorname.startswith(primary + "_")):
            return meaning
    return None


def storage_error(exc: BaseException) -> StorageError | None:
    """``exc`` as a StorageError (with ``exc`` as its cause) if it blames the storage."""
    if isinstance(exc, StorageError):
        return exc
    name = getattr(exc, "sqlite_errorname", None) if isinstance(exc, sqlite3.Error) else None
    meaning = classify(name)
    if meaning is None:
        return None
    code, sentence, retry_after = meaning
    error = StorageError(code, f"{sentence} ({name})", retry_after)
    error.__cause__ = exc
    return error


def has_room(quota: int, used: int, live: int, new: list[int]) -> bool:
    """Whether jobs whose args take ``new`` bytes each may be enqueued into a database
    of ``used`` bytes under a quota of ``quota`` bytes while ``live`` jobs are not yet
    finished: each new job takes its args and ROOM_PER_JOB, and every live job keeps
    ROOM_PER_JOB for its run."""
    return used + sum(new) + (live + len(new)) * ROOM_PER_JOB <= quota


def quota_full(quota: int) -> StorageError:
    return StorageError("storage_full", f"the database is at its quota (--max-db-size"
                        f" {quota} bytes); the room left is kept for the jobs accepted",
                        STORAGE_ERRORS["SQLITE_FULL"][2])


def used_bytes(conn: sqlite3.Connection) -> int:
    """What the database's pages in use take (free pages are room)."""
    row = conn.execute("SELECT (page_count - freelist_count) * page_size FROM"
                       " pragma_page_count(), pragma_freelist_count(), pragma_page_size()"
                       ).fetchone()
    return int(row[0])


def rowcounts(conn: Any, sql: str, rows: list[tuple[Any, ...]]) -> list[int]:
    """Run ``sql`` once per parameter row and say how many rows each run changed: a
    fenced write (``UPDATE ... WHERE id = ? AND attempt = ?``) learns which rows refused
    it, which ``executemany``'s one total cannot say. rota/store/pg.py's connection pipelines
    the statements; sqlite3 runs them one by one (its statement cache makes that about
    as fast as executemany)."""
    if isinstance(conn, sqlite3.Connection):
        return [conn.execute(sql, row).rowcount for row in rows]
    return list(conn.rowcounts(sql, rows))


# What a commit survives (``rota serve --durability``): "full" fsyncs every commit, so an
# acknowledged write survives power loss; "process" lets the OS write it back later, so it
# survives a crash of Rota but the last commits may be lost if the machine or its power
# fails. Either way a commit is atomic and the file stays consistent (WAL).
SYNCHRONOUS = {"full": "FULL", "process": "NORMAL"}


def connect(path: Path, *, readonly: bool = False, durability: str = "full"
            ) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout = 5000")
        conn.execute("PRAGMA foreign_keys = ON")
        if not readonly:  # (a file that is not a database fails here)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {SYNCHRONOUS[durability]}")
        else:
            conn.execute("PRAGMA query_only = ON")
    except BaseException:
        conn.close()
        raise
    return conn


def up_to_date(conn: sqlite3.Connection) -> bool:
    """Whether the file has this Rota's migrations (rota/store/schema.py), all and only
    them: then rota/store/migrations.py has nothing to do. A new file, one with a
    migration pending, or one a newer Rota migrated is not."""
    try:
        names = [row[0] for row in conn.execute(
            "SELECT name FROM _sqlite_migrations WHERE migration_set = 'rota'")]
    except sqlite3.Error:  # (no such table: a new file)
        return False
    return len(names) == len(MIGRATIONS) and set(names) == set(MIGRATIONS)


def _version() -> str:
    try:
        return importlib.metadata.version("rota")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class NewerDatabase(RotaError):
    """The database (a file, or a PostgreSQL URL) was migrated by a newer Rota: this one
    refuses to open it."""

    def __init__(self, path: Path | str, unknown: list[str], version: str, by: str | None
                 ) -> None:
        writer = f"Rota {by}" if by else "a newer Rota"
        super().__init__("newer_database", f"{path} was written by {writer}, and this is"
                         f" Rota {version}: its schema has {', '.join(unknown)}, which this"
                         " version does not know. Upgrade Rota, or use another --db")

