"""The producer's workflow builders (``rota.step``, ``chain``, ``group``, ``batch``): the
JSON they make is what the server's own reader takes, node for node; the result a
finished workflow passes on, rebuilt from its tree; the error of a failed one; and the
tree ``rota workflows show`` draws."""

from __future__ import annotations

import pytest

from rota import WorkflowError, batch, chain, group, step
from rota.cli.workflows import tree_lines
from rota.client.flows import job_ids, result_of
from rota.core import workflow_defs as defs


def accept_all(path, request):
    return None


def test_builders_nest_and_make_the_definition_the_server_reads():
    flow = chain(
        step("resize_image", url="https://example.com/a.png", width=64),
        group(step("echo", message="a"), {"spec": "echo", "args": {"message": "b"}}),
        batch(step("send_email", {"from": "ops"}, to="ada@example.com").set(queue="urgent",
                                                                            priority=None),
              on_complete=step("echo", message="sent"), on_failure=step("echo", message="no")),
        name="thumbnails", id="thumbs-1")
    sent = flow.to_json()
    assert sent["type"] == "chain" and sent["id"] == "thumbs-1" and sent["name"] == "thumbnails"
    # args as a dict and as keywords merge; an option left None is not sent
    assert sent["steps"][2]["jobs"][0] == {"spec": "send_email", "queue": "urgent",
                                           "args": {"from": "ops", "to": "ada@example.com"}}
    nodes = defs.plan(defs.definition(sent, accept_all))
    assert [(n.kind, n.role, n.path) for n in nodes] == [
        ("chain", None, ""), ("job", None, "steps[0]"), ("group", None, "steps[1]"),
        ("job", None, "steps[1].jobs[0]"), ("job", None, "steps[1].jobs[1]"),
        ("batch", None, "steps[2]"), ("job", None, "steps[2].jobs[0]"),
        ("job", "on_failure", "steps[2].callbacks.on_failure"),
        ("job", "on_complete", "steps[2].callbacks.on_complete")]


def test_a_batch_without_callbacks_or_a_step_of_another_type_is_refused_at_once():
    with pytest.raises(TypeError, match="at least one of on_success"):
        batch(step("echo", message="a"))
    with pytest.raises(TypeError, match="chain step 1 must be a step"):
        chain(step("echo", message="a"), "echo").to_json()
    # What a newcomer writes by mistake gets a hint, not a bare TypeError.
    with pytest.raises(TypeError, match=r"pass the steps one by one: group\(\*steps\)"):
        group([step("echo"), step("echo")]).to_json()
    with pytest.raises(TypeError, match="args go as keywords"):
        step("echo", "message=x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a callback is not a nested workflow"):
        batch(step("echo"), on_complete=group(step("echo"))).to_json()  # type: ignore[arg-type]


def node(n, kind, state="completed", children=(), position=0, **extra):
    return {"node": n, "kind": kind, "state": state, "position": position,
            "children": list(children), **extra}


TREE = node(0, "chain", children=[
    node(1, "job", job_id="j1", spec="resize_image"),
    node(2, "batch", position=1, children=[
        node(3, "job", job_id="j3", spec="echo"),
        node(4, "job", position=1, job_id="j4", spec="echo"),
        node(5, "job", "skipped", position=2, role="on_failure", job_id="j5", spec="echo")])])


def test_a_finished_workflow_passes_on_its_last_steps_result():
    results = {"j1": {"width": 64}, "j3": "a", "j4": "b", "j5": None}
    assert job_ids(TREE) == ["j1", "j3", "j4", "j5"]
    assert result_of(TREE, results) == {"0": "a", "1": "b"}  # the batch's, callbacks aside
    assert result_of(TREE["children"][0], results) == {"width": 64}


def test_the_cli_draws_the_tree_with_states_and_job_ids():
    assert tree_lines(TREE) == [
        "chain  completed",
        "├── resize_image  completed  job j1",
        "└── batch  completed",
        "    ├── echo  completed  job j3",
        "    ├── echo  completed  job j4",
        "    └── on_failure: echo  skipped  job j5"]


def test_a_failed_workflow_names_its_first_failed_job():
    error = {"failed_job_ids": ["j3", "j4"], "errors": [
        {"job_id": "j3", "code": "ValueError", "message": "no such image", "attempt": 3},
        {"job_id": "j4", "code": "ValueError", "message": "no such image", "attempt": 3}]}
    failure = WorkflowError("thumbs-1", "failed", error)
    assert failure.code == "workflow_failed" and len(failure.errors) == 2
    assert str(failure) == ("workflow thumbs-1 failed: job j3: ValueError: no such image"
                            " (and 1 more)")
    assert str(WorkflowError("thumbs-1", "cancelled", None)) == "workflow thumbs-1 cancelled"
