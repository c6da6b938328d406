"""The ``rota`` command in real subprocesses: specs push during a deploy, enqueue, inspect,
``rota serve`` configured by ROTA_* variables, and ``rota worker`` stopping on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest
from conftest import Live, write_spec
from helpers import RawWorker, reap, rota, wait_until

from click.testing import CliRunner

from rota.cli.app import main
from rota.base.specs import checksum


async def test_specs_push_dry_run_then_push_then_change(live: Live, connect, tmp_path: Path):
    specs = tmp_path / "specs"
    echo_v1 = write_spec(specs, "echo", version="1")
    write_spec(specs, "resize", queue="media")
    assert await rota("specs", "list", "--url", live.base) == (  # none yet: said, not silence
        0, "", "no specs registered; push some with `rota specs push DIR`\n")
    code, out, _ = await rota("specs", "push", str(specs), "--dry-run", "--url", live.base)
    assert code == 0
    assert out.splitlines()[0].startswith("new       echo")
    assert "dry run: nothing was changed" in out
    assert (await live.http.get("/specs")).json()["specs"] == []

    code, out, _ = await rota("specs", "push", str(specs), env={"ROTA_URL": live.base})
    assert code == 0 and out.count("new ") == 2
    # The checksums line up under the widest name ("echo" was two columns short of it).
    assert {line.index("sha256:") for line in out.splitlines()} == {len("new       resize  ")}
    old_worker = await connect("old")
    await old_worker.register([echo_v1])

    write_spec(specs, "echo", version="2")
    code, out, _ = await rota("specs", "push", str(specs), "--url", live.base)
    assert code == 0
    lines = {line.split()[1]: line for line in out.splitlines()}
    assert lines["echo"].startswith("changed")
    assert "1 connected worker(s) no longer match" in lines["echo"]
    assert lines["resize"].startswith("unchanged")

    code, out, _ = await rota("specs", "list", "--url", live.base)
    assert code == 0 and "echo" in out and "resize" in out and "queue=media" in out
    assert out.splitlines()[0].startswith("echo    2 ")
    code, out, _ = await rota("specs", "history", "echo", "--url", live.base)
    assert code == 0
    versions = [line.split()[1] for line in out.splitlines()]
    assert versions == ["1", "2"]


async def test_enqueue_and_jobs_show(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    code, out, _ = await rota("enqueue", "echo", "--args", '{"message": "hi"}', "--id", "job-1",
                              "--priority", "3", "--url", live.base)
    assert code == 0
    job = json.loads(out)
    assert (job["id"], job["priority"], job["args"]) == ("job-1", 3, {"message": "hi"})
    code, out, err = await rota("enqueue", "echo", "--args", '{"message": "hi"}', "--id", "job-1",
                                "--priority", "3", "--url", live.base)
    assert code == 0 and "exists already" in err and json.loads(out)["id"] == "job-1"
    code, out, _ = await rota("jobs", "show", "job-1", "--url", live.base)
    shown = json.loads(out)
    assert shown["state"] == "available"
    assert shown["waiting_reason"] == "no connected worker serves queue 'default'"


@pytest.mark.parametrize(("args", "message"), [
    (["enqueue", "nope"], "has no status quo"),
    (["enqueue", "echo", "--args", "{oops"], "--args is not valid JSON"),
    (["enqueue", "echo", "--args", "[1]"], "must be a JSON object"),
    (["jobs", "show", "missing"], "no job missing"),
])
async def test_cli_errors_are_clear(live: Live, tmp_path: Path, args: list[str], message: str):
    await live.push(write_spec(tmp_path, "echo"))
    code, _, err = await rota(*args, "--url", live.base)
    assert code == 1 and message in err


async def test_unreachable_server_is_a_clear_error(tmp_path: Path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    code, _, err = await rota("specs", "list", "--url", f"http://127.0.0.1:{port}")
    assert code == 1 and "cannot reach Rota" in err


def test_every_command_has_help():
    runner = CliRunner()
    commands = [[], ["serve"], ["worker"], ["specs"], ["specs", "push"], ["specs", "list"],
                ["specs", "history"], ["specs", "checksum"], ["enqueue"], ["jobs"],
                ["jobs", "show"], ["jobs", "cancel"], ["jobs", "retry"], ["jobs", "list"],
                ["queues"], ["queues", "pause"], ["queues", "resume"], ["workers", "resume"],
                ["watch"], ["tail"], ["run"], ["demo"], ["limits"], ["limits", "set"],
                ["limits", "clear"]]
    for command in commands:
        result = runner.invoke(main, [*command, "--help"])
        assert result.exit_code == 0 and len(result.output.splitlines()) > 3, command
    out = runner.invoke(main, ["serve", "--help"]).output
    for var in ("ROTA_HOST", "ROTA_PORT", "ROTA_DB", "ROTA_LOG_LEVEL", "ROTA_HEARTBEAT_INTERVAL",
                "ROTA_HEARTBEAT_TIMEOUT", "ROTA_VISIBILITY_TIMEOUT"):
        assert var in out, var


async def test_serve_reads_rota_variables_and_stops_on_sigterm(tmp_path: Path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "ROTA_PORT": str(port), "ROTA_DB": str(tmp_path / "env.db"),
           "ROTA_HEARTBEAT_TIMEOUT": "7.5", "ROTA_HEARTBEAT_INTERVAL": "0.5",
           "ROTA_LOG_LEVEL": "warning", "ROTA_MAX_DB_SIZE": "4096"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "rota", "serve", env=env,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            async def healthy() -> bool:
                try:
                    return (await http.get("/healthz")).status_code == 200
                except httpx.TransportError:
                    return False

            await wait_until(healthy, timeout=15, what="rota serve to answer")
            pushed = await http.put("/specs", json={"specs": [{"name": "echo", "version": "1"}]})
            assert pushed.status_code == 200, pushed.text
            refused = await http.post("/jobs", json={"spec": "echo"})  # the file is past 4096
            assert refused.json()["error"]["code"] == "storage_full", refused.text
        worker = await RawWorker.open(f"ws://127.0.0.1:{port}/work", "env-check")
        welcome = await worker.register([])
        assert (welcome["heartbeat_timeout"], welcome["heartbeat_interval"]) == (7.5, 0.5)
        await worker.ws.close()
        assert (tmp_path / "env.db").exists()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


WORKER_MODULE = """
import asyncio
from rota import Worker

