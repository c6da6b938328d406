"""What no handler can do to its worker, with a real server and worker processes: block
its event loop, hang in a thread, flood it at load. Each run of a handler is counted by
job id in a file, so "every job ran exactly once" is read off the runs themselves."""

from __future__ import annotations

import asyncio
import collections
import os
import sys
from pathlib import Path

import pytest
from conftest import Live, start_server, stop_server, wait_until, write_spec
from helpers import COSTLY_POLL

# (spelt out, not imported: the sentence itself is under test)
WAY_OUT = ('use isolation="process" for handlers that must stop on a cancel,'
           " or check ctx.cancelled")

WORKER = """
import asyncio, os, sys, threading, time
from rota import Worker

RUNS = os.open(os.environ["RUNS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
worker = Worker(url=sys.argv[1], specs_dir="specs", worker_id=sys.argv[2],
                concurrency=int(os.environ.get("CONCURRENCY", "10")),
                max_abandoned_threads=int(os.environ.get("MAX_ABANDONED", "0")) or None)

def ran(ctx):
    os.write(RUNS, f"{ctx.id}\\n".encode())

@worker.handler("noop")
async def noop(ctx):
    ran(ctx)

@worker.handler("block")
async def block(ctx):
    ran(ctx)
    time.sleep(ctx.args["seconds"])  # noqa: sleep-ok (the mistake under test: it blocks)
    return "unblocked"

@worker.handler("hang")
def hang(ctx):
    ran(ctx)
    threading.Event().wait()  # a dead network call: it never returns

@worker.handler("quick")
def quick(ctx):
    ran(ctx)
    return "quick"

asyncio.run(worker.run())
sys.exit(worker.exit_code)
"""
SPECS = ("noop", "block", "hang", "quick")


class Fleet:
    """Worker processes started from WORKER; every handler run is a line in runs.txt."""

    def __init__(self, live: Live, tmp: Path) -> None:
        self.live = live
        self.tmp = tmp
        self.runs = tmp / "runs.txt"
        self.procs: list[asyncio.subprocess.Process] = []
        (tmp / "rworker.py").write_text(WORKER)

    async def start(self, worker_id: str, **env: str) -> asyncio.subprocess.Process:
        with open(self.tmp / f"{worker_id}.log", "w") as log:  # the child keeps its copy
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "rworker.py", self.live.ws, worker_id, cwd=self.tmp,
                env={**os.environ, "RUNS": str(self.runs), **env},
                stdout=asyncio.subprocess.DEVNULL, stderr=log)
        self.procs.append(proc)

        async def registered() -> bool:
            workers = (await self.live.http.get("/workers")).json()["workers"]
            return any(w["id"] == worker_id for w in workers)

        await wait_until(registered, timeout=15, what=f"{worker_id} to register",
                         step=COSTLY_POLL)
        return proc

    def run_counts(self) -> collections.Counter[str]:
        text = self.runs.read_text() if self.runs.exists() else ""
        return collections.Counter(text.split())

    def log(self, worker_id: str) -> str:
        return (self.tmp / f"{worker_id}.log").read_text()

    async def close(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.fixture
async def fleet(live: Live, tmp_path: Path):
    await live.push(*(write_spec(tmp_path / "specs", name) for name in SPECS))
    fleet = Fleet(live, tmp_path)
    try:
        yield fleet
    finally:
        await fleet.close()


async def worker_view(live: Live, worker_id: str) -> dict | None:
    workers = (await live.http.get("/workers")).json()["workers"]
    return next((w for w in workers if w["id"] == worker_id), None)


async def test_a_blocked_handler_loop_does_not_silence_the_worker(tmp_path: Path):
    live = await start_server(tmp_path, heartbeat_interval=0.2, heartbeat_timeout=1.0)
    fleet = Fleet(live, tmp_path)
    try:
        await live.push(*(write_spec(tmp_path / "specs", name) for name in SPECS))
        await fleet.start("w1", CONCURRENCY="4")
        before = await worker_view(live, "w1")
        assert before is not None
        blocker = await live.enqueue("block", {"seconds": 2.5})  # 2.5 x the timeout
        await live.wait_state(blocker["id"], "active")
        others = [await live.enqueue("noop") for _ in range(6)]
        for job in [blocker, *others]:
            done = await live.wait_state(job["id"], "completed", timeout=15)
            assert done["attempt"] == 1 and done["errors"] == []
        after = await worker_view(live, "w1")
        assert after is not None and after["connected_at"] == before["connected_at"]
        assert (await live.job(blocker["id"]))["result"] == "unblocked"
        counts = fleet.run_counts()
        assert set(counts.values()) == {1} and len(counts) == 7
        blocked = [a for a in after["alerts"] if "blocked" in a["message"]]
        assert blocked and blocked[0]["job_id"] == blocker["id"]
        assert "'block'" in blocked[0]["message"]
        assert fleet.log("w1").count("event loop blocked") == 1
    finally:
        await fleet.close()
        await stop_server(live)


async def test_hung_threads_are_abandoned_and_quick_jobs_still_run(live: Live, fleet: Fleet):
    await fleet.start("w1", CONCURRENCY="3", MAX_ABANDONED="10")
    hung = [await live.enqueue("hang", visibility_timeout=1.0, max_attempts=1)
            for _ in range(3)]
    for job in hung:
        given_up = await live.wait_state(job["id"], "discarded", timeout=10)
        assert given_up["errors"][-1]["type"] == "visibility_timeout"
    quick = [await live.enqueue("quick") for _ in range(10)]
    for job in quick:  # the hung threads hold no slot any more
        assert (await live.wait_state(job["id"], "completed", timeout=5))["attempt"] == 1

    async def alerted() -> list[str]:  # (each a second after its run was given up)
        view = await worker_view(live, "w1")
        assert view is not None
        return [a["message"] for a in view["alerts"] if "abandoned" in a["message"]]

    async def three() -> bool:
        return len(await alerted()) >= 3

    await wait_until(three, what="three abandoned-thread alerts")
    abandoned = await alerted()
    assert len(abandoned) == 3 and all(m.endswith(WAY_OUT) for m in abandoned), abandoned
    assert fleet.procs[0].returncode is None


async def test_past_max_abandoned_threads_the_worker_drains_and_exits(live: Live, fleet: Fleet):
    proc = await fleet.start("w1", CONCURRENCY="2", MAX_ABANDONED="2")
    for _ in range(2):
        await live.enqueue("hang", visibility_timeout=0.5, max_attempts=1)
    assert await asyncio.wait_for(proc.wait(), 15) == 75  # for its supervisor to restart
    # Each line says the way out, the exit's too (it named none).
    assert fleet.log("w1").count(f"with code 75 for a restart; {WAY_OUT}") == 1
    assert fleet.log("w1").count(f"abandoned=2: {WAY_OUT}") == 1

    async def gone() -> bool:
        return await worker_view(live, "w1") is None

    await wait_until(gone, what="the worker to deregister")


# Tens of thousands of jobs (the soak runs, -m soak): a loaded CI machine may need more
# than the default minute. The default run has the same at 1/40 of the size.
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("workers", "concurrency", "total"), [
    (1, 10, 500), (2, 100, 500),
    pytest.param(1, 10, 20_000, marks=pytest.mark.soak),
    pytest.param(2, 100, 20_000, marks=pytest.mark.soak)])
