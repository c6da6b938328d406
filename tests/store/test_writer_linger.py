"""The writer's linger (rota/store/writer.py): with --durability full, a batch of background
writes only (a worker's results) waits up to LINGER for other writes to commit with; any
other write ends that wait at once, and both commit in one transaction. The wait is made
long here (monkeypatched), so that each test sees which side ended it."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers import wait_until

from rota.store import writer as writer_module
from rota.store.writer import Writer


class Watched:
    """A writer on a new file, with a table ``t`` and the COMMITs it runs counted."""

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.commits = 0

    def trace(self, statement: str) -> None:
        self.commits += statement == "COMMIT"

    async def taken(self) -> None:
        """Until the writer has taken everything queued (and, here, lingers)."""
        await wait_until(self.writer._queue.empty, timeout=5, what="the writer to take it")


@pytest.fixture(params=["full"])
async def watched(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Watched]:
    writer = Writer(tmp_path / "linger.db", durability=request.param)
    writer.start(asyncio.get_running_loop())
    found = Watched(writer)

    def set_up(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE t (v INTEGER)")
        conn.set_trace_callback(found.trace)

    await writer.submit(set_up)
    found.commits = 0
    try:
        yield found
    finally:
        await asyncio.to_thread(writer.stop)


def insert(value: int) -> writer_module.Op:
    return lambda conn: conn.execute("INSERT INTO t VALUES (?)", (value,)).rowcount


async def test_a_write_a_request_waits_on_ends_the_linger_and_both_commit_once(
        watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "LINGER", 30.0)
    background = watched.writer.submit(insert(1), linger=True)
    await watched.taken()
    assert not background.done()  # it waits for company
    started = time.monotonic()
    asked = watched.writer.submit(insert(2))
    assert await asyncio.wait_for(asyncio.gather(background, asked), 10) == [1, 1]
    assert time.monotonic() - started < 10
    assert watched.commits == 1
    rows = await watched.writer.submit(
        lambda conn: [v for (v,) in conn.execute("SELECT v FROM t ORDER BY rowid")])
    assert rows == [1, 2]  # in the order they were submitted


async def test_background_writes_alone_commit_together_once_the_linger_is_over(
        watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "LINGER", 1.0)
    started = time.monotonic()
    first = watched.writer.submit(insert(1), linger=True)
    await watched.taken()
    second = watched.writer.submit(insert(2), linger=True)  # joins; the wait goes on
    assert await asyncio.wait_for(asyncio.gather(first, second), 10) == [1, 1]
    assert time.monotonic() - started >= 1.0
    assert watched.commits == 1


async def test_a_write_that_does_not_linger_never_waits(
        watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "LINGER", 30.0)
    for value in range(3):
        assert await asyncio.wait_for(watched.writer.submit(insert(value)), 10) == 1
    assert watched.commits == 3


async def test_a_stop_commits_what_lingers_at_once(
        watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "LINGER", 30.0)
    background = watched.writer.submit(insert(1), linger=True)
    await watched.taken()
    started = time.monotonic()
    await asyncio.to_thread(watched.writer.stop)
    assert time.monotonic() - started < 10
    assert await asyncio.wait_for(background, 10) == 1
    assert watched.commits == 1


@pytest.mark.parametrize("watched", ["process"], indirect=True)
async def test_without_a_sync_to_share_nothing_lingers(
        watched: Watched, monkeypatch: pytest.MonkeyPatch) -> None:
    # --durability process: a commit costs no fsync, so a job's completion is not delayed.
    monkeypatch.setattr(writer_module, "LINGER", 30.0)
    for value in range(3):
        write = watched.writer.submit(insert(value), linger=True)
        assert await asyncio.wait_for(write, 10) == 1
    assert watched.commits == 3
