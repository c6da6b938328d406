"""Worker lifecycle: server directives (API and CLI), signals to real worker processes,
graceful shutdown with a grace period, deregistration, and a rolling deploy."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import Live, wait_until, write_spec
from helpers import COSTLY_POLL, rota

from rota import JobContext, Worker

WORKER_MODULE = """
import asyncio, os
from rota import Worker

worker = Worker(specs_dir="specs", concurrency=2, labels=["proc"], heartbeat_interval=0.1,
                grace_period=float(os.environ.get("GRACE", "25")))

@worker.handler("work")
async def work(ctx):
    open(f"run-{ctx.id}-{ctx.attempt}", "w").close()  # the test sees the run start
    await asyncio.sleep(ctx.args.get("seconds", 0))  # noqa: sleep-ok (the job's own work)
    return {"slept": ctx.args.get("seconds", 0), "pid": os.getpid()}

if __name__ == "__main__":  # a plain script: its signals must behave as under `rota worker`
    import sys
    worker.url = sys.argv[1]
    asyncio.run(worker.run())
"""
# How a worker process is started: by the CLI, or as a script that calls worker.run().
LAUNCHES = ["cli", "script"]


async def start_worker_process(live: Live, tmp_path: Path, *, grace: float = 25.0,
                               launch: str = "cli") -> tuple[asyncio.subprocess.Process, str]:
    (tmp_path / "lifecycle_worker.py").write_text(WORKER_MODULE)
    command = (["-m", "rota", "worker", "lifecycle_worker:worker", "--url", live.base]
               if launch == "cli" else ["lifecycle_worker.py", live.ws])
    with open(tmp_path / "worker.log", "a") as log:  # read it when a test fails
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *command,
            cwd=tmp_path, env={**os.environ, "GRACE": str(grace)},
            stdout=asyncio.subprocess.DEVNULL, stderr=log)

    async def registered() -> str | None:
        workers = (await live.http.get("/workers")).json()["workers"]
        return next((w["id"] for w in workers if w["pid"] == proc.pid), None)

    return proc, await wait_until(registered, timeout=15, what="the worker process to register",
                                  step=COSTLY_POLL)


async def worker_state(live: Live, worker_id: str) -> str | None:
    workers = (await live.http.get("/workers")).json()["workers"]
    return next((w["state"] for w in workers if w["id"] == worker_id), None)


@pytest.fixture
async def procs():
    started: list[asyncio.subprocess.Process] = []
    yield started
    for proc in started:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def sdk(tmp_path: Path, **options) -> Worker:
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1, **options)

    @worker.handler("work")
    async def work(ctx: JobContext) -> str:
        await asyncio.sleep(ctx.args.get("seconds", 0))  # noqa: sleep-ok (the job's work)
        return ctx.worker_id

    return worker


async def test_a_stopping_worker_beats_at_its_pace_while_a_job_runs(live: Live, sdk_worker,
                                                                     tmp_path: Path):
    """Told to terminate with a job still running, a worker keeps its heartbeat interval
    until the job ends (it beat once per ack, thousands a second, before)."""
    await live.push(write_spec(tmp_path, "work"))
    worker = await sdk_worker(sdk(tmp_path))
    job = await live.enqueue("work", {"seconds": 1.5})
    await live.wait_state(job["id"], "active")
    conn = live.coordinator.connections[worker.worker_id]
    worker.stop()
    await wait_until(lambda: conn.worker.state == "terminate", what="the stop to be heard")
    before, started = conn.frames, time.monotonic()
    await wait_until(lambda: time.monotonic() - started >= 0.5 or not live.coordinator
                     .connections, what="half a second of a stopping worker")
    elapsed = time.monotonic() - started
    assert conn.frames - before <= 5 + 20 * elapsed  # interval 0.1 s: ~10 a second
    assert (await live.wait_state(job["id"], "completed"))["attempt"] == 1


# -- directives ---------------------------------------------------------------------------
async def test_server_directs_quiet_then_terminate(live: Live, sdk_worker, tmp_path: Path):
    await live.push(write_spec(tmp_path, "work"))
    worker = await sdk_worker(sdk(tmp_path))
    running = await live.enqueue("work", {"seconds": 0.4})
    await live.wait_state(running["id"], "active")
    reply = await live.http.post(f"/workers/{worker.worker_id}/state", json={"state": "quiet"})
    assert reply.status_code == 200 and reply.json()["workers"] == [worker.worker_id]
    await wait_until(lambda: worker.state == "quiet", what="the worker to go quiet")
    waiting = await live.enqueue("work")
    assert "quiet or terminating" in (await live.job(waiting["id"]))["waiting_reason"]
    assert (await live.wait_state(running["id"], "completed"))["attempt"] == 1

    back = await live.http.post(f"/workers/{worker.worker_id}/state", json={"state": "terminate"})
    assert back.status_code == 200
    await wait_until(lambda: not live.coordinator.connections, what="the worker to deregister")
    assert worker.state == "terminate"
    assert (await live.job(waiting["id"]))["state"] == "available"  # never given to it


async def test_directive_errors(live: Live, connect, tmp_path: Path):
    spec = write_spec(tmp_path, "work")
    await live.push(spec)
    raw = await connect("raw")
    await raw.register([spec])
    assert (await live.http.post("/workers/nobody/state", json={"state": "quiet"})).status_code == 404
    running = await live.http.post("/workers/raw/state", json={"state": "running"})
    assert running.status_code == 200  # it runs already: nothing to do
    bad = await live.http.post("/workers/raw/state", json={"state": "sleeping"})
    assert bad.status_code == 422
    assert (await live.http.post("/workers/state", json={"state": "quiet"})).status_code == 422
    assert (await live.http.post("/workers/raw/state", json={"state": "terminate"})).status_code == 200
    back = await live.http.post("/workers/raw/state", json={"state": "quiet"})
    assert back.status_code == 409 and back.json()["error"]["code"] == "invalid_transition"
    back = await live.http.post("/workers/raw/state", json={"state": "running"})
    assert back.status_code == 409 and back.json()["error"]["code"] == "invalid_transition"
    await raw.beat(status={"state": "running", "active_job_ids": []})
    assert (await raw.expect("ack"))["state"] == "terminate"  # said until the worker gets there
    code, out, _ = await rota("workers", "list", "--url", live.base)  # said as a state
    assert code == 0 and out.startswith("raw  terminating load="), out


async def test_cli_quiets_by_label_and_terminates_all(live: Live, sdk_worker, tmp_path: Path):
    await live.push(write_spec(tmp_path, "work"))
    canary = await sdk_worker(sdk(tmp_path, labels=["canary"]))
    stable = await sdk_worker(sdk(tmp_path, labels=["stable"]))
    code, out, _ = await rota("workers", "quiet", "--label", "canary", "--url", live.base)
    assert code == 0 and out.strip() == f"{canary.worker_id}: quiet"
    await wait_until(lambda: canary.state == "quiet", what="canary quiet")
    assert stable.state == "running"
    code, out, _ = await rota("workers", "list", "--url", live.base)
    assert code == 0 and "quiet" in out and "labels=canary" in out
    job = await live.enqueue("work")
    assert (await live.wait_state(job["id"], "completed"))["result"] == stable.worker_id
    code, out, _ = await rota("workers", "terminate", "--all", "--url", live.base)
    assert code == 0 and len(out.splitlines()) == 2
    await wait_until(lambda: not live.coordinator.connections, what="both workers to leave")
    code, _, err = await rota("workers", "quiet", "--url", live.base)
    assert code == 1 and "name one worker" in err


async def test_goodbye_deregisters_at_once(live: Live, connect, tmp_path: Path):
    import websockets

    spec = write_spec(tmp_path, "work")
    await live.push(spec)
    raw = await connect("leaving")
    await raw.register([spec])
    await raw.beat(goodbye=True, status={"state": "terminate", "active_job_ids": []})
    assert (await raw.expect("ack"))["seq"] == 1
    with pytest.raises(websockets.ConnectionClosedOK) as closed:
        await raw.recv()
    assert closed.value.rcvd.code == 1000 and closed.value.rcvd.reason == "goodbye"
    assert (await live.http.get("/workers")).json()["workers"] == []


# -- signals to real worker processes ----------------------------------------------------------
@pytest.mark.parametrize("launch", LAUNCHES)
async def test_sigterm_lets_jobs_finish_then_deregisters(live: Live, procs, tmp_path: Path,
                                                         launch: str):
    await live.push(write_spec(tmp_path / "specs", "work"))
    proc, worker_id = await start_worker_process(live, tmp_path, launch=launch)
    procs.append(proc)
    jobs = [await live.enqueue("work", {"seconds": 0.3}) for _ in range(2)]
    for job in jobs:
        await live.wait_state(job["id"], "active")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    took = time.monotonic() - signalled
    for job in jobs:
        done = await live.job(job["id"])
        assert done["state"] == "completed" and done["attempt"] == 1
    assert (await live.http.get("/workers")).json()["workers"] == []  # deregistered, not timed out
    assert took < live.settings.heartbeat_timeout
    print(f"\n[shutdown] SIGTERM with two 0.3 s jobs running: both completed, exit 0 after"
          f" {took * 1000:.0f} ms")


@pytest.mark.parametrize("launch", LAUNCHES)
async def test_sigterm_past_the_grace_period_requeues_at_once(live: Live, procs, sdk_worker,
                                                               tmp_path: Path, launch: str):
    await live.push(write_spec(tmp_path / "specs", "work"))
    proc, _ = await start_worker_process(live, tmp_path, grace=0.3, launch=launch)
    procs.append(proc)
    long = await live.enqueue("work", {"seconds": 30})
    await live.wait_state(long["id"], "active")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    took = time.monotonic() - signalled
    back = await live.job(long["id"])
    assert back["state"] == "available" and back["attempt"] == 1
    assert [e["type"] for e in back["errors"]] == ["shutdown"] and back["fails"] == 0
    rescuer = Worker(specs_dir=tmp_path / "specs", heartbeat_interval=0.1)

    @rescuer.handler("work")
    async def quick(ctx: JobContext) -> str:  # the new release does it faster
        return "rescued"

    await sdk_worker(rescuer)
    done = await live.wait_state(long["id"], "completed")
    assert (done["attempt"], done["worker_id"], done["result"]) == (2, rescuer.worker_id,
                                                                    "rescued")
    print(f"\n[shutdown] SIGTERM with a 30 s job and a 0.3 s grace: exit 0 after"
          f" {took * 1000:.0f} ms, the job requeued at once and completed elsewhere")


@pytest.mark.parametrize("launch", LAUNCHES)
async def test_sigtstp_quiets_and_sigcont_resumes(live: Live, procs, tmp_path: Path,
                                                  launch: str):
    await live.push(write_spec(tmp_path / "specs", "work"))
    proc, worker_id = await start_worker_process(live, tmp_path, launch=launch)
    procs.append(proc)
    proc.send_signal(signal.SIGTSTP)

    async def is_quiet() -> bool:
        return await worker_state(live, worker_id) == "quiet"

    await wait_until(is_quiet, what="quiet after SIGTSTP")
    job = await live.enqueue("work")
    assert "quiet or terminating" in (await live.job(job["id"]))["waiting_reason"]
    proc.send_signal(signal.SIGCONT)
    done = await live.wait_state(job["id"], "completed")
    assert done["result"]["pid"] == proc.pid
    assert await worker_state(live, worker_id) == "running"


async def exits(proc: asyncio.subprocess.Process, tmp_path: Path, timeout: float) -> None:
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except TimeoutError:
        raise AssertionError((tmp_path / "worker.log").read_text()[-3000:]) from None


@pytest.mark.parametrize("launch", LAUNCHES)
async def test_ctrl_c_lets_the_running_job_finish_and_says_so(live: Live, procs, tmp_path: Path,
                                                              launch: str):
    """README, step 3: Ctrl-C does what SIGTERM does. It cancelled the running job before
    (it ran again later, on another worker)."""
    await live.push(write_spec(tmp_path / "specs", "work"))
    proc, _ = await start_worker_process(live, tmp_path, launch=launch)
    procs.append(proc)
    job = await live.enqueue("work", {"seconds": 1.0})
    await wait_until(lambda: (tmp_path / f"run-{job['id']}-1").exists(), timeout=15,
                     what="the run to start")
    proc.send_signal(signal.SIGINT)
    await exits(proc, tmp_path, 15)
    assert proc.returncode == 0
    done = await live.wait_state(job["id"], "completed")
    assert (done["attempt"], done["errors"]) == (1, [])
    assert not (tmp_path / f"run-{job['id']}-2").exists()
    said = (tmp_path / "worker.log").read_text()
    assert "Ctrl-C: finishing 1 running job(s) (grace 25s), taking no new ones; Ctrl-C again" \
        " to stop now" in said


async def test_a_second_ctrl_c_stops_at_once(live: Live, procs, tmp_path: Path):
    """(A script's worker.run(): `rota worker` runs the same, tested just above.)"""
    await live.push(write_spec(tmp_path / "specs", "work"))
    proc, _ = await start_worker_process(live, tmp_path, launch="script")  # grace 25 s
    procs.append(proc)
    long = await live.enqueue("work", {"seconds": 30})
    await wait_until(lambda: (tmp_path / f"run-{long['id']}-1").exists(), timeout=15,
                     what="the run to start")
    proc.send_signal(signal.SIGINT)
    await wait_until(lambda: "Ctrl-C again" in (tmp_path / "worker.log").read_text(),
                     timeout=10, what="the first Ctrl-C to be heard")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGINT)
    await exits(proc, tmp_path, 10)
    took = time.monotonic() - signalled
    assert took < 3
    back = await live.wait_state(long["id"], "available")
    assert [e["type"] for e in back["errors"]] == ["shutdown"]
    print(f"\n[shutdown] a second Ctrl-C with a 30 s job (grace 25 s): exit after"
          f" {took * 1000:.0f} ms, the job requeued")


