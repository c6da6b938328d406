"""The engine's decisions, driven in-process: events in, effects out. No socket, no disk,
no event loop and no sleep: a fake clock says what time it is."""

from __future__ import annotations

import itertools
import logging
import json
import weakref
from typing import Any

import msgspec
import pytest

from rota.base import protocol as p
from rota.core.auth import OPEN, Principal
from rota.core.effects import Abort, Arm, Effect, Finished, Reserve, Save, Send, Wake, Withdraw
from rota.core.engine import ROW_REFUSED, Engine
from rota.core.jobs import EnqueueRequest
from rota.core.observe import COMPLETED
from rota.core.model import ClockReading, Instant, InvalidTransition, JobRecord, JobState, Limits, \
    wall_step
from rota.core.reservations import PAUSE_AFTER_FAILED_ROUND
from rota.core.settings import ServerSettings
from rota.base.specs import JobSpec, RetryPolicy, checksum

SPEC = JobSpec(name="echo", version="1")
POISONOUS = JobSpec(name="boom", version="1", retry=RetryPolicy(max_worker_deaths=2))


class FakeClock:
    """Both clocks, moved by the test: ``advance`` moves both (time passes), ``step``
    moves only the wall clock (NTP, a VM resumed)."""

    def __init__(self) -> None:
        self.mono = 1000.0
        self.wall = 1_800_000_000.0

    def __call__(self) -> Instant:
        return Instant(self.mono, self.wall)

    def advance(self, seconds: float) -> Instant:
        self.mono += seconds
        self.wall += seconds
        return self()

    def step(self, seconds: float) -> Instant:
        self.wall += seconds
        return self()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(clock: FakeClock) -> Engine:
    return make_engine(clock)


def make_engine(clock: FakeClock) -> Engine:
    """The engine the fixture gives (a test that feeds two side by side makes another)."""
    settings = ServerSettings(heartbeat_interval=1.0, heartbeat_timeout=5.0,
                              reconnect_grace=5.0, visibility_timeout=30.0)
    engine = Engine(settings, rand=lambda: 0.0)
    specs = {s.name: s for s in (SPEC, POISONOUS)}
    engine.load(specs, {n: checksum(s) for n, s in specs.items()}, [], clock())
    return engine


def hb(worker: str, seq: int, *, register: bool = False, active: list[str] | None = None,
       results: list[p.Result] | None = None, capacity: int | None = None,
       started_at: str | None = "t0", state: str = "running",
       queues: list[str] | None = None) -> p.Heartbeat:
    registration = p.Registration(
        hostname="h", os="linux", pid=7, sdk="test", queues=queues or ["default"], concurrency=4,
        specs=[p.SpecRef(s.name, checksum(s)) for s in (SPEC, POISONOUS)],
        started_at=started_at) if register else None
    status = p.Status(state=state, active_job_ids=active or [])  # type: ignore[arg-type]
    return p.Heartbeat(seq=seq, worker_id=worker, registration=registration, status=status,
                       results=results or [], capacity=capacity)


def sent(effects: list[Effect], conn: int | None = None) -> list[dict[str, Any]]:
    return [json.loads(e.frame) for e in effects
            if isinstance(e, Send) and (conn is None or e.conn == conn)]


def of(kind: type, effects: list[Effect]) -> list[Any]:
    return [e for e in effects if isinstance(e, kind)]


def connect(engine: Engine, clock: FakeClock, worker: str = "w1", conn: int = 1,
            capacity: int = 4, principal: Principal = OPEN, active: list[str] | None = None
            ) -> list[Effect]:
    first = hb(worker, 0, register=True, capacity=capacity, active=active)
    return (engine.register(conn, first, principal, clock())
            + engine.heartbeat(conn, worker, first, clock()))


# The rows a test's jobs would have, by row id: the engine keeps a plain waiting job as a
# key only, and a reservation's outcome carries the rows its claims read (see ``read``).
ROWS: weakref.WeakKeyDictionary[Engine, dict[int, JobRecord]] = weakref.WeakKeyDictionary()


def enqueue(engine: Engine, clock: FakeClock, n: int = 1, spec: str = "echo",
            **options: Any) -> list[JobRecord]:
    jobs = []
    rows = ROWS.setdefault(engine, {})
    for i in range(n):
        built = engine.build(EnqueueRequest(spec=spec, id=f"{spec}-{i}", **options), OPEN,
                             clock())
        assert isinstance(built, JobRecord)
        rows[len(rows) + 1] = built
        engine.enqueued(built, len(rows), clock())
        jobs.append(built)
    return jobs


def read(engine: Engine, reserve: Reserve) -> list[JobRecord | None]:
    """What the store reads back for the reservation's claims, as its UPDATE leaves them:
    None where the row is no longer available."""
    rows = ROWS.get(engine, {})
    out: list[JobRecord | None] = []
    for claim in reserve.claims:
        job = rows.get(claim.seq)
        if job is None or job.state != JobState.AVAILABLE:
            out.append(None)
            continue
        job.state, job.worker_id, job.checksum = JobState.ACTIVE, claim.worker.id, claim.checksum
        job.worker_token = claim.worker.token
        job.attempt += 1
        job.lease_expires_at = reserve.wall + max(job.visibility_timeout or reserve.lease,
                                                  reserve.min_lease)
        out.append(job)
    return out


def job_of(engine: Engine, job_id: str) -> JobRecord:
    """The job, held whole by the engine or, if it waits as a key only, as its row."""
    held = engine.scheduler.jobs.get(job_id)
    return held or next(j for j in ROWS[engine].values() if j.id == job_id)


def commit(engine: Engine, reserve: Reserve, clock: FakeClock) -> list[Effect]:
    return engine.committed(reserve.ticket, None, clock(), read(engine, reserve))


def assign(engine: Engine, clock: FakeClock) -> list[dict[str, Any]]:
    """A scheduling round, committed: the jobs each worker is sent."""
    effects = engine.dispatch(clock())
    [reserve] = of(Reserve, effects)
    frames = sent(commit(engine, reserve, clock))
    return [job for frame in frames if frame["type"] == "assign" for job in frame["jobs"]]


