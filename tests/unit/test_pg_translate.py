"""rota/store/pg_sql.py: SQLite's SQL as PostgreSQL runs it, and the schema's DDL; text in,
text out, with no database (tests/store/test_pg.py runs the results on a real PostgreSQL)."""

from __future__ import annotations

import pytest

from rota.store import fleet, schema
from rota.store.pg_sql import ddl, translate


# -- translate(), one rule at a time ------------------------------------------------------
def test_placeholders_become_psycopg_s_and_a_percent_is_doubled() -> None:
    assert translate("SELECT 100 % 7 FROM t WHERE a = ? AND b = '?'") == \
        "SELECT 100 %% 7 FROM t WHERE a = %s AND b = '?'"


def test_begin_immediate_is_begin() -> None:
    assert translate("BEGIN IMMEDIATE") == "BEGIN"


def test_index_hints_are_dropped() -> None:
    assert translate("SELECT id FROM jobs INDEXED BY idx_jobs_state WHERE state = 'x'") == \
        "SELECT id FROM jobs WHERE state = 'x'"


def test_a_unary_plus_before_a_column_is_dropped_and_addition_stays() -> None:
    assert translate("UPDATE t SET a = ? + b WHERE rowid = ? AND +state = 'a'") == \
        "UPDATE t SET a = %s + b WHERE rowid = %s AND state = 'a'"
    assert translate("SELECT (-priority << 40) + rowid FROM jobs WHERE (+spec = ?)") == \
        "SELECT (-priority << 40) + rowid FROM jobs WHERE (spec = %s)"


def test_a_scalar_max_or_min_is_greatest_or_least_and_the_aggregate_stays() -> None:
    assert translate("SELECT ? + MAX(COALESCE(NULLIF(v, 0), ?), ?), max(rowid), "
                     "min(a, (b))") == \
        "SELECT %s + GREATEST(COALESCE(NULLIF(v, 0), %s), %s), max(rowid), LEAST(a, (b))"


def test_a_bare_parameter_tested_for_null_gets_a_type() -> None:
    assert translate("SET a = CASE WHEN ? IS NULL THEN a ELSE ? END, b = ? IS NOT NULL") == \
        "SET a = CASE WHEN CAST(%s AS TEXT) IS NULL THEN a ELSE %s END," \
        " b = CAST(%s AS TEXT) IS NOT NULL"


def test_instr_is_strpos() -> None:
    assert translate("SELECT 1 WHERE instr(lower(errors), lower(?)) > 0") == \
        "SELECT 1 WHERE strpos(lower(errors), lower(%s)) > 0"


def test_json_insert_at_the_end_is_rota_json_append() -> None:
    assert translate("UPDATE jobs SET errors = json_insert(errors, '$[#]', json(?))") == \
        "UPDATE jobs SET errors = rota_json_append(errors, %s)"


def test_a_subquery_in_from_gets_a_name_unless_it_has_one() -> None:
    assert translate("SELECT count(*) FROM (SELECT 1 FROM jobs LIMIT ?)") == \
        "SELECT count(*) FROM (SELECT 1 FROM jobs LIMIT %s) AS _sub1"
    assert translate("SELECT a FROM (SELECT a FROM t) WHERE a > 1") == \
        "SELECT a FROM (SELECT a FROM t) AS _sub1 WHERE a > 1"
    assert translate("SELECT x.a FROM (SELECT a FROM t) x") == \
        "SELECT x.a FROM (SELECT a FROM t) x"


def test_a_number_as_a_condition_is_compared_with_zero() -> None:
    assert translate("SELECT name FROM queues WHERE paused") == \
        "SELECT name FROM queues WHERE (paused <> 0)"
    assert translate("SELECT 1 FROM jobs WHERE 1 AND rowid < ? ORDER BY rowid") == \
        "SELECT 1 FROM jobs WHERE (1 <> 0) AND rowid < %s ORDER BY rowid"
    # comparisons and NULL tests are left alone
    assert translate("SELECT 1 WHERE a = 1 AND b IS NOT NULL AND NOT (c = 2)") == \
        "SELECT 1 WHERE a = 1 AND b IS NOT NULL AND NOT (c = 2)"


