"""HTTP requests that stay open (issue 20): GET /events streams and result long-polls
(GET /jobs/{id}/result?wait=). Revoking a token ends every one of its requests, and one
token cannot hold every connection the server has. Real parts: a server on loopback,
tokens written to its file and revoked there by `rota tokens revoke`, httpx clients and
raw sockets."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from conftest import Live, start_server, stop_server, write_spec
from helpers import wait_until
from helpers import bearer, make_token, make_tokens

from rota.cli.app import main


@pytest.fixture
async def waits(tmp_path: Path) -> AsyncIterator[Live]:
    """Auth on, a spec and no worker (jobs wait), streams silent for a minute, at most
    four requests that wait per token and twelve connections in all."""
    live = await start_server(tmp_path, events_keepalive=60.0, max_waits_per_token=4,
                              max_connections=12)
    admin = await make_token(live, "admin")
    live.http.headers.update(bearer(admin))
    await live.push(write_spec(tmp_path / "specs", "echo"))
    try:
        yield live
    finally:
        await stop_server(live)


def revoke(live: Live, secret: str) -> None:
    """As an operator does: `rota tokens revoke` on the server's file."""
    result = CliRunner().invoke(main, ["tokens", "revoke", secret.split("_")[1],
                                       "--db", str(live.settings.db)])
    assert result.exit_code == 0, result.output


def stalled_subscriber(live: Live, secret: str) -> socket.socket:
    """A GET /events client that never reads what it is sent (a small receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", live.port))
    sock.sendall(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                 + secret.encode() + b"\r\n\r\n")
    return sock


async def enqueue(live: Live, secret: str) -> str:
    """A job of this producer's (a producer sees only its own)."""
    answer = await live.http.post("/jobs", json={"spec": "echo"}, headers=bearer(secret))
    assert answer.status_code == 201, answer.text
    return str(answer.json()["job"]["id"])


async def test_revoking_a_token_ends_its_streams_and_answers_its_waits_401(waits: Live):
    watcher, producer = await make_tokens(waits, ("admin", None), ("producer", None))
    job = await enqueue(waits, producer)
    async with httpx.AsyncClient(base_url=waits.base, timeout=30) as http:
        stream_lines: list[str] = []

        async def follow() -> None:
            async with http.stream("GET", "/events", headers=bearer(watcher)) as reply:
                assert reply.status_code == 200
                async for line in reply.aiter_lines():
                    stream_lines.append(line)

        stream = asyncio.create_task(follow())
        poll = asyncio.create_task(http.get(f"/jobs/{job}/result?wait=60",
                                            headers=bearer(producer)))
        stalled = stalled_subscriber(waits, watcher)
        try:
            coordinator = waits.coordinator
            await wait_until(lambda: coordinator.watching.subscribers == 2
                             and len(coordinator.watching.waiters.get(job, [])) == 1,
                             what="the stream, the stalled stream and the wait to be open")
            # Events until the stalled subscriber's socket is full (the kernel takes a
            # few MB) and its stream waits: long queue names make long events.
            for _ in range(20):
                answer = await waits.http.post("/jobs/batch", json={"jobs": [
                    {"spec": "echo", "queue": "q" * 128} for _ in range(1000)]})
                assert answer.status_code == 200
            revoke(waits, watcher)
            revoke(waits, producer)
            # The token loop reads the file within a heartbeat interval (0.2 s here).
            await asyncio.wait_for(stream, 10)  # the stream ended, cleanly
            answer = await asyncio.wait_for(poll, 10)
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "token_revoked"
            # The subscriber that does not read was dropped: nothing of it is held.
            await wait_until(lambda: coordinator.watching.subscribers == 0, timeout=10,
                             what="every stream of the revoked token to end")
            assert not coordinator.watching.waiters and not coordinator.waits
            # And the tokens are refused from now on.
            again = await http.get(f"/jobs/{job}/result?wait=1", headers=bearer(producer))
            assert again.status_code == 401
        finally:
            stalled.close()
            stream.cancel()
            poll.cancel()
            await asyncio.gather(stream, poll, return_exceptions=True)
    # The admin's own requests are untouched.
    assert (await waits.http.get(f"/jobs/{job}/result?wait=0.1")).status_code == 202