def run_for(engine: Engine, clock: FakeClock, seconds: float, *, worker: str | None = None,
            active: list[str] | None = None) -> list[Effect]:
    """Let time pass as the shell would: a tick every half second (it promises one at
    least every ``tick_every``), and a heartbeat from ``worker`` on each, if given."""
    effects: list[Effect] = []
    for _ in range(round(seconds / 0.5)):
        clock.advance(0.5)
        if worker is not None and worker in engine.connections:
            conn = engine.connections[worker].conn
            effects += engine.heartbeat(conn, worker, hb(worker, next(SEQ), active=active),
                                        clock())
        effects += engine.tick(clock())
    return effects


SEQ = itertools.count(1000)


def done(job: dict[str, Any]) -> p.Result:
    return p.Result(job_id=job["id"], attempt=job["attempt"], outcome="completed", result=1)


# -- batches ------------------------------------------------------------------------
def test_a_heartbeat_with_n_results_gives_one_save_and_one_ack(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, 4)
    copies = assign(engine, clock)
    assert len(copies) == 4
    effects = engine.heartbeat(1, "w1", hb("w1", 1, results=[done(j) for j in copies]), clock())
    [save] = of(Save, effects)
    assert len(save.changes) == 4 and not sent(effects)  # no ack before the commit
    after = engine.committed(save.ticket, None, clock())
    [ack] = sent(after)
    assert ack["type"] == "ack" and ack["seq"] == 1 and sorted(ack["accepted"]) == sorted(
        j["id"] for j in copies)
    assert sorted(of(Finished, after)[i].job_ids[0] for i in range(4)) == sorted(
        j["id"] for j in copies)
    assert engine.scheduler.jobs == {}


def test_jobs_chosen_in_one_round_go_in_one_assign(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, 3)
    effects = engine.dispatch(clock())
    [reserve] = of(Reserve, effects)
    frames = sent(commit(engine, reserve, clock))
    assert [f["type"] for f in frames] == ["assign"] and len(frames[0]["jobs"]) == 3


def test_a_round_of_large_jobs_is_split_into_frames_of_about_a_mebibyte(engine, clock):
    connect(engine, clock)  # room for 4
    enqueue(engine, clock, 4, args={"blob": "x" * 262_000})  # args near the 256 KiB limit
    effects = engine.dispatch(clock())
    [reserve] = of(Reserve, effects)
    frames = sent(commit(engine, reserve, clock))
    assert [len(f["jobs"]) for f in frames] == [3, 1]  # in order, none over ~1 MiB
    assert [j["id"] for f in frames for j in f["jobs"]] == [f"echo-{i}" for i in range(4)]


def test_acks_keep_heartbeat_order_while_results_commit(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    with_result = engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock())
    behind = engine.heartbeat(1, "w1", hb("w1", 2), clock())
    assert not sent(with_result) and not sent(behind)  # seq 2 waits behind seq 1
    [save] = of(Save, with_result)
    assert [a["seq"] for a in sent(engine.committed(save.ticket, None, clock()))] == [1, 2]


def test_a_failed_commit_keeps_the_job_and_asks_for_the_result_again(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    effects = engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock())
    [save] = of(Save, effects)
    [ack] = sent(engine.committed(save.ticket, OSError("disk full"), clock()))
    assert not ack.get("accepted") and "report it again" in ack["rejected"][0]["reason"]
    job = engine.scheduler.jobs[copy["id"]]
    assert job.state == JobState.ACTIVE and job.worker_id == "w1"


def test_a_result_its_row_refused_is_rejected_forgotten_and_not_counted(engine, clock, caplog):
    """The row moved on behind this server (another server ran attempt 2, or it was
    written directly): the commit's outcome names the result refused, and the ack says
    rejected; nothing is counted, remembered or logged as completed."""
    connect(engine, clock)
    enqueue(engine, clock, 2)
    first, second = assign(engine, clock)
    effects = engine.heartbeat(1, "w1", hb("w1", 1, results=[done(first), done(second)]),
                               clock())
    [save] = of(Save, effects)
    with caplog.at_level(logging.INFO, logger="rota.server"):
        after = engine.committed(save.ticket, None, clock(), {first["id"]: None})
    [ack] = sent(after)
    assert ack["accepted"] == [second["id"]]
    assert ack["rejected"] == [{"job_id": first["id"], "attempt": 1, "reason": ROW_REFUSED}]
    assert [f.job_ids for f in of(Finished, after)] == [[second["id"]]]
    assert first["id"] not in engine.scheduler.jobs
    assert [totals[COMPLETED] for totals in completed_counts(engine).values()] == [1]
    completed = [r.getMessage() for r in caplog.records if "outcome=completed" in r.getMessage()]
    assert completed and all(first["id"] not in line for line in completed)
    assert any("refused by the row job=" + first["id"] in r.getMessage()
               for r in caplog.records)
    # A resend of it is no "stored already": it was never stored.
    [ack] = sent(engine.heartbeat(1, "w1", hb("w1", 2, results=[done(first)]), clock()))
    assert ack["rejected"][0]["reason"] == "unknown job, or it already finished"


def test_a_refused_result_whose_row_waits_again_is_held_as_the_row_reads(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, ttl=3600)
    [copy] = assign(engine, clock)
    [save] = of(Save, engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock()))
    stale = engine.scheduler.jobs[copy["id"]]
    row = JobRecord(id=copy["id"], spec="echo", queue="default", args=msgspec.Raw(b"{}"),
              priority=0, enqueued_at=clock.wall, seq=stale.seq, limits=stale.limits,
              state=JobState.AVAILABLE, attempt=2, expires_at=clock.wall + 3600)
    engine.committed(save.ticket, None, clock(), {copy["id"]: row})
    held = engine.scheduler.jobs[copy["id"]]
    assert held is row and held.state == JobState.AVAILABLE and held.attempt == 2
    assert [j["attempt"] for j in assign(engine, clock)] == [3]


def test_an_ending_its_row_refused_is_not_counted_and_the_copy_is_let_go(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, ttl=3600)
    [copy] = assign(engine, clock)
    effects = engine.disconnect(1, "w1", "closed", clock())  # its attempt ends here
    [save] = of(Save, effects)
    assert engine.scheduler.jobs[copy["id"]].state != JobState.ACTIVE
    before = completed_counts(engine)
    after = engine.committed(save.ticket, None, clock(), {copy["id"]: None})
    assert not [f for f in of(Finished, after) if f.job_ids]
    assert completed_counts(engine) == before
    assert copy["id"] not in engine.scheduler.jobs


