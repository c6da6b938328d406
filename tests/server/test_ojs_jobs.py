"""The OJS binding's producer routes on one server (docs/ojs.md): PUSH, batch, INFO, CANCEL,
activate and the test reset, their error shapes (400, 404, 409, 422), the gate's 401 in
OJS's shape, unversioned types (run by a /work worker that declares them, refused under
--ojs-registered-types-only, taken in again at a restart), and Rota's own POST /jobs
refusing what only OJS sets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Live, start_server, stop_server, write_spec
from helpers import RawWorker, bearer, completed, make_tokens

from rota.base.ojs import OJS_MEDIA

JOBS = "/ojs/v1/jobs"
ID = "019461a8-1a2b-7c3d-8e4f-5a6b7c8d9e0f"
UNSAFE = {"unsafe_test_endpoints": True}


def refused(response: Any, status: int, code: str, kind: str) -> dict[str, Any]:
    """The OJS error body of ``response``, checked: its status, code, type and headers."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == OJS_MEDIA
    assert response.headers["ojs-version"] == "1.0"
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (code, kind), error
    assert error["retryable"] is False and error["message"]
    assert error["request_id"] == response.headers["x-request-id"]
    return error


@pytest.mark.both_backends
@pytest.mark.parametrize("live", [UNSAFE], indirect=True)
async def test_push_info_cancel_activate_batch_and_reset(
        live: Live, caplog: pytest.LogCaptureFixture) -> None:
    assert any(r.levelname == "WARNING" and "--unsafe-test-endpoints" in r.getMessage()
               for r in caplog.get_records("setup"))
    pushed = await live.http.post(JOBS, headers={"X-Request-Id": "trace-1"}, json={
        "type": "report.generate", "args": [42, "q"], "id": ID, "meta": {"trace_id": "t"},
        "x_custom": {"n": 1}, "options": {"queue": "reports", "priority": 10,
                                          "timeout_ms": 60000, "retry": {"max_attempts": 5}}})
    assert pushed.status_code == 201, pushed.text
    assert pushed.headers["x-request-id"] == "trace-1"
    assert pushed.headers["content-type"] == OJS_MEDIA
    job = pushed.json()["job"]
    assert (job["id"], job["type"], job["queue"], job["args"], job["state"], job["priority"],
            job["attempt"], job["max_attempts"], job["x_custom"], job["meta"]) == (
        ID, "report.generate", "reports", [42, "q"], "available", 10, 0, 5, {"n": 1},
        {"trace_id": "t"})
    assert "started_at" not in job and "completed_at" not in job and None not in job.values()
    info = await live.http.get(f"{JOBS}/{ID}")
    assert info.status_code == 200 and info.json()["job"] == job
    # an id given twice is 409, even for the same job
    refused(await live.http.post(JOBS, json={"type": "report.generate", "args": [42, "q"],
                                             "id": ID}), 409, "duplicate", "conflict")
    refused(await live.http.post(JOBS, content=b"{ invalid json }"), 400, "invalid_payload",
            "validation_error")
    refused(await live.http.post(JOBS, json={"args": []}), 400, "invalid_request",
            "validation_error")
    refused(await live.http.post(JOBS, json={"type": "a", "args": []},
                                 headers={"OJS-Version": "2.0"}), 422, "unsupported",
            "validation_error")
    error = refused(await live.http.post(JOBS, json={
        "type": "a", "args": [], "options": {"retry": {"max_attempts": -1}}}),
        422, "invalid_retry_policy", "validation_error")
    assert "max_attempts" in error["message"]
    missing = refused(await live.http.get(f"{JOBS}/nope"), 404, "not_found", "not_found")
    assert missing["hint"] and missing["docs_url"].endswith("ojs.md#errors")
    # cancel: at once while it waits, 409 once it ended
    cancelled = await live.http.delete(f"{JOBS}/{ID}")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["job"]["state"] == "cancelled"
    assert "cancelled_at" in cancelled.json()["job"]
    assert "completed_at" not in cancelled.json()["job"]
    refused(await live.http.delete(f"{JOBS}/{ID}"), 409, "conflict", "conflict")
    # activate: a scheduled job runs now
    later = (await live.http.post(JOBS, json={
        "type": "a", "args": [], "options": {"delay_until": "+PT1H"}})).json()["job"]
    assert later["state"] == "scheduled" and "scheduled_at" in later
    now = await live.http.post(f"{JOBS}/{later['id']}/activate")
    assert now.status_code == 200 and now.json()["job"]["state"] == "available", now.text
    refused(await live.http.post(f"{JOBS}/{later['id']}/activate"), 409, "conflict", "conflict")
    # a batch is all or nothing
    before = len((await live.http.get("/jobs")).json()["jobs"])
    bad = refused(await live.http.post(f"{JOBS}/batch", json={"jobs": [
        {"type": "a", "args": [1]}, {"args": [2]}]}), 400, "invalid_request",
        "validation_error")
    assert bad["details"] == {"index": 1}
    assert len((await live.http.get("/jobs")).json()["jobs"]) == before
    batch = await live.http.post(f"{JOBS}/batch", json={"jobs": [
        {"type": "a", "args": [1]}, {"type": "b", "args": [{"k": 2}]}]})
    assert batch.status_code == 201, batch.text
    assert [j["args"] for j in batch.json()["jobs"]] == [[1], [{"k": 2}]]
    # the test switch empties the store, and forgets pull workers
    fetch = await live.http.post("/ojs/v1/workers/fetch", json={"queues": ["none"],
                                                                "worker_id": "p1"})
    assert fetch.status_code == 200 and fetch.json()["jobs"] == [], fetch.text
    assert "ojs:p1" in (await live.http.get("/workers")).text
    reset = await live.http.post("/ojs/v1/admin/reset")
    assert reset.status_code == 200 and reset.json() == {"reset": True}
    refused(await live.http.get(f"{JOBS}/{later['id']}"), 404, "not_found", "not_found")
    assert (await live.http.get("/jobs")).json()["jobs"] == []
    assert "ojs:p1" not in (await live.http.get("/workers")).text


