"""Bad input gets a precise error and loses nothing: frames on /work and HTTP requests."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import websockets
from conftest import Live, write_spec
from helpers import RawWorker, closed_with, heartbeat, registration

REGISTRATION = registration()


@pytest.fixture
async def busy_good_worker(live: Live, connect, tmp_path: Path):
    """A healthy worker holding one job, with two more jobs queued behind it."""
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    good = await connect("good")
    await good.register([echo], concurrency=1)
    jobs = [await live.enqueue("echo", {"n": n}) for n in range(3)]
    [held] = await good.jobs(1)
    return good, held, jobs


FIRST_FRAME_CASES: list[tuple[str, Any, str, int]] = [
    ("malformed JSON", '{"type": "heartbeat", "seq": 0,', "malformed_json", 1007),
    ("unknown type", {"type": "hello", "seq": 0}, "unknown_type", 1003),
    ("a server message sent by a worker", {"type": "ack", "seq": 0, "state": "running",
                                           "server_time": "x"}, "unknown_type", 1003),
    ("no registration first", heartbeat(0, "bad", capacity=1), "registration_required", 1008),
    ("seq of the wrong type", heartbeat("zero", "bad", registration=REGISTRATION),
     "invalid_message", 1007),
    ("capacity negative", heartbeat(0, "bad", capacity=-3, registration=REGISTRATION),
     "invalid_message", 1007),
    ("concurrency zero", heartbeat(0, "bad", registration=registration(concurrency=0)),
     "invalid_message", 1007),
    ("queues not a list", heartbeat(0, "bad", registration=registration(queues="default")),
     "invalid_message", 1007),
    ("a JSON array", [1, 2, 3], "invalid_message", 1007),
    ("an idle ack interval of zero", heartbeat(0, "bad", registration={
        **REGISTRATION, "lean_acks": True, "idle_ack_interval": 0}), "invalid_message", 1007),
    ("no type at all", {"seq": 0, "worker_id": "bad", "registration": REGISTRATION},
     "unknown_type", 1003),
    ("a spec declared twice", heartbeat(0, "bad", registration=registration([
        {"name": "echo", "checksum": "sha256:1"}, {"name": "echo", "checksum": "sha256:2"}])),
     "invalid_message", 1007),
]


@pytest.mark.parametrize(("case", "frame", "code", "close_code"), FIRST_FRAME_CASES,
                         ids=[c[0] for c in FIRST_FRAME_CASES])
async def test_bad_first_frame_gets_error_and_close(live: Live, connect, busy_good_worker,
                                                    case: str, frame: Any, code: str,
                                                    close_code: int):
    good, held, jobs = busy_good_worker
    bad = await connect("bad")
    await bad.send(frame)
    error = await bad.expect("error")
    assert error["code"] == code and error["message"]
    assert await closed_with(bad) == close_code
    await assert_others_unharmed(live, good, held, jobs)


async def test_a_refused_registration_is_logged_with_the_worker_id_it_gave(
        live: Live, connect, caplog: pytest.LogCaptureFixture):
    bad = await connect("bad")
    await bad.send(heartbeat(0, "w-typo", registration={**REGISTRATION, "lean_acks": True,
                                                        "idle_ack_interval": "10"}))
    error = await bad.expect("error")
    assert error["code"] == "invalid_message" and "idle_ack_interval" in error["message"]
    assert await closed_with(bad) == 1007
    assert "protocol error worker=w-typo token=None code=invalid_message" in caplog.text


async def assert_others_unharmed(live: Live, good: RawWorker, held: dict[str, Any],
                                 jobs: list[dict[str, Any]]) -> None:
    """The good worker still works, and every job is where it should be."""
    ack = await good.complete(held, capacity=1)
    assert ack["accepted"] == [held["id"]]
    [nxt] = await good.jobs(1)
    states = {j["id"]: (await live.job(j["id"]))["state"] for j in jobs}
    assert states[held["id"]] == "completed" and states[nxt["id"]] == "active"
    assert sorted(states.values()) == ["active", "available", "completed"]


LATER_FRAME_CASES: list[tuple[str, Any, str, int]] = [
    ("seq going back", heartbeat(0, "bad"), "seq_not_increasing", 1008),
    ("another worker id", heartbeat(5, "someone-else"), "worker_id_mismatch", 1008),
    ("a second registration", heartbeat(5, "bad", registration=REGISTRATION),
     "already_registered", 1008),
    ("result with a wrong outcome", heartbeat(5, "bad", results=[
        {"job_id": "x", "attempt": 1, "outcome": "maybe"}]), "invalid_message", 1007),
    ("malformed JSON", "{nope", "malformed_json", 1007),
    ("a status without its state", heartbeat(5, "bad", status={"active_job_ids": []}),
     "invalid_message", 1007),
    ("an error object without its type", heartbeat(5, "bad", results=[
        {"job_id": "x", "attempt": 1, "outcome": "failed", "error": {"message": "m"}}]),
     "invalid_message", 1007),
    # A process uses at most 100% of each core: 4,096 cores is the most Rota takes.
    ("cpu_percent past 4,096 cores", heartbeat(5, "bad", status={
        "state": "running", "cpu_percent": 409_600.1}), "invalid_message", 1007),
    ("cpu_percent huge", heartbeat(5, "bad", status={"state": "running", "cpu_percent": 1e300}),
     "invalid_message", 1007),
    ("cpu_percent negative", heartbeat(5, "bad", status={"state": "running",
                                                         "cpu_percent": -1}),
     "invalid_message", 1007),
]


@pytest.mark.parametrize(("case", "frame", "code", "close_code"), LATER_FRAME_CASES,
                         ids=[c[0] for c in LATER_FRAME_CASES])
async def test_bad_frame_from_a_worker_holding_a_job_loses_nothing(
        live: Live, connect, tmp_path: Path, case: str, frame: Any, code: str, close_code: int):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    bad = await connect("bad")
    await bad.register([echo], concurrency=1)
    job = await live.enqueue("echo")
    await bad.jobs(1)
    await bad.send(frame)
    error = await bad.expect("error")
    assert error["code"] == code
    assert await closed_with(bad) == close_code
    await live.wait_state(job["id"], "available")  # back in the queue, not lost
    rescuer = await connect("rescuer")
    await rescuer.register([echo])
    [copy] = await rescuer.jobs(1)
    assert copy["id"] == job["id"] and copy["attempt"] == 2


async def test_binary_frame_is_refused(live: Live, connect, busy_good_worker):
    good, held, jobs = busy_good_worker
    bad = await connect("bad")
    await bad.ws.send(b'{"type": "heartbeat"}')
    assert (await bad.expect("error"))["code"] == "binary_not_supported"
    assert await closed_with(bad) == 1003
    await assert_others_unharmed(live, good, held, jobs)


async def test_oversized_frame_is_refused(live: Live, connect, busy_good_worker):
    good, held, jobs = busy_good_worker
    bad = await connect("bad")
    huge = heartbeat(0, "bad", registration=registration(hostname="x" * (2 << 20)))
    await bad.send(huge)
    assert await closed_with(bad) == 1009
    await assert_others_unharmed(live, good, held, jobs)


async def test_a_second_connection_with_a_live_worker_id_is_refused(
        live: Live, connect, busy_good_worker, tmp_path: Path):
    good, held, jobs = busy_good_worker
    twin = await connect("good")
    await twin.beat(registration=REGISTRATION, capacity=1)
    assert (await twin.expect("error"))["code"] == "worker_id_in_use"
    assert await closed_with(twin) == 1008
    await assert_others_unharmed(live, good, held, jobs)


# -- HTTP -------------------------------------------------------------------------------
async def test_enqueue_errors_are_precise(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "typed", extra='[args.n]\ntype = "integer"\n'))
    name_rule = "1 to 128 letters, digits and '_.:-', starting with a letter or digit"
    cases = [  # each message in plain words, naming the field (never msgspec's own)
        (b'{"spec": "typed",', 400, "malformed_json", ""),
        (b'{"spec": 5}', 422, "invalid_request", "spec must be a string, got an integer"),
        (b'[{"spec": "typed"}]', 422, "invalid_request",
         "the body must be an object, got an array"),
        (b'{"args": {}}', 422, "invalid_request", "spec is required"),
        (b'{"spec": "typed", "args": [1]}', 422, "invalid_request",
         "args must be an object, got an array"),
        (b'{"spec": "typed", "args": {"n": 1}, "colour": "red"}', 422, "invalid_request",
         "colour is not a field Rota knows (known: spec, args, id, queue, priority, run_at,"
         " delay, ttl, visibility_timeout, max_attempts, max_fails, capture_logs,"
         " new_queue, unique, concurrency_key, labels, expires_at)"),
        (b'{"spec": "typed", "delay": -1}', 422, "invalid_request", "delay must be a number >= 0"),
        (b'{"spec": "typed", "ttl": 0}', 422, "invalid_request", "ttl must be a number > 0"),
        (b'{"spec": "typed", "priority": "3"}', 422, "invalid_request",
         "priority must be an integer, got a string"),
        (b'{"spec": "typed", "priority": 99999999999}', 422, "invalid_request",
         "priority must be an integer <= 2147483647"),
        (b'{"spec": "typed", "capture_logs": 1}', 422, "invalid_request",
         "capture_logs must be true or false, got an integer"),
        (b'{"spec": "nope"}', 422, "unknown_spec", ""),
        (b'{"spec": "typed", "args": {"n": "one"}}', 422, "invalid_args",
         "args.n must be an integer, got a string (spec 'typed')"),
        (b'{"spec": "typed", "args": {"n": true}}', 422, "invalid_args",
         "args.n must be an integer, got a boolean (spec 'typed')"),
        (b'{"spec": "typed", "args": {}}', 422, "invalid_args", ""),
        (b'{"spec": "typed", "args": {"n": 1, "m": 2}}', 422, "invalid_args", ""),
        (b'{"spec": "typed", "args": {"n": 1}, "queue": "no spaces please"}', 422,
         "invalid_request", f"queue must be a name of {name_rule}"),
    ]
    for body, status, code, says in cases:
        response = await live.http.post("/jobs", content=body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["code"] == code, body
        message = response.json()["error"]["message"]
        assert message == says or (not says and message and "`" not in message), body
    batch = await live.http.post("/jobs/batch",
                                 content=b'{"jobs": [{"spec": "typed", "delay": -1}]}')
    assert batch.json()["results"][0]["error"]["message"] == "delay must be a number >= 0"
    for body, says in ((b'{"specs": [{"name": "a", "version": "1", "retry": {"max_attempts": 0}}]}',
                        "specs[0].retry.max_attempts must be an integer >= 1"),
                       (b'{"specs": [{"name": "a", "version": "1 2"}]}', "specs[0].version must"
                        " be a version of 1 to 64 characters, with no space or control character"),
                       (b'{"specs": [{"name": "a", "version": "1",'
                        b' "args": {"w": {"type": "int"}}}]}',
                        "specs[0].args.w.type must be one of any, array, boolean, integer,"
                        " number, object, string, not 'int'")):
        pushed = await live.http.put("/specs", content=body)
        assert (pushed.status_code, pushed.json()["error"]["message"]) == (422, says), body
    token = await live.http.post("/tokens", json={"scope": "root"})
    assert token.json()["error"]["message"] == \
        "scope must be one of admin, metrics, producer, worker, not 'root'"
    counts = (await live.http.get("/queues")).json()["queues"]
    assert counts == []  # nothing was stored


async def test_duplicate_job_id_gives_the_existing_job(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    first = await live.http.post("/jobs", json={"spec": "echo", "id": "order-17", "args": {"a": 1}})
    again = await live.http.post("/jobs", json={"spec": "echo", "id": "order-17", "args": {"a": 1}})
    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["created"] is True and again.json()["created"] is False
    assert again.json()["job"]["id"] == "order-17"
    assert again.json()["job"]["enqueued_at"] == first.json()["job"]["enqueued_at"]
    conflict = await live.http.post("/jobs", json={"spec": "echo", "id": "order-17",
                                                   "args": {"a": 2}})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "id_conflict"
    assert live.coordinator.scheduler.live() == 1
    assert (await live.job("order-17"))["args"] == {"a": 1}


async def test_not_found_and_bad_parameters(live: Live):
    for path, status, code in [("/jobs/missing", 404, "not_found"),
                               ("/jobs/missing/result", 404, "not_found"),
                               ("/jobs/missing/result?wait=abc", 400, "invalid_wait"),
                               ("/jobs/missing/result?wait=-1", 400, "invalid_wait"),
                               ("/specs/missing/history", 404, "not_found"),
                               ("/no/such/route", 404, "not_found")]:
        response = await live.http.get(path)
        assert response.status_code == status, path
        assert response.json()["error"]["code"] == code, path
    response = await live.http.delete("/specs")
    assert response.status_code == 405
    assert response.json()["error"]["code"] == "method_not_allowed"


async def test_bad_spec_push_changes_nothing(live: Live, tmp_path: Path):
    good = write_spec(tmp_path, "echo")
    await live.push(good)
    for body, code in [({"specs": [{"name": "bad name!", "version": "1"}]}, "invalid_request"),
                       ({"specs": [{"name": "x"}]}, "invalid_request"),
                       ({"specs": [{"name": "x", "version": "1", "colour": "red"}]}, "invalid_request"),
                       ({"specs": [{"name": "x", "version": "1"}, {"name": "x", "version": "2"}]},
                        "duplicate_spec")]:
        response = await live.http.put("/specs", json=body)
        assert response.status_code == 422, body
        assert response.json()["error"]["code"] == code
    specs = (await live.http.get("/specs")).json()["specs"]
    assert [s["name"] for s in specs] == ["echo"]
    assert live.coordinator.scheduler.status_quo.keys() == {"echo"}


async def test_a_result_the_store_cannot_commit_is_rejected_and_kept(
        live: Live, connect, tmp_path: Path):
    """A real SQLite failure (a trigger aborts the update): the worker is told, the job stays
    reserved, and reporting it again once the store recovers succeeds."""
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    worker = await connect()
    await worker.register([echo])
    await live.enqueue("echo", id="doomed")
    [copy] = await worker.jobs(1)
    with contextlib.closing(sqlite3.connect(live.settings.db, isolation_level=None)) as db:
        db.execute("CREATE TRIGGER refuse BEFORE UPDATE OF state ON jobs"
                   " WHEN NEW.state = 'completed' BEGIN SELECT RAISE(ABORT, 'disk says no'); END")
        ack = await worker.complete(copy, result=1)
        assert ack.get("accepted", []) == []
        [rejection] = ack["rejected"]
        assert rejection["attempt"] == 1 and "disk says no" in rejection["reason"]
        assert (await live.job("doomed"))["state"] == "active"
        db.execute("DROP TRIGGER refuse")
    ack = await worker.complete(copy, result=2)
    assert ack["accepted"] == ["doomed"]
    assert (await live.job("doomed"))["result"] == 2


@pytest.mark.parametrize("path", ["/jobs", "/jobs/batch", "/specs"])
async def test_a_client_gone_mid_body_leaves_no_traceback(live: Live, tmp_path: Path, path: str,
                                                         caplog: pytest.LogCaptureFixture):
    """A body cut short by a closed connection: nothing is stored, nothing is logged above
    DEBUG, and the server goes on serving."""
    import asyncio

    await live.push(write_spec(tmp_path, "echo"))
    method = "PUT" if path == "/specs" else "POST"
    for _ in range(3):
        reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 1000\r\n\r\n{{\"spec\":".encode())
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    await live.enqueue("echo", id="after")  # still serving; also orders us after the three
    assert (await live.http.get("/healthz")).json()["live_jobs"] == 1
    # (A "server stalled" warning is the loop's own, about a loaded machine.)
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING
             and "AUTH IS OFF" not in r.getMessage()
             and not r.getMessage().startswith("server stalled")]
    assert noisy == [], [r.getMessage() for r in noisy]


async def test_a_wrong_url_says_where_to_go(live: Live):
    for path in ("/", "/work/", "/jobs"):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(f"ws://127.0.0.1:{live.port}{path}")
        answer = refused.value.response
        assert answer.status_code == 404, path
        assert b"workers connect to /work" in answer.body and b'"not_found"' in answer.body
    plain = await live.http.get("/work")
    assert plain.status_code == 404 and "WebSocket endpoint" in plain.json()["error"]["message"]
    nowhere = await live.http.get("/nope")
    assert "/openapi.json" in nowhere.json()["error"]["message"]
