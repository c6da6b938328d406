"""Workflows' pure core (rota/core/workflow_defs.py, workflows.py, workflow_view.py) on fake
rows: each primitive's state machine, failure and cancel propagation, the batch firing
matrix, nesting, parent_results, retry, and what validation refuses."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import msgspec
import pytest

from rota.base.errors import Conflict, Invalid, DomainError
from rota.core import workflow_defs as defs
from rota.core import workflows as wf
from rota.core.workflow_view import view

LIVE_JOB = ("available", "active")


class FakeRows:
    """A store's rows as a transaction reads them: copies, so a change the core makes
    counts only if its Decision carries it; ``reads`` counts the rows read."""

    def __init__(self, rows: list[wf.NodeRow]) -> None:
        self.rows = rows
        self.reads = 0

    def _copy(self, rows: list[wf.NodeRow]) -> list[wf.NodeRow]:
        self.reads += len(rows)
        return [dataclasses.replace(row) for row in rows]

    def row(self, node: int) -> wf.NodeRow:
        return self._copy([self.rows[node]])[0]

    def span(self, first: int, last: int) -> list[wf.NodeRow]:
        return self._copy(self.rows[first:last + 1])

    def children(self, node: int) -> list[wf.NodeRow]:
        return self._copy(wf.ListRows(self.rows).children(node))


class World:
    """One workflow, its node rows and its jobs' states, as the store would keep them."""

    def __init__(self, definition: dict[str, Any], limit: int = 1 << 20) -> None:
        self.nodes = defs.plan(defs.definition(definition, lambda path, request: None))
        self.limit = limit
        self.rows = wf.new_rows(self.nodes, {n.node: f"j{n.node}" for n in self.nodes
                                             if n.kind == "job"})
        self.jobs = {row.job_id: "pending" for row in self.rows if row.job_id}
        self.inputs: dict[str, Any] = {}
        self.errors: dict[str, Any] = {}
        self.released: list[str] = []  # every release, in order (a job twice: a bug)
        self.head = wf.Head("w1")
        self.reads: list[int] = []
        self.apply(wf.start(self.copy_head(), [dataclasses.replace(r) for r in self.rows],
                            limit=limit, now=1.0))

    def copy_head(self) -> wf.Head:
        return dataclasses.replace(self.head)

    def apply(self, decision: wf.Decision) -> None:
        self.head = decision.head
        for row in decision.rows:
            self.rows[row.node] = dataclasses.replace(row)
        for job in decision.reset:
            assert self.jobs[job] in ("pending", "discarded", "cancelled"), job
            self.jobs[job] = "pending"
        for job, inputs in decision.release:
            assert self.jobs[job] == "pending", (job, self.jobs[job])
            self.jobs[job] = "available"
            self.inputs[job] = json.loads(inputs)
            self.released.append(job)
        for job, error in decision.discard:
            assert self.jobs[job] == "pending"
            self.jobs[job] = "discarded"
            self.errors[job] = json.loads(error)
        for job in decision.cancel:
            if self.jobs[job] == "pending":
                self.jobs[job] = "cancelled"
        for job in decision.live:  # the ordinary cancel path, which then settles as usual
            assert self.jobs[job] in LIVE_JOB
            self.finish(job, "cancelled")

    def job(self, path: str) -> str:
        """The job id of the node written at ``path`` ("steps[1].jobs[0]")."""
        return next(f"j{n.node}" for n in self.nodes if n.path == path)

    def node(self, path: str) -> wf.NodeRow:
        return next(self.rows[n.node] for n in self.nodes if n.path == path)

    def finish(self, job: str, state: str = "completed", result: Any = None) -> None:
        assert self.jobs[job] in LIVE_JOB, (job, self.jobs[job])
        self.jobs[job] = state
        error = None
        if state != "completed":
            error = msgspec.json.encode({"type": "boom" if state == "discarded" else "cancelled",
                                         "message": f"{job} {state}", "attempt": 3})
        rows = FakeRows(self.rows)
        flow = wf.Flow(self.copy_head(), rows, limit=self.limit, now=2.0)
        flow.end(wf.Ending(int(job[1:]), state, None if result is None
                           else msgspec.json.encode(result), error, 3))
        self.apply(flow.done())
        self.reads.append(rows.reads)

    def available(self) -> list[str]:
        return [job for job, state in self.jobs.items() if state == "available"]

    def run(self, fail: frozenset[str] = frozenset()) -> None:
        """Every job that runs ends (those in ``fail`` discarded), until none runs; each
        job's result is {"by": its id}."""
        while ready := self.available():
            for job in ready:
                if job in fail:
                    self.finish(job, "discarded")
                else:
                    self.finish(job, result={"by": job})

    def states(self) -> dict[str, str]:
        return {n.path or "root": self.rows[n.node].state for n in self.nodes}


