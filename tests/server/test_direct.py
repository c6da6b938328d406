"""``POST /jobs`` and ``POST /jobs/batch`` served by the HTTP protocol itself
(rota/server/direct.py), driven by a raw peer: bodies in pieces and in chunks, pipelined
requests mixed with ones the ASGI app serves, refusals before the body, a client that
goes away mid-body or stops reading, HTTP/1.0, ``Connection: close`` and ``Expect:
100-continue``. The answers are the ones the routes gave through Starlette (the shared
cases are in test_express.py and test_security.py, which now reach this path)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import make_tokens, wait_until

from rota import JobContext, Worker
from rota.server import api
from rota.server.direct import POSTS, RESULTS, match

Answer = tuple[int, dict[str, str], bytes]


def post(path: str, body: bytes, *extra: bytes, length: bool = True,
         version: bytes = b"1.1") -> bytes:
    head = [b"POST " + path.encode() + b" HTTP/" + version, b"Host: 127.0.0.1", *extra]
    if length:
        head.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def job(job_id: str, spec: str = "echo") -> bytes:
    return json.dumps({"spec": spec, "id": job_id}).encode()


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in
               (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 5)
    return int(lines[0].split(" ")[1]), headers, body


class Peer:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, live: Live) -> Peer:
        return cls(*await asyncio.open_connection("127.0.0.1", live.settings.port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def answer(self) -> Answer:
        return await read_answer(self.reader)

    async def closed(self) -> bool:
        return await asyncio.wait_for(self.reader.read(), 5) == b""

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def echo(live: Live, tmp_path: Path) -> Live:
    await live.push(write_spec(tmp_path, "echo"))
    return live


def test_which_requests_the_protocol_serves_itself():
    assert match(b"POST", b"/jobs") == (POSTS[b"/jobs"], "/jobs", "", b"")
    assert match(b"POST", b"/jobs/batch?x=1") == (POSTS[b"/jobs/batch"], "/jobs/batch", "", b"x=1")
    assert match(b"GET", b"/jobs/j-1/result?wait=2") == (RESULTS, "/jobs/j-1/result", "j-1",
                                                         b"wait=2")
    # The rest go on to the app: other methods and paths, an empty or slashed id, and any
    # "%" (the app decodes the path, and the gate judges what it decodes to).
    for method, url in [(b"GET", b"/jobs//result"), (b"GET", b"/jobs/a/b/result"),
                        (b"GET", b"/jobs/result"), (b"PUT", b"/jobs"), (b"GET", b"/jobs"),
                        (b"POST", b"/jobs/"), (b"POST", b"/jobs/retry"),
                        (b"HEAD", b"/jobs/a/result"), (b"POST", b"/jobs/a/result"),
                        (b"GET", b"/jobs/batch"), (b"GET", b"/jobs/a%2Fb/result"),
                        (b"GET", b"/jobs/a%41/result"), (b"GET", "/jobs/é/result".encode()),
                        (b"POST", b"http://x/jobs")]:
        assert match(method, url) is None, (method, url)
    # A fragment is part of neither the path nor the query (as uvicorn parses a URL).
    assert match(b"GET", b"/jobs/a/result?wait=0#frag") == (RESULTS, "/jobs/a/result", "a",
                                                           b"wait=0")
    assert match(b"POST", b"/jobs#x") == (POSTS[b"/jobs"], "/jobs", "", b"")


async def test_the_hot_routes_never_reach_the_asgi_app(echo: Live,
                                                       monkeypatch: pytest.MonkeyPatch):
    async def unreachable(*args: Any) -> Any:
        raise AssertionError("a hot route went through the ASGI app")

    monkeypatch.setattr(api, "enqueue", unreachable)
    monkeypatch.setattr(api, "enqueue_batch", unreachable)
    monkeypatch.setattr(api, "job_result", unreachable)
    made = await echo.http.post("/jobs", json={"spec": "echo", "id": "d-1"})
    assert (made.status_code, made.json()["job"]["id"]) == (201, "d-1")
    assert made.headers["content-type"] == "application/json"
    assert "date" in made.headers  # uvicorn's default headers, as on every answer
    batch = await echo.http.post("/jobs/batch", json={"jobs": [{"spec": "echo"}]})
    assert [r["status"] for r in batch.json()["results"]] == [201]
    # With a query string too (Starlette's router ignores it for these routes).
    assert (await echo.http.post("/jobs?x=1", json={"spec": "echo"})).status_code == 201
    result = await echo.http.get("/jobs/d-1/result", params={"wait": "0"})
    assert (result.status_code, result.json()["state"]) == (202, "available")
    # Starlette's reading of a query: the last "wait" counts.
    late = await echo.http.get("/jobs/d-1/result?wait=x&wait=0")
    assert late.status_code == 202
    bad = await echo.http.get("/jobs/d-1/result?wait=0&wait=nan")
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_wait")
    missing = await echo.http.get("/jobs/nope/result")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")
    # Everything else on these paths still reaches the router.
    assert (await echo.http.put("/jobs", json={})).status_code == 405


async def test_a_result_waited_for_through_the_protocol_arrives_when_the_job_ends(
        echo: Live, tmp_path: Path):
    worker = Worker(url=echo.ws, specs_dir=tmp_path, heartbeat_interval=0.1)

    @worker.handler("echo")
    async def run(ctx: JobContext) -> Any:
        return {"ran": ctx.args}

    made = (await echo.http.post("/jobs", json={"spec": "echo", "id": "waited"})).json()
    waiting = asyncio.create_task(echo.http.get("/jobs/waited/result", params={"wait": "5"}))
    task = asyncio.create_task(worker.run())
    try:
        answer = await asyncio.wait_for(waiting, 10)
    finally:
        worker.stop()
        await task
    assert answer.status_code == 200
    assert answer.json() == {"id": made["job"]["id"], "state": "completed", "done": True,
                             "result": {"ran": {}}, "error": None}


async def test_pipelined_requests_are_answered_in_order_beside_asgi_ones(echo: Live):
    peer = await Peer.open(echo)
    await peer.send(post("/jobs", job("p-1")) + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                    + post("/jobs", job("p-2")) + post("/jobs", b"{bad")
                    + post("/jobs/batch", json.dumps({"jobs": [{"spec": "echo", "id": "p-3"}]})
                           .encode()))
    answers = [await peer.answer() for _ in range(5)]
    assert [status for status, _, _ in answers] == [201, 200, 201, 400, 200]
    assert json.loads(answers[0][2])["job"]["id"] == "p-1"
    assert json.loads(answers[2][2])["job"]["id"] == "p-2"
    assert json.loads(answers[3][2])["error"]["code"] == "malformed_json"
    assert json.loads(answers[4][2])["results"][0]["job"]["id"] == "p-3"
    peer.close()


async def test_a_body_in_pieces_and_in_chunks_is_read_whole(echo: Live):
    peer = await Peer.open(echo)
    request = post("/jobs", job("piece"))
    for start in range(0, len(request), 7):  # a few bytes at a time, each a write
        await peer.send(request[start:start + 7])
    status, _, body = await peer.answer()
    assert (status, json.loads(body)["job"]["id"]) == (201, "piece")
    assert _server_side(echo, peer).cycle.body == b""  # not kept while the connection idles
    payload = job("chunked")
    await peer.send(post("/jobs", b"", b"Transfer-Encoding: chunked", length=False))
    for part in (payload[:10], payload[10:]):
        await peer.send(b"%x\r\n%s\r\n" % (len(part), part))
    await peer.send(b"0\r\n\r\n")
    status, _, body = await peer.answer()
    assert (status, json.loads(body)["job"]["id"]) == (201, "chunked")
    peer.close()


@pytest.mark.parametrize("live", [{"max_body_bytes": 1000}], indirect=True)
async def test_a_body_over_the_limit_is_refused_before_it_is_read_and_the_connection_goes_on(
        echo: Live):
    peer = await Peer.open(echo)
    # Declared too large: refused at once, before a byte of it is sent.
    await peer.send(post("/jobs", b"", length=False)[:-4] + b"\r\nContent-Length: 5000\r\n\r\n")
    status, headers, body = await peer.answer()
    assert (status, json.loads(body)["error"]["code"]) == (413, "body_too_large")
    assert headers.get("connection") != "close"
    await peer.send(b"x" * 5000 + post("/jobs", job("after-413")))  # dropped, then served
    status, _, body = await peer.answer()
    assert (status, json.loads(body)["job"]["id"]) == (201, "after-413")
    # In chunks with no length: refused once past the limit.
    await peer.send(post("/jobs", b"", b"Transfer-Encoding: chunked", length=False)
                    + b"%x\r\n%s\r\n" % (1200, b"y" * 1200))
    status, _, body = await peer.answer()
    assert (status, json.loads(body)["error"]["code"]) == (413, "body_too_large")
    peer.close()
    assert [j["id"] for j in (await echo.http.get("/jobs")).json()["jobs"]] == ["after-413"]


def _server_side(live: Live, peer: Peer) -> Any:
    """The server's protocol object of ``peer``'s connection."""
    port = peer.writer.get_extra_info("sockname")[1]
    return next((c for c in live.server.server_state.connections if c.client[1] == port), None)


@pytest.mark.parametrize("path", ["/jobs", "/specs"])  # the protocol's route, the app's
async def test_a_refused_requests_body_is_dropped_and_the_connection_then_times_out(
        echo: Live, path: str):
    """A body refused before it arrived (here 401) is read and dropped, not kept, and
    once it has arrived the connection is idle: its keep-alive timer runs again, which the
    body's arrival had cancelled."""
    await make_tokens(echo, ("admin", None))
    peer = await Peer.open(echo)
    size = 500_000
    await peer.send(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    b"rota_0123456789ab_" + b"x" * 43 + b"\r\nContent-Length: %d\r\n\r\n" % size
                    + b"y" * (size - 1))
    status, _, body = await peer.answer()
    assert (status, json.loads(body)["error"]["code"]) == (401, "unauthorized")
    await peer.send(b"y")  # the last byte: the request is over
    protocol = await wait_until(lambda: _server_side(echo, peer), what="the connection")
    await wait_until(lambda: protocol.timeout_keep_alive_task is not None,
                     what="the keep-alive timer")
    assert not getattr(protocol.cycle, "chunks", [])  # nothing of the body kept
    peer.close()


