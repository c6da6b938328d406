"""The HTTP edge (rota/server/httpedge.py) against raw clients that do what no HTTP
library does: pipeline answers they never read and then leave, send headers as a
chunked body's trailers, trickle the body of a request already refused. Each was found
by a review from outside; each is answered, or ends, as the docs say, and leaves no
traceback. Real parts: a server in this process on loopback, raw TCP sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
import uvloop
from conftest import Live
from helpers import make_tokens, raw_http
from wirepeer import log  # noqa: F401 (fixture: no traceback in the whole test's log)

from rota.server.httpedge import Corked


def test_an_answer_written_after_its_client_left_is_dropped_not_raised() -> None:
    # A pipelining client that read none of its answers and left: uvicorn's cycle for the
    # request in hand was not told, and its answer went to a closed transport, which
    # uvloop refuses with a RuntimeError (asyncio's own loop ignores it): an ERROR and a
    # traceback in the log, for a client doing nothing worse than leaving.
    async def scene() -> None:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[asyncio.Transport] = loop.create_future()
        lost: asyncio.Future[None] = loop.create_future()

        class Server(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                accepted.set_result(transport)  # type: ignore[arg-type]

            def connection_lost(self, exc: Exception | None) -> None:
                lost.set_result(None)

        server = await loop.create_server(Server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        transport = await accepted
        try:
            corked = Corked(transport, loop)
            corked.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")  # held
            client.abort()  # the client is gone (a reset)
            await asyncio.wait_for(lost, 5)
            corked.write(b"{}")  # the body, which joins the held head
            corked.write(b"more")  # and a later one alone: dropped, not raised
            corked.flush()
        finally:
            transport.abort()
            server.close()

    uvloop.run(scene())


def chunked_post(path: str, body: bytes, headers: bytes, trailers: bytes) -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers
            + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            + b"%x\r\n" % len(body) + body + b"\r\n0\r\n" + trailers + b"\r\n")


async def test_a_chunked_bodys_trailers_are_not_headers(
        live: Live, log: list[logging.LogRecord]) -> None:
    """uvicorn added trailers to the request's headers: an Authorization sent as one
    passed the door when the whole request came in one read, and not when it came in
    two. Each of the three routes the protocol serves itself, and one Starlette serves."""
    (secret,) = await make_tokens(live, ("admin", None))
    token = b"Authorization: Bearer " + secret.encode() + b"\r\n"
    body = json.dumps({"spec": "echo", "args": {}}).encode()
    for path in ("/jobs", "/jobs/batch", "/specs/echo/retire"):
        payload = json.dumps({"jobs": [{"spec": "echo"}]}).encode() if "batch" in path else body
        status, answer = await raw_http(live.settings.port,
                                        chunked_post(path, payload, b"", token))
        assert (status, json.loads(answer)["error"]["code"]) == (401, "unauthorized"), path
    # A token in the headers and another in a trailer: one token, not two; an Origin in
    # a trailer is no Origin. Both pass the door (to a server with no spec pushed).
    for trailer in (token, b"Origin: https://evil.example\r\n"):
        status, answer = await raw_http(live.settings.port,
                                        chunked_post("/jobs", body, token, trailer))
        assert (status, json.loads(answer)["error"]["code"]) == (422, "unknown_spec"), answer


@pytest.mark.parametrize("live", [{"body_timeout": 0.5}], indirect=True)
async def test_a_refused_requests_body_still_has_its_deadline(
        live: Live, log: list[logging.LogRecord]) -> None:
    """A request refused at the door is answered before its body is read; the rest must
    still come within --body-timeout (each byte put off the keep-alive timer before, so a
    client with no token could hold a connection for ever, a byte at a time). One whose
    body does come in time keeps its connection for the next request."""
    await make_tokens(live, ("admin", None))
    for head in (b"POST /jobs HTTP/1.1", b"PUT /specs HTTP/1.1"):  # (direct, Starlette)
        reader, writer = await asyncio.open_connection("127.0.0.1", live.settings.port)
        writer.write(head + b"\r\nHost: 127.0.0.1\r\nAuthorization: Bearer nothing\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        status, _ = await read_answer(reader)
        assert status == 401, head
        began = time.monotonic()
        ended = False
        while time.monotonic() - began < 5 and not ended:
            writer.write(b" ")  # a byte of the body now and then
            try:
                ended = await asyncio.wait_for(reader.read(), 0.1) == b""
            except TimeoutError:
                pass
        assert ended, f"{head!r}: still open after 5 s"
        writer.close()
    # A request pipelined behind one answered at once, its body short: its own route's
    # 408 answers it (the deadline of an answered request's body is not its own).
    admin = (await make_tokens(live, ("admin", None)))[0].encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", live.settings.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nPOST /jobs HTTP/1.1\r\n"
                 b"Host: 127.0.0.1\r\nAuthorization: Bearer " + admin + b"\r\n"
                 b"Content-Length: 20\r\n\r\n{\"spe")
    assert (await read_answer(reader))[0] == 200
    status, body = await read_answer(reader)
    assert (status, json.loads(body)["error"]["code"]) == (408, "body_timeout"), body
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", live.settings.port)
    refused = (b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer nothing\r\n"
               b"Content-Length: 2\r\n\r\n")
    writer.write(refused)
    assert (await read_answer(reader))[0] == 401
    writer.write(b"{}")  # the body's end, soon enough
    await asyncio.sleep(0.8)  # noqa: sleep-ok (past the deadline that must not fire now)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return int(head.split(b" ")[1]), await asyncio.wait_for(reader.readexactly(length), 5)


async def test_two_hosts_or_two_origins_are_refused_not_chosen_between(
        live: Live, log: list[logging.LogRecord]) -> None:
    """The gate checks Host (auth off: loopback names only) and Origin; with two, one
    was checked and the other could be the one a proxy or an app behind believed."""
    port = live.settings.port
    for extra in (b"Host: evil.example\r\nHost: 127.0.0.1\r\n",
                  b"Host: 127.0.0.1\r\nHost: 127.0.0.1\r\n",
                  b"Host: 127.0.0.1\r\nOrigin: http://127.0.0.1\r\nOrigin: http://127.0.0.1\r\n"):
        for line in (b"GET /specs HTTP/1.1\r\n", b"POST /jobs HTTP/1.1\r\n"):
            status, body = await raw_http(port, line + extra + b"Content-Length: 2\r\n\r\n{}")
            assert (status, json.loads(body)["error"]["code"]) == (400, "duplicate_header"), (
                line, extra)
    status, _ = await raw_http(port, b"GET /specs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 200
    # The dashboard's cookie stands for an Authorization header: not for a second Host.
    (secret,) = await make_tokens(live, ("admin", None))
    status, body = await raw_http(port, b"GET /specs HTTP/1.1\r\nHost: evil.example\r\n"
                                  b"Host: 127.0.0.1\r\nCookie: rota_session="
                                  + secret.encode() + b"\r\n\r\n")
    assert (status, json.loads(body)["error"]["code"]) == (400, "duplicate_header"), body


async def test_an_upgrade_to_http2_is_ignored_or_refused_never_half_read(
        live: Live, log: list[logging.LogRecord]) -> None:
    """``curl --http2`` to an http:// URL asks for an Upgrade to h2c. Without a body the
    request is served as HTTP/1.1 (RFC 9110 lets a server ignore an Upgrade); with one,
    which the HTTP parser would hand to the new protocol unread, it is refused, saying
    what to do, rather than answered "the body is empty". A WebSocket Upgrade with a
    body, on any route, is a handshake refused (it was never answered)."""
    port = live.settings.port
    h2c = b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABk\r\n"
    status, body = await raw_http(port, b"GET /specs HTTP/1.1\r\nHost: 127.0.0.1\r\n" + h2c
                                  + b"\r\n")
    assert status == 200, body
    job = json.dumps({"spec": "echo"}).encode()
    for path in (b"/jobs", b"/specs"):
        status, body = await raw_http(port, b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1"
                                      b"\r\n" + h2c + b"Content-Length: %d\r\n\r\n" % len(job)
                                      + job)
        assert (status, json.loads(body)["error"]["code"]) == (400, "upgrade_not_supported")
        assert "--http1.1" in json.loads(body)["error"]["message"]
    # Behind a request still being served: answered after it, in order.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /jobs/nothing/result?wait=0.3 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                 b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n" + h2c
                 + b"Content-Length: %d\r\n\r\n" % len(job) + job)
    first, second = await read_answer(reader), await read_answer(reader)
    assert (first[0], second[0]) == (404, 400), (first, second)
    assert json.loads(second[1])["error"]["code"] == "upgrade_not_supported"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    status, body = await raw_http(port, b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                  b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
                                  b"Sec-WebSocket-Version: 13\r\n"
                                  b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                  b"Content-Length: %d\r\n\r\n" % len(job) + job)
    assert (status, json.loads(body)["error"]["code"]) == (400, "bad_handshake"), body
    assert not [r for r in log if r.levelno >= logging.WARNING and r.name.startswith("uvicorn")]
