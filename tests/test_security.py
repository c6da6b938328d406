"""Tokens and scopes, and the limits that keep a hostile or broken client from hurting
anyone else: each test crosses one line and checks the answer, that a bystander worker
keeps working, and that no stored job changed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sqlite3
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
import websockets
from click.testing import CliRunner
from conftest import Live, start_server, stop_server, write_spec
from helpers import RawWorker, heartbeat, raw_http, registration, wait_until
from test_bad_input import closed_with
from test_cli import rota

from rota import JobContext, Worker
from rota.client import ApiError, Client
from rota.auth import new_token
from rota.cli import main
from rota.store import create_token


async def make_token(live: Live, scope: str, queues: list[str] | None = None) -> str:
    """Create a token in the server's file and wait until the server has read it."""
    token_id, secret, hashed = new_token()
    create_token(live.settings.db, name=f"{scope}-{token_id}", scope=scope, queues=queues,
                 token_id=token_id, hashed=hashed)
    await wait_until(lambda: live.coordinator.tokens.valid_id(token_id),
                     what="the server to read the new token")
    return secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@pytest.fixture
async def guarded(tmp_path: Path):
    """A server with an admin token (so auth is on), its specs pushed, and a connected
    bystander worker that must keep working through whatever a test throws at it."""
    live = await start_server(tmp_path, registration_timeout=0.5, rate_limit=20.0,
                              rate_burst=20, max_worker_connections_per_token=3,
                              max_args_bytes=1024, max_result_bytes=2048, max_body_bytes=4096,
                              header_timeout=0.5, body_timeout=0.5)
    admin = await make_token(live, "admin")
    live.http.headers.update(bearer(admin))
    await live.push(write_spec(tmp_path / "specs", "echo"))
    bystander = Worker(url=live.ws, specs_dir=tmp_path / "specs", heartbeat_interval=0.1,
                       token=await make_token(live, "worker"))

    @bystander.handler("echo")
    async def echo(ctx: JobContext) -> Any:
        return ctx.args

    task = asyncio.create_task(bystander.run())
    await wait_until(lambda: bystander.connected.is_set() or task.done(), what="bystander")
    live.admin = admin  # type: ignore[attr-defined]
    try:
        yield live
    finally:
        bystander.stop()
        await asyncio.wait_for(task, 10)
        await stop_server(live)


async def bystander_still_works(live: Live) -> None:
    job = await live.enqueue("echo", {"n": 1})
    assert (await live.wait_state(job["id"], "completed"))["result"] == {"n": 1}


def stored_jobs(live: Live) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(live.settings.db)) as conn:
        return conn.execute("SELECT id, state, attempt, result FROM jobs ORDER BY id").fetchall()


async def raw_worker(live: Live, secret: str | None, worker_id: str = "raw") -> RawWorker:
    headers = bearer(secret) if secret else {}
    return await RawWorker.open(live.ws, worker_id, additional_headers=headers)


# -- tokens and scopes ----------------------------------------------------------------------
async def test_http_needs_a_valid_token(guarded: Live):
    async with httpx.AsyncClient(base_url=guarded.base) as anonymous:
        refused = await anonymous.get("/specs")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        assert refused.headers["www-authenticate"].startswith("Bearer")
        forged = guarded.admin[:-4] + "AAAA"  # type: ignore[attr-defined]
        assert (await anonymous.get("/specs", headers=bearer(forged))).status_code == 401
        assert (await anonymous.get("/specs", headers=bearer("nonsense"))).status_code == 401
        assert (await anonymous.get("/healthz")).status_code == 200  # for load balancers


async def test_a_producer_enqueues_and_sees_only_its_own_jobs(guarded: Live):
    mine, other = await make_token(guarded, "producer"), await make_token(guarded, "producer")
    async with httpx.AsyncClient(base_url=guarded.base, headers=bearer(mine)) as producer:
        made = await producer.post("/jobs", json={"spec": "echo", "args": {"x": 1}})
        assert made.status_code == 201
        job_id = made.json()["job"]["id"]
        assert (await producer.get(f"/jobs/{job_id}/result?wait=5")).json()["result"] == {"x": 1}
        for method, path in (("GET", "/workers"), ("POST", f"/jobs/{job_id}/retry"),
                             ("GET", "/specs/echo/history"), ("PUT", "/specs"),
                             ("GET", "/queues")):
            reply = await producer.request(method, path)
            assert reply.status_code == 403 and reply.json()["error"]["code"] == "forbidden", path
    async with httpx.AsyncClient(base_url=guarded.base, headers=bearer(other)) as stranger:
        assert (await stranger.get(f"/jobs/{job_id}")).status_code == 404
        assert (await stranger.get(f"/jobs/{job_id}/result")).status_code == 404
    assert (await guarded.job(job_id))["state"] == "completed"  # the admin sees everything