async def test_a_caller_without_a_token_is_refused_before_its_body(echo: Live):
    admin, worker = await make_tokens(echo, ("admin", None), ("worker", None))
    peer = await Peer.open(echo)
    await peer.send(post("/jobs", b"", length=False)[:-4] + b"\r\nContent-Length: 100\r\n\r\n")
    status, headers, body = await peer.answer()  # no body sent: answered all the same
    assert (status, json.loads(body)["error"]["code"]) == (401, "unauthorized")
    assert headers["www-authenticate"].startswith("Bearer")
    await peer.send(b" " * 100)  # the rest, read and dropped
    await peer.send(post("/jobs/batch", b'{"jobs": []}', b"Authorization: Bearer " + worker.encode()))
    status, _, body = await peer.answer()
    assert (status, json.loads(body)["error"]["code"]) == (403, "forbidden")
    assert json.loads(body)["error"]["message"] == (
        "a worker token may not POST /jobs/batch: it takes a producer or admin token")
    await peer.send(post("/jobs", job("ok"), b"Authorization: Bearer " + admin.encode()))
    assert (await peer.answer())[0] == 201
    peer.close()


async def test_a_client_gone_mid_body_leaves_nothing_and_no_traceback(
        echo: Live, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="rota")
    peer = await Peer.open(echo)
    await peer.send(post("/jobs", job("half"))[:-10])
    await wait_until(lambda: any(echo.server.server_state.tasks), what="the request waiting")
    peer.writer.transport.abort()
    await wait_until(lambda: not echo.server.server_state.tasks, what="the request gone")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("went away before its body" in r.getMessage() for r in caplog.records)
    assert (await echo.http.get("/jobs")).json()["jobs"] == []
    assert (await echo.http.post("/jobs", json={"spec": "echo"})).status_code == 201