worker = Worker(specs_dir="specs", concurrency=2)

@worker.handler("echo")
async def echo(ctx):
    await asyncio.sleep(ctx.args.get("work_seconds", 0))  # noqa: sleep-ok (the job's own work)
    return {"echoed": ctx.args}
"""


async def test_rota_worker_runs_jobs_and_finishes_them_on_sigterm(live: Live, tmp_path: Path):
    echo = write_spec(tmp_path / "specs", "echo")
    await live.push(echo)
    (tmp_path / "demo_worker.py").write_text(WORKER_MODULE)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "worker", "demo_worker:worker", "--url", live.base,
        "--prefetch", "3", cwd=tmp_path, stderr=asyncio.subprocess.PIPE)
    try:
        quick = await live.enqueue("echo", {"n": 1})
        assert (await live.wait_state(quick["id"], "completed", timeout=15))["result"] == {
            "echoed": {"n": 1}}
        [shown] = (await live.http.get("/workers")).json()["workers"]
        assert (shown["concurrency"], shown["prefetch"]) == (2, 3)  # --prefetch wins
        slow = await live.enqueue("echo", {"work_seconds": 0.5})
        await live.wait_state(slow["id"], "active")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        done = await live.job(slow["id"])
        assert done["state"] == "completed" and done["attempt"] == 1
        assert done["checksum"] == checksum(echo)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_rota_worker_takes_its_settings_from_the_environment(live: Live, tmp_path: Path):
    """A deploy labels and sizes its workers without editing their code."""
    echo = write_spec(tmp_path / "elsewhere", "echo", queue="mail")
    await live.push(echo)
    (tmp_path / "demo_worker.py").write_text(WORKER_MODULE)
    env = {**os.environ, "ROTA_URL": live.base, "ROTA_CONCURRENCY": "3", "ROTA_QUEUES": "mail",
           "ROTA_LABELS": "blue canary", "ROTA_SPECS_DIR": str(tmp_path / "elsewhere")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "worker", "demo_worker:worker", "--label", "eu",
        cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE)
    try:
        job = await live.enqueue("echo", {"n": 1})
        await live.wait_state(job["id"], "completed", timeout=15)
        [shown] = (await live.http.get("/workers")).json()["workers"]
        assert (shown["concurrency"], shown["queues"]) == (3, ["mail"])
        assert shown["labels"] == ["eu"]  # the flag wins over ROTA_LABELS, as click does
        assert shown["prefetch"] == 96  # the default follows the new concurrency
        code, _, err = await rota("workers", "quiet", "--label", "typo", "--url", live.base)
        assert code == 1 and "no connected worker with label 'typo'" in err
        code, out, _ = await rota("workers", "quiet", "--label", "eu", "--url", live.base)
        assert code == 0 and out.strip().endswith(": quiet")
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


LOOP_WORKER = """
import asyncio
from rota import Worker

