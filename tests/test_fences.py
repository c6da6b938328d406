"""The row decides (docs/scaling.md): a reservation or a transition written from a stale
copy of a job changes nothing, straight on a real store. With one server these never
trip; with several sharing a database they keep each job in one reservation at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from conftest import store_url

from rota.model import Change, Job, JobState, shared_limits
from rota.ready import Claim
from rota.ready import WorkerSlot
from rota.store import Store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    store = Store(tmp_path / "rota.db", server_id="a")
    await asyncio.to_thread(store.load)
    store.start(asyncio.get_running_loop())
    yield store
    await asyncio.to_thread(store.close)


def new_job(job_id: str) -> Job:
    return Job(id=job_id, spec="echo", queue="default", args=msgspec.Raw(b"{}"), priority=0,
               enqueued_at=1.0, seq=0, limits=shared_limits(25, None, 1.0, 3600.0, 3))


def reserved_copy(job: Job, seq: int, worker: str, attempt: int) -> Job:
    copy = new_job(job.id)
    copy.seq, copy.state, copy.worker_id, copy.attempt = seq, JobState.ACTIVE, worker, attempt
    copy.checksum, copy.lease_expires_at = "c", 100.0
    return copy


async def test_a_whole_job_is_reserved_once_and_the_stale_copy_hears_it_lost(store: Store):
    [(row, _)] = await store.enqueue([new_job("j")])
    first = await store.reserve([reserved_copy(new_job("j"), row["rowid"], "w1", 1)], 2.0)
    assert first.lost == frozenset()
    # A second server's copy, made from the same waiting row, reserves nothing.
    second = await store.reserve([reserved_copy(new_job("j"), row["rowid"], "w2", 1)], 2.0)
    assert second.lost == {"j"}
    stored = await store.get_job("j")
    assert stored is not None
    assert (stored["worker_id"], stored["attempt"], stored["server_id"]) == ("w1", 1, "a")


async def test_a_transition_from_a_stale_attempt_changes_nothing(store: Store):
    [(row, _)] = await store.enqueue([new_job("j")])
    held = reserved_copy(new_job("j"), row["rowid"], "w1", 1)
    await store.reserve([held], 2.0)
    stale = reserved_copy(new_job("j"), row["rowid"], "w0", 0)  # before the reservation
    stale.state = JobState.COMPLETED
    await store.save([Change(stale, result=b'"old"', finished_at=3.0)])
    stored = await store.get_job("j")
    assert stored is not None and stored["state"] == "active" and stored["result"] is None
    held.state = JobState.COMPLETED
    await store.save([Change(held, result=b'"new"', finished_at=3.0)])
    stored = await store.get_job("j")
    assert stored is not None and (stored["state"], stored["result"]) == ("completed", '"new"')
    assert stored["server_id"] == "a"  # kept for the audit: which server's worker ran it


async def test_a_key_claimed_twice_in_one_round_reserves_one_job(store: Store):
    [(row, _)] = await store.enqueue([new_job("j")])
    worker = WorkerSlot(id="w1", queues=["default"], concurrency=2, specs={"echo": "c"},
                        capacity=2)
    claims = [Claim(row["rowid"], "default", "echo", 0, worker, "c")] * 2
    outcome = await store.reserve([], 2.0, claims)
    assert [job is not None for job in outcome.read] == [True, False]


async def test_after_a_lapsed_lease_the_jobs_still_this_servers_are_kept(store: Store):
    """Server a's lease lapsed and another server recovered its reservations. Of the jobs
    a's workers still run: one the recovery made wait is taken back, one a reserved after
    the recovery is its own already; one given out again elsewhere, and one that ended
    there, are not a's any more."""
    seqs: dict[str, int] = {}
    for name in ("recovered", "ours", "elsewhere", "ended"):
        [(row, _)] = await store.enqueue([new_job(name)])
        seqs[name] = row["rowid"]
    held = [reserved_copy(new_job(name), seq, "w1", 1) for name, seq in seqs.items()]
    await store.reserve(held, 2.0)

    def elsewhere(conn: object) -> None:  # the recovery, then another server's work
        run = conn.execute  # type: ignore[attr-defined]
        run("UPDATE jobs SET state = 'available', worker_id = NULL, server_id = NULL,"
            " lease_expires_at = NULL WHERE id IN ('recovered', 'elsewhere', 'ended')")
        run("UPDATE jobs SET state = 'active', attempt = 2, worker_id = 'w9', server_id = 'b'"
            " WHERE id IN ('elsewhere', 'ended')")
        run("UPDATE jobs SET state = 'completed', server_id = NULL WHERE id = 'ended'")

    await store.writer.submit(elsewhere)
    assert sorted(await store.take_back(held)) == ["ours", "recovered"]
    for name in ("recovered", "ours"):
        stored = await store.get_job(name)
        assert stored is not None
        assert (stored["state"], stored["worker_id"], stored["server_id"], stored["attempt"],
                stored["lease_expires_at"] is not None) == ("active", "w1", "a", 1, True)
    for name in ("elsewhere", "ended"):
        stored = await store.get_job(name)
        assert stored is not None and (stored["worker_id"], stored["attempt"]) == ("w9", 2)


@pytest.fixture
async def either_store(tmp_path: Path) -> AsyncIterator[Store]:
    """The store on the test's backend (both_backends): SQLite, or PostgreSQL."""
    store = Store(tmp_path / "rota.db", server_id="a", database_url=store_url(tmp_path))
    await asyncio.to_thread(store.load)
    store.start(asyncio.get_running_loop())
    yield store
    await asyncio.to_thread(store.close)


@pytest.mark.both_backends
async def test_a_worker_id_takes_over_only_its_own_tokens_reservations(either_store: Store):
    """A job's row keeps the token its worker connected with (a whole job's reservation
    and a claim alike), and a take-over from another server is fenced on it: a worker
    id registered by another token takes nothing (issue 20, item 3)."""
    store = either_store
    rows = [(await store.enqueue([new_job(name)]))[0][0] for name in ("whole", "claimed")]
    whole = reserved_copy(new_job("whole"), rows[0]["rowid"], "w1", 1)
    whole.worker_token = "tok-a"
    worker = WorkerSlot(id="w1", queues=["default"], concurrency=2, specs={"echo": "c"},
                        capacity=2, token="tok-a")
    outcome = await store.reserve([whole], 2.0,
                                  [Claim(rows[1]["rowid"], "default", "echo", 0, worker, "c")])
    [claimed] = outcome.read
    assert claimed is not None and claimed.worker_token == "tok-a"

    def on_server_b(conn: object) -> None:  # the worker's server was another one
        conn.execute("UPDATE jobs SET server_id = 'b'")  # type: ignore[attr-defined]

    await store.writer.submit(on_server_b)
    # Taken by nobody, and the worker id named as another token's (its registration is
    # then refused: Coordinator.take_over).
    assert await store.take_over("w1", ["claimed", "whole"], "tok-b") == ([], {"tok-a"})
    taken, others = await store.take_over("w1", ["claimed", "whole"], "tok-a")
    assert sorted((j.id, j.worker_token) for j in taken) == [("claimed", "tok-a"),
                                                             ("whole", "tok-a")]
    assert others == set()
