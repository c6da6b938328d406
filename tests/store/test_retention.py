"""Retention: finished jobs are deleted once past their state's retention.

The decisions (rota/core/retention.py) with a fake clock; the deletes on a real SQLite file
through the real writer; and a stream of jobs through a real server whose file stops
growing: 100,000 jobs (about 9 s here; ROTA_RETENTION_JOBS sets another count), a soak
run (-m soak), and the same stream at 1/20 of that in the default run.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import Live, start_server, stop_server, store_url, write_spec
from helpers import wait_until

from rota.core.model import Change, JobRecord, shared_limits
from rota.core.retention import (DAY, Cutoff, Frames, PruneTally, Retention, due, format_duration,
                            next_pass, parse_duration, parse_rule)
from rota.store.store import Store
from rota.worker.worker import Worker

# The decisions are pure; the prune runs on both backends; the stream through a server
# runs on SQLite (its file's size is the point).

# -- the decisions, with a fake clock -------------------------------------------------


def test_durations_read_as_people_write_them():
    assert parse_duration("7d") == 7 * DAY
    assert parse_duration("12h") == 43200
    assert parse_duration("0.5s") == 0.5
    assert parse_duration("90") == 90
    assert parse_duration("2w") == 14 * DAY
    assert parse_duration("never") is None
    for bad in ("", "7 days", "-1d", "1e400d", "d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert [format_duration(s) for s in (7 * DAY, 3600, 90, 0.5, None)] == [
        "7d", "1h", "90s", "0.5s", "never"]


def test_a_queue_rule_names_its_queue_and_states():
    assert parse_rule("queue=emails:completed=1d:discarded=never") == (
        "emails", {"completed": DAY, "discarded": None})
    for bad in ("emails:completed=1d", "queue=emails", "queue=:completed=1d",
                "queue=emails:finished=1d", "queue=emails:completed=soon"):
        with pytest.raises(ValueError):
            parse_rule(bad)


def test_the_defaults_keep_a_week_a_month_and_a_week():
    now = 1_000_000_000.0
    assert due(Retention(), now) == [Cutoff("completed", now - 7 * DAY),
                                     Cutoff("discarded", now - 30 * DAY),
                                     Cutoff("cancelled", now - 7 * DAY)]


def test_a_queue_rule_takes_its_queue_out_of_the_default():
    retention = Retention.from_rules({"cancelled": None}, [
        ("emails", "completed", DAY), ("audit", "completed", None), ("emails", "completed", 60)])
    now = 5_000_000.0
    assert due(retention, now) == [
        Cutoff("completed", now - 7 * DAY, None, ("audit", "emails")),  # audit: kept forever
        Cutoff("completed", now - 60, "emails"),  # the later rule for a pair wins
        Cutoff("discarded", now - 30 * DAY),
    ]  # cancelled: never
    assert "cancelled=never queue=audit:completed=never queue=emails:completed=1m" in (
        retention.describe())


def test_a_full_batch_goes_again_at_once_otherwise_it_waits():
    week = Retention()
    assert next_pass(500, week) == 0.0
    assert next_pass(499, week) == 60.0
    short = Retention.from_rules({"completed": 2.0}, [])
    assert next_pass(0, short) == 0.5  # a quarter of the shortest retention
    tiny = Retention.from_rules({"completed": 0.0}, [])
    assert next_pass(0, tiny) == 0.1  # but never busier than this
    assert next_pass(0, Retention.from_rules(
        {"completed": None, "discarded": None, "cancelled": None}, [])) is None


def test_prune_lines_are_rate_limited_and_carry_every_count():
    tally = PruneTally(every=10.0)
    assert tally.add({}, 0.0) is None  # nothing deleted, nothing to say
    assert tally.add({"completed": 500}, 1.0) == (
        "prune completed=500 discarded=0 cancelled=0 batches=1")
    assert tally.add({"completed": 500}, 2.0) is None
    assert tally.add({"completed": 20, "discarded": 3}, 5.0) is None
    assert tally.add({}, 11.0) == "prune completed=520 discarded=3 cancelled=0 batches=2"
    assert tally.add({}, 30.0) is None


def test_without_a_step_the_frames_change_nothing():
    frames = Frames()
    frames.look(1000.0, 0.0)
    frames.seen([1010.0], 1010.5, 10.5)
    assert frames.spans(5.0, 50.0, 1050.0) == ()
    assert due(Retention.from_rules({"completed": 5.0}, []), 1050.0, frames, 50.0)[0] == \
        Cutoff("completed", 1045.0, None, (), ())


def test_after_a_step_back_each_job_is_judged_by_the_clock_that_stored_it():
    """Up at wall 1000 (monotonic 0); jobs finish at 1010 and 1020; the wall clock steps
    2 h back at monotonic 30; one finishes at monotonic 40 (wall 1040 - 7200)."""
    frames = Frames()
    frames.look(1000.0, 0.0)
    assert frames.seen([1010.0, 1020.0], 1020.0, 20.0) == 0.0
    assert frames.look(1030.0 - 7200, 30.0) == -7200
    frames.seen([1040.0 - 7200], 1040.0 - 7200, 40.0)

    def due_at(mono: float, seconds: float, finished: float) -> bool:
        spans = frames.spans(seconds, mono, mono + 1000.0 - 7200)
        return any(low <= finished < high for low, high in spans)

    # A minute on, with a 30 s retention: the jobs of before the step are due (the old
    # clock says 70 s and 60 s ago), the one after it is not (30 s ago: just due at 70).
    assert due_at(80.0, 30.0, 1010.0) and due_at(80.0, 30.0, 1020.0)
    assert not due_at(69.0, 30.0, 1040.0 - 7200) and due_at(71.0, 30.0, 1040.0 - 7200)
    # (the plain cutoff, wall - 30, would have kept the first two for 2 h more)
    assert not 1010.0 < 80.0 + 1000.0 - 7200 - 30.0


def test_after_a_step_forward_nothing_goes_early():
    frames = Frames()
    frames.look(1000.0, 0.0)
    frames.seen([1010.0], 1010.0, 10.0)
    assert frames.look(1020.0 + 7200, 20.0) == 7200
    # At monotonic 30 a 60 s retention keeps the job finished at 10 (the plain cutoff,
    # wall - 60 = 8170, would delete it 2 h early).
    spans = frames.spans(60.0, 30.0, 1030.0 + 7200)
    assert not any(low <= 1010.0 < high for low, high in spans)
    assert any(low <= 1010.0 < high for low, high in frames.spans(60.0, 71.0, 1071.0 + 7200))


# -- the deletes, on a real file through the real writer ------------------------------


def _job(job_id: str, queue: str = "default") -> JobRecord:
    return JobRecord(id=job_id, spec="echo", queue=queue, args=msgspec.Raw(b"{}"), priority=0,
               enqueued_at=0.0, seq=0, limits=shared_limits(3, None, 1.0, 60.0, 3))


async def _finish(store: Store, jobs: list[tuple[JobRecord, str, float]]) -> None:
    await store.enqueue([job for job, _, _ in jobs])
    for job, state, at in jobs:
        job.state = state  # type: ignore[assignment]
    await store.save([Change(job, finished_at=at) for job, _, at in jobs])


@pytest.mark.both_backends
async def test_prune_deletes_what_is_due_oldest_first_with_its_logs(tmp_path: Path):
    store = Store(tmp_path / "rota.db", database_url=store_url(tmp_path))
    await asyncio.to_thread(store.load)
    store.start(asyncio.get_running_loop())
    try:
        await _finish(store, [(_job(f"old-{n}"), "completed", 100.0 + n) for n in range(5)]
                      + [(_job("new"), "completed", 900.0), (_job("fail"), "discarded", 100.0),
                         (_job("mail", "emails"), "completed", 100.0)])
        await store.enqueue([_job("waiting")])
        writer = store.writer.submit(lambda conn: conn.execute(
            "INSERT INTO job_logs (job_id, attempt, at, kind, level, message) VALUES"
            " ('old-0', 1, 1, 'log', 'info', 'x'), ('new', 1, 1, 'log', 'info', 'y')"))
        await writer
        await store.writer.submit(lambda conn: conn.execute(  # unique keys they hold
            "INSERT INTO unique_keys (key, job_id, covers) VALUES ('k0', 'old-0', 'active'),"
            " ('k1', 'new', 'active')"))
        retention = Retention.from_rules({"completed": 500.0}, [("emails", "completed", None)])
        cutoffs = due(retention, 1000.0)  # completed before 500; discarded kept 30 days

        assert await store.prune(cutoffs, 3, keep=set()) == {"completed": 3}
        assert await store.prune(cutoffs, 3, keep={"old-4"}) == {"completed": 1}
        assert await store.prune(cutoffs, 3, keep=set()) == {"completed": 1}
        assert await store.prune(cutoffs, 3, keep=set()) == {}

        def left(conn: Any) -> tuple[list[str], list[str], list[str]]:
            jobs = [r[0] for r in conn.execute("SELECT id FROM jobs ORDER BY id")]
            logs = [r[0] for r in conn.execute("SELECT job_id FROM job_logs")]
            keys = [r[0] for r in conn.execute("SELECT job_id FROM unique_keys")]
            return jobs, logs, keys

        assert await store.readers.run(left) == (["fail", "mail", "new", "waiting"], ["new"],
                                                 ["new"])
        assert await store.get_job("old-0") is None
        # With spans (the wall clock stepped): only rows finished inside one of them.
        spanned = [Cutoff("completed", 0.0, None, ("emails",), ((-math.inf, 50.0),
                                                               (800.0, 950.0)))]
        await _finish(store, [(_job("early"), "completed", 10.0),
                              (_job("between"), "completed", 600.0)])
        assert await store.prune(spanned, 10, keep=set()) == {"completed": 2}
        assert await store.get_job("between") is not None and await store.get_job("new") is None
    finally:
        await asyncio.to_thread(store.close)


@pytest.mark.both_backends
async def test_a_finished_workflow_goes_with_its_last_job(tmp_path: Path):
    """Issue 24: retention deletes a workflow's jobs as any others; the workflow (its row
    and nodes) goes once none of its jobs is left, and a running one stays."""
    store = Store(tmp_path / "rota.db", database_url=store_url(tmp_path))
    await asyncio.to_thread(store.load)
    store.start(asyncio.get_running_loop())
    try:
        jobs = []
        for job_id, flow, at in (("a1", "done", 100.0), ("a2", "done", 700.0),
                                 ("b1", "going", 100.0)):
            job = _job(job_id)
            job.workflow_id, job.workflow_node = flow, 1
            jobs.append((job, "completed", at))
        await _finish(store, jobs)
        for flow, state in (("done", "completed"), ("going", "running")):
            await store.writer.submit(lambda conn, flow=flow, state=state: (conn.execute(
                "INSERT INTO workflows (id, type, state, digest, created_at, job_count,"
                " steps_total, max_parent_results) VALUES (?, 'group', ?, 'd', 1, 2, 2,"
                " 65536)", (flow, state)), conn.execute(
                "INSERT INTO workflow_nodes (workflow_id, node, end_node, kind, position,"
                " state) VALUES (?, 0, 1, 'group', 0, 'active')", (flow,))))

        def flows(conn: Any) -> list[tuple[str, int]]:
            return [(r[0], r[1]) for r in conn.execute(
                "SELECT w.id, (SELECT count(*) FROM workflow_nodes n WHERE n.workflow_id"
                " = w.id) FROM workflows w ORDER BY w.id")]

        retention = Retention.from_rules({"completed": 500.0}, [])
        assert await store.prune(due(retention, 1000.0), 10, keep=set()) == {"completed": 2}
        assert await store.readers.run(flows) == [("done", 1), ("going", 1)]  # a2 is left
        assert await store.prune(due(retention, 1300.0), 10, keep=set()) == {"completed": 1}
        assert await store.readers.run(flows) == [("going", 1)]
    finally:
        await asyncio.to_thread(store.close)


# -- a stream through a real server ---------------------------------------------------

JOBS = int(os.environ.get("ROTA_RETENTION_JOBS", "100000"))
BATCH = 1000
BACKLOG = 4000  # jobs enqueued and not yet finished, at most


async def _stream(live: Live, count: int) -> None:
    """Enqueue ``count`` jobs in batches, keeping the backlog bounded (as a steady
    producer does), and wait until every one has finished."""
    scheduler = live.coordinator.scheduler
    sent = 0
    while sent < count:
        await wait_until(lambda: scheduler.live() <= BACKLOG - BATCH, timeout=30,
                         what="the backlog to drain")
        body = {"jobs": [{"spec": "noop", "args": {"n": sent + n}} for n in range(BATCH)]}
        response = await live.http.post("/jobs/batch", json=body, timeout=30)
        assert response.status_code == 200, response.text
        sent += BATCH
    await wait_until(lambda: scheduler.live() == 0, timeout=60, what="every job finished")


def _rows(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        count: int = conn.execute("SELECT count(*) FROM jobs").fetchone()[0]
    conn.close()
    return count


# 100,000 jobs: well under a minute alone, but a loaded CI machine may take longer.
@pytest.mark.soak
@pytest.mark.timeout(180)
# On SQLite: its file's size levels off (PostgreSQL's autovacuum reuses space on its own
# schedule).
async def test_a_stream_of_jobs_levels_the_file_off(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture):
    await _stream_through_retention(tmp_path, caplog, JOBS, levels_off=True)


async def test_a_short_stream_of_jobs_is_pruned_as_it_goes(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture):
    """The soak run at 1/20 of its size: every job is pruned and the prune lines are
    rate-limited. (The file's size is judged at full size only: at 5,000 jobs it is
    within what one prune batch moves.)"""
    await _stream_through_retention(tmp_path, caplog, JOBS // 20, levels_off=False)


async def _stream_through_retention(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                    jobs: int, *, levels_off: bool) -> None:
    caplog.set_level(logging.INFO, logger="rota.server")
    spec = write_spec(tmp_path / "specs", "noop")
    live = await start_server(tmp_path, durability="process", retain_completed=0.5)
    worker = Worker(url=live.ws, specs_dir=tmp_path / "specs", concurrency=20,
                    handle_signals=False)

    @worker.handler("noop")
    async def noop(ctx: Any) -> None:
        return None

    running = asyncio.create_task(worker.run(), name="sdk-noop")
    db = tmp_path / "rota.db"
    try:
        await live.push(spec)
        first = await live.enqueue("noop", {"n": "first"}, id="first")
        await live.wait_state(first["id"], "completed")
        started = time.monotonic()
        await _stream(live, jobs // 2)
        half = db.stat().st_size
        await _stream(live, jobs // 2)
        whole = db.stat().st_size
        took = time.monotonic() - started
        if levels_off:
            # Without retention the second half adds as much as the first did (measured:
            # 19.8 MB after 50,000 jobs, 38.5 MB after 100,000); with it the freed pages
            # are reused (4.7 MB and 4.7 MB).
            assert whole <= half * 1.25 + (1 << 20), (half, whole)
        await wait_until(lambda: _rows(db) == 0, timeout=10, what="every job pruned")
        gone = await live.http.get("/jobs/first")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"
        print(f"retention stream: {jobs} jobs in {took:.1f}s; file {half} -> {whole} bytes")
    finally:
        worker.stop()
        await asyncio.wait_for(running, timeout=10)
        await stop_server(live)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prune ")]
    assert lines and all("completed=" in line for line in lines)
    assert len(lines) <= took / 10 + 2  # rate-limited: at most one per 10 s
