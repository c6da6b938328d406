"""Cron schedules firing on a real server with a real SDK worker: one job per tick, with the
tick's id; the overlap policy skip with a slow handler; a schedule waiting for its spec."""

from __future__ import annotations

import asyncio
import calendar
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import wait_until

from rota import JobContext, Worker
from rota.core.schedules import check, tick_id
from rota.store.ticks import Fired


async def tick_jobs(live: Live, name: str) -> list[dict[str, Any]]:
    jobs = (await live.http.get("/jobs", params={"q": f"cron-{name}-", "limit": 500})).json()
    return sorted((j for j in jobs["jobs"] if j["id"].startswith(f"cron-{name}-")),
                  key=lambda j: j["id"])


async def test_every_second_fires_one_job_per_tick(live: Live, sdk_worker, tmp_path: Path):
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "beat"))
    worker = Worker(specs_dir=specs, heartbeat_interval=0.1)
    ran: list[str] = []

    @worker.handler("beat")
    async def beat(ctx: JobContext) -> str:
        ran.append(ctx.id)
        return ctx.id

    await sdk_worker(worker)
    began = time.time()
    answer = await live.http.put("/schedules/beat", json={"spec": "beat", "cron": "@every 1s"})
    assert answer.status_code == 201
    await wait_until(lambda: len(ran) >= 3, timeout=10, what="3 ticks run")
    await live.http.post("/schedules/beat/pause")
    ended = time.time()
    await asyncio.sleep(0.3)  # noqa: sleep-ok (a tick in flight at the pause lands)
    jobs = await tick_jobs(live, "beat")
    ticks = [j["id"] for j in jobs]
    assert len(ticks) == len(set(ticks)) == len(set(ran) | set(ticks) - set(ran))
    # one per whole second from the schedule's start, none skipped, none twice
    seconds = sorted(calendar.timegm(time.strptime(t[-16:], "%Y%m%dT%H%M%SZ")) for t in ticks)
    assert seconds == list(range(seconds[0], seconds[0] + len(seconds)))
    assert int(began) < seconds[0] <= int(began) + 5 and seconds[-1] <= ended + 1
    assert sorted(ran) == ticks[:len(ran)]
    shown = (await live.http.get("/schedules/beat")).json()
    assert shown["run_count"] == len(ticks) and shown["last_job_id"] == ticks[-1]
    assert shown["last_tick"] is not None
    assert tick_id("beat", seconds[-1]) == ticks[-1]


async def test_overlap_skip_with_a_slow_handler(live: Live, sdk_worker, tmp_path: Path):
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "slow"))
    worker = Worker(specs_dir=specs, heartbeat_interval=0.1)
    release = asyncio.Event()

    @worker.handler("slow")
    async def slow(ctx: JobContext) -> None:
        await release.wait()

    await sdk_worker(worker)
    await live.http.put("/schedules/slow", json={"spec": "slow", "cron": "@every 1s"})
    first = await wait_until(lambda: tick_jobs(live, "slow"), timeout=5, what="a first tick")

    async def skipped() -> dict[str, Any] | None:
        shown = (await live.http.get("/schedules/slow")).json()
        return shown if shown["last_outcome"] == "skipped: previous run still active" else None

    shown = await wait_until(skipped, timeout=5, what="a skipped tick")
    kinds = [e[1] for e in live.coordinator.engine.observe.ring]
    assert "cron_fire" in kinds and "cron_skip" in kinds
    assert shown["last_job_id"] == first[0]["id"]
    assert [j["id"] for j in await tick_jobs(live, "slow")] == [first[0]["id"]]
    release.set()
    await live.wait_state(first[0]["id"], "completed")
    later = await wait_until(lambda: _more(live, "slow", 2), timeout=5, what="the next tick")
    assert later[0]["id"] == first[0]["id"]
    await live.http.post("/schedules/slow/pause")


async def _more(live: Live, name: str, count: int) -> list[dict[str, Any]] | None:
    jobs = await tick_jobs(live, name)
    return jobs if len(jobs) >= count else None


async def test_a_schedule_waits_for_its_spec_then_fires(live: Live, tmp_path: Path):
    answer = await live.http.put("/schedules/later", json={"spec": "late", "cron": "@every 1s"})
    assert answer.json()["schedule"]["state"] == "waiting"
    await asyncio.sleep(1.1)  # noqa: sleep-ok (an absence: a tick passes, it makes no job)
    assert await tick_jobs(live, "later") == []
    await live.push(write_spec(tmp_path / "specs", "late"))
    jobs = await wait_until(lambda: tick_jobs(live, "later"), timeout=5, what="a tick")
    assert jobs[0]["spec"] == "late"
    shown = (await live.http.get("/schedules/later")).json()
    assert shown["state"] == "active" and shown["waiting_reason"] is None
    # a new version whose args the schedule's no longer fit: it waits, and says why
    await live.push(write_spec(tmp_path / "specs", "late", version="2",
                               extra='[args.team]\ntype = "string"\n'))

    async def refused() -> dict[str, Any] | None:
        shown = (await live.http.get("/schedules/later")).json()
        return shown if shown["state"] == "waiting" else None

    shown = await wait_until(refused, timeout=5, what="the schedule to wait")
    assert shown["waiting_reason"] == "its jobs are refused: spec 'late' requires argument 'team'"
    await live.http.post("/schedules/later/pause")