async def test_one_token_cannot_take_every_connection_with_result_waits(
        waits: Live):
    hog, other = await make_tokens(waits, ("producer", None), ("producer", None))
    job = await enqueue(waits, hog)
    clients = [httpx.AsyncClient(base_url=waits.base, timeout=30) for _ in range(5)]
    try:
        polls = [asyncio.create_task(client.get(f"/jobs/{job}/result?wait=300",
                                                headers=bearer(hog)))
                 for client in clients[:4]]
        await wait_until(lambda: len(waits.coordinator.watching.waiters.get(job, [])) == 4,
                         what="the hog's four waits")
        # The fifth is over its share: refused at once, precisely.
        over = await clients[4].get(f"/jobs/{job}/result?wait=300", headers=bearer(hog))
        assert over.status_code == 429, over.text
        assert over.json()["error"]["code"] == "too_many_waits"
        assert over.headers["retry-after"] == "1"
        assert "--max-waits-per-token" in over.json()["error"]["message"]
        # Another token still waits (and is answered when its wait runs out).
        async with httpx.AsyncClient(base_url=waits.base, timeout=30) as fresh:
            mine = await fresh.get(f"/jobs/{await enqueue(waits, other)}/result?wait=0.2",
                                   headers=bearer(other))
        assert mine.status_code == 202, mine.text
        for poll in polls:
            assert not poll.done()
    finally:
        for client in clients:
            await client.aclose()
    await asyncio.gather(*polls, return_exceptions=True)


async def test_a_wait_whose_client_left_gives_its_share_back_at_once(waits: Live):
    """Four waits of a token whose clients leave, by the protocol's own route and by the
    ASGI one: each gave its place back only when its 300 s ran out, and the token's next
    wait was refused 429 meanwhile. (A client that pipelined a request behind its wait is
    not read until the wait's answer has gone, so its leaving is seen only then.)"""
    (producer,) = await make_tokens(waits, ("producer", None))
    job = await enqueue(waits, producer)

    def wait(path: str, extra: str = "") -> bytes:
        return (f"GET {path}?wait=300 HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}"
                f"Authorization: Bearer {producer}\r\n\r\n").encode()

    requests = [
        wait(f"/jobs/{job}/result"),  # served by the protocol itself (rota/server/direct.py)
        wait(f"/jobs/{job}/result"),
        wait(f"/jobs/%{ord(job[0]):02X}{job[1:]}/result"),  # by the ASGI route (an escape)
        wait(f"/jobs/{job}/result", "Expect: 100-continue\r\n"),  # ... (an Expect)
    ]
    gone = []
    for request in requests:
        reader, writer = await asyncio.open_connection("127.0.0.1", waits.port)
        writer.write(request)
        gone.append(writer)
    await wait_until(lambda: len(waits.coordinator.watching.waiters.get(job, [])) == 4,
                     what="the four waits")
    for writer in gone:
        writer.close()
    await wait_until(lambda: not waits.coordinator.watching.waiters.get(job),
                     what="the waits of the clients gone to end")
    async with httpx.AsyncClient(base_url=waits.base, timeout=30) as fresh:
        mine = await fresh.get(f"/jobs/{job}/result?wait=0.1", headers=bearer(producer))
    assert mine.status_code == 202, mine.text
    # (who may ask is judged before how: a worker's token with a bad wait is forbidden)
    (worker,) = await make_tokens(waits, ("worker", None))
    async with httpx.AsyncClient(base_url=waits.base, timeout=30) as client:
        refused = await client.get(f"/jobs/{job}/result?wait=soon", headers=bearer(worker))
    assert refused.status_code == 403, refused.text


async def test_healthz_is_answered_when_every_connection_is_taken(waits: Live):
    idle = [socket.create_connection(("127.0.0.1", waits.port)) for _ in range(12)]
    try:
        async with httpx.AsyncClient(base_url=waits.base, timeout=10) as fresh:
            health = await fresh.get("/healthz")
            assert health.status_code == 200, health.text
            assert json.loads(health.text)
            assert (await fresh.get("/specs")).status_code == 503  # the rest: the cap
    finally:
        for sock in idle:
            sock.close()
