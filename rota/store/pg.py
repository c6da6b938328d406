"""PostgreSQL plumbing: the same store as rota/store/sqlite.py's, on a server several Rotas share.

The store's operations (rota/store/store.py, rota/store/writes.py, rota/store/rows.py, ...) are
written once, in SQLite's SQL, against a sqlite3 connection. Here they run unchanged on PostgreSQL:

- rota/store/pg_sql.py translates each statement for PostgreSQL, and makes the schema's DDL;
- rota/store/pg_connection.py's ``TranslatingConnection`` acts as sqlite3's does for what the store uses;
- ``Writer`` and ``Readers`` are rota/store/writer.py's and rota/store/readers.py's, on these
  connections: one writer thread, group commit, a savepoint per operation, and a reader
  pool;
- ``migrate`` brings a database to this Rota's schema;
- ``Listener`` hears NOTIFY on an asyncio connection (psycopg's AsyncConnection),
  connecting again if it is lost.

The database server going away is an expected fault: its errors become ``StorageError``
(``storage_unavailable``), the store is degraded (rota/store/health.py), and each
connection is opened again at its next use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import psycopg
from psycopg import sql as pgsql

from rota.store import readers, schema, sqlite, writer
from rota.base.errors import StorageError
from rota.store.urls import redact
from rota.store.pg_connection import TranslatingConnection, connect, connect_params
from rota.store.pg_sql import ddl

log = logging.getLogger("rota.server")

MIGRATIONS_TABLE = "rota_migrations"
MIGRATE_LOCK = 0x726F7461  # pg_advisory_xact_lock key ("rota"): one migrator at a time


# -- the server going away --------------------------------------------------------------
# SQLSTATE classes and codes that blame the database server rather than the statement:
# (code, sentence, seconds to wait), as rota/store/sqlite.py's STORAGE_ERRORS for SQLite.
UNAVAILABLE = ("storage_unavailable", "the PostgreSQL server cannot be reached", 1)
REFUSED = ("storage_unavailable", "the PostgreSQL server refused the connection", 1)
STORAGE_STATES: dict[str, tuple[str, str, int]] = {
    "08": UNAVAILABLE,  # connection exceptions
    "57P": UNAVAILABLE,  # shut down, crashed, starting up
    "53300": UNAVAILABLE,  # too many connections
    "53100": ("storage_full", "the PostgreSQL server's disk is full", 3),
    "53": ("storage_busy", "the PostgreSQL server is out of resources", 1),
    "58": ("storage_io_error", "the PostgreSQL server failed a read or a write", 3),
    "XX001": ("storage_corrupt", "the PostgreSQL database is damaged", 3),
    "XX002": ("storage_corrupt", "the PostgreSQL database is damaged", 3),
    # This server's session sat inside a transaction past the bound (``connect``): it
    # stalled, and PostgreSQL ended the session so that its locks held nobody else.
    "25P03": ("storage_unavailable", "the PostgreSQL server ended this server's session,"
              " idle inside a transaction past idle_in_transaction_session_timeout (this"
              " server stalled)", 1),
    "25006": ("storage_read_only", "the PostgreSQL server takes no writes (a standby?)", 3),
    "40001": ("storage_busy", "the PostgreSQL server refused a conflicting write", 1),
    "40P01": ("storage_busy", "the PostgreSQL server broke a deadlock", 1),
    "55P03": ("storage_busy", "a row another transaction holds stayed locked past"
                              " lock_timeout", 1),
}


def storage_error(exc: BaseException) -> StorageError | None:
    """``exc`` as a StorageError (with ``exc`` as its cause) if it blames the database
    server: it cannot be reached, the connection was lost, or its storage failed."""
    if isinstance(exc, StorageError):
        return exc
    if not isinstance(exc, psycopg.Error):
        return None
    state = exc.sqlstate
    meaning = None
    if state is None:
        # No SQLSTATE: the client's own (refused or lost connection, one closed already).
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            # A server that answered with FATAL (no such database or role, a refused
            # login) was reached: say that it refused, not that it cannot be reached.
            meaning = REFUSED if "FATAL:" in str(exc) else UNAVAILABLE
    else:
        meaning = next((m for prefix, m in sorted(STORAGE_STATES.items(),
                                                  key=lambda kv: -len(kv[0]))
                        if state.startswith(prefix)), None)
    if meaning is None:
        return None
    code, sentence, retry_after = meaning
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    error = StorageError(code, f"{sentence} ({reason})", retry_after)
    error.__cause__ = exc
    return error


def history(conn: TranslatingConnection) -> tuple[int, str] | None:
    """Which server's history this connection writes: its system identifier and WAL
    timeline. A restart keeps both; a standby promoted (a failover) starts a new
    timeline, where a transaction id may name another transaction. None where it cannot
    be read (a role not allowed to): then no failover is told apart."""
    try:
        row = conn.raw.execute("SELECT system_identifier, substr(pg_walfile_name("
                               "pg_current_wal_lsn()), 1, 8) FROM pg_control_system()"
                               ).fetchone()
    except psycopg.Error as exc:
        if storage_error(exc) is not None:
            raise
        return None
    return None if row is None else (int(row[0]), str(row[1]))


def used_bytes(conn: TranslatingConnection) -> int:
    """What the database takes on the server's disk (a --max-db-size quota is kept by
    refusing new jobs, as on SQLite; PostgreSQL has no hard limit of its own)."""
    return int(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])


# -- the store's threads ----------------------------------------------------------------
class Txn(NamedTuple):
    """A writer's transaction, as a commit in doubt names it (``Writer._begin``)."""

    xid: int
    pid: int  # its session's backend
    history: tuple[int, str] | None  # the server's (``history``), which its id belongs to

    def __str__(self) -> str:  # (in the writer's log lines)
        return f"{self.xid} of session pid {self.pid}"


