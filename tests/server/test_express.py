"""The producers' hot routes (rota/server/express.py) skip Starlette's router, and answer
exactly as the routes did through it: the same checks at the gate, the same error bodies
and statuses, the same safety net; every other method or path still reaches the router."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import bearer, make_tokens

from rota.server import api
from rota.server.express import route


def scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path}


def test_only_the_hot_routes_are_taken_and_a_result_gets_its_job_id():
    assert route(scope("POST", "/jobs")) is api.enqueue
    assert route(scope("POST", "/jobs/batch")) is api.enqueue_batch
    result = scope("GET", "/jobs/j-1/result")
    assert route(result) is api.job_result and result["path_params"] == {"job_id": "j-1"}
    # One non-empty segment for the id, as Starlette's {job_id}; the rest go on to it.
    for method, path in [("GET", "/jobs//result"), ("GET", "/jobs/a/b/result"),
                         ("GET", "/jobs/result"), ("PUT", "/jobs"), ("GET", "/jobs"),
                         ("POST", "/jobs/"), ("POST", "/jobs/retry"), ("HEAD", "/jobs/a/result"),
                         ("POST", "/jobs/a/result"), ("GET", "/jobs/batch")]:
        assert route(scope(method, path)) is None, (method, path)


async def test_the_hot_routes_answer_errors_in_rotas_shape(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo", extra='[args.n]\ntype = "integer"\n'))
    cases = [
        (live.http.post("/jobs", content=b"{not json"), 400, "malformed_json"),
        (live.http.post("/jobs", json={"spec": "echo", "args": {"n": "x"}}), 422, "invalid_args"),
        (live.http.post("/jobs", json={"spec": "nope"}), 422, "unknown_spec"),
        (live.http.post("/jobs", json={"spec": "echo", "bogus": 1}), 422, "invalid_request"),
        (live.http.post("/jobs", content=b"x" * (live.settings.max_body_bytes + 1)), 413,
         "body_too_large"),
        (live.http.post("/jobs/batch", json={"jobs": "no"}), 422, "invalid_request"),
        (live.http.get("/jobs/missing/result"), 404, "not_found"),
        (live.http.get("/jobs/missing/result?wait=nan"), 400, "invalid_wait"),
    ]
    for call, status, code in cases:
        answer = await call
        assert answer.status_code == status, answer.text
        assert answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == code, answer.text
    made = await live.http.post("/jobs", json={"spec": "echo", "args": {"n": 1}, "id": "a"})
    assert (made.status_code, made.json()["created"]) == (201, True)
    again = await live.http.post("/jobs", json={"spec": "echo", "args": {"n": 1}, "id": "a"})
    assert (again.status_code, again.json()["created"]) == (200, False)
    clash = await live.http.post("/jobs", json={"spec": "echo", "args": {"n": 2}, "id": "a"})
    assert (clash.status_code, clash.json()["error"]["code"]) == (409, "id_conflict")
    waiting = await live.http.get("/jobs/a/result")
    assert (waiting.status_code, waiting.json()["state"]) == (202, "available")
    batch = await live.http.post("/jobs/batch", json={"jobs": [
        {"spec": "echo", "args": {"n": 3}}, {"spec": "echo", "args": {"n": "x"}}]})
    assert [r["status"] for r in batch.json()["results"]] == [201, 422]
    # Other methods on these paths still reach the router: its JSON 405 and 404.
    assert (await live.http.put("/jobs", json={})).status_code == 405
    assert (await live.http.get("/jobs/batch")).json()["error"]["code"] == "not_found"


async def test_the_gate_still_stands_before_the_hot_routes(live: Live):
    admin, worker = await make_tokens(live, ("admin", None), ("worker", None))  # auth on
    for method, path in [("POST", "/jobs"), ("POST", "/jobs/batch"), ("GET", "/jobs/a/result")]:
        answer = await live.http.request(method, path, json={"spec": "echo"})
        assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")
        assert answer.json()["error"]["code"] == "unauthorized"
        answer = await live.http.request(method, path, json={"spec": "echo"},
                                         headers=bearer(worker))
        assert (answer.status_code, answer.json()["error"]["code"]) == (403, "forbidden")
    answer = await live.http.get("/jobs/a/result", headers=bearer(admin))
    assert (answer.status_code, answer.json()["error"]["code"]) == (404, "not_found")


async def test_a_bug_behind_a_hot_route_is_a_json_500_logged_once(
        live: Live, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch):
    await live.push(write_spec(tmp_path, "echo"))

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(live.coordinator, "enqueue", broken)
    caplog.set_level(logging.INFO)
    answer = await live.http.post("/jobs", json={"spec": "echo"})
    assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal"
    assert "secret" not in answer.text
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert answer.json()["error"]["id"] in record.getMessage()
    monkeypatch.undo()
    assert (await live.http.post("/jobs", json={"spec": "echo"})).status_code == 201
