"""The hostile corpus (tests/corpus.py) against a live server: every value in every field
of every HTTP body and /work frame, every whole-body oddity, path segment, query value and
header Rota reads (in the soak run; the default run tries a third of the values in each
place, every value somewhere). For each (place, payload) pair:

- the answer is a 4xx JSON error, or a documented close code with an ``error`` frame, or
  (for JSON the field's type admits) the documented success; never a 5xx or 1011;
- a payload that is not JSON Rota accepts anywhere is refused wherever it goes;
- the server log gets no ERROR line, no traceback, and no forged or escape-coloured line;
- a bystander worker keeps completing jobs, and no stored job changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import corpus
import httpx
import pytest
import websockets
from conftest import Live, start_server, stop_server, write_spec
from helpers import raw_http, wait_until
from helpers import bearer, make_tokens

from rota import JobContext, Worker
from rota.base.ojs import OJS_MEDIA
from rota.base.specs import checksum

Path_ = tuple[str | int, ...]
MARK = "\u0001HOSTILE\u0001"
CLOSE_CODES = {1003, 1007, 1008, 1009}  # docs/protocol.md §7: what a bad frame may get


# -- templates: one well-formed instance of each body and frame --------------------------
def soon() -> str:
    moment = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=30)
    return moment.isoformat().replace("+00:00", "Z")


def enqueue_bodies() -> list[dict[str, Any]]:
    return [
        {"spec": "parked", "args": {"k": "v", "n": [1, {"m": 2}]}, "queue": "default",
         "priority": 1, "run_at": soon(), "ttl": 60.0, "visibility_timeout": 30.0,
         "max_attempts": 3, "max_fails": 2, "capture_logs": False,
         "concurrency_key": "acme", "labels": ["gpu", "region:eu"]},
        {"spec": "parked", "id": "hostile-id", "delay": 10.0},
        {"spec": "parked", "args": {"user": 7, "k": "v"}, "unique": {
            "keys": ["args", "queue"], "args_keys": ["user"], "states": "finished",
            "period": 60.0, "on_conflict": "reject"}},
        {"spec": "parked", "unique": {"key": "k-1", "states": "waiting",
                                      "on_conflict": "replace"}},
    ]


OJS_ID = "019461a8-1a2b-7c3d-8e4f-5a6b7c8d9e0f"
BATCH = {"jobs": [{"spec": "parked", "args": {"k": "v"}, "priority": 1, "queue": "default"}]}
SPECS = {"dry_run": True, "specs": [{
    "name": "hostile", "version": "1", "description": "d", "queue": "default", "priority": 0,
    "visibility_timeout": 30.0,
    "retry": {"max_attempts": 3, "max_fails": 2, "backoff_base": 1.0, "backoff_max": 10.0,
              "max_worker_deaths": 2},
    "args": {"k": {"type": "string", "description": "d", "required": True}},
    "unique": {"keys": ["args"], "args_keys": ["k"], "states": "active", "period": 60.0,
               "on_conflict": "existing"},
    "labels": ["gpu"], "limits": {"concurrency": 4, "rate": "5/s", "key_concurrency": 2,
                                  "key_rate": {"limit": 10, "period": 60.0, "burst": 2}}}]}
# A workflow of each primitive, nested (its jobs are parked: nothing runs them).
WORKFLOW = {"type": "chain", "name": "w", "steps": [
    {"spec": "parked", "args": {"k": "v"}, "priority": 1, "queue": "default"},
    {"type": "batch", "jobs": [{"type": "group", "jobs": [{"spec": "parked"}]}],
     "callbacks": {"on_complete": {"spec": "parked", "max_attempts": 2}}}]}
# Push execution: a spec with [execute] (dry run), and a push endpoint's callbacks for a
# stored job no endpoint holds (no token is its: none may settle it).
EXECUTE_SPECS = {"dry_run": True, "specs": [{
    "name": "hostile-exec", "version": "1", "execute": {
        "url": "https://example.com/hook", "secret": "hostile-exec", "timeout": 30.0,
        "max_in_flight": 10, "headers": {"X-Team": "a"}}}]}
CALLBACK = {"token": "1." + "0" * 40, "status": "failed", "result": {"k": "v"},
            "error": {"type": "E", "code": "c", "message": "m", "retryable": True,
                      "details": {"k": "v"}}}
# No payload may direct the bystander: the label matches nobody, and all + label is refused.
WORKERS_STATE = {"state": "quiet", "label": "nobody", "all": False}
WORKER_STATE = {"state": "quiet"}
# Flow control: a runtime limit, rates as a table and as shorthand (on a spec nothing runs).
SCHEDULE = {"spec": "parked", "cron": "@every 1h", "timezone": "Europe/Berlin",
            "args": {"k": "v"}, "overlap": "skip", "misfire": "catch_up", "catch_up": 2,
            "jitter": 1.5, "queue": "default", "priority": 1, "max_attempts": 3,
            "description": "d", "paused": True}  # paused: what a value leaves in never fires
SPECS["schedules"] = [{**SCHEDULE, "name": "hostile-pushed"}]
# A subscription no event reaches (a kind no test here makes, a queue nothing is in), to
# a host that never resolves: what a value leaves in sends nothing.
WEBHOOK = {"url": "https://hostile.invalid/hook", "kinds": ["cron_miss"],
           "filter": {"queue": "hostile-none", "spec": "parked"}, "enabled": False}
LIMIT = {"concurrency": 4, "rate": {"limit": 10, "period": 60.0, "burst": 2},
         "key_concurrency": 2, "key_rate": "100/min"}


def http_templates() -> list[tuple[str, str, dict[str, Any]]]:
    return [*(("POST", "/jobs", body) for body in enqueue_bodies()),
            ("POST", "/jobs/batch", BATCH), ("PUT", "/specs", SPECS),
            ("POST", "/workers/state", WORKERS_STATE),
            ("POST", "/workers/nobody/state", WORKER_STATE),
            ("PUT", "/limits/spec/parked", LIMIT), ("POST", "/workflows", WORKFLOW),
            ("PUT", "/schedules/hostile-sched", SCHEDULE),
            ("PUT", "/secrets/hostile-secret", {"value": "a-hostile-secret-0123", "window": 60.0}),
            ("PUT", "/specs", EXECUTE_SPECS), ("POST", "/jobs/keep-available/callback", CALLBACK),
            ("POST", "/jobs/keep-available/callback/heartbeat", {"token": CALLBACK["token"]}),
            ("POST", "/webhooks", WEBHOOK),
            ("POST", "/ojs/v1/jobs", ojs_push()),
            ("POST", "/ojs/v1/jobs/batch", {"jobs": [{"type": "hostile.batch", "args": [1]}]}),
            *ojs_workers()]


def ojs_workers() -> list[tuple[str, str, dict[str, Any]]]:
    """The OJS worker routes, of a queue nothing is pushed to (a FETCH takes nothing)."""
    pull = {"worker_id": "hostile-puller", "x_rota_specs": {"hostile": "sha256:0"}}
    return [("POST", "/ojs/v1/workers/fetch", {**pull, "queues": ["ojs-nothing"], "count": 2,
                                                "visibility_timeout_ms": 30000}),
            ("POST", "/ojs/v1/workers/ack", {"job_id": OJS_ID, "worker_id": "hostile-puller",
                                              "result": {"k": "v"}, "x_rota_attempt": 1}),
            ("POST", "/ojs/v1/workers/nack", {
                "job_id": OJS_ID, "worker_id": "hostile-puller", "requeue": False,
                "error": {"code": "c", "message": "m", "retryable": True, "details": {}}}),
            ("POST", "/ojs/v1/workers/heartbeat", {**pull, "active_jobs": [OJS_ID],
                                                   "visibility_timeout_ms": 30000})]


def ojs_push() -> dict[str, Any]:
    """An OJS PUSH with every option (docs/ojs.md), of a type no worker here takes."""
    return {"type": "hostile.push", "args": [1, {"k": "v"}], "id": OJS_ID,
            "meta": {"trace_id": "t"}, "x_ext": {"n": 1}, "specversion": "1.0",
            "options": {"queue": "ojs-hostile", "priority": 1, "timeout_ms": 1000,
                        "visibility_timeout_ms": 30000, "delay_until": soon(),
                        "expires_at": "+PT1H", "tags": ["a"], "metadata": {"k": "v"},
                        "retry": {"max_attempts": 3, "initial_interval": "PT1S",
                                  "backoff_coefficient": 2.0, "max_interval": "PT5M",
                                  "jitter": True, "non_retryable_errors": ["Auth.*"],
                                  "on_exhaustion": "discard",
                                  "backoff_strategy": "exponential"},
                        "unique": {"keys": ["type", "args"], "key": ["k"], "period": "PT1H",
                                   "on_conflict": "ignore", "states": ["available"]}}}


def registration_frame(worker_id: str, hostile_checksum: str) -> dict[str, Any]:
    return {"type": "heartbeat", "seq": 0, "worker_id": worker_id, "capacity": 0,
            "registration": {
                "hostname": "h", "os": "linux", "pid": 4242, "sdk": "raw/1",
                "queues": ["default"], "concurrency": 1,
                "specs": [{"name": "hostile", "checksum": hostile_checksum}],
                "labels": ["corpus"], "started_at": "2026-11-25T00:00:00.000Z", "prefetch": 0,
                "lean_acks": True, "idle_ack_interval": 10.0}}


def status_frame(worker_id: str) -> dict[str, Any]:
    return {"type": "heartbeat", "seq": 1, "worker_id": worker_id, "capacity": 0,
            "goodbye": False,
            "status": {
                "state": "running", "active_job_ids": ["j-1"], "prefetched_job_ids": ["j-2"],
                "cpu_percent": 1.5, "memory_rss": 1000,
                "progress": [{"job_id": "j-1", "percent": 50.0, "message": "m"}],
                "logs": [{"job_id": "j-1", "message": "m", "level": "info",
                          "time": "2026-11-25T00:00:00.000Z"}],
                "alerts": [{"message": "m", "level": "warning", "job_id": "j-1"}]},
            "results": [{"job_id": "j-3", "attempt": 1, "outcome": "failed", "result": None,
                         "error": {"type": "E", "message": "m", "retryable": True,
                                   "details": {"k": "v"}}}]}


def places(value: Any, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every field of a template, nested ones included, as key paths."""
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from places(child, (*prefix, key))


