"""Cron schedules' rows and fire transaction (rota/store/ticks.py), called straight on each
backend: a tick decided twice makes one job, a push never resumes, a resume counts from
now, and a held (enqueue) tick is released when the schedule's live job ends."""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import pytest
from conftest import open_store

from rota.core.model import JobRecord, JobState, shared_limits
from rota.core.schedules import check, tick_id
from rota.store import ticks

pytestmark = pytest.mark.both_backends
T0 = 1_800_000_000.0  # a whole minute


def job(name: str, tick: float) -> JobRecord:
    return JobRecord(id=tick_id(name, tick), spec="echo", queue="default",
                     args=msgspec.Raw(b"{}"), priority=0, enqueued_at=tick, seq=0,
                     limits=shared_limits(3, None, 1.0, 60.0, 3), schedule=name)


def defined(**fields):
    return check({"name": "beat", "spec": "echo", "cron": "@every 60s", **fields})


def states(conn) -> dict[str, str]:
    return {r[0]: r[1] for r in conn.execute("SELECT id, state FROM jobs ORDER BY id")}


def first_of_enqueue(conn) -> str:
    """An overlap enqueue schedule whose first tick (T0 + 60) fired; its stored JSON."""
    ticks.upsert(conn, defined(overlap="enqueue"), T0)
    seen = ticks.read_one(conn, "beat")["definition"]
    ticks.fire(conn, "beat", seen, T0 + 60.5, {T0 + 60: job("beat", T0 + 60)}, None)
    return seen


def test_a_tick_decided_twice_makes_one_job(tmp_path: Path):
    with contextlib.closing(open_store(tmp_path)) as conn:
        assert ticks.upsert(conn, defined(overlap="allow"), T0) == "new"
        seen = ticks.read_one(conn, "beat")["definition"]
        built = {T0 + 60: job("beat", T0 + 60)}
        first = ticks.fire(conn, "beat", seen, T0 + 60.5, built, None)
        again = ticks.fire(conn, "beat", seen, T0 + 60.5, built, None)  # another server's
        assert [new for _, _, new in first.made] == [True] and again.made == []
        row = ticks.read_one(conn, "beat")
        assert (row["last_tick"], row["run_count"], row["last_job_state"]) == (
            T0 + 60, 1, "available")
        # built from a definition since replaced: nothing is made, the loop builds again
        ticks.upsert(conn, defined(overlap="allow", args={"x": 1}), T0 + 61)
        assert ticks.fire(conn, "beat", seen, T0 + 120.5, {}, None).stale
        assert list(states(conn)) == [tick_id("beat", T0 + 60)]


def test_a_push_never_resumes_and_a_resume_counts_from_now(tmp_path: Path):
    with contextlib.closing(open_store(tmp_path)) as conn:
        ticks.upsert(conn, defined(), T0)
        ticks.set_paused(conn, "beat", True, T0 + 10)
        assert ticks.upsert(conn, defined(), T0 + 20, push=True) == "unchanged"
        assert ticks.read_one(conn, "beat")["paused"] == 1
        assert ticks.upsert(conn, defined(jitter=5), T0 + 30, push=True) == "changed"
        assert ticks.read_one(conn, "beat")["paused"] == 1
        row = ticks.set_paused(conn, "beat", False, T0 + 600.5)
        assert row is not None and ticks.start_of(row) == T0 + 600  # the pause is not missed
        assert ticks.set_paused(conn, "nobody", False, T0) is None
        assert ticks.delete(conn, "beat", T0 + 601)["name"] == "beat"
        assert ticks.read_all(conn) == []


def test_an_enqueued_tick_waits_pending_until_the_live_one_ends(tmp_path: Path):
    with contextlib.closing(open_store(tmp_path)) as conn:
        seen = first_of_enqueue(conn)
        first, second = T0 + 60, T0 + 120
        fired = ticks.fire(conn, "beat", seen, second + 0.5, {second: job("beat", second)}, None)
        assert [stored["state"] for _, stored, _ in fired.made] == ["pending"]
        assert ticks.release_next(conn, "beat", second + 1) == []  # the first is live
        conn.execute("UPDATE jobs SET state = 'completed' WHERE id = ?",
                     (tick_id("beat", first),))
        [released] = ticks.release_next(conn, "beat", second + 2)
        assert (released.id, released.state) == (tick_id("beat", second), JobState.AVAILABLE)
        assert released.schedule == "beat"
        assert states(conn)[tick_id("beat", second)] == "available"


