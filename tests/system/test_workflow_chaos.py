"""Workflows under chaos (issue 24): real `rota serve` processes (one on SQLite, or three
on one PostgreSQL), `rota worker` subprocesses, a chain of 3, a group of 1,000, and two
batches whose callbacks between them cover the whole firing matrix. Midway an SDK worker
and then a server are killed with -9 (the server started again). At the end every
workflow reached its state (docs/protocol.md §8.3), each step had exactly one job and that
job completed once (the store's rows say so: a job killed mid-run runs again under the
same id, so "run once" is one completion per step, not one handler call), every callback
fired once or not at all as the matrix says, and the chain's steps passed their results on."""

from __future__ import annotations

import asyncio
import collections
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from conftest import write_spec
from helpers import COSTLY_POLL, clean_env, end, free_port, spawn_serve, wait_until

GROUP = 1000
BATCH = 40

WORKER_MODULE = '''
"""Written by tests/system/test_workflow_chaos.py."""
import asyncio
import random

from rota import Worker


def ran(ctx):
    """One line per attempt that reached its end: the test counts (id, attempt) pairs."""
    with open("runs.txt", "a") as log:
        log.write(f"{ctx.id} {ctx.attempt}\\n")

worker = Worker(specs_dir="specs", concurrency=16, heartbeat_interval=0.2)


@worker.handler("step")
async def step(ctx):
    await asyncio.sleep(random.uniform(0, 0.02))  # noqa: sleep-ok (the job's own work)
    before = sum(int(r["total"]) for r in ctx.parent_results.values())
    ran(ctx)
    return {"total": before + int(ctx.args["n"]), "seen": sorted(ctx.parent_results)}


@worker.handler("fan")
async def fan(ctx):
    await asyncio.sleep(random.uniform(0, 0.01))  # noqa: sleep-ok (the job's own work)
    if ctx.args.get("fail"):
        raise RuntimeError("this one fails on purpose")
    ran(ctx)
    return {"n": ctx.args["n"]}


@worker.handler("report")
async def report(ctx):
    ran(ctx)
    return {"role": ctx.args["role"], "results": len(ctx.parent_results)}
'''


def specs(directory: Path) -> list[Any]:
    num = '[args.n]\ntype = "integer"\n'
    return [write_spec(directory, "step", extra=num),
            write_spec(directory, "fan", extra=num + '[args.fail]\ntype = "boolean"\n'
                       'required = false\n[retry]\nmax_fails = 1\n'),
            write_spec(directory, "report", extra='[args.role]\ntype = "string"\n')]


def batch(name: str, failing: int | None) -> dict[str, Any]:
    jobs = [{"spec": "fan", "args": {"n": n, **({"fail": True} if n == failing else {})}}
            for n in range(BATCH)]
    return {"type": "batch", "name": name, "jobs": jobs, "callbacks": {
        role: {"spec": "report", "args": {"role": role}}
        for role in ("on_success", "on_failure", "on_complete")}}


def job_nodes(tree: dict[str, Any]) -> list[dict[str, Any]]:
    """Every job node of a workflow's tree, callbacks included."""
    found = [tree] if tree["kind"] == "job" else []
    for child in tree.get("children", []):
        found += job_nodes(child)
    return found


