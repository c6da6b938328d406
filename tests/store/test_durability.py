"""``--durability``: full (the default) fsyncs every commit; process is an opt-in that
trades the machine's crash for speed. Both keep a commit atomic."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import open_store, store_url

from rota.store import sqlite as db, pg_connection
from rota.cli.app import main
from rota.server.coordinator import Coordinator
from rota.core.settings import ServerSettings

pytestmark = pytest.mark.both_backends


@pytest.mark.parametrize(("durability", "synchronous", "commit"),
                         [("full", 2, "on"), ("process", 1, "off")])
def test_the_writer_connection_syncs_as_asked(tmp_path: Path, durability: str,
                                              synchronous: int, commit: str) -> None:
    url = store_url(tmp_path)
    if url is not None:  # PostgreSQL: a commit is acknowledged before its flush, or after
        with contextlib.closing(pg_connection.connect(url, durability=durability)) as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone()[0] == commit
        return
    conn = db.connect(tmp_path / "r.db", durability=durability)
    try:
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == synchronous
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


@pytest.mark.sqlite_only("settings only: no store is opened")
def test_the_default_is_full_and_the_setting_reaches_the_store(tmp_path: Path) -> None:
    assert ServerSettings().durability == "full"
    coordinator = Coordinator(ServerSettings(db=tmp_path / "r.db", durability="process"))
    assert coordinator.store.durability == "process"


async def test_a_process_durable_server_stores_and_serves(tmp_path: Path) -> None:
    coordinator = Coordinator(ServerSettings(db=tmp_path / "rota.db", durability="process",
                                             database_url=store_url(tmp_path)))
    await coordinator.start()
    try:
        # the writer runs; a commit lands in the file
        await coordinator.store.writer.submit(lambda conn: conn.execute(
            "INSERT INTO tokens (id, name, scope, queues, hash, created_at)"
            " VALUES ('t', 'n', 'admin', '[]', 'h', 0)"))
    finally:
        await coordinator.stop()
    with contextlib.closing(open_store(tmp_path)) as check:
        assert check.execute("SELECT count(*) FROM tokens").fetchone()[0] == 1


@pytest.mark.sqlite_only("the command line's check only: no store is opened")
def test_an_unknown_durability_is_refused_by_name(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "--db", str(tmp_path / "r.db"),
                                       "--durability", "none"])
    assert result.exit_code == 2 and "'full', 'process'" in result.output
