"""Prefetch end to end: a real server and real SDK workers. A worker holds up to
concurrency + prefetch jobs, runs no more than concurrency at once, and gives back the
ones it has not started when it goes quiet, terminates or is asked to cancel one; another
worker then runs each of them exactly once (docs/protocol.md §3.5)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import rota, wait_until
from test_reconnect import Tally, behind_proxy, reconnected

from rota import Worker
from rota.cli.live import render, snapshot
from rota.client.client import Client


class Gate(Tally):
    """Handlers that block until the test opens the gate, counting what ran where."""

    def __init__(self) -> None:
        super().__init__()
        self.open = asyncio.Event()

    def worker(self, specs: Path, *, concurrency: int, prefetch: int | None) -> Worker:
        return self.build(specs, concurrency=concurrency, gate=self.open, prefetch=prefetch)


async def held(live: Live, worker: Worker, running: int, prefetched: int) -> None:
    """Wait until the server and the worker agree it runs ``running`` and holds
    ``prefetched`` more."""
    async def check() -> bool:
        shown = (await live.http.get("/workers")).json()["workers"]
        mine = [w for w in shown if w["id"] == worker.worker_id]
        return bool(mine) and (mine[0]["active"], mine[0]["prefetched"]) == (
            running, prefetched) and (len(worker.running_jobs),
                                      len(worker.prefetched_jobs)) == (running, prefetched)

    # Seen through heartbeats: on a machine running two suites at once 5 s ran out once.
    await wait_until(check, timeout=15, what=f"{running} running and {prefetched} prefetched")


async def fill(live: Live, tmp_path: Path, sdk_worker: Callable[..., Awaitable[Worker]],
               gate: Gate, jobs: int) -> tuple[Worker, list[dict[str, Any]]]:
    """A worker of concurrency 2 and prefetch 3, full: 2 running, 3 waiting."""
    await live.push(write_spec(tmp_path, "work"))
    first = await sdk_worker(gate.worker(tmp_path, concurrency=2, prefetch=3))
    return first, await fill_up(live, first, jobs)


async def fill_up(live: Live, worker: Worker, jobs: int) -> list[dict[str, Any]]:
    """Enqueue ``jobs`` gated jobs and wait until the worker holds 2 + 3 of them. (It
    holds a line once it has seen how long runs take: two quick jobs show it they are
    short.) Their time is then pinned: on a busy machine a quick run measured at 5 ms
    sized the line at 2, and the 3 waiting jobs never came (a flaky wait)."""
    for _ in range(2):
        await live.wait_state((await live.enqueue("work", {"quick": True}))["id"], "completed")
    worker.runner.run_times["work"] = 0.0001  # no job ends before the gate opens
    enqueued = [await live.enqueue("work", id=f"j{n}") for n in range(jobs)]
    await held(live, worker, running=2, prefetched=3)
    return enqueued


async def each_ran_once_after(live: Live, gate: Gate, jobs: list[dict[str, Any]],
                              released: list[str]) -> None:
    """Every job completed exactly once; the released ones at attempt 2, their first
    lease ending in one ``released`` record (not counted against max_attempts)."""
    gate.open.set()
    for job in jobs:
        done = await live.wait_state(job["id"], "completed")
        assert gate.runs[job["id"]] == 1, job["id"]
        if job["id"] in released:
            assert done["attempt"] == 2 and [e["type"] for e in done["errors"]] == ["released"]
            assert done["fails"] == 0 and done["deaths"] == 0
        else:
            assert (done["attempt"], done["errors"]) == (1, [])


async def test_a_worker_holds_concurrency_plus_prefetch_and_runs_only_concurrency(
        live: Live, tmp_path: Path, sdk_worker):
    gate = Gate()
    worker, jobs = await fill(live, tmp_path, sdk_worker, gate, jobs=8)
    queue = (await live.http.get("/queues")).json()["queues"][0]
    assert queue["counts"]["active"] == 5 and queue["counts"]["available"] == 3
    assert worker.prefetched_jobs == ["j2", "j3", "j4"]  # in the order assigned
    gate.open.set()
    for job in jobs:
        await live.wait_state(job["id"], "completed")
    assert gate.most == 2 and all(gate.runs[job["id"]] == 1 for job in jobs)


async def test_quiet_gives_waiting_jobs_back_and_another_worker_runs_them_once(
        live: Live, tmp_path: Path, sdk_worker):
    gate = Gate()
    first, jobs = await fill(live, tmp_path, sdk_worker, gate, jobs=7)
    waiting = list(first.prefetched_jobs)
    reply = await live.http.post(f"/workers/{first.worker_id}/state", json={"state": "quiet"})
    assert reply.status_code == 200
    for job_id in waiting:  # back at once: no lease, no grace to wait out
        await live.wait_state(job_id, "available", timeout=2.0)
    await held(live, first, running=2, prefetched=0)
    second = await sdk_worker(gate.worker(tmp_path, concurrency=10, prefetch=0))
    await wait_until(lambda: len(second.running_jobs) == 5, what="the second worker to take 5")
    await each_ran_once_after(live, gate, jobs, waiting)


async def test_terminate_gives_waiting_jobs_back_and_runs_out_the_running(
        live: Live, tmp_path: Path, sdk_worker):
    gate = Gate()
    first, jobs = await fill(live, tmp_path, sdk_worker, gate, jobs=5)
    waiting = list(first.prefetched_jobs)
    first.terminate()  # graceful: running jobs get the grace period
    for job_id in waiting:
        await live.wait_state(job_id, "available", timeout=2.0)
    assert sorted(first.running_jobs) == ["j0", "j1"]
    second = await sdk_worker(gate.worker(tmp_path, concurrency=10, prefetch=0))
    await wait_until(lambda: len(second.running_jobs) == 3, what="the second worker to take 3")
    await each_ran_once_after(live, gate, jobs, waiting)


async def test_a_waiting_job_cancelled_never_runs(live: Live, tmp_path: Path, sdk_worker):
    gate = Gate()
    first, jobs = await fill(live, tmp_path, sdk_worker, gate, jobs=5)
    reply = await live.http.delete("/jobs/j3")
    assert reply.status_code == 202  # active (held by the worker), so asked through it
    done = await live.wait_state("j3", "cancelled", timeout=2.0)
    assert [e["type"] for e in done["errors"]] == ["cancelled"]
    assert "j3" not in first.prefetched_jobs
    gate.open.set()
    for job in jobs:
        if job["id"] != "j3":
            await live.wait_state(job["id"], "completed")
    assert gate.runs["j3"] == 0 and gate.most == 2


async def test_a_lost_connection_keeps_the_line_and_the_worker_reclaims_it(
        live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "work"))
    gate = Gate()
    async with behind_proxy(live.settings.port, tmp_path, concurrency=2, tally=gate,
                            gate=gate.open, prefetch=3) as (_, worker, proxy):
        jobs = await fill_up(live, worker, 6)
        worker.connected.clear()
        proxy.cut()  # no assign on its way: the worker holds all it may
        await reconnected(worker, proxy, 2)
        await held(live, worker, running=2, prefetched=3)  # reclaimed, running and waiting
        await each_ran_once_after(live, gate, jobs, released=[])


@pytest.mark.parametrize("fresh", [False, True])
async def test_the_first_jobs_of_a_spec_new_to_a_worker_keep_one_waiting(
        live: Live, tmp_path: Path, sdk_worker, fresh: bool):
    """The trial: after quick jobs of one spec, the first 2 s jobs of another filled the
    line (32 for a worker of concurrency 1), for runs whose length nobody knew yet. And
    a fresh worker (``fresh``: no run timed at all) held none ("load=1/1 +0/32")."""
    await live.push(write_spec(tmp_path, "quick"), write_spec(tmp_path, "slow"))
    gate = asyncio.Event()
    worker = Worker(specs_dir=tmp_path, concurrency=1, heartbeat_interval=0.1)
    worker.handler("quick")(lambda ctx: None)

    @worker.handler("slow")
    async def slow(ctx: Any) -> None:
        await gate.wait()

    await sdk_worker(worker)
    for _ in range(0 if fresh else 2):
        await live.wait_state((await live.enqueue("quick"))["id"], "completed")
    jobs = [await live.enqueue("slow") for _ in range(8)]
    await live.wait_state(jobs[0]["id"], "active")

    async def shown() -> dict[str, Any]:
        return next(w for w in (await live.http.get("/workers")).json()["workers"]
                    if w["id"] == worker.worker_id)

    beats = (await shown())["heartbeats"]

    async def beaten() -> bool:
        return (await shown())["heartbeats"] >= beats + 3

    await wait_until(beaten, what="three more heartbeats")  # while the slow job runs
    now = await shown()
    gate.set()  # (before judging: a failed check must not leave the worker stuck)
    # A job of a spec new to it counts as a second of work (README): one waits, so the
    # next starts at once; the rest stay on the server for any idle worker.
    assert now["active"] == 1 and now["prefetched"] == 1, now
    for job in jobs:
        await live.wait_state(job["id"], "completed", timeout=10)


async def test_a_quick_job_behind_a_long_one_starts_on_a_worker_that_becomes_idle(
        live: Live, tmp_path: Path, sdk_worker):
    """The trial (issue 23): a quick job prefetched behind a 12 s job waited the whole
    12 s while a second worker sat idle. Now the server knows it has not started, takes
    it back from the line when the second worker registers, and that one runs it: within
    a second, at no attempt's cost, and exactly once."""
    await live.push(write_spec(tmp_path, "work"))
    release = asyncio.Event()
    starts: dict[str, list[tuple[str, float]]] = {}

    def build(concurrency: int, prefetch: int | None) -> Worker:
        worker = Worker(specs_dir=tmp_path, concurrency=concurrency, prefetch=prefetch)

        @worker.handler("work")
        async def work(ctx: Any) -> None:
            starts.setdefault(ctx.id, []).append((worker.worker_id, time.monotonic()))
            if ctx.args.get("block"):  # the long job: 5 s at most, ended by the test
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(release.wait(), 5.0)

        return worker

    busy = await sdk_worker(build(concurrency=1, prefetch=4))
    for _ in range(2):  # timed runs: short, so the worker holds a line
        await live.wait_state((await live.enqueue("work"))["id"], "completed")
    await live.enqueue("work", {"block": True}, id="long")
    await live.wait_state("long", "active")
    await live.enqueue("work", id="quick")
    await held(live, busy, running=1, prefetched=1)  # the server knows it has not started
    await shows_it_prefetched(live, busy)
    try:
        idle = build(concurrency=1, prefetch=None)
        await sdk_worker(idle)
        registered = time.monotonic()
        done = await live.wait_state("quick", "completed", timeout=5.0)
    finally:
        release.set()
    [(where, started)] = starts["quick"]
    assert where == idle.worker_id and started - registered < 1.0, started - registered
    assert done["attempt"] == 2 and done["attempts_used"] == 1, done
    assert [e["type"] for e in done["errors"]] == ["released"] and done["deaths"] == 0
    assert (await live.wait_state("long", "completed"))["attempt"] == 1
    await shows_it_taken_back_not_failed(live, busy)


