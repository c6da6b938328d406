"""Jobs found by an operator's filter (rota/listing.py), read from SQLite: the queries
behind ``GET /jobs``, its counts and the bulk actions. Functions of a connection; the
store runs them on its readers.

Every query is served by an index and reads only what a page needs, with 1,000,000 jobs
in the table (bench/listing.py measures it):

- no filter: the table itself, newest row id first;
- a state, or a spec, queue or worker: one query per state (all seven when none is
  given), each walking ``(state)``, ``(state, spec)``, ``(state, queue)`` or the partial
  ``(state, worker_id)`` newest first, merged (``listing.merge_newest``). SQLite cannot
  walk an ``IN`` list of states in row id order, and would sort every match instead;
- ``q`` (error text): examines at most ``MAX_SCAN`` rows per state query (or of the
  table, with no other filter), newest first, within the other filters. A page that
  ends at that bound may hold fewer jobs than asked (even none) and still give a
  ``next_cursor``: the search goes on from there.
  A ``q`` that some job's id starts with (within the other filters) is an id prefix
  instead, looked up in the primary key (at most ``MAX_SCAN`` ids).
"""

from __future__ import annotations

import sqlite3
from typing import Any

from rota.listing import JobFilter, encode_cursor, merge_newest
from rota.model import JOB_STATES

MAX_SCAN = 10_000  # rows examined per state query for a q search
COUNT_CAP = 100_000  # a count stops here: count_jobs says "at least"
NO_CURSOR = 2**63 - 1
Page = list[tuple[int, dict[str, Any]]]


def _where(flt: JobFilter, state: str | None, plain: str = "") -> tuple[list[str], list[Any]]:
    """Terms for the filter's fields but ``q`` (``plain="+"``: none of them may pick the
    index, for a query that must walk the primary key)."""
    terms: list[str] = []
    params: list[Any] = []
    for column, value in (("state", state), ("spec", flt.spec), ("queue", flt.queue),
                          ("worker_id", flt.worker)):
        if value is not None:
            terms.append(f"{plain}{column} = ?")
            params.append(value)
    return terms, params


def _states(flt: JobFilter) -> list[str | None]:
    if flt.states:
        return list(flt.states)
    if flt.spec or flt.queue or flt.worker:
        return list(JOB_STATES)  # the indexes all lead with state
    return [None]  # the table itself, newest row first


def page(conn: sqlite3.Connection, flt: JobFilter, limit: int, before: int | None,
         columns: str = "*") -> tuple[Page, str | None]:
    """Up to ``limit`` matching rows older than row id ``before`` (None: the newest),
    newest first, and the cursor of the next page (None: there is none)."""
    before = NO_CURSOR if before is None else before
    if flt.q is not None and (by_id := _by_id(conn, flt, limit, before, columns)) is not None:
        return by_id
    pages: list[Page] = []
    boundary = 0  # the scans examined every row above this (q only)
    for state in _states(flt):
        terms, params = _where(flt, state)
        terms.append("rowid < ?")
        params.append(before)
        where = " AND ".join(terms)
        if flt.q is None:
            sql = (f"SELECT rowid AS rowid_, {columns} FROM jobs WHERE {where}"
                   " ORDER BY rowid DESC LIMIT ?")
            pages.append(_read(conn, sql, [*params, limit + 1]))
            continue
        # The error text: a bounded walk newest first (lower(): a case-blind search), and
        # where the walk stopped, if it was stopped by its bound.
        sql = (f"SELECT rowid_, {columns} FROM (SELECT rowid AS rowid_, * FROM jobs"
               f" WHERE {where} ORDER BY rowid DESC LIMIT ?)"
               " WHERE instr(lower(errors), lower(?)) > 0 LIMIT ?")
        pages.append(_read(conn, sql, [*params, MAX_SCAN, flt.q, limit + 1]))
        last = conn.execute(f"SELECT rowid FROM jobs WHERE {where} ORDER BY rowid DESC"
                            " LIMIT 1 OFFSET ?", [*params, MAX_SCAN - 1]).fetchone()
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
    """Matching jobs, at most COUNT_CAP. With ``q``, those within the bounded search."""
    if flt.q is not None:
        rows, _ = page(conn, flt, COUNT_CAP, None, "id")
        return len(rows)
    total = 0
    for state in _states(flt):
        terms, params = _where(flt, state)
        where = f" WHERE {' AND '.join(terms)}" if terms else ""
        total += conn.execute(f"SELECT count(*) FROM (SELECT 1 FROM jobs{where} LIMIT ?)",
                              [*params, COUNT_CAP - total]).fetchone()[0]
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
    queue = ""
    while True:  # the next queue in the (state, queue) index: a seek, not a walk
        found = conn.execute("SELECT queue FROM jobs WHERE state = 'available' AND queue > ?"
                             " ORDER BY queue LIMIT 1", (queue,)).fetchone()
        if found is None:
            return ages
        queue = found[0]
        row = conn.execute("SELECT enqueued_at, run_at FROM jobs WHERE state = 'available'"
                           " AND queue = ? ORDER BY rowid LIMIT 1", (queue,)).fetchone()
        ages[queue] = round(max(0.0, now - max(row[0], row[1] or 0.0)), 3)