def job(spec: str = "s", **args: Any) -> dict[str, Any]:
    return {"spec": spec, "args": args}


def chain(*steps: Any) -> dict[str, Any]:
    return {"type": "chain", "steps": list(steps)}


def group(*jobs: Any) -> dict[str, Any]:
    return {"type": "group", "jobs": list(jobs)}


def batch(*jobs: Any, **callbacks: Any) -> dict[str, Any]:
    return {"type": "batch", "jobs": list(jobs), "callbacks": callbacks}


# -- chain -------------------------------------------------------------------------------
def test_a_chain_runs_its_steps_in_turn_each_given_every_earlier_result():
    w = World(chain(job(), job(), job()))
    assert w.available() == ["j1"] and w.inputs["j1"] == {}
    assert w.states() == {"root": "active", "steps[0]": "pending", "steps[1]": "waiting",
                          "steps[2]": "waiting"}
    w.finish("j1", result={"a": 1})
    assert w.available() == ["j2"] and w.inputs["j2"] == {"0": {"a": 1}}
    w.finish("j2", result=[2])
    assert w.inputs["j3"] == {"0": {"a": 1}, "1": [2]}
    w.finish("j3", result="last")
    assert w.head.state == "completed" and w.head.finished_at == 2.0
    assert w.rows[0].result == b'"last"'  # a chain's result is its last step's
    assert (w.head.completed_count, w.head.failed_count) == (3, 0)


def test_a_chain_of_1000_steps_costs_o_1_rows_per_step():
    w = World(chain(*[job() for _ in range(1_000)]))
    for k in range(1_000):
        [step] = w.available()
        assert step == f"j{k + 1}"
        assert w.inputs[step] == {str(i): {"by": f"j{i + 1}"} for i in range(k)}  # §7.2
        w.finish(step, result={"by": step})
    assert max(w.reads) <= 3  # the job's row, its chain's, the next step's
    assert w.head.state == "completed" and json.loads(w.rows[0].result) == {"by": "j1000"}


def test_a_chain_row_from_before_it_kept_its_inputs_reads_its_steps_once():
    w = World(group(chain(job(), job(), job(), job())), limit=1 << 20)
    w.finish("j2", result="a")
    w.finish("j3", result="b")
    w.rows[1].result = None  # as a running chain's row was stored before
    w.finish("j4", result="c")
    assert w.inputs["j5"] == {"0": "a", "1": "b", "2": "c"}
    w.finish("j5", result="d")
    assert w.head.state == "completed" and json.loads(w.rows[0].result) == {"0": "d"}


def test_a_failed_chain_in_a_batch_passes_its_callback_null():
    w = World(batch(chain(job(), job()), on_complete=job()))
    w.finish("j2", result="x")
    w.finish("j3", "discarded")
    assert w.inputs["j4"] == {"0": None}  # (not the inputs the chain had kept)