async def test_under_load_every_job_runs_exactly_once(live: Live, fleet: Fleet, workers: int,
                                                      concurrency: int, total: int):
    for n in range(workers):
        await fleet.start(f"w{n}", CONCURRENCY=str(concurrency))
    batch = min(total, 1000)
    for start in range(0, total, batch):
        response = await live.http.post("/jobs/batch", json={"jobs": [
            {"spec": "noop", "id": f"load-{n}"} for n in range(start, start + batch)]})
        assert response.status_code == 200

    async def all_completed() -> bool:
        response = await live.http.get("/queues")
        assert response.status_code == 200, response.text  # under load too
        queues = response.json()["queues"]
        return sum(q["counts"].get("completed", 0) for q in queues) == total

    await wait_until(all_completed, timeout=40, what=f"{total} jobs to complete")
    counts = fleet.run_counts()
    assert len(counts) == total and set(counts.values()) == {1}  # each handler ran once
    queues = (await live.http.get("/queues")).json()["queues"]
    assert {state: n for q in queues for state, n in q["counts"].items() if n} == {
        "completed": total}  # nothing lost, nothing retried or discarded
    logs = "".join(fleet.log(f"w{n}") for n in range(workers))
    assert "result rejected" not in logs and "rate_limited" not in logs
    assert "connection to" not in logs  # never lost its connection


ISOLATED = """
import os, time
from pathlib import Path
from rota import Worker

worker = Worker(specs_dir="specs", isolation="process")

@worker.handler("charge")
def charge(ctx):
    Path("pid").write_text(str(os.getpid()))
    time.sleep(ctx.args["wait"])  # noqa: sleep-ok (the work a kill -9 interrupts)
    Path("charged").write_text("charged")
"""


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (a container's init may never do it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_a_worker_killed_with_9_leaves_no_isolated_job_running(live: Live,
                                                                      tmp_path: Path):
    await live.push(write_spec(tmp_path / "specs", "charge"))
    (tmp_path / "isoworker.py").write_text(ISOLATED)
    with open(tmp_path / "worker.log", "w") as log:  # (`rota worker`: a module, by name)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rota", "worker", "isoworker:worker", "--url", live.base,
            cwd=tmp_path, stdout=asyncio.subprocess.DEVNULL, stderr=log)
    try:
        await live.enqueue("charge", {"wait": 2})
        pid_file = tmp_path / "pid"
        await wait_until(lambda: pid_file.exists() and pid_file.read_text(), timeout=15,
                         what="the job to start in its child", step=COSTLY_POLL)
        pid = int(pid_file.read_text())
        proc.kill()
        await proc.wait()
        await wait_until(lambda: dead(pid), timeout=5, what="the child to die with its worker")
        assert not (tmp_path / "charged").exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
