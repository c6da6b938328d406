"""The row decides (docs/scaling.md): a reservation or a transition written from a stale
copy of a job changes nothing, straight on a real store. With one server these never
trip; with several sharing a database they keep each job in one reservation at a time."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from conftest import Live, open_store, store_url, write_spec

from rota.core.engine import ROW_REFUSED
from rota.core.model import Change, JobRecord, JobState, shared_limits
from rota.core.ready import Claim
from rota.core.ready import WorkerSlot
from rota.store.store import Store

pytestmark = pytest.mark.both_backends


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    store = Store(tmp_path / "rota.db", server_id="a", database_url=store_url(tmp_path))
    await asyncio.to_thread(store.load)
    store.start(asyncio.get_running_loop())
    yield store
    await asyncio.to_thread(store.close)


def new_job(job_id: str) -> JobRecord:
    return JobRecord(id=job_id, spec="echo", queue="default", args=msgspec.Raw(b"{}"), priority=0,
               enqueued_at=1.0, seq=0, limits=shared_limits(25, None, 1.0, 3600.0, 3))


def reserved_copy(job: JobRecord, seq: int, worker: str, attempt: int) -> JobRecord:
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
    assert await store.save([Change(stale, result=b'"old"', finished_at=3.0)]) == {"j": None}
    stored = await store.get_job("j")
    assert stored is not None and stored["state"] == "active" and stored["result"] is None
    held.state = JobState.COMPLETED
    assert await store.save([Change(held, result=b'"new"', finished_at=3.0)]) == {}
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


async def test_a_worker_id_takes_over_only_its_own_tokens_reservations(store: Store):
    """A job's row keeps the token its worker connected with (a whole job's reservation
    and a claim alike), and a take-over from another server is fenced on it: a worker
    id registered by another token takes nothing (issue 20, item 3)."""
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


async def test_a_take_over_refused_moves_nothing_and_takes_only_queues_the_token_serves(
        store: Store):
    """A worker id another token's worker holds a named job under takes nothing, not
    even the jobs no token holds (reserved before tokens); one it may use takes only
    jobs of the queues its token may serve, as a reclaim on one server (issue 20, item 3)."""
    names = ("theirs", "tokenless", "mail")
    for name in names:
        [(row, _)] = await store.enqueue([new_job(name)])
        await store.reserve([reserved_copy(new_job(name), row["rowid"], "w1", 1)], 2.0)

    def on_server_b(conn: object) -> None:
        run = conn.execute  # type: ignore[attr-defined]
        run("UPDATE jobs SET server_id = 'b', worker_token = NULL")
        run("UPDATE jobs SET worker_token = 'tok-a' WHERE id = 'theirs'")
        run("UPDATE jobs SET queue = 'mail' WHERE id = 'mail'")

    async def servers() -> list[str]:
        return [(await store.get_job(name) or {}).get("server_id") for name in names]

    await store.writer.submit(on_server_b)
    assert await store.take_over("w1", list(names), "tok-b") == ([], {"tok-a"})
    assert await servers() == ["b", "b", "b"]
    taken, others = await store.take_over("w1", ["tokenless", "mail"], "tok-b", {"default"})
    assert ([job.id for job in taken], others) == (["tokenless"], set())
    assert await servers() == ["b", "a", "b"]


async def test_a_producers_new_kept_id_answers_with_its_job_from_before_the_upgrade(
        store: Store):
    """A job a token enqueued before producers' ids were kept as ``<token id>:<id>`` is
    the one a repeat of its id under the kept form names (issue 20, item 4): no second
    row. Another token's row under that id is not, and the kept id's own row comes first."""
    def made(job_id: str, token: str) -> JobRecord:
        job = new_job(job_id)
        job.created_by = token
        return job

    await store.enqueue([made("order-17", "tok-a"), made("order-18", "tok-a")])
    [(again, new)] = await store.enqueue([made("tok-a:order-17", "tok-a")],
                                         unscoped=["order-17"])
    assert (again["id"], new) == ("order-17", False)
    assert await store.get_job("tok-a:order-17") is None
    [(theirs, new)] = await store.enqueue([made("tok-b:order-17", "tok-b")],
                                          unscoped=["order-17"])
    assert (theirs["id"], new) == ("tok-b:order-17", True)
    await store.enqueue([made("tok-a:order-18", "tok-a")])  # as a Rota before this fix did
    [(kept, new)] = await store.enqueue([made("tok-a:order-18", "tok-a")], unscoped=["order-18"])
    assert (kept["id"], new) == ("tok-a:order-18", False)


async def test_a_save_names_each_change_its_row_refused_and_how_the_row_waits(store: Store):
    """Of one batch, a change whose row moved on (completed elsewhere at attempt 2; made
    to wait again at attempt 2; deleted) is named, with the row if it waits; the others
    are stored."""
    seqs: dict[str, int] = {}
    for name in ("kept", "done_elsewhere", "waits_again", "deleted"):
        [(row, _)] = await store.enqueue([new_job(name)])
        seqs[name] = row["rowid"]
    held = {name: reserved_copy(new_job(name), seq, "w1", 1) for name, seq in seqs.items()}
    await store.reserve(list(held.values()), 2.0)

    def behind(conn: object) -> None:
        run = conn.execute  # type: ignore[attr-defined]
        run("UPDATE jobs SET state = 'completed', attempt = 2, worker_id = 'w9',"
            " result = '\"theirs\"' WHERE id = 'done_elsewhere'")
        run("UPDATE jobs SET state = 'available', attempt = 2, worker_id = NULL,"
            " server_id = NULL WHERE id = 'waits_again'")
        run("DELETE FROM jobs WHERE id = 'deleted'")

    await store.writer.submit(behind)
    for job in held.values():
        job.state = JobState.COMPLETED
    refused = await store.save([Change(job, result=b'"mine"', finished_at=3.0)
                                for job in held.values()])
    assert sorted(refused) == ["deleted", "done_elsewhere", "waits_again"]
    assert refused["done_elsewhere"] is None and refused["deleted"] is None
    again = refused["waits_again"]
    assert again is not None and (again.state, again.attempt) == (JobState.AVAILABLE, 2)
    rows = {name: await store.get_job(name) for name in seqs}
    assert (rows["kept"] or {}).get("result") == '"mine"'
    assert [(rows["done_elsewhere"] or {}).get(k) for k in ("state", "attempt", "result")] \
        == ["completed", 2, '"theirs"']
    assert (rows["waits_again"] or {}).get("state") == "available"


async def test_a_result_the_row_refuses_is_acked_rejected_on_a_live_server(
        live: Live, connect, tmp_path: Path, caplog: pytest.LogCaptureFixture):
    """issue 20 item 2: the row was completed behind this server's back (by another
    server, or by hand) at attempt 2; the worker's result for attempt 1 arrives. The ack
    says rejected, the row is unchanged, nothing is logged or counted as completed, and
    the server keeps serving the worker."""
    spec = write_spec(tmp_path, "echo")
    await live.push(spec)
    worker = await connect()
    await worker.register([spec], concurrency=2)
    job = await live.enqueue("echo")
    [copy] = await worker.jobs(1)
    assert copy["attempt"] == 1
    conn = open_store(tmp_path)
    try:
        conn.execute("UPDATE jobs SET state = 'completed', attempt = 2, worker_id = 'other',"
                     " result = '\"theirs\"', finished_at = 1.0 WHERE id = ?", (job["id"],))
    finally:
        conn.close()
    with caplog.at_level(logging.INFO, logger="rota.server"):
        ack = await worker.complete(copy, result="mine")
    assert ack.get("accepted", []) == []
    assert ack["rejected"] == [{"job_id": job["id"], "attempt": 1, "reason": ROW_REFUSED}]
    row = await live.job(job["id"])
    assert (row["state"], row["attempt"], row["worker_id"], row["result"]) == \
        ("completed", 2, "other", "theirs")
    lines = [r.getMessage() for r in caplog.records]
    assert not [line for line in lines if "outcome=completed" in line]
    assert [line for line in lines if f"refused by the row job={job['id']}" in line]
    series = (await live.http.get("/stats?minutes=5")).json()["series"]
    assert sum(sum(s["completed"]) for s in series) == 0
    # The server forgot its stale copy and serves the worker on: the next job completes.
    second = await live.enqueue("echo")
    [copy] = await worker.jobs(1)
    assert (await worker.complete(copy, result=2))["accepted"] == [second["id"]]
    assert (await live.wait_state(second["id"], "completed"))["result"] == 2


async def test_a_retry_is_any_servers_to_write_and_an_ending_only_the_holders(store: Store):
    """A finished row keeps the server whose worker ran it (for the audit): another
    server's ending of it is refused, but its retry by an operator there is stored."""
    [(row, _)] = await store.enqueue([new_job("j")])

    def ran_on_b(conn: object) -> None:
        conn.execute("UPDATE jobs SET state = 'discarded', attempt = 1, worker_id = 'w9',"  # type: ignore[attr-defined]
                     " server_id = 'b', finished_at = 3.0 WHERE id = 'j'")

    await store.writer.submit(ran_on_b)
    ending = reserved_copy(new_job("j"), row["rowid"], "w1", 1)
    ending.state = JobState.RETRYABLE
    # Refused: the row is another holder's (several servers), and finished (any store:
    # only a retry moves a finished row, writes.SAVE).
    assert await store.save([Change(ending)]) == {"j": None}
    assert (await store.get_job("j") or {}).get("state") == "discarded"
    retry = reserved_copy(new_job("j"), row["rowid"], "w1", 1)
    retry.state, retry.worker_id, retry.budget_start = JobState.AVAILABLE, None, 1
    assert await store.save([Change(retry, retry=True)]) == {}
    stored = await store.get_job("j")
    assert stored is not None and (stored["state"], stored["server_id"]) == ("available", None)