def test_a_failed_step_fails_its_chain_and_cancels_the_steps_after_it():
    w = World(chain(job(), job(), group(job(), job()), job()))
    w.finish("j1", result=1)
    w.finish("j2", "discarded")
    assert w.head.state == "failed"
    assert w.states() == {"root": "failed", "steps[0]": "completed", "steps[1]": "failed",
                          "steps[2]": "cancelled", "steps[2].jobs[0]": "cancelled",
                          "steps[2].jobs[1]": "cancelled", "steps[3]": "cancelled"}
    assert {j: w.jobs[j] for j in ("j4", "j5", "j6")} == dict.fromkeys(("j4", "j5", "j6"),
                                                                        "cancelled")
    assert json.loads(w.head.error) == {
        "failed_step_index": 1, "failed_job_ids": ["j2"],
        "errors": [{"job_id": "j2", "code": "boom", "message": "j2 discarded", "attempt": 3}]}


def test_a_step_cancelled_on_its_own_is_a_failed_step():
    w = World(chain(job(), job()))
    w.finish("j1", "cancelled")
    assert w.head.state == "failed" and w.jobs["j2"] == "cancelled"
    assert json.loads(w.head.error)["errors"][0]["code"] == "cancelled"


# -- group ------------------------------------------------------------------------------
def test_a_group_runs_all_at_once_and_fails_only_when_all_are_done():
    w = World(group(job(), job(), job()))
    assert w.available() == ["j1", "j2", "j3"]
    assert all(w.inputs[j] == {} for j in ("j1", "j2", "j3"))
    w.finish("j2", "discarded")
    assert w.head.state == "running" and w.rows[0].state == "active"  # the others run on
    w.finish("j1", result="a")
    w.finish("j3", result="c")
    assert w.head.state == "failed" and w.head.failed_count == 1
    error = json.loads(w.head.error)
    assert "failed_step_index" not in error and error["failed_job_ids"] == ["j2"]


def test_a_group_result_holds_each_job_result_by_index():
    w = World(group(job(), job()))
    w.finish("j2", result={"b": 2})
    w.finish("j1", result=None)
    assert w.head.state == "completed"
    assert json.loads(w.rows[0].result) == {"0": None, "1": {"b": 2}}


# -- batch ------------------------------------------------------------------------------
CALLBACKS = ("on_success", "on_failure", "on_complete")


@pytest.mark.parametrize(("given", "job_fails", "fired", "callback_fails", "outcome"), [
    (CALLBACKS, False, {"on_success", "on_complete"}, False, "completed"),
    (CALLBACKS, True, {"on_failure", "on_complete"}, False, "failed"),  # (Rota's, not OJS's)
    (("on_success",), False, {"on_success"}, False, "completed"),
    (("on_success",), True, set(), False, "failed"),  # none fired: the failed job decides
    (("on_failure",), False, set(), False, "completed"),
    (("on_failure",), True, {"on_failure"}, False, "failed"),  # handled, but a job failed
    (("on_complete",), True, {"on_complete"}, False, "failed"),
    (("on_complete",), False, {"on_complete"}, True, "failed"),  # a fired callback failed
    (("on_success", "on_complete"), False, {"on_success", "on_complete"}, True, "failed"),
])
def test_the_batch_firing_matrix(given, job_fails, fired, callback_fails, outcome):
    w = World(batch(job(), job(), **{role: job(role) for role in given}))
    roles = {w.job(f"callbacks.{role}"): role for role in given}
    assert w.available() == ["j1", "j2"]  # callbacks wait for the jobs
    w.finish("j1", result={"n": 1})
    assert not set(w.available()) & set(roles)
    w.finish("j2", "discarded" if job_fails else "completed", result={"n": 2})
    assert {roles[j] for j in w.available()} == fired
    for callback in w.available():
        assert w.inputs[callback] == {"0": {"n": 1}, "1": None if job_fails else {"n": 2}}
        w.finish(callback, "discarded" if callback_fails else "completed", result="cb")
    assert w.head.state == outcome and w.rows[0].state == outcome
    assert {roles[j] for j in roles if w.rows[int(j[1:])].state == "skipped"} == \
        set(given) - fired
    assert all(w.jobs[j] == "cancelled" for j in roles if roles[j] not in fired)
    assert sorted(w.released) == sorted(["j1", "j2", *(j for j in roles if roles[j] in fired)])