class Writer(writer.Writer):
    """rota/store/writer.py's writer (group commit, a savepoint per op) on a PostgreSQL connection,
    opened again after the server went away. ``bound``: see ``connect`` (rota/store/store.py
    gives a quarter of the server lease: a server stalled inside a transaction holds the
    others' writers that long at most, and their leases outlast it)."""

    bound: float | None = None

    _history: tuple[int, str] | None = None  # the writer connection's server's

    def _open(self) -> TranslatingConnection:
        conn = connect(self._path, durability=self._durability, bound=self.bound)
        self._history = history(conn)
        if self.max_bytes is not None:
            self.used_bytes = used_bytes(conn)
        return conn

    def _usable(self, conn: Any) -> bool:
        return bool(conn.usable)

    def _classify(self, exc: BaseException) -> StorageError | None:
        return storage_error(exc)

    def _begin(self, conn: Any) -> Txn:
        # The transaction's id comes back with BEGIN, in the same round trip (simple
        # query protocol, hence never prepared): a COMMIT whose answer is lost with the
        # connection can then be asked about (``_fates``). PostgreSQL's fast shutdown
        # does end sessions between a commit and its answer. With it, the session's pid:
        # a session cut from this side may still be carrying the COMMIT out.
        cursor = conn.raw.execute("BEGIN; SELECT txid_current()", prepare=False)
        cursor.nextset()
        return Txn(int(cursor.fetchone()[0]), conn.raw.info.backend_pid, self._history)

    def _in_doubt(self, conn: Any, exc: BaseException) -> bool:
        # Lost with the session: the COMMIT may have been carried out. An answer from
        # the server (a serialization failure at COMMIT) is certain: it did not commit.
        if conn is not None and not conn.usable:
            return True
        state = getattr(exc, "sqlstate", None)
        return state is None or state.startswith(("08", "57P"))

    def _fates(self, conn: Any, names: list[Any]) -> dict[Any, bool | None]:
        # A transaction id from another history (a standby promoted since: a failover)
        # may name another transaction here, or none: failed, as reported before.
        elsewhere = {name: False for name in names if None not in (name.history,
                                                                    self._history)
                     and name.history != self._history}
        if elsewhere:
            log.warning("%d commit(s) in doubt were made before a failover (the database"
                        " server's history changed): reported as failed", len(elsewhere))
        names = [name for name in names if name not in elsewhere]
        fates = self._statuses(conn, names) | elsewhere
        running = [name for name in names if fates[name] is None]
        if running:
            # Its old session (cut from this side: a network's fault) still carries it
            # out. Ended, its outcome is final at once: committed if its record was
            # written, else not. (The same role may end its own sessions.)
            conn.raw.execute("SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) AS p",
                             ([name.pid for name in running],))
            deadline = time.monotonic() + DOUBT_WAIT
            while running and time.monotonic() < deadline:
                time.sleep(0.01)  # noqa: sleep-ok (a poll step of DOUBT_WAIT)
                fates.update(self._statuses(conn, running))
                running = [name for name in running if fates[name] is None]
        return fates

    @staticmethod
    def _statuses(conn: Any, names: list[Any]) -> dict[Any, bool | None]:
        if not names:
            return {}
        rows = dict(conn.raw.execute(
            "SELECT x, txid_status(x) FROM unnest(%s::bigint[]) AS x",
            ([name.xid for name in names],)).fetchall())
        # "in progress": not ended yet; NULL: too old to be known (wrapped around),
        # which an answer lost minutes ago never is.
        return {name: {"committed": True, "aborted": False}.get(rows[name.xid])
                if rows[name.xid] else False for name in names}

    def measure(self, conn: Any) -> int:
        return used_bytes(conn)

    def _alone(self, exc: BaseException) -> bool:
        # A lock held past lock_timeout (by another server's transaction, or an
        # operator's) fails the op that waited on it, not its whole transaction: the
        # savepoint is rolled back, and the rest (a lease renewal among them) commits.
        return getattr(exc, "sqlstate", None) == LOCKED

    def _again(self, exc: BaseException) -> bool:
        # A deadlock (two servers' writers updating the same rows in different orders)
        # or a serialization failure: PostgreSQL rolled the transaction back and asks
        # for it again. Every op is a function of its inputs and the rows, so it can.
        return getattr(exc, "sqlstate", None) in AGAIN or \
            getattr(exc.__cause__, "sqlstate", None) in AGAIN