async def test_rota_s_own_api_takes_far_moments_and_refuses_what_only_ojs_sets(
        live: Live, tmp_path: Path) -> None:
    await live.push(write_spec(tmp_path / "specs", "a"))
    far = await live.http.post("/jobs", json={"spec": "a", "run_at": "2099-12-31T23:59:59Z",
                                              "expires_at": "2100-01-01T00:00:00Z"})
    assert far.status_code == 201 and far.json()["job"]["state"] == "scheduled", far.text
    assert far.json()["job"]["expires_at"] == "2100-01-01T00:00:00.000Z"
    too_far = await live.http.post("/jobs", json={"spec": "a", "run_at": "2199-01-01T00:00:00Z"})
    assert too_far.status_code == 422 and "100 years" in too_far.json()["error"]["message"]
    both = await live.http.post("/jobs", json={"spec": "a", "ttl": 5,
                                               "expires_at": "2100-01-01T00:00:00Z"})
    assert both.status_code == 422 and both.json()["error"]["code"] == "invalid_request"
    own = await live.http.post("/jobs", json={"spec": "a", "ojs": {"meta": {}}})
    assert own.status_code == 400 and own.json()["error"]["code"] == "invalid_request"
    own = await live.http.post("/jobs", json={"spec": "a", "args": {"_ojs_args": [1]}})
    assert own.status_code == 400 and own.json()["error"]["code"] == "reserved_arg"


async def test_reset_needs_the_switch_and_the_gate_answers_in_ojs_shape(live: Live) -> None:
    refused(await live.http.post("/ojs/v1/admin/reset"), 404, "not_found", "not_found")
    producer, worker = await make_tokens(live, ("producer", None), ("worker", None))
    refused(await live.http.post(JOBS, json={"type": "a", "args": []}), 401,
            "unauthenticated", "auth_error")
    refused(await live.http.post(JOBS, json={"type": "a", "args": []}, headers=bearer(worker)),
            403, "permission_denied", "auth_error")
    # a producer's ids are its own (kept as <token id>:<id>), shown as it gave them
    mine = await live.http.post(JOBS, json={"type": "a", "args": [], "id": ID},
                                headers=bearer(producer))
    assert mine.status_code == 201 and mine.json()["job"]["id"] == ID, mine.text
    again = await live.http.get(f"{JOBS}/{ID}", headers=bearer(producer))
    assert again.status_code == 200 and again.json()["job"]["id"] == ID
    for public in ("/ojs/manifest", "/ojs/v1/health"):
        response = await live.http.get(public)
        assert response.status_code == 200, response.text
    assert (await live.http.get("/ojs/manifest")).json()["specversion"] == "1.0"