def test_a_failed_batch_names_its_failed_jobs_and_callbacks_with_their_roles():
    w = World(batch(job(), job(), on_failure=job(), on_complete=job()))
    w.finish("j1", result=1)
    w.finish("j2", "discarded")
    w.finish("j3", result="handled")  # on_failure ran: the batch has failed all the same
    assert w.head.state == "running"  # (on_complete still runs)
    w.finish("j4", "discarded")
    assert w.head.state == "failed" and w.rows[0].state == "failed"
    assert json.loads(w.head.error) == {"failed_job_ids": ["j2", "j4"], "errors": [
        {"job_id": "j2", "code": "boom", "message": "j2 discarded", "attempt": 3},
        {"job_id": "j4", "code": "boom", "message": "j4 discarded", "attempt": 3,
         "callback": "on_complete"}]}


def test_a_group_of_10000_fires_its_callback_once_at_o_depth_per_ending():
    w = World(batch(*[job() for _ in range(10_000)], on_complete=job("report")))
    callback = w.job("callbacks.on_complete")
    assert len(w.available()) == 10_000
    for n, job_id in enumerate(list(w.available())):
        w.finish(job_id, result=n)
        if n < 9_999:
            assert w.jobs[callback] == "pending"
    assert w.released.count(callback) == 1 and w.jobs[callback] == "available"
    assert max(w.reads[:-1]) <= 3  # the job's row, its parent's, (the root is the parent)
    assert len(w.inputs[callback]) == 10_000 and w.inputs[callback]["9999"] == 9_999
    w.finish(callback, result="done")
    assert w.head.state == "completed" and w.head.completed_count == 10_001


# -- nesting ----------------------------------------------------------------------------
def test_a_chain_of_groups_passes_each_group_result_on():
    w = World(chain(group(job(), job()), group(job(), job()), job()))
    assert w.available() == ["j2", "j3"]
    w.finish("j2", result="a")
    assert w.available() == ["j3"]  # the second group waits for the whole first
    w.finish("j3", result="b")
    assert w.available() == ["j5", "j6"]
    assert w.inputs["j5"] == w.inputs["j6"] == {"0": {"0": "a", "1": "b"}}
    w.run()
    assert w.inputs["j7"] == {"0": {"0": "a", "1": "b"}, "1": {"0": {"by": "j5"},
                                                              "1": {"by": "j6"}}}
    assert w.head.state == "completed"


def test_a_group_of_chains_runs_the_chains_side_by_side():
    w = World(group(chain(job(), job()), chain(job(), job())))
    assert w.available() == ["j2", "j5"]
    w.finish("j5", result="c")
    assert w.available() == ["j2", "j6"] and w.inputs["j6"] == {"0": "c"}
    w.finish("j2", "discarded")  # the first chain fails; the second goes on
    assert w.jobs["j3"] == "cancelled" and w.head.state == "running"
    w.finish("j6", result="d")
    assert w.head.state == "failed" and w.node("jobs[1]").state == "completed"
    assert json.loads(w.node("jobs[1]").result) == "d"


def test_a_batch_inside_a_chain_gets_and_gives_results():
    w = World(chain(job(), batch(job(), job(), on_complete=job()), job()))
    w.finish("j1", result="x")
    assert w.inputs["j3"] == w.inputs["j4"] == {"0": "x"}
    w.finish("j3", result="a")
    w.finish("j4", result="b")
    assert w.inputs["j5"] == {"0": "a", "1": "b"}  # the callback: the batch's job results
    w.finish("j5", result="reported")
    assert w.inputs["j6"] == {"0": "x", "1": {"0": "a", "1": "b"}}
    w.finish("j6", result="y")
    assert w.head.state == "completed"


def test_a_nested_chain_merges_its_steps_results_over_what_it_received():
    w = World(chain(job(), group(chain(job(), job()))))
    w.finish("j1", result="outer")
    assert w.inputs["j4"] == {"0": "outer"}
    w.finish("j4", result="inner")
    assert w.inputs["j5"] == {"0": "inner"}  # key "0" is the inner chain's own step now
    w.run()
    assert w.head.state == "completed"