async def test_http_1_0_and_connection_close_end_the_connection_after_the_answer(echo: Live):
    for extra, version in [((), b"1.0"), ((b"Connection: close",), b"1.1")]:
        peer = await Peer.open(echo)
        await peer.send(post("/jobs", job(f"c-{version.decode()}"), *extra, version=version))
        status, headers, _ = await peer.answer()
        assert (status, headers["connection"]) == (201, "close")
        assert await peer.closed()
        peer.close()


async def test_expect_100_continue_is_answered_before_the_body(echo: Live):
    peer = await Peer.open(echo)
    payload = job("continued")
    await peer.send(post("/jobs", b"", b"Expect: 100-continue", length=False)[:-4]
                    + b"\r\nContent-Length: %d\r\n\r\n" % len(payload))
    assert await asyncio.wait_for(peer.reader.readuntil(b"\r\n\r\n"), 5) == (
        b"HTTP/1.1 100 Continue\r\n\r\n")
    await peer.send(payload)
    status, _, body = await peer.answer()
    assert (status, json.loads(body)["job"]["id"]) == (201, "continued")
    peer.close()


async def test_a_client_that_stops_reading_is_not_read_either(echo: Live):
    """A pipelining client that reads none of its answers: the first answer waits in the
    socket, and the requests behind it are neither run nor read until it has left (as
    uvicorn's own cycle does), so the server holds one answer, not one per request."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a window that fills at once
    sock.connect(("127.0.0.1", echo.settings.port))
    peer = Peer(*await asyncio.open_connection(sock=sock))
    batch = post("/jobs/batch", json.dumps({"jobs": [{"spec": "echo"}] * 1000}).encode())
    await peer.send(batch * 8)  # 8 answers of ~640 KB: more than the sockets hold

    def stored() -> int:
        with contextlib.closing(sqlite3.connect(echo.settings.db)) as conn:
            return conn.execute("SELECT count(*) FROM jobs").fetchone()[0]

    await wait_until(lambda: _flow_paused(echo), what="the server's writes paused")
    first = stored()
    await asyncio.sleep(0.3)  # noqa: sleep-ok (that nothing more is stored is the point)
    assert first == stored() < 8000
    answers = [await peer.answer() for _ in range(8)]  # reading again: each in turn
    assert [status for status, _, _ in answers] == [200] * 8
    assert stored() == 8000
    peer.close()


def _flow_paused(live: Live) -> bool:
    return any(getattr(c, "flow", None) is not None and c.flow.write_paused
               for c in live.server.server_state.connections)


async def test_a_shutdown_while_an_answer_drains_closes_the_connection_after_it(echo: Live):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", echo.settings.port))
    peer = Peer(*await asyncio.open_connection(sock=sock))
    await peer.send(post("/jobs/batch", json.dumps({"jobs": [{"spec": "echo"}] * 10_000})
                         .encode()))  # an answer of ~6 MB, which the client does not read
    protocol = await wait_until(lambda: _server_side(echo, peer), what="the connection")
    await wait_until(lambda: protocol.flow.write_paused, what="the server's writes paused")
    echo.server.request_exit()
    status, _, _ = await peer.answer()  # read at last: the answer is whole...
    assert status == 200
    # ...and the connection ends with it, as the server stops: not 5 s later, when its
    # keep-alive would have run out.
    assert await asyncio.wait_for(peer.reader.read(), 2.5) == b""
    await asyncio.wait_for(echo.server.test_task, 10)  # type: ignore[attr-defined]
    peer.close()


async def test_a_refusal_behind_a_trusted_proxy_logs_the_forwarded_client(
        echo: Live, caplog: pytest.LogCaptureFixture):
    await make_tokens(echo, ("admin", None))
    caplog.set_level(logging.INFO, logger="rota")
    peer = await Peer.open(echo)  # from 127.0.0.1, which uvicorn trusts by default
    await peer.send(post("/jobs", b"{}", b"X-Forwarded-For: 203.0.113.9"))
    assert (await peer.answer())[0] == 401
    assert any("client=203.0.113.9" in r.getMessage() for r in caplog.records)
    peer.close()
