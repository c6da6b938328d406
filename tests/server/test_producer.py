"""The asyncio producer client: concurrent enqueues share requests, and each caller still
gets its own answer, after its own job is committed, or its own error."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sqlite3
from pathlib import Path

import pytest
from conftest import Live, write_spec

from rota.client.client import ApiError
from rota.client.producer import AsyncClient, AsyncJob


def stored_ids(live: Live) -> set[str]:
    with contextlib.closing(sqlite3.connect(live.settings.db)) as db:
        return {row[0] for row in db.execute("SELECT id FROM jobs")}


async def test_a_lone_enqueue_goes_at_once_in_the_sync_clients_shape(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    async with AsyncClient(live.base) as client:
        job = await client.enqueue("echo", {"n": 1}, id="one", priority=3)
        assert job.created is True and client.requests == 1
        assert (job.id, job.state, job.view["priority"]) == ("one", "available", 3)
        assert (job["job"], job["created"]) == (job.view, True)  # the old dict's shape
        assert (await client.job("one"))["args"] == {"n": 1}
    assert stored_ids(live) == {"one"}


async def test_many_concurrent_enqueues_share_few_requests_and_all_are_stored(
        live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    async with AsyncClient(live.base, max_in_flight=2) as client:
        answers = await asyncio.gather(*(client.enqueue("echo", {"n": n}) for n in range(500)))
        assert client.requests <= 10  # 500 callers, a handful of requests
    ids = [a["job"]["id"] for a in answers]
    assert len(set(ids)) == 500 and all(a["created"] for a in answers)
    assert stored_ids(live) == set(ids)  # every caller was answered after its commit


async def test_a_refused_job_fails_only_its_own_caller(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo", extra='[args.n]\ntype = "integer"\n'))
    async with AsyncClient(live.base, max_in_flight=1) as client:
        results = await asyncio.gather(
            client.enqueue("echo", {"n": 1}, id="a"),
            client.enqueue("nope", {}),
            client.enqueue("echo", {"n": "not a number"}),
            client.enqueue("echo", {"n": 2}, id="b"),
            return_exceptions=True)
    good, unknown, invalid, other = results
    assert isinstance(good, AsyncJob) and isinstance(other, AsyncJob)
    assert isinstance(unknown, ApiError) and (unknown.status, unknown.code) == (422, "unknown_spec")
    assert isinstance(invalid, ApiError) and (invalid.status, invalid.code) == (422, "invalid_args")
    assert stored_ids(live) == {"a", "b"}


async def test_a_repeated_id_is_the_same_job_and_a_different_one_conflicts(
        live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    async with AsyncClient(live.base, max_in_flight=1) as client:
        first, again, clash = await asyncio.gather(
            client.enqueue("echo", {"n": 1}, id="dup"),
            client.enqueue("echo", {"n": 1}, id="dup"),
            client.enqueue("echo", {"n": 2}, id="dup"),
            return_exceptions=True)
    assert first["created"] is True and again["created"] is False  # type: ignore[index]
    assert isinstance(clash, ApiError) and (clash.status, clash.code) == (409, "id_conflict")


async def test_a_batch_is_cut_before_the_servers_body_limit(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    big = "x" * 100_000  # 12 of them pass 1 MiB together; each alone is fine
    async with AsyncClient(live.base, max_in_flight=1) as client:
        answers = await asyncio.gather(*(client.enqueue("echo", {"s": big}) for _ in range(12)))
    assert all(a["created"] for a in answers) and len(stored_ids(live)) == 12


async def test_a_caller_that_gives_up_hurts_nobody_else(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    async with AsyncClient(live.base, max_in_flight=1) as client:
        first = asyncio.create_task(client.enqueue("echo", {}, id="first"))
        quitter = asyncio.create_task(client.enqueue("echo", {}, id="quitter"))
        stayer = asyncio.create_task(client.enqueue("echo", {}, id="stayer"))
        await asyncio.sleep(0)  # all three are waiting or in flight  # noqa: sleep-ok
        quitter.cancel()
        assert (await first)["created"] and (await stayer)["created"]
        with pytest.raises(asyncio.CancelledError):
            await quitter
    assert {"first", "stayer"} <= stored_ids(live)  # the quitter's may be stored too


async def test_an_unreachable_server_fails_every_caller_clearly():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    async with AsyncClient(f"http://127.0.0.1:{port}") as client:
        results = await asyncio.gather(*(client.enqueue("echo", {}) for _ in range(5)),
                                       return_exceptions=True)
    assert all(isinstance(r, ApiError) and r.code == "unreachable" for r in results)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_batch"):
        AsyncClient(max_batch=10_001)
    with pytest.raises(ValueError, match="max_in_flight"):
        AsyncClient(max_in_flight=0)


async def _silent_server() -> tuple[asyncio.Server, int, list[asyncio.StreamWriter]]:
    """A server that reads requests and never answers: the producer's connection is made."""
    held: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read(1 << 20)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], held


async def test_a_timeout_says_the_job_may_be_stored_not_that_the_server_is_unreachable():
    server, port, held = await _silent_server()
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}", timeout=0.3) as client:
            results = await asyncio.gather(*(client.enqueue("echo", {}) for _ in range(3)),
                                           return_exceptions=True)
    finally:
        for writer in held:
            writer.close()
        server.close()
    assert all(isinstance(r, ApiError) and r.code == "no_answer" for r in results), results
    assert "timed out" in results[0].message and "same job id" in results[0].message


async def test_a_server_that_closes_without_answering_is_no_answer_with_a_reason():
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with AsyncClient(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(ApiError) as caught:
                await client.enqueue("echo", {})
    finally:
        server.close()
    assert caught.value.code == "no_answer"
    assert caught.value.message.split("(")[1].split(")")[0].strip()  # a reason, not blank


async def test_a_closed_client_says_so_and_leaves_no_stray_task_error(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    client = AsyncClient(live.base)
    await client.enqueue("echo", {})
    await client.aclose()
    with pytest.raises(ApiError) as caught:
        await client.enqueue("echo", {})
    assert caught.value.code == "client_closed"
    with pytest.raises(ApiError):
        await client.job("nope")
    assert errors == []


def test_a_client_used_from_a_second_event_loop_says_so():
    client = AsyncClient("http://127.0.0.1:9")
    with pytest.raises(ApiError):  # nothing listens on port 9: unreachable, in loop one
        asyncio.run(client.enqueue("echo", {}))
    with pytest.raises(ApiError) as caught:
        asyncio.run(client.enqueue("echo", {}))
    assert caught.value.code == "client_error" and "event loop" in caught.value.message


def test_the_sync_client_tells_a_timeout_from_an_unreachable_server():
    from rota.client.client import Client

    with socket.socket() as listener:  # accepts (the kernel does) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with Client(f"http://127.0.0.1:{port}", timeout=0.2) as client, \
                pytest.raises(ApiError) as caught:
            client.enqueue("echo", {})
    assert caught.value.code == "no_answer" and "timed out" in caught.value.message
    with Client(f"http://127.0.0.1:{port}", timeout=0.2) as client, \
            pytest.raises(ApiError) as caught:
        client.enqueue("echo", {})
    assert caught.value.code == "unreachable" and "is the server running" in caught.value.message