async def run_chaos(tmp: Path, db: str, servers: int) -> None:
    made = specs(tmp / "specs")
    (tmp / "chaos_worker.py").write_text(WORKER_MODULE)
    ports = [free_port() for _ in range(servers)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    clients = [httpx.AsyncClient(base_url=u, timeout=30) for u in urls]
    procs: list[asyncio.subprocess.Process] = []
    workers: list[asyncio.subprocess.Process] = []

    async def serve(i: int, log: str) -> asyncio.subprocess.Process:
        shared = (["--server-id", f"s{i}", "--server-lease", "1", "--reconnect-grace", "1"]
                  if servers > 1 else ["--reconnect-grace", "1"])
        return await spawn_serve(clients[i], [
            "--db", db, "--port", str(ports[i]), "--heartbeat-interval", "0.2",
            "--heartbeat-timeout", "1", *shared], tmp / log)

    async def worker(k: int) -> asyncio.subprocess.Process:
        with (tmp / f"worker-{k}.log").open("wb") as sink:
            return await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rota", "worker", "chaos_worker:worker",
                "--url", urls[k % servers], "--log-level", "info", cwd=tmp, env=clean_env(),
                stdout=sink, stderr=sink)

    try:
        for i in range(servers):
            procs.append(await serve(i, f"s{i}.log"))
        pushed = await clients[0].put("/specs", json={
            "specs": [msgspec.to_builtins(s) for s in made]})
        assert pushed.status_code == 200, pushed.text
        workers = [await worker(k) for k in range(3)]
        bodies = {
            "chain": {"type": "chain", "name": "chain",
                      "steps": [{"spec": "step", "args": {"n": n}} for n in (1, 10, 100)]},
            "group": {"type": "group", "name": "group",
                      "jobs": [{"spec": "fan", "args": {"n": n}} for n in range(GROUP)]},
            "all-good": batch("all-good", None),
            "one-bad": batch("one-bad", 7),
        }
        ids: dict[str, str] = {}
        for k, (name, body) in enumerate(bodies.items()):
            made_one = await clients[k % servers].post("/workflows", json=body)
            assert made_one.status_code == 201, made_one.text
            ids[name] = made_one.json()["workflow"]["id"]

        async def completed_jobs() -> int:
            reply = await clients[0].get("/queues")
            return sum(q["counts"].get("completed", 0) for q in reply.json()["queues"])

        # Chaos once work is under way: a worker killed with -9 (its jobs run again
        # elsewhere), then a server (started again on the same store).
        await wait_until(lambda: _at_least(completed_jobs, GROUP // 5), timeout=60,
                         what="a fifth of the group done", step=COSTLY_POLL)
        workers[0].send_signal(signal.SIGKILL)
        await workers[0].wait()
        victim = 1 % servers
        procs[victim].send_signal(signal.SIGKILL)
        await procs[victim].wait()
        procs[victim] = await serve(victim, f"s{victim}-again.log")
        workers.append(await worker(3))

        async def all_ended() -> bool:
            for workflow_id in ids.values():
                view = await clients[0].get(f"/workflows/{workflow_id}")
                if view.json()["state"] not in ("completed", "failed"):
                    return False
            return True

        await wait_until(all_ended, timeout=120, what="every workflow ended", step=COSTLY_POLL)
        views = {name: (await clients[0].get(f"/workflows/{wid}")).json()
                 for name, wid in ids.items()}
        assert {name: v["state"] for name, v in views.items()} == {
            "chain": "completed", "group": "completed", "all-good": "completed",
            "one-bad": "failed"}  # a job failed: its batch fails, its callbacks having run
        # (Rota's rule; OJS §8.3 would have it completed: docs/protocol.md §8.3 says why)
        # Each job node has one job; each job ended once, as the matrix says.
        fired: dict[str, set[str]] = {}
        for name, view in views.items():
            nodes = job_nodes(view["root"])
            job_ids = [n["job_id"] for n in nodes if n.get("job_id")]
            assert len(job_ids) == len(set(job_ids)), f"{name}: a step with two jobs"
            fired[name] = {n["role"] for n in nodes if n.get("role") and n["state"] == "completed"}
            states = collections.Counter(n["state"] for n in nodes)
            if name == "one-bad":
                assert states == {"completed": BATCH - 1 + 2, "failed": 1, "skipped": 1}, states
            else:
                assert set(states) == {"completed"} | ({"skipped"} if name == "all-good"
                                                       else set()), states
        assert fired["all-good"] == {"on_success", "on_complete"}
        assert fired["one-bad"] == {"on_failure", "on_complete"}
        assert len(job_nodes(views["group"]["root"])) == GROUP
        # The chain passed its results on: 1, then 1 + 10, then 1 + 11 + 100 (each step
        # sees every step before it).
        last = job_nodes(views["chain"]["root"])[-1]["job_id"]
        result = (await clients[0].get(f"/jobs/{last}")).json()["result"]
        assert result == {"total": 112, "seen": ["0", "1"]}, result
        # Every step that ran to its end did so once per attempt (an attempt is given out
        # once, whichever server released the step), and every completed step ran.
        runs = collections.Counter((tmp / "runs.txt").read_text().split("\n")[:-1])
        assert max(runs.values()) == 1, [run for run, n in runs.items() if n > 1][:5]
        ran_ids = {run.split()[0] for run in runs}
        for name, view in views.items():
            done = {n["job_id"] for n in job_nodes(view["root"]) if n["state"] == "completed"}
            assert done <= ran_ids, f"{name}: {sorted(done - ran_ids)[:5]} completed unrun"
        print(f"workflow chaos on {servers} server(s): {GROUP} grouped jobs, 2 batches of"
              f" {BATCH}, a chain of 3, through a worker and a server killed with -9")
    finally:
        for proc in workers:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await end(procs, clients)


async def _at_least(count: Any, wanted: int) -> bool:
    return await count() >= wanted


@pytest.mark.timeout(150)
async def test_workflows_complete_exactly_once_on_sqlite_through_kill_9(tmp_path: Path):
    await run_chaos(tmp_path, str(tmp_path / "rota.db"), servers=1)


@pytest.mark.soak
@pytest.mark.timeout(240)
async def test_workflows_complete_exactly_once_on_three_postgresql_servers(tmp_path: Path,
                                                                          pg_url: str):
    await run_chaos(tmp_path, pg_url, servers=3)
