"""Workflows through the HTTP API with a real server and real SDK workers: a chain passing
results through ctx.parent_results (also on PostgreSQL), a group and a batch with its
callbacks and a failing job, cancel, retry, the list, and bad input refused with nothing
stored."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import wait_until

from rota import JobContext, Worker

Starter = Callable[[Worker], Awaitable[Worker]]


def job(spec: str, **args: Any) -> dict[str, Any]:
    return {"spec": spec, "args": args}


async def serve(live: Live, sdk_worker: Starter, directory: Path) -> dict[str, Any]:
    """A worker for ``step`` (returns its args and what its parents passed it), ``boom``
    (fails for good while ``state["boom"]`` says so) and ``collect`` (returns its
    parent_results). ``parked`` has no worker: its jobs wait."""
    state: dict[str, Any] = {"boom": True, "runs": []}
    await live.push(write_spec(directory, "step"), write_spec(directory, "collect"),
                    write_spec(directory, "boom", extra="[retry]\nmax_attempts = 1\n"),
                    write_spec(directory, "parked", queue="nobody"))
    worker = Worker(specs_dir=directory, heartbeat_interval=0.2, concurrency=4)

    @worker.handler("step")
    async def step(ctx: JobContext) -> dict[str, Any]:
        state["runs"].append(ctx.args.get("n"))
        assert ctx.workflow_id is not None
        return {"n": ctx.args.get("n"), "seen": ctx.parent_results}

    @worker.handler("boom")
    async def boom(ctx: JobContext) -> str:
        if state["boom"]:
            raise ValueError("the widget melted")
        return "mended"

    @worker.handler("collect")
    async def collect(ctx: JobContext) -> dict[str, Any]:
        return ctx.parent_results

    await sdk_worker(worker)
    return state


async def create(live: Live, body: dict[str, Any], status: int = 201) -> dict[str, Any]:
    answer = await live.http.post("/workflows", json=body)
    assert answer.status_code == status, answer.text
    return answer.json()["workflow"]


async def until(live: Live, workflow_id: str, state: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        shown = (await live.http.get(f"/workflows/{workflow_id}")).json()
        return shown if shown["state"] == state else None

    return await wait_until(check, timeout=15, what=f"workflow {workflow_id} {state}")


async def results(live: Live, tree: dict[str, Any]) -> list[Any]:
    """The results of the tree's jobs, in preorder."""
    out = []
    for node in tree["children"] or [tree]:
        if node["kind"] == "job":
            out.append((await live.job(node["job_id"]))["result"])
        else:
            out += await results(live, node)
    return out


@pytest.mark.both_backends
async def test_a_chain_of_three_passes_each_step_the_results_before_it(
        live: Live, sdk_worker: Starter, tmp_path: Path):
    await serve(live, sdk_worker, tmp_path)
    made = await create(live, {"type": "chain", "name": "etl", "id": "etl-1", "steps": [
        job("step", n=1), job("step", n=2), job("step", n=3)]})
    assert (made["id"], made["type"], made["name"], made["job_count"]) == ("etl-1", "chain",
                                                                            "etl", 3)
    # (the view is read once it is stored: the worker may have run some steps by then)
    assert [(n["kind"], n["spec"]) for n in made["root"]["children"]] == [("job", "step")] * 3
    assert made["root"]["children"][0]["state"] != "waiting"
    done = await until(live, "etl-1", "completed")
    assert (done["completed_count"], done["failed_count"], done["error"]) == (3, 0, None)
    first, second, third = await results(live, done["root"])
    assert first == {"n": 1, "seen": {}}
    assert second == {"n": 2, "seen": {"0": first}}
    assert third == {"n": 3, "seen": {"0": first, "1": second}}
    step = await live.job(done["root"]["children"][2]["job_id"])
    assert (step["workflow_id"], step["workflow_node"]) == ("etl-1", 3)
    again = await live.http.post("/workflows", json={"type": "chain", "name": "etl", "id": "etl-1",
                                                     "steps": [job("step", n=1), job("step", n=2),
                                                               job("step", n=3)]})
    assert (again.status_code, again.json()["created"]) == (200, False)


