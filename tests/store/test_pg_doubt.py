"""A COMMIT whose answer is lost with the connection (rota/store/writer.py ``Doubt``): the
database may have carried it out. PostgreSQL's fast shutdown does end sessions between a
commit and its answer; here a synchronous-replication wait that never ends holds the
writer's COMMIT after its commit record, and the session is ended there, which is
PostgreSQL's own "committed locally" case, every time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from helpers import wait_until
from pgserver import Cluster

from rota.base.errors import StorageError
from rota.store import health as db_health, pg, pg_connection, writer as writer_mod


@contextlib.asynccontextmanager
async def commits_wait_forever(cluster: Cluster) -> AsyncIterator[None]:
    """Every commit with synchronous_commit on waits after its record (``hold_commits``),
    until the block ends."""
    await asyncio.to_thread(cluster.hold_commits, True)
    try:
        yield
    finally:
        await asyncio.to_thread(cluster.hold_commits, False)


async def in_commit(admin: psycopg.AsyncConnection[Any], event: str) -> int | None:
    """The pid of this database's session that waits on ``event``, if one does."""
    row = await (await admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE wait_event = %s"
        " AND datname = current_database()", (event,))).fetchone()
    return None if row is None else int(row[0])


@contextlib.asynccontextmanager
async def started_writer(cluster: Cluster) -> AsyncIterator[tuple[str, pg.Writer]]:
    """A writer on a new migrated database of ``cluster``: its URL and the writer."""
    url = cluster.create_database(migrated=True)
    writer = pg.Writer(url, health=db_health.Health(hold=0.0))
    writer.start(asyncio.get_running_loop())
    try:
        yield url, writer
    finally:
        await asyncio.to_thread(writer.stop)
        cluster.give_back(url)


