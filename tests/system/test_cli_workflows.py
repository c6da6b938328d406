"""``rota workflows`` against a real server: create from a JSON file, the list, a tree
drawn with each step's state and job id, cancel, retry; and each mistake as one line
on stderr with exit 1 (a file that is not JSON, an unknown workflow, a retry of a
workflow that has not failed, a definition the server refuses)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

from conftest import Live, write_spec
from helpers import rota, wait_until

from rota import JobContext, Worker


async def test_create_list_show_cancel_and_the_mistakes(
        live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]], tmp_path: Path):
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "echo"), write_spec(specs, "hold"),
                    write_spec(specs, "boom", extra="[retry]\nmax_attempts = 1\n"))
    worker = Worker(specs_dir=specs, heartbeat_interval=0.2)
    held = asyncio.Event()

    @worker.handler("echo")
    async def echo(ctx: JobContext) -> dict[str, object]:
        return {"said": ctx.args["message"], "after": ctx.parent_results}

    @worker.handler("boom")
    async def boom(ctx: JobContext) -> None:
        raise ValueError("the widget melted")

    @worker.handler("hold")
    async def hold(ctx: JobContext) -> None:
        held.set()
        await asyncio.sleep(60)  # noqa: sleep-ok (the job holds on until cancelled)

    await sdk_worker(worker)
    url = ["--url", live.base]
    flow = tmp_path / "flow.json"
    flow.write_text(json.dumps({"type": "chain", "name": "hello", "id": "hello-1", "steps": [
        {"spec": "echo", "args": {"message": "a"}},
        {"type": "batch", "jobs": [{"spec": "echo", "args": {"message": "b"}}],
         "callbacks": {"on_success": {"spec": "echo", "args": {"message": "ok"}},
                       "on_failure": {"spec": "echo", "args": {"message": "no"}}}}]}))
    code, out, err = await rota("workflows", "create", str(flow), *url)
    assert (code, err) == (0, "")
    # (its worker may have run a step or two already)
    assert re.match(r"workflow hello-1 hello \(chain\): \w+, \d/4 jobs completed, created ", out)

    async def finished() -> bool:
        shown = await live.http.get("/workflows/hello-1")
        return shown.json()["state"] == "completed"

    await wait_until(finished, timeout=15, what="the workflow to complete")
    code, out, err = await rota("workflows", "show", "hello-1", *url)
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(
        "workflow hello-1 hello (chain): completed, 3/4 jobs completed, created")
    view = (await live.http.get("/workflows/hello-1")).json()
    ids = [view["root"]["children"][0]["job_id"]] + [
        c["job_id"] for c in view["root"]["children"][1]["children"]]
    assert lines[1:] == [
        "chain  completed",
        f"├── echo  completed  job {ids[0]}",
        "└── batch  completed",
        f"    ├── echo  completed  job {ids[1]}",
        f"    ├── on_success: echo  completed  job {ids[2]}",
        f"    └── on_failure: echo  skipped  job {ids[3]}"]
    code, again, err = await rota("workflows", "create", str(flow), *url)  # the same id
    assert (code, err) == (0, "a workflow with this id exists already (the same definition):\n")

    stuck = tmp_path / "stuck.json"
    stuck.write_text(json.dumps({"type": "group", "name": "stuck", "jobs": [{"spec": "hold"}]}))
    code, out, _ = await rota("workflows", "create", str(stuck), *url)
    stuck_id = out.split()[1]
    await wait_until(held.is_set, timeout=10, what="hold to start")
    code, out, err = await rota("workflows", "cancel", stuck_id, *url)
    assert code == 0 and f"workflow {stuck_id} stuck (group): cancelled" in out

    code, out, err = await rota("workflows", *url)
    rows = out.splitlines()
    assert code == 0 and rows[0].split() == ["ID", "NAME", "TYPE", "STATE", "COMPLETED", "FAILED",
                                               "CREATED"]
    assert rows[1].split()[:4] == [stuck_id, "stuck", "group", "cancelled"]
    assert rows[2].split()[:6] == ["hello-1", "hello", "chain", "completed", "3/4", "0"]
    code, out, _ = await rota("workflows", "--limit", "1", *url)
    assert out.splitlines()[1:] == [rows[1], "(more: --limit 2 shows more)"]
    code, out, _ = await rota("workflows", "--state", "completed", "--json", *url)
    assert [w["id"] for w in json.loads(out)["workflows"]] == ["hello-1"]

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"type": "group", "id": "broken", "jobs": [{"spec": "boom"}]}))
    await rota("workflows", "create", str(broken), *url)

    async def failed() -> bool:
        return (await live.http.get("/workflows/broken")).json()["state"] == "failed"

    await wait_until(failed, timeout=15, what="the group to fail")
    code, out, _ = await rota("workflows", "show", "broken", *url)
    [boom_job] = [line.split()[-1] for line in out.splitlines() if "boom" in line]
    assert out.splitlines()[:2] == [
        out.splitlines()[0], f"  failed: job {boom_job} (attempt 1): ValueError: the widget melted"]
    assert out.splitlines()[0].startswith("workflow broken (group): failed, 0/1 jobs completed,"
                                          " 1 failed, created ")
    code, out, err = await rota("workflows", "retry", "broken", *url)  # runs again (and fails)
    assert (code, err) == (0, "")
    assert re.match(r"workflow broken \(group\): (running|failed), 0/1 jobs", out)

    (tmp_path / "bad.json").write_text('{"type": "chain", "steps": [}')
    mistakes = {
        ("create", str(tmp_path / "bad.json")): f"error: {tmp_path / 'bad.json'} is not JSON:",
        ("create", str(tmp_path / "none.json")): f"error: cannot read {tmp_path / 'none.json'}:",
        ("show", "nope"): "error: no workflow nope (not_found)",
        ("retry", "hello-1"): "error: ",
    }
    for args, said in mistakes.items():
        code, out, err = await rota("workflows", *args, *url)
        assert (code, out) == (1, ""), args
        assert err.startswith(said) and err.count("\n") == 1, (args, err)
    empty = tmp_path / "empty.json"
    empty.write_text('{"type": "group", "jobs": []}')
    code, out, err = await rota("workflows", "create", str(empty), *url)
    assert code == 1 and "jobs is empty" in err and "(empty_workflow)" in err