async def test_a_group_in_a_chain_and_a_batch_with_a_failing_job(
        live: Live, sdk_worker: Starter, tmp_path: Path):
    state = await serve(live, sdk_worker, tmp_path)
    fan = await create(live, {"type": "chain", "steps": [
        {"type": "group", "jobs": [job("step", n=1), job("step", n=2)]}, job("collect")]})
    done = await until(live, fan["id"], "completed")
    *_, collected = await results(live, done["root"])
    assert collected == {"0": {"0": {"n": 1, "seen": {}}, "1": {"n": 2, "seen": {}}}}
    made = await create(live, {"type": "batch", "jobs": [job("step", n=10), job("boom")],
                               "callbacks": {"on_success": job("step", n=11),
                                             "on_failure": job("collect"),
                                             "on_complete": job("step", n=12)}})
    # Its fired callbacks completed, but a job failed: the batch failed (not OJS §8.3's).
    done = await until(live, made["id"], "failed")
    kids = done["root"]["children"]
    assert [(k.get("role"), k["state"]) for k in kids] == [
        (None, "completed"), (None, "failed"), ("on_success", "skipped"),
        ("on_failure", "completed"), ("on_complete", "completed")]
    assert (done["completed_count"], done["failed_count"]) == (3, 1)
    assert done["error"]["failed_job_ids"] == [kids[1]["job_id"]]
    listed = (await live.http.get("/workflows", params={"state": "failed"})).json()
    assert made["id"] in [w["id"] for w in listed["workflows"]]
    report = await live.job(kids[3]["job_id"])
    assert report["result"] == {"0": {"n": 10, "seen": {}}, "1": None}
    assert (await live.job(kids[2]["job_id"]))["state"] == "cancelled"
    assert sorted(n for n in state["runs"] if n is not None and n >= 10) == [10, 12]
    # A retry runs the failed job again; none failed now, so on_success fires at last, and
    # the callbacks that completed do not run again.
    state["boom"] = False
    answer = await live.http.post(f"/workflows/{made['id']}/retry")
    assert answer.status_code == 200, answer.text
    done = await until(live, made["id"], "completed")
    assert [k["state"] for k in done["root"]["children"]] == ["completed"] * 3 + [
        "completed", "completed"]
    assert sorted(n for n in state["runs"] if n is not None and n >= 10) == [10, 11, 12]


async def test_cancel_stops_waiting_and_held_jobs_and_retry_resumes_a_failed_chain(
        live: Live, sdk_worker: Starter, tmp_path: Path):
    state = await serve(live, sdk_worker, tmp_path)
    parked = await create(live, {"type": "chain", "steps": [job("parked"), job("step")]})
    # A released step no worker takes says why, in the workflow's view as in its job's.
    shown = (await live.http.get(f"/workflows/{parked['id']}")).json()
    first = shown["root"]["children"][0]
    assert first["waiting_reason"] == "no connected worker serves queue 'nobody'", first
    assert "waiting_reason" not in shown["root"]["children"][1]  # held: its turn will come
    answer = await live.http.delete(f"/workflows/{parked['id']}")
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "cancelled"
    for node in answer.json()["root"]["children"]:
        assert node["state"] == "cancelled"
        assert (await live.job(node["job_id"]))["state"] == "cancelled"
    again = await live.http.delete(f"/workflows/{parked['id']}")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "not_cancellable")
    # A group's released jobs that still wait are cancelled with it, in its transaction,
    # and the server lets go of them (none is counted waiting, none given out).
    wide = await create(live, {"type": "group", "jobs": [job("parked")] * 300})
    answer = await live.http.delete(f"/workflows/{wide['id']}")
    assert answer.json()["state"] == "cancelled"
    assert {n["state"] for n in answer.json()["root"]["children"]} == {"cancelled"}
    states = (await live.http.get("/queues")).json()["queues"]
    assert not any(q["counts"].get("available") for q in states), states
    first = answer.json()["root"]["children"][0]["job_id"]
    assert live.coordinator.scheduler.jobs.get(first) is None  # let go of, whole or as a key

    made = await create(live, {"type": "chain", "steps": [job("step", n=1), job("boom"),
                                                          job("step", n=3)]})
    failed = await until(live, made["id"], "failed")
    assert failed["error"]["failed_step_index"] == 1
    [error] = failed["error"]["errors"]
    assert (error["code"], error["message"]) == ("ValueError", "the widget melted")
    assert [n["state"] for n in failed["root"]["children"]] == ["completed", "failed",
                                                                "cancelled"]
    state["boom"] = False
    answer = await live.http.post(f"/workflows/{made['id']}/retry")
    assert answer.status_code == 200, answer.text
    done = await until(live, made["id"], "completed")
    assert done["error"] is None and done["finished_at"] is not None
    assert state["runs"].count(1) == 1 and state["runs"].count(3) == 1  # once each
    again = await live.http.post(f"/workflows/{made['id']}/retry")
    assert (again.status_code, again.json()["error"]["code"]) == (409, "not_failed")
    state["boom"] = True  # a failed step whose job retention deleted cannot run again
    lost = await create(live, {"type": "chain", "steps": [job("boom"), job("step", n=5)]})
    failed = await until(live, lost["id"], "failed")
    gone = failed["root"]["children"][0]["job_id"]
    with contextlib.closing(sqlite3.connect(live.settings.db)) as conn, conn:
        conn.execute("DELETE FROM jobs WHERE id = ?", (gone,))
    refused = await live.http.post(f"/workflows/{lost['id']}/retry")
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "not_retryable")
    assert gone in refused.json()["error"]["message"]
    assert (await live.http.get(f"/workflows/{lost['id']}")).json()["state"] == "failed"
    listed = (await live.http.get("/workflows", params={"state": "completed"})).json()
    assert [w["id"] for w in listed["workflows"]] == [made["id"]]
    page = (await live.http.get("/workflows", params={"limit": 1})).json()
    assert page["next"] is not None
    rest = (await live.http.get("/workflows", params={"after": page["next"]})).json()
    assert [w["id"] for w in page["workflows"] + rest["workflows"]] == [
        lost["id"], made["id"], wide["id"], parked["id"]]


