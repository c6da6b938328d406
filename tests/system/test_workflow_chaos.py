"""Workflows under chaos, with real processes: a chain of 3, a group of 1,000 and a batch
with all three callbacks, while a ``rota worker`` and then the server are killed with -9
(the server restarted on its store, a new worker started). Every node's job completes
once it is released, no step is released twice, each fired callback runs, the one the
matrix does not fire never does, and every chain step got the results before it."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import write_spec
from helpers import COSTLY_POLL, wait_until
from test_crash import ServerProcess, WorkerProcesses

pytestmark = pytest.mark.soak

WORKER_MODULE = '''
"""Written by tests/system/test_workflow_chaos.py: a step returns its args and how many
results it was given; a few milliseconds of work each."""
import asyncio
import random

from rota import Worker

worker = Worker(specs_dir="specs", concurrency=CONCURRENCY)


@worker.handler("step")
async def step(ctx):
    await asyncio.sleep(random.uniform(0, 0.01))  # noqa: sleep-ok (the job's own work)
    return {"args": ctx.args, "given": sorted(ctx.parent_results)}
'''


class StepWorkers(WorkerProcesses):
    MODULE, PREFIX = WORKER_MODULE, "chaos_worker"


def step(n: int) -> dict[str, Any]:
    return {"spec": "step", "args": {"n": n}}


def rows(db: Path, sql: str, *params: Any) -> list[sqlite3.Row]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


async def test_workflows_survive_killed_workers_and_a_killed_server(tmp_path: Path):
    server, workers = ServerProcess(tmp_path), StepWorkers(tmp_path)
    try:
        await server.start()
        await server.push(write_spec(tmp_path / "specs", "step"))
        first = [await workers.start(server.base, concurrency=8) for _ in range(2)]
        made = {}
        for name, body in (
                ("chain", {"type": "chain", "id": "chain", "steps": [step(1), step(2), step(3)]}),
                ("group", {"type": "group", "id": "group", "jobs": [step(n) for n in range(1000)]}),
                ("batch", {"type": "batch", "id": "batch", "jobs": [step(n) for n in range(100)],
                           "callbacks": {"on_success": step(-1), "on_failure": step(-2),
                                         "on_complete": step(-3)}})):
            reply = await server.http.post("/workflows", json=body)
            assert reply.status_code == 201, reply.text
            made[name] = reply.json()["workflow"]

        def completed() -> int:
            return rows(server.db, "SELECT COUNT(*) FROM jobs WHERE state = 'completed'")[0][0]

        await wait_until(lambda: completed() >= 200, timeout=30, what="200 steps done",
                         step=COSTLY_POLL)
        first[0].kill()  # a worker dies mid-job
        await first[0].wait()
        await wait_until(lambda: completed() >= 500, timeout=30, what="500 steps done",
                         step=COSTLY_POLL)
        await server.kill()  # and the server, with jobs in flight
        await server.restart_here()
        await workers.start(server.base, concurrency=8)

        async def finished() -> bool:
            states = [(await server.http.get(f"/workflows/{w}")).json()["state"]
                      for w in made]
            return all(state == "completed" for state in states)

        await wait_until(finished, timeout=60, what="every workflow completed", step=0.2)
        jobs = rows(server.db, "SELECT id, state, workflow_id, workflow_node, result, attempt"
                               " FROM jobs")
        assert Counter(row["workflow_id"] for row in jobs) == {"chain": 3, "group": 1000,
                                                              "batch": 103}
        nodes = {(r["workflow_id"], r["node"]): r["state"] for r in rows(
            server.db, "SELECT workflow_id, node, state FROM workflow_nodes")}
        by_node = {(row["workflow_id"], row["workflow_node"]): row for row in jobs}
        assert len(by_node) == len(jobs)  # one job per node, made once
        for key, row in by_node.items():
            if row["state"] == "cancelled":  # the callback the matrix does not fire
                assert nodes[key] == "skipped" and key == ("batch", 102), key
                assert row["attempt"] == 0  # never given out
            else:
                assert (row["state"], nodes[key]) == ("completed", "completed"), key
        chain = [json.loads(by_node[("chain", n)]["result"]) for n in (1, 2, 3)]
        assert [c["given"] for c in chain] == [[], ["0"], ["0", "1"]]
        callbacks = [json.loads(by_node[("batch", n)]["result"] or "null") for n in (101, 103)]
        assert [c["given"] for c in callbacks] == [[str(n) for n in sorted(
            range(100), key=str)]] * 2
        view = (await server.http.get("/workflows/batch")).json()
        assert (view["completed_count"], view["failed_count"]) == (102, 0)
        reran = sum(1 for row in jobs if row["attempt"] > 1)
        print(f"\n[workflow chaos] 1,106 steps in 3 workflows, a worker and the server"
              f" killed -9: every step completed; {reran} ran again after a death")
    finally:
        await workers.close()
        await server.close()
