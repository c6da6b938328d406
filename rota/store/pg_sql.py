"""PostgreSQL's SQL, made from SQLite's: pure text in, text out.

The store's operations (rota/store/writes.py, rota/store/rows.py, rota/store/lookup.py, rota/store/fleet.py)
are written once, in SQLite's SQL. ``translate`` rewrites each statement for PostgreSQL
(``?`` placeholders, SQLite's scalar MAX, INSERT OR IGNORE / OR REPLACE, index hints,
...), once per statement text; rota/store/pg_connection.py runs what it gives. ``ddl`` makes
the statements that bring a PostgreSQL database to the schema's description
(rota/store/schema.py). tests/unit/test_pg_translate.py checks each rule.

PostgreSQL prepares every statement (rota/store/pg_connection.py), so it must tell each
parameter's type from its place, which SQLite never asks: ``translate`` gives a bare
``? IS NULL`` a type, and new SQL must not leave a parameter with nothing around it to
type it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from rota.store import schema


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
    # SQLite's time now, in seconds since the epoch (rota/store/fleet.py's DB_NOW): the
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


# -- the schema -------------------------------------------------------------------------
TYPES = {"TEXT": 'TEXT COLLATE "C"', "INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION"}
# Text compares as bytes, as in SQLite (the id prefix search of rota/store/lookup.py needs it),
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
    """Statements that bring a PostgreSQL database to the description (rota/store/schema.py),
    each a no-op where it is there already: tables, then columns a newer description
    added, then indexes, then the functions translated SQL calls."""
    statements = []
    for table in schema.TABLES:
        columns = [_column(table, c) for c in table.columns]
        if table.rowid:  # the insertion order SQL names rowid (rota/store/schema.py)
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