BAD: list[tuple[str, Any, int, str, str]] = [
    ("unknown spec in a step", {"type": "chain", "steps": [
        job("step"), {"type": "group", "jobs": [job("step"), job("nope")]}]}, 422,
     "unknown_spec", "steps[1].jobs[1]: spec 'nope' has no status quo. Known specs: step."
     " Push a spec with 'rota specs push' first."),
    ("an empty group", {"type": "group", "jobs": []}, 422, "empty_workflow",
     "jobs is empty: a group needs at least one step"),
    ("too deep", {"type": "chain", "steps": [{"type": "group", "jobs": [{"type": "chain",
     "steps": [{"type": "group", "jobs": [{"type": "chain", "steps": [job("step")]}]}]}]}]},
     422, "workflow_too_deep", "steps[0].jobs[0].steps[0].jobs[0]: workflows nest at most 4"
     " deep (a chain, group or batch counts one)"),
    ("too large", {"type": "group", "jobs": [job("step")] * 10_001}, 422,
     "workflow_too_large", "jobs[10000]: a workflow holds at most 10000 jobs (its batches'"
     " callbacks not counted)"),
    ("a delay in a step", {"type": "chain", "steps": [{"spec": "step", "delay": 5}]}, 422,
     "invalid_workflow", "steps[0].delay is not allowed in a workflow: a step runs when the"
     " steps before it are done"),
    ("bad args", {"type": "chain", "steps": [{"spec": "step", "args": []}]}, 422,
     "invalid_workflow", "steps[0]: args must be an object, got an array"),
    ("callbacks on a group", {"type": "group", "jobs": [job("step")], "callbacks": {
        "on_complete": job("step")}}, 422, "invalid_workflow", "callbacks: only a batch has"
     " callbacks (this is a group: make it a batch)"),
    ("a misspelt field", {"type": "chain", "setps": [job("step")]}, 422, "invalid_workflow",
     "setps is not a field Rota knows; did you mean steps? (known: steps, name, id)"),
    ("a repeated id", {"type": "chain", "id": "x", "steps": [
        {"type": "group", "id": "x", "jobs": [job("step")]}]}, 422, "invalid_workflow",
     "steps[0].id 'x' is given twice (first at id): a workflow is a tree, each node once"),
]


