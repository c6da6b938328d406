"""OJS cron jobs and workflows over HTTP on one server (rota/server/ojs_flows.py): a cron
registration is a Rota schedule whose ticks make jobs of an unversioned type, listed and
deleted in OJS's shape; a chain, group or batch is a Rota workflow, shown with both of
OJS's counts, cancelled once (409 after), and the jobs of a batch entered together are
fetched in the order written (note B: the suites' NACK of the second fetched job)."""

from __future__ import annotations

import re
from typing import Any

from conftest import Live
from helpers import wait_until

UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
OJS_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3})?Z$")


def ojs_error(answer: Any, status: int, code: str) -> dict[str, Any]:
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"].startswith("application/openjobspec+json")
    error = answer.json()["error"]
    assert error["code"] == code and error["message"], error
    return error


async def test_a_cron_job_is_registered_fires_an_unversioned_type_and_is_deleted(live: Live):
    body = {"name": "tick-tock", "expression": "* * * * * *",  # (every second)
            "job_template": {"type": "flows.test.tick", "args": [{"n": 1}],
                             "options": {"queue": "cron-flows",
                                         "retry": {"max_attempts": 2}}}}
    answer = await live.http.post("/ojs/v1/cron", json=body)
    assert answer.status_code == 201, answer.text
    cron = answer.json()["cron"]
    assert {k: cron[k] for k in ("name", "expression", "timezone", "overlap_policy",
                                 "enabled")} == {"name": "tick-tock",
                                                 "expression": "* * * * * *",
                                                 "timezone": "UTC", "overlap_policy": "skip",
                                                 "enabled": True}
    assert OJS_TIME.match(cron["next_run_at"]) and OJS_TIME.match(cron["created_at"])
    assert cron["job_template"] == {"type": "flows.test.tick", "args": [{"n": 1}],
                                    "options": {"queue": "cron-flows",
                                                "retry": {"max_attempts": 2}}}

    async def fired() -> list[dict[str, Any]]:  # (GET /jobs?queue= refuses it until then)
        jobs = (await live.http.get("/jobs")).json()["jobs"]
        return [job for job in jobs if job["queue"] == "cron-flows"]

    made = (await wait_until(fired, what="the cron job's first tick"))[0]
    assert (made["spec"], made["args"]) == ("flows.test.tick", {"n": 1})  # no spec: unversioned
    shown = (await live.http.get(f"/ojs/v1/jobs/{made['id']}")).json()["job"]
    assert (shown["type"], shown["args"], shown["max_attempts"]) == (
        "flows.test.tick", [{"n": 1}], 2)

    again = await live.http.post("/ojs/v1/cron", json={**body, "enabled": False})
    assert again.status_code == 200, again.text  # the same name: replaced (ojs-cron §8.1)
    assert (again.json()["cron"]["enabled"], again.json()["cron"]["next_run_at"]) == (False, None)
    resumed = await live.http.patch("/ojs/v1/cron/tick-tock", json={"enabled": True})
    assert resumed.json()["cron"]["enabled"] is True and resumed.json()["cron"]["next_run_at"]
    shown = (await live.http.get("/ojs/v1/cron/tick-tock")).json()["cron"]
    assert (shown["enabled"], shown["run_count"] >= 1) == (True, True)
    ojs_error(await live.http.patch("/ojs/v1/cron/tick-tock", json={"enabled": "no"}),
              400, "invalid_request")
    listed = (await live.http.get("/ojs/v1/cron")).json()
    assert [c["name"] for c in listed["crons"]] == ["tick-tock"] and listed["count"] == 1
    deleted = await live.http.delete("/ojs/v1/cron/tick-tock")
    assert deleted.status_code == 200 and deleted.json()["cron"]["name"] == "tick-tock"
    assert (await live.http.get("/ojs/v1/cron")).json()["crons"] == []
    gone = ojs_error(await live.http.delete("/ojs/v1/cron/tick-tock"), 404, "not_found")
    assert "tick-tock" in gone["message"]


async def test_a_bad_cron_registration_is_refused_with_nothing_stored(live: Live):
    template = {"type": "flows.test.bad", "args": []}
    for expression in ("not a valid cron", "0 0 0 0 0 0 0", "99 25 32 13 8"):
        answer = await live.http.post("/ojs/v1/cron", json={
            "name": "bad", "expression": expression, "job_template": template})
        ojs_error(answer, 400, "invalid_cron_expression")
    ojs_error(await live.http.post("/ojs/v1/cron", json={
        "name": "bad", "expression": "@daily", "timezone": "Mars/Olympus",
        "job_template": template}), 400, "invalid_request")
    ojs_error(await live.http.post("/ojs/v1/cron", json={
        "name": "bad", "expression": "@daily",
        "job_template": {**template, "options": {"delay_until": "+PT5S"}}}),
        400, "invalid_request")
    ojs_error(await live.http.post("/ojs/v1/cron", content=b"{ nope"), 400, "invalid_payload")
    assert (await live.http.get("/ojs/v1/cron")).json()["crons"] == []
    # Rota's own route keeps ojs to /ojs/v1/cron
    for extra in ({"ojs": {"tags": ["a"]}}, {"args": {"_ojs_args": []}}):
        refused = await live.http.put("/schedules/x", json={"spec": "s", "cron": "@daily",
                                                             **extra})
        assert refused.status_code == 400, refused.text
        assert "/ojs/v1/cron only" in refused.json()["error"]["message"]