def test_a_fire_run_again_after_a_rollback_judges_its_jobs_afresh(tmp_path: Path):
    # the writer runs every op of a batch again after a deadlock: the first run's verdict
    # (held: the previous job was live) must not stick to the jobs it was given
    with contextlib.closing(open_store(tmp_path)) as conn:
        seen = first_of_enqueue(conn)
        first, second = T0 + 60, T0 + 120
        built = {second: job("beat", second)}
        conn.execute("BEGIN")
        ticks.fire(conn, "beat", seen, second + 0.5, built, None)
        conn.execute("ROLLBACK")
        conn.execute("UPDATE jobs SET state = 'completed' WHERE id = ?",
                     (tick_id("beat", first),))
        fired = ticks.fire(conn, "beat", seen, second + 0.5, built, None)
        assert [stored["state"] for _, stored, _ in fired.made] == ["available"]
        assert built[second].state == JobState.AVAILABLE


@pytest.mark.parametrize("how", ["paused", "deleted"])
def test_a_pause_or_a_delete_cancels_the_held_ticks(tmp_path: Path, how: str):
    # nothing else would: DELETE /jobs leaves a held job to its schedule
    with contextlib.closing(open_store(tmp_path)) as conn:
        seen = first_of_enqueue(conn)
        held = [T0 + 120, T0 + 180]
        for tick in held:
            fired = ticks.fire(conn, "beat", seen, tick + 0.5, {tick: job("beat", tick)}, None)
        assert fired.held == 2
        if how == "paused":
            row = ticks.set_paused(conn, "beat", True, T0 + 200)
        else:
            row = ticks.delete(conn, "beat", T0 + 200)
        assert row is not None and row["cancelled"] == [tick_id("beat", t) for t in held]
        conn.execute("UPDATE jobs SET state = 'completed' WHERE id = ?",
                     (tick_id("beat", T0 + 60),))
        assert ticks.release_next(conn, "beat", T0 + 201) == []
        assert list(states(conn).values()) == ["completed", "cancelled", "cancelled"]
        error = conn.execute("SELECT errors FROM jobs WHERE id = ?",
                             (tick_id("beat", held[0]),)).fetchone()[0]
        assert f"its schedule beat was {how}" in error


@pytest.mark.parametrize(("policy", "made"), [
    ("skip", [300]), ("cancel_previous", [300]), ("allow", [180, 240, 300]),
    ("enqueue", [180, 240, 300])])
def test_after_downtime_the_overlap_policy_takes_the_caught_up_ticks_as_a_whole(
        tmp_path: Path, policy: str, made: list[int]):
    # catch_up = 3 after five missed minutes: under skip the stalest tick made no job that
    # kept the newest from running (it would have counted as live)
    with contextlib.closing(open_store(tmp_path)) as conn:
        ticks.upsert(conn, defined(overlap=policy, catch_up=3), T0)
        seen = ticks.read_one(conn, "beat")["definition"]
        built = {T0 + t: job("beat", T0 + t) for t in (60, 120, 180, 240, 300)}
        fired = ticks.fire(conn, "beat", seen, T0 + 330, built, None)
        assert [job.id for job, _, _ in fired.made] == [tick_id("beat", T0 + t) for t in made]
        assert (fired.missed, fired.caught, fired.skipped) == (5, len(made), [])
        assert ticks.read_one(conn, "beat")["run_count"] == len(made)


@pytest.mark.parametrize("previous", ["available", "active"])
def test_cancel_previous_cancels_in_the_fire_transaction(tmp_path: Path, previous: str):
    # a crash right after the commit must not leave both running: the cancel is stored
    with contextlib.closing(open_store(tmp_path)) as conn:
        ticks.upsert(conn, defined(overlap="cancel_previous"), T0)
        seen = ticks.read_one(conn, "beat")["definition"]
        first, second = T0 + 60, T0 + 120
        ticks.fire(conn, "beat", seen, first + 0.5, {first: job("beat", first)}, None)
        conn.execute("UPDATE jobs SET state = ? WHERE id = ?", (previous, tick_id("beat", first)))
        fired = ticks.fire(conn, "beat", seen, second + 0.5, {second: job("beat", second)}, None)
        row = conn.execute("SELECT state, cancel_requested, errors FROM jobs WHERE id = ?",
                           (tick_id("beat", first),)).fetchone()
        assert [stored["state"] for _, stored, _ in fired.made] == ["available"]
        if previous == "available":  # cancelled in place, for the engine to let go of
            assert [r["id"] for r in fired.replaced] == [tick_id("beat", first)]
            assert row[0] == "cancelled" and "overlap cancel_previous" in row[2]
            assert fired.cancel == []
        else:  # running: requested in the row, passed on to its worker after the commit
            assert (row[0], row[1], fired.replaced) == ("active", 1, [])
            assert fired.cancel == [tick_id("beat", first)]