def put(template: Any, path: Path_, fragment: bytes) -> bytes:
    """The template as JSON bytes, with the value at ``path`` replaced by raw ``fragment``."""
    copy = json.loads(json.dumps(template))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = MARK
    text = json.dumps(copy).encode()
    marker = json.dumps(MARK).encode()
    assert text.count(marker) == 1
    return text.replace(marker, fragment)


# -- the server, a bystander, and what must not change -------------------------------------
class Watch:
    """What a test checks after its pairs: the log, the bystander, the stored jobs."""

    def __init__(self, records: list[logging.LogRecord]) -> None:
        self.records = records
        self.pairs = 0
        self.live: Live
        self.kept: list[Any] = []

    async def check(self) -> None:
        bad = []
        assert any(r.getMessage().startswith("register worker=") for r in self.records)
        for record in self.records:
            message = record.getMessage()
            if record.levelno >= logging.ERROR or record.exc_info:
                bad.append(f"{record.levelname} {message[:300]}")
            if f"\n{corpus.FORGED}" in message or f"\nERROR {corpus.FORGED}" in message \
                    or "\x1b" in message or "\r" in message:
                bad.append(f"forged or escaped: {message[:300]!r}")
        assert not bad, "\n".join(bad[:20])
        job = await self.live.enqueue("echo", {"n": self.pairs})
        done = await self.live.wait_state(job["id"], "completed", timeout=10)
        assert done["result"] == {"n": self.pairs}
        assert stored(self.live) == self.kept, "a stored job changed"