# -- parent_results too large -----------------------------------------------------------
def test_parent_results_over_the_limit_fail_the_step_with_a_clear_error():
    w = World(chain(job(), group(job(), job()), job()), limit=100)
    w.finish("j1", result="x" * 200)
    assert w.jobs["j3"] == w.jobs["j4"] == "discarded" and w.jobs["j5"] == "cancelled"
    error = w.errors["j3"]
    assert error["type"] == "parent_results_too_large" and not error["retryable"]
    assert error["message"] == ("the results of its parents are 208 bytes as JSON; the limit"
                                " (max_parent_results_bytes) is 100")
    assert w.head.state == "failed" and w.head.failed_count == 2
    assert json.loads(w.head.error)["failed_step_index"] == 1


def test_callbacks_whose_inputs_are_too_large_fail_the_batch():
    w = World(batch(job(), on_success=job(), on_complete=job()), limit=50)
    w.finish("j1", result="y" * 60)
    assert w.jobs["j2"] == w.jobs["j3"] == "discarded" and w.head.state == "failed"


# -- replays, cancel, retry ---------------------------------------------------------------
def test_an_ending_counts_once():
    w = World(group(job(), job()))
    w.finish("j1", result=1)
    before = (list(w.rows), dataclasses.replace(w.head))
    flow = wf.Flow(w.copy_head(), FakeRows(w.rows), limit=w.limit, now=3.0)
    flow.end(wf.Ending(1, "completed", b"1"))  # the same job again (a replay)
    decision = flow.done()
    assert decision.rows == [] and decision.head == before[1]


def test_cancel_stops_everything_and_later_endings_advance_nothing():
    w = World(chain(group(job(), job()), job()))
    w.finish("j2", result=1)
    w.apply(wf.cancel(w.copy_head(), [dataclasses.replace(r) for r in w.rows], now=5.0))
    assert w.head.state == "cancelled" and w.head.finished_at == 5.0
    assert w.jobs == {"j2": "completed", "j3": "cancelled", "j4": "cancelled"}
    assert w.states() == {"root": "cancelled", "steps[0]": "cancelled",
                          "steps[0].jobs[0]": "completed", "steps[0].jobs[1]": "cancelled",
                          "steps[1]": "cancelled"}
    with pytest.raises(Conflict) as refused:
        wf.cancel(w.copy_head(), w.rows, now=6.0)
    assert refused.value.code == "not_cancellable"


def test_retry_resumes_a_chain_from_its_failed_step():
    w = World(chain(job(), job(), job()))
    w.finish("j1", result="a")
    w.finish("j2", "discarded")
    assert w.jobs["j3"] == "cancelled"
    w.apply(wf.retry(w.copy_head(), [dataclasses.replace(r) for r in w.rows], limit=w.limit,
                     now=4.0))
    assert w.head.state == "running" and w.head.error is None
    assert (w.head.completed_count, w.head.failed_count) == (1, 0)
    assert w.jobs == {"j1": "completed", "j2": "available", "j3": "pending"}
    assert w.inputs["j2"] == {"0": "a"} and w.states()["steps[2]"] == "waiting"
    w.run()
    assert w.head.state == "completed" and w.released.count("j1") == 1


def test_retry_reruns_only_the_failed_jobs_of_a_group():
    w = World(group(job(), job(), job()))
    w.run(fail=frozenset({"j2"}))
    w.apply(wf.retry(w.copy_head(), [dataclasses.replace(r) for r in w.rows], limit=w.limit,
                     now=4.0))
    assert w.available() == ["j2"]
    w.run()
    assert w.head.state == "completed" and w.released.count("j1") == 1