async def test_a_chain_is_shown_with_both_counts_and_cancelled_once(live: Live):
    steps = [{"type": f"flows.test.step_{i}", "args": [{"order": i}],
              "options": {"queue": "flows-chain"}} for i in range(3)]
    answer = await live.http.post("/ojs/v1/workflows", json={
        "type": "chain", "name": "three-steps", "steps": steps})
    assert answer.status_code == 201, answer.text
    workflow = answer.json()["workflow"]
    assert UUID7.match(workflow["id"])
    assert {k: workflow[k] for k in ("type", "name", "state", "steps_total", "steps_completed",
                                     "jobs_total", "jobs_completed")} == {
        "type": "chain", "name": "three-steps", "state": "running", "steps_total": 3,
        "steps_completed": 0, "jobs_total": 3, "jobs_completed": 0}
    assert [s["type"] for s in workflow["steps"]] == [f"flows.test.step_{i}" for i in range(3)]
    first = workflow["steps"][0]["job_id"]
    job = (await live.http.get(f"/ojs/v1/jobs/{first}")).json()["job"]
    assert (job["args"], job["workflow_id"], job["state"]) == (
        [{"order": 0}], workflow["id"], "available")

    path = f"/ojs/v1/workflows/{workflow['id']}"
    assert (await live.http.get(path)).json()["workflow"]["state"] == "running"
    cancelled = await live.http.delete(path)
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["workflow"]["state"] == "cancelled"
    assert (await live.http.get(f"/ojs/v1/jobs/{first}")).json()["job"]["state"] == "cancelled"
    error = ojs_error(await live.http.delete(path), 409, "conflict")
    assert error["details"] == {"current_state": "cancelled"}
    ojs_error(await live.http.get("/ojs/v1/workflows/019539a4-b68c-7def-8000-1a2b3c4d5e6f"),
              404, "not_found")


async def test_a_bad_workflow_is_refused_naming_its_place(live: Live):
    dag = {"type": "chain", "steps": [{"type": "a.b", "args": []},
                                      {"type": "c.d", "args": [], "depends_on": ["x"]}]}
    ojs_error(await live.http.post("/ojs/v1/workflows", json=dag), 422, "unsupported")
    bad = await live.http.post("/ojs/v1/workflows", json={
        "type": "group", "jobs": [{"type": "a.b", "args": []}, {"type": "Bad.Type", "args": []}]})
    assert "jobs[1]" in ojs_error(bad, 400, "invalid_request")["message"]
    empty = await live.http.post("/ojs/v1/workflows", json={"type": "group", "jobs": []})
    ojs_error(empty, 400, "invalid_request")
    ojs_error(await live.http.post("/ojs/v1/workflows", content=b"[1,"), 400, "invalid_payload")
    # Rota's own route keeps OJS's parts to /ojs/v1/workflows
    for step in ({"spec": "a.b", "ojs": {"tags": ["t"]}},
                 {"spec": "a.b", "args": {"_ojs_args": []}}):
        refused = await live.http.post("/workflows", json={"type": "group", "jobs": [step]})
        assert refused.status_code == 422 and "/ojs/v1/workflows only" in refused.text


async def test_a_batch_counts_its_jobs_not_its_callbacks_and_they_are_fetched_in_order(
        live: Live):
    answer = await live.http.post("/ojs/v1/workflows", json={
        "type": "batch", "name": "in-order",
        "jobs": [{"type": "flows.test.ok", "args": [{"task": "a"}],
                  "options": {"queue": "flows-batch"}},
                 {"type": "flows.test.fail", "args": [{"task": "b"}],
                  "options": {"queue": "flows-batch", "retry": {"max_attempts": 1}}}],
        "callbacks": {"on_complete": {"type": "flows.test.done", "args": [],
                                      "options": {"queue": "flows-batch-cb"}}}})
    assert answer.status_code == 201, answer.text
    workflow = answer.json()["workflow"]
    assert (workflow["jobs_total"], workflow["steps_total"]) == (2, 2)
    assert workflow["callbacks"]["on_complete"]["type"] == "flows.test.done"
    # Fetched one at a time, the jobs come in the order written: the suites NACK the
    # second fetched expecting it to be the one with max_attempts 1 (L3-BAT-003/004/005,
    # GRP-003).
    fetched = []
    for n in range(2):
        answer = await live.http.post("/ojs/v1/workers/fetch", json={
            "queues": ["flows-batch"], "worker_id": f"flows-{n}"})
        assert answer.status_code == 200, answer.text
        fetched += answer.json()["jobs"]
    assert [(job["type"], job["max_attempts"]) for job in fetched] == [
        ("flows.test.ok", 3), ("flows.test.fail", 1)]