def test_a_cancel_its_row_refused_leaves_memory_as_the_row_says(engine, clock):
    """A waiting job held whole is cancelled here, but the row had moved on (another
    server retried it: attempt 2, waiting): memory holds the row's job, not a cancel."""
    [job] = enqueue(engine, clock, ttl=3600)
    outcome, effects = engine.cancel(job.id, clock())
    [save] = of(Save, effects)
    assert outcome == "cancelled" and save.ticket is None and job.id not in engine.scheduler.jobs
    row = JobRecord(id=job.id, spec="echo", queue="default", args=msgspec.Raw(b"{}"), priority=0,
              enqueued_at=clock.wall, seq=job.seq, limits=job.limits,
              state=JobState.AVAILABLE, attempt=2, expires_at=clock.wall + 3600)
    assert of(Wake, engine.refused(save.changes, {job.id: row}, clock()))
    assert engine.scheduler.jobs[job.id] is row


def completed_counts(engine: Engine) -> dict[tuple[str, str], list[int]]:
    return {(queue, spec): list(series.totals) for queue, spec, series
            in engine.observe.totals()}


# -- leases and liveness --------------------------------------------------------------
def test_a_lease_lapses_without_heartbeats_and_the_job_goes_back(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, visibility_timeout=10.0)
    [copy] = assign(engine, clock)
    effects = run_for(engine, clock, 12.0, worker="w1")  # it beats but stops naming the job
    cancels = [f for f in sent(effects) if f["type"] == "cancel"]
    assert cancels == [{"type": "cancel", "job_ids": [copy["id"]], "reason": "visibility_timeout"}]
    job = job_of(engine, copy["id"])
    assert job.state == JobState.AVAILABLE and copy["id"] not in engine.scheduler.jobs
    [save] = of(Save, effects)
    assert b"visibility_timeout" in (save.changes[0].error or b"")


def test_a_silent_worker_is_dropped_after_the_heartbeat_timeout(engine, clock):
    connect(engine, clock)
    effects = run_for(engine, clock, 4.5)
    assert not of(Abort, effects)
    effects = run_for(engine, clock, 1.0)
    assert [a.code for a in of(Abort, effects)] == ["heartbeat_timeout"]
    assert "w1" not in engine.connections


def test_a_wall_clock_step_between_runs_is_told_from_the_time_that_passed():
    last = ClockReading(wall=1_800_000_000.0, boot=500.0, boot_id="b1")
    # Same boot: the boot clock says how long the server was down; the rest is a step.
    assert wall_step(last, ClockReading(last.wall + 7200 + 60, 560.0, "b1")) == 7200
    assert wall_step(last, ClockReading(last.wall - 7200 + 60, 560.0, "b1")) == -7200
    assert wall_step(last, ClockReading(last.wall + 60.4, 560.0, "b1")) == 0.0  # no step
    # Rebooted: how long it was down is unknown. Ahead is taken as downtime; behind the
    # last reading is a step back at least that far.
    assert wall_step(last, ClockReading(last.wall + 7200, 30.0, "b2")) == 0.0
    assert wall_step(last, ClockReading(last.wall - 7200, 30.0, "b2")) == -7200
    assert wall_step(None, last) == 0.0  # a first start


def test_after_a_step_the_waiting_jobs_deadlines_are_written_on_the_new_clock(engine, clock):
    [later] = enqueue(engine, clock, delay=3600)
    [short] = enqueue(engine, clock, spec="boom", ttl=600)  # (ids go by spec)
    stored = (later.run_at, short.expires_at)
    [save] = of(Save, engine.restamp(clock.step(-7200)))
    assert {c.job.id for c in save.changes} == {later.id, short.id}
    assert (later.run_at, short.expires_at) == (stored[0] - 7200, stored[1] - 7200)
    assert later.due is not None and clock.mono + 3599 < later.due <= clock.mono + 3600


def test_a_wall_clock_step_either_way_cancels_nothing(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, visibility_timeout=2.0)
    [copy] = assign(engine, clock)
    effects: list[Effect] = []
    for step in (+7200.0, -7200.0, -7200.0, +7200.0):
        clock.step(step)
        for seq in range(5):
            clock.advance(0.5)
            effects += engine.heartbeat(1, "w1", hb("w1", seq, active=[copy["id"]]), clock())
            effects += engine.tick(clock())
    assert not [f for f in sent(effects) if f["type"] != "ack"] and not of(Abort, effects)
    assert engine.scheduler.jobs[copy["id"]].state == JobState.ACTIVE
    result = engine.heartbeat(1, "w1", hb("w1", 99, results=[done(copy)]), clock())
    assert of(Save, result)


def test_a_server_stall_is_not_held_against_its_workers(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, visibility_timeout=3.0)
    [copy] = assign(engine, clock)
    engine.tick(clock())
    # The server froze for 8 s (> heartbeat_timeout and > the lease); the worker's
    # heartbeats waited in the socket. The timer fires before they are read.
    effects = engine.tick(clock.advance(8.0))
    assert not of(Abort, effects) and not sent(effects) and not of(Save, effects)
    effects = engine.heartbeat(1, "w1", hb("w1", 1, active=[copy["id"]]), clock())
    effects += engine.tick(clock.advance(0.2))
    assert not of(Abort, effects) and engine.scheduler.jobs[copy["id"]].state == "active"
    # ...but a worker that stays silent after the server is back is dropped as usual.
    effects = run_for(engine, clock, 6.0)
    assert [a.code for a in of(Abort, effects)] == ["heartbeat_timeout"]


# -- a worker that does not read what it is sent ----------------------------------------
def test_a_full_outbox_gets_no_jobs_and_a_drained_one_gets_what_waited(engine, clock):
    connect(engine, clock)
    assert engine.outbox(1, "w1", True, False, clock()) == []
    enqueue(engine, clock, 2)
    assert engine.dispatch(clock()) == []  # nothing reserved for a worker that cannot take it
    assert not of(Wake, engine.heartbeat(1, "w1", hb("w1", 1), clock()))  # no futile rounds
    assert of(Wake, engine.outbox(1, "w1", False, False, clock()))  # drained: a round runs
    assert len(assign(engine, clock)) == 2