def test_retry_of_a_batch_runs_no_completed_callback_again():
    w = World(batch(job(), job(), on_failure=job(), on_complete=job()))
    w.finish("j1", result=1)
    w.finish("j2", "discarded")
    w.finish("j4", result="done")  # on_complete
    w.finish("j3", "discarded")  # on_failure fails: the batch fails
    assert w.head.state == "failed"
    w.apply(wf.retry(w.copy_head(), [dataclasses.replace(r) for r in w.rows], limit=w.limit,
                     now=4.0))
    assert w.available() == ["j2"] and w.states()["callbacks.on_failure"] == "waiting"
    w.finish("j2", result=2)  # all succeeded now: on_failure is not fired, on_complete ran
    assert w.head.state == "completed" and w.released.count("j4") == 1
    assert w.states()["callbacks.on_failure"] == "skipped" and w.jobs["j3"] == "cancelled"


def test_retry_of_a_batch_whose_job_failed_reruns_it_and_fires_what_was_skipped():
    w = World(batch(job(), job(), on_success=job(), on_failure=job(), on_complete=job()))
    w.finish("j1", result=1)
    w.finish("j2", "discarded")
    w.finish("j4", result="alerted")  # on_failure
    w.finish("j5", result="reported")  # on_complete
    assert w.head.state == "failed" and json.loads(w.head.error)["failed_job_ids"] == ["j2"]
    assert w.states()["callbacks.on_success"] == "skipped"
    w.apply(wf.retry(w.copy_head(), [dataclasses.replace(r) for r in w.rows], limit=w.limit,
                     now=4.0))
    assert w.head.state == "running" and w.available() == ["j2"]
    w.finish("j2", result=2)  # now none failed: on_success fires; the others ran already
    assert w.available() == ["j3"] and w.inputs["j3"] == {"0": 1, "1": 2}
    w.finish("j3", result="celebrated")
    assert w.head.state == "completed"
    assert [w.released.count(j) for j in ("j1", "j2", "j3", "j4", "j5")] == [1, 2, 1, 1, 1]


def test_retry_of_a_failed_callback_alone_fires_it_again():
    w = World(batch(job(), on_success=job()))
    w.finish("j1", result=1)
    w.finish("j2", "discarded")
    w.apply(wf.retry(w.copy_head(), [dataclasses.replace(r) for r in w.rows], limit=w.limit,
                     now=4.0))
    assert w.available() == ["j2"] and w.inputs["j2"] == {"0": 1}
    w.finish("j2", result="ok")
    assert w.head.state == "completed"


def test_only_a_failed_workflow_is_retried():
    w = World(chain(job()))
    with pytest.raises(Conflict) as refused:
        wf.retry(w.copy_head(), w.rows, limit=w.limit, now=1.0)
    assert refused.value.code == "not_failed"


# -- the view -----------------------------------------------------------------------------
def test_the_view_draws_the_tree_with_states_and_job_ids():
    w = World(chain(job("a"), batch(job("b"), on_complete=job("c"))))
    row = {"id": "w1", "type": "chain", "name": "etl", "state": "running", "created_at": 0.0,
           "started_at": 0.0, "finished_at": None, "job_count": 3, "completed_count": 0,
           "failed_count": 0, "steps_total": 2, "error": None}
    shown = view(row, w.rows, {"j1": "active"})
    assert shown["created_at"] == "1970-01-01T00:00:00.000Z" and shown["error"] is None
    assert shown["root"] == {
        "node": 0, "kind": "chain", "state": "active", "position": 0, "children": [
            {"node": 1, "kind": "job", "state": "active", "position": 0, "job_id": "j1",
             "spec": "a", "children": []},
            {"node": 2, "kind": "batch", "state": "waiting", "position": 1, "children": [
                {"node": 3, "kind": "job", "state": "waiting", "position": 0, "job_id": "j3",
                 "spec": "b", "children": []},
                {"node": 4, "kind": "job", "state": "waiting", "position": 1,
                 "role": "on_complete", "job_id": "j4", "spec": "c", "children": []}]}]}


# -- validation ---------------------------------------------------------------------------
def refusal(data: Any, check=lambda path, request: None) -> tuple[str, str]:
    with pytest.raises(DomainError) as refused:
        defs.definition(data, check)
    return refused.value.code, refused.value.message


def deep(levels: int) -> dict[str, Any]:
    inner: dict[str, Any] = chain(job())
    for _ in range(levels - 1):
        inner = group(inner)
    return inner