@pytest.mark.parametrize("live", [{"ojs_registered_types_only": True}], indirect=True)
async def test_registered_types_only_refuses_unversioned_types(live: Live,
                                                               tmp_path: Path) -> None:
    refused(await live.http.post(JOBS, json={"type": "email.send", "args": []}), 400,
            "invalid_job_type", "validation_error")
    assert (await live.http.get("/jobs")).json()["jobs"] == []
    await live.push(write_spec(tmp_path / "specs", "email.send"))
    pushed = await live.http.post(JOBS, json={"type": "email.send", "args": [{"to": "x"}]})
    assert pushed.status_code == 201, pushed.text


async def test_an_unversioned_type_runs_on_a_worker_that_declares_it(tmp_path: Path) -> None:
    live = await start_server(tmp_path)
    try:
        job = (await live.http.post(JOBS, json={"type": "email.send", "args": ["x"]})
               ).json()["job"]
    finally:
        await stop_server(live)
    live = await start_server(tmp_path)  # a restart takes the type in again, unversioned
    try:
        worker = await RawWorker.open(live.ws, "w1")
        welcome = await worker.register([], declared={"email.send": "unversioned"})
        assert welcome["specs"]["accepted"] == ["email.send"]
        [copy] = (await worker.expect("assign"))["jobs"]
        assert (copy["id"], copy["checksum"], copy["args"]) == (
            job["id"], "unversioned", {"_ojs_args": ["x"]})
        await worker.beat(results=[completed(copy, {"sent": True})])
        done = await live.wait_state(job["id"], "completed")
        view = (await live.http.get(f"{JOBS}/{job['id']}")).json()["job"]
        assert (view["state"], view["result"], view["attempt"]) == ("completed", {"sent": True}, 1)
        assert view["completed_at"] and view["started_at"] and done["checksum"] is None
        await worker.ws.close()
    finally:
        await stop_server(live)


async def test_a_bug_under_ojs_is_a_json_500_with_ojs_headers(
        live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    from rota.server import ojs_api

    def broken(row: dict[str, Any], now: float) -> dict[str, Any]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(ojs_api, "job_view", broken)
    answer = await live.http.post(JOBS, json={"type": "a", "args": []})
    assert answer.status_code == 500 and answer.headers["ojs-version"] == "1.0"
    assert answer.json()["error"]["code"] == "internal"



async def test_one_job_two_views_in_the_api_metrics_and_the_dashboard(live: Live, tmp_path):
    """A job pushed through OJS is a Rota job like any other (GET /jobs/{id}, /metrics,
    its dashboard page), and a Rota job is an OJS job (GET /ojs/v1/jobs/{id})."""
    pushed = await live.http.post("/ojs/v1/jobs", json={
        "type": "views.both", "args": [{"to": "ada"}], "options": {"queue": "views"}})
    assert pushed.status_code == 201, pushed.text
    job_id = pushed.json()["job"]["id"]
    rota = (await live.http.get(f"/jobs/{job_id}")).json()
    assert (rota["spec"], rota["queue"], rota["args"], rota["state"]) == (
        "views.both", "views", {"to": "ada"}, "available")
    metrics = (await live.http.get("/metrics")).text
    assert 'rota_queue_jobs{queue="views",state="available"} 1.0' in metrics, metrics[:2000]
    page = await live.http.get(f"/ui/jobs/{job_id}")
    assert page.status_code == 200 and job_id in page.text and "views.both" in page.text
    await live.push(write_spec(tmp_path / "specs", "echo"))
    mine = await live.enqueue("echo", {"n": 1})
    seen = (await live.http.get(f"/ojs/v1/jobs/{mine['id']}")).json()["job"]
    assert (seen["type"], seen["args"], seen["state"]) == ("echo", [{"n": 1}], "available")


async def test_the_python_sdk_runs_an_unversioned_type_it_says_it_runs(live: Live, tmp_path):
    """``@worker.handler(type, unversioned=True)``: no spec file, checksum "unversioned"
    (docs/ojs.md); an OJS producer's job runs on Rota's own SDK worker."""
    import asyncio

    from rota import JobContext, Worker
    pushed = await live.http.post(JOBS, json={"type": "email.send", "args": [{"to": "ada"}]})
    assert pushed.status_code == 201, pushed.text
    worker = Worker(url=live.ws, specs_dir=tmp_path / "no-specs", heartbeat_interval=0.1)

    @worker.handler("email.send", unversioned=True)
    async def send(ctx: JobContext) -> dict[str, Any]:
        return {"sent": ctx.args["to"]}

    task = asyncio.create_task(worker.run())
    try:
        done = await live.wait_state(pushed.json()["job"]["id"], "completed", timeout=10)
        assert done["result"] == {"sent": "ada"}
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
