"""What a worker tells the person running it: a line for each job (examples/manual.py
shows them), a failure's traceback that starts at the handler, and where it looked for
its specs when they are not there."""

from __future__ import annotations

import asyncio
import shutil
import signal
import sys
from pathlib import Path

import pytest
from conftest import Live, write_spec
from helpers import clean_env, reap, rota, wait_until

from rota import JobContext, Worker
from rota.base.specs import SpecError, load_dir

ROOT = Path(__file__).resolve().parents[2]


async def test_the_manual_example_logs_a_line_for_each_job(live: Live, tmp_path: Path):
    """examples/manual.py's comment says its log shows each job: it showed none that
    succeeded. Ctrl-C then lets it finish and exit 0."""
    for folder in ("specs", "examples"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    await live.push(*load_dir(tmp_path / "specs"))
    log = tmp_path / "manual.log"
    with open(log, "w") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "examples/manual.py", cwd=tmp_path,
            env={**clean_env(), "ROTA_URL": live.base}, stdout=asyncio.subprocess.DEVNULL,
            stderr=err)
    try:
        job = await live.enqueue("resize_image", {"url": "https://example.com/a.png",
                                                  "width": 64})
        await live.wait_state(job["id"], "completed", timeout=15)
        line = f"job ended job={job['id']} spec=resize_image queue=media attempt=1" \
            " outcome=completed duration_ms="
        await wait_until(lambda: line in log.read_text(), timeout=10, what="the job's line")
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        await reap(proc)


async def test_a_failures_traceback_starts_at_the_handler(live: Live, sdk_worker,
                                                          tmp_path: Path):
    """It started with the SDK's own frames: three of them for a plain function."""
    await live.push(write_spec(tmp_path, "plain"), write_spec(tmp_path, "coro"))
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)

    @worker.handler("plain")
    def plain(ctx: JobContext) -> None:
        raise ValueError("no such image")

    @worker.handler("coro")
    async def coro(ctx: JobContext) -> None:
        raise ValueError("no such image")

    await sdk_worker(worker)
    for spec in ("plain", "coro"):
        job = await live.enqueue(spec, max_attempts=1)
        [error] = (await live.wait_state(job["id"], "discarded"))["errors"]
        first_frame = error["details"]["traceback"].splitlines()[1]
        assert first_frame.startswith(f'  File "{__file__}"') and first_frame.endswith(spec), \
            error["details"]["traceback"]


async def test_a_worker_started_in_another_folder_says_where_it_looked(tmp_path: Path,
                                                                     monkeypatch):
    """It said only "specs: not a directory"."""
    (tmp_path / "app.py").write_text(
        "from rota import Worker\nworker = Worker()\nworker.handler('echo')(print)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code, _, err = await rota("worker", "app:worker", cwd=elsewhere,
                              env={"PYTHONPATH": str(tmp_path), "ROTA_SPECS_DIR": ""})
    assert (code, err) == (1, f"error: specs: not a directory: the worker looked for"
                              f" {elsewhere / 'specs'} (a relative path is taken from the current"
                              " folder); run it from the folder that holds specs, or point it"
                              " elsewhere with --specs-dir or ROTA_SPECS_DIR\n")
    monkeypatch.chdir(elsewhere)  # a script of one's own: the advice is the SDK's
    worker = Worker()
    worker.handler("echo")(print)
    with pytest.raises(SpecError, match=r"looked for .*elsewhere/specs .* or give"
                       r" Worker\(specs_dir=...\) a full path$"):
        await worker.run()