@pytest.mark.parametrize(("data", "code", "message"), [
    ([], "invalid_workflow", "a workflow is an object, got an array"),
    ({"steps": [job()]}, "invalid_workflow", "type is required: chain, group or batch"),
    ({"type": "dag"}, "invalid_workflow", "type must be one of chain, group, batch, not 'dag'"
     " (a job step has no type: it names its spec)"),
    (chain(job(), {"type": {"a": 1}}), "invalid_workflow", "steps[1].type must be one of"
     " chain, group, batch, not an object (a job step has no type: it names its spec)"),
    (chain(), "empty_workflow", "steps is empty: a chain needs at least one step"),
    (chain(job(), group()), "empty_workflow", "steps[1].jobs is empty: a group needs at least"
     " one step"),
    ({"type": "group"}, "empty_workflow", "jobs must be an array of steps, got nothing"),
    (chain(job(), {"type": "batch", "jobs": [job()]}), "invalid_workflow",
     "steps[1].callbacks must name at least one of on_success, on_failure, on_complete (a"
     " batch without callbacks is a group)"),
    (batch(job(), on_done=job()), "invalid_workflow", "callbacks.on_done is not a field Rota"
     " knows (known: on_success, on_failure, on_complete)"),
    (chain(job(), {**job(), "delay": 5}), "invalid_workflow", "steps[1].delay is not allowed"
     " in a workflow: a step runs when the steps before it are done"),
    (group({**job(), "id": "x"}), "invalid_workflow", "jobs[0].id is not allowed in a"
     " workflow: a step's job id is given by the workflow"),
    (chain(job(), {"spec": "s", "priority": "high"}), "invalid_workflow",
     "steps[1]: priority must be an integer, got a string"),
    (chain({"spec": "s", "colour": 1}), "invalid_workflow", "steps[0]: colour is not a field"
     " Rota knows (known: spec, args, id, queue, priority, run_at, delay, ttl,"
     " visibility_timeout, max_attempts, max_fails, capture_logs, new_queue, unique,"
     " concurrency_key, labels, expires_at)"),
    (chain(7), "invalid_workflow", "steps[0] must be an object (a job or a chain, group or"
     " batch), got an integer"),
    ({**chain(job()), "label": "x"}, "invalid_workflow", "label is not a field Rota knows"
     " (known: steps, name, id)"),
    ({**group(job()), "callbacks": {"on_complete": job()}}, "invalid_workflow",
     "callbacks: only a batch has callbacks (this is a group: make it a batch)"),
    (chain(job(), {**chain(job()), "callback": {"on_failure": job()}}), "invalid_workflow",
     "steps[1].callback: only a batch has callbacks (this is a chain: make it a batch)"),
    ({"type": "chain", "stpes": [job()]}, "invalid_workflow", "stpes is not a field Rota"
     " knows; did you mean steps? (known: steps, name, id)"),
    (chain(job(), {"type": "group", "job": [job()]}), "invalid_workflow", "steps[1].job is"
     " not a field Rota knows; did you mean jobs? (known: jobs, name, id)"),
    ({**batch(job(), on_success=job()), "callback": {}}, "invalid_workflow", "callback is"
     " not a field Rota knows; did you mean callbacks? (known: jobs, callbacks, name, id)"),
    ({**chain(job(), {**group(job()), "id": "g"}), "id": "g"}, "invalid_workflow",
     "steps[1].id 'g' is given twice (first at id): a workflow is a tree, each node once"),
    ({**chain(job()), "id": "a/b"}, "invalid_id", "id: the workflow id holds U+002F '/' at"
     " character 2 (an id is one segment of a URL): a workflow id is 1 to 128 characters from"
     " A-Z a-z 0-9 _ . : @ + = -, starting with a letter or digit"),
    (deep(5), "workflow_too_deep", "jobs[0].jobs[0].jobs[0].jobs[0]: workflows nest at most 4"
     " deep (a chain, group or batch counts one)"),
    (group(*[job()] * 10_001), "workflow_too_large", "jobs[10000]: a workflow holds at most"
     " 10000 jobs (its batches' callbacks not counted)"),
])
def test_validation_names_what_is_wrong_and_where(data, code, message):
    assert refusal(data) == (code, message)


