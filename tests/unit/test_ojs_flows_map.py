"""OJS cron registrations and workflows as Rota's definitions, and Rota's views as OJS's
(rota/core/ojs_flows_map.py): pure, no server."""

from __future__ import annotations

from typing import Any

import pytest

from rota.core.ojs_flows_map import (cron_definition, cron_view, workflow_definition,
                                     workflow_view)
from rota.core.ojs_map import OjsRefusal

NOW = 1_800_000_000.0


def refusal(call: Any, *args: Any) -> OjsRefusal:
    with pytest.raises(OjsRefusal) as caught:
        call(*args)
    return caught.value


def test_a_cron_registration_becomes_a_schedule_in_either_form():
    suites = {"name": "nightly", "expression": "0 2 * * *", "timezone": "Asia/Tokyo",
              "overlap_policy": "allow", "enabled": False,
              "job_template": {"type": "report.build", "args": ["a", 1],
                               "options": {"queue": "reports", "priority": 5,
                                           "retry": {"max_attempts": 4}, "tags": ["t"]}}}
    definition = cron_definition(suites, NOW)
    assert {k: definition[k] for k in ("name", "spec", "cron", "args", "paused", "timezone",
                                       "overlap", "queue", "priority", "max_attempts")} == {
        "name": "nightly", "spec": "report.build", "cron": "0 2 * * *",
        "args": {"_ojs_args": ["a", 1]}, "paused": True, "timezone": "Asia/Tokyo",
        "overlap": "allow", "queue": "reports", "priority": 5, "max_attempts": 4}
    assert definition["ojs"]["tags"] == ["t"]
    # ojs-cron.md's own form: cron, and the template's fields at the top level
    flat = cron_definition({"name": "n", "cron": "@hourly", "type": "a.b"}, NOW)
    assert (flat["cron"], flat["spec"], flat["args"], flat["paused"]) == (
        "@hourly", "a.b", {"_ojs_args": []}, False)


@pytest.mark.parametrize(("body", "code", "said"), [
    ([], "invalid_request", "JSON object"),
    ({"name": "n", "job_template": {"type": "a.b", "args": []}}, "invalid_cron_expression",
     "expression is required"),
    ({"name": "n", "expression": "@daily"}, "invalid_request", "job_template is required"),
    ({"name": "n", "expression": "@daily", "job_template": {"type": "A.B", "args": []}},
     "invalid_request", "job_template: "),
    ({"name": "n", "expression": "@daily",
      "job_template": {"type": "a.b", "args": [], "options": {"delay_until": "+PT5S"}}},
     "invalid_request", "runs at its tick"),
    ({"name": "n", "expression": "@daily", "job_template": {
        "type": "a.b", "args": [], "options": {"unique": {"keys": ["type"]}}}},
     "invalid_request", "overlap_policy"),
])
def test_a_bad_cron_registration_is_refused(body: Any, code: str, said: str):
    refused = refusal(cron_definition, body, NOW)
    assert (refused.status, refused.code) == (400, code) and said in refused.message


def test_a_schedule_view_is_shown_as_an_ojs_cron_job():
    schedule = {"name": "n", "spec": "a.b", "cron": "*/5 * * * *", "timezone": "UTC",
                "overlap": "skip", "paused": False, "args": {"x": 1}, "queue": "q",
                "priority": None, "max_attempts": 2, "ojs": {"tags": ["t"]},
                "next_fires": ["2027-01-15T08:05:00.000Z", "2027-01-15T08:10:00.000Z"],
                "last_tick": None, "run_count": 0, "created_at": "2027-01-15T08:01:02.345Z",
                "state": "active", "waiting_reason": None}
    view = cron_view(schedule)
    assert view == {"name": "n", "expression": "*/5 * * * *", "timezone": "UTC",
                    "overlap_policy": "skip", "enabled": True,
                    "next_run_at": "2027-01-15T08:05:00Z", "last_run_at": None,
                    "run_count": 0, "created_at": "2027-01-15T08:01:02.345Z",
                    "job_template": {"type": "a.b", "args": [{"x": 1}],
                                     "options": {"queue": "q", "tags": ["t"],
                                                 "retry": {"max_attempts": 2}}}}
    assert cron_view({**schedule, "paused": True})["next_run_at"] is None