def test_a_full_outbox_leaves_the_jobs_to_a_worker_that_reads(engine, clock):
    connect(engine, clock)
    connect(engine, clock, worker="w2", conn=2)
    engine.outbox(1, "w1", True, False, clock())
    enqueue(engine, clock, 3)
    assert {j["id"] for j in assign(engine, clock)} == {"echo-0", "echo-1", "echo-2"}
    assert all(j.worker_id == "w2" for j in engine.scheduler.jobs.values())


def test_an_outbox_over_its_limit_too_long_is_closed_and_its_jobs_wait_the_grace(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    engine.outbox(1, "w1", True, True, clock())
    effects = run_for(engine, clock, 20.0, worker="w1", active=[copy["id"]])
    engine.outbox(1, "w1", False, False, clock())  # drained for a moment: starts over
    engine.outbox(1, "w1", True, True, clock())
    effects += run_for(engine, clock, 29.5, worker="w1", active=[copy["id"]])
    assert not of(Abort, effects)
    effects = run_for(engine, clock, 1.0, worker="w1")
    [abort] = of(Abort, effects)
    assert (abort.conn, abort.code, abort.close_code) == (1, "slow_consumer", p.CLOSE_POLICY)
    assert "w1" not in engine.connections
    job = engine.scheduler.jobs[copy["id"]]
    assert job.orphaned and not of(Save, effects)  # kept for the grace, as a lost connection's
    effects = run_for(engine, clock, 6.0)
    [save] = of(Save, effects)
    assert b"did not reconnect in time" in (save.changes[0].error or b"")
    assert job_of(engine, copy["id"]).state == JobState.AVAILABLE


def test_an_outbox_full_too_long_is_closed_however_little_it_holds(engine, clock):
    """A worker that stopped reading with less than the limit unread: the server sends
    it nothing more, and the jobs it was sent wait on it. It was kept as long as it
    beat (its jobs until their leases ran out); now it is closed as one over the limit."""
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    engine.outbox(1, "w1", True, False, clock())  # full, under the limit
    effects = run_for(engine, clock, 29.5, worker="w1", active=[copy["id"]])
    assert not of(Abort, effects)
    effects = run_for(engine, clock, 1.0, worker="w1")
    [abort] = of(Abort, effects)
    assert (abort.conn, abort.code) == (1, "slow_consumer")
    assert engine.scheduler.jobs[copy["id"]].orphaned  # kept for the grace


def test_an_outbox_that_drains_now_and_then_is_kept(engine, clock):
    connect(engine, clock)
    effects = []
    for _ in range(4):  # full 20 s, drained, full again: a worker that reads, slowly
        engine.outbox(1, "w1", True, False, clock())
        effects += run_for(engine, clock, 20.0, worker="w1")
        engine.outbox(1, "w1", False, False, clock())
    assert not of(Abort, effects) and "w1" in engine.connections


def test_a_server_stall_is_not_held_against_a_full_outbox(engine, clock):
    connect(engine, clock)
    engine.outbox(1, "w1", True, True, clock())
    run_for(engine, clock, 25.0, worker="w1")
    clock.advance(10.0)  # the server itself did not run: it could not see the outbox drain
    effects = engine.tick(clock()) + run_for(engine, clock, 4.0, worker="w1")
    assert not of(Abort, effects)
    assert [a.code for a in of(Abort, run_for(engine, clock, 2.0, worker="w1"))] == [
        "slow_consumer"]


# -- reconnects, restarts, supersede ----------------------------------------------------
def test_a_lost_connection_keeps_jobs_for_the_grace_and_the_worker_reclaims_them(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    effects = engine.disconnect(1, "w1", "connection_lost", clock())
    assert not of(Save, effects) and of(Arm, effects)
    clock.advance(2.0)
    connect(engine, clock, conn=2)
    engine.heartbeat(2, "w1", hb("w1", 1, active=[copy["id"]]), clock())
    job = engine.scheduler.jobs[copy["id"]]
    assert not job.orphaned and job.worker_id == "w1"
    effects = run_for(engine, clock, 10.0, worker="w1", active=[copy["id"]])
    assert not of(Save, effects)  # the grace passed: nothing lapsed


def test_after_a_restart_a_job_not_reclaimed_in_time_ends_as_worker_death(clock):
    engine = Engine(ServerSettings(heartbeat_timeout=5.0), rand=lambda: 0.0)
    job = JobRecord(id="j1", spec="echo", queue="default", args=msgspec.Raw(b"{}"), priority=0,
              enqueued_at=clock.wall - 60, seq=1, state="active", attempt=1, worker_id="w1",
              checksum=checksum(SPEC), lease_expires_at=clock.wall + 1000,
              limits=Limits(max_attempts=5, max_fails=None, backoff_base=1, backoff_max=1))
    engine.load({"echo": SPEC}, {"echo": checksum(SPEC)}, [job], clock())
    assert job.orphaned
    effects = run_for(engine, clock, 6.0)
    [save] = of(Save, effects)
    assert b"did not reconnect in time" in (save.changes[0].error or b"")
    assert job.state == JobState.AVAILABLE and job.deaths == 1


def test_the_same_process_supersedes_its_half_open_connection(engine, clock):
    connect(engine, clock)
    effects = connect(engine, clock, conn=2)
    assert [(a.conn, a.code) for a in of(Abort, effects)] == [(1, "superseded")]
    assert engine.connections["w1"].conn == 2
    assert [f["type"] for f in sent(effects, conn=2)] == ["welcome", "ack"]


def test_another_process_under_a_connected_id_is_refused(engine, clock):
    connect(engine, clock)
    other = hb("w1", 0, register=True, started_at="t1")
    with pytest.raises(p.FrameError) as refused:
        engine.register(2, other, OPEN, clock())
    assert refused.value.code == "worker_id_in_use"


# Two worker tokens (issue 20, item 3): one limited to the queue of its own jobs.
HIGH = Principal(token_id="aaaaaaaaaaaa", name="high", scope="worker", queues=None)
LOW = Principal(token_id="bbbbbbbbbbbb", name="low", scope="worker",
                queues=frozenset({"default", "acc-low"}))


def test_a_lost_workers_id_is_refused_to_another_token_and_its_jobs_keep_their_grace(
        engine, clock):
    connect(engine, clock, principal=HIGH)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    job = engine.scheduler.jobs[copy["id"]]
    assert job.worker_token == HIGH.token_id
    engine.disconnect(1, "w1", "connection_lost", clock())
    clock.advance(1.0)
    forged = hb("w1", 0, register=True, active=[copy["id"]], results=[done(copy)])
    with pytest.raises(p.FrameError) as refused:
        engine.register(2, forged, LOW, clock())
    assert (refused.value.code, refused.value.close_code) == ("worker_id_taken", p.CLOSE_POLICY)
    assert "w1" not in engine.connections and job.orphaned and job.worker_id == "w1"
    effects = run_for(engine, clock, 6.0)  # the grace runs out as if nobody had come
    [save] = of(Save, effects)
    assert b"did not reconnect in time" in (save.changes[0].error or b"")
    assert job.state == JobState.AVAILABLE and job.attempt == 1


def test_the_same_token_reclaims_even_as_a_principal_read_again(engine, clock):
    connect(engine, clock, principal=HIGH)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    engine.disconnect(1, "w1", "connection_lost", clock())
    clock.advance(2.0)
    reloaded = Principal(token_id=HIGH.token_id, name="renamed", scope="worker")
    connect(engine, clock, conn=2, principal=reloaded, active=[copy["id"]])
    job = engine.scheduler.jobs[copy["id"]]
    assert not job.orphaned and job.worker_id == "w1"


def test_a_live_worker_is_superseded_only_by_its_own_token(engine, clock):
    connect(engine, clock, principal=HIGH)
    copied = hb("w1", 0, register=True)  # the same hostname, pid and started_at
    with pytest.raises(p.FrameError) as refused:
        engine.register(2, copied, LOW, clock())
    assert refused.value.code == "worker_id_taken"
    assert engine.connections["w1"].conn == 1  # untouched
    effects = engine.register(3, copied, HIGH, clock())
    assert [(a.conn, a.code) for a in of(Abort, effects)] == [(1, "superseded")]


def kept_job(clock: FakeClock, job_id: str, queue: str, token: str | None) -> JobRecord:
    """An active job of w1's as a restart loads it from its row."""
    return JobRecord(id=job_id, spec="echo", queue=queue, args=msgspec.Raw(b"{}"), priority=0,
               enqueued_at=clock.wall - 60, seq=1, state="active", attempt=1, worker_id="w1",
               worker_token=token, checksum=checksum(SPEC), lease_expires_at=clock.wall + 1000,
               limits=Limits(max_attempts=5, max_fails=None, backoff_base=1, backoff_max=1))


def test_after_a_restart_a_kept_workers_id_is_still_its_tokens(clock):
    engine = Engine(ServerSettings(heartbeat_timeout=5.0), rand=lambda: 0.0)
    job = kept_job(clock, "j1", "default", HIGH.token_id)
    engine.load({"echo": SPEC}, {"echo": checksum(SPEC)}, [job], clock())
    with pytest.raises(p.FrameError, match="another token"):
        connect(engine, clock, principal=LOW, active=["j1"])
    connect(engine, clock, conn=2, principal=HIGH, active=["j1"])
    assert not job.orphaned and engine.scheduler.kept_for("w1") == []


def test_only_jobs_of_queues_the_token_may_serve_are_reclaimed(clock, caplog):
    engine = Engine(ServerSettings(heartbeat_timeout=5.0), rand=lambda: 0.0)
    # Reserved before auth was on (no token), in a queue LOW may not serve; and one of
    # its own.
    theirs = kept_job(clock, "high-1", "acc-high", None)
    mine = kept_job(clock, "low-1", "acc-low", LOW.token_id)
    engine.load({"echo": SPEC}, {"echo": checksum(SPEC)}, [theirs, mine], clock())
    forged = p.Result(job_id="high-1", attempt=1, outcome="completed", result="forged")
    first = hb("w1", 0, register=True, active=["high-1", "low-1"], results=[forged])
    effects = engine.register(1, first, LOW, clock()) + engine.heartbeat(1, "w1", first, clock())
    assert not mine.orphaned and theirs.orphaned and theirs.state == JobState.ACTIVE
    [ack] = [f for f in sent(effects) if f["type"] == "ack"]
    assert not ack.get("accepted") and [r["job_id"] for r in ack["rejected"]] == ["high-1"]
    assert not of(Save, effects)  # the forged result changed nothing
    assert any(f["type"] == "cancel" and f["job_ids"] == ["high-1"] for f in sent(effects))
    effects = run_for(engine, clock, 6.0, worker="w1", active=["high-1", "low-1"])
    assert caplog.text.count("reclaim refused job=high-1") == 1  # once, not every heartbeat
    [save] = of(Save, effects)
    assert [c.job.id for c in save.changes] == ["high-1"] and theirs.state == JobState.AVAILABLE


def test_a_directive_rides_every_ack_until_the_worker_gets_there(engine, clock):
    connect(engine, clock)
    assert engine.registry.direct(["w1"], "quiet") == ["w1"]
    enqueue(engine, clock)
    assert not engine.dispatch(clock())  # a quiet worker gets nothing
    [ack] = sent(engine.heartbeat(1, "w1", hb("w1", 1), clock()))
    assert ack["state"] == "quiet"
    engine.heartbeat(1, "w1", hb("w1", 2, state="quiet"), clock())
    assert engine.connections["w1"].directive is None
    assert engine.registry.direct(["w1"], "terminate") == ["w1"]
    engine.heartbeat(1, "w1", hb("w1", 3, state="terminate"), clock())
    assert engine.registry.direct(["w1"], "running") == []  # never back from terminate


def test_a_quiet_worker_resumed_gets_jobs_once_it_says_it_runs(engine, clock):
    connect(engine, clock)
    engine.heartbeat(1, "w1", hb("w1", 1, state="quiet"), clock())  # quiet by SIGTSTP
    enqueue(engine, clock)
    assert engine.registry.direct(["w1"], "running") == ["w1"]
    assert not of(Reserve, engine.dispatch(clock()))  # not before it runs again
    [ack] = sent(engine.heartbeat(1, "w1", hb("w1", 2, state="quiet"), clock()))
    assert ack["state"] == "running"  # the ask rides every ack until the worker runs
    assert engine.connections["w1"].worker.state == "quiet"
    assert not of(Reserve, engine.dispatch(clock.advance(1.0)))
    [ack] = sent(engine.heartbeat(1, "w1", hb("w1", 3), clock()))
    assert ack["state"] == "running" and engine.connections["w1"].directive is None
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert len(reserve.jobs) + len(reserve.claims) == 1
    assert engine.registry.direct(["w1"], "running") == []  # running already: nothing asked


def test_a_paused_queue_keeps_its_jobs_and_assigns_none_until_resumed(engine, clock):
    connect(engine, clock)
    assert engine.pause_queue("default", True, clock()) == []
    enqueue(engine, clock, n=3)
    for _ in range(3):  # however long it waits
        engine.tick(clock.advance(10.0))
        assert not of(Reserve, engine.dispatch(clock()))
    assert engine.scheduler.ready_counts() == {("default", "echo"): 3}
    assert engine.scheduler.waiting_reason("default", "echo") == "queue paused"
    assert of(Wake, engine.pause_queue("default", False, clock()))
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert len(reserve.jobs) + len(reserve.claims) == 3
    assert engine.scheduler.waiting_reason("default", "echo") is None
    changes = [ev for _, ev in engine.observe.after(0, 10_000)[1] if ev[1] == "state_change"]
    assert [(ev[5], ev[8]) for ev in changes] == [("default", "paused"), ("default", "resumed")]


def test_a_queue_paused_before_a_restart_stays_paused(clock):
    settings = ServerSettings(heartbeat_interval=1.0, heartbeat_timeout=5.0)
    engine = Engine(settings, rand=lambda: 0.0)
    engine.load({SPEC.name: SPEC}, {SPEC.name: checksum(SPEC)}, [], clock(),
                paused=["default"])
    connect(engine, clock)
    enqueue(engine, clock)
    assert not of(Reserve, engine.dispatch(clock()))
    engine.pause_queue("other", True, clock())  # another queue paused: no matter here
    engine.pause_queue("default", False, clock())
    assert of(Reserve, engine.dispatch(clock()))


# -- poison -----------------------------------------------------------------------------
def test_a_job_that_kills_its_workers_is_discarded_as_poison(engine, clock):
    enqueue(engine, clock, spec="boom")  # max_worker_deaths = 2
    for n in (1, 2):
        connect(engine, clock, worker=f"w{n}", conn=n)
        [copy] = assign(engine, clock)
        assert copy["attempt"] == n
        effects = engine.disconnect(n, f"w{n}", "closed", clock())
    [save] = of(Save, effects)
    record = json.loads(save.changes[0].error or b"{}")
    assert save.changes[0].job.state == JobState.DISCARDED and record["type"] == "poison"
    connect(engine, clock, worker="w3", conn=3)
    assert not engine.dispatch(clock())


def test_deaths_count_only_in_a_row(engine, clock):
    enqueue(engine, clock, spec="boom")
    connect(engine, clock, worker="w1", conn=1)
    [copy] = assign(engine, clock)
    engine.disconnect(1, "w1", "closed", clock())
    connect(engine, clock, worker="w2", conn=2)
    [copy] = assign(engine, clock)
    failed = p.Result(job_id=copy["id"], attempt=copy["attempt"], outcome="failed",
                      error=p.ErrorInfo(type="ValueError", message="no"))
    [save] = of(Save, engine.heartbeat(2, "w2", hb("w2", 1, results=[failed]), clock()))
    engine.committed(save.ticket, None, clock())
    job = engine.scheduler.jobs[copy["id"]]
    assert job.deaths == 0 and job.state == JobState.RETRYABLE


# -- the model ---------------------------------------------------------------------------
def test_job_transitions_are_guarded():
    job = JobRecord(id="j", spec="s", queue="q", args=msgspec.Raw(b"{}"), priority=0, enqueued_at=0,
              seq=1, limits=Limits(max_attempts=1, max_fails=None, backoff_base=1, backoff_max=1))
    job.move(JobState.ACTIVE)
    job.move(JobState.COMPLETED)
    with pytest.raises(InvalidTransition, match="got completed"):
        job.move(JobState.AVAILABLE)


def test_engine_effects_are_plain_values(engine, clock):
    """Everything the shell needs is in the effect: nothing to call back into."""
    effects = connect(engine, clock)
    enqueue(engine, clock)
    effects += engine.dispatch(clock())
    assert {type(e).__name__ for e in effects} >= {"Send", "Reserve", "WorkerSeen"}
    assert any(isinstance(e, Wake) for e in engine.enqueued(
        engine.build(EnqueueRequest(spec="echo"), OPEN, clock()), 9, clock()))  # type: ignore[arg-type]


# -- what a review found ------------------------------------------------------------------
def test_a_failed_commit_after_the_worker_left_keeps_the_job_for_its_return(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    [save] = of(Save, engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock()))
    engine.disconnect(1, "w1", "connection_lost", clock())  # while the result commits
    effects = engine.committed(save.ticket, OSError("disk full"), clock())
    job = engine.scheduler.jobs[copy["id"]]
    assert job.state == JobState.ACTIVE and job.orphaned and of(Arm, effects)
    connect(engine, clock, conn=2)  # it comes back and reports the result again
    [save] = of(Save, engine.heartbeat(2, "w1", hb("w1", 1, results=[done(copy)]), clock()))
    assert save.changes[0].job.state == JobState.COMPLETED


def test_a_failed_commit_leaves_a_lease_that_still_lapses(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, visibility_timeout=5.0)
    [copy] = assign(engine, clock)
    [save] = of(Save, engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock()))
    run_for(engine, clock, 6.0, worker="w1")  # the lease entry was popped while pending
    engine.committed(save.ticket, OSError("disk full"), clock())
    effects = run_for(engine, clock, 6.0, worker="w1")  # and the worker never reports again
    assert [f["reason"] for f in sent(effects) if f["type"] == "cancel"] == ["visibility_timeout"]


def test_a_resent_result_is_acknowledged_quietly_and_changes_nothing(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    [save] = of(Save, engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock()))
    engine.committed(save.ticket, None, clock())
    effects = engine.heartbeat(1, "w1", hb("w1", 2, results=[done(copy)]), clock())
    [ack] = sent(effects)
    assert ack["accepted"] == [copy["id"]] and not ack.get("rejected") and not of(Save, effects)


def test_the_same_result_twice_in_one_heartbeat_is_stored_once(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    effects = engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy), done(copy)]), clock())
    [save] = of(Save, effects)
    [ack] = sent(engine.committed(save.ticket, None, clock()))
    assert len(save.changes) == 1 and ack["accepted"] == [copy["id"]]
    assert [r["reason"] for r in ack["rejected"]] == [
        "this heartbeat already carries a result for this attempt of this job"]


