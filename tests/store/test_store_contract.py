"""The store's contract, on SQLite and on PostgreSQL (the both_backends marker): what the
server's scenarios rely on the store for, called straight on rota/store/store.py's Store, with no
server. The scenarios themselves (tests/server/test_server.py, test_lifecycle.py, test_backlog.py,
test_operate.py, test_reconnect.py, test_status.py, test_retire.py) run once, on SQLite;
what only PostgreSQL does (several servers on one database, its outages, its stalls) has
scenarios of its own (test_cluster.py, test_failover.py, test_stall.py, test_pg.py, and
kill -9 in test_crash.py on each backend). test_fences.py holds the row's fences, on both.

A "restart" here is what a server's start does: a new Store on the same database, and
its ``load()``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import store_url, write_spec

from rota.core.listing import parse_filter
from rota.core.model import Change, JobRecord, JobState, StatusNote, shared_limits
from rota.core.ready import SEQ_BITS
from rota.store.rows import Snapshot
from rota.base.specs import checksum
from rota.store.store import Store

pytestmark = pytest.mark.both_backends

Opener = Callable[[], Awaitable[tuple[Store, Snapshot]]]


@pytest.fixture
async def open_store(tmp_path: Path) -> AsyncIterator[Opener]:
    """Opens the test's store (a new Store on the same database each time, as a restart
    does): the store, started, and what its load() found. One is open at a time: opening
    closes the last; the last is closed at the end."""
    opened: list[Store] = []

    async def start() -> tuple[Store, Snapshot]:
        if opened:
            await asyncio.to_thread(opened[-1].close)
        store = Store(tmp_path / "rota.db", server_id="a", database_url=store_url(tmp_path))
        snapshot = await asyncio.to_thread(store.load)
        store.start(asyncio.get_running_loop())
        opened.append(store)
        return store, snapshot

    yield start
    await asyncio.to_thread(opened[-1].close)


def new_job(job_id: str, *, priority: int = 0, queue: str = "default", **fields: object) -> JobRecord:
    job = JobRecord(id=job_id, spec="echo", queue=queue, args=msgspec.Raw(b'{"n": 1}'),
              priority=priority, enqueued_at=1.0, seq=0,
              limits=shared_limits(5, 2, 1.0, 3600.0, 3))
    for name, value in fields.items():
        setattr(job, name, value)
    return job


async def enqueued(store: Store, *jobs: JobRecord) -> list[JobRecord]:
    """The jobs, stored, each with its row id (its seq)."""
    for job, (row, new) in zip(jobs, await store.enqueue(list(jobs)), strict=True):
        assert new, job.id
        job.seq = row["rowid"]
    return list(jobs)


async def reserved(store: Store, job: JobRecord, worker: str = "w1", now: float = 2.0) -> JobRecord:
    """The job, reserved for ``worker`` at its next attempt (as the engine's copy)."""
    job.state, job.worker_id, job.attempt = JobState.ACTIVE, worker, job.attempt + 1
    job.checksum, job.lease_expires_at = "c", now + 30.0
    assert (await store.reserve([job], now)).lost == frozenset()
    return job


async def test_a_restart_finds_the_waiting_jobs_in_priority_then_arrival_order(
        open_store: Opener):
    """tests/server/test_backlog.py's restart: plain waiting jobs come back as keys only, which
    sort as the scheduler gives them out (higher priority first, then first come)."""
    store, _ = await open_store()
    jobs = await enqueued(store, new_job("a"), new_job("b", priority=5), new_job("c"),
                          new_job("d", priority=-3), new_job("e", priority=5),
                          new_job("other", queue="q2"))
    by_seq = {job.seq: job.id for job in jobs}
    _, snapshot = await open_store()
    keys = sorted(snapshot.waiting[("default", "echo", None, ())])
    mask = (1 << SEQ_BITS) - 1
    assert [by_seq[key & mask] for key in keys] == ["b", "e", "a", "c", "d"]
    assert [by_seq[key & mask] for key in snapshot.waiting[("q2", "echo", None, ())]] == ["other"]
    assert snapshot.jobs == [] and snapshot.last_seq == max(by_seq)


async def test_a_restart_groups_waiting_keys_by_concurrency_key_and_labels(open_store: Opener):
    """Flow control: the keys come back by (queue, spec, concurrency_key, labels), and a
    job kept whole keeps its key and labels."""
    store, _ = await open_store()
    jobs = await enqueued(store, new_job("plain"), new_job("acme", concurrency_key="acme"),
                          new_job("gpu", labels=("gpu", "region:eu")),
                          new_job("both", concurrency_key="acme", labels=("gpu", "region:eu")),
                          new_job("later", concurrency_key="acme", labels=("gpu",),
                                  state=JobState.SCHEDULED, run_at=5000.0))
    by_seq = {job.seq: job.id for job in jobs}
    _, snapshot = await open_store()
    mask = (1 << SEQ_BITS) - 1
    assert {group: [by_seq[key & mask] for key in keys]
            for group, keys in snapshot.waiting.items()} == {
        ("default", "echo", None, ()): ["plain"],
        ("default", "echo", "acme", ()): ["acme"],
        ("default", "echo", None, ("gpu", "region:eu")): ["gpu"],
        ("default", "echo", "acme", ("gpu", "region:eu")): ["both"]}
    [later] = snapshot.jobs
    assert (later.concurrency_key, later.labels) == ("acme", ("gpu",))


async def test_a_restart_finds_every_other_live_job_whole(open_store: Opener):
    """Scheduled, with a time to live, retryable, and active (a graceful restart leaves
    running jobs to their worker; a crash after a reservation's commit leaves it for its
    worker to reclaim): each comes back as it was stored. Finished jobs do not."""
    store, _ = await open_store()
    later, scheduled, ttl, failing, running, done = await enqueued(
        store, new_job("later", state=JobState.SCHEDULED, run_at=5000.0),
        new_job("scheduled", state=JobState.SCHEDULED, run_at=4000.0, capture_logs=True,
                created_by="tok-1"),
        new_job("ttl", expires_at=3000.0, visibility_timeout=7.5),
        new_job("failing"), new_job("running"), new_job("done"))
    for job in (failing, running, done):
        await reserved(store, job)
    failing.state, failing.run_at, failing.fails = JobState.RETRYABLE, 2500.0, 1
    done.state = JobState.COMPLETED
    running.cancel_requested = True
    assert await store.save([Change(failing, error=b'{"type": "error", "attempt": 1}'),
                             Change(done, result=b'"ok"', finished_at=3.0),
                             Change(running)]) == {}

    _, snapshot = await open_store()
    back = {job.id: job for job in snapshot.jobs}
    assert sorted(back) == ["failing", "later", "running", "scheduled", "ttl"]
    assert snapshot.waiting == {}
    assert (back["scheduled"].state, back["scheduled"].run_at) == ("scheduled", 4000.0)
    assert (back["scheduled"].capture_logs, back["scheduled"].created_by) == (True, "tok-1")
    assert (back["ttl"].state, back["ttl"].expires_at) == ("available", 3000.0)
    assert back["ttl"].visibility_timeout == 7.5
    assert (back["failing"].state, back["failing"].run_at, back["failing"].fails,
            back["failing"].attempt, back["failing"].worker_id) == ("retryable", 2500.0, 1, 1,
                                                                    None)
    kept = back["running"]
    assert (kept.state, kept.worker_id, kept.attempt, kept.checksum, kept.lease_expires_at,
            kept.cancel_requested) == ("active", "w1", 1, "c", 32.0, True)
    assert kept.limits == shared_limits(5, 2, 1.0, 3600.0, 3)
    assert bytes(kept.args) == bytes(later.args)


async def test_an_id_enqueued_again_is_the_stored_job_even_fifty_at_once(open_store: Opener):
    """A producer sending a job again (its answer was lost, or fifty at once) gets the
    stored row, and one job exists."""
    store, _ = await open_store()
    await enqueued(store, new_job("once"))
    [(row, new)] = await store.enqueue([new_job("once", priority=9)])
    assert (row["id"], row["priority"], new) == ("once", 0, False)
    outcomes = await asyncio.gather(*(store.enqueue([new_job("many")]) for _ in range(50)))
    assert sorted(new for [(_, new)] in outcomes) == [False] * 49 + [True]
    assert len({row["rowid"] for [(row, _)] in outcomes}) == 1
    counts = await store.queue_counts()
    assert counts["default"]["available"] == 2


async def test_each_ending_is_stored_with_its_result_errors_and_times(open_store: Opener):
    """The rows a worker's results, a retry's backoff, a discard and a cancel leave, as
    GET /jobs/{id} reads them; a second failure appends its error."""
    store, _ = await open_store()
    ok, again, out, off = await enqueued(store, *(new_job(n) for n in ("ok", "again", "out",
                                                                       "off")))
    for job in (ok, again, out):
        await reserved(store, job)
    ok.state = JobState.COMPLETED
    again.state, again.run_at, again.fails = JobState.RETRYABLE, 10.0, 1
    out.state, out.fails = JobState.DISCARDED, 1
    off.state = JobState.CANCELLED
    first = {"type": "error", "attempt": 1, "message": "boom"}
    assert await store.save([
        Change(ok, result=b'{"answer": 42}', finished_at=3.0),
        Change(again, error=json.dumps(first).encode()),
        Change(out, error=b'{"type": "not_retryable", "attempt": 1}', finished_at=3.5),
        Change(off, finished_at=4.0)]) == {}
    rows = {job_id: await store.get_job(job_id) for job_id in ("ok", "again", "out", "off")}
    assert all(rows.values())
    assert [rows["ok"][k] for k in ("state", "attempt", "worker_id", "finished_at")] == [  # type: ignore[index]
        "completed", 1, "w1", 3.0]
    assert json.loads(rows["ok"]["result"]) == {"answer": 42}  # type: ignore[index]
    assert [rows["again"][k] for k in ("state", "run_at", "fails", "worker_id")] == [  # type: ignore[index]
        "retryable", 10.0, 1, None]
    assert json.loads(rows["again"]["errors"]) == [first]  # type: ignore[index]
    assert rows["out"]["state"] == "discarded"  # type: ignore[index]
    assert json.loads(rows["out"]["errors"])[0]["type"] == "not_retryable"  # type: ignore[index]
    assert (rows["off"]["state"], rows["off"]["finished_at"]) == ("cancelled", 4.0)  # type: ignore[index]

    # The retry's second attempt fails too: its error is appended to the first.
    again.state = JobState.AVAILABLE
    assert await store.save([Change(again)]) == {}
    await reserved(store, again)
    again.state, again.fails = JobState.DISCARDED, 2
    second = {"type": "error", "attempt": 2, "message": "boom again"}
    assert await store.save([Change(again, error=json.dumps(second).encode(),
                                    finished_at=12.0)]) == {}
    row = await store.get_job("again")
    assert row is not None and (row["state"], row["attempt"]) == ("discarded", 2)
    assert json.loads(row["errors"]) == [first, second]
    counts = await store.queue_counts()
    assert {k: v for k, v in counts["default"].items() if v} == {
        "completed": 1, "discarded": 2, "cancelled": 1}


async def test_a_retried_job_waits_again_with_a_fresh_budget_across_a_restart(
        open_store: Opener):
    """A manual retry (one job, or a bulk retry by filter) makes a discarded job wait
    again, its attempts so far no longer counted (budget_start)."""
    store, _ = await open_store()
    [job] = await enqueued(store, new_job("j"))
    await reserved(store, job)
    job.state = JobState.DISCARDED
    assert await store.save([Change(job, error=b'{"attempt": 1}', finished_at=3.0)]) == {}
    job.state, job.worker_id, job.budget_start = JobState.AVAILABLE, None, job.attempt
    assert await store.save([Change(job, retry=True)]) == {}
    row = await store.get_job("j")
    assert row is not None
    assert (row["state"], row["attempt"], row["budget_start"], row["worker_id"]) == (
        "available", 1, 1, None)
    assert len(json.loads(row["errors"])) == 1  # the history stays
    _, snapshot = await open_store()
    assert len(snapshot.waiting[("default", "echo", None, ())]) == 1


async def test_a_waiting_job_is_read_whole_from_its_row_and_cancelled_only_while_it_waits(
        open_store: Opener):
    """tests/server/test_backlog.py's cancel of a job kept as a key: the row is read whole when
    asked for, and withdrawn (cancelled) only while it is still available."""
    store, _ = await open_store()
    waiting, taken = await enqueued(store, new_job("waiting", priority=3), new_job("taken"))
    await reserved(store, taken)
    [read] = await store.waiting_jobs([waiting.seq, taken.seq, taken.seq + 100])
    assert (read.id, read.state, read.priority, read.seq) == ("waiting", "available", 3,
                                                             waiting.seq)
    assert bytes(read.args) == b'{"n": 1}' and read.limits == waiting.limits
    assert await store.withdraw(waiting.seq, 9.0) is True
    assert await store.withdraw(waiting.seq, 9.5) is False  # cancelled already
    assert await store.withdraw(taken.seq, 9.0) is False  # a worker runs it
    row = await store.get_job("waiting")
    assert row is not None and (row["state"], row["finished_at"]) == ("cancelled", 9.0)
    assert await store.waiting_jobs([waiting.seq]) == []
    assert await store.job_states(["waiting", "taken"]) == {"waiting": "cancelled",
                                                            "taken": "active"}


async def test_progress_log_lines_and_alerts_are_kept_with_the_job(open_store: Opener):
    store, _ = await open_store()
    [job] = await enqueued(store, new_job("j"))
    await reserved(store, job)
    await store.note_status([
        StatusNote("j", 1, 5.0, progress=(10.0, "starting")),
        StatusNote("j", 1, 6.0, line=("log", "INFO", "step one")),
        StatusNote("j", 1, 7.0, progress=(55.5, "halfway")),
        StatusNote("j", 1, 8.0, line=("alert", "WARNING", "disk is slow"))])
    row = await store.get_job("j")
    assert row is not None
    assert (row["progress_percent"], row["progress_message"], row["progress_at"]) == (
        55.5, "halfway", 7.0)
    lines = await store.job_logs("j", 10)
    assert [(line["attempt"], line["kind"], line["level"], line["message"])
            for line in lines] == [(1, "log", "INFO", "step one"),
                                   (1, "alert", "WARNING", "disk is slow")]
    assert [line["message"] for line in await store.job_logs("j", 1)] == ["disk is slow"]


async def test_specs_their_status_quo_a_retired_spec_and_paused_queues_survive_a_restart(
        open_store: Opener, tmp_path: Path):
    store, _ = await open_store()
    v1 = write_spec(tmp_path / "v1", "echo", version="1")
    v2 = write_spec(tmp_path / "v2", "echo", version="2")
    old = write_spec(tmp_path / "v1", "old")
    changes = await store.push_specs([(v1, checksum(v1)), (old, checksum(old))], dry_run=False)
    assert [(c.change, c.previous) for c in changes] == [("new", None), ("new", None)]
    dry = await store.push_specs([(v2, checksum(v2))], dry_run=True)
    assert [(c.change, c.previous) for c in dry] == [("changed", checksum(v1))]
    assert (await store.status_quo())[1]["echo"] == checksum(v1)  # a dry run stores nothing
    assert [c.change for c in await store.push_specs([(v2, checksum(v2))], dry_run=False)] == [
        "changed"]
    assert [c.change for c in await store.push_specs([(v2, checksum(v2))], dry_run=False)] == [
        "unchanged"]
    retired = await store.retire_spec("old", 20.0)
    assert retired is not None
    await store.set_paused("q1", True, 21.0)
    await store.set_paused("q2", True, 21.0)
    await store.set_paused("q2", False, 22.0)
    assert await store.paused_queues() == {"q1"}

    _, snapshot = await open_store()
    assert snapshot.checksums == {"echo": checksum(v2), "old": checksum(old)}
    assert snapshot.status_quo["echo"].version == "2"
    assert snapshot.retired == {"old": 20.0}
    assert snapshot.paused == {"q1"}


async def other_server_keeps(tmp_path: Path, row: tuple[Any, ...]) -> None:
    """Server "b" on the test's database adds ``row`` to its per-minute counts."""
    other = Store(tmp_path / "rota.db", server_id="b", database_url=store_url(tmp_path))
    other.start(asyncio.get_running_loop())
    try:
        await other.keep_throughput([row], 50)
    finally:
        await asyncio.to_thread(other.close)


async def test_the_per_minute_counts_add_up_per_server_and_the_hour_is_kept(
        open_store: Opener, tmp_path: Path):
    store, snapshot = await open_store()
    assert snapshot.throughput == []
    await store.keep_throughput([(100, "default", "echo", 5, 4, 1, 0, 0, 0)], 50)
    await store.keep_throughput([(100, "default", "echo", 2, 3, 0, 0, 0, 0),  # adds up
                                 (101, "mail", "send", 1, 0, 0, 0, 1, 0)], 50)
    # Another server on the database (PostgreSQL) keeps its own rows beside them.
    await other_server_keeps(tmp_path, (100, "default", "echo", 10, 0, 0, 0, 0, 0))
    await store.keep_throughput([(160, "default", "echo", 1, 0, 0, 0, 0, 0)], 101)  # 100: gone

    _, snapshot = await open_store()
    assert snapshot.throughput == [(101, "mail", "send", 1, 0, 0, 0, 1, 0),
                                   (160, "default", "echo", 1, 0, 0, 0, 0, 0)]
    store, _ = await open_store()
    await store.keep_throughput([(120, "default", "echo", 0, 2, 0, 0, 0, 0)], 50)
    await other_server_keeps(tmp_path, (120, "default", "echo", 7, 0, 0, 0, 0, 0))
    _, snapshot = await open_store()
    # Each server of a shared database loads its own (its /stats counts what it saw, as
    # docs/scaling.md says); a SQLite file's one server at a time, whatever its name, all.
    mine = (120, "default", "echo", 0, 2, 0, 0, 0, 0)
    both = (120, "default", "echo", 7, 2, 0, 0, 0, 0)
    assert snapshot.throughput[1] == (mine if store_url(tmp_path) else both)


async def test_listing_pages_newest_first_and_counts_by_filter(open_store: Opener):
    """GET /jobs and the bulk actions' counts, as the store answers them."""
    store, _ = await open_store()
    jobs = await enqueued(store, *(new_job(f"j{n}", queue=("q1", "q2")[n % 2])
                                   for n in range(7)))
    await reserved(store, jobs[0])
    jobs[0].state = JobState.COMPLETED
    assert await store.save([Change(jobs[0], result=b"1", finished_at=3.0)]) == {}
    seen, cursor = [], None
    while True:
        page, cursor = await store.list_jobs(parse_filter({"state": "available"}), 2, cursor)
        assert len(page) <= 2
        seen += [job["id"] for job in page]
        if cursor is None:
            break
    assert seen == ["j6", "j5", "j4", "j3", "j2", "j1"]
    q1 = parse_filter({"queue": "q1"})
    assert [job["id"] for job in (await store.list_jobs(q1, 10, None))[0]] == [
        "j6", "j4", "j2", "j0"]
    assert await store.count_jobs(q1) == 4
    assert await store.count_jobs(parse_filter({"state": "completed"})) == 1
    assert (await store.state_counts())["available"] == 6
    # The bulk actions' match (POST /jobs/cancel, /jobs/retry): one more than the limit
    # says more match.
    assert await store.match_jobs(q1, 2) == ([("j6", "available"), ("j4", "available"),
                                              ("j2", "available")], False)
    assert await store.match_jobs(parse_filter({"state": "completed"}), 5) == (
        [("j0", "completed")], False)
    assert await store.job_states(["j0", "j1", "nope"]) == {"j0": "completed",
                                                            "j1": "available"}


async def test_a_pending_job_is_not_loaded_and_its_release_reads_it_back_whole(
        open_store: Opener):
    """Issue 24: a workflow's later step is stored ``pending``: a restart does not take
    it in (no scheduler may give it out), and its release (rota/store/settle.py) makes it
    wait with what its workflow passes it, read back with its origin."""
    from rota.store import holds
    store, _ = await open_store()
    await enqueued(store, new_job("step-2", state=JobState.PENDING, workflow_id="wf-1",
                                  workflow_node=2, schedule="nightly", expires_at=61.0))
    _, snapshot = await open_store()
    assert snapshot.jobs == [] and snapshot.waiting == {}
    store, _ = await open_store()
    [job] = await store.writer.submit(
        lambda conn: holds.release(conn, [("step-2", '{"0": {"n": 7}}')], 1000.0))
    assert (job.id, job.state, job.workflow_id, job.workflow_node, job.schedule) == (
        "step-2", JobState.AVAILABLE, "wf-1", 2, "nightly")
    assert json.loads(bytes(job.parent_results)) == {"0": {"n": 7}}
    assert job.expires_at == 1060.0  # its time to live (60 s) counts from its release
    again = await store.writer.submit(
        lambda conn: holds.release(conn, [("step-2", None)], 1000.0))
    assert again == []  # released once: the row decides
    _, snapshot = await open_store()
    [kept] = snapshot.jobs  # (waiting whole: it has a time to live)
    assert (kept.id, kept.state, kept.expires_at) == ("step-2", JobState.AVAILABLE, 1060.0)


async def test_a_write_that_fails_leaves_nothing_alone_or_beside_others(open_store: Opener):
    """The writer runs a commit's only write without a savepoint and each of several in
    one (rota/store/writer.py, ``_run_op``): either way a write that raises after
    changing rows leaves none of its changes, its caller hears its error, and the
    writes beside it, and the next commit, are stored."""
    store, _ = await open_store()

    def insert(name: str, fail: bool = False) -> Callable[[Any], str]:
        def op(conn: Any) -> str:
            conn.execute("INSERT INTO tokens (id, name, scope, queues, hash, created_at)"
                         " VALUES (?, ?, 'admin', '[]', ?, 0)", (name, name, "h-" + name))
            if fail:
                raise ValueError(f"{name} refused after its insert")
            return name
        return op

    with pytest.raises(ValueError, match="lone refused"):
        await store.writer.submit(insert("lone", fail=True))  # a commit of its own
    assert await store.writer.submit(insert("next")) == "next"
    # Three submitted in one turn of the loop: one commit, the middle one failing.
    futures = [store.writer.submit(insert("a")), store.writer.submit(insert("b", fail=True)),
               store.writer.submit(insert("c"))]
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    assert outcomes[0] == "a" and outcomes[2] == "c" and isinstance(outcomes[1], ValueError)
    names = await store.writer.submit(
        lambda conn: sorted(r[0] for r in conn.execute("SELECT id FROM tokens")))
    assert names == ["a", "c", "next"]