def stored(live: Live) -> list[Any]:
    with contextlib.closing(sqlite3.connect(live.settings.db)) as conn:
        return conn.execute("SELECT * FROM jobs WHERE id LIKE 'keep-%' ORDER BY id").fetchall()


@pytest.fixture
async def watched(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Watch]:
    # A handler of its own, from the start: caplog.records holds only the current phase's
    # records, and the check runs in the fixture's teardown.
    caplog.set_level(logging.INFO)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    watch = Watch(records)
    live = await start_server(tmp_path, registration_timeout=2.0)
    specs = tmp_path / "specs"
    for name in ("echo", "parked", "hostile"):
        await live.push(write_spec(specs, name))
    live.admin, live.worker_token = await make_tokens(  # type: ignore[attr-defined]
        live, ("admin", None), ("worker", None))
    live.http.headers.update(bearer(live.admin))  # type: ignore[attr-defined]
    secret = await live.http.put("/secrets/hostile-exec", json={"value": "x" * 32})
    assert secret.status_code == 201, secret.text
    bystander = Worker(url=live.ws, specs_dir=specs, heartbeat_interval=0.1,
                       token=live.worker_token)  # type: ignore[attr-defined]

    @bystander.handler("echo")
    async def echo(ctx: JobContext) -> Any:
        return ctx.args

    task = asyncio.create_task(bystander.run())
    await wait_until(lambda: bystander.connected.is_set() or task.done(), what="bystander")
    # Stored jobs in several states, which nothing in the corpus may touch.
    await live.enqueue("parked", {"k": "waits"}, id="keep-available")
    await live.enqueue("parked", {"k": "later"}, id="keep-scheduled", delay=3600)
    await live.enqueue("echo", {"k": "done"}, id="keep-completed")
    await live.wait_state("keep-completed", "completed")
    live.hostile_checksum = checksum(write_spec(specs, "hostile"))  # type: ignore[attr-defined]
    watch.live, watch.kept = live, stored(live)
    try:
        yield watch
        await watch.check()
    finally:
        logging.getLogger().removeHandler(handler)
        bystander.stop()
        await asyncio.wait_for(task, 10)
        await stop_server(live)