async def test_bad_input_is_refused_precisely_and_nothing_is_stored(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "step", queue="nobody"))
    for name, body, status, code, message in BAD:
        answer = await live.http.post("/workflows", json=body)
        assert answer.status_code == status, (name, answer.text)
        assert answer.json()["error"] == {"code": code, "message": message}, name
    huge = await live.http.post("/workflows", content=b'{"type": "group", "jobs": ['
                                + b'{"spec": "step"},' * 70_000 + b'{"spec": "step"}]}')
    assert (huge.status_code, huge.json()["error"]["code"]) == (413, "body_too_large")
    await create(live, {"type": "chain", "id": "w", "steps": [job("step", n=1)]})
    other = await live.http.post("/workflows", json={"type": "chain", "id": "w",
                                                     "steps": [job("step", n=2)]})
    assert (other.status_code, other.json()["error"]["code"]) == (409, "workflow_exists")
    listed = (await live.http.get("/workflows")).json()["workflows"]
    assert [w["id"] for w in listed] == ["w"]
    jobs = (await live.http.get("/jobs")).json()["jobs"]
    assert [j["workflow_id"] for j in jobs] == ["w"]  # the refused ones left nothing
    before = len(jobs)
    # A step's unique key (its spec's [unique]) held by another job: the whole is refused.
    await live.push(write_spec(tmp_path, "solo", queue="nobody",
                               extra='[unique]\nkeys = ["spec"]\n'))
    holder = await live.enqueue("solo")
    held = await live.http.post("/workflows", json={"type": "chain", "steps": [
        job("step"), job("solo")]})
    assert (held.status_code, held.json()["error"]["code"]) == (409, "unique_conflict")
    assert held.json()["error"]["message"].startswith(f"steps[1]: job {holder['id']} holds")
    assert [w["id"] for w in (await live.http.get("/workflows")).json()["workflows"]] == ["w"]
    assert len((await live.http.get("/jobs")).json()["jobs"]) == before + 1  # the holder
    missing = await live.http.get("/workflows/nope")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "not_found")


async def test_a_unique_replace_leaves_a_released_step_to_its_workflow(live: Live,
                                                                       tmp_path: Path):
    """A step's job holding its spec's unique key is its workflow's: an enqueue that
    would replace it is refused (409, saying whose it is), so the workflow never waits
    for an ending that no transaction would settle."""
    await live.push(write_spec(tmp_path, "uq", queue="nobody", extra=(
        '[unique]\non_conflict = "replace"\nstates = "waiting"\n')))
    made = await create(live, {"type": "chain", "steps": [job("uq")]})
    replace = await live.http.post("/jobs", json={"spec": "uq"})
    assert (replace.status_code, replace.json()["error"]["code"]) == (409, "unique_conflict")
    assert "workflow's step" in replace.json()["error"]["message"]
    first = made["root"]["children"][0]["job_id"]
    assert (await live.job(first))["state"] == "available"
    # Two steps of one group claiming one key: the workflow is refused whole.
    both = await live.http.post("/workflows", json={"type": "group", "jobs": [job("uq")] * 2})
    assert (both.status_code, both.json()["error"]["code"]) == (409, "unique_conflict"), both.text


async def test_a_create_whose_transaction_runs_again_still_releases_its_first_steps(
        live: Live, sdk_worker: Starter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The writer runs a transaction again from the start when PostgreSQL ends it for a
    deadlock with another server's (rota/store/writer.py): every write in it must do the
    same the second time. Here every write runs twice on the real database, its first
    run rolled back as a deadlock's would be. A workflow's create once emptied the list
    of steps its start releases on the first run: the second stored the first step
    waiting and handed it to no server, and the chain never ran (seen on three servers
    on PostgreSQL)."""
    await serve(live, sdk_worker, tmp_path)
    writer = live.coordinator.store.writer
    submit = writer.submit

    def twice(op: Callable[[Any], Any], linger: bool = False) -> Any:
        def again(conn: Any) -> Any:
            conn.execute("SAVEPOINT first_run")
            op(conn)
            conn.execute("ROLLBACK TO first_run")
            conn.execute("RELEASE first_run")
            return op(conn)
        return submit(again, linger)

    monkeypatch.setattr(writer, "submit", twice)
    await create(live, {"type": "chain", "id": "twice", "steps": [job("step", n=1),
                                                                 job("step", n=2)]})
    await create(live, {"type": "group", "id": "twice-group", "jobs": [job("step", n=3),
                                                                      job("step", n=4)]})
    for workflow_id in ("twice", "twice-group"):
        done = await until(live, workflow_id, "completed")
        assert (done["completed_count"], done["failed_count"]) == (2, 0)
