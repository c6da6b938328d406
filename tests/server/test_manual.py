"""Manual mode: ``worker.listen()`` hands jobs to the caller, who reports each outcome;
the run loop's rules (capacity, cancels, grace period, deregistration) still hold."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from conftest import Live, wait_until, write_spec

from rota import JobContext, JobFailed, Worker


def manual(live: Live, tmp_path: Path, **options) -> Worker:
    return Worker(url=live.ws, specs_dir=tmp_path, heartbeat_interval=0.05, **options)


async def test_jobs_taken_by_hand_complete_fail_and_retry(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo", extra="[retry]\nmax_attempts = 2\n"))
    worker = manual(live, tmp_path)
    ok = await live.enqueue("echo", {"say": "hi"}, id="ok")
    fatal = await live.enqueue("echo", {"say": "no"}, id="fatal")
    flaky = await live.enqueue("echo", {"say": "again"}, id="flaky")
    seen: list[tuple[str, int]] = []
    async with worker.listen("echo") as jobs:
        async for job in jobs:
            seen.append((job.id, job.attempt))
            if job.id == "ok":
                assert job.complete({"said": job.args["say"]}) is True
            elif job.id == "fatal":
                job.fail("bad input", retryable=False)
            elif job.attempt == 1:
                job.fail(TimeoutError("upstream slow"))
            else:
                job.complete("second time lucky")
            if len(seen) == 4:
                break
    assert sorted(seen) == [("fatal", 1), ("flaky", 1), ("flaky", 2), ("ok", 1)]
    assert (await live.job(ok["id"]))["result"] == {"said": "hi"}
    discarded = await live.job(fatal["id"])
    assert discarded["state"] == "discarded"
    assert (discarded["errors"][0]["type"], discarded["errors"][0]["message"]) == (
        "JobFailed", "bad input")
    retried = await live.job(flaky["id"])
    assert (retried["state"], retried["attempt"]) == ("completed", 2)
    assert retried["errors"][0]["type"] == "TimeoutError"
    await wait_until(lambda: not live.coordinator.connections, what="the worker to deregister")


async def test_a_taken_job_holds_its_slot_until_reported(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    worker = manual(live, tmp_path, concurrency=2, prefetch=0)  # j2 stays on the server
    for n in range(3):
        await live.enqueue("echo", {"n": n}, id=f"j{n}")
    async with worker.listen("echo") as jobs:
        first, second = await anext(jobs), await anext(jobs)
        with pytest.raises(TimeoutError):  # both slots are taken: no third job comes
            await asyncio.wait_for(anext(jobs), 0.3)
        assert (await live.job("j2"))["state"] == "available"
        first.complete()
        third = await asyncio.wait_for(anext(jobs), 5)
        assert third.id == "j2"
        second.complete()
        third.complete()
    for n in range(3):
        assert (await live.job(f"j{n}"))["state"] == "completed"


async def test_a_cancel_reaches_a_job_taken_by_hand(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    worker = manual(live, tmp_path)
    job = await live.enqueue("echo")
    async with worker.listen("echo") as jobs:
        taken = await anext(jobs)
        reply = await live.http.delete(f"/jobs/{job['id']}")
        assert reply.status_code == 202
        await wait_until(lambda: taken.cancelled, what="the job to be stopped")
        assert taken.complete("too late") is False
        await live.wait_state(job["id"], "cancelled")


async def test_leaving_the_block_gives_unreported_jobs_the_grace_then_requeues(
        live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    worker = manual(live, tmp_path, grace_period=0.2)
    job = await live.enqueue("echo")
    async with worker.listen("echo") as jobs:
        taken = await anext(jobs)
    assert taken.cancelled
    back = await live.job(job["id"])
    assert back["state"] == "available" and [e["type"] for e in back["errors"]] == ["shutdown"]
    assert live.coordinator.connections == {}


def test_complete_is_only_for_jobs_taken_by_hand():
    ctx = JobContext(id="j", spec="s", queue="q", attempt=1, args={}, priority=0,
                     checksum="c", enqueued_at="now", worker_id="w", visibility_timeout=1.0)
    with pytest.raises(RuntimeError, match="worker.listen"):
        ctx.complete()
    with pytest.raises(ValueError, match="at least one spec"):
        Worker().listen()
    assert JobFailed("x", retryable=False).retryable is False


async def test_jobs_handed_over_but_never_taken_go_back_at_once(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    worker = manual(live, tmp_path, concurrency=2, grace_period=30)
    jobs = [await live.enqueue("echo", {"n": n}) for n in range(2)]
    async with worker.listen("echo"):
        await wait_until(lambda: len(worker.running_jobs) == 2, what="both jobs handed over")
        leaving = time.monotonic()
    assert time.monotonic() - leaving < 5  # not the 30 s grace: nobody held them
    for job in jobs:
        back = await live.job(job["id"])
        assert back["state"] == "available" and [e["type"] for e in back["errors"]] == ["shutdown"]
