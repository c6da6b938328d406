"""Jobs found by an operator's filter (rota/core/listing.py), read from SQLite: the queries
behind ``GET /jobs``, its counts and the bulk actions. Functions of a connection; the
store runs them on its readers.

Every query reads only what a page needs, with 1,000,000 jobs in the table
(bench/listing.py measures it), and the indexes it needs cost the hot path as little
as they can: every job is inserted ``available``, reserved ``active`` and finished, so
m011's indexes are partial, leaving out those two states (an enqueue and a reservation
touch none of them):

- no filter: the table itself, newest row id first;
- otherwise one walk per state (all seven when none is given), newest first, merged
  (``listing.merge_newest``): SQLite cannot walk an ``IN`` list of states in row id
  order, and would sort every match instead. The state is written into the SQL, from
  the fixed list, so that SQLite may use a partial index for it;
- a finished, scheduled or retryable state: ``(state)``, ``(state, spec)`` or
  ``(state, worker_id)`` (partial), or m001's ``(state, queue)``;
- ``active``: few rows (the fleet's slots), read whole;
- a ``schedule``'s jobs, in any state: m018's ``(schedule, state)`` (partial);
- ``available``: ``(state, queue)``, one walk per queue (found by seeks). A ``spec``
  there is checked row by row: like ``q``, a bounded walk;
- a bounded walk examines at most ``MAX_SCAN`` rows per page. A page that ends at that
  bound may hold fewer jobs than asked (even none) and still give a ``next_cursor``:
  the search goes on from there. ``q`` is such a filter (error text), unless some job's
  id starts with it: then it is an id prefix, looked up in the primary key.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from typing import Any, NamedTuple

from rota.core.listing import JobFilter, decode_cursor, encode_cursor, merge_newest
from rota.core.model import JOB_STATES

MAX_SCAN = 10_000  # rows a bounded walk examines per page
COUNT_CAP = 100_000  # a count stops here: count_jobs says "at least"
NO_CURSOR = 2**63 - 1
HOT = ("available", "active")  # every job passes through them: no index of m011's
Page = list[tuple[int, dict[str, Any]]]


class Walk(NamedTuple):
    """One index walk, newest first: ``where`` picks the rows walked (from ``source``);
    ``check`` (if any) is tested row by row on at most MAX_SCAN of them."""

    source: str
    where: str
    params: list[Any]
    check: str = ""
    check_params: list[Any] = []


# The partial indexes' condition, repeated word for word in a query that uses them:
# SQLite proves a partial index usable only from terms of the query itself.
COLD = "state NOT IN ('available', 'active')"


def _cold_index(flt: JobFilter) -> str:
    """The index for a walk of one cold state: named, so that the planner (which has no
    statistics) cannot prefer (state, finished_at) and sort every row of the state."""
    if flt.worker is not None:
        return "idx_jobs_state_worker"
    if flt.spec is not None:
        return "idx_jobs_state_spec"
    return "idx_jobs_state_queue" if flt.queue is not None else "idx_jobs_state"


def _where(flt: JobFilter, state: str | None, plain: str = "") -> tuple[list[str], list[Any]]:
    """Terms for the filter's fields but ``q`` (``plain="+"``: none of them may pick the
    index, for a query that must walk the primary key)."""
    terms: list[str] = []
    params: list[Any] = []
    for column, value in (("state", state), ("spec", flt.spec), ("queue", flt.queue),
                          ("worker_id", flt.worker), ("schedule", flt.schedule)):
        if value is not None:
            terms.append(f"{plain}{column} = ?")
            params.append(value)
    return terms, params


def _walks(conn: sqlite3.Connection, flt: JobFilter) -> Iterator[Walk]:
    text = ("instr(lower(errors), lower(?)) > 0", [flt.q]) if flt.q is not None else ("", [])
    states: list[str | None] = list(flt.states)
    if not states:
        states = (list(JOB_STATES) if flt.spec or flt.queue or flt.worker or flt.schedule
                  else [None])
    for state in states:
        if state is None:  # the table itself
            yield Walk("jobs", "1", [], *text)
            continue
        assert state in JOB_STATES  # written into the SQL: only the fixed names
        terms, params = _where(flt, None)
        if flt.schedule is not None:  # a schedule's jobs: m018's (schedule, state), any state
            yield Walk("jobs INDEXED BY idx_jobs_schedule",
                       " AND ".join([f"state = '{state}'", "schedule IS NOT NULL", *terms]),
                       params, *text)
            continue
        if state == "active":  # few: the fleet's slots
            yield Walk("jobs", " AND ".join(["state = 'active'", *terms]), params, *text)
            continue
        if state != "available":
            yield Walk(f"jobs INDEXED BY {_cold_index(flt)}",
                       " AND ".join([f"state = '{state}'", COLD, *terms]), params, *text)
            continue
        if flt.worker is not None:
            continue  # a waiting job belongs to no worker
        checks, check_params = [], []
        if flt.spec is not None:
            checks.append("spec = ?")
            check_params.append(flt.spec)
        if text[0]:
            checks.append(text[0])
            check_params += text[1]
        for queue in [flt.queue] if flt.queue is not None else queues(conn, state):
            yield Walk("jobs INDEXED BY idx_jobs_state_queue",
                       "state = 'available' AND queue = ?", [queue], " AND ".join(checks),
                       check_params)


def queues(conn: sqlite3.Connection, state: str) -> list[str]:
    """The queues with jobs in ``state``: one seek each in the (state, queue) index."""
    found: list[str] = []
    while True:
        row = conn.execute("SELECT queue FROM jobs WHERE state = ? AND queue > ?"
                           " ORDER BY queue LIMIT 1", (state, found[-1] if found else "")
                           ).fetchone()
        if row is None:
            return found
        found.append(row[0])


def page(conn: sqlite3.Connection, flt: JobFilter, limit: int, before: int | None,
         columns: str = "*") -> tuple[Page, str | None]:
    """Up to ``limit`` matching rows older than row id ``before`` (None: the newest),
    newest first, and the cursor of the next page (None: there is none)."""
    before = NO_CURSOR if before is None else before
    if flt.q is not None and (by_id := _by_id(conn, flt, limit, before, columns)) is not None:
        return by_id
    pages: list[Page] = []
    boundary = 0  # the bounded walks examined every row above this
    for walk in _walks(conn, flt):
        where = f"{walk.where} AND rowid < ?"
        params = [*walk.params, before]
        if not walk.check:
            sql = (f"SELECT rowid AS rowid_, {columns} FROM {walk.source} WHERE {where}"
                   " ORDER BY rowid DESC LIMIT ?")
            pages.append(_read(conn, sql, [*params, limit + 1]))
            continue
        sql = (f"SELECT rowid_, {columns} FROM (SELECT rowid AS rowid_, * FROM {walk.source}"
               f" WHERE {where} ORDER BY rowid DESC LIMIT ?) WHERE {walk.check} LIMIT ?")
        pages.append(_read(conn, sql, [*params, MAX_SCAN, *walk.check_params, limit + 1]))
        last = conn.execute(f"SELECT rowid FROM {walk.source} WHERE {where}"
                            " ORDER BY rowid DESC LIMIT 1 OFFSET ?",
                            [*params, MAX_SCAN - 1]).fetchone()
        if last is not None:
            boundary = max(boundary, last[0])
    found = [(r, row) for r, row in merge_newest(pages, limit + 1) if r >= boundary]
    if len(found) > limit:
        return found[:limit], encode_cursor(found[limit - 1][0])
    if boundary:
        return found, encode_cursor(boundary)
    return found, None


def _by_id(conn: sqlite3.Connection, flt: JobFilter, limit: int, before: int,
           columns: str) -> tuple[Page, str | None] | None:
    """``q`` as an id prefix, if any job within the other filters has an id that starts
    with it (else None: ``q`` is error text). The ids come from the primary key (ids sort
    as bytes, and every character an id may hold is below 0x7f), at most MAX_SCAN of
    them; the other filters must not pick another index (the ``+``)."""
    assert flt.q is not None
    terms, params = _where(flt, None, plain="+")
    if flt.states:
        terms.append(f"+state IN ({', '.join('?' * len(flt.states))})")
        params += flt.states
    where = "".join(f" AND {term}" for term in terms)
    ids = [flt.q, flt.q + "\x7f", *params]
    if conn.execute(f"SELECT 1 FROM jobs WHERE id >= ? AND id < ?{where} LIMIT 1",
                    ids).fetchone() is None:
        return None
    sql = (f"SELECT rowid_, {columns} FROM (SELECT rowid AS rowid_, * FROM jobs"
           f" WHERE id >= ? AND id < ?{where} LIMIT ?) WHERE rowid_ < ?"
           " ORDER BY rowid_ DESC LIMIT ?")
    found = _read(conn, sql, [*ids, MAX_SCAN, before, limit + 1])
    if len(found) > limit:
        return found[:limit], encode_cursor(found[limit - 1][0])
    return found, None


def _read(conn: sqlite3.Connection, sql: str, params: list[Any]) -> Page:
    rows = conn.execute(sql, params)
    out = []
    for row in rows:
        item = dict(row)
        out.append((item.pop("rowid_"), item))
    return out


def count(conn: sqlite3.Connection, flt: JobFilter) -> int:
    """Matching jobs, at most COUNT_CAP. With a bounded walk (``q``, or a ``spec`` of
    available jobs), those within its bound."""
    total = 0
    for walk in _walks(conn, flt):
        if walk.check:
            rows, _ = page(conn, flt, COUNT_CAP, None, "id")
            return len(rows)
        total += conn.execute(f"SELECT count(*) FROM (SELECT 1 FROM {walk.source}"
                              f" WHERE {walk.where} LIMIT ?)",
                              [*walk.params, COUNT_CAP - total]).fetchone()[0]
        if total >= COUNT_CAP:
            break
    return total


def state_counts(conn: sqlite3.Connection) -> dict[str, int]:
    """Jobs per state, every state named (the ``(state)`` index, no table rows)."""
    counts = dict.fromkeys(JOB_STATES, 0)
    for state, n in conn.execute("SELECT state, count(*) FROM jobs GROUP BY state"):
        counts[state] = n
    return counts


def oldest_available(conn: sqlite3.Connection, now: float) -> dict[str, float | None]:
    """Per queue with jobs, the seconds the longest-waiting available job has waited:
    the first by enqueue order, from when it became due (its run_at) or was enqueued.
    One index probe per queue."""
    ages: dict[str, float | None] = {}
    for queue in queues(conn, "available"):
        row = conn.execute("SELECT enqueued_at, run_at FROM jobs WHERE state = 'available'"
                           " AND queue = ? ORDER BY rowid LIMIT 1", (queue,)).fetchone()
        if row is None:
            # Each statement reads its own snapshot: the queue's last available job was
            # taken between the two reads, so nothing in it waits any more.
            continue
        ages[queue] = round(max(0.0, now - max(row[0], row[1] or 0.0)), 3)
    return ages


def match(conn: sqlite3.Connection, flt: JobFilter, limit: int, pages: int
          ) -> tuple[list[tuple[str, str]], bool]:
    """``Store.match_jobs``: (id, state) of up to ``limit + 1`` matching jobs, newest
    first, and whether ``pages`` scans stopped with rows left unexamined."""
    found: list[tuple[str, str]] = []
    before = None
    for _ in range(pages):
        rows, cursor = page(conn, flt, limit + 1 - len(found), before, "id, state")
        found += [(row["id"], row["state"]) for _, row in rows]
        if cursor is None or len(found) > limit:
            return found[:limit + 1], False
        before = decode_cursor(cursor)
    return found, True
