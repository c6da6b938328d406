"""A PostgreSQL connection that acts as sqlite3's does, for what the store uses.

``TranslatingConnection``/``Cursor``/``Row`` act as sqlite3's do (``execute``, ``executemany``,
``in_transaction``, rows read by index or name, ``cursor.row_factory = None`` for plain
tuples), and run SQLite's SQL, each statement translated (rota/store/pg_sql.py).

The driver is psycopg 3, its sync connections (the writer's and readers' threads: the
model of rota/store/writer.py, so nothing differs but the connection). Parameters are bound
by the server, and every statement is prepared on its first use
(``prepare_threshold=0``): the store's statements come from a few templates, and a
prepared one costs half the time of one sent whole (measured: 6,000 single-row enqueue
INSERTs in 1.8 s against 3.7 s bound on the client). (A PgBouncer in front must be 1.21
or newer, in transaction mode, with ``max_prepared_statements`` set.)
"""

from __future__ import annotations

import os
import select
import socket
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus

from rota.store.pg_sql import translate

# Connection settings unless the URL says otherwise: a server that does not answer is
# found out in seconds (the store degrades and says so) rather than when the kernel
# gives up on TCP, minutes later.
DEFAULTS = {"connect_timeout": "5", "keepalives": "1", "keepalives_idle": "5",
            "keepalives_interval": "2", "keepalives_count": "3", "tcp_user_timeout": "10000",
            "application_name": "rota"}


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


class TranslatingConnection:
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
        say how many rows each changed (``sqlite.rowcounts``: a fenced write checks each)."""
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

    def __enter__(self) -> TranslatingConnection:
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


def connect_params(url: str) -> dict[str, Any]:
    """The connection settings the URL leaves to DEFAULTS. A malformed URL raises
    ProgrammingError here, before connecting: libpq would report a port that is not a
    number as a bad connection, which reads as a server that is down."""
    given = conninfo_to_dict(url)
    port = str(given.get("port", ""))
    if port and not all(p.strip().isdigit() for p in port.split(",")):
        raise psycopg.ProgrammingError(f"invalid URL: the port {port!r} is not a number")
    return {key: value for key, value in DEFAULTS.items() if key not in given}


def connect(url: str, *, readonly: bool = False, durability: str = "full",
            bound: float | None = None) -> TranslatingConnection:
    """``bound``: the most seconds this connection's transactions wait for a lock another
    holds (``lock_timeout``), and may sit idle inside a transaction before PostgreSQL
    ends the session (``idle_in_transaction_session_timeout``). Rota's writer never
    idles in a transaction: one that does belongs to a server that stalled (a SIGSTOP, a
    starved machine), and its row locks would hold every other server's writer."""
    raw = psycopg.connect(url, autocommit=True, prepare_threshold=0, **connect_params(url))
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
    return TranslatingConnection(raw, bounded=bound is not None)