def test_the_message_of_a_refused_job_names_its_path():
    def check(path: str, request: Any) -> DomainError | None:
        return Invalid("unknown_spec", f"unknown spec {request.spec!r}") \
            if request.spec == "x" else None

    data = chain(job(), group(job(), job(), job(), job("x")))
    assert refusal(data, check) == ("unknown_spec", "steps[1].jobs[3]: unknown spec 'x'")


def test_a_valid_definition_is_planned_in_preorder():
    seen: list[str] = []
    data = chain(job("a"), batch(job("b"), chain(job("c")), on_failure=job("d")), job("e"))
    workflow = defs.definition(data, lambda path, request: seen.append(path))
    assert deep(4) and defs.definition(deep(4), lambda p, r: None)  # 4 deep is allowed
    assert seen == ["steps[0]", "steps[1].jobs[0]", "steps[1].jobs[1].steps[0]",
                    "steps[1].callbacks.on_failure", "steps[2]"]
    nodes = defs.plan(workflow)
    assert [(n.node, n.parent, n.end, n.kind, n.position, n.role) for n in nodes] == [
        (0, None, 7, "chain", 0, None), (1, 0, 1, "job", 0, None),
        (2, 0, 6, "batch", 1, None), (3, 2, 3, "job", 0, None), (4, 2, 5, "chain", 1, None),
        (5, 4, 5, "job", 0, None), (6, 2, 6, "job", 2, "on_failure"),
        (7, 0, 7, "job", 2, None)]
    assert [n.path for n in nodes if n.kind == "job"] == seen
    assert defs.digest(workflow) == defs.digest(defs.definition(
        json.loads(json.dumps(data)), lambda p, r: None))


# -- any tree, any order of endings -------------------------------------------------------
def trees(depth: int = 3) -> Any:
    from hypothesis import strategies as st

    jobs = st.builds(lambda: job())
    if depth == 0:
        return jobs
    inner = st.one_of(jobs, st.deferred(lambda: trees(depth - 1)))
    steps = st.lists(inner, min_size=1, max_size=4)
    roles = st.sets(st.sampled_from(CALLBACKS), min_size=1)
    return st.one_of(
        steps.map(lambda s: chain(*s)), steps.map(lambda s: group(*s)),
        st.tuples(steps, roles).map(lambda t: batch(*t[0], **{r: job() for r in t[1]})))


def test_any_workflow_ends_with_every_job_released_at_most_once():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @given(trees(), st.randoms(use_true_random=False))
    @settings(max_examples=150, deadline=None)
    def check(definition: dict[str, Any], rng: Any) -> None:
        w = World(definition if "type" in definition else chain(definition))
        while ready := w.available():
            chosen = rng.choice(ready)
            w.finish(chosen, rng.choice(["completed", "completed", "discarded"]), result=1)
        assert w.head.state in ("completed", "failed")
        assert len(w.released) == len(set(w.released))
        states = {row.job_id: row.state for row in w.rows if row.kind == "job"}
        assert w.head.completed_count == sum(s == "completed" for s in states.values())
        assert w.head.failed_count == sum(s == "failed" for s in states.values())
        assert all(row.state not in wf.OPEN for row in w.rows)  # every node ended
        assert all(w.jobs[job_id] != "pending" for job_id in states)  # no job held for ever
        assert w.rows[0].state == w.head.state
        if w.head.state == "failed":  # a retry, everything succeeding: it completes
            done = {job_id for job_id, state in states.items() if state == "completed"}
            w.apply(wf.retry(w.copy_head(), [dataclasses.replace(r) for r in w.rows],
                             limit=w.limit, now=5.0))
            w.run()
            assert w.head.state == "completed"
            assert all(w.released.count(job_id) == 1 for job_id in done)  # none ran again

    check()
