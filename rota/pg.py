"""PostgreSQL plumbing: the same store as rota/db.py's, on a server several Rotas share.

The store's operations (rota/store.py, rota/rows.py, rota/lookup.py) are written once,
in SQLite's SQL, against a sqlite3 connection. Here they run unchanged on PostgreSQL:

- ``translate`` rewrites each statement for PostgreSQL (``?`` placeholders, SQLite's
  scalar MAX, INSERT OR IGNORE / OR REPLACE, index hints, ...), once per statement text;
- ``Connection``/``Cursor``/``Row`` act as sqlite3's do for what the store uses
  (``execute``, ``executemany``, ``in_transaction``, rows read by index or name,
  ``cursor.row_factory = None`` for plain tuples);
- ``Writer`` and ``Readers`` are rota/db.py's, on these connections: one writer thread,
  group commit, a savepoint per operation, and a reader pool;
- ``Listener`` hears NOTIFY on an asyncio connection, connecting again if it is lost.

The driver is psycopg 3: sync connections on the writer's and readers' threads (the model
of rota/db.py, so nothing differs but the connection) and its AsyncConnection for LISTEN.
Parameters are bound by the server, and every statement is prepared on its first use
(``prepare_threshold=0``): the store's statements come from a few templates, and a
prepared one costs half the time of one sent whole (measured: 6,000 single-row enqueue
INSERTs in 1.8 s against 3.7 s bound on the client). The price is that PostgreSQL must
tell each parameter's type from its place, which SQLite never asks: ``translate`` gives
a bare ``? IS NULL`` a type, and new SQL must not leave a parameter with nothing around
it to type it. (A PgBouncer in front must be 1.21 or newer, in transaction mode, with
``max_prepared_statements`` set.)

The database server going away is an expected fault: its errors become ``StorageError``
(``storage_unavailable``), the store is degraded (rota/db.py ``Health``), and each
connection is opened again at its next use.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import select
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from rota import db, schema
from rota.errors import StorageError

log = logging.getLogger("rota.server")

SCHEMES = ("postgresql://", "postgres://")
# Connection settings unless the URL says otherwise: a server that does not answer is
# found out in seconds (the store degrades and says so) rather than when the kernel
# gives up on TCP, minutes later.
DEFAULTS = {"connect_timeout": "5", "keepalives": "1", "keepalives_idle": "5",
            "keepalives_interval": "2", "keepalives_count": "3", "tcp_user_timeout": "10000",
            "application_name": "rota"}
MIGRATIONS_TABLE = "rota_migrations"
MIGRATE_LOCK = 0x726F7461  # pg_advisory_xact_lock key ("rota"): one migrator at a time


def is_url(text: str | object) -> bool:
    """Whether a --db value names a PostgreSQL database rather than an SQLite file."""
    return isinstance(text, str) and text.startswith(SCHEMES)


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


# -- SQLite's SQL, for PostgreSQL ---------------------------------------------------------
@functools.lru_cache(maxsize=2048)
def translate(sql: str) -> str:
    """``sql`` (SQLite's, as the store writes it) as PostgreSQL runs it. Statements come
    from a few templates, so each text is rewritten once (the cache)."""
    for rule in RULES:
        sql = rule(sql)
    return sql


def _begin(sql: str) -> str:
    # BEGIN IMMEDIATE takes SQLite's write lock at once; PostgreSQL locks rows as it goes.
    return re.sub(r"(?i)^\s*BEGIN\s+(IMMEDIATE|DEFERRED|EXCLUSIVE)\b", "BEGIN", sql)


def _index_hints(sql: str) -> str:
    # INDEXED BY tells SQLite's planner (no statistics) which index to walk; PostgreSQL's
    # planner has statistics and no such clause.
    return re.sub(r"(?i)\s+INDEXED\s+BY\s+\w+", "", sql)


def _unary_plus(sql: str) -> str:
    # "+state" keeps SQLite from using an index on the column; PostgreSQL has no such
    # idiom (its planner decides), and the plus is a no-op only on numbers there.
    return re.sub(r"(?<=[\s(])\+(?=[A-Za-z_])", "", sql)


def _json_append(sql: str) -> str:
    # json_insert(list, '$[#]', json(?)) appends to a JSON list kept as text. The migration
    # defines rota_json_append, which does the same to the text (PostgreSQL's jsonb would
    # write it back with other spacing and key order).
    return re.sub(r"(?i)json_insert\(\s*(\w+)\s*,\s*'\$\[#\]'\s*,\s*json\(\s*\?\s*\)\s*\)",
                  r"rota_json_append(\1, ?)", sql)


def _db_clock(sql: str) -> str:
    # SQLite's time now, in seconds since the epoch (rota/fleet.py's DB_NOW): the
    # database's clock when the statement runs (clock_timestamp, not the transaction's
    # start, now()), which judges every server's lease.
    return sql.replace("((julianday('now') - 2440587.5) * 86400.0)",
                       "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)")


def _null_test(sql: str) -> str:
    # "? IS NULL": a parameter with nothing around it to give it a type, which PostgreSQL
    # must know to prepare the statement. Any value's text is NULL only if it is.
    return re.sub(r"\?(\s+IS\s+(?:NOT\s+)?NULL\b)", r"CAST(? AS TEXT)\1", sql, flags=re.I)


def _instr(sql: str) -> str:
    return re.sub(r"(?i)\binstr\(", "strpos(", sql)


def _closing(sql: str, start: int) -> int:
    """The index of the parenthesis that closes the one at ``start``."""
    depth = 0
    quoted = False
    for i in range(start, len(sql)):
        ch = sql[i]
        if ch == "'":
            quoted = not quoted
        elif quoted:
            continue
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced parentheses in {sql!r}")


def _top_level_comma(text: str) -> bool:
    depth = 0
    quoted = False
    for ch in text:
        if ch == "'":
            quoted = not quoted
        elif not quoted:
            depth += ch == "("
            depth -= ch == ")"
            if ch == "," and depth == 0:
                return True
    return False


def _scalar_min_max(sql: str) -> str:
    # SQLite's MAX(a, b) with two or more arguments is scalar: GREATEST. (One argument is
    # the aggregate, the same in both.) Both arguments here are never NULL where it is
    # used; GREATEST would skip a NULL where SQLite's MAX returns NULL.
    out = []
    last = 0
    for match in re.finditer(r"(?i)\b(MAX|MIN)\s*\(", sql):
        if match.start() < last:
            continue
        close = _closing(sql, match.end() - 1)
        if _top_level_comma(sql[match.end():close]):
            name = "GREATEST" if match.group(1).upper() == "MAX" else "LEAST"
            out.append(sql[last:match.start()] + name + "(")
            last = match.end()
    return "".join(out) + sql[last:]


_NOT_ALIASES = {"WHERE", "ORDER", "LIMIT", "GROUP", "HAVING", "UNION", "JOIN", "LEFT",
                "INNER", "CROSS", "ON", "OFFSET", "EXCEPT", "INTERSECT", "WINDOW"}


def _subquery_aliases(sql: str) -> str:
    # SQLite lets a subquery in FROM go unnamed; PostgreSQL before 16 requires a name.
    n = 0
    pos = 0
    while (match := re.compile(r"(?i)\bFROM\s*\(\s*SELECT\b").search(sql, pos)) is not None:
        open_at = sql.index("(", match.start())
        close = _closing(sql, open_at)
        after = re.match(r"\s*(?:AS\s+)?([A-Za-z_]\w*)", sql[close + 1:])
        if after is None or after.group(1).upper() in _NOT_ALIASES:
            n += 1
            sql = f"{sql[:close + 1]} AS _sub{n}{sql[close + 1:]}"
        pos = open_at + 1
    return sql


def _truth(sql: str) -> str:
    # SQLite takes a number as a condition ("WHERE paused", "WHERE 1 AND ..."); PostgreSQL
    # wants a boolean. A lone name or number between WHERE/AND/OR/NOT and the next
    # AND/OR/clause is compared with 0, as SQLite reads it.
    return re.sub(r"(?i)\b(WHERE|AND|OR|NOT)\s+(?!(?:NULL|TRUE|FALSE)\b)([A-Za-z_]\w*|\d+)"
                  r"(?=\s*$|\s*\)|\s+(?:AND|OR|ORDER|LIMIT|GROUP)\b)", r"\1 (\2 <> 0)", sql)


def _or_ignore(sql: str) -> str:
    match = re.match(r"(?is)^\s*INSERT\s+OR\s+IGNORE\s+INTO\b", sql)
    if match is None:
        return sql
    return _before_returning("INSERT INTO" + sql[match.end():], " ON CONFLICT DO NOTHING")


def _or_replace(sql: str) -> str:
    # SQLite's REPLACE deletes the row in the way and inserts the new one: the columns not
    # named take their defaults. An upsert on the primary key that sets every column
    # (named: the new value; not named: DEFAULT) leaves the same row.
    match = re.match(r"(?is)^\s*INSERT\s+OR\s+REPLACE\s+INTO\s+(\w+)\s*\(([^)]*)\)", sql)
    if match is None:
        return sql
    table = schema.table(match.group(1))
    named = {c.strip() for c in match.group(2).split(",")}
    sets = [f"{c.name} = excluded.{c.name}" if c.name in named else f"{c.name} = DEFAULT"
            for c in table.columns if c.name not in table.pk]
    rest = "INSERT INTO" + sql[re.match(r"(?is)^\s*INSERT\s+OR\s+REPLACE\s+INTO", sql).end():]
    action = f"DO UPDATE SET {', '.join(sets)}" if sets else "DO NOTHING"
    return _before_returning(rest, f" ON CONFLICT ({', '.join(table.pk)}) {action}")


def _before_returning(sql: str, clause: str) -> str:
    match = re.search(r"(?i)\sRETURNING\s", sql)
    if match is None:
        return sql.rstrip() + clause
    return sql[:match.start()] + clause + sql[match.start():]


def _placeholders(sql: str) -> str:
    # psycopg's placeholders are %s, and a literal % is written %%.
    out = []
    quoted = False
    for ch in sql:
        if ch == "'":
            quoted = not quoted
        if ch == "%":
            out.append("%%")
        elif ch == "?" and not quoted:
            out.append("%s")
        else:
            out.append(ch)
    return "".join(out)


RULES: tuple[Callable[[str], str], ...] = (
    _begin, _index_hints, _unary_plus, _json_append, _db_clock, _null_test, _instr, _scalar_min_max,
    _subquery_aliases, _truth, _or_ignore, _or_replace, _placeholders)


# -- a sqlite3-like connection ----------------------------------------------------------
class Row:
    """A row as sqlite3.Row gives it: by index, by column name, ``keys()``, ``dict(row)``."""

    __slots__ = ("_names", "_values")

    def __init__(self, names: dict[str, int], values: tuple[Any, ...]) -> None:
        self._names = names
        self._values = values

    def __getitem__(self, key: int | str | slice) -> Any:
        if isinstance(key, str):
            return self._values[self._names[key]]
        return self._values[key]

    def keys(self) -> list[str]:
        return list(self._names)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Row):
            return self._values == other._values and self._names == other._names
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._values)

    def __repr__(self) -> str:
        return f"Row({dict(zip(self._names, self._values))!r})"


class Cursor:
    """The results of one statement. ``row_factory = None`` gives plain tuples (as
    sqlite3's cursor does), else ``Row``s; it may be set after ``execute``."""

    def __init__(self, cursor: psycopg.Cursor[Any]) -> None:
        self._cursor = cursor
        self.row_factory: Any = Row
        self._names: dict[str, int] | None = None

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    def _row(self, values: tuple[Any, ...]) -> Any:
        if self.row_factory is None:
            return values
        if self._names is None:
            names: dict[str, int] = {}
            for i, column in enumerate(self._cursor.description or ()):
                names.setdefault(column.name, i)  # a name twice: the first, as sqlite3
            self._names = names
        return Row(self._names, values)

    def fetchone(self) -> Any:
        if self._cursor.description is None:  # no rows: not a query
            return None
        values = self._cursor.fetchone()
        return None if values is None else self._row(values)

    def fetchall(self) -> list[Any]:
        if self._cursor.description is None:
            return []
        return [self._row(values) for values in self._cursor.fetchall()]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.fetchall())


class Connection:
    """A psycopg connection that runs SQLite's SQL (``translate``), in autocommit mode
    as the store's sqlite3 connections are (``isolation_level=None``): transactions are
    the ``BEGIN`` and ``COMMIT`` the writer issues."""

    def __init__(self, raw: psycopg.Connection[Any], bounded: bool = False) -> None:
        self.raw = raw
        self.bounded = bounded  # its idle time in a transaction is bounded (``connect``)

    def execute(self, sql: str, params: Sequence[Any] | None = ()) -> Cursor:
        cursor = self.raw.cursor()
        # Always with parameters (maybe none), so that %% reads as % in every statement.
        cursor.execute(translate(sql), tuple(params or ()))  # type: ignore[arg-type]
        return Cursor(cursor)

    def executemany(self, sql: str, seq: Iterable[Sequence[Any]]) -> Cursor:
        rows = [tuple(p) for p in seq]
        cursor = self.raw.cursor()
        if rows:
            cursor.executemany(translate(sql), rows)  # type: ignore[arg-type]
            self._rearm()
        return Cursor(cursor)

    def _rearm(self) -> None:
        """After a pipelined executemany. psycopg's executemany pipelines, and ends with
        a flush request after its Sync: PostgreSQL, having read it, waits for the next
        statement with no idle_in_transaction_session_timeout armed, and a stall then
        would hold the rows locked for as long as it lasts. A plain statement arms it
        again (one round trip, on the writer only)."""
        if self.bounded and self.in_transaction:
            self.raw.execute("SELECT 1")

    def rowcounts(self, sql: str, seq: Iterable[Sequence[Any]]) -> list[int]:
        """Run one statement per parameter row, pipelined as ``executemany`` does, and
        say how many rows each changed (``db.rowcounts``: a fenced write checks each)."""
        rows = [tuple(p) for p in seq]
        if not rows:
            return []
        cursor = self.raw.cursor()
        # returning=True keeps each statement's result, so each has its own rowcount.
        cursor.executemany(translate(sql), rows, returning=True)  # type: ignore[arg-type]
        counts = [cursor.rowcount]
        while cursor.nextset():
            counts.append(cursor.rowcount)
        self._rearm()
        return counts

    @property
    def in_transaction(self) -> bool:
        return self.raw.info.transaction_status in (TransactionStatus.INTRANS,
                                                    TransactionStatus.INERROR)

    @property
    def usable(self) -> bool:
        """Whether the connection can still be used: not found broken, and, if it sits
        idle, not ended by the server meanwhile (a restart or failover of PostgreSQL
        leaves its farewell, an ErrorResponse, or the end of the stream unread on the
        socket). Seen here, without a round trip, the next write opens a new connection
        instead of failing on the old one with a 503."""
        if self.raw.closed or self.raw.broken:
            return False
        if self.raw.info.transaction_status != TransactionStatus.IDLE:
            return True
        return _still_open(self.raw.pgconn.socket)

    def close(self) -> None:
        self.raw.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        # As sqlite3's: the open transaction is committed, or rolled back on an error.
        if self.in_transaction:
            self.raw.execute("ROLLBACK" if kind is not None else "COMMIT")


def _still_open(fd: int) -> bool:
    """Whether an idle connection's socket has no farewell from the server waiting: nothing
    to read (the usual case, one poll), or a message an idle session may get (a notice,
    a parameter's new value, a notification) rather than an error or the end."""
    try:
        if not select.select([fd], [], [], 0)[0]:
            return True
        with socket.socket(fileno=os.dup(fd)) as sock:
            first = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return first not in (b"", b"E")


def _params(url: str) -> dict[str, Any]:
    """The connection settings the URL leaves to DEFAULTS. A malformed URL raises
    ProgrammingError here, before connecting: libpq would report a port that is not a
    number as a bad connection, which reads as a server that is down."""
    given = conninfo_to_dict(url)
    port = str(given.get("port", ""))
    if port and not all(p.strip().isdigit() for p in port.split(",")):
        raise psycopg.ProgrammingError(f"invalid URL: the port {port!r} is not a number")
    return {key: value for key, value in DEFAULTS.items() if key not in given}


def connect(url: str, *, readonly: bool = False, durability: str = "full",
            bound: float | None = None) -> Connection:
    """``bound``: the most seconds this connection's transactions wait for a lock another
    holds (``lock_timeout``), and may sit idle inside a transaction before PostgreSQL
    ends the session (``idle_in_transaction_session_timeout``). Rota's writer never
    idles in a transaction: one that does belongs to a server that stalled (a SIGSTOP, a
    starved machine), and its row locks would hold every other server's writer."""
    raw = psycopg.connect(url, autocommit=True, prepare_threshold=0, **_params(url))
    try:
        if bound is not None:
            ms = max(1, round(bound * 1000))
            raw.execute(f"SET lock_timeout = {ms}")
            raw.execute(f"SET idle_in_transaction_session_timeout = {ms}")
        if readonly:
            raw.execute("SET default_transaction_read_only = on")
        if durability == "process":
            # A commit is acknowledged before it is flushed: a crash of Rota loses
            # nothing, one of PostgreSQL or its machine may lose the last commits (as
            # --durability process does on SQLite). The database stays consistent.
            raw.execute("SET synchronous_commit = off")
        elif raw.execute("SHOW synchronous_commit").fetchone() == ("off",):  # type: ignore[union-attr]
            # full: an acknowledged commit is flushed. The server's own setting stands
            # when it promises that or more (on, remote_write, remote_apply); off does not.
            raw.execute("SET synchronous_commit = on")
    except BaseException:
        raw.close()
        raise
    return Connection(raw, bounded=bound is not None)


# -- the server going away --------------------------------------------------------------
# SQLSTATE classes and codes that blame the database server rather than the statement:
# (code, sentence, seconds to wait), as rota/db.py's STORAGE_ERRORS for SQLite.
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


def used_bytes(conn: Connection) -> int:
    """What the database takes on the server's disk (a --max-db-size quota is kept by
    refusing new jobs, as on SQLite; PostgreSQL has no hard limit of its own)."""
    return int(conn.execute("SELECT pg_database_size(current_database())").fetchone()[0])


# -- the store's threads ----------------------------------------------------------------
class Writer(db.Writer):
    """rota/db.py's writer (group commit, a savepoint per op) on a PostgreSQL connection,
    opened again after the server went away. ``bound``: see ``connect`` (rota/store.py
    gives a quarter of the server lease: a server stalled inside a transaction holds the
    others' writers that long at most, and their leases outlast it)."""

    bound: float | None = None

    def _open(self) -> Connection:
        conn = connect(self._path, durability=self._durability, bound=self.bound)
        if self.max_bytes is not None:
            self.used_bytes = used_bytes(conn)
        return conn

    def _usable(self, conn: Any) -> bool:
        return bool(conn.usable)

    def _classify(self, exc: BaseException) -> StorageError | None:
        return storage_error(exc)

    def _measure(self, conn: Any) -> int:
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


AGAIN = frozenset({"40P01", "40001"})  # deadlock_detected, serialization_failure
LOCKED = "55P03"  # lock_not_available: lock_timeout ran out


class Readers(db.Readers):
    """rota/db.py's reader pool on read-only PostgreSQL connections (``size`` of them:
    --db-pool)."""

    def _open(self) -> Connection:
        return connect(self._path, readonly=True)

    def _usable(self, conn: Any) -> bool:
        return bool(conn.usable)

    def _classify(self, exc: BaseException) -> StorageError | None:
        return storage_error(exc)


# -- the schema -------------------------------------------------------------------------
TYPES = {"TEXT": 'TEXT COLLATE "C"', "INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION"}
# Text compares as bytes, as in SQLite (the id prefix search of rota/lookup.py needs it),
# whatever the database's locale: COLLATE "C" on every text column.


def _column(table: schema.Table, column: schema.Column) -> str:
    kind = TYPES[column.type]
    if table.pk == (column.name,) and column.type == "INTEGER":
        # SQLite's INTEGER PRIMARY KEY numbers new rows itself. BY DEFAULT: rows copied
        # from an SQLite file may keep their numbers.
        kind += " GENERATED BY DEFAULT AS IDENTITY"
    if column.not_null:
        kind += " NOT NULL"
    if column.default is not None:
        kind += f" DEFAULT {column.default}"
    return f"{column.name} {kind}"


def ddl() -> list[str]:
    """Statements that bring a PostgreSQL database to the description (rota/schema.py),
    each a no-op where it is there already: tables, then columns a newer description
    added, then indexes, then the functions translated SQL calls."""
    statements = []
    for table in schema.TABLES:
        columns = [_column(table, c) for c in table.columns]
        if table.rowid:  # the insertion order SQL names rowid (rota/schema.py)
            columns.insert(0, "rowid BIGINT GENERATED BY DEFAULT AS IDENTITY UNIQUE")
        columns.append(f"PRIMARY KEY ({', '.join(table.pk)})")
        statements.append(f"CREATE TABLE IF NOT EXISTS {table.name} ({', '.join(columns)})")
        statements += [f"ALTER TABLE {table.name} ADD COLUMN IF NOT EXISTS"
                       f" {_column(table, c)}" for c in table.columns if c.name not in table.pk]
    for index in schema.INDEXES:
        where = f" WHERE {index.where}" if index.where else ""
        statements.append(f"CREATE INDEX IF NOT EXISTS {index.name} ON {index.table}"
                          f" ({', '.join(index.columns)}){where}")
    statements.append(
        "CREATE OR REPLACE FUNCTION rota_json_append(list TEXT, item TEXT) RETURNS TEXT"
        " LANGUAGE sql IMMUTABLE AS $$ SELECT CASE WHEN list IS NULL THEN NULL"
        " WHEN list = '[]' THEN '[' || item || ']'"
        " ELSE left(list, -1) || ',' || item || ']' END $$")
    return statements


def migrate(url: str) -> None:
    """Bring the database to this Rota's schema, recording the same migration names as
    SQLite's; refuse one a newer Rota migrated (db.NewerDatabase). Several servers
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
            raise db.NewerDatabase(redact(url), unknown, db._version(), by[0] if by else None)
        pending = [name for name in schema.MIGRATIONS if name not in applied]
        if pending:
            for statement in ddl():  # PostgreSQL's own SQL: not translated
                conn.raw.execute(statement)
            now = time.time()
            conn.executemany(f"INSERT INTO {MIGRATIONS_TABLE} (name, applied_at) VALUES (?, ?)",
                             [(name, now) for name in pending])
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('migrated_by', ?)",
                         (db._version(),))
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
                                                             **_params(self.url))
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