# -- HTTP ------------------------------------------------------------------------------
def assert_http(answer: httpx.Response, refused: bool, what: str) -> None:
    status = answer.status_code
    assert status < 500, f"{what}: {status} {answer.text[:300]}"
    if status >= 400:
        assert answer.headers.get("content-type", "").startswith(
            ("application/json", OJS_MEDIA)), what
        error = answer.json()["error"]
        assert isinstance(error["code"], str) and isinstance(error["message"], str), what
        assert_plain(error["message"], what)
    elif refused and answer.request.url.path == "/jobs/batch":
        # The batch's own shape was fine; the value sat in one request: that one is refused.
        assert all(400 <= r["status"] < 500 for r in answer.json()["results"]), what
        for result in answer.json()["results"]:
            assert_plain(result["error"]["message"], what)
    else:
        assert not refused, f"{what}: accepted ({status}) {answer.text[:300]}"


def assert_plain(message: str, what: str) -> None:
    """An error in Rota's words, naming the field: never msgspec's own ("Expected `float`
    >= 0.0 - at `$.delay`")."""
    assert "Expected `" not in message and "- at `$" not in message \
        and "field `" not in message, f"{what}: {message}"


HTTP_PLACES = [(method, route, index, path)
               for index, (method, route, template) in enumerate(http_templates())
               for path in places(template)]


# The default run puts every third value of the corpus in each place, a different third
# from place to place, so every value and every place are tried; the soak run (-m soak,
# .ci/run) puts every value in every place.
SPREAD = [*((chunk, 3) for chunk in range(4)),
          *(pytest.param(chunk, 1, marks=pytest.mark.soak) for chunk in range(4))]
FRAME_SPREAD = [*((chunk, 3) for chunk in range(6)),
                *(pytest.param(chunk, 1, marks=pytest.mark.soak) for chunk in range(6))]


