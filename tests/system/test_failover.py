"""A worker given several servers moves to the next one when its server goes away, and a
producer client moves on connection errors (never on an error answer).

Each test runs two independent servers (each its own SQLite file, the same spec pushed
to both): the worker runs a job on A; A stops (gracefully, or kill -9 as a `rota serve`
process); the worker connects to B, by itself, and runs the jobs enqueued there. Servers
that share one PostgreSQL database are the real use; two files are enough to show where
the worker goes, and that it registers again and runs work on the server it lands on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from conftest import Api, Live, start_server, stop_server, write_spec
from helpers import free_port, spawn_serve, wait_until
from helpers import rota
from test_cli import WORKER_MODULE
from test_cli_failures import one_line

from rota import AsyncClient, Client, JobContext, Worker
from rota.client.client import ApiError


@contextlib.asynccontextmanager
async def two_servers(tmp_path: Path) -> AsyncIterator[tuple[Live, Live]]:
    """Servers A and B in this process, each on its own file, with spec echo on both."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = await start_server(tmp_path / "a")
    b = await start_server(tmp_path / "b")
    try:
        echo = write_spec(tmp_path / "specs", "echo")
        for server in (a, b):
            await server.push(echo)
        yield a, b
    finally:
        for server in (a, b):
            if not server.server.test_task.done():  # type: ignore[attr-defined]
                await stop_server(server)


async def runs_a_job(server: Api, where: str, timeout: float = 10.0) -> None:
    job = await server.enqueue("echo", {"on": where})
    done = await server.wait_state(job["id"], "completed", timeout=timeout)
    assert done["result"] == {"echoed": {"on": where}}


def test_a_worker_takes_one_url_or_several_and_checks_them_all_at_once():
    assert Worker(url="http://127.0.0.1:8000").urls == ["ws://127.0.0.1:8000/work"]
    worker = Worker(url=["http://127.0.0.1:8000", "wss://b.internal/", "ws://127.0.0.1:8000/work"])
    # Two spellings of one server are one stop; the first URL is the one in use.
    assert worker.urls == ["ws://127.0.0.1:8000/work", "wss://b.internal/work"]
    assert worker.server_url == worker.url == "ws://127.0.0.1:8000/work"
    worker.url = "http://c:9000"  # (as `rota worker` and the test fixtures set it)
    assert worker.urls == ["ws://c:9000/work"]
    for bad in (["http://127.0.0.1:8000", "127.0.0.1:8001"], ["http://"], ["http://a:port"]):
        with pytest.raises(ValueError, match="base URL") as refused:
            Worker(url=bad)
        assert repr(bad[-1]) in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="at least one server"):
        Worker(url=[])