DOUBT_WAIT = 2.0  # seconds a commit in doubt's ended session is given to settle it


AGAIN = frozenset({"40P01", "40001"})  # deadlock_detected, serialization_failure
LOCKED = "55P03"  # lock_not_available: lock_timeout ran out


class Readers(readers.Readers):
    """rota/store/readers.py's reader pool on read-only PostgreSQL connections (``size`` of them:
    --db-pool)."""

    def _open(self) -> TranslatingConnection:
        return connect(self._path, readonly=True)

    def _usable(self, conn: Any) -> bool:
        return bool(conn.usable)

    def _classify(self, exc: BaseException) -> StorageError | None:
        return storage_error(exc)


def migrate(url: str) -> None:
    """Bring the database to this Rota's schema, recording the same migration names as
    SQLite's; refuse one a newer Rota migrated (sqlite.NewerDatabase). Several servers
    starting at once take turns (an advisory lock)."""
    conn = connect(url)
    try:
        conn.execute("BEGIN")
        conn.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATE_LOCK,))
        conn.execute(f"CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (name TEXT PRIMARY KEY,"
                     " applied_at DOUBLE PRECISION)")
        applied = [r[0] for r in conn.execute(f"SELECT name FROM {MIGRATIONS_TABLE}")]
        unknown = [name for name in applied if name not in schema.MIGRATIONS]
        if unknown:
            by = None
            if conn.execute("SELECT to_regclass('meta')").fetchone()[0] is not None:
                by = conn.execute("SELECT value FROM meta WHERE key = 'migrated_by'"
                                  ).fetchone()
            raise sqlite.NewerDatabase(redact(url), unknown, sqlite._version(), by[0] if by else None)
        pending = [name for name in schema.MIGRATIONS if name not in applied]
        if pending:
            for statement in ddl():  # PostgreSQL's own SQL: not translated
                conn.raw.execute(statement)
            now = time.time()
            conn.executemany(f"INSERT INTO {MIGRATIONS_TABLE} (name, applied_at) VALUES (?, ?)",
                             [(name, now) for name in pending])
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('migrated_by', ?)",
                         (sqlite._version(),))
        conn.execute("COMMIT")
    finally:
        conn.close()  # (a refusal's open transaction ends with it)


# -- LISTEN -----------------------------------------------------------------------------
class Listener:
    """Hears NOTIFY on ``channels`` and calls ``callback(channel, payload)`` on the event
    loop, one call per notification, in the order PostgreSQL delivers them.

    A lost connection is opened again (every ``retry`` seconds until it is). What was
    notified in between is not heard: ``on_connect`` runs after every LISTEN, the first
    and each one after a reconnection, for the caller to catch up by reading the store.
    """

    def __init__(self, url: str, channels: Sequence[str],
                 callback: Callable[[str, str], None], *,
                 on_connect: Callable[[], None] | None = None, retry: float = 0.5) -> None:
        self.url = url
        self.channels = list(channels)
        self.callback = callback
        self.on_connect = on_connect
        self.retry = retry
        self.listening = asyncio.Event()  # set while LISTEN holds
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rota-listen")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self.listening.clear()

    async def _run(self) -> None:
        lost_since: float | None = None
        while True:
            try:
                conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True,
                                                             **connect_params(self.url))
                async with conn:
                    for channel in self.channels:
                        await conn.execute(pgsql.SQL("LISTEN {}").format(
                            pgsql.Identifier(channel)))
                    self.listening.set()
                    if lost_since is not None:
                        log.warning("listening again on %s after %.1fs",
                                    ", ".join(self.channels), time.monotonic() - lost_since)
                        lost_since = None
                    if self.on_connect is not None:
                        self.on_connect()
                    async for note in conn.notifies():
                        try:
                            self.callback(note.channel, note.payload)
                        except Exception:  # one bad callback must not stop the others
                            log.exception("a NOTIFY callback failed")
            except psycopg.Error as exc:
                if lost_since is None:
                    lost_since = time.monotonic()
                    log.error("LISTEN connection lost: %s; connecting again",
                              str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
            self.listening.clear()
            # Not a synchronisation: the pause between attempts to reach a server that is
            # down, so that they do not spin.
            await asyncio.sleep(self.retry)