def spread(values: list[corpus.Value], place: int, every: int) -> list[tuple[int, corpus.Value]]:
    """The values (with their numbers) tried in place number ``place``."""
    return [(n, value) for n, value in enumerate(values) if n % every == place % every]


@pytest.mark.parametrize(("chunk", "every"), SPREAD)
async def test_every_value_in_every_field_of_every_body(watched: Watch, chunk: int, every: int):
    live, templates = watched.live, http_templates()
    for place, (method, route, index, path) in enumerate(HTTP_PLACES[chunk::4]):
        for _, (name, fragment, refused) in spread(corpus.VALUES, place, every):
            body = put(templates[index][2], path, fragment)
            answer = await live.http.request(method, route, content=body)
            assert_http(answer, refused, f"{method} {route} {path} <- {name}")
            watched.pairs += 1


async def test_whole_bodies_on_every_route_that_takes_one(watched: Watch):
    for method, route, _ in http_templates():
        for name, body in corpus.BODIES:  # none is an object of the right shape
            answer = await watched.live.http.request(method, route, content=body)
            assert 400 <= answer.status_code < 500, f"{method} {route} <- {name}"
            assert_http(answer, True, f"{method} {route} <- {name}")
            watched.pairs += 1


PATH_ROUTES = [("GET", "/jobs/{}"), ("GET", "/jobs/{}/result"), ("DELETE", "/jobs/{}"),
               ("POST", "/jobs/{}/retry"), ("GET", "/specs/{}/history"),
               ("POST", "/workers/{}/state"), ("PUT", "/limits/spec/{}"),
               ("DELETE", "/limits/spec/{}"), ("PUT", "/limits/{}/parked"),
               ("GET", "/workflows/{}"), ("DELETE", "/workflows/{}"),
               ("POST", "/workflows/{}/retry"),
               ("GET", "/schedules/{}"), ("PUT", "/schedules/{}"), ("DELETE", "/schedules/{}"),
               ("POST", "/schedules/{}/pause"), ("POST", "/schedules/{}/resume"),
               ("PUT", "/secrets/{}"), ("DELETE", "/secrets/{}"),
               ("GET", "/webhooks/{}"), ("PATCH", "/webhooks/{}"), ("DELETE", "/webhooks/{}"),
               ("GET", "/webhooks/{}/deliveries"), ("POST", "/webhooks/{}/test"),
               ("POST", "/webhooks/{}/rotate-secret"),
               ("GET", "/ojs/v1/jobs/{}"), ("DELETE", "/ojs/v1/jobs/{}"),
               ("POST", "/ojs/v1/jobs/{}/activate"), ("POST", "/jobs/{}/callback"),
               ("POST", "/jobs/{}/callback/heartbeat")]