async def test_a_producer_reads_specs_and_cancels_its_own_jobs_only(guarded: Live):
    mine, other = await make_token(guarded, "producer"), await make_token(guarded, "producer")
    async with (httpx.AsyncClient(base_url=guarded.base, headers=bearer(mine)) as producer,
                httpx.AsyncClient(base_url=guarded.base, headers=bearer(other)) as stranger):
        specs = (await producer.get("/specs")).json()["specs"]  # the argument schemas
        assert [s["name"] for s in specs] == ["echo"] and "args" in specs[0]["spec"]
        later = {"spec": "echo", "delay": 3600}  # waits: nothing runs it meanwhile
        theirs = (await stranger.post("/jobs", json=later)).json()["job"]["id"]
        job_id = (await producer.post("/jobs", json=later)).json()["job"]["id"]
        refused = await producer.delete(f"/jobs/{theirs}")
        assert (refused.status_code, refused.json()["error"]["code"]) == (404, "not_found")
        assert (await producer.delete("/jobs/nope")).status_code == 404
        cancelled = await producer.delete(f"/jobs/{job_id}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        again = await producer.delete(f"/jobs/{job_id}")
        assert (again.status_code, again.json()["error"]["code"]) == (409, "not_cancellable")
        assert (await producer.post(f"/jobs/{job_id}/retry")).status_code == 403
    assert (await guarded.job(theirs))["state"] == "scheduled"  # untouched
    assert (await guarded.http.delete(f"/jobs/{theirs}")).status_code == 200  # the admin may
    code, out, err = await rota("jobs", "cancel", "nope", "--url", guarded.base, "--token", mine)
    assert code == 1 and "not_found" in err


async def test_tokens_limited_to_queues(guarded: Live, tmp_path: Path):
    await guarded.push(write_spec(tmp_path / "specs", "mail", queue="mail"))
    producer = await make_token(guarded, "producer", queues=["default"])
    async with httpx.AsyncClient(base_url=guarded.base, headers=bearer(producer)) as client:
        refused = await client.post("/jobs", json={"spec": "mail"})
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "queue_not_allowed"
        batch = await client.post("/jobs/batch", json={"jobs": [{"spec": "echo"},
                                                                {"spec": "mail"}]})
        assert [r["status"] for r in batch.json()["results"]] == [201, 403]
    worker = await raw_worker(guarded, await make_token(guarded, "worker", queues=["default"]))
    await worker.beat(registration=registration(queues=["default", "mail"]))
    error = await worker.expect("error")
    assert error["code"] == "queue_not_allowed" and "mail" in error["message"]
    assert await closed_with(worker) == 1008
    await bystander_still_works(guarded)


@pytest.mark.parametrize("scope", [None, "producer"])
async def test_work_refuses_the_handshake_without_a_worker_token(guarded: Live, scope: str | None):
    secret = await make_token(guarded, scope) if scope else None
    with pytest.raises(websockets.InvalidStatus) as refused:
        await raw_worker(guarded, secret)
    response = refused.value.response
    expected = (401, "unauthorized") if scope is None else (403, "forbidden")
    assert (response.status_code, json.loads(response.body)["error"]["code"]) == expected
    await bystander_still_works(guarded)


async def test_revoking_a_token_disconnects_its_worker(guarded: Live, tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture):
    secret = await make_token(guarded, "worker")
    token_id = secret.split("_")[1]
    worker = Worker(url=guarded.ws, specs_dir=tmp_path / "specs", heartbeat_interval=0.1,
                    token=secret)
    worker.handler("echo")(lambda ctx: None)
    task = asyncio.create_task(worker.run())
    await wait_until(lambda: worker.connected.is_set(), what="the worker to connect")
    result = CliRunner().invoke(main, ["tokens", "revoke", token_id,
                                       "--db", str(guarded.settings.db)])
    assert result.exit_code == 0, result.output
    with pytest.raises(PermissionError, match="401"):  # it may not come back either
        await asyncio.wait_for(task, 5)
    assert f"token revoked worker={worker.worker_id} token={token_id}" in caplog.text
    assert secret not in caplog.text  # secrets are never logged
    await bystander_still_works(guarded)


async def test_tokens_are_stored_hashed_and_listed_without_secrets(guarded: Live):
    secret = await make_token(guarded, "producer")
    with contextlib.closing(sqlite3.connect(guarded.settings.db)) as conn:
        stored = " ".join(str(v) for row in conn.execute("SELECT * FROM tokens") for v in row)
    assert secret.split("_", 2)[2] not in stored
    listing = CliRunner().invoke(main, ["tokens", "list", "--db", str(guarded.settings.db)])
    assert secret.split("_")[1] in listing.output and secret.split("_", 2)[2] not in listing.output


async def test_cli_takes_the_token_from_the_flag_or_the_environment(guarded: Live):
    code, _, err = await rota("jobs", "show", "nope", "--url", guarded.base)
    assert code == 1 and "set ROTA_TOKEN or pass --token" in err
    code, _, err = await rota("jobs", "show", "nope", "--url", guarded.base,
                              "--token", guarded.admin)  # type: ignore[attr-defined]
    assert code == 1 and "not_found" in err


def test_cli_creates_tokens_and_refuses_to_serve_open_beyond_loopback(tmp_path: Path):
    db = str(tmp_path / "rota.db")
    runner = CliRunner()
    refused = runner.invoke(main, ["serve", "--host", "0.0.0.0", "--db", db])
    assert refused.exit_code == 1 and "--insecure" in refused.output
    made = runner.invoke(main, ["tokens", "create", "--scope", "worker", "--queues", "a,b",
                                "--name", "ci", "--db", db])
    assert made.exit_code == 0 and made.output.startswith("rota_")
    again = runner.invoke(main, ["tokens", "create", "--scope", "admin", "--name", "ci",
                                 "--db", db])
    assert again.exit_code == 1 and "already named" in again.output
    assert runner.invoke(main, ["tokens", "revoke", "ci", "--db", db]).exit_code == 0
    assert runner.invoke(main, ["tokens", "revoke", "ci", "--db", db]).exit_code == 1


async def test_browser_origins_are_refused_unless_allowed(tmp_path: Path):
    live = await start_server(tmp_path, allowed_origins=("https://ops.example",))
    try:
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(live.ws, origin="https://evil.example")
        assert refused.value.response.status_code == 403
        ws = await websockets.connect(live.ws, origin="https://ops.example")
        await ws.close()
    finally:
        await stop_server(live)


async def test_a_web_page_cannot_give_orders_to_a_server_without_tokens(tmp_path: Path):
    """Auth off (loopback only): a page in the operator's browser must not enqueue jobs or
    direct workers, by a plain cross-site POST or by rebinding its name to 127.0.0.1."""
    live = await start_server(tmp_path, allowed_origins=("https://ops.example",))
    try:
        await live.push(write_spec(tmp_path / "specs", "echo"))
        before = stored_jobs(live)
        order = '{"spec": "echo", "args": {"to": "victim"}}'
        plain = {"Content-Type": "text/plain"}  # a form or fetch() sends it with no preflight
        for headers, code in [
            ({"Origin": "http://evil.example"}, "origin_not_allowed"),
            ({"Sec-Fetch-Site": "cross-site"}, "origin_not_allowed"),
            ({"Host": "evil.example:8000", "Origin": "http://evil.example:8000"},
             "host_not_allowed"),  # DNS rebinding: same-origin as far as the browser knows
            ({"Host": "evil.example"}, "host_not_allowed"),
            ({"Authorization": "Bearer x"} | {"X-Second": "1"}, None),
        ]:
            answer = await live.http.post("/jobs", content=order, headers=plain | headers)
            if code is None:
                assert answer.status_code == 201  # no token needed while auth is off
                continue
            assert (answer.status_code, answer.json()["error"]["code"]) == (403, code), headers
        terminate = await live.http.post("/workers/state", json={"state": "terminate", "all": True},
                                         headers={"Origin": "http://evil.example"})
        assert terminate.status_code == 403
        assert len(stored_jobs(live)) == len(before) + 1  # only the last one
        # The API's own origin, an allowed one, and loopback names are served.
        port = live.settings.port
        for headers in ({"Origin": f"http://127.0.0.1:{port}"}, {"Origin": "https://ops.example"},
                        {"Host": f"localhost:{port}"}, {"Host": f"[::1]:{port}"}):
            assert (await live.http.get("/specs", headers=headers)).status_code == 200, headers
    finally:
        await stop_server(live)


async def test_a_token_works_the_moment_it_is_created(guarded: Live):
    """`rota tokens create` writes the file; the server looks when it meets an unknown id,
    rather than refusing the token until its next periodic look."""
    token_id, secret, hashed = new_token()
    create_token(guarded.settings.db, name="fresh", scope="admin", queues=None,
                 token_id=token_id, hashed=hashed)
    async with httpx.AsyncClient(base_url=guarded.base, headers=bearer(secret)) as fresh:
        assert (await fresh.get("/specs")).status_code == 200
    async with httpx.AsyncClient(base_url=guarded.base,
                                 headers=bearer(f"rota_{'0' * 12}_{'x' * 43}")) as nobody:
        assert (await nobody.get("/specs")).status_code == 401  # still refused, once looked


async def test_refusals_are_logged_at_a_bounded_rate(guarded: Live, caplog):
    caplog.set_level(logging.WARNING, logger="rota.server")
    async with httpx.AsyncClient(base_url=guarded.base) as anonymous:
        for _ in range(50):
            assert (await anonymous.get("/specs")).status_code == 401
    lines = [r for r in caplog.records if "no valid token" in r.getMessage()]
    assert 1 <= len(lines) <= 11  # a burst of 10 (and one more if a second passed)


async def test_two_authorization_headers_are_refused(guarded: Live):
    status, body = await raw_http(guarded.settings.port, b"GET /specs HTTP/1.1\r\nHost: x\r\n"
                                     b"Authorization: Bearer junk\r\nAuthorization: Bearer "
                                     + guarded.admin.encode() + b"\r\n\r\n")  # type: ignore[attr-defined]
    assert (status, json.loads(body)["error"]["code"]) == (400, "duplicate_header")


# -- limits ----------------------------------------------------------------------------------
async def test_oversized_args_body_and_result_are_refused(guarded: Live):
    before = stored_jobs(guarded)
    big = await guarded.http.post("/jobs", json={"spec": "echo", "args": {"x": "a" * 2000}})
    assert big.status_code == 413 and big.json()["error"]["code"] == "args_too_large"
    assert "max_args_bytes" in big.json()["error"]["message"]

    async def chunks():  # no Content-Length: the limit must hold while streaming
        for _ in range(10):
            yield b" " * 1000

    streamed = await guarded.http.post("/jobs", content=chunks())
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "body_too_large"
    assert stored_jobs(guarded) == before
    await bystander_still_works(guarded)


async def test_a_result_over_the_limit_fails_the_job_for_good(guarded: Live, tmp_path: Path):
    await guarded.push(write_spec(tmp_path / "specs", "big", queue="big"))
    worker = await raw_worker(guarded, await make_token(guarded, "worker"), "big")
    await worker.register([write_spec(tmp_path / "specs", "big", queue="big")], queues=["big"])
    job = await guarded.enqueue("big")
    [copy] = await worker.jobs(1)
    await worker.complete(copy, result="x" * 5000)
    done = await guarded.wait_state(job["id"], "discarded")
    assert done["result"] is None and done["errors"][0]["type"] == "result_too_large"
    assert "max_result_bytes" in done["errors"][0]["message"]


async def test_a_silent_socket_is_closed_before_it_registers(guarded: Live):
    worker = await raw_worker(guarded, await make_token(guarded, "worker"))
    error = await worker.expect("error", timeout=3)
    assert error["code"] == "registration_timeout"
    assert await closed_with(worker) == 1008
    await bystander_still_works(guarded)


async def test_a_flooding_worker_is_throttled_not_cut_off_and_others_keep_going(guarded: Live):
    flood = await raw_worker(guarded, await make_token(guarded, "worker"), "flood")
    await flood.register([write_spec(Path(guarded.tmp) / "specs", "echo")], capacity=0)
    first = flood.seq
    for _ in range(50):  # well past the burst of 20, at 20 a second
        await flood.beat()
    await bystander_still_works(guarded)  # while the flood is being read slowly
    acked = set()
    while len(acked) < 50:  # every frame is read in the end: throttled, none refused
        frame = await flood.recv(timeout=5)
        assert frame["type"] == "ack", frame
        acked.add(frame["seq"])
    assert acked == set(range(first, first + 50))
    assert guarded.coordinator.connections.get("flood") is not None


async def test_connections_per_token_are_capped(guarded: Live):
    secret = await make_token(guarded, "worker")
    opened = [await raw_worker(guarded, secret, f"w{n}") for n in range(3)]
    with pytest.raises(websockets.InvalidStatus) as refused:
        await raw_worker(guarded, secret, "one-too-many")
    assert refused.value.response.status_code == 429
    for raw in opened:
        await raw.ws.close()
    await bystander_still_works(guarded)


async def test_slow_headers_are_cut_off(guarded: Live):
    reader, writer = await asyncio.open_connection("127.0.0.1", guarded.settings.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 3) == b""  # closed by the server
    writer.close()
    await bystander_still_works(guarded)


async def test_a_slow_body_is_cut_off_with_408(guarded: Live):
    before = stored_jobs(guarded)
    reader, writer = await asyncio.open_connection("127.0.0.1", guarded.settings.port)
    writer.write(b"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 + guarded.admin.encode() + b"\r\nContent-Length: 100\r\n\r\n"  # type: ignore[attr-defined]
                 + b'{"spec": "echo", ')  # and never the rest
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 3)  # answered, then closed
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"body_timeout"' in answer
    assert stored_jobs(guarded) == before
    await bystander_still_works(guarded)


