"""A /work handshake the edge refuses before any route sees it is answered in Rota's JSON
error shape and closed (docs/protocol.md, section 1): a request websockets cannot read
though the HTTP parser did (a header line over 8 KiB, over 128 headers, a body), one it
reads and refuses (no key, another version, not a GET), and HTTP/1.0. Before, the first
kind got no answer and its connection stayed open for good, before any token was asked
for, holding one of --max-connections. Real parts: a server in this process on loopback,
raw TCP sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from conftest import Live
from helpers import RawWorker
from wirepeer import log  # noqa: F401 (fixture: no traceback in the whole test's log)

KEY = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"


def handshake(extra: bytes = b"", *, method: bytes = b"GET", target: bytes = b"/work",
              version: bytes = b"HTTP/1.1", key: bytes = KEY, ws_version: bytes = b"13") -> bytes:
    return (method + b" " + target + b" " + version + b"\r\nHost: 127.0.0.1\r\n"
            b"Upgrade: websocket\r\nConnection: Upgrade\r\n" + key
            + b"Sec-WebSocket-Version: " + ws_version + b"\r\n" + extra + b"\r\n")


REFUSED = {  # name: (request, status, code, a header the answer must carry)
    "a header line over 8 KiB": (handshake(b"X-Big: " + b"a" * 9_000 + b"\r\n"),
                                 431, "headers_too_large", None),
    "130 headers": (handshake(b"".join(b"X-%d: v\r\n" % n for n in range(130))),
                    431, "headers_too_large", None),
    "a request line over 8 KiB": (handshake(target=b"/work?x=" + b"a" * 9_000),
                                  414, "url_too_long", None),
    "a body": (handshake(b"Content-Length: 5\r\n") + b"hello", 400, "bad_handshake", None),
    "a chunked body": (handshake(b"Transfer-Encoding: chunked\r\n") + b"0\r\n\r\n",
                       400, "bad_handshake", None),
    "version 8": (handshake(ws_version=b"8"), 426, "unsupported_version",
                  b"sec-websocket-version: 13"),
    "no key": (handshake(key=b""), 400, "bad_handshake", None),
    "a key that is not 16 bytes": (handshake(key=b"Sec-WebSocket-Key: c2hvcnQ=\r\n"),
                                   400, "bad_handshake", None),
    "POST": (handshake(method=b"POST"), 405, "method_not_allowed", b"allow: get"),
    "HTTP/1.0": (handshake(version=b"HTTP/1.0"), 400, "bad_handshake", None),
}


async def answer_and_end(port: int, request: bytes) -> tuple[int, bytes, bytes, bool]:
    """The status, head and body of the answer, and whether the server then closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await asyncio.wait_for(reader.readexactly(length), 5)
        ended = await asyncio.wait_for(reader.read(), 5) == b""
        return int(head.split(b" ")[1]), head.lower(), body, ended
    finally:
        writer.close()


@pytest.mark.parametrize("name", list(REFUSED))
async def test_a_refused_handshake_is_answered_in_json_and_closed(
        live: Live, log: list[logging.LogRecord], name: str) -> None:
    request, status, code, header = REFUSED[name]
    got, head, body, ended = await answer_and_end(live.settings.port, request)
    assert (got, json.loads(body)["error"]["code"]) == (status, code), (name, body)
    assert b"content-type: application/json" in head and ended, name
    assert header is None or header in head, (name, head)
    refusals = [r.getMessage() for r in log if "refused a WebSocket handshake" in r.getMessage()]
    assert len(refusals) == 1 and f"{status} {code}" in refusals[0], refusals


async def test_many_unreadable_handshakes_hold_no_connection_and_harm_no_worker(
        live: Live, log: list[logging.LogRecord]) -> None:
    port = live.settings.port
    answers = await asyncio.gather(*(answer_and_end(port, request)
                                     for request, *_ in list(REFUSED.values()) * 5))
    assert all(ended for *_, ended in answers)
    worker = await RawWorker.open(live.ws, "after")
    try:
        assert (await worker.register([]))["worker_id"] == "after"
    finally:
        await worker.ws.close()
    assert (await live.http.get("/healthz")).status_code == 200
    # (the refusals' lines keep the gate's rate: a burst of ten, then one a second)
    assert len([r for r in log if "refused a WebSocket handshake" in r.getMessage()]) <= 11


async def test_a_refusals_line_shows_what_the_client_sent_escaped(
        live: Live, log: list[logging.LogRecord]) -> None:
    request = handshake(key=b"Sec-WebSocket-Key: \x85\x9b31mred\r\n")
    status, _, body, ended = await answer_and_end(live.settings.port, request)
    assert status == 400 and ended, body
    lines = [r.getMessage() for r in log if "refused a WebSocket handshake" in r.getMessage()]
    assert len(lines) == 1 and "\\x85" in lines[0], lines
    assert not any(c in lines[0] for c in "\x85\x9b\n"), lines
