"""One server per database file: a second ``rota serve`` on the same file, under any name of
it (a symlink, a hard link, a path through ``..``), refuses to start, in one line naming the
holder's pid, and the lock dies with its holder."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from helpers import spawn_serve
from helpers import rota
from helpers import free_port

from rota.store.dblock import hold_database
from rota.base.errors import DatabaseInUse, DatabaseLinked


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
        # Every other name of the same file is the same database: a symlink, a hard link
        # in another directory (which once took a lock of its own, and two servers then
        # wrote one file) and a path through "..".
        (tmp_path / "alias.db").symlink_to(db)
        (tmp_path / "elsewhere").mkdir()
        os.link(db, tmp_path / "elsewhere" / "linked.db")
        names = [str(db), str(tmp_path / "alias.db"), str(tmp_path / "elsewhere" / "linked.db"),
                 f"{tmp_path}/elsewhere/../rota.db"]
        tried = await asyncio.gather(*(rota("serve", "--port", str(free_port()), "--db", name,
                                            timeout=20) for name in names))  # all at once
        for name, (code, out, err) in zip(names, tried, strict=True):
            assert code == 1, err
            assert err.strip() == (f"error: {name} is in use by another rota serve"
                                   f" (pid {first.pid}); stop it first or use another --db")
            assert out == ""
        assert (await http.get("/healthz")).status_code == 200  # the first serves on
    finally:
        assert await stop(first) == 0
    # Stopped, a file with a second name is refused (see below); with one, it starts.
    code, _, err = await rota("serve", "--port", str(free_port()), "--db", str(db), timeout=20)
    assert code == 1 and "has 2 hard links" in err and err.count("\n") == 1, err
    (tmp_path / "elsewhere" / "linked.db").unlink()
    # Stopped (or killed: the kernel drops the lock with its process), a new one starts.
    second = await serve(http, db, tmp_path / "second.log")
    assert await stop(second, signal.SIGKILL) == -signal.SIGKILL
    third = await serve(http, db, tmp_path / "third.log")
    assert await stop(third) == 0


def test_the_lock_is_the_files_names_its_holder_and_is_released_on_exit(tmp_path: Path):
    db = tmp_path / "rota.db"
    with hold_database(db):  # a database that does not exist yet: created empty, and locked
        assert db.stat().st_size == 0
        os.link(db, tmp_path / "linked.db")
        for name in (db, tmp_path / "linked.db"):
            with pytest.raises(DatabaseInUse) as refused, hold_database(name):
                pass
            assert refused.value.pid == os.getpid()  # found in /proc/locks by the file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linked.db", "rota.db"]  # no lock file
    # Free, a file of two names is still refused: SQLite would keep a log beside each.
    with pytest.raises(DatabaseLinked) as linked, hold_database(tmp_path / "linked.db"):
        pass
    assert linked.value.links == 2
    db.unlink()
    with hold_database(tmp_path / "linked.db"):
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


async def test_tokens_refuse_a_second_name_of_a_running_servers_file(tmp_path: Path,
                                                                     http: httpx.AsyncClient):
    """Through a hard link, SQLite keeps another write-ahead log: a token written there was
    never seen by the server on the first name (a new-user trial, issue 20). Refused in one
    line; the server's own name still works."""
    db = tmp_path / "rota.db"
    server = await serve(http, db, tmp_path / "server.log")
    try:
        os.link(db, tmp_path / "hard.db")
        for name in (tmp_path / "hard.db", db):
            code, out, err = await rota("tokens", "create", "--scope", "producer", "--db",
                                        str(name))
            assert (code, out) == (1, ""), out
            assert err.startswith(f"error: {name} has 2 hard links: SQLite keeps"), err
            assert err.count("\n") == 1
        (tmp_path / "hard.db").unlink()
        code, out, err = await rota("tokens", "create", "--scope", "admin", "--db", str(db))
        assert code == 0 and out.startswith("rota_"), err
    finally:
        assert await stop(server) == 0
