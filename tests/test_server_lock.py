"""One server per database file: a second ``rota serve`` on the same file refuses to start,
in one line naming the holder's pid, and the lock dies with its holder."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers import spawn_serve
from test_cli import rota
from test_crash import free_port

from rota.db import hold_database, lock_path
from rota.errors import DatabaseInUse


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    """A client for a server yet to start on a free port."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}") as client:
        yield client


async def serve(http: httpx.AsyncClient, db: Path, log: Path) -> asyncio.subprocess.Process:
    """``rota serve`` on ``db`` at the port ``http`` talks to, once it answers."""
    return await spawn_serve(http, ["--port", str(http.base_url.port), "--db", str(db)], log)


async def stop(proc: asyncio.subprocess.Process, sig: int = signal.SIGTERM) -> int:
    proc.send_signal(sig)
    return await asyncio.wait_for(proc.wait(), 15)


async def test_a_second_server_on_the_same_file_refuses_to_start(tmp_path: Path,
                                                                http: httpx.AsyncClient):
    db = tmp_path / "rota.db"
    first = await serve(http, db, tmp_path / "first.log")
    try:
        # Another name of the same file (through a symlink) is the same database.
        (tmp_path / "alias.db").symlink_to(db)
        for name in (str(db), str(tmp_path / "alias.db")):
            code, out, err = await rota("serve", "--port", str(free_port()), "--db", name,
                                        timeout=20)
            assert code == 1, err
            assert err.strip() == (f"error: {name} is in use by another rota serve"
                                   f" (pid {first.pid}); stop it first or use another --db")
            assert out == ""
        assert (await http.get("/healthz")).status_code == 200  # the first serves on
    finally:
        assert await stop(first) == 0
    # Stopped (or killed: the kernel drops the lock with its process), a new one starts.
    second = await serve(http, db, tmp_path / "second.log")
    assert await stop(second, signal.SIGKILL) == -signal.SIGKILL
    third = await serve(http, db, tmp_path / "third.log")
    assert await stop(third) == 0


def test_the_lock_names_its_holder_and_is_released_on_exit(tmp_path: Path):
    db = tmp_path / "rota.db"
    with hold_database(db):
        assert lock_path(db).read_text() == f"{os.getpid()}\n"
        with pytest.raises(DatabaseInUse) as refused, hold_database(db):
            pass
        assert refused.value.pid == os.getpid()
        assert not db.exists()  # the lock is a file of its own: SQLite's file is untouched
    assert lock_path(db).read_text() == ""  # no stale pid after a clean exit
    with hold_database(db):
        pass


async def test_tokens_work_beside_a_running_server(tmp_path: Path, http: httpx.AsyncClient):
    db = tmp_path / "rota.db"
    server = await serve(http, db, tmp_path / "server.log")
    try:
        code, out, err = await rota("tokens", "create", "--scope", "admin", "--db", str(db))
        assert code == 0 and out.startswith("rota_"), err
        code, out, _ = await rota("tokens", "list", "--db", str(db))
        assert code == 0 and "admin" in out
    finally:
        assert await stop(server) == 0