async def shows_it_taken_back_not_failed(live: Live, busy: Worker) -> None:
    """The trial: the page listed the take-back under "Attempts that failed (1)", with
    "0 failed since the last retry, 1 in all", though no retry was made and it used no
    attempt; `rota jobs show` did not say so either."""
    page = (await live.http.get("/ui/jobs/quick")).text
    assert "Attempts that failed" not in page and "since the last retry" not in page
    assert "<h2>Attempts given back unstarted (1, not counted)</h2>" in page
    assert "<dd>1 of 25 (2 in all, 1 given back unstarted) · 0 failed</dd>" in page
    said = (f"taken back unstarted from worker {busy.worker_id}&#39;s line for an idle"
            " worker: not counted against max_attempts")
    assert "not started</span> <span class=\"muted small\">not counted</span>" in page
    assert said in page
    code, out, _ = await rota("jobs", "show", "quick", "--url", live.base)
    shown = json.loads(out)
    assert code == 0 and (shown["attempt"], shown["attempts_used"]) == (2, 1)
    assert shown["errors"][0]["message"] == said.replace("&#39;", "'")


async def shows_it_prefetched(live: Live, busy: Worker) -> None:
    """The API, the dashboard and ``rota watch`` tell the job waiting in the line from
    the one running (before: both "active", and the dashboard said "Started")."""
    listed = (await live.http.get("/jobs", params={"state": "active"})).json()["jobs"]
    assert {j["id"]: j["started"] for j in listed} == {"long": True, "quick": False}
    assert (await live.http.get("/jobs/quick")).json()["started"] is False
    [queue] = (await live.http.get("/queues")).json()["queues"]
    assert (queue["counts"]["active"], queue["prefetched"]) == (2, 1)
    page = (await live.http.get("/ui/jobs/quick")).text
    assert "data-run>prefetched<" in page and "not started" in page
    assert "data-run>running<" in (await live.http.get("/ui/jobs/long")).text
    with Client(live.base) as client:
        screen = render(await asyncio.to_thread(snapshot, client), live.base, 1.0, 100)
    [row] = [line.split() for line in screen if line.startswith("default ")]
    assert row[4:6] == ["1", "1"], screen  # RUNNING, PREFETCHED
    [load] = [line for line in screen if line.startswith(busy.worker_id)]
    assert "1/1 +1 prefetched" in load, screen