STUBBORN = """
import asyncio, sys
from rota import Worker

worker = Worker(specs_dir="specs", heartbeat_interval=0.1)

@worker.handler("work")
async def work(ctx):
    open("started", "w").close()
    try:
        await asyncio.sleep(30)  # noqa: sleep-ok (the job's own work)
    except asyncio.CancelledError:
        await asyncio.sleep(30)  # noqa: sleep-ok (a handler that takes its time to stop)

worker.url = sys.argv[1]
asyncio.run(worker.run())
"""


async def test_a_third_ctrl_c_leaves_at_once_with_a_goodbye(live: Live, procs, tmp_path: Path):
    await live.push(write_spec(tmp_path / "specs", "work"))
    (tmp_path / "stubborn.py").write_text(STUBBORN)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "stubborn.py", live.ws, cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    procs.append(proc)
    job = await live.enqueue("work")
    await wait_until(lambda: (tmp_path / "started").exists(), timeout=15,
                     what="the handler to start")
    for _ in range(3):  # three presses, apart: the kernel merges a signal still pending
        proc.send_signal(signal.SIGINT)
        await asyncio.sleep(0.2)  # noqa: sleep-ok (a person's pace between key presses)
    await asyncio.wait_for(proc.wait(), 10)
    back = await live.wait_state(job["id"], "available")  # at once: no reconnect grace
    assert back["deaths"] == 0 and back["errors"][-1]["type"] == "worker_death"
    assert "goodbye" in back["errors"][-1]["message"]


