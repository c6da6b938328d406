"""The job lifecycle on a live server: retries, limits, leases, scheduling, TTL, cancel,
manual retry, batches and idempotent enqueue."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from conftest import Live, start_server, stop_server, write_spec
from helpers import RawWorker, wait_until

from rota import JobContext, Worker

# The server's scenarios run on SQLite; what they rely on the store for runs on both
# backends in tests/store/test_store_contract.py.

FAST_RETRY = "[retry]\nmax_attempts = 3\nbackoff_base = 0.05\nbackoff_max = 0.1\n"


async def fail(worker, copy, *, retryable: bool = True, kind: str = "Boom") -> dict:
    await worker.beat(results=[{"job_id": copy["id"], "attempt": copy["attempt"],
                                "outcome": "failed",
                                "error": {"type": kind, "message": "no", "retryable": retryable}}],
                      capacity=1)
    return await worker.expect("ack")


async def test_failures_retry_after_backoff_and_stop_at_max_attempts(
        live: Live, connect, tmp_path: Path):
    await live.push(write_spec(tmp_path, "flaky", extra=FAST_RETRY))
    worker = await connect()
    await worker.register([write_spec(tmp_path, "flaky", extra=FAST_RETRY)], concurrency=1)
    job = await live.enqueue("flaky")
    for attempt in (1, 2, 3):
        [copy] = await worker.jobs(1)
        assert copy["attempt"] == attempt
        failed_at = time.monotonic()
        ack = await fail(worker, copy)
        assert ack["accepted"] == [job["id"]]
        if attempt < 3:
            state = (await live.job(job["id"]))["state"]
            assert state in ("retryable", "available", "active")
            [again] = await worker.jobs(1)
            assert time.monotonic() - failed_at >= 0.025  # half the base backoff at least
            worker.held.insert(0, {"type": "assign", "jobs": [again]})
    done = await live.wait_state(job["id"], "discarded")
    assert [e["attempt"] for e in done["errors"]] == [1, 2, 3]
    assert done["fails"] == 3 and done["attempt"] == 3
    result = (await live.http.get(f"/jobs/{job['id']}/result")).json()
    assert result["done"] and result["error"]["type"] == "Boom"


async def test_max_fails_counts_only_explicit_failures(live: Live, connect, tmp_path: Path):
    spec = write_spec(tmp_path, "picky", extra="[retry]\nmax_attempts = 5\nmax_fails = 1\n")
    await live.push(spec)
    job = await live.enqueue("picky")
    for attempt in (1, 2):  # two worker deaths: attempts, not failures
        worker = await connect(f"doomed-{attempt}")
        await worker.register([spec], concurrency=1)
        [copy] = await worker.jobs(1)
        assert copy["attempt"] == attempt
        await worker.ws.close()
        await live.wait_state(job["id"], "available")
    after_deaths = await live.job(job["id"])
    assert [e["type"] for e in after_deaths["errors"]] == ["worker_death", "worker_death"]
    assert after_deaths["fails"] == 0
    worker = await connect("last")
    await worker.register([spec], concurrency=1)
    [copy] = await worker.jobs(1)
    await fail(worker, copy)
    done = await live.wait_state(job["id"], "discarded")
    assert done["attempt"] == 3 and done["fails"] == 1


async def test_not_retryable_error_discards_at_once(live: Live, connect, tmp_path: Path):
    spec = write_spec(tmp_path, "strict", extra=FAST_RETRY)
    await live.push(spec)
    worker = await connect()
    await worker.register([spec], concurrency=1)
    job = await live.enqueue("strict")
    [copy] = await worker.jobs(1)
    await fail(worker, copy, retryable=False)
    done = await live.wait_state(job["id"], "discarded")
    assert done["attempt"] == 1 and len(done["errors"]) == 1


async def test_lapsed_lease_is_recovered_and_a_listed_one_is_kept(
        live: Live, connect, tmp_path: Path):
    spec = write_spec(tmp_path, "long")
    await live.push(spec)
    worker = await connect()
    await worker.register([spec], concurrency=2)
    kept = await live.enqueue("long", visibility_timeout=0.4)
    lapsed = await live.enqueue("long", visibility_timeout=0.4)
    await worker.jobs(2)
    started = time.monotonic()
    while time.monotonic() - started < 0.8:  # beat for twice the lease, vouching for one
        await worker.beat(status={"state": "running", "active_job_ids": [kept["id"]]}, capacity=0)
        await worker.expect("ack")
        await asyncio.sleep(0.1)  # noqa: sleep-ok (the worker's own heartbeat cadence)
    cancel = await worker.expect("cancel")
    assert cancel == {"type": "cancel", "job_ids": [lapsed["id"]], "reason": "visibility_timeout"}
    recovered = await live.wait_state(lapsed["id"], "available")
    [error] = recovered["errors"]
    assert (error["type"], error["attempt"], error["worker_id"]) == ("visibility_timeout", 1, "w1")
    assert (await live.job(kept["id"]))["state"] == "active"


async def test_sdk_gives_up_a_silent_handler_and_keeps_one_that_heartbeats(
        live: Live, sdk_worker, tmp_path: Path):
    await live.push(write_spec(tmp_path, "silent", extra="[retry]\nmax_attempts = 2\n"),
                    write_spec(tmp_path, "chatty"))
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)
    silent_runs = 0

    @worker.handler("silent")
    async def silent(ctx: JobContext) -> None:
        nonlocal silent_runs
        silent_runs += 1
        await asyncio.Event().wait()  # hangs: never finishes, never heartbeats

    @worker.handler("chatty")
    async def chatty(ctx: JobContext) -> str:
        for _ in range(8):  # 0.8 s of work, twice the lease, with a heartbeat each 0.1 s
            await asyncio.sleep(0.1)  # noqa: sleep-ok (the job's own work)
            await ctx.heartbeat()
        return "finished"

    hung = await live.enqueue("silent", visibility_timeout=0.4)
    alive = await live.enqueue("chatty", visibility_timeout=0.4)
    await sdk_worker(worker)
    done = await live.wait_state(alive["id"], "completed", timeout=5)
    assert done["attempt"] == 1 and done["result"] == "finished" and done["errors"] == []
    given_up = await live.wait_state(hung["id"], "discarded", timeout=5)
    assert [e["type"] for e in given_up["errors"]] == ["visibility_timeout"] * 2
    assert silent_runs == 2


async def test_scheduled_jobs_wait_for_their_time_and_survive_a_restart(tmp_path: Path):
    live = await start_server(tmp_path)
    spec = write_spec(tmp_path / "specs", "later")
    await live.push(spec)
    past = await live.enqueue("later", run_at="2001-01-01T00:00:00Z")
    assert past["state"] == "available"
    # Long enough that the restart below (slow on a loaded machine) is over before it.
    soon = await live.enqueue("later", delay=2.0)
    assert soon["state"] == "scheduled" and soon["run_at"] is not None
    reason = (await live.job(soon["id"]))["waiting_reason"]
    assert reason.startswith("scheduled until")
    await stop_server(live)
    live = await start_server(tmp_path)
    try:
        worker = await RawWorker.open(live.ws, "w")
        await worker.register([spec])
        [first] = await worker.jobs(1)
        assert first["id"] == past["id"]
        [second] = await worker.jobs(1, timeout=5)
        assert second["id"] == soon["id"]
        reserved = (await live.job(soon["id"]))["reserved_at"]
        assert reserved >= soon["run_at"]
        await worker.ws.close()
    finally:
        await stop_server(live)


async def test_bad_schedule_options_are_refused(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "later"))
    for body, code in [({"run_at": "next tuesday"}, "invalid_run_at"),
                       ({"run_at": "2030-01-01T00:00:00"}, "invalid_run_at"),
                       ({"run_at": "2030-01-01T00:00:00Z", "delay": 1}, "invalid_request"),
                       ({"delay": -1}, "invalid_request"), ({"ttl": 0}, "invalid_request"),
                       ({"max_attempts": 0}, "invalid_request")]:
        response = await live.http.post("/jobs", json={"spec": "later", **body})
        assert response.status_code == 422, body
        assert response.json()["error"]["code"] == code, body


async def test_ttl_discards_a_job_nobody_ran(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "fleeting"))
    job = await live.enqueue("fleeting", ttl=0.3)
    done = await live.wait_state(job["id"], "discarded", timeout=3)
    assert [e["type"] for e in done["errors"]] == ["expired"]
    result = await live.http.get(f"/jobs/{job['id']}/result", params={"wait": 1})
    assert result.status_code == 200 and result.json()["error"]["type"] == "expired"


async def test_cancel_waiting_and_running_jobs_then_retry(live: Live, sdk_worker, tmp_path: Path):
    await live.push(write_spec(tmp_path, "endless"), write_spec(tmp_path, "nobody", queue="q2"))
    waiting = await live.enqueue("nobody")
    response = await live.http.delete(f"/jobs/{waiting['id']}")
    assert response.status_code == 200 and response.json()["state"] == "cancelled"
    again = await live.http.delete(f"/jobs/{waiting['id']}")
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_cancellable"

    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)
    started = asyncio.Event()

    @worker.handler("endless")
    async def endless(ctx: JobContext) -> None:
        started.set()
        await asyncio.Event().wait()

    worker.handler("nobody")(lambda ctx: None)
    await sdk_worker(worker)
    running = await live.enqueue("endless")
    await asyncio.wait_for(started.wait(), 5)
    response = await live.http.delete(f"/jobs/{running['id']}")
    assert response.status_code == 202 and response.json()["cancel_requested"] is True
    cancelled = await live.wait_state(running["id"], "cancelled")
    assert cancelled["errors"][-1]["type"] == "cancelled"
    # Once the job ended, its page says the cancel is done, not still "requested".
    page = (await live.http.get(f"/ui/jobs/{running['id']}")).text
    assert cancelled["cancel_requested"] and "<dt>Cancel</dt><dd>done at " in page, page
    assert ">requested<" not in page

    # The worker serves q2 too (it has a handler for "nobody"), so the retried job may be
    # reserved, even finished, before the answer's row is read: any of those says it is back.
    retried = await live.http.post(f"/jobs/{waiting['id']}/retry")
    assert retried.status_code == 200
    assert retried.json()["state"] in ("available", "active", "completed"), retried.json()
    done = await live.wait_state(waiting["id"], "completed")
    assert done["attempt"] == 1  # cancelled while it waited: no attempt was spent
    assert (await live.http.post(f"/jobs/{waiting['id']}/retry")).status_code == 409
    assert (await live.http.post("/jobs/nope/retry")).status_code == 404
    assert (await live.http.delete("/jobs/nope")).status_code == 404


async def test_manual_retry_gives_a_discarded_job_a_fresh_budget(
        live: Live, connect, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.INFO, "rota.server")
    spec = write_spec(tmp_path, "once", extra="[retry]\nmax_attempts = 1\n")
    await live.push(spec)
    worker = await connect()
    await worker.register([spec], concurrency=1)
    job = await live.enqueue("once")
    for _ in range(2):  # discarded, and retried by hand, twice
        [copy] = await worker.jobs(1)
        await fail(worker, copy)
        await live.wait_state(job["id"], "discarded")
        retried = (await live.http.post(f"/jobs/{job['id']}/retry")).json()
        # A fresh budget: nothing used of it, or (the idle worker was quicker than the
        # answer's read) the one attempt it has just been assigned.
        assert (retried["attempt"] - copy["attempt"], retried["attempts_used"]) in (
            (0, 0), (1, 1)), retried
    [copy] = await worker.jobs(1)
    assert copy["attempt"] == 3
    # The attempts the budget counts, and all of them: "1 of 1 (3 in all)", not "3 of 1".
    assert ((view := await live.job(job["id"]))["attempt"], view["attempts_used"]) == (3, 1)
    page = (await live.http.get(f"/ui/jobs/{job['id']}")).text
    assert "<dd>1 of 1 (3 in all) · 0 failed since the last retry, 2 in all" in page
    assert f"assign job={job['id']} " in caplog.text
    assert [line.endswith("attempt=3 budget=1/1") for line in caplog.text.splitlines()
            if f"assign job={job['id']} " in line] == [False, False, True]
    await worker.complete(copy, result="second time lucky")
    done = await live.wait_state(job["id"], "completed")
    assert done["result"] == "second time lucky" and len(done["errors"]) == 2


async def test_batch_enqueue_reports_each_job(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    body = {"jobs": [{"spec": "echo", "id": "b1"}, {"spec": "nope"}, {"spec": 5},
                     {"spec": "echo", "id": "b1"}, {"spec": "echo", "id": "b1", "priority": 9},
                     {"spec": "echo", "delay": 60}]}
    response = await live.http.post("/jobs/batch", json=body)
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["status"] for r in results] == [201, 422, 422, 200, 409, 201]
    assert results[1]["error"]["code"] == "unknown_spec"
    assert results[4]["error"]["code"] == "id_conflict"
    assert results[5]["job"]["state"] == "scheduled"
    assert live.coordinator.scheduler.live() == 2
    empty = await live.http.post("/jobs/batch", json={"jobs": []})
    assert empty.status_code == 422


async def test_fifty_concurrent_enqueues_with_one_id_make_one_job(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "echo"))
    body = {"spec": "echo", "id": "same", "args": {"n": 1}}
    replies = await asyncio.gather(*(live.http.post("/jobs", json=body) for _ in range(50)))
    assert sorted(r.status_code for r in replies) == [200] * 49 + [201]
    assert sum(r.json()["created"] for r in replies) == 1
    queues = (await live.http.get("/queues")).json()["queues"]
    assert queues[0]["counts"]["available"] == 1


async def test_result_wait_returns_on_any_terminal_state(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "nobody", queue="none"))
    job = await live.enqueue("nobody")
    poll = asyncio.create_task(live.http.get(f"/jobs/{job['id']}/result", params={"wait": 10}))
    await wait_until(lambda: job["id"] in live.coordinator.watching.waiters, what="the waiter")
    await live.http.delete(f"/jobs/{job['id']}")
    reply = await asyncio.wait_for(poll, 5)
    assert reply.status_code == 200 and reply.json()["state"] == "cancelled"


async def test_a_graceful_restart_leaves_running_jobs_to_their_worker(tmp_path: Path):
    live = await start_server(tmp_path, heartbeat_timeout=3.0)
    port = live.settings.port
    await live.push(write_spec(tmp_path / "specs", "steady"))
    worker = Worker(url=live.ws, specs_dir=tmp_path / "specs", heartbeat_interval=0.1)
    started, release = asyncio.Event(), asyncio.Event()

    @worker.handler("steady")
    async def steady(ctx: JobContext) -> str:
        started.set()
        await release.wait()
        return f"attempt {ctx.attempt}"

    task = asyncio.create_task(worker.run())
    try:
        job = await live.enqueue("steady")
        await asyncio.wait_for(started.wait(), 5)
        await stop_server(live)  # graceful: the job must not be taken from its worker
        live = await start_server(tmp_path, port=port, heartbeat_timeout=3.0)
        await wait_until(lambda: worker.connected.is_set() and live.coordinator.connections,
                         what="the worker to reconnect")
        release.set()
        done = await live.wait_state(job["id"], "completed")
        assert done["attempt"] == 1 and done["errors"] == [] and done["result"] == "attempt 1"
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await stop_server(live)


async def test_sync_handlers_can_heartbeat_from_their_thread(live: Live, sdk_worker,
                                                             tmp_path: Path):
    await live.push(write_spec(tmp_path, "grind", extra="[retry]\nmax_attempts = 1\n"))
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)

    @worker.handler("grind")
    def grind(ctx: JobContext) -> int:
        for _ in range(8):  # 0.8 s of blocking work, twice the lease
            time.sleep(0.1)  # noqa: sleep-ok (the job's own blocking work)
            ctx.heartbeat()
        return 8

    job = await live.enqueue("grind", visibility_timeout=0.4)
    await sdk_worker(worker)
    done = await live.wait_state(job["id"], "completed", timeout=5)
    assert done["result"] == 8 and done["errors"] == []
