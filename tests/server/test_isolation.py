"""Handlers isolated in child processes (``isolation="process"``, rota/worker/isolation.py)
beside the same handlers on threads: what flows back (result, progress, captured lines,
logging, failures with their traceback, heartbeats), and what only a process gives: a
cancel, a lapsed lease or a shutdown stops the work for real, and a child killed by the
OS fails its job, not the worker. The handlers are in tests/isolated.py, where a child
can import them."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import isolated
import pytest
from conftest import Live, write_spec
from helpers import wait_until

from rota import JobContext, Worker
from rota.base.specs import SpecError
from rota.worker.execution import THREAD_GRACE

SPECS = ("report", "boom", "leave", "grind", "charge", "stubborn", "crash", "polite")


def fleet(tmp_path: Path, isolation: str, **options: object) -> Worker:
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1, isolation=isolation,
                    **options)  # type: ignore[arg-type]
    for name in SPECS:
        worker.handler(name)(getattr(isolated, name))
    worker.runner.children.grace = 0.3  # SIGTERM, then SIGKILL this soon
    return worker


async def push(live: Live, tmp_path: Path) -> None:
    await live.push(*(write_spec(tmp_path, name, extra="[retry]\nmax_attempts = 1\n")
                      for name in SPECS))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def started(path: Path) -> int:
    await wait_until(lambda: path.exists() and path.read_text(), timeout=10,
                     what="the handler to start")
    return int(path.read_text())


@pytest.mark.parametrize("isolation", ["thread", "process"])
async def test_results_status_logs_and_failures_flow_back_from_either(
        live: Live, sdk_worker, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        isolation: str):
    await push(live, tmp_path)
    caplog.set_level(logging.INFO)
    await sdk_worker(fleet(tmp_path, isolation))
    reported = await live.enqueue("report", {"n": 1}, capture_logs=True)
    failed = await live.enqueue("boom", {"n": 2})
    left = await live.enqueue("leave")
    ground = await live.enqueue("grind", visibility_timeout=0.3)

    done = await live.wait_state(reported["id"], "completed", timeout=10)
    assert done["result"]["args"] == {"n": 1}
    assert (done["result"]["pid"] != os.getpid()) is (isolation == "process")
    assert (done["progress"]["percent"], done["progress"]["message"]) == (50, "half way")
    assert sorted((line["kind"], line["level"], line["message"]) for line in done["logs"]) == [
        ("alert", "error", "disk almost full"), ("log", "warning", "working")]
    assert f"logged with logging by job {reported['id']}" in caplog.text
    assert f"job={reported['id']} working" in caplog.text  # the worker's own line for ctx.log

    [error] = (await live.wait_state(failed["id"], "discarded"))["errors"]
    assert (error["type"], error["message"]) == ("ValueError", "no luck 2")
    trace = error["details"]["traceback"]
    assert "in boom" in trace and 'raise ValueError(f"no luck' in trace, trace
    assert trace.rstrip().endswith("ValueError: no luck 2")
    [error] = (await live.wait_state(left["id"], "discarded"))["errors"]
    assert error["type"] == "SystemExit" and error["retryable"] is False
    assert error["message"].startswith("the handler raised SystemExit(3)")

    done = await live.wait_state(ground["id"], "completed", timeout=10)  # kept by heartbeats
    assert done["result"] == 6 and done["errors"] == []


async def test_a_cancelled_process_job_is_stopped_before_its_side_effect(
        live: Live, sdk_worker, tmp_path: Path):
    await push(live, tmp_path)
    worker = await sdk_worker(fleet(tmp_path, "process"))
    args = {"pid": str(tmp_path / "pid"), "effect": str(tmp_path / "charged"), "wait": 1.5}
    job = await live.enqueue("charge", args)
    pid = await started(tmp_path / "pid")
    response = await live.http.delete(f"/jobs/{job['id']}")
    assert response.status_code == 202
    cancelled = await live.wait_state(job["id"], "cancelled")
    assert cancelled["errors"][-1]["type"] == "cancelled"
    assert gone(pid)  # reported only once its child was gone
    assert not (tmp_path / "charged").exists()
    assert not worker.runner.abandoned and not worker.runner.children.live
    again = await live.enqueue("report", {"n": 3})  # a new child runs the next job
    done = await live.wait_state(again["id"], "completed", timeout=10)
    assert done["result"]["pid"] != pid


async def test_a_sigterm_from_outside_leaves_a_child_to_its_worker(live: Live, sdk_worker,
                                                                   tmp_path: Path):
    """systemd's default KillMode sends SIGTERM to every process of the service: the
    worker decides (it lets running jobs finish within its grace period)."""
    await push(live, tmp_path)
    await sdk_worker(fleet(tmp_path, "process"))
    args = {"pid": str(tmp_path / "pid"), "effect": str(tmp_path / "charged"), "wait": 0.5}
    job = await live.enqueue("charge", args)
    os.kill(await started(tmp_path / "pid"), signal.SIGTERM)
    assert (await live.wait_state(job["id"], "completed", timeout=10))["result"] == "charged"


async def test_a_lapsed_lease_kills_a_child_that_ignores_sigterm(
        live: Live, sdk_worker, tmp_path: Path):
    await push(live, tmp_path)
    # One abandoned thread would make this worker drain and exit: a child is never one.
    worker = await sdk_worker(fleet(tmp_path, "process", max_abandoned_threads=1))
    job = await live.enqueue("stubborn", {"pid": str(tmp_path / "pid")}, visibility_timeout=0.4)
    pid = await started(tmp_path / "pid")
    given_up = await live.wait_state(job["id"], "discarded", timeout=10)
    assert [e["type"] for e in given_up["errors"]] == ["visibility_timeout"]
    # The server gives the job up when its lease lapses; the worker's SIGKILL comes after
    # its grace, on its own clock: waited for, not assumed done by then.
    await wait_until(lambda: gone(pid), timeout=10, what="the child killed after its grace")
    assert not worker.runner.abandoned and worker.exit_code == 0 and not worker.stopping


async def test_a_child_killed_by_the_os_fails_its_job_and_the_worker_goes_on(
        live: Live, sdk_worker, tmp_path: Path):
    await push(live, tmp_path)
    await sdk_worker(fleet(tmp_path, "process"))
    job = await live.enqueue("crash", max_attempts=2)
    discarded = await live.wait_state(job["id"], "discarded", timeout=10)
    assert [e["type"] for e in discarded["errors"]] == ["child_died", "child_died"]
    assert "was killed by SIGKILL" in discarded["errors"][0]["message"]
    after = await live.enqueue("report", {"n": 4})
    assert (await live.wait_state(after["id"], "completed", timeout=10))["result"]["args"] == {
        "n": 4}


async def test_a_shutdown_past_its_grace_stops_a_process_job(live: Live, sdk_worker,
                                                             tmp_path: Path):
    await push(live, tmp_path)
    worker = await sdk_worker(fleet(tmp_path, "process", grace_period=0.2))
    args = {"pid": str(tmp_path / "pid"), "effect": str(tmp_path / "charged"), "wait": 5}
    job = await live.enqueue("charge", args)
    pid = await started(tmp_path / "pid")
    worker.terminate()
    async def stopped() -> dict | None:
        view = await live.job(job["id"])
        return view if view["errors"] else None

    view = await wait_until(stopped, timeout=10, what="the job to be stopped")
    assert view["errors"][-1]["type"] == "shutdown"
    assert gone(pid) and not (tmp_path / "charged").exists()


async def test_a_plain_function_sees_ctx_cancelled_and_stops(live: Live, sdk_worker,
                                                            tmp_path: Path):
    await push(live, tmp_path)
    worker = await sdk_worker(fleet(tmp_path, "thread"))
    args = {"pid": str(tmp_path / "pid"), "effect": str(tmp_path / "effect")}
    job = await live.enqueue("polite", args)
    await started(tmp_path / "pid")
    assert (await live.http.delete(f"/jobs/{job['id']}")).status_code == 202
    await live.wait_state(job["id"], "cancelled")
    given_up = time.monotonic()
    effect = tmp_path / "effect"
    # (the handler makes the file, then writes it: its text is what is waited for)
    await wait_until(lambda: effect.exists() and effect.read_text(), timeout=10,
                     what="the handler to end")
    assert effect.read_text() == "stopped"
    # It did what the abandoned-thread warning advises: past the grace, no thread of it
    # is counted as abandoned and no alert says so (the trial saw both).
    await wait_until(lambda: time.monotonic() > given_up + THREAD_GRACE + 0.2,
                     what="the grace to pass")
    assert not worker.runner.abandoned
    [shown] = [w for w in (await live.http.get("/workers")).json()["workers"]
               if w["id"] == worker.worker_id]
    assert not [a for a in shown["alerts"] if "abandoned" in a["message"]], shown["alerts"]


def own_handler(ctx: JobContext) -> None:
    """Registered, then replaced under its name: a child would import the other one."""


def test_a_handler_a_child_cannot_import_is_refused_when_registered_or_at_start(
        tmp_path: Path):
    worker = Worker(specs_dir=tmp_path, isolation="process")
    with pytest.raises(SpecError, match=r"spec 'l' cannot run in a child process: test_\w+"
                       r"\.<locals>\.<lambda> is a lambda; .* defined at the top level of a module"):
        worker.handler("l")(lambda ctx: None)

    def inner(ctx: JobContext) -> None: ...

    with pytest.raises(SpecError, match="inner is defined inside a function"):
        worker.handler("c")(inner)
    worker.handler("t", isolation="thread")(inner)  # on a thread, anything goes
    worker.handler("own")(own_handler)
    worker.runner.children.check()
    globals()["own_handler"] = inner
    try:
        with pytest.raises(SpecError, match="spec 'own' cannot run in a child process: Can't"
                           " pickle"):
            worker.runner.children.check()
    finally:
        globals()["own_handler"] = worker.handlers["own"]
    with pytest.raises(ValueError, match="isolation must be 'thread' or 'process', not 'fork'"):
        Worker(specs_dir=tmp_path, isolation="fork")
    worker.listen("by_hand")  # manual mode: its jobs go to the caller, in the worker
    assert "by_hand" in worker.handlers and "by_hand" not in worker.runner.children
    worker.runner.children.check()


async def test_a_slow_child_start_does_not_spend_the_jobs_lease(live: Live, sdk_worker,
                                                               tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    await push(live, tmp_path)
    worker = fleet(tmp_path, "process")
    start = worker.runner.children._start

    async def slow_start():  # a fork server's first start on a loaded machine
        await asyncio.sleep(0.8)  # noqa: sleep-ok (the slow start under test)
        return await start()

    monkeypatch.setattr(worker.runner.children, "_start", slow_start)
    await sdk_worker(worker)
    job = await live.enqueue("report", {"n": 5}, visibility_timeout=0.3)
    done = await live.wait_state(job["id"], "completed", timeout=10)
    assert done["errors"] == [] and done["attempt"] == 1
