"""Live status: job progress, captured log lines and alerts travel in heartbeats and are
kept with the job; bad status sections are refused like any bad frame."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import Live, wait_until, write_spec
from helpers import closed_with
from helpers import rota

from rota import JobContext, Worker
from rota.base import protocol as p
from rota.worker.context import MAX_HELD_LINES, MAX_LINES_PER_BEAT, STATUS_BYTES_PER_BEAT, StatusBuffer
from rota.worker.link import RESULT_BYTES_PER_BEAT, Link

# The server's scenarios run on SQLite; what they rely on the store for runs on both
# backends in tests/store/test_store_contract.py.


def chatty(tmp_path: Path, release: asyncio.Event, **options: Any) -> Worker:
    worker = Worker(specs_dir=tmp_path, **options)

    @worker.handler("chatty")
    async def run(ctx: JobContext) -> str:
        ctx.progress(10)
        ctx.log("step one")
        ctx.log("looking closely", "debug")
        ctx.progress(50, "half way")
        await release.wait()
        ctx.progress(100, "done")
        return "ok"

    return worker


async def job_with(live: Live, job_id: str, check: Any) -> dict[str, Any]:
    async def shown() -> dict[str, Any] | None:
        job = await live.job(job_id)
        return job if check(job) else None

    return await wait_until(shown, what=f"job {job_id} to show its status")


async def test_progress_and_captured_logs_are_kept_with_the_job(live: Live, sdk_worker,
                                                                tmp_path: Path):
    await live.push(write_spec(tmp_path, "chatty"))
    release = asyncio.Event()
    await sdk_worker(chatty(tmp_path, release, heartbeat_interval=0.05))
    code, out, _ = await rota("enqueue", "chatty", "--capture-logs", "--url", live.base)
    assert code == 0
    job = json.loads(out)
    running = await job_with(live, job["id"], lambda j: j["progress"] and j["logs"])
    assert running["state"] == "active" and running["capture_logs"] is True
    assert (running["progress"]["percent"], running["progress"]["message"]) == (50, "half way")
    assert [(line["level"], line["message"], line["attempt"], line["kind"])
            for line in running["logs"]] == [("info", "step one", 1, "log"),
                                            ("debug", "looking closely", 1, "log")]
    release.set()
    done = await live.wait_state(job["id"], "completed")
    assert (done["progress"]["percent"], done["progress"]["message"]) == (100, "done")
    code, out, _ = await rota("jobs", "show", job["id"], "--url", live.base)
    assert code == 0 and '"looking closely"' in out and '"half way"' not in out


async def test_logs_stay_local_unless_the_job_asks_for_them(live: Live, sdk_worker,
                                                            tmp_path: Path):
    await live.push(write_spec(tmp_path, "chatty"))
    release = asyncio.Event()
    release.set()
    await sdk_worker(chatty(tmp_path, release, heartbeat_interval=0.05))
    job = await live.enqueue("chatty")
    done = await live.wait_state(job["id"], "completed")
    assert done["capture_logs"] is False and done["logs"] == []
    assert done["progress"]["percent"] == 100  # progress is always kept


async def test_alerts_go_out_at_once_and_are_shown(live: Live, sdk_worker, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture):
    await live.push(write_spec(tmp_path, "alarm"))
    # A heartbeat interval far longer than the test: only the alert itself can wake it.
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=30)
    raised = asyncio.Event()
    hold = threading.Event()

    @worker.handler("alarm")
    def alarm(ctx: JobContext) -> None:  # a plain function: runs in a thread
        ctx.alert("disk almost full", "error")
        raised.set()
        hold.wait(10)

    await sdk_worker(worker)
    job = await live.enqueue("alarm")
    await raised.wait()
    sent_at = time.monotonic()
    shown = await job_with(live, job["id"], lambda j: j["logs"])
    latency = time.monotonic() - sent_at
    hold.set()
    [line] = shown["logs"]
    assert (line["kind"], line["level"], line["message"]) == ("alert", "error", "disk almost full")
    assert latency < 1.0, latency  # not held for the 30 s heartbeat
    [seen] = (await live.http.get("/workers")).json()["workers"]
    assert [(a["level"], a["job_id"], a["message"]) for a in seen["alerts"]] == [
        ("error", job["id"], "disk almost full")]
    assert f"alert worker={worker.worker_id} job={job['id']} level=error" in caplog.text
    worker.alert("going to restart soon")
    await wait_until(lambda: "level=warning message='going to restart soon'" in caplog.text,
                     what="a worker alert")
    print(f"\n[status] alert from a handler stored and shown {latency * 1000:.0f} ms after it"
          " was raised (heartbeat interval 30 s)")


async def test_status_for_jobs_not_held_is_ignored(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    owner, other = await connect("owner"), await connect("other")
    await owner.register([echo], concurrency=1)
    await other.register([echo], concurrency=1, capacity=0)
    job = await live.enqueue("echo", capture_logs=True)
    await owner.jobs(1)
    await other.beat(status={"state": "running", "active_job_ids": [],
                             "progress": [{"job_id": job["id"], "percent": 99}],
                             "logs": [{"job_id": job["id"], "message": "not mine"}]})
    await other.expect("ack")
    await owner.beat(status={"state": "running", "active_job_ids": [job["id"]],
                             "logs": [{"job_id": job["id"], "message": "mine"}]})
    await owner.expect("ack")
    shown = await job_with(live, job["id"], lambda j: j["logs"])
    assert shown["progress"] is None and [line["message"] for line in shown["logs"]] == ["mine"]


@pytest.mark.parametrize("status, detail", [
    ({"progress": [{"job_id": "j", "percent": 150}]}, "<= 100"),
    ({"progress": [{"job_id": "j", "percent": -1}]}, ">= 0"),
    ({"logs": [{"job_id": "j", "message": "x", "level": "loud"}]}, "level"),
    ({"alerts": [{"message": 7}]}, "Expected `str`"),
], ids=["percent over 100", "negative percent", "unknown level", "alert not text"])
async def test_bad_status_sections_are_refused(live: Live, connect, tmp_path: Path,
                                               status: dict[str, Any], detail: str):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    bad, good = await connect("bad"), await connect("good")
    await bad.register([echo])
    await good.register([echo])
    await bad.beat(status={"state": "running", **status})
    error = await bad.expect("error")
    assert error["code"] == "invalid_message" and detail in error["message"]
    assert await closed_with(bad) == 1007
    job = await live.enqueue("echo")
    [copy] = await good.jobs(1)
    assert (await good.complete(copy))["accepted"] == [job["id"]]


def test_status_buffer_is_bounded_and_says_what_it_dropped():
    woken: list[int] = []
    buffer = StatusBuffer(wake=lambda: woken.append(1))
    for n in range(MAX_HELD_LINES + 5):
        buffer.log("j1", f"line {n}", "info")
    buffer.progress("j1", 250, "over")  # clamped, not refused
    buffer.alert("now", "critical", None)
    assert woken == [1]
    status = p.Status(state="running")
    buffer.fill(status)
    assert status.logs[0].message == "5 earlier log line(s) dropped: buffer full"
    assert status.logs[1].message == "line 5" and len(status.logs) == MAX_LINES_PER_BEAT
    assert status.progress[0].percent == 100 and [a.level for a in status.alerts] == ["critical"]
    rest = p.Status(state="running")
    buffer.fill(rest)
    assert rest.logs[0].message == f"line {5 + MAX_LINES_PER_BEAT - 1}"
    assert rest.progress == [] and rest.alerts == []


def test_status_buffer_keeps_each_heartbeat_under_its_byte_budget():
    buffer = StatusBuffer(wake=lambda: None)
    for n in range(100):
        buffer.log("j1", "é" * p.MAX_TEXT * 2, "info")  # cut to MAX_TEXT characters
        buffer.alert("a" * p.MAX_TEXT, "error", None)
        buffer.progress(f"j{n}", 5, "p" * p.MAX_TEXT)
    sent = {"alerts": 0, "progress": 0, "logs": 0}
    for _ in range(100):
        status = p.Status(state="running")
        buffer.fill(status)
        if not (status.alerts or status.progress or status.logs):
            break
        frame = p.encode(p.Heartbeat(seq=0, worker_id="w", status=status)).encode()
        assert len(frame) <= STATUS_BYTES_PER_BEAT + 256
        for kind in sent:
            sent[kind] += len(getattr(status, kind))
    assert sent == {"alerts": 100, "progress": 100, "logs": 100}  # all of it, in turns


def test_results_are_spread_over_heartbeats_that_fit_a_frame():
    link = Link("w")
    big = msgspec.Raw(msgspec.json.encode("r" * 300 * 1024))
    for n in range(5):
        link.add_result(p.Result(job_id=f"j{n}", attempt=1, outcome="completed", result=big), 0.0)
    batches = []
    for now in range(1, 10):
        beat = link.heartbeat(float(now), state="running", active=[], capacity=0)
        if not beat.results:
            break
        batches.append(len(beat.results))
        assert len(p.encode(beat).encode()) < RESULT_BYTES_PER_BEAT + 1024
        # the rest leave in the very next heartbeat, ack or no ack
        assert link.due(float(now)) == (sum(batches) < 5)
    assert batches == [2, 2, 1]