async def test_every_path_segment_and_query_value(watched: Watch):
    live = watched.live
    for method, route in PATH_ROUTES:
        for name, segment in corpus.SEGMENTS:
            body = (json.dumps(CALLBACK).encode() if "callback" in route else
                    json.dumps(WORKER_STATE).encode() if "workers" in route else
                    json.dumps(SCHEDULE).encode() if route.startswith("/schedules") and
                    method == "PUT" else json.dumps(LIMIT).encode() if method == "PUT" else
                    b'{"enabled": true}' if method == "PATCH" else None)
            answer = await live.http.request(method, route.format(segment), content=body)
            assert 400 <= answer.status_code < 500, f"{method} {route} <- {name}: {answer.text}"
            assert_http(answer, True, f"{method} {route} <- {name}")
            watched.pairs += 1
    for name, value in corpus.NUMBERS_IN_QUERY:
        answer = await live.http.get(f"/jobs/keep-completed/result?wait={value}")
        assert_http(answer, False, f"?wait={value} ({name})")
        watched.pairs += 1
    for name, field, value, code in corpus.FILTER_NAMES:  # no bulk action may touch a job
        for answer in [await live.http.get("/jobs", params={field: value}),
                       await live.http.get("/events", params={field: value}),  # (or follow none)
                       *[await live.http.post(f"/jobs/{action}", json={"filter": {field: value}})
                         for action in ("retry", "cancel")]]:
            assert_http(answer, True, f"{answer.request.url.path} {field}={value} ({name})")
            assert (answer.status_code, answer.json()["error"]["code"]) == (422, code), name
            watched.pairs += 1
    for name, value in corpus.QUEUE_SLIPS:
        for answer in [await live.http.post(f"/queues/{value}/pause"),
                       await live.http.post(f"/queues/{value}/resume"),
                       await live.http.post("/jobs", json={"spec": "echo", "queue": value})]:
            assert_http(answer, True, f"{answer.request.url.path} queue={value} ({name})")
            assert (answer.status_code, answer.json()["error"]["code"]) == (422,
                                                                         "unknown_queue"), name
            watched.pairs += 1
    for name, method, path, body, code in corpus.FLOW_SLIPS:
        answer = await live.http.request(method, path, json=body)
        assert_http(answer, True, f"{method} {path} ({name})")
        assert (answer.status_code, answer.json()["error"]["code"]) == (422, code), name
        watched.pairs += 1
    assert not await live.coordinator.store.runtime_limits(), "a refused limit was stored"
    before = (await live.http.get("/workflows", params={"limit": 500})).json()["workflows"]
    for name, body, status, code in corpus.WORKFLOW_SLIPS:
        answer = await live.http.post("/workflows", json=body)
        assert_http(answer, True, f"POST /workflows ({name})")
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), name
        watched.pairs += 1
    after = (await live.http.get("/workflows", params={"limit": 500})).json()["workflows"]
    assert after == before, "a refused workflow was stored"
    for name, body, code in corpus.SCHEDULE_SLIPS:
        answer = await live.http.put("/schedules/hostile-slip", json=body)
        assert_http(answer, True, f"PUT /schedules/hostile-slip ({name})")
        assert (answer.status_code, answer.json()["error"]["code"]) == (422, code), name
        watched.pairs += 1
    assert (await live.http.get("/schedules/hostile-slip")).status_code == 404


async def test_every_header_rota_reads(watched: Watch):
    live = watched.live
    port = live.settings.port
    for name, value in corpus.AUTHORIZATIONS:
        # A control character never reaches Rota: the HTTP parser refuses the request.
        expected = (400, "bad_http_request") if b"\x07" in value else (401, "unauthorized")
        status, body = await raw_http(port, b"GET /specs HTTP/1.1\r\nHost: x\r\n"
                                      b"Authorization: " + value + b"\r\n\r\n")
        assert (status, json.loads(body)["error"]["code"]) == expected, name
        if status == 401:  # a token sent is said to be refused, not missing
            given = value[:7].lower() == b"bearer " and bool(value[7:].strip())
            assert json.loads(body)["error"]["message"].startswith(
                "the token given is not valid here" if given else "send a token"), name
        watched.pairs += 1
        status, body = await raw_http(port, b"GET /work HTTP/1.1\r\nHost: x\r\n"
                                      b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
                                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                      b"Sec-WebSocket-Version: 13\r\n"
                                      b"Authorization: " + value + b"\r\n\r\n")
        assert (status, json.loads(body)["error"]["code"]) == expected, f"/work {name}"
        watched.pairs += 1
        # The routes the HTTP protocol serves itself (rota/server/direct.py): the same.
        for line in (b"POST /jobs HTTP/1.1", b"POST /jobs/batch HTTP/1.1",
                     b"GET /jobs/x/result?wait=0 HTTP/1.1"):
            status, body = await raw_http(port, line + b"\r\nHost: x\r\nContent-Length: 2\r\n"
                                          b"Authorization: " + value + b"\r\n\r\n{}")
            assert (status, json.loads(body)["error"]["code"]) == expected, (line, name)
            watched.pairs += 1
    token = bearer(live.admin)["Authorization"].encode()  # type: ignore[attr-defined]
    for name, value in corpus.ORIGINS:
        expected = (400, "bad_http_request") if b"\x1b" in value else (403, "origin_not_allowed")
        status, body = await raw_http(port, b"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: "
                                      + token + b"\r\nOrigin: " + value
                                      + b"\r\nContent-Length: 2\r\n\r\n{}")
        assert (status, json.loads(body)["error"]["code"]) == expected, f"POST Origin {name}"
        watched.pairs += 1
    for name, value in corpus.ORIGINS:
        expected = (400, "bad_http_request") if b"\x1b" in value else (403, "origin_not_allowed")
        status, body = await raw_http(port, b"GET /work HTTP/1.1\r\nHost: x\r\n"
                                      b"Upgrade: websocket\r\nConnection: Upgrade\r\n"
                                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                      b"Sec-WebSocket-Version: 13\r\nAuthorization: " + token
                                      + b"\r\nOrigin: " + value + b"\r\n\r\n")
        assert (status, json.loads(body)["error"]["code"]) == expected, f"Origin {name}"
        watched.pairs += 1
    # Headers and URL together are bounded; a large but legal one still passes.
    for request, expected in [
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"GET /jobs/" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 60_000 + b"\r\n\r\n", 200),
    ]:
        status, body = await raw_http(port, request)
        assert status == expected, request[:40]
        if status == 431:
            assert json.loads(body)["error"]["code"] == "headers_too_large"
        watched.pairs += 1
    for name, value in corpus.CONTENT_LENGTHS:
        status, _ = await raw_http(port, b"POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: "
                                   + token + b"\r\nContent-Length: " + value
                                   + b"\r\nConnection: close\r\n\r\n{}")
        assert 400 <= status < 500, name
        watched.pairs += 1