# -- TLS -------------------------------------------------------------------------------------
async def test_serving_over_tls_with_a_self_signed_certificate(tmp_path: Path):
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert_file, key_file, ca_file = tmp_path / "cert.pem", tmp_path / "key.pem", tmp_path / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    cert.private_key_pem.write_to_path(str(key_file))
    ca.cert_pem.write_to_path(str(ca_file))
    live = await start_server(tmp_path, ssl_certfile=str(cert_file), ssl_keyfile=str(key_file))
    https = f"https://127.0.0.1:{live.settings.port}"
    live.http = httpx.AsyncClient(base_url=https, verify=ssl.create_default_context(
        cafile=str(ca_file)))
    try:
        await live.push(write_spec(tmp_path / "specs", "echo"))
        trust = ssl.create_default_context(cafile=str(ca_file))
        worker = Worker(url=f"wss://127.0.0.1:{live.settings.port}/work",
                        specs_dir=tmp_path / "specs", heartbeat_interval=0.1, ssl=trust)
        worker.handler("echo")(lambda ctx: "over tls")
        task = asyncio.create_task(worker.run())
        job = await live.enqueue("echo")
        assert (await live.wait_state(job["id"], "completed"))["result"] == "over tls"
        worker.stop()
        await asyncio.wait_for(task, 10)
        with pytest.raises(ssl.SSLError):  # a client that does not trust the CA is refused
            await websockets.connect(f"wss://127.0.0.1:{live.settings.port}/work")
        with pytest.raises((socket.error, httpx.HTTPError)):
            async with httpx.AsyncClient() as plain:
                await plain.get(f"{https}/healthz")

        def untrusting() -> ApiError:
            with Client(https) as client, pytest.raises(ApiError) as refused:
                client.specs()
            return refused.value

        said = await asyncio.to_thread(untrusting)  # Rota's own client says what to do
        assert said.code == "untrusted_certificate" and "SSL_CERT_FILE" in said.message
    finally:
        await stop_server(live)