@pytest.mark.parametrize(("reason", "counts"), [("closed", True), ("heartbeat_timeout", True),
                                                ("goodbye", False), ("invalid_message", False)])
def test_only_a_worker_that_really_died_counts_toward_poison(engine, clock, reason, counts):
    enqueue(engine, clock, spec="boom")
    connect(engine, clock)
    [copy] = assign(engine, clock)
    engine.disconnect(1, "w1", reason, clock())
    job = job_of(engine, copy["id"])
    assert job.state == JobState.AVAILABLE and job.deaths == (1 if counts else 0)


def test_a_failed_reservation_of_an_orphaned_job_frees_it(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock)
    [reserve] = of(Reserve, engine.dispatch(clock()))
    engine.disconnect(1, "w1", "connection_lost", clock())  # before the commit
    engine.committed(reserve.ticket, OSError("disk full"), clock())
    [claim] = reserve.claims  # a waiting job is a key: reserving it claims its row
    assert engine.scheduler.ready_counts() == {("default", "echo"): 1}
    assert engine.scheduler.orphans == 0 and claim.worker.claims == 0
    connect(engine, clock, conn=2)
    assert Wake() in run_for(engine, clock, PAUSE_AFTER_FAILED_ROUND)  # the pause is over
    assert len(assign(engine, clock)) == 1


