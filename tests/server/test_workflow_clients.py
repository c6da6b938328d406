"""Workflows through the producer clients, against a real server and a real SDK worker:
a chain passes each step the results before it and returns its last; a group and a
batch return ``{"0": ...}`` and fire the callback the matrix says; a failed step fails
the workflow (``WorkflowError``) and a retry resumes it; a cancel stops a running step;
a bad step is refused naming its path; the same id again is the same workflow."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import make_tokens, wait_until

from rota import (ApiError, AsyncClient, Client, JobContext, Worker, WorkflowError, batch,
                  chain, group, step)


class Handlers:
    """``add`` returns its ``n`` plus every number its parents passed; ``flaky`` fails
    until ``mended``; ``hold`` runs until released (or cancelled)."""

    def __init__(self) -> None:
        self.mended = False
        self.held: asyncio.Event = asyncio.Event()
        self.seen: list[dict[str, Any]] = []

    async def start(self, live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]],
                    directory: Path, token: str | None = None) -> None:
        once = "[retry]\nmax_attempts = 1\n"
        await live.push(write_spec(directory, "add"), write_spec(directory, "flaky", extra=once),
                        write_spec(directory, "hold"))
        worker = Worker(specs_dir=directory, heartbeat_interval=0.2, concurrency=4, token=token)

        @worker.handler("add")
        async def add(ctx: JobContext) -> int:
            self.seen.append(dict(ctx.parent_results))
            passed = [v for v in ctx.parent_results.values() if isinstance(v, int)]
            return int(ctx.args["n"]) + sum(passed)

        @worker.handler("flaky")
        async def flaky(ctx: JobContext) -> int:
            if not self.mended:
                raise ValueError("not yet")
            return 1000

        @worker.handler("hold")
        async def hold(ctx: JobContext) -> str:
            self.held.set()
            await asyncio.sleep(60)  # noqa: sleep-ok (the job holds on until cancelled)
            return "never"

        await sdk_worker(worker)


@pytest.fixture
async def handlers(live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]],
                   tmp_path: Path) -> Handlers:
    running = Handlers()
    await running.start(live, sdk_worker, tmp_path / "specs")
    return running


async def test_the_sync_client_runs_a_chain_a_group_and_a_batch(live: Live, handlers: Handlers):
    def produce() -> None:
        with Client(live.base) as client:
            flow = client.chain(step("add", n=1), step("add", n=10), step("add", n=100),
                                name="sums", id="sums-1")
            assert (flow.id, flow.type, flow.name) == ("sums-1", "chain", "sums") and flow.created
            # step 2 got {"0": 1, "1": 11}: every step before it
            assert flow.result(timeout=20) == 112
            assert flow.state == "completed" and len(flow.job_ids) == 3
            again = client.chain(step("add", n=1), step("add", n=10), step("add", n=100),
                                 name="sums", id="sums-1")
            assert again.created is False and again.id == "sums-1"
            with pytest.raises(ApiError) as other:
                client.chain(step("add", n=2), id="sums-1")
            assert other.value.status == 409

            sides = client.group(step("add", n=1), chain(step("add", n=2), step("add", n=3)))
            assert sides.result(timeout=20) == {"0": 1, "1": 5}

            mixed = client.batch(step("add", n=1), step("flaky"),
                                 on_success=step("add", n=7), on_failure=step("add", n=50))
            mixed.wait(timeout=20)
            callbacks = {c["role"]: c for c in mixed.view["root"]["children"] if c.get("role")}
            assert callbacks["on_success"]["state"] == "skipped"
            assert callbacks["on_failure"]["state"] == "completed"
            assert client.wait(callbacks["on_failure"]["job_id"], timeout=5) == 51
            assert mixed.state == "failed"  # its on_failure ran, but a job failed
            with pytest.raises(WorkflowError) as failed_batch:
                mixed.result(timeout=5)
            assert failed_batch.value.state == "failed"

            seen = client.workflow("sums-1")
            assert seen.view["completed_count"] == 3 and seen.view["root"]["kind"] == "chain"
            listed = client.workflows(name="sums")["workflows"]
            assert [w["id"] for w in listed] == ["sums-1"]

    await asyncio.to_thread(produce)


async def test_a_failed_step_fails_the_chain_and_a_retry_resumes_it(live: Live,
                                                                   handlers: Handlers):
    def produce() -> None:
        with Client(live.base) as client:
            flow = client.chain(step("add", n=1), step("flaky"), step("add", n=5))
            with pytest.raises(WorkflowError) as failed:
                flow.result(timeout=20)
            flaky_job = flow.job_ids[1]
            assert failed.value.state == "failed"
            assert failed.value.errors[0]["job_id"] == flaky_job
            assert f"job {flaky_job}: ValueError: not yet" in str(failed.value)
            last = flow.view["root"]["children"][2]
            assert last["state"] == "cancelled"
            handlers.mended = True
            # (the answer is the view after the retry: its steps may have run already)
            assert flow.retry().state in ("running", "completed")
            assert flow.result(timeout=20) == 5 + 1 + 1000
            with pytest.raises(ApiError) as not_failed:
                client.retry_workflow(flow.id)
            assert (not_failed.value.status, not_failed.value.code) == (409, "not_failed")

            with pytest.raises(ApiError) as refused:
                client.chain(step("add", n=1), group(step("add", n=1), step("nope")))
            assert refused.value.status == 422
            assert "steps[1].jobs[1]: " in refused.value.message
            assert "nope" in refused.value.message

    await asyncio.to_thread(produce)


async def test_the_async_client_creates_reads_and_cancels(live: Live, handlers: Handlers):
    async with AsyncClient(live.base) as client:
        flow = await client.chain(group(step("add", n=1), step("add", n=2)), step("add", n=4),
                                  name="async")
        assert await flow.result(timeout=20) == 4  # it got {"0": {"0": 1, "1": 2}}: no int
        assert handlers.seen[-1] == {"0": {"0": 1, "1": 2}}

        stuck = await client.chain(step("hold"), step("add", n=1), name="stuck")
        await wait_until(handlers.held.is_set, timeout=10, what="hold to start")
        cancelled = await stuck.cancel()
        assert cancelled.state == "cancelled"
        with pytest.raises(WorkflowError, match="cancelled"):
            await stuck.result(timeout=10)
        hold_job = stuck.job_ids[0]

        async def hold_ended() -> bool:
            return (await client.job(hold_job))["state"] == "cancelled"

        await wait_until(hold_ended, timeout=10, what="the running step cancelled")
        states = [c["state"] for c in (await client.workflow(stuck.id)).view["root"]["children"]]
        assert states == ["cancelled", "cancelled"]
        page = await client.workflows(state="cancelled")
        assert [w["id"] for w in page["workflows"]] == [stuck.id]


async def test_a_producer_token_creates_and_reads_its_own(
        live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]], tmp_path: Path):
    admin, producer, other, worker = await make_tokens(
        live, ("admin", None), ("producer", None), ("producer", None), ("worker", None))
    live.http.headers["Authorization"] = f"Bearer {admin}"  # to push the specs
    await Handlers().start(live, sdk_worker, tmp_path / "specs", token=worker)

    def produce() -> None:
        with Client(live.base, token=producer) as client, \
                Client(live.base, token=other) as stranger:
            flow = client.chain(step("add", n=2), step("add", n=3), id="mine")
            assert flow.result(timeout=20) == 5  # its jobs' results are its own too
            assert [w["id"] for w in client.workflows()["workflows"]] == [flow.id]
            assert stranger.workflows()["workflows"] == []
            with pytest.raises(ApiError) as hidden:
                stranger.workflow(flow.id)
            assert hidden.value.status == 404
            with pytest.raises(ApiError) as admin_only:
                client.retry_workflow(flow.id)
            assert admin_only.value.status == 403

    await asyncio.to_thread(produce)