async def test_a_second_retry_of_a_job_made_available_again_is_refused(store: Store):
    """Two retries of one discarded job, each from its own read of the row (two servers):
    the first is stored, the second finds the row waiting again and is refused, whoever
    holds the row (server_id NULL after the first)."""
    [(row, _)] = await store.enqueue([new_job("j")])

    def discarded(conn: object) -> None:
        conn.execute("UPDATE jobs SET state = 'discarded', attempt = 1, worker_id = 'w9',"  # type: ignore[attr-defined]
                     " server_id = NULL, finished_at = 3.0 WHERE id = 'j'")

    await store.writer.submit(discarded)
    retries = []
    for _ in range(2):
        retry = reserved_copy(new_job("j"), row["rowid"], "w1", 1)
        retry.state, retry.worker_id, retry.budget_start = JobState.AVAILABLE, None, 1
        retries.append(retry)
    assert await store.save([Change(retries[0], retry=True)]) == {}
    refused = await store.save([Change(retries[1], retry=True)])
    assert list(refused) == ["j"]
    stored = await store.get_job("j")
    assert stored is not None and (stored["state"], stored["budget_start"]) == ("available", 1)


async def test_a_cancel_the_row_refuses_is_not_answered_as_done(live: Live, tmp_path: Path,
                                                                backend: str):
    """A waiting job this server holds whole is cancelled, but its row moved on behind
    the server: finished elsewhere, the cancel is refused (409); on PostgreSQL, reserved
    by another server's worker, the cancel is passed on to that server (202)."""
    await live.push(write_spec(tmp_path, "echo"))
    for job_id in ("finished-elsewhere", "running-elsewhere"):
        await live.enqueue("echo", id=job_id, ttl=3600)  # held whole (a time to live)
    conn = open_store(tmp_path)
    try:
        conn.execute("UPDATE jobs SET state = 'completed', attempt = 1, worker_id = 'w9',"
                     " finished_at = 1.0 WHERE id = 'finished-elsewhere'")
        conn.execute("UPDATE jobs SET state = 'active', attempt = 1, worker_id = 'w9',"
                     " server_id = 'other' WHERE id = 'running-elsewhere'")
    finally:
        conn.close()
    response = await live.http.delete("/jobs/finished-elsewhere")
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "not_cancellable"
    assert (await live.job("finished-elsewhere"))["state"] == "completed"
    response = await live.http.delete("/jobs/running-elsewhere")
    assert response.status_code == 202, response.text
    row = await live.job("running-elsewhere")
    assert row["state"] == "active"
    if backend == "postgres":  # the server that holds it hears the cancel
        assert row["cancel_requested"] is True


async def test_a_copy_coming_due_does_not_bring_back_a_job_cancelled_behind_it(store: Store):
    """Another server (or a unique enqueue's replace) cancelled a scheduled job this
    server holds too: its copy, coming due, writes nothing, and hears the row is gone."""
    job = new_job("later")
    job.state, job.run_at = JobState.SCHEDULED, 50.0
    [(row, _)] = await store.enqueue([job])
    await store.writer.submit(lambda conn: conn.execute(
        "UPDATE jobs SET state = 'cancelled', finished_at = 2.0 WHERE id = 'later'"))
    due = new_job("later")
    due.seq, due.state = row["rowid"], JobState.AVAILABLE
    assert await store.save([Change(due)]) == {"later": None}
    assert (await store.get_job("later") or {}).get("state") == "cancelled"
