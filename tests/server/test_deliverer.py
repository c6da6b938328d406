"""The Deliverer against a real endpoint (tests/endpoint_rig.py, a subprocess): each class
of answer, the address check, redirects, the body cap, the signature as the receiver
checks it, and a delivery id per POST."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from helpers import wait_until

from rota.base.egress import Answer
from rota.base.push import Delivery
from rota.server.deliverer import Deliverer
from rota.server.outbound import Egress

RIG = Path(__file__).resolve().parents[1] / "endpoint_rig.py"
SECRET = "rig-secret"


class Rig:
    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def lines(self, delivery_id: str | None = None) -> list[dict[str, Any]]:
        """The rig's log (its line is written before it answers), or one delivery's. A
        line still being written (read while a request is in flight) is left for later."""
        text = self.log.read_text()
        found = [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
        return [f for f in found if delivery_id is None or f.get("delivery_id") == delivery_id]


@contextlib.contextmanager
def running_rig(log: Path, *options: str) -> Iterator[Rig]:
    """The rig as a subprocess, logging to ``log``, signed with SECRET, until the end."""
    log.touch()
    proc = subprocess.Popen([sys.executable, str(RIG), "--port", "0", "--log", str(log),
                             "--secret", SECRET, *options], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        yield Rig(int(proc.stdout.readline()), log)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with running_rig(tmp_path_factory.mktemp("rig") / "rig.log", "--nth", "/nth:2:503") as rig:
        yield rig


@pytest.fixture
async def deliverer(rig: Rig) -> AsyncIterator[Deliverer]:
    values = {"s": [SECRET.encode()], "rotating": [b"new-one", SECRET.encode()],
              "wrong": [b"not-the-rig-s"]}
    d = Deliverer(True, values.get, rig.url("/base/"))  # (the rig's callbacks come back to it)
    yield d
    await d.aclose()


def delivery(url: str, timeout: float = 5.0, secret: str = "s") -> Delivery:
    return Delivery(job_id=f"j-{uuid.uuid4().hex[:8]}", attempt=1, spec="resize",
                    checksum="c" * 16, queue="default", args=[{"n": 1}], priority=0, url=url,
                    timeout=timeout, headers={"X-Team": "a", "X-Rota-Attempt": "99"},
                    secret=secret, delivery_id=f"del-{uuid.uuid4()}", deadline=time.time() + 60,
                    callback_token="tok")


async def test_ok_completes_with_the_json_and_the_rig_verifies_the_signature(rig, deliverer):
    d = delivery(rig.url("/ok"))
    done = await deliverer.deliver(d)
    assert (done.kind, done.result, done.status) == ("completed", {"echo": [{"n": 1}]}, 200)
    assert done.delivery_id == d.delivery_id and done.ms > 0
    [seen] = rig.lines(d.delivery_id)
    assert seen == {"path": "/ok", "delivery_id": d.delivery_id, "job_id": d.job_id,  # attempt:
                    "attempt": "1", "signed": True, "whole": True, "t": seen["t"]}  # not 99
    rotating = delivery(rig.url("/ok"), secret="rotating")  # either signature will do
    await deliverer.deliver(rotating)
    assert rig.lines(rotating.delivery_id)[0]["signed"] is True
    wrong = delivery(rig.url("/ok"), secret="wrong")
    await deliverer.deliver(wrong)
    assert rig.lines(wrong.delivery_id)[0]["signed"] is False


@pytest.mark.parametrize("path, kind, type, retryable, fault", [
    ("/fail", "failed", "http_500", True, True),
    ("/bad", "failed", "http_400", False, False),
    ("/gone", "failed", "http_404", False, True),
    ("/429", "failed", "http_429", True, True),
    ("/notjson", "failed", "bad_response", True, True),
    ("/latin1", "failed", "bad_response", True, True),
    ("/huge", "failed", "bad_response", True, True),
    ("/reset", "failed", "connect", True, True),
    ("/redirect", "failed", "redirect", False, True),
    ("/accept?ms=0", "accepted", None, None, False),
    ("/redirect-same", "completed", None, None, False),
])
async def test_each_class_of_answer(rig, deliverer, path, kind, type, retryable, fault):
    d = delivery(rig.url(path))
    done = await deliverer.deliver(d)
    assert (done.kind, done.fault) == (kind, fault), done
    if type is not None:
        assert done.error is not None
        assert (done.error.type, done.error.retryable) == (type, retryable), done.error
        assert done.error.details == done.record()
    if path == "/429":
        assert done.retry_in == 1.0
    if path == "/huge":  # the cap: 1 MiB read, the rest never
        assert "over 1048576 bytes" in done.error.message and len(done.body) == 2048
    if path == "/redirect":  # another host: named, never asked
        assert "http://other.invalid/x" in done.error.message
        assert [line["path"] for line in rig.lines(d.delivery_id)] == ["/redirect"]
    if path.startswith("/accept"):  # and the rig calls back, here to itself
        back = rig.url(f"/base/jobs/{d.job_id}/callback")
        await wait_until(lambda: [x for x in rig.lines() if x.get("url") == back],
                         what="the rig's callback")
    if path == "/redirect-same":
        assert [line["path"] for line in rig.lines(d.delivery_id)] == ["/redirect-same", "/ok"]


async def test_a_silent_endpoint_times_out(rig, deliverer):
    done = await deliverer.deliver(delivery(rig.url("/hang"), timeout=0.3))
    assert done.error is not None and (done.error.type, done.error.retryable) == ("timeout", True)
    assert done.status is None and 300 <= done.ms < 5000


async def test_a_refused_connection_and_a_missing_secret(rig, deliverer):
    with socket_closed() as port:
        done = await deliverer.deliver(delivery(f"http://127.0.0.1:{port}/ok"))
    assert done.error is not None and done.error.type == "connect"
    assert "Connection refused" in done.error.message
    d = delivery(rig.url("/ok"), secret="nobody")
    missing = await deliverer.deliver(d)
    assert missing.error is not None and (missing.error.type, missing.error.retryable,
                                          missing.fault) == ("secret_missing", False, True)
    assert rig.lines(d.delivery_id) == []  # no POST


async def test_a_url_httpx_cannot_request_is_no_exception(deliverer):
    done = await deliverer.deliver(delivery("http://ex\u00e4mple..com/"))  # (bad IDNA)
    assert done.error is not None and (done.error.type, done.error.retryable, done.fault) \
        == ("invalid_url", False, True)
    assert "IDNA" in done.error.message


async def test_a_private_address_is_refused_without_the_option(rig):
    strict = Deliverer(False, lambda name: [SECRET.encode()], "https://rota.example")
    try:
        for host in ("127.0.0.1", "localhost"):
            d = delivery(f"http://{host}:{rig.port}/ok")
            done = await strict.deliver(d)
            assert done.error is not None and done.error.type == "address_refused"
            assert (done.error.retryable, done.fault) == (False, True)
            assert "--allow-private-endpoints" in done.error.message
            assert rig.lines(d.delivery_id) == []  # never reached
    finally:
        await strict.aclose()


async def test_every_post_has_its_own_delivery_id_in_header_and_body(rig, deliverer):
    ids, statuses = [], []
    for _ in range(3):
        d = delivery(rig.url("/nth"))
        statuses.append((await deliverer.deliver(d)).status)
        ids.append(d.delivery_id)
    seen = [line["delivery_id"] for line in rig.lines() if line["path"] == "/nth"]
    assert seen == ids and len(set(seen)) == 3
    assert statuses == [404, 503, 404]  # (the rig's --nth /nth:2:503; no such path else)
    d = delivery(rig.url("/ok"))
    body = json.loads(deliverer.body(d))
    assert body["job"] == {"id": d.job_id, "spec": "resize", "checksum": "c" * 16,
                           "queue": "default", "attempt": 1, "args": [{"n": 1}], "priority": 0}
    assert (body["delivery_id"], body["deadline"]) == (d.delivery_id, d.deadline)
    assert body["callback"] == {"url": rig.url(f"/base/jobs/{d.job_id}/callback"),
                                "token": "tok"}


class socket_closed:
    """A port nothing listens on (bound, never listening: connecting is refused)."""

    def __enter__(self) -> int:
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


async def test_tls_is_verified_against_the_url_s_name_though_the_address_is_checked(tmp_path):
    ca = trustme.CA()
    names: list[str | None] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass  # (a client that refused the certificate)
        writer.close()

    async def answer(cert_for: str, trusted: bool) -> Answer:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(cert_for).configure_cert(context)
        context.sni_callback = lambda sock, name, ctx: names.append(name)
        server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
        trust = ssl.create_default_context()
        ca.configure_trust(trust)
        egress = Egress(allow_private=True, ssl_context=trust if trusted else None)
        try:
            port = server.sockets[0].getsockname()[1]
            return await egress.post(f"https://localhost:{port}/", b"{}", {}, timeout=5)
        finally:
            await egress.aclose()
            server.close()
            await server.wait_closed()

    good = await answer("localhost", trusted=True)
    assert (good.status, good.body, names) == (200, b"{}", ["localhost"])  # SNI: the name
    mismatch = await answer("other.example", trusted=True)
    assert mismatch.error == "connect" and "localhost" in mismatch.message  # checked by name
    untrusted = await answer("localhost", trusted=False)
    assert untrusted.error == "connect" and "CERTIFICATE_VERIFY_FAILED" in untrusted.message


async def test_a_pool_that_cannot_be_made_makes_each_post_a_connect_error(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The pool is made at the first POST (rota/server/outbound.py): a TLS setup that
    fails then must not raise into a delivery or a webhook's task. Each POST says why,
    and the log says it once."""
    import rota.server.egress_http as egress_http

    def broken(self: object, **options: object) -> None:
        raise ssl.SSLError("no CA file")

    monkeypatch.setattr(egress_http.HttpPool, "__init__", broken)
    egress = Egress(allow_private=True)
    for _ in range(2):
        answer = await egress.post("http://127.0.0.1:9/x", b"{}", {}, timeout=1.0)
        assert (answer.status, answer.error) == (None, "connect"), answer
        assert "no CA file" in answer.message
    said = [r for r in caplog.records if "cannot send requests" in r.getMessage()]
    assert len(said) == 1
    await egress.aclose()
