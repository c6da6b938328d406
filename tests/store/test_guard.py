"""The database guard (rota/store/limits.py), straight on real stores: two servers' stores on
one PostgreSQL reserving jobs of one concurrency key at once never hold more than its
limit, nor start more than its rate allows; SQLite records the starts; a restart reads
them back. (The engine's own limits are fake-clock tests of the core.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from rota.core.effects import Guard
from rota.core.limits import Rate
from rota.core.model import ClockReading, JobRecord, JobState, shared_limits
from rota.core.ready import Claim, WorkerSlot
from rota.store.store import Store


def new_job(job_id: str, key: str) -> JobRecord:
    return JobRecord(id=job_id, spec="echo", queue="default", args=msgspec.Raw(b"{}"),
                     priority=0, enqueued_at=1.0, seq=0, concurrency_key=key,
                     limits=shared_limits(25, None, 1.0, 3600.0, 3))


async def opened(tmp: Path, server: str, url: str | None) -> Store:
    store = Store(tmp / "rota.db", server_id=server, database_url=url,
                  hold_reserve=0.05 if url else 0.0)  # (a window for the other to race in)
    await asyncio.to_thread(store.load)
    store.start(asyncio.get_running_loop())
    return store


@pytest.fixture
async def two(tmp_path: Path, pg_url: str) -> AsyncIterator[tuple[Store, Store]]:
    a, b = await opened(tmp_path, "a", pg_url), await opened(tmp_path, "b", pg_url)
    yield a, b
    for store in (a, b):
        await asyncio.to_thread(store.close)


async def stored(store: Store, jobs: list[JobRecord]) -> list[JobRecord]:
    for job, (row, new) in zip(jobs, await store.enqueue(jobs), strict=True):
        assert new
        job.seq = row["rowid"]
    return jobs


def as_reserved(job: JobRecord, worker: str) -> JobRecord:
    job.state, job.worker_id, job.attempt = JobState.ACTIVE, worker, job.attempt + 1
    job.checksum, job.lease_expires_at = "c", 100.0
    return job


async def active(store: Store, key: str) -> int:
    return await store.readers.run(lambda conn: conn.execute(
        "SELECT count(*) FROM jobs WHERE state = 'active' AND concurrency_key = ?",
        (key,)).fetchone()[0])


async def test_two_servers_reserving_one_key_at_once_never_pass_its_limit(
        two: tuple[Store, Store]):
    """A reserves whole jobs and B claims compact ones, of one key, at the same moment,
    each as if it were alone (its memory says nothing runs): the database holds them to 3
    in all, refuses the rest (still available), and a job that ends lets one more in."""
    a, b = two
    jobs = await stored(a, [new_job(f"j{n}", "acme") for n in range(10)])
    limit = (Guard("spec:echo", "acme", 3, None), Guard("spec:echo", None, 8, None))
    worker = WorkerSlot("wb", ["default"], 10, {"echo": "c"})
    mine = [as_reserved(job, "wa") for job in jobs[:5]]
    claims = [Claim(job.seq, "default", "echo", 0, worker, "c") for job in jobs[5:]]
    got_a, got_b = await asyncio.gather(
        a.reserve(mine, 2.0, guards={job.id: limit for job in mine}),
        b.reserve([], 2.0, claims, guards={c.seq: limit for c in claims}))
    held = 5 - len(got_a.refused) + sum(job is not None for job in got_b.read)
    assert held == 3 and await active(a, "acme") == 3
    assert len(got_a.refused) + len(got_b.refused) == 7
    assert all(got_b.read[n] is None for n, c in enumerate(claims) if c.seq in got_b.refused)
    # Whichever came second was refused (the first reserved what it asked, up to 3).
    assert sorted((len(got_a.refused), len(got_b.refused))) in ([2, 5], [0, 7])
    # It says which limit was full: the key's (the spec's, 8, was not).
    assert got_a.full | got_b.full == {("spec:echo", "acme")}
    # Nothing refused moved: it waits, for whoever has room next.
    waiting = await a.waiting_jobs([job.seq for job in jobs])
    assert len(waiting) == 7 and all(job.state == "available" for job in waiting)
    # Another key is not held back by this one's limit; the spec's own (8) still holds.
    other = await stored(a, [new_job(f"o{n}", "other") for n in range(9)])
    again = await b.reserve([as_reserved(job, "wb") for job in other], 3.0,
                            guards={job.id: (Guard("spec:echo", "other", 3, None),
                                             limit[1]) for job in other})
    assert len(again.refused) == 6 and await active(a, "other") == 3


async def test_two_servers_starting_one_key_at_once_keep_its_rate(
        two: tuple[Store, Store], tmp_path: Path, pg_url: str):
    """4 starts a minute for key acme, asked by both servers at once (and a burst of 2):
    2 start now, nothing more until the spacing allows; and a restart reads the starts
    back, so a window goes on."""
    a, b = two
    t0 = time.time()  # (a restart reads back the starts of the last day)
    jobs = await stored(a, [new_job(f"r{n}", "acme") for n in range(8)])
    rate = (Guard("spec:echo", "acme", None, Rate(4, 60.0, burst=2)),)
    first, second = [as_reserved(j, "wa") for j in jobs[:4]], [as_reserved(j, "wb") for j in jobs[4:]]
    got_a, got_b = await asyncio.gather(
        a.reserve(first, t0, guards={j.id: rate for j in first}),
        b.reserve(second, t0, guards={j.id: rate for j in second}))
    assert len(got_a.refused) + len(got_b.refused) == 6 and await active(a, "acme") == 2
    # 15 s later (period / limit apart) one more may start; 30 s later, the 4th.
    later = [j for j in first + second if j.id in got_a.refused | got_b.refused]
    assert len((await a.reserve(later[:2], t0 + 10, guards={j.id: rate for j in later[:2]})
                ).refused) == 2
    assert len((await b.reserve(later[:2], t0 + 15.5, guards={j.id: rate for j in later[:2]})
                ).refused) == 1
    restarted = await opened(tmp_path / "again", "c", pg_url)
    try:
        snapshot = await asyncio.to_thread(restarted.load)
        # (each recorded as its commit landed: the first two then, not at the plan's t0)
        [(name, starts)] = snapshot.limit_starts.items()
        assert name == ("spec:echo", "acme") and starts[2] == t0 + 15.5, starts
        assert all(t0 <= at < t0 + 5 for at in starts[:2]), starts
    finally:
        await asyncio.to_thread(restarted.close)


async def test_sqlite_records_the_starts_and_refuses_nothing(tmp_path: Path):
    """One server per file: its memory is exact, so the store only keeps the starts."""
    store = await opened(tmp_path, "a", None)
    try:
        jobs = await stored(store, [new_job(f"s{n}", "k") for n in range(3)])
        rate = (Guard("queue:default", None, None, Rate(1, 60.0)),)
        t0 = time.time()
        got = await store.reserve([as_reserved(j, "w") for j in jobs], t0,
                                  guards={j.id: rate for j in jobs})
        assert got.refused == frozenset() and await active(store, "k") == 3
    finally:
        await asyncio.to_thread(store.close)
    snapshot = await asyncio.to_thread(Store(tmp_path / "rota.db").load)
    [(name, starts)] = snapshot.limit_starts.items()  # (as the commit landed)
    assert name == ("queue:default", None) and len(starts) == 3, starts
    assert all(t0 <= at < t0 + 5 and at == starts[0] for at in starts), starts


async def test_a_step_between_runs_moves_the_starts_with_it(tmp_path: Path):
    """The wall clock stepped 2 h back between two runs on one file: the starts the last
    run recorded are moved with the jobs' deadlines (writes.undo_step), so a restart's
    windows hold them as long ago as they were, not 2 h ahead."""
    store = Store(tmp_path / "rota.db")
    boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    t0 = time.time()
    await asyncio.to_thread(store.load, ClockReading(t0, boot, "b1"))
    store.start(asyncio.get_running_loop())
    try:
        jobs = await stored(store, [new_job(f"s{n}", "k") for n in range(2)])
        rate = (Guard("queue:default", None, None, Rate(5, 60.0)),)
        await store.reserve([as_reserved(j, "w") for j in jobs], t0,
                            guards={j.id: rate for j in jobs})
        await store.note_clock(ClockReading(t0, boot, "b1"))
    finally:
        await asyncio.to_thread(store.close)
    # 10 s later by the boot clock; the wall clock reads 2 h less than that
    snapshot = await asyncio.to_thread(Store(tmp_path / "rota.db").load,
                                       ClockReading(t0 + 10 - 7200, boot + 10, "b1"))
    assert snapshot.clock_step == -7200
    [(name, starts)] = snapshot.limit_starts.items()
    assert name == ("queue:default", None) and len(starts) == 2, starts
    assert all(t0 - 7200 <= at < t0 - 7195 for at in starts), starts


async def test_starts_restamped_while_running_replace_those_recorded(tmp_path: Path):
    """After a step seen while the server runs, its windows' starts (on the new clock)
    are the store's: those recorded before, on the old clock, are gone."""
    store = await opened(tmp_path, "a", None)
    try:
        jobs = await stored(store, [new_job(f"s{n}", "k") for n in range(2)])
        rate = (Guard("spec:echo", "k", None, Rate(5, 60.0)),)
        t0 = time.time()
        await store.reserve([as_reserved(j, "w") for j in jobs], t0,
                            guards={j.id: rate for j in jobs})
        await store.restamp({("spec:echo", "k"): [t0 - 7200, t0 - 7199]}, -7200.0)
    finally:
        await asyncio.to_thread(store.close)
    snapshot = await asyncio.to_thread(Store(tmp_path / "rota.db").load)
    assert snapshot.limit_starts == {("spec:echo", "k"): [t0 - 7200, t0 - 7199]}