async def test_a_commit_carried_out_whose_answer_was_lost_is_reported_a_success(
        pg_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """The writer's COMMIT was carried out, and its session ended before the answer: the
    caller hears success, with what its op returned, once the database says so; not the
    storage failure the lost answer looked like. The write after it commits as usual."""
    caplog.set_level(logging.INFO, logger="rota.server")
    async with started_writer(pg_cluster) as (url, writer):
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
            async with commits_wait_forever(pg_cluster):
                writes: list[asyncio.Future[Any]] = []

                async def waiting() -> int | None:
                    # The setting reaches the commits a moment after the reload: a write
                    # that committed without waiting is followed by another.
                    if not writes or writes[-1].done():
                        key = f"doubt{len(writes)}"
                        writes.append(writer.submit(lambda c: c.execute(
                            "INSERT INTO meta VALUES (?, '1')", (key,)) and key))
                    return await in_commit(admin, "SyncRep")

                pid = await wait_until(waiting, timeout=10, what="a COMMIT to wait")
                await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                write = writes[-1]
                await wait_until(lambda: "a commit's answer was lost" in caplog.text,
                                 what="the writer to find its commit in doubt")
                # Never a failure. (The writer's next probe, a second on, may have asked
                # already: the record is there, so it took effect.)
                assert not (write.done() and write.exception() is not None)
            key = f"doubt{len(writes) - 1}"
            assert await asyncio.wait_for(write, 10) == key  # what its op returned
            row = await (await admin.execute(
                "SELECT value FROM meta WHERE key = %s", (key,))).fetchone()
            assert row == ("1",)
            await writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('after', '2')"))
        assert "took effect" in caplog.text and "did not take effect" not in caplog.text


async def test_a_commit_in_doubt_that_did_not_take_effect_fails_its_callers(
        pg_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """The writer's session ends inside its COMMIT before the commit record (a deferred
    trigger sleeps there): the COMMIT's outcome is as unknown to the writer as above,
    and the database says it did not take effect. Its caller gets the storage error, and
    nothing of it is in the database."""
    caplog.set_level(logging.INFO, logger="rota.server")
    async with writer_in_a_slow_commit(pg_cluster) as (_, write, admin):
        await admin.execute("SELECT pg_terminate_backend(%s)",
                            (await in_commit(admin, "PgSleep"),))
        with pytest.raises(StorageError) as failed:
            await asyncio.wait_for(write, 10)  # the writer asks at its next probe
        assert failed.value.code == "storage_unavailable"
        assert await (await admin.execute("SELECT count(*) FROM slow")).fetchone() == (0,)
    assert "a commit's answer was lost" in caplog.text
    assert "did not take effect" in caplog.text


def slow_commits(url: str) -> None:
    """A table whose rows' transactions sleep 30 s in their COMMIT (a deferred trigger),
    before its record: ended there, a transaction did not commit."""
    with psycopg.connect(url, autocommit=True) as setup:
        setup.execute("CREATE TABLE slow (i int)")
        setup.execute("CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS"
                      " $$ BEGIN PERFORM pg_sleep(30); RETURN NULL; END $$")
        setup.execute("CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON slow"
                      " DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION"
                      " slow_commit()")


@contextlib.asynccontextmanager
async def writer_in_a_slow_commit(cluster: Cluster) -> AsyncIterator[
        tuple[pg.Writer, asyncio.Future[Any], psycopg.AsyncConnection[Any]]]:
    """A writer whose one write sleeps in its COMMIT now (``slow_commits``): the
    writer, the write's future, and an admin connection to its database."""
    url = cluster.create_database(migrated=True)
    slow_commits(url)
    writer = pg.Writer(url, health=db_health.Health(hold=0.0))
    writer.start(asyncio.get_running_loop())
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
            write = writer.submit(lambda c: c.execute("INSERT INTO slow VALUES (1)"))
            await wait_until(lambda: in_commit(admin, "PgSleep"), timeout=10,
                             what="the COMMIT to run its trigger")
            yield writer, write, admin
    finally:
        await asyncio.to_thread(writer.stop)
        cluster.give_back(url)


async def test_a_commit_its_old_session_still_carries_out_is_ended_before_anything_commits(
        pg_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """The writer's side of the connection is cut (a network's fault) while PostgreSQL
    still carries out the COMMIT: its transaction is in progress when the writer asks.
    The writer ends that session (its outcome is then final) before the next write
    begins, so nothing commits ahead of it; here it had not committed."""
    caplog.set_level(logging.INFO, logger="rota.server")
    async with writer_in_a_slow_commit(pg_cluster) as (writer, write, admin):
        with socket.socket(fileno=os.dup(writer._conn.raw.pgconn.socket)) as cut:
            cut.shutdown(socket.SHUT_RDWR)  # the session itself goes on
        after = writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('a', '1')"))
        with pytest.raises(StorageError):
            await asyncio.wait_for(write, 10)
        await asyncio.wait_for(after, 10)
        assert await (await admin.execute("SELECT count(*) FROM slow")).fetchone() == (0,)
    assert "did not take effect" in caplog.text


async def fails_and_the_next_write_commits(writer: pg.Writer, txn: pg.Txn) -> None:
    """A doubt naming ``txn``, put where ``_commit`` leaves one (a list append: the idle
    writer only reads it): the next write commits, and the doubt's caller gets the error
    it carried."""
    doubtful: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    lost = StorageError("storage_unavailable", "the answer was lost", 1)
    writer._doubts.append(writer_mod.Doubt(txn, [(doubtful, "v", None)], lost))
    assert await asyncio.wait_for(
        writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('next', '2')") and "ok"),
        10) == "ok"
    with pytest.raises(StorageError) as failed:
        await asyncio.wait_for(doubtful, 1)
    assert failed.value is lost


async def test_a_transaction_the_database_cannot_name_fails_its_callers_not_the_writer(
        pg_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """A doubt whose transaction id the database never had (a standby promoted without
    it, another cluster behind the URL): txid_status refuses it. Its callers get the
    error they would have got, and the writes after it commit."""
    async with started_writer(pg_cluster) as (url, writer):
        with psycopg.connect(url, autocommit=True) as other:
            future_xid = other.execute("SELECT txid_current() + 1000000").fetchone()[0]
        await fails_and_the_next_write_commits(writer, pg.Txn(future_xid, 0, None))
        assert "cannot say how 1 commit(s) in doubt ended" in caplog.text


async def test_a_stop_while_the_database_is_away_fails_a_commit_in_doubt_at_once(
        pg_cluster: Cluster) -> None:
    """PostgreSQL's fast shutdown ends the writer's session inside its COMMIT (held after
    its record) and stays down. The server begins to stop: its caller is not held until
    the database returns (uvicorn waits for requests before the store stops) but fails,
    as before doubts were asked about."""
    async with started_writer(pg_cluster) as (url, writer):
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
            await asyncio.to_thread(pg_cluster.hold_commits, True)
            write = writer.submit(lambda c: c.execute("INSERT INTO meta VALUES ('c', '3')"))
            await wait_until(lambda: in_commit(admin, "SyncRep"), timeout=10,
                             what="the COMMIT to wait")
        await asyncio.to_thread(pg_cluster.stop)
        try:
            assert not write.done()  # in doubt: the database is away
            writer.begin_stop()
            with pytest.raises(StorageError):
                await asyncio.wait_for(write, 5)
        finally:
            await asyncio.to_thread(pg_cluster.start)
            await asyncio.to_thread(pg_cluster.hold_commits, False)


async def test_a_commit_in_doubt_from_before_a_failover_is_reported_failed(
        pg_cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """A doubt made on another history of the server (a standby promoted since starts a
    new timeline, where its transaction id may name another transaction): it is not
    asked about, and fails, though the id here names a committed transaction."""
    async with started_writer(pg_cluster) as (url, writer):
        with psycopg.connect(url, autocommit=True) as other:
            other.execute("BEGIN")
            other.execute("INSERT INTO meta VALUES ('here', '1')")
            xid = other.execute("SELECT txid_current()").fetchone()[0]
            other.execute("COMMIT")
            here = pg.history(pg_connection.TranslatingConnection(other))
        assert here is not None and here[1] == "00000001"  # a new cluster's first timeline
        # As if made on another timeline: the id here names a committed transaction.
        await fails_and_the_next_write_commits(writer, pg.Txn(xid, 0, (here[0], "00000002")))
        assert "made before a failover" in caplog.text
