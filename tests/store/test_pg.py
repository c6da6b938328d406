"""rota/store/pg.py and rota/store/pg_connection.py: the sqlite3-like connection on a real
PostgreSQL, its schema and migrations, a lost server as storage_unavailable, LISTEN."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import start_server, stop_server, write_spec
from helpers import wait_until
from pgserver import Cluster

from rota.store import sqlite as db, health as db_health, migrations as db_migrations, fleet, pg, pg_connection, schema, urls
from rota.base.errors import StorageError


# -- the adapter on a real PostgreSQL ----------------------------------------------------
@pytest.fixture
def conn(pg_url: str) -> Iterator[pg_connection.TranslatingConnection]:
    pg.migrate(pg_url)
    connection = pg_connection.connect(pg_url)
    yield connection
    connection.close()


def test_rows_read_as_sqlite3_rows(conn: pg_connection.TranslatingConnection) -> None:
    conn.execute("INSERT INTO queues (name, paused, updated_at) VALUES (?, ?, ?)",
                 ("q", 1, 1.5))
    row = conn.execute("SELECT name, paused, updated_at FROM queues").fetchone()
    assert (row[0], row["paused"], row["updated_at"]) == ("q", 1, 1.5)
    assert row.keys() == ["name", "paused", "updated_at"]
    assert dict(row) == {"name": "q", "paused": 1, "updated_at": 1.5}
    name, paused, at = row
    assert (name, paused, at) == ("q", 1, 1.5)
    cursor = conn.execute("SELECT name, paused FROM queues")
    cursor.row_factory = None
    assert cursor.fetchall() == [("q", 1)]
    assert dict(conn.execute("SELECT name, updated_at FROM queues")) == {"q": 1.5}
    assert conn.execute("SELECT name FROM queues WHERE paused").fetchall()[0][0] == "q"
    assert conn.execute("UPDATE queues SET paused = 0 WHERE name = ?", ("q",)).rowcount == 1
    assert conn.execute("SELECT 1 FROM queues WHERE name = ?", ("none",)).fetchone() is None


def test_transactions_and_savepoints_as_the_writer_uses_them(conn: pg_connection.TranslatingConnection) -> None:
    assert not conn.in_transaction
    conn.execute("BEGIN IMMEDIATE")
    assert conn.in_transaction
    conn.execute("SAVEPOINT op")
    conn.execute("INSERT INTO meta (key, value) VALUES ('a', '1')")
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("INSERT INTO meta (key, value) VALUES ('a', '2')")
    assert conn.in_transaction  # failed, not ended: the savepoint undoes the op
    conn.execute("ROLLBACK TO op")
    conn.execute("RELEASE op")
    conn.execute("INSERT INTO meta (key, value) VALUES ('b', '2')")
    conn.execute("COMMIT")
    assert [r[0] for r in conn.execute("SELECT key FROM meta ORDER BY key")] == \
        ["b", "migrated_by"]


def test_the_jobs_rowid_is_a_column_and_returning_gives_it(conn: pg_connection.TranslatingConnection) -> None:
    insert = ("INSERT INTO jobs (id, spec, queue, args, priority, state, enqueued_at)"
              " VALUES (?, 's', 'q', '{}', 0, 'available', ?) ON CONFLICT(id) DO NOTHING")
    first = conn.execute(insert + " RETURNING rowid, *", ("a", 1.0)).fetchone()
    second = conn.execute(insert + " RETURNING rowid", ("b", 2.0)).fetchone()
    assert second[0] > first["rowid"] and first["id"] == "a" and first["errors"] == "[]"
    assert conn.execute(insert + " RETURNING rowid", ("a", 3.0)).fetchone() is None
    conn.execute("UPDATE jobs SET errors = CASE WHEN ? IS NULL THEN errors ELSE"
                 " json_insert(errors, '$[#]', json(?)) END WHERE id = ?",
                 ('{"x":1}', '{"x":1}', "a"))
    conn.execute("UPDATE jobs SET errors = CASE WHEN ? IS NULL THEN errors ELSE"
                 " json_insert(errors, '$[#]', json(?)) END WHERE id = ?", (None, None, "a"))
    conn.execute("UPDATE jobs SET errors = json_insert(errors, '$[#]', json(?))"
                 " WHERE id = ?", ('"y"', "a"))
    assert conn.execute("SELECT errors FROM jobs WHERE id = 'a'").fetchone()[0] == \
        '[{"x":1},"y"]'  # the text SQLite's json_insert writes
    keys = conn.execute("SELECT (-priority << 40) + rowid FROM jobs ORDER BY rowid")
    keys.row_factory = None
    assert [k for (k,) in keys] == [first["rowid"], second[0]]


def test_text_sorts_as_bytes_as_in_sqlite(conn: pg_connection.TranslatingConnection) -> None:
    conn.executemany("INSERT INTO meta (key, value) VALUES (?, '')",
                     [("a",), ("B",), ("a\x7f",), ("ab",)])
    keys = [r[0] for r in conn.execute("SELECT key FROM meta WHERE key >= ? AND key < ?"
                                       " ORDER BY key", ("B", "a\x7f"))]
    assert keys == ["B", "a", "ab"]


# -- the schema --------------------------------------------------------------------------
def test_the_database_has_the_described_tables_and_indexes(conn: pg_connection.TranslatingConnection) -> None:
    for table in schema.TABLES:
        columns = [r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ?"
            " ORDER BY ordinal_position", (table.name,))]
        assert columns == ["rowid"] * table.rowid + [c.name for c in table.columns]
    indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes")}
    assert {i.name for i in schema.INDEXES} <= indexes
    applied = [r[0] for r in conn.execute(f"SELECT name FROM {pg.MIGRATIONS_TABLE}"
                                          " ORDER BY name")]
    assert applied == list(schema.MIGRATIONS)  # the names SQLite records


def test_migrate_again_changes_nothing(pg_url: str, conn: pg_connection.TranslatingConnection) -> None:
    conn.execute("INSERT INTO meta (key, value) VALUES ('kept', 'yes')")
    pg.migrate(pg_url)
    assert conn.execute("SELECT value FROM meta WHERE key = 'kept'").fetchone()[0] == "yes"


def test_a_database_a_newer_rota_migrated_is_refused(pg_url: str, conn: pg_connection.TranslatingConnection,
                                                     tmp_path: Path) -> None:
    conn.execute(f"INSERT INTO {pg.MIGRATIONS_TABLE} (name) VALUES ('m999_future')")
    conn.execute("UPDATE meta SET value = '9.0' WHERE key = 'migrated_by'")
    with pytest.raises(db.NewerDatabase) as refused:
        pg.migrate(pg_url.replace("rota@", "rota:secret@"))
    assert "m999_future" in refused.value.message and "Rota 9.0" in refused.value.message
    assert "secret" not in refused.value.message
    # the same refusal on SQLite
    db_migrations.migrate(tmp_path / "rota.db")
    with contextlib.closing(db.connect(tmp_path / "rota.db")) as lite:
        lite.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at)"
                     " VALUES ('rota', 'm999_future', '')")
    with pytest.raises(db.NewerDatabase, match="m999_future"):
        db_migrations.migrate(tmp_path / "rota.db")


# -- a lost server -----------------------------------------------------------------------
def test_a_server_that_is_down_is_storage_unavailable(pg_cluster: Cluster,
                                                      conn: pg_connection.TranslatingConnection) -> None:
    pg_cluster.stop()
    try:
        with pytest.raises(psycopg.Error) as lost:
            conn.execute("SELECT 1")
        error = pg.storage_error(lost.value)
        assert error is not None and error.code == "storage_unavailable"
        with pytest.raises(psycopg.OperationalError) as refused:
            pg_connection.connect(pg_cluster.url())
        error = pg.storage_error(refused.value)
        assert error is not None and error.code == "storage_unavailable"
        assert not conn.usable
    finally:
        pg_cluster.start()
    other = pg_connection.connect(pg_cluster.url())
    with pytest.raises(psycopg.errors.UndefinedTable) as bug:
        other.execute("SELECT * FROM nowhere")
    other.close()
    assert pg.storage_error(bug.value) is None  # the statement's fault, not the storage's


async def test_the_writer_degrades_while_the_server_is_down_and_recovers(
        pg_cluster: Cluster, pg_url: str) -> None:
    pg.migrate(pg_url)
    health = db_health.Health(hold=0.0)
    writer = pg.Writer(pg_url, health=health)
    readers = pg.Readers(pg_url, 1, health=health)  # one thread: one connection, reused
    writer.start(asyncio.get_running_loop())
    try:
        await writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('a', '1')"))
        assert await readers.run(lambda c: c.execute("SELECT count(*) FROM meta"
                                                     ).fetchone()[0]) == 2
        pg_cluster.stop()
        try:
            with pytest.raises(StorageError) as failed:
                await writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('b', '2')"))
            assert failed.value.code == "storage_unavailable"
            for _ in range(3):  # its connection lost, then none to be had: each says so
                with pytest.raises(StorageError):
                    await readers.run(lambda c: c.execute("SELECT 1").fetchone())
            assert health.degraded is not None
        finally:
            pg_cluster.start()
        # the writer's probe (or the next write) finds the server back
        await wait_until(lambda: health.degraded is None, timeout=10, what="recovery")
        await writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('c', '3')"))
        assert await readers.run(lambda c: c.execute("SELECT count(*) FROM meta"
                                                     ).fetchone()[0]) == 3
    finally:
        await asyncio.to_thread(writer.stop)
        readers.close()


async def test_a_database_restarted_while_rota_is_idle_costs_no_write_a_failure(
        pg_cluster: Cluster, pg_url: str) -> None:
    """The connections' server went away and came back while they sat idle: the writer
    and a reader see it before they use them, and open new ones; nothing fails."""
    pg.migrate(pg_url)
    health = db_health.Health(hold=0.0)
    writer = pg.Writer(pg_url, health=health)
    readers = pg.Readers(pg_url, 1, health=health)
    writer.start(asyncio.get_running_loop())
    try:
        await writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('a', '1')"))
        assert await readers.run(lambda c: c.execute("SELECT 1").fetchone()[0]) == 1
        await asyncio.to_thread(pg_cluster.stop)
        await asyncio.to_thread(pg_cluster.start)
        await writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('b', '2')"))
        assert await readers.run(lambda c: c.execute("SELECT count(*) FROM meta"
                                                     ).fetchone()[0]) == 3
        assert health.degraded is None
    finally:
        await asyncio.to_thread(writer.stop)
        readers.close()


# -- a server stalled inside a transaction (docs/scaling.md) ------------------------------
async def test_a_write_that_waits_on_a_held_lock_fails_alone_after_the_bound(
        pg_url: str, conn: pg_connection.TranslatingConnection) -> None:
    """Another session holds a row (a server stopped inside its transaction): the op
    that waits on it fails after ``bound`` with storage_busy, and the rest of its
    transaction commits; the store is not degraded for it."""
    conn.execute("INSERT INTO meta VALUES ('held', '1')")
    conn.execute("BEGIN")
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'held'")  # and sits there
    health = db_health.Health(hold=0.0)
    writer = pg.Writer(pg_url, health=health)
    writer.bound = 0.3
    writer.start(asyncio.get_running_loop())
    try:
        began = time.monotonic()
        blocked = writer.submit(lambda c: c.execute("UPDATE meta SET value = '3'"
                                                    " WHERE key = 'held'"))
        beside = writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('new', '1')"))
        with pytest.raises(StorageError) as busy:
            await blocked
        await beside
        assert busy.value.code == "storage_busy" and "lock_timeout" in str(busy.value)
        assert time.monotonic() - began < 3.0
        assert health.degraded is None
    finally:
        conn.execute("ROLLBACK")
        await asyncio.to_thread(writer.stop)
    assert conn.execute("SELECT value FROM meta WHERE key = 'new'").fetchone()[0] == "1"


@pytest.mark.parametrize("last", ["execute", "executemany", "rowcounts"])
def test_a_session_idle_inside_a_transaction_past_the_bound_is_ended_and_its_locks_go(
        pg_url: str, conn: pg_connection.TranslatingConnection, last: str) -> None:
    """Whatever its last statement was: psycopg's executemany (a pipeline, also behind
    the row counts Store.save's fenced writes read) would leave the session with no idle
    timeout armed, and the connection arms it again."""
    stalled = pg_connection.connect(pg_url, bound=0.3)
    stalled.execute("BEGIN")
    rows = [("stalled",), ("more",)]
    if last == "execute":
        stalled.execute("INSERT INTO meta VALUES ('stalled', '1')")
    elif last == "executemany":
        stalled.executemany("INSERT INTO meta VALUES (?, '1')", rows)
    else:
        assert db.rowcounts(stalled, "INSERT INTO meta VALUES (?, '1')", rows) == [1, 1]
    # The stall itself, until PostgreSQL's timer ends the session (its backend leaves).
    pid = stalled.raw.info.backend_pid
    deadline = time.monotonic() + 10
    while conn.raw.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, "the stalled session was not ended"
        time.sleep(0.05)  # noqa: sleep-ok (a poll step bounded by the deadline)
    with pytest.raises(psycopg.Error) as ended:
        stalled.execute("COMMIT")
    failure = pg.storage_error(ended.value)
    assert failure is not None and failure.code == "storage_unavailable"
    assert "idle_in_transaction_session_timeout" in str(failure)
    assert not stalled.usable  # the writer opens a new connection for its next write
    stalled.close()
    conn.execute("INSERT INTO meta VALUES ('stalled', '2')")  # no lock left to wait on


@pytest.mark.parametrize("starting", [True, False])
def test_a_lease_runs_from_the_databases_clock_when_the_renewal_ran(
        conn: pg_connection.TranslatingConnection, starting: bool) -> None:
    """A renewal asked for long ago (the server's ``now`` read before it waited on the
    writer) still holds a whole lease from when its UPDATE ran."""
    fleet.renew(conn, "s", host="h", pid=1, url="", now=time.time(), lease=5,
                starting=True)
    assert fleet.renew(conn, "s", host="h", pid=1, url="", now=time.time() - 3600, lease=5,
                       starting=starting)
    left = conn.execute(f"SELECT lease_expires_at - {fleet.DB_NOW} FROM servers").fetchone()[0]
    assert 4.0 < left <= 5.0
    assert fleet.holder(conn, "s")[:2] == ("h", 1)
    assert fleet.lapsed(conn, "other") == {}
    fleet.let_lapse(conn, "s")
    assert fleet.holder(conn, "s") is None
    assert list(fleet.lapsed(conn, "other")) == ["s"]


# -- LISTEN --------------------------------------------------------------------------------
async def test_the_listener_hears_notify_and_listens_again_after_a_restart(
        pg_cluster: Cluster, pg_url: str) -> None:
    heard: list[tuple[str, str]] = []
    connects = 0

    def connected() -> None:
        nonlocal connects
        connects += 1

    listener = pg.Listener(pg_url, ["rota_jobs", "rota specs"],
                           lambda channel, payload: heard.append((channel, payload)),
                           on_connect=connected, retry=0.1)
    listener.start()
    notify = pg_connection.connect(pg_url)
    try:
        await wait_until(listener.listening.is_set, what="LISTEN")
        notify.execute("SELECT pg_notify(?, ?)", ("rota_jobs", "one"))
        notify.execute("SELECT pg_notify(?, ?)", ("rota specs", "two"))
        await wait_until(lambda: len(heard) == 2, what="two notifications")
        assert heard == [("rota_jobs", "one"), ("rota specs", "two")]
        await asyncio.to_thread(pg_cluster.stop)
        try:
            await wait_until(lambda: not listener.listening.is_set(), what="lost")
        finally:
            await asyncio.to_thread(pg_cluster.start)
        await wait_until(listener.listening.is_set, timeout=10, what="LISTEN again")
        assert connects == 2
        again = pg_connection.connect(pg_url)
        again.execute("SELECT pg_notify(?, ?)", ("rota_jobs", "three"))
        again.close()
        await wait_until(lambda: heard[-1:] == [("rota_jobs", "three")], what="after restart")
    finally:
        notify.close()
        await listener.stop()


def test_a_url_is_told_from_a_file() -> None:
    assert urls.is_url("postgresql://u@h/db") and urls.is_url("postgres://h/db")
    assert not urls.is_url("rota.db") and not urls.is_url(Path("postgresql:/x"))
    assert urls.redact("postgresql://u:pw@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert urls.redact("postgresql://u@h/db") == "postgresql://u@h/db"
    assert time.time() > 0


async def test_a_server_on_postgresql_answers_503_while_it_is_down_and_recovers(
        pg_cluster: Cluster, pg_url: str, tmp_path: Path) -> None:
    """The database server stops under a running Rota: enqueues get 503
    storage_unavailable with Retry-After, /healthz says degraded, reads of what is cached
    fail the same way; once it is back, Rota recovers by itself, and every job it
    acknowledged is there."""
    live = await start_server(tmp_path, database_url=pg_url, recover_after=2.0)  # (not 5 s)
    acked: list[str] = []
    try:
        await live.push(write_spec(tmp_path / "specs", "echo"))
        acked.append((await live.enqueue("echo"))["id"])
        await asyncio.to_thread(pg_cluster.stop)
        try:
            response = await live.http.post("/jobs", json={"spec": "echo", "args": {}})
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "storage_unavailable", error
            assert "PostgreSQL server cannot be reached" in error["message"]
            assert 1 <= int(response.headers["Retry-After"]) <= 5
            health = (await live.http.get("/healthz")).json()
            assert health["status"] == "degraded"
            assert health["storage"]["code"] == "storage_unavailable"
        finally:
            await asyncio.to_thread(pg_cluster.start)

        async def healthy() -> bool:
            health = (await live.http.get("/healthz")).json()
            return health["status"] == "ok" and health["storage"] is None

        await wait_until(healthy, timeout=db_health.RECOVER_AFTER + 20, what="recovery")
        acked.append((await live.enqueue("echo"))["id"])
        for job_id in acked:
            assert (await live.job(job_id))["state"] == "available"
    finally:
        await stop_server(live)