async def test_a_worker_moves_to_the_next_server_when_its_server_stops(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    async with two_servers(tmp_path) as (a, b):
        nobody = f"http://127.0.0.1:{free_port()}"  # refused: the worker goes on to A
        worker = Worker(url=[nobody, a.base, b.base], specs_dir=tmp_path / "specs",
                        heartbeat_interval=0.1, handle_signals=False)

        @worker.handler("echo")
        async def echo(ctx: JobContext) -> dict[str, object]:
            return {"echoed": ctx.args}

        task = asyncio.create_task(worker.run(), name="sdk-failover")
        try:
            await wait_until(lambda: worker.connected.is_set() or task.done(), what="connect")
            assert worker.server_url == a.ws
            await runs_a_job(a, "a")
            await stop_server(a)  # graceful: A says it is shutting down, and closes
            await wait_until(lambda: worker.server_url == b.ws or task.done(), what="switch")
            await runs_a_job(b, "b")
            assert worker.server_url == b.ws and not task.done()
        finally:
            worker.stop()
            await asyncio.wait_for(task, 10)
    # One line per switch: where it went, and why it left.
    assert f"cannot connect to ws://127.0.0.1:{nobody.rsplit(':', 1)[1]}/work" in caplog.text
    assert f"switching to {a.ws}" in caplog.text
    left = next(line for line in caplog.text.splitlines() if f"connection to {a.ws} lost" in line)
    assert f"switching to {b.ws}" in left, left


async def test_the_server_it_moves_to_hears_of_the_job_it_holds(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """As on any reconnect, the registration names the runs the worker holds. B's file
    never had A's job, so B tells it to stop that run; servers that share one database
    take it back instead."""
    async with two_servers(tmp_path) as (a, b):
        worker = Worker(url=[a.base, b.base], specs_dir=tmp_path / "specs",
                        heartbeat_interval=0.1, handle_signals=False)
        started, stopped = asyncio.Event(), asyncio.Event()

        @worker.handler("echo")
        async def echo(ctx: JobContext) -> None:
            started.set()
            try:
                await asyncio.Event().wait()  # runs until it is told to stop
            finally:
                stopped.set()

        task = asyncio.create_task(worker.run(), name="sdk-failover-held")
        try:
            await wait_until(lambda: worker.connected.is_set() or task.done(), what="connect")
            job = await a.enqueue("echo")
            await asyncio.wait_for(started.wait(), 10)
            await stop_server(a)
            await asyncio.wait_for(stopped.wait(), 10)  # B's cancel: reservation_lost
            # (the handler's finally runs before the SDK lets go of the run: CI saw it held)
            await wait_until(lambda: not worker.running_jobs, what="the run let go")
            assert worker.server_url == b.ws
        finally:
            worker.stop()
            await asyncio.wait_for(task, 10)
    assert f"reservation lost worker={worker.worker_id} jobs={job['id']}" in caplog.text


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
async def test_rota_worker_moves_to_a_surviving_server(tmp_path: Path, stop: str):
    """A is `rota serve` in a process of its own, B a server here; the worker is
    `rota worker`, given both URLs by --url twice (kill -9) or by ROTA_URL (SIGTERM)."""
    (tmp_path / "b").mkdir()
    b = await start_server(tmp_path / "b")
    a = Api()
    a.port = free_port()
    worker: asyncio.subprocess.Process | None = None
    server: asyncio.subprocess.Process | None = None
    log = tmp_path / "worker.log"
    async with httpx.AsyncClient(base_url=a.base, timeout=10) as a.http:
        try:
            server = await spawn_serve(a.http, ["--port", str(a.port), "--db", str(tmp_path / "a.db")],
                                       tmp_path / "a.log")
            echo = write_spec(tmp_path / "specs", "echo")
            for live in (a, b):
                await live.push(echo)
            (tmp_path / "demo_worker.py").write_text(WORKER_MODULE)
            if stop == "kill -9":
                urls, env = ["--url", a.base, "--url", b.base], {}
            else:
                urls, env = [], {"ROTA_URL": f"{a.base},{b.base}"}
            with log.open("wb") as sink:
                worker = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "rota", "worker", "demo_worker:worker", *urls,
                    cwd=tmp_path, env={**os.environ, **env}, stdout=sink, stderr=sink)
            await runs_a_job(a, "a", timeout=15)
            if stop == "kill -9":
                server.kill()
            else:
                server.send_signal(signal.SIGTERM)
            await asyncio.wait_for(server.wait(), 15)
            await runs_a_job(b, "b", timeout=15)
            [shown] = (await b.http.get("/workers")).json()["workers"]
            assert shown["pid"] == worker.pid
            worker.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(worker.wait(), 15) == 0
        finally:
            for proc in (worker, server):
                if proc is not None and proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            await stop_server(b)
    said = log.read_text()
    assert f"switching to {b.ws}" in said, said


async def test_rota_worker_refuses_a_bad_url_in_its_list_in_one_line(tmp_path: Path):
    (tmp_path / "w.py").write_text("from rota import Worker\nworker = Worker(specs_dir='.')\n"
                                   "worker.handler('echo')(lambda ctx: ctx.args)\n")
    good = f"http://127.0.0.1:{free_port()}"
    code, _, err = await rota("worker", "w:worker", "--url", good, "--url", "localhost:8000",
                              cwd=tmp_path)
    assert "not 'localhost:8000'" in one_line(code, err, "a bad second --url")
    code, _, err = await rota("worker", "w:worker", cwd=tmp_path,
                              env={"ROTA_URL": f"{good}, ftp://x"})
    assert "not 'ftp://x'" in one_line(code, err, "a bad URL in ROTA_URL")


# -- producer clients ----------------------------------------------------------------------
async def test_a_producer_client_moves_on_connection_errors_and_never_on_an_answer(
        tmp_path: Path):
    async with two_servers(tmp_path) as (a, b):
        nobody = f"http://127.0.0.1:{free_port()}"
        client = Client([nobody, a.base, b.base], timeout=5)
        try:
            # Refused: nothing was sent, so the enqueue goes on to A within this call.
            assert (await asyncio.to_thread(client.enqueue, "echo", id="one")).created
            assert client.url == a.base and (await a.job("one"))["state"] == "available"
            with pytest.raises(ApiError) as refused:  # an answer: the same on every server
                await asyncio.to_thread(client.enqueue, "nope")
            assert refused.value.status == 422 and client.url == a.base
            await stop_server(a)
            assert (await asyncio.to_thread(client.specs))["specs"]  # asked of B
            assert client.url == b.base
            await asyncio.to_thread(client.enqueue, "echo", id="two")
            assert (await b.job("two"))["state"] == "available"
        finally:
            client.close()

        async with AsyncClient([nobody, b.base]) as producer:
            job = await producer.enqueue("echo", id="three")
            assert job.created and producer.url == b.base
            with pytest.raises(ApiError) as refused:
                await producer.enqueue("nope")
            assert refused.value.status == 422 and producer.url == b.base


async def test_a_request_that_may_have_been_carried_out_is_not_sent_again(tmp_path: Path):
    async with two_servers(tmp_path) as (_, b):
        with socket.socket() as silent:  # the kernel accepts; nobody ever answers
            silent.bind(("127.0.0.1", 0))
            silent.listen()
            first = f"http://127.0.0.1:{silent.getsockname()[1]}"
            with Client([first, b.base], timeout=0.3) as client:
                with pytest.raises(ApiError) as caught:  # it may be stored on the first
                    await asyncio.to_thread(client.enqueue, "echo", id="once")
                assert caught.value.code == "no_answer" and first in caught.value.message
                assert client.url == b.base  # the next request goes to B
                with pytest.raises(ApiError) as missing:
                    await asyncio.to_thread(client.job, "once")
                assert missing.value.status == 404  # B was asked, and never sent the enqueue
            async with AsyncClient([first, b.base], timeout=0.3) as producer:
                # A read means the same thing twice: it goes on to B within the call.
                with pytest.raises(ApiError) as missing:
                    await producer.job("once")
                assert missing.value.status == 404 and producer.url == b.base


async def test_the_commands_beside_a_worker_read_a_rota_url_of_several_servers(tmp_path: Path):
    """One ROTA_URL serves a deploy's `rota worker` and its other commands alike."""
    async with two_servers(tmp_path) as (a, _):
        nobody = f"http://127.0.0.1:{free_port()}"
        code, out, err = await rota("specs", "list", env={"ROTA_URL": f"{nobody}, {a.base}"})
        assert code == 0 and out.startswith("echo"), err
        code, _, err = await rota("jobs", "list", env={"ROTA_URL": f"{nobody},{nobody}/x"})
        assert f"cannot reach Rota at any of {nobody}, {nobody}/x" in one_line(code, err, "none")
        code, _, err = await rota("tail", "--url", f"{a.base},{nobody}")
        assert "give it one --url" in one_line(code, err, "tail of two servers")