@pytest.mark.parametrize("whole", [False, True])
def test_a_failed_reservation_gives_the_worker_its_slots_back_after_a_pause(
        engine, clock, whole):
    """Nothing was sent, so the worker will not ask again: the slots the round took are
    its own again. The next round waits a moment, or a failing disk would be retried as
    fast as it fails."""
    connect(engine, clock, capacity=2)
    enqueue(engine, clock, 2, **({"ttl": 60} if whole else {}))  # a TTL keeps a job whole
    worker = engine.scheduler.workers["w1"]
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert len(reserve.jobs if whole else reserve.claims) == 2 and worker.free() == 0
    assert engine.committed(reserve.ticket, OSError("disk I/O error"), clock()) == []
    assert worker.free() == 2 and engine.scheduler.ready_counts() == {("default", "echo"): 2}
    assert engine.dispatch(clock()) == []  # paused
    assert Wake() not in engine.tick(clock.advance(PAUSE_AFTER_FAILED_ROUND / 2))
    assert Wake() in engine.tick(clock.advance(PAUSE_AFTER_FAILED_ROUND / 2))
    copies = assign(engine, clock)  # with no new capacity from the worker
    assert len(copies) == 2 and {c["attempt"] for c in copies} == {1}


# -- early admission: a job with a server-made id is placed before its row commits ----
def early(engine: Engine, clock: FakeClock) -> tuple[JobRecord, list[Effect]]:
    built = engine.build(EnqueueRequest(spec="echo"), OPEN, clock())
    assert isinstance(built, JobRecord)
    return built, engine.enqueued(built, None, clock()) + engine.dispatch(clock())