worker = Worker(specs_dir="specs", concurrency=1)

@worker.handler("echo")
async def echo(ctx):
    return type(asyncio.get_running_loop()).__module__.split(".")[0]
"""


def no_uvloop(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import uvloop`` fails (Windows, or Rota without it)."""
    (tmp_path / "shadow").mkdir(exist_ok=True)
    (tmp_path / "shadow" / "uvloop.py").write_text("raise ImportError('no uvloop here')\n")
    return {"PYTHONPATH": str(tmp_path / "shadow")}


@pytest.mark.parametrize(("flags", "shadowed", "loop"), [
    ([], False, "uvloop"), (["--loop", "asyncio"], False, "asyncio"), ([], True, "asyncio")],
    ids=["auto", "asyncio", "auto-without-uvloop"])
async def test_rota_worker_runs_the_handlers_on_the_loop_it_is_given(
        live: Live, tmp_path: Path, flags: list[str], shadowed: bool, loop: str):
    await live.push(write_spec(tmp_path / "specs", "echo"))
    (tmp_path / "loop_worker.py").write_text(LOOP_WORKER)
    env = {**os.environ, **(no_uvloop(tmp_path) if shadowed else {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "worker", "loop_worker:worker", "--url", live.base,
        *flags, cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE)
    try:
        job = await live.enqueue("echo", {})
        assert (await live.wait_state(job["id"], "completed", timeout=15))["result"] == loop
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        await reap(proc)


async def test_rota_worker_refuses_a_loop_it_cannot_run_in_one_line(tmp_path: Path):
    (tmp_path / "loop_worker.py").write_text(LOOP_WORKER)
    code, _, err = await rota("worker", "loop_worker:worker", "--loop", "uvloop",
                              cwd=tmp_path, env=no_uvloop(tmp_path))
    assert code == 1 and "uvloop is not installed" in err and "--loop asyncio" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, _, err = await rota("worker", "loop_worker:worker", "--loop", "trio", cwd=tmp_path)
    assert code == 2 and "'trio' is not one of 'auto', 'asyncio', 'uvloop'" in err


async def test_rota_worker_rejects_a_bad_target(tmp_path: Path):
    code, _, err = await rota("worker", "no_such_module:worker", cwd=tmp_path)
    assert code == 1 and "cannot load" in err
    code, _, err = await rota("worker", "json:dumps", cwd=tmp_path)
    assert code == 1 and "not a rota.Worker" in err


async def test_run_waits_for_the_result(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    worker = await connect()
    await worker.register([echo])
    run = asyncio.create_task(rota("run", "echo", "--args", '{"n": 7}', "--id", "r1",
                                   "--wait", "20", "--url", live.base))
    [copy] = await worker.jobs(1, timeout=15)
    await worker.complete(copy, result={"seven": 7})
    code, out, _ = await run
    assert code == 0 and json.loads(out)["result"] == {"seven": 7}
    code, out, err = await rota("run", "echo", "--wait", "0.2", "--url", live.base,
                                "--queue", "nobody-serves-this")
    assert code == 2 and "has not finished" in err


async def test_jobs_cancel_and_retry(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    await live.enqueue("echo", id="c1")
    code, out, _ = await rota("jobs", "cancel", "c1", "--url", live.base)
    assert code == 0 and out.strip() == "cancelled c1"
    code, _, err = await rota("jobs", "cancel", "c1", "--url", live.base)
    assert code == 1 and "is cancelled" in err
    code, out, _ = await rota("jobs", "retry", "c1", "--url", live.base)
    assert code == 0 and "c1 is available again" in out
    code, _, err = await rota("jobs", "retry", "c1", "--url", live.base)  # twice (issue 22)
    assert (code, err) == (1, "error: job c1 is available already, waiting to run; only"
                              " discarded or cancelled jobs can be retried (not_retryable)\n")
    assert (await live.job("c1"))["state"] == "available"


async def test_rota_demo_runs_jobs_and_stops_on_ctrl_c(tmp_path: Path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # From an empty directory, with no --specs: the demo's specs ship inside the package.
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "demo", "--port", str(port), "--rate", "50",
        cwd=tmp_path, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            async def some_completed() -> bool:
                try:
                    queues = (await http.get("/queues")).json()["queues"]
                except httpx.HTTPError:
                    return False
                return sum(q["counts"].get("completed", 0) for q in queues) >= 5

            await wait_until(some_completed, timeout=20, what="demo jobs to complete")
        proc.send_signal(signal.SIGINT)  # one Ctrl-C stops producer, worker and server
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