def test_insert_or_ignore_does_nothing_on_conflict() -> None:
    assert translate("INSERT OR IGNORE INTO t (a) VALUES (?)") == \
        "INSERT INTO t (a) VALUES (%s) ON CONFLICT DO NOTHING"
    assert translate("INSERT OR IGNORE INTO t (a) VALUES (?) RETURNING a") == \
        "INSERT INTO t (a) VALUES (%s) ON CONFLICT DO NOTHING RETURNING a"


def test_insert_or_replace_sets_every_column_as_a_new_row_would() -> None:
    assert translate("INSERT OR REPLACE INTO queues (name, paused) VALUES (?, ?)") == (
        "INSERT INTO queues (name, paused) VALUES (%s, %s) ON CONFLICT (name) DO UPDATE"
        " SET paused = excluded.paused, updated_at = DEFAULT")


def test_sqlites_time_now_is_the_database_servers_clock_when_the_statement_runs() -> None:
    assert translate(f"SELECT {fleet.DB_NOW} + ?") == \
        "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION) + %s"


def test_translations_are_cached_per_statement() -> None:
    text = "SELECT ? AS cached_once"
    assert translate(text) is translate(text)


def test_insert_or_replace_goes_before_returning_and_names_the_whole_key() -> None:
    assert translate("INSERT OR REPLACE INTO meta (key, value) VALUES ('clock', ?)"
                     " RETURNING key") == (
        "INSERT INTO meta (key, value) VALUES ('clock', %s) ON CONFLICT (key) DO UPDATE"
        " SET value = excluded.value RETURNING key")


def test_a_statement_with_nothing_to_translate_is_left_as_it_is() -> None:
    assert translate("SELECT id, state FROM jobs WHERE rowid = %s") == \
        "SELECT id, state FROM jobs WHERE rowid = %%s"  # (only the % is doubled)
    assert translate("COMMIT") == "COMMIT"


def test_parentheses_and_commas_inside_quotes_do_not_count() -> None:
    assert translate("SELECT max(a) FROM t WHERE b = '(,'") == \
        "SELECT max(a) FROM t WHERE b = '(,'"
    assert translate("SELECT MAX(a, ',') FROM t") == "SELECT GREATEST(a, ',') FROM t"


def test_an_unbalanced_statement_is_refused_not_guessed_at() -> None:
    with pytest.raises(ValueError, match="unbalanced"):
        translate("SELECT MAX(a, b FROM t")


# -- ddl() ----------------------------------------------------------------------------------
def test_the_ddl_makes_every_table_and_index_of_the_description_and_nothing_else() -> None:
    statements = ddl()
    tables = [s.split()[5] for s in statements if s.startswith("CREATE TABLE")]
    indexes = [s.split()[5] for s in statements if s.startswith("CREATE INDEX")]
    assert tables == [t.name for t in schema.TABLES]
    assert indexes == [i.name for i in schema.INDEXES]
    # each may run again: a database already there is left as it is
    assert all(" IF NOT EXISTS " in s or s.startswith("CREATE OR REPLACE FUNCTION")
               for s in statements)


def test_the_ddl_types_text_as_bytes_and_numbers_rows_as_sqlite_does() -> None:
    jobs = next(s for s in ddl() if s.startswith("CREATE TABLE IF NOT EXISTS jobs "))
    assert jobs.startswith("CREATE TABLE IF NOT EXISTS jobs (rowid BIGINT GENERATED BY"
                           " DEFAULT AS IDENTITY UNIQUE, id TEXT COLLATE \"C\","
                           " spec TEXT COLLATE \"C\" NOT NULL,")
    assert jobs.endswith("PRIMARY KEY (id))")
    assert "attempt BIGINT NOT NULL DEFAULT 0" in jobs
    assert "visibility_timeout DOUBLE PRECISION," in jobs
    assert "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS worker_token TEXT COLLATE \"C\"" in ddl()
    assert not any("ADD COLUMN IF NOT EXISTS id " in s for s in ddl())  # the key is made once


def test_the_ddl_defines_the_function_translated_sql_calls() -> None:
    assert "rota_json_append(errors, %s)" in translate(
        "UPDATE jobs SET errors = json_insert(errors, '$[#]', json(?))")
    assert any(s.startswith("CREATE OR REPLACE FUNCTION rota_json_append(list TEXT,"
                            " item TEXT)") for s in ddl())