def test_a_workflow_becomes_rota_s_definition_each_job_read_as_a_push():
    body = {"type": "chain", "name": "etl", "steps": [
        {"type": "data.extract", "args": [{"source": "s"}], "options": {"queue": "etl"}},
        {"type": "group", "jobs": [{"type": "t.csv", "args": []},
                                   {"type": "batch", "jobs": [{"type": "t.x", "args": [1]}],
                                    "callbacks": {"on_complete": {"type": "t.done",
                                                                  "args": []}}}]},
        {"type": "data.load", "args": [{"to": "w"}], "options": {"retry": {"max_attempts": 1}}}]}
    definition = workflow_definition(body, NOW)
    first, group, last = definition["steps"]
    assert (definition["type"], definition["name"]) == ("chain", "etl")
    assert (first["spec"], first["args"], first["queue"], first["new_queue"]) == (
        "data.extract", {"source": "s"}, "etl", True)
    assert "id" not in first and "run_at" not in first  # (given only: Rota refuses those)
    assert group["type"] == "group" and group["jobs"][0]["args"] == {"_ojs_args": []}
    assert group["jobs"][1]["callbacks"]["on_complete"]["spec"] == "t.done"
    assert last["max_attempts"] == 1
    # a job whose type is "chain" but that has no steps is a job
    assert workflow_definition({"type": "group", "jobs": [{"type": "chain", "args": []}]},
                               NOW)["jobs"][0]["spec"] == "chain"


def test_a_dag_or_a_bad_job_is_refused_naming_its_place():
    dag = refusal(workflow_definition, {"type": "chain", "steps": [
        {"type": "a.b", "args": [], "depends_on": ["x"]}]}, NOW)
    assert (dag.status, dag.code) == (422, "unsupported")
    bad = refusal(workflow_definition, {"type": "group", "jobs": [
        {"type": "a.b", "args": []}, {"type": "a.b", "args": {}}]}, NOW)
    assert bad.status == 400 and bad.message.startswith("jobs[1]: ")


def node(kind: str, state: str, children: list[Any] = (), role: str | None = None,
         spec: str | None = None, position: int = 0) -> dict[str, Any]:
    shown = {"kind": kind, "state": state, "children": list(children), "position": position}
    if role is not None:
        shown["role"] = role
    if spec is not None:
        shown["spec"], shown["job_id"] = spec, f"id-{spec}"
    return shown


def test_a_workflow_view_counts_steps_and_jobs_callbacks_aside():
    root = node("batch", "running", [
        node("job", "completed", spec="a"),
        node("chain", "running", [node("job", "completed", spec="b"),
                                  node("job", "active", spec="c")], position=1),
        node("job", "pending", role="on_complete", spec="cb", position=2)])
    view = workflow_view({"id": "w", "type": "batch", "name": None, "state": "running",
                          "created_at": "2027-01-15T08:00:00.000Z", "started_at": None,
                          "finished_at": None, "job_count": 4, "completed_count": 2,
                          "failed_count": 0, "error": None, "root": root})
    assert (view["steps_total"], view["steps_completed"]) == (2, 1)
    assert (view["jobs_total"], view["jobs_completed"]) == (3, 2)
    assert "name" not in view and view["created_at"] == "2027-01-15T08:00:00Z"
    assert [(j["index"], j["type"]) for j in view["jobs"]] == [(0, "a"), (1, "chain")]
    assert view["callbacks"] == {"on_complete": {"type": "cb", "state": "pending",
                                                 "job_id": "id-cb"}}
