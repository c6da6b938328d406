"""The producer clients' job handles, against a real server and a real worker: the fields
of what ``enqueue`` returns, and ``result(timeout=)`` for a completed, a discarded and a
cancelled job, one not finished in time, and a wait longer than one long poll."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, RawWorker, start_server, stop_server, write_spec
from helpers import wait_until

from rota import ApiError, AsyncClient, AsyncJob, Client, Job, JobContext, JobError, ResultTimeout, Worker


async def serve_jobs(live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]],
                     directory: Path) -> None:
    """A worker for ``add``, which returns a sum, and ``explode``, which fails for good
    on its first attempt."""
    await live.push(write_spec(directory, "add"),
                    write_spec(directory, "explode", extra="[retry]\nmax_attempts = 1\n"))
    worker = Worker(specs_dir=directory, heartbeat_interval=0.2)

    @worker.handler("add")
    async def add(ctx: JobContext) -> int:
        return int(ctx.args["a"]) + int(ctx.args["b"])

    @worker.handler("explode")
    async def explode(ctx: JobContext) -> None:
        raise ValueError("the widget melted")

    await sdk_worker(worker)


async def test_the_sync_client_returns_a_handle_whose_result_waits(
        live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]], tmp_path: Path):
    await serve_jobs(live, sdk_worker, tmp_path)

    def produce() -> None:  # blocking calls: on a thread, off the server's event loop
        with Client(live.base) as client:
            job = client.enqueue("add", {"a": 2, "b": 3}, id="sum", priority=4)
            assert isinstance(job, Job) and job.created
            assert (job.id, job.spec, job.state) == ("sum", "add", "available")
            assert job.view["priority"] == 4 and job.view["args"] == {"a": 2, "b": 3}
            assert job.result(timeout=10) == 5
            assert job.refresh().state == "completed"
            assert client.enqueue("add", {"a": 2, "b": 3}, id="sum", priority=4).created is False
            doomed = client.enqueue("explode")
            with pytest.raises(JobError) as caught:
                doomed.result(timeout=10)
            failure = caught.value
            assert (failure.job_id, failure.state) == (doomed.id, "discarded")
            assert (failure.error_type, failure.error_message) == ("ValueError", "the widget melted")
            assert "ValueError: the widget melted" in str(failure)

    await asyncio.to_thread(produce)


async def test_the_async_client_returns_a_handle_whose_result_waits(
        live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]], tmp_path: Path):
    await serve_jobs(live, sdk_worker, tmp_path)
    async with AsyncClient(live.base) as client:
        jobs = await asyncio.gather(*(client.enqueue("add", {"a": n, "b": 1}) for n in range(20)))
        assert all(isinstance(job, AsyncJob) and job.spec == "add" for job in jobs)
        results = await asyncio.gather(*(job.result(timeout=10) for job in jobs))
        assert results == [n + 1 for n in range(20)]
        assert (await jobs[0].refresh()).state == "completed"
        with pytest.raises(JobError) as caught:
            await (await client.enqueue("explode")).result(timeout=10)
        assert (caught.value.state, caught.value.error_type) == ("discarded", "ValueError")


async def test_a_cancelled_job_raises_job_error_without_a_worker_error(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "add"))
    async with AsyncClient(live.base) as client:
        job = await client.enqueue("add", {"a": 1, "b": 1}, delay=3600)
        assert job.state == "scheduled"
        await client.cancel(job.id)
        with pytest.raises(JobError) as caught:
            await job.result(timeout=5)
    assert (caught.value.state, caught.value.error_type, caught.value.error) == (
        "cancelled", None, None)


async def test_a_job_not_finished_in_time_raises_a_timeout_error(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "add"))  # and no worker: it waits
    async with AsyncClient(live.base) as client:
        job = await client.enqueue("add", {"a": 1, "b": 1})
        for timeout in (0, 0.2):
            with pytest.raises(ResultTimeout) as caught:
                await job.result(timeout=timeout)
            assert isinstance(caught.value, TimeoutError)
            assert (caught.value.job_id, caught.value.state) == (job.id, "available")

    def wait_sync() -> None:
        with Client(live.base) as client, pytest.raises(TimeoutError, match="not finished"):
            client.wait(job.id, timeout=0.2)

    await asyncio.to_thread(wait_sync)


class CountingAsyncClient(AsyncClient):
    """A real client that counts its long polls."""

    polls = 0

    async def result(self, job_id: str, *, wait: float = 0) -> dict[str, Any]:
        self.polls += 1
        return await super().result(job_id, wait=wait)


class CountingClient(Client):
    polls = 0

    def result(self, job_id: str, *, wait: float = 0) -> dict[str, Any]:
        self.polls += 1
        return super().result(job_id, wait=wait)


async def test_a_wait_longer_than_the_servers_longest_poll_polls_again(tmp_path: Path):
    # A server whose longest poll is 0.1 s refuses ?wait=0.2 (400): a result() of 30 s
    # is waited out in polls of 0.1 s.
    live = await start_server(tmp_path, max_result_wait=0.1)
    raw = await RawWorker.open(live.ws)
    try:
        spec = write_spec(tmp_path, "add")
        await live.push(spec)
        async with CountingAsyncClient(live.base, max_wait=0.1) as client:
            job = await client.enqueue("add", {"a": 1, "b": 1})
            waiting = asyncio.create_task(job.result(timeout=30))
            await wait_until(lambda: client.polls >= 3, what="three long polls")
            await raw.register([spec])
            [copy] = await raw.jobs(1)
            await raw.complete(copy, result=2)
            assert await asyncio.wait_for(waiting, 10) == 2

        def time_out() -> int:  # sync: 0.5 s of polls of 0.1 s, then ResultTimeout
            with CountingClient(live.base, max_wait=0.1) as sync_client:
                other = sync_client.enqueue("add", {"a": 2, "b": 2})
                with pytest.raises(ResultTimeout):
                    other.result(timeout=0.5)
                return sync_client.polls

        # More than one poll: the wait went on past the server's longest (how many fit
        # depends on the machine's load, so no more is asserted).
        assert await asyncio.to_thread(time_out) >= 2
    finally:
        await raw.ws.close()
        await stop_server(live)


def test_handles_keep_the_old_answers_shape_for_code_that_reads_it():
    view = {"id": "j1", "spec": "add", "state": "available"}
    job = Job(Client("http://127.0.0.1:9"), view, True)
    assert (job["job"], job["created"]) == (view, True)
    with pytest.raises(KeyError):
        job["id"]
    assert repr(job) == "<Job j1 add available>"


async def test_a_client_given_no_url_or_token_reads_rota_url_and_rota_token(
        live: Live, monkeypatch: pytest.MonkeyPatch):
    """As the CLI does (issue 22): ``Client(os.environ.get("ROTA_URL"))`` with it unset is
    the default, not a TypeError; a value of the wrong type is named."""
    monkeypatch.delenv("ROTA_URL", raising=False)
    monkeypatch.delenv("ROTA_TOKEN", raising=False)
    assert Client(None).url == Client().url == "http://127.0.0.1:8000"
    monkeypatch.setenv("ROTA_URL", f" {live.base}/ ,http://127.0.0.1:9")
    monkeypatch.setenv("ROTA_TOKEN", "rota_0123456789ab_" + "x" * 43)

    def read() -> Any:  # blocking calls: on a thread, off the server's event loop
        with Client() as client:
            assert client.servers.urls == [live.base, "http://127.0.0.1:9"]
            assert client._transports[0].headers["Authorization"].endswith("x" * 43)
            return client.specs()  # (an open server minds no token)

    assert await asyncio.to_thread(read) == {"specs": []}
    async with AsyncClient(None) as client:
        with pytest.raises(ApiError) as missing:  # (it reached the server)
            await client.job("nope")
        assert client.url == live.base and missing.value.code == "not_found"
        assert client._token  # ROTA_TOKEN's
    assert not Client(token="")._transports[0].token  # "": no token, whatever ROTA_TOKEN says
    for bad, named in (({"url": 8000}, "url must be"), ({"url": [None]}, "url must be"),
                       ({"token": 17}, "token must be")):
        for make in (Client, AsyncClient):
            with pytest.raises(TypeError, match=named):
                make(**bad)
