"""Flow control in the database: the limits set at runtime, the rate starts kept across restarts, and the guard that holds limits exactly across servers sharing PostgreSQL.

SQL on a connection, run by the store's writer or readers (rota/store/store.py). The guard
runs inside a reservation's transaction: on PostgreSQL it takes a transaction-scoped
advisory lock per limit and key (in one sorted order, so two servers never wait on each
other in a cycle), counts the scope's reserved rows and its starts in the window as
committed (another server's reservation of the same key waited for the lock, so it is
counted), and refuses what would pass a limit. On SQLite one server holds every
reservation, and its memory is exact: only the starts are recorded.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import msgspec

from rota.base.flow import MAX_PERIOD
from rota.core.effects import Guard
from rota.store import fleet

Item = str | int  # a whole job's id, or a claim's seq


# -- the runtime table (PUT / DELETE /limits/{kind}/{name}) ----------------------------------
def read_limits(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    """Every limit set at runtime: kind, name, rule (JSON), updated_at, updated_by."""
    return [dict(row) for row in conn.execute(
        "SELECT kind, name, rule, updated_at, updated_by FROM limits ORDER BY kind, name")]


def set_limit(conn: sqlite3.Connection, kind: str, name: str, rule: str, now: float,
              by: str | None) -> None:
    conn.execute("INSERT INTO limits (kind, name, rule, updated_at, updated_by)"
                 " VALUES (?, ?, ?, ?, ?) ON CONFLICT(kind, name) DO UPDATE SET"
                 " rule = excluded.rule, updated_at = excluded.updated_at,"
                 " updated_by = excluded.updated_by", (kind, name, rule, now, by))


def clear_limit(conn: sqlite3.Connection, kind: str, name: str) -> bool:
    """Delete the runtime rule of a scope; whether there was one."""
    return conn.execute("DELETE FROM limits WHERE kind = ? AND name = ?",
                        (kind, name)).rowcount > 0


def change(conn: sqlite3.Connection, kind: str, name: str, rule: str | None, now: float,
           by: str | None, server_id: str | None) -> bool:
    """``Store.set_limit``: set the scope's rule (JSON), or clear it (None); whether a
    rule changed. ``server_id``: one of several servers, which tell the others."""
    if rule is not None:
        set_limit(conn, kind, name, rule, now, by)
    elif not clear_limit(conn, kind, name):
        return False
    if server_id is not None:
        fleet.notify(conn, fleet.LIMITS, server_id, [f"{kind}:{name}"])
    return True


# -- rate starts -----------------------------------------------------------------------------
def read_starts(conn: sqlite3.Connection, now: float) -> dict[tuple[str, str | None], list[float]]:
    """The starts recorded within the longest window (a day), oldest first, by (limit
    name, key: None for the scope's own): what a restart's rate windows hold."""
    starts: dict[tuple[str, str | None], list[float]] = {}
    cursor = conn.execute("SELECT name, key, at FROM limit_starts WHERE at > ? ORDER BY at",
                          (now - MAX_PERIOD,))
    cursor.row_factory = None
    for name, key, at in cursor:
        starts.setdefault((name, key or None), []).append(at)
    return starts


def record_starts(conn: sqlite3.Connection, started: Sequence[Guard], now: float) -> None:
    """One start per rate guard of each reservation made, and the starts of those limits
    past their window deleted (a restart reads back only what a window may count)."""
    rated = [g for g in started if g.rate is not None]
    if not rated:
        return
    conn.executemany("INSERT INTO limit_starts (name, key, at) VALUES (?, ?, ?)",
                     [(g.name, g.key or "", now) for g in rated])
    longest: dict[tuple[str, str], float] = {}
    for g in rated:
        assert g.rate is not None
        scope = (g.name, g.key or "")
        longest[scope] = max(longest.get(scope, 0.0), g.rate.period)
    conn.executemany("DELETE FROM limit_starts WHERE name = ? AND key = ? AND at <= ?",
                     [(name, key, now - period) for (name, key), period in longest.items()])


def replace_starts(conn: sqlite3.Connection,
                   starts: Mapping[tuple[str, str | None], Sequence[float]]) -> None:
    """The recorded starts made again from the server's own windows (one server per
    file), after its wall clock stepped: a restart reads them on the clock as it is."""
    conn.execute("DELETE FROM limit_starts")
    conn.executemany("INSERT INTO limit_starts (name, key, at) VALUES (?, ?, ?)",
                     [(name, key or "", at) for (name, key), times in starts.items()
                      for at in times])


def prune_starts(conn: sqlite3.Connection, now: float) -> None:
    """Forget starts older than any window (those of limits no longer set, too)."""
    conn.execute("DELETE FROM limit_starts WHERE at <= ?", (now - MAX_PERIOD,))


# -- the guard -------------------------------------------------------------------------------
def lock_id(name: str, key: str | None) -> int:
    """The advisory lock of a limit and key: 64 bits of a hash every server computes alike."""
    digest = hashlib.sha256(f"{name}\0{key or ''}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _running(conn: sqlite3.Connection, name: str, key: str | None) -> int:
    kind, scope = name.split(":", 1)
    column = "spec" if kind == "spec" else "queue"
    sql = f"SELECT count(*) FROM jobs WHERE state = 'active' AND {column} = ?"
    args: tuple[Any, ...] = (scope,)
    if key is not None:
        sql, args = sql + " AND concurrency_key = ?", (scope, key)
    return int(conn.execute(sql, args).fetchone()[0])


def _keys_running(conn: sqlite3.Connection, name: str, keys: list[str]) -> dict[str, int]:
    """The active jobs of each of ``keys`` within a limit's scope: one query for a
    round's keys (in hundreds), not one each."""
    kind, scope = name.split(":", 1)
    column = "spec" if kind == "spec" else "queue"
    counts: dict[str, int] = {}
    for start in range(0, len(keys), 500):
        some = keys[start:start + 500]
        marks = ", ".join("?" * len(some))
        for key, n in conn.execute(
                f"SELECT concurrency_key, count(*) FROM jobs WHERE state = 'active' AND"
                f" {column} = ? AND concurrency_key IN ({marks}) GROUP BY concurrency_key",
                (scope, *some)):
            counts[key] = int(n)
    return counts