# -- names -------------------------------------------------------------------------------------
@pytest.mark.parametrize("frame", [
    {"worker_id": "bad\nid"},
    {"worker_id": "w", "results": [{"job_id": "j\r\nINFO forged", "attempt": 1,
                                    "outcome": "completed"}]},
    {"worker_id": "w", "status": {"state": "running", "active_job_ids": ["a b"]}},
    {"worker_id": "w", "registration": registration(labels=["x" * 200])},
], ids=["worker id", "result job id", "active job id", "label too long"])
async def test_names_outside_their_pattern_are_refused(live: Live, connect,
                                                      frame: dict[str, Any]):
    raw = await connect("anyone")
    await raw.send(heartbeat(0, **frame))
    error = await raw.expect("error")
    assert error["code"] == "invalid_message" and "matching regex" in error["message"]
    assert await closed_with(raw) == 1007


async def test_job_ids_outside_their_pattern_are_refused(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    for bad in ("has space", "new\nline", "", "x" * 129, "-leading"):
        reply = await live.http.post("/jobs", json={"spec": "echo", "id": bad})
        assert reply.status_code == 422, bad
    ok = await live.http.post("/jobs", json={"spec": "echo", "id": "order/17@shop:eu=1+2"})
    assert ok.status_code == 201


async def test_connections_over_the_server_cap_get_503(tmp_path: Path):
    live = await start_server(tmp_path, max_connections=3)
    opened = []
    try:
        for _ in range(3):
            opened.append(await websockets.connect(live.ws))
        async with httpx.AsyncClient() as fresh:  # a new connection, over the cap
            assert (await fresh.get(f"{live.base}/specs")).status_code == 503
            # (but /healthz is answered: tests/test_waits.py)
        await asyncio.wait_for(await opened[0].ping(), 5)  # those open are still served
    finally:
        for ws in opened:
            await ws.close()
        await stop_server(live)
