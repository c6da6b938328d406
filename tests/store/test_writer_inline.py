"""Light writes committed on the loop's own thread (rota/store/writer.py, ``inline``: SQLite
with --durability process): only when the writer thread has nothing, in submission order
whatever commits where, handed to the thread when the file is locked by another process,
and not again for a while after a slow commit. A real SQLite file, a real writer thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from rota.store import writer as writing
from rota.store.sqlite import connect
from rota.store.writer import INLINE_MAX, Writer

pytestmark = pytest.mark.sqlite_only("the writer thread of a SQLite file")

Log = list[tuple[int, str]]  # (value written, the thread that wrote it)


def insert(log: Log, value: int, pause: float = 0.0) -> Callable[[sqlite3.Connection], int]:
    def op(conn: sqlite3.Connection) -> int:
        if pause:
            time.sleep(pause)  # noqa: sleep-ok (a commit that takes long: a slow disk)
        conn.execute("INSERT INTO t (x) VALUES (?)", (value,))
        log.append((value, threading.current_thread().name))
        return value
    return op


@contextlib.asynccontextmanager
async def running(tmp_path: Path, durability: str = "process") -> AsyncIterator[Writer]:
    path = tmp_path / "w.db"
    with contextlib.closing(connect(path)) as conn:
        conn.execute("CREATE TABLE t (x INTEGER)")
    writer = Writer(path, durability)
    writer.inline = durability == "process"  # as Store sets it
    writer.start(asyncio.get_running_loop())
    await writer.submit(lambda conn: None)  # the thread has opened its connection
    try:
        yield writer
    finally:
        writer.stop()


def stored(tmp_path: Path) -> list[int]:
    with contextlib.closing(sqlite3.connect(tmp_path / "w.db")) as conn:
        return [x for (x,) in conn.execute("SELECT x FROM t ORDER BY rowid")]


async def test_a_turns_light_writes_commit_together_on_the_loop(tmp_path: Path):
    log: Log = []
    async with running(tmp_path) as writer:
        futures = [writer.submit(insert(log, n), light=True) for n in range(3)]
        assert await asyncio.gather(*futures) == [0, 1, 2]
    assert log == [(n, "MainThread") for n in range(3)]
    assert stored(tmp_path) == [0, 1, 2]


async def test_a_heavy_write_sends_the_turns_light_ones_before_it_to_the_thread(tmp_path: Path):
    log: Log = []
    async with running(tmp_path) as writer:
        futures = [writer.submit(insert(log, 1), light=True), writer.submit(insert(log, 2)),
                   writer.submit(insert(log, 3), light=True)]
        await asyncio.gather(*futures)
        # Now the thread has done all it was given: a light write may commit here again.
        await writer.submit(insert(log, 4), light=True)
    assert [v for v, _ in log] == [1, 2, 3, 4] == stored(tmp_path)
    assert {name for _, name in log[:3]} == {"rota-writer"} and log[3][1] == "MainThread"


async def test_more_light_writes_than_a_loop_commit_takes_go_to_the_thread_in_order(
        tmp_path: Path):
    log: Log = []
    async with running(tmp_path) as writer:
        count = INLINE_MAX + 3
        await asyncio.gather(*(writer.submit(insert(log, n), light=True) for n in range(count)))
    assert [v for v, _ in log] == list(range(count)) == stored(tmp_path)
    assert {name for _, name in log} == {"rota-writer"}


async def test_a_file_locked_by_another_process_never_holds_the_loop(tmp_path: Path):
    log: Log = []
    async with running(tmp_path) as writer:
        await writer.submit(insert(log, 0), light=True)  # (the file exists, in WAL mode)
        other = sqlite3.connect(tmp_path / "w.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # a CLI writing to the file: its lock held
        future = writer.submit(insert(log, 1), light=True)
        started = time.monotonic()
        await asyncio.sleep(0)  # noqa: sleep-ok (one turn: the loop's commit is tried)
        await asyncio.sleep(0)  # noqa: sleep-ok
        assert time.monotonic() - started < 1.0  # the loop went on (BUSY_MS is 5 s)
        assert not future.done()  # the thread waits for the lock instead
        other.execute("COMMIT")
        other.close()
        assert await asyncio.wait_for(future, 10) == 1
    assert log == [(0, "MainThread"), (1, "rota-writer")]


async def test_a_slow_commit_on_the_loop_sends_writes_to_the_thread_for_a_while(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    caplog.set_level(logging.INFO, "rota.server")
    log: Log = []
    async with running(tmp_path) as writer:
        await writer.submit(insert(log, 0, pause=writing.INLINE_SLOW * 2), light=True)
        await writer.submit(insert(log, 1), light=True)
        monkeypatch.setattr(writer, "_rest_until", 0.0)  # the rest is over
        await writer.submit(insert(log, 2), light=True)
    assert log == [(0, "MainThread"), (1, "rota-writer"), (2, "MainThread")]
    [line] = [r.getMessage() for r in caplog.records if "event loop took" in r.getMessage()]
    assert f"for {writing.INLINE_REST:g}s" in line


async def test_with_full_durability_every_write_goes_to_the_thread(tmp_path: Path):
    log: Log = []
    async with running(tmp_path, durability="full") as writer:
        await asyncio.gather(*(writer.submit(insert(log, n), light=True) for n in range(2)))
    assert {name for _, name in log} == {"rota-writer"}


async def test_a_failing_light_write_fails_alone_and_the_loop_commits_the_rest(tmp_path: Path):
    log: Log = []

    def broken(conn: sqlite3.Connection) -> Any:
        raise ValueError("a bug in one op")

    async with running(tmp_path) as writer:
        good = writer.submit(insert(log, 1), light=True)
        bad = writer.submit(broken, light=True)
        assert await good == 1
        with pytest.raises(ValueError, match="a bug in one op"):
            await bad
    assert stored(tmp_path) == [1]