def _count_starts(conn: sqlite3.Connection, name: str, key: str | None, since: float) -> int:
    return int(conn.execute("SELECT count(*) FROM limit_starts WHERE name = ? AND key = ?"
                            " AND at > ?", (name, key or "", since)).fetchone()[0])


def _starts(conn: sqlite3.Connection, name: str, key: str | None, since: float) -> list[float]:
    cursor = conn.execute("SELECT at FROM limit_starts WHERE name = ? AND key = ? AND at > ?"
                          " ORDER BY at", (name, key or "", since))
    cursor.row_factory = None
    return [at for (at,) in cursor]


class Room:
    """One limit and key as the database holds it: the scope's reserved jobs and its
    starts in the window, and whether one more reservation fits now.

    A rate holds at most ``limit`` starts in any window of ``period``; a burst below the
    limit also spaces them: ``burst`` back to back, then one per period / limit (the
    generic cell rate algorithm: a start may come once the theoretical arrival time,
    less the burst's tolerance, is reached)."""

    def __init__(self, conn: sqlite3.Connection, guard: Guard, now: float,
                 running: int | None = None) -> None:
        self.guard = guard
        self.running = (None if guard.concurrency is None
                        else running if running is not None
                        else _running(conn, guard.name, guard.key))
        rate = guard.rate
        self.spaced = rate is not None and rate.burst is not None and rate.burst < rate.limit
        self.due = float("-inf")  # the theoretical arrival time of the next start
        # Starts in the window: counted, or, for a spaced rate, read to replay the spacing
        # (a count is all the window needs: a rate of 5,000/h reads one number, not 5,000).
        self.count = 0
        if rate is not None and self.spaced:
            starts = _starts(conn, guard.name, guard.key, now - rate.period)
            self.count = len(starts)
            for at in starts:
                self._spaced(at)
        elif rate is not None:
            self.count = _count_starts(conn, guard.name, guard.key, now - rate.period)

    def _spaced(self, at: float) -> None:
        rate = self.guard.rate
        if rate is not None and self.spaced:
            self.due = max(self.due, at) + rate.period / rate.limit

    def fits(self, now: float) -> bool:
        guard, rate = self.guard, self.guard.rate
        if guard.concurrency is not None and (self.running or 0) >= guard.concurrency:
            return False
        if rate is None:
            return True
        if self.count >= rate.limit:
            return False
        tolerance = ((rate.burst or rate.limit) - 1) * rate.period / rate.limit
        return now >= self.due - tolerance - 1e-9

    def take(self, now: float) -> None:
        if self.running is not None:
            self.running += 1
        if self.guard.rate is not None:
            self.count += 1
            self._spaced(now)


def guard(conn: sqlite3.Connection, guards: Mapping[Item, tuple[Guard, ...]],
          order: Sequence[Item], now: float
          ) -> tuple[frozenset[Item], frozenset[tuple[str, str | None]], float]:
    """PostgreSQL, in a reservation's transaction: lock each limit and key the
    reservation counts against, and refuse the items, in ``order`` (the engine's: best
    first), that would take one past its limit as the database holds it. Returns them,
    the limits (name, key) found full, and the moment the starts were judged at: once
    the locks are held (a wait for another server's commit may take seconds, and the
    starts are made when this commit lands, not when the round was planned)."""
    if not guards:
        return frozenset(), frozenset(), now
    distinct = {(g.name, g.key): g for gs in guards.values() for g in gs}
    for name, key in sorted(distinct, key=lambda s: (s[0], s[1] or "")):
        conn.execute("SELECT pg_advisory_xact_lock(?)", (lock_id(name, key),))
    now = max(now, time.time())
    # The keys' active jobs, counted per limit in one query (the keys a round holds).
    keyed: dict[str, list[str]] = {}
    for (name, key), g in distinct.items():
        if key is not None and g.concurrency is not None:
            keyed.setdefault(name, []).append(key)
    counted = {(name, key) for name, keys in keyed.items() for key in keys}
    running = {(name, key): n for name, keys in keyed.items()
               for key, n in _keys_running(conn, name, keys).items()}
    rooms = {scope: Room(conn, g, now, running.get(scope, 0) if scope in counted else None)
             for scope, g in distinct.items()}
    refused: set[Item] = set()
    full: set[tuple[str, str | None]] = set()
    for item in order:
        held = [rooms[(g.name, g.key)] for g in guards.get(item, ())]
        short = [room for room in held if not room.fits(now)]
        if not short:
            for room in held:
                room.take(now)
        else:
            refused.add(item)
            full.update((room.guard.name, room.guard.key) for room in short)
    return frozenset(refused), frozenset(full), now


def started(guards: Mapping[Item, tuple[Guard, ...]], made: Collection[Item]) -> list[Guard]:
    """The guards of the reservations ``made``, one per start."""
    return [g for item in made for g in guards.get(item, ())]


def rule_text(rule: Any) -> str:
    """A rule as its column keeps it: JSON, defaults left out."""
    return msgspec.json.encode(rule).decode()
