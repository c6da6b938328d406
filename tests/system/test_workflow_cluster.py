"""Workflows on three servers sharing one PostgreSQL, a worker on each: workflows created
through one server advance on whichever server stores each ending (the workflow's row
locked), so every step runs once and a batch's callbacks fire once, however its jobs'
endings race across the servers."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from conftest import write_spec
from helpers import COSTLY_POLL, wait_until
from test_cluster import running, servers

from rota import JobContext, Worker


async def test_three_servers_advance_each_workflow_once(tmp_path: Path, pg_url: str):
    specs = tmp_path / "specs"
    spec = write_spec(specs, "step")
    runs: collections.Counter[tuple[str, str]] = collections.Counter()

    def worker(url: str, name: str) -> Worker:
        made = Worker(url=url, specs_dir=specs, heartbeat_interval=0.1, worker_id=name,
                      concurrency=8)

        @made.handler("step")
        async def step(ctx: JobContext) -> dict[str, Any]:
            runs[(str(ctx.workflow_id), ctx.id)] += 1
            return {"n": ctx.args["n"], "given": sorted(ctx.parent_results)}

        return made

    async with servers(tmp_path, pg_url, 3) as lives:
        await lives[0].push(spec)
        async with running(*(worker(live.ws, f"w{i}") for i, live in enumerate(lives))):
            bodies = [
                {"type": "batch", "id": "fan", "jobs": [
                    {"spec": "step", "args": {"n": n}} for n in range(300)],
                 "callbacks": {"on_success": {"spec": "step", "args": {"n": -1}},
                               "on_complete": {"spec": "step", "args": {"n": -2}}}},
                {"type": "chain", "id": "line", "steps": [
                    {"spec": "step", "args": {"n": n}} for n in range(3)]}]
            for live, body in zip(lives, bodies):
                reply = await live.http.post("/workflows", json=body)
                assert reply.status_code == 201, reply.text

            async def done() -> bool:
                shown = [(await lives[2].http.get(f"/workflows/{w}")).json()
                         for w in ("fan", "line")]
                return all(s["state"] == "completed" for s in shown)

            async def explain() -> str:
                """What each server says of the workflows' unfinished jobs, and of its
                workers (seen once: a chain's released step never assigned in 30 s)."""
                said = []
                for i, live in enumerate(lives):
                    for w in ("fan", "line"):
                        view = (await live.http.get(f"/workflows/{w}")).json()
                        said.append(f"s{i} {w}: {_unfinished(view.get('root', {}))}")
                    said.append(f"s{i} workers: {(await live.http.get('/workers')).text}")
                return "\n".join(said)

            try:
                await wait_until(done, timeout=30, what="both workflows completed",
                                 step=COSTLY_POLL)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{await explain()}") from None
        fan = (await lives[1].http.get("/workflows/fan")).json()
        assert (fan["completed_count"], fan["failed_count"]) == (302, 0)
        assert sum(1 for w, _ in runs if w == "fan") == 302
        assert sum(1 for w, _ in runs if w == "line") == 3
        assert max(runs.values()) == 1, "a step ran twice"
        callbacks = [node for node in fan["root"]["children"] if "role" in node]
        for node in callbacks:
            job = (await lives[0].http.get(f"/jobs/{node['job_id']}")).json()
            assert len(job["result"]["given"]) == 300
        line = (await lives[0].http.get("/workflows/line")).json()
        last = (await lives[0].http.get(f"/jobs/{line['root']['children'][2]['job_id']}")
                ).json()
        assert last["result"]["given"] == ["0", "1"]


def _unfinished(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes of a workflow's tree not completed, each as the view shows it, bar its
    children."""
    found = [{k: v for k, v in node.items() if k != "children"}] if node.get(
        "state") not in (None, "completed") and "job_id" in node else []
    for child in node.get("children", []):
        found += _unfinished(child)
    return found


async def test_a_workflow_through_another_server_right_after_a_push_finds_its_specs(
        tmp_path: Path, pg_url: str):
    """As an enqueue: a server that has not heard of a spec pushed through another one
    reads the status quo before it refuses a workflow naming it."""
    spec = write_spec(tmp_path / "specs", "step")
    async with servers(tmp_path, pg_url, 2) as (a, b):
        cluster = b.server.config.loaded_app.app.state.cluster  # type: ignore[union-attr]
        cluster._ready = False  # B hears no spec notice: as if it had not come yet
        await a.push(spec)
        made = await b.http.post("/workflows", json={"type": "group", "jobs": [
            {"spec": "step"}]})
        assert made.status_code == 201, made.text
        refused = await b.http.post("/workflows", json={"type": "group", "jobs": [
            {"spec": "stpe"}]})
        assert (refused.status_code, refused.json()["error"]["code"]) == (422, "unknown_spec")


async def test_one_id_created_through_two_servers_at_once_is_one_workflow(
        tmp_path: Path, pg_url: str):
    """Sending a workflow again is safe across servers: the same id created through two
    at once makes one workflow (201 and 200), never a 500; another definition is 409."""
    import asyncio
    spec = write_spec(tmp_path / "specs", "step")
    async with servers(tmp_path, pg_url, 2) as (a, b):
        await a.push(spec)
        for n in range(4):
            body = {"type": "group", "id": f"twice-{n}", "jobs": [
                {"spec": "step", "args": {"n": k}} for k in range(200)]}
            answers = await asyncio.gather(a.http.post("/workflows", json=body),
                                           b.http.post("/workflows", json=body))
            assert sorted(r.status_code for r in answers) == [200, 201], [
                r.text[:200] for r in answers]
            other = await b.http.post("/workflows", json={**body, "jobs": body["jobs"][:1]})
            assert (other.status_code, other.json()["error"]["code"]) == (409,
                                                                          "workflow_exists")
        counts = (await a.http.get("/queues")).json()["queues"][0]["counts"]
        assert sum(counts.values()) == 4 * 200, counts  # one job per step, none twice