EXITING = """
import asyncio, sys
from rota import Worker

worker = Worker(specs_dir="specs", concurrency=2, heartbeat_interval=0.1)

@worker.handler("leave")
async def leave(ctx):
    sys.exit(3)

@worker.handler("interrupt")
def interrupt(ctx):  # a stray KeyboardInterrupt in a thread
    raise KeyboardInterrupt

@worker.handler("work")
async def work(ctx):
    return "still here"

worker.url = sys.argv[1]
asyncio.run(worker.run())
"""


async def test_a_handler_cannot_stop_its_worker(live: Live, procs, tmp_path: Path):
    await live.push(*(write_spec(tmp_path / "specs", name)
                      for name in ("leave", "interrupt", "work")))
    (tmp_path / "exiting.py").write_text(EXITING)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "exiting.py", live.ws, cwd=tmp_path,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    procs.append(proc)
    for spec, raised in (("leave", "SystemExit"), ("interrupt", "KeyboardInterrupt")):
        job = await live.enqueue(spec)
        done = await live.wait_state(job["id"], "discarded", timeout=15)
        [error] = done["errors"]
        assert (done["attempt"], error["type"], error["retryable"]) == (1, raised, False)
        assert "cannot stop its worker" in error["message"]
    job = await live.enqueue("work")
    assert (await live.wait_state(job["id"], "completed"))["result"] == "still here"
    assert proc.returncode is None