def test_an_early_job_is_reserved_in_the_same_round_and_sent_after_the_commit(engine, clock):
    connect(engine, clock)
    job, effects = early(engine, clock)
    [reserve] = of(Reserve, effects)
    assert [j.id for j in reserve.jobs] == [job.id] and not sent(effects)  # nothing yet
    [frame] = sent(engine.committed(reserve.ticket, None, clock()))
    assert frame["type"] == "assign" and frame["jobs"][0]["id"] == job.id


def test_an_early_job_comes_after_the_jobs_already_waiting(engine, clock):
    waiting = enqueue(engine, clock, 2)  # no worker yet: they wait
    job, _ = early(engine, clock)
    connect(engine, clock, capacity=1)
    assert [j["id"] for j in assign(engine, clock)] == [waiting[0].id]
    assert job.seq > max(j.seq for j in waiting)


def test_an_early_job_whose_write_failed_is_forgotten_and_frees_its_slot(engine, clock):
    connect(engine, clock, capacity=1)
    job, effects = early(engine, clock)
    [reserve] = of(Reserve, effects)
    worker = engine.scheduler.workers["w1"]
    assert worker.free() == 0
    error = OSError("disk full")
    engine.not_stored([job], error)
    # The reservation shared the failed transaction; its outcome must not revive the job.
    assert not sent(engine.committed(reserve.ticket, error, clock()))
    assert job.id not in engine.scheduler.jobs and worker.active == set()
    assert worker.free() == 1 and engine.dispatch(clock()) == []


# -- waiting jobs kept as keys: claims and withdraws -----------------------------------
def test_a_claim_whose_row_is_no_longer_available_sends_nothing_and_frees_the_slot(
        engine, clock):
    connect(engine, clock, capacity=1)
    [job] = enqueue(engine, clock)
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert [c.seq for c in reserve.claims] == [job.seq] and not reserve.jobs
    effects = engine.committed(reserve.ticket, None, clock(), [None])  # cancelled meanwhile
    assert not sent(effects) and of(Wake, effects)
    assert engine.scheduler.workers["w1"].free() == 1 and engine.scheduler.live() == 0


def test_a_claim_committed_after_its_worker_left_goes_back_without_a_death(engine, clock):
    connect(engine, clock)
    [job] = enqueue(engine, clock, spec="boom")
    [reserve] = of(Reserve, engine.dispatch(clock()))
    engine.disconnect(1, "w1", "closed", clock())  # before the commit: it held nothing yet
    effects = commit(engine, reserve, clock)
    assert not sent(effects)
    [save] = of(Save, effects)
    assert save.changes[0].job is job and job.state == JobState.AVAILABLE and job.deaths == 0
    assert job.id not in engine.scheduler.jobs and engine.scheduler.ready.keys == 1


def test_a_claimed_job_is_assigned_from_its_row_and_its_lease_armed(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, visibility_timeout=7.0, args={"x": 1})
    [reserve] = of(Reserve, engine.dispatch(clock()))
    clock.advance(0.5)  # the commit takes a while: the lease runs from the reservation
    effects = commit(engine, reserve, clock)
    [frame] = sent(effects)
    [copy] = frame["jobs"]
    assert (copy["args"], copy["attempt"], copy["visibility_timeout"]) == ({"x": 1}, 1, 7.0)
    assert [a.deadline for a in of(Arm, effects)] == [clock.mono - 0.5 + 7.0]
    assert engine.scheduler.workers["w1"].active == {copy["id"]}


