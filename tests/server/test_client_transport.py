"""The sync client's HTTP/1.1 reader (rota/client/transport.py) against a fake server on a
real socket that answers what a proxy or a broken peer might: chunked bodies, bodies that
run to the close, interim 1xx answers, a kept-alive connection closed under it, garbage
and answers cut short. Each must come back as the answer, or as the ApiError the client
gives for a lost answer, never as a hang or a traceback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rota.client.client import ApiError, Client

Script = Callable[[socket.socket, bytes], object]


@pytest.fixture
def peer() -> Iterator[Callable[[list[Script]], str]]:
    """A server that runs one script per request it reads, on one connection after another."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)
    seen: list[bytes] = []
    threads: list[threading.Thread] = []

    done = threading.Event()

    def serve(scripts: list[Script]) -> None:
        queue = list(scripts)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:  # (once the scripts are done, each connection is hung up on at once,
                # so that the client's "is it TLS?" probe has its answer without waiting)
                conn.settimeout(10)
                while queue:
                    request = _read_request(conn)
                    if request is None:
                        break
                    seen.append(request)
                    if queue.pop(0)(conn, request):  # (True: it hung up)
                        break

    def start(scripts: list[Script]) -> str:
        thread = threading.Thread(target=serve, args=(scripts,), daemon=True)
        thread.start()
        threads.append(thread)
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    start.seen = seen  # type: ignore[attr-defined]
    yield start
    done.set()
    socket.create_connection(listener.getsockname(), 5).close()  # (wakes the accept)
    listener.close()
    for thread in threads:
        thread.join(5)


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            size = int(line.split(b":")[1])
            while len(body) < size:
                body += conn.recv(65536)
    return data


def say(raw: bytes) -> Script:
    return lambda conn, _request: conn.sendall(raw)


def say_and_close(raw: bytes) -> Script:
    def script(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(raw)
        conn.shutdown(socket.SHUT_RDWR)
    return script


JOB = b'{"job":{"id":"a","state":"waiting"},"created":true}'


def test_an_answer_with_a_length_and_one_in_chunks_read_on_one_connection(peer):
    url = peer([
        say(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(JOB), JOB)),
        say(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;ext=1\r\n" + JOB[:5] + b"\r\n" + b"%x\r\n" % (len(JOB) - 5) + JOB[5:]
            + b"\r\n0\r\nX-Trailer: 1\r\n\r\n"),
        say(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"),
    ])
    with Client(url) as client:
        assert client.job("a") == {"job": {"id": "a", "state": "waiting"}, "created": True}
        assert client.job("a")["job"]["id"] == "a"
        assert client.job("a") == {}
    requests = peer.seen  # type: ignore[attr-defined]
    assert len(requests) == 3
    assert requests[0].startswith(b"GET /jobs/a HTTP/1.1\r\nHost: 127.0.0.1:")


def test_a_body_that_runs_to_the_close_and_an_http_1_0_answer_end_the_connection(peer):
    url = peer([say_and_close(b"HTTP/1.1 200 OK\r\n\r\n" + JOB),
                say_and_close(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}")])
    with Client(url) as client:
        assert client.job("a")["created"] is True
        assert client.job("a") == {}  # (a second connection: the first was closed)


def test_a_kept_alive_connection_closed_before_the_answer(peer):
    """A read goes again on a new connection; an enqueue may have been carried out, so
    its caller hears no_answer and nothing is sent twice."""
    def hang_up(conn: socket.socket, _request: bytes) -> bool:
        conn.shutdown(socket.SHUT_RDWR)
        return True
    ok = say(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    url = peer([ok, hang_up, ok, ok, hang_up])
    with Client(url) as client:
        assert client.job("a") == {}
        assert client.job("a") == {}  # the first try was hung up on: asked again
        assert client.job("a") == {}
        with pytest.raises(ApiError) as raised:
            client.enqueue("noop", {})
    assert raised.value.code == "no_answer"
    assert "repeat it with the same job id" in raised.value.message
    assert sum(r.startswith(b"POST") for r in peer.seen) == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("raw", [
    b"SSH-2.0-OpenSSH_9.2\r\n\r\n",  # not HTTP at all
    b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n{\"cut\":",  # cut short
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a bad chunk size
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",  # a bad length
    b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000,  # headers that never end
])
def test_an_answer_that_is_not_http_or_is_cut_short_is_no_answer(peer, raw):
    url = peer([say_and_close(raw)])
    with Client(url, timeout=5) as client, pytest.raises(ApiError) as raised:
        client.job("a")
    assert raised.value.code == "no_answer"


def test_a_server_that_never_answers_times_out(peer):
    release = threading.Event()
    url = peer([lambda conn, _request: release.wait(10)])
    try:
        with Client(url, timeout=0.3) as client, pytest.raises(ApiError) as raised:
            client.job("a")
        assert raised.value.code == "no_answer"
        assert "timed out" in raised.value.message
    finally:
        release.set()


def test_a_service_that_speaks_first_and_waits_is_not_http_at_once(peer):
    """An SSH server (say) on the port: its first line is not HTTP, which is said as soon
    as it comes, not after the client's whole timeout."""
    release = threading.Event()

    def speak_and_wait(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        release.wait(10)

    url = peer([speak_and_wait])
    started = time.monotonic()
    try:
        with Client(url, timeout=20) as client, pytest.raises(ApiError) as raised:
            client.job("a")
    finally:
        release.set()
    assert time.monotonic() - started < 5
    assert raised.value.code == "no_answer" and "SSH-2.0" in raised.value.message


def test_an_enqueue_after_the_server_closed_the_kept_alive_connection_goes_on_a_new_one(peer):
    """A server restarted (or timing out an idle connection) between two calls: the
    connection it closed is seen closed before the request goes, so an enqueue is sent
    on a new one, not lost on the old one as "may have been carried out"."""
    closed = threading.Event()

    def answer_and_close(conn: socket.socket, _request: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s" % (len(JOB), JOB))
        conn.shutdown(socket.SHUT_RDWR)
        closed.set()
        return True

    url = peer([answer_and_close, say(b"HTTP/1.1 201 Created\r\nContent-Length: %d\r\n\r\n%s"
                                      % (len(JOB), JOB))])
    with Client(url) as client:
        assert client.enqueue("noop", {}).id == "a"
        assert closed.wait(5)
        kept = client._transports[0]._conn
        assert kept is not None
        deadline = time.monotonic() + 5
        while not kept.dropped():  # (until the server's FIN has crossed loopback)
            assert time.monotonic() < deadline, "the closed connection never read as closed"
            time.sleep(0.001)  # noqa: sleep-ok (the poll step of a deadline loop)
        assert client.enqueue("noop", {}).id == "a"
    assert sum(r.startswith(b"POST") for r in peer.seen) == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("body", [b"[]", b"42", b'"text"', b"null"])
def test_json_that_is_not_an_object_is_not_an_answer_of_the_api(peer, body):
    """Another service on the port answering JSON, but not Rota's (every answer of the
    API is an object): an error that says so, never a caller's KeyError or TypeError."""
    url = peer([say(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))])
    with Client(url) as client, pytest.raises(ApiError) as raised:
        client.list_jobs()
    assert raised.value.code == "http_error" and "a JSON object" in raised.value.message