async def test_overlap_enqueue_holds_ticks_pending_and_runs_them_one_at_a_time(
        live: Live, sdk_worker, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "serial"))
    worker = Worker(specs_dir=specs, heartbeat_interval=0.1, concurrency=4)
    release = asyncio.Event()
    running: list[str] = []
    most = 0

    @worker.handler("serial")
    async def serial(ctx: JobContext) -> None:
        nonlocal most
        running.append(ctx.id)
        most = max(most, len(running))
        await release.wait()
        running.remove(ctx.id)

    await sdk_worker(worker)
    await live.http.put("/schedules/serial", json={"spec": "serial", "cron": "@every 1s",
                                                   "overlap": "enqueue"})
    held = await wait_until(lambda: _pending(live, "serial", 2), timeout=6, what="held ticks")
    assert all(j["schedule"] == "serial" for j in held)
    release.set()  # the running one ends: the held ones run, one at a time

    async def all_done() -> bool:
        states = {(await live.job(j["id"]))["state"] for j in held}
        return states == {"completed"}

    await wait_until(all_done, timeout=10, what="the held ticks to run")
    assert most == 1  # one at a time, though the worker takes four
    # a pause cancels the ticks it holds: nothing else would (DELETE /jobs refuses them)
    release.clear()
    held = await wait_until(lambda: _pending(live, "serial", 1), timeout=6, what="a held tick")
    assert (await live.http.post("/schedules/serial/pause")).status_code == 200
    release.set()
    for j in held:
        shown = await live.job(j["id"])
        assert shown["state"] == "cancelled"
        assert shown["errors"][-1]["message"] == "its schedule serial was paused"
    # more than 2 held: a warning (ojs-cron §6), once per fire that holds one more
    definition = check({"name": "serial", "spec": "serial", "cron": "@every 1s",
                        "overlap": "enqueue"})
    with caplog.at_level(logging.INFO, logger="rota.cron"):
        for held_now in (2, 3):
            live.coordinator.clockwork._report(definition, Fired(held=held_now),
                                               live.coordinator.clock())
    # (rota.cron's only: a loaded machine may add the server's own stall warning)
    assert [r.getMessage() for r in caplog.records
            if r.name == "rota.cron" and r.levelno == logging.WARNING] == [
        "cron backlog schedule=serial held=3: its runs last longer than its interval"
        " (overlap enqueue)"]


async def _pending(live: Live, name: str, count: int) -> list[dict[str, Any]] | None:
    jobs = [await live.job(j["id"]) for j in await tick_jobs(live, name)]
    held = [j for j in jobs if j["state"] == "pending"]
    return held if len(held) >= count else None


async def test_overlap_cancel_previous_cancels_the_running_one(live: Live, sdk_worker,
                                                                tmp_path: Path):
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "sync"))
    worker = Worker(specs_dir=specs, heartbeat_interval=0.1, concurrency=4)
    done = asyncio.Event()

    @worker.handler("sync")
    async def sync(ctx: JobContext) -> None:
        await done.wait()  # (a run the next tick cancels)

    await sdk_worker(worker)
    await live.http.put("/schedules/sync", json={"spec": "sync", "cron": "@every 1s",
                                                 "overlap": "cancel_previous"})
    first = (await wait_until(lambda: tick_jobs(live, "sync"), timeout=5, what="a tick"))[0]
    await live.wait_state(first["id"], "cancelled", timeout=6)
    await live.http.post("/schedules/sync/pause")
    done.set()


async def test_overlap_cancel_previous_cancels_a_waiting_one_in_the_fire(live: Live,
                                                                        tmp_path: Path):
    await live.push(write_spec(tmp_path / "specs", "idle"))  # (no worker: each tick waits)
    await live.http.put("/schedules/idle", json={"spec": "idle", "cron": "@every 1s",
                                                 "overlap": "cancel_previous"})
    jobs = await wait_until(lambda: _more(live, "idle", 2), timeout=6, what="two ticks")
    await live.http.post("/schedules/idle/pause")
    first = await live.job(jobs[0]["id"])
    assert first["state"] == "cancelled"
    assert "overlap cancel_previous" in first["errors"][-1]["message"]
    # the engine let go of its copy: no worker would be given it
    seqs = await live.coordinator.store.readers.run(lambda conn: dict(
        conn.execute("SELECT id, rowid FROM jobs WHERE schedule = 'idle'").fetchall()))
    assert seqs[first["id"]] not in live.coordinator.engine.scheduler.held_seqs()