def test_a_withdraw_that_lost_to_a_reservation_leaves_the_job_waiting(engine, clock):
    [job] = enqueue(engine, clock)
    row = {"id": job.id, "rowid": job.seq, "queue": job.queue, "spec": job.spec,
           "priority": job.priority}
    outcome, effects = engine.cancel_waiting(row, clock())
    [withdraw] = of(Withdraw, effects)
    assert outcome == "withdrawing" and engine.scheduler.ready_counts() == {}
    assert of(Wake, engine.withdrawn(withdraw, False))  # the row was no longer available
    assert engine.scheduler.ready_counts() == {("default", "echo"): 1}
    outcome, effects = engine.cancel_waiting(row, clock())
    assert of(Finished, engine.withdrawn(of(Withdraw, effects)[0], True))[0].job_ids == [job.id]
    connect(engine, clock)
    assert not of(Reserve, engine.dispatch(clock()))


def test_no_job_is_reserved_once_a_shutdown_has_begun(engine, clock):
    """A job made available during a graceful stop (a retry come due, a new enqueue) waits
    for the restart: reserved now, its assign would go out on a closing connection and the
    job would wait out a reclaim instead (seen: tests/server/test_invariants.py, seeds 48, 55)."""
    connect(engine, clock)
    engine.begin_shutdown()
    enqueue(engine, clock, 2)
    assert engine.dispatch(clock()) == []
    assert not of(Reserve, run_for(engine, clock, 2.0))
    assert all(job_of(engine, f"echo-{i}").state == JobState.AVAILABLE for i in range(2))


def test_a_completion_ends_a_jobs_row_of_deaths(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, 1)
    [first] = assign(engine, clock)
    engine.disconnect(1, "w1", "closed", clock())  # its worker died: deaths 1
    assert job_of(engine, first["id"]).deaths == 1
    connect(engine, clock, worker="w2", conn=2)
    [again] = assign(engine, clock)
    effects = engine.heartbeat(2, "w2", hb("w2", 1, results=[done(again)]), clock())
    [save] = of(Save, effects)
    assert save.changes[0].job.state == JobState.COMPLETED and save.changes[0].job.deaths == 0


def test_a_flood_of_alerts_is_kept_but_logged_at_a_bounded_rate(engine, clock, caplog):
    connect(engine, clock)
    caplog.set_level(logging.INFO, logger="rota.server")

    def alerts(n: int) -> p.Heartbeat:
        beat = hb("w1", next(SEQ))
        assert beat.status is not None
        beat.status.alerts = [p.Alert(message=f"boom {i}", level="critical") for i in range(n)]
        return beat

    for _ in range(10):  # 1,000 alerts in one second
        engine.heartbeat(1, "w1", alerts(100), clock())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("alert")]
    assert len(lines) == 20  # the burst, then nothing more this second
    assert [a["message"] for a in engine.connections["w1"].alerts][-1] == "boom 99"
    caplog.clear()
    clock.advance(2.0)
    engine.heartbeat(1, "w1", alerts(1), clock())
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("alerts worker=w1: 980 not logged") and "boom 0" in said[1]


def test_a_lease_is_never_shorter_than_two_heartbeat_intervals(engine, clock):
    connect(engine, clock)
    enqueue(engine, clock, visibility_timeout=1e-9)
    [copy] = assign(engine, clock)
    interval = engine.settings.heartbeat_interval
    assert copy["visibility_timeout"] == 2 * interval
    held = engine.scheduler.jobs[copy["id"]]
    assert held.lease is not None and held.lease >= clock().mono + 2 * interval - 1e-6


def test_once_a_shutdown_began_no_deadline_takes_a_job_back(engine, clock):
    """A reclaim grace that runs out while the server stops: the job stays reserved for
    its worker, and the restart gives it a grace of its own (rows decide then)."""
    connect(engine, clock)
    enqueue(engine, clock, 1, priority=1_000_000)
    [copy] = assign(engine, clock)
    engine.disconnect(1, "w1", "connection_lost", clock())  # kept for a reclaim
    engine.begin_shutdown()
    effects = run_for(engine, clock, 60)
    assert not of(Save, effects)
    job = engine.scheduler.jobs[copy["id"]]
    assert job.state == JobState.ACTIVE and job.worker_id == "w1"


def test_registrations_are_one_line_each_and_at_most_a_budget_a_token(engine, clock, caplog):
    """One line a registration, however many specs it declares wrong; past the token's
    budget (a burst, then a rate), counted and said in one line when one is logged again."""
    from rota.core.auth import Principal
    from rota.core.registry import REGISTER_BURST, REGISTER_LINES

    caplog.set_level(logging.INFO, logger="rota.server")
    flooder = Principal(token_id="t-flood", name="flood", scope="worker")
    bad = [p.SpecRef(f"nope-{k}", "sha256:" + "0" * 64) for k in range(50)]

    def register(worker: str, principal: Principal = flooder) -> None:
        first = hb(worker, 0, register=True)
        first.registration.specs = bad  # type: ignore[union-attr]
        engine.register(next(SEQ), first, principal, clock())
        engine.disconnect(engine.connections[worker].conn, worker, "closed", clock())

    for n in range(REGISTER_BURST + 30):  # at one instant: the burst, and no more
        register(f"f{n}")
    lines = [r.getMessage() for r in caplog.records]
    assert len([m for m in lines if m.startswith("register ")]) == REGISTER_BURST
    assert len([m for m in lines if m.startswith("disconnect ")]) == REGISTER_BURST
    assert all(m.endswith("specs_ok=0 specs_rejected=50 rejected=nope-0@sha256:00000000"
                          "(status_quo=none),nope-1@sha256:00000000(status_quo=none),"
                          "nope-2@sha256:00000000(status_quo=none),+47 more")
               for m in lines if m.startswith("register "))
    register("w-other", OPEN)  # another token's budget is its own
    assert caplog.records[-2].getMessage().startswith("register worker=w-other ")
    caplog.clear()
    clock.advance(1 / REGISTER_LINES)  # room for one more
    register("f-next")
    assert caplog.records[0].getMessage() == (
        "registrations token=t-flood: 30 not logged, nor their disconnects (over 10 a second;"
        " GET /workers lists the connected)")
    assert caplog.records[1].getMessage().startswith("register worker=f-next ")
    assert caplog.records[1].levelno == logging.WARNING