# -- /work -----------------------------------------------------------------------------
async def outcome(ws: websockets.ClientConnection, seq: int | None) -> tuple[str, Any]:
    """How the server took a frame: ("ack", ack) or ("closed", (error frame, close code)).
    ``seq``: the ack's, or None for the next ack (the frame under test may carry any seq,
    and its ack echoes it: waiting for another one waited for the heartbeat timeout)."""
    error = None
    try:
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if frame["type"] == "ack" and (seq is None or frame["seq"] == seq):
                return "ack", frame
            if frame["type"] == "error":
                error = frame
    except websockets.ConnectionClosed as closed:
        return "closed", (error, closed.rcvd.code if closed.rcvd else None)


def assert_frame(result: tuple[str, Any], refused: bool, what: str) -> None:
    kind, detail = result
    if kind == "ack":
        assert not refused, f"{what}: accepted"
        return
    error, code = detail
    assert code in CLOSE_CODES, f"{what}: closed with {code} ({error})"
    # Without an error frame only the WebSocket layer's own closes (docs/protocol.md §7).
    assert error is not None or code in (1007, 1009), f"{what}: no error frame ({code})"
    if error is not None:
        assert isinstance(error["code"], str) and error["message"], what


async def send_pair(watched: Watch, frame: bytes, second: bytes | None) -> tuple[str, Any]:
    """Send ``frame`` on a new connection; if ``second`` is given, ``frame`` is a good
    registration and ``second`` the frame under test. Return how the server took it."""
    live = watched.live
    # proxy=None: loopback, and no look through the environment for a proxy on each of
    # the ~2,800 connections (a tenth of the test's CPU)
    async with websockets.connect(live.ws, additional_headers=bearer(
            live.worker_token), max_size=None, proxy=None) as ws:  # type: ignore[attr-defined]
        if second is not None:  # a good registration first; the hostile frame after it
            await ws.send(frame.decode())
            first = await outcome(ws, 0)
            assert first[0] == "ack", first
            frame = second
        await ws.send(frame, text=True)
        result = await outcome(ws, None)  # only the frame under test is acked from here
        watched.pairs += 1
        return result


def frame_places() -> list[tuple[str, Path_]]:
    first = registration_frame("w", "sha256:x")
    later = status_frame("w")
    return [*(("first", path) for path in places(first)),
            *(("later", path) for path in places(later))]


FRAME_PLACES = frame_places()