# -- a rolling deploy ------------------------------------------------------------------------
async def test_rolling_deploy_loses_nothing_and_runs_nothing_twice(live: Live, sdk_worker,
                                                                   tmp_path: Path):
    old_specs, new_specs = tmp_path / "v1", tmp_path / "v2"
    write_spec(old_specs, "work", version="1")
    await live.push(write_spec(new_specs, "work", version="1"))
    runs: collections.Counter[str] = collections.Counter()

    def build(specs: Path, label: str) -> Worker:
        worker = Worker(specs_dir=specs, heartbeat_interval=0.1, labels=[label], concurrency=3)

        @worker.handler("work")
        async def work(ctx: JobContext) -> str:
            runs[ctx.id] += 1
            await asyncio.sleep(0.02)  # noqa: sleep-ok (the job's work)
            return label

        return worker

    old = [await sdk_worker(build(old_specs, "old")) for _ in range(2)]
    first = [await live.enqueue("work", {"n": n}) for n in range(20)]
    # The deploy: new code, new spec version, new workers; then retire the old ones.
    write_spec(new_specs, "work", version="2")
    from rota.base.specs import load_dir

    await live.push(*load_dir(new_specs))
    new = await sdk_worker(build(new_specs, "new"))
    second = [await live.enqueue("work", {"n": n}) for n in range(20, 40)]
    reply = await live.http.post("/workers/state", json={"state": "quiet", "label": "old"})
    assert sorted(reply.json()["workers"]) == sorted(w.worker_id for w in old)
    await live.http.post("/workers/state", json={"state": "terminate", "label": "old"})
    await wait_until(lambda: set(live.coordinator.connections) == {new.worker_id},
                     what="the old workers to leave")
    for job in first + second:
        done = await live.wait_state(job["id"], "completed")
        # (one waiting in an old worker's line may be taken back for the idle new one: a
        # released attempt, which uses none)
        assert done["attempts_used"] == 1, done
        assert {e["type"] for e in done["errors"]} <= {"released"}, done
    assert all(runs[job["id"]] == 1 for job in first + second)
    for job in second:  # enqueued after the push: only the new version may run them
        assert (await live.job(job["id"]))["result"] == "new"


async def test_workers_report_cpu_and_memory(live: Live, sdk_worker, tmp_path: Path):
    await live.push(write_spec(tmp_path, "work"))
    worker = await sdk_worker(sdk(tmp_path))

    async def figures() -> dict | None:
        [shown] = (await live.http.get("/workers")).json()["workers"]
        return shown if shown["memory_rss"] else None

    shown = await wait_until(figures, what="CPU and memory figures")
    assert shown["id"] == worker.worker_id and shown["cpu_percent"] >= 0
    assert shown["memory_rss"] > 10 * 2**20  # a Python process is well over 10 MiB
    code, out, _ = await rota("workers", "list", "--url", live.base)
    assert code == 0 and "rss=" in out and "MiB" in out