@pytest.mark.parametrize(("chunk", "every"), FRAME_SPREAD)
async def test_every_value_in_every_field_of_every_frame(watched: Watch, chunk: int, every: int):
    hostile = watched.live.hostile_checksum  # type: ignore[attr-defined]
    for index, (which, path) in enumerate(FRAME_PLACES[chunk::6]):
        for number, (name, fragment, refused) in spread(corpus.VALUES, index, every):
            worker_id = f"h{chunk}-{index}-{number}"
            good = json.dumps(registration_frame(worker_id, hostile)).encode()
            if which == "first":
                result = await send_pair(
                    watched, put(registration_frame(worker_id, hostile), path, fragment), None)
            else:
                result = await send_pair(watched, good,
                                         put(status_frame(worker_id), path, fragment))
            assert_frame(result, refused, f"{which} frame {path} <- {name}")


async def test_whole_frames(watched: Watch):
    hostile = watched.live.hostile_checksum  # type: ignore[attr-defined]
    for number, (name, body) in enumerate(corpus.BODIES):
        # as the first frame, and as the frame after a good registration
        assert_frame(await send_pair(watched, body, None), True, f"first frame <- {name}")
        good = json.dumps(registration_frame(f"whole-{number}", hostile)).encode()
        assert_frame(await send_pair(watched, good, body), True, f"later frame <- {name}")
    live = watched.live
    async with websockets.connect(live.ws, additional_headers=bearer(
            live.worker_token)) as ws:  # type: ignore[attr-defined]
        await ws.send(b"\x00\x01binary")
        assert_frame(await outcome(ws, 0), True, "a binary frame")
        watched.pairs += 1


# -- the findings that started this, pinned one by one ------------------------------------
async def test_what_was_found_by_hand_gets_a_precise_4xx(watched: Watch):
    live = watched.live
    cases = [
        (b'{"spec": "parked", "args": {"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}}",
         400, "too_deep"),
        (b'{"spec": "parked", "priority": 99999999999999999999}', 422, "invalid_request"),
        (b'{"spec": "parked", "priority": -9223372036854775809}', 422, "invalid_request"),
        (b'{"spec": "parked", "priority": 2147483648}', 422, "invalid_request"),
        (b'{"spec": "parked", "args": {"a": "\xff\xfe"}}', 400, "invalid_utf8"),
        (b'{"spec": "parked", "args": {"a": "\\ud800"}}', 400, "invalid_unicode"),
        (b'{"spec": "parked", "run_at": "9999-12-31T00:00:00Z"}', 422, "invalid_run_at"),
        (b'{"spec": "parked", "ttl": 1e300}', 422, "invalid_request"),
        (b'{"spec": "parked", "max_attempts": 4294967296}', 422, "invalid_request"),
    ]
    for body, status, code in cases:
        answer = await live.http.post("/jobs", content=body)
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), body[:80]
    unicode = (await live.http.post("/jobs", content=cases[5][0])).json()["error"]["message"]
    assert "lone UTF-16 surrogate \\ud800" in unicode and "truncated" not in unicode
    # Duplicate keys: accepted, the last one wins, and what is stored holds it once.
    answer = await live.http.post("/jobs", content=b'{"spec": "parked", "args": {"a": 1, "a": 2}}')
    assert answer.status_code == 201 and answer.json()["job"]["args"] == {"a": 2}
    # Priorities at the documented edges are taken.
    for edge in (2**31 - 1, -(2**31 - 1)):
        assert (await live.http.post("/jobs", json={"spec": "parked", "priority": edge})
                ).status_code == 201

    hostile = live.hostile_checksum  # type: ignore[attr-defined]
    deep = ('{"type": "heartbeat", "seq": 1, "worker_id": "deep", "results": [{"job_id": "j",'
            ' "attempt": 1, "outcome": "completed", "result": ' + "[" * 40_000 + "]" * 40_000
            + "}]}").encode()
    good = json.dumps(registration_frame("deep", hostile)).encode()
    kind, (error, code) = await send_pair(watched, good, deep)
    assert (kind, error["code"], code) == ("closed", "too_deep", 1007)
