"""The engine as one of several servers on one database (docs/scaling.md), driven
in-process with a fake clock: jobs another server made wait are taken in, a reservation
that lost to another server's sends nothing and frees its slot, and a status quo pushed
through another server rules here too."""

from __future__ import annotations

import pytest
from test_engine import (SPEC, FakeClock, assign, clock, connect, engine, enqueue, of,  # noqa: F401
                         sent)

from rota.core.effects import Reserve, Reserved, Wake
from rota.core.engine import Engine
from rota.core.jobs import EnqueueRequest
from rota.core.auth import OPEN
from rota.core.model import JobRecord, JobState
from rota.base.ojs import OjsExtras
from rota.base.specs import JobSpec, checksum
from rota.core.ready import WorkerSlot


def row_of(engine: Engine, clock: FakeClock, job_id: str, seq: int, **options: object) -> JobRecord:
    """A job as another server's enqueue stored it: its row, read back here."""
    built = engine.build(EnqueueRequest(spec="echo", id=job_id, **options), OPEN, clock())
    assert isinstance(built, JobRecord)
    built.seq = seq
    return built


def test_a_job_another_server_made_wait_is_taken_in_and_assigned(engine, clock):
    connect(engine, clock)
    job = row_of(engine, clock, "from-b", 7, priority=1_000_000)  # held whole
    effects = engine.taken_in([job], clock())
    assert of(Wake, effects)
    [copy] = assign(engine, clock)
    assert copy["id"] == "from-b" and copy["attempt"] == 1


def test_a_reservation_that_lost_to_another_server_sends_nothing_and_frees_the_slot(
        engine, clock):
    connect(engine, clock, capacity=1)
    engine.taken_in([row_of(engine, clock, "contested", 3, priority=1_000_000)], clock())
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert [j.id for j in reserve.jobs] == ["contested"]
    # The row had moved on: another server's worker holds it.
    effects = engine.committed(reserve.ticket, None, clock(),
                               Reserved([], frozenset({"contested"})))
    assert not sent(effects) and of(Wake, effects)
    assert "contested" not in engine.scheduler.jobs
    assert engine.scheduler.workers["w1"].free() == 1
    # The job comes back (its worker there failed it): this server may give it out again.
    engine.taken_in([row_of(engine, clock, "contested", 3, priority=1_000_000)], clock())
    [copy] = assign(engine, clock)
    assert copy["id"] == "contested"


def test_a_copy_this_server_has_reserved_is_not_replaced_by_a_notice(engine, clock):
    connect(engine, clock)
    [job] = enqueue(engine, clock, 1, priority=1_000_000)
    [copy] = assign(engine, clock)
    stale = row_of(engine, clock, job.id, job.seq, priority=1_000_000)
    engine.taken_in([stale], clock())
    assert engine.scheduler.jobs[job.id].state == JobState.ACTIVE
    assert engine.scheduler.jobs[job.id].worker_id == "w1"


def test_a_waiting_copy_gives_way_to_the_row(engine, clock):
    held = row_of(engine, clock, "moved", 5, priority=1_000_000, delay=60)
    engine.taken_in([held], clock())
    assert engine.scheduler.jobs["moved"].state == JobState.SCHEDULED
    now_available = row_of(engine, clock, "moved", 5, priority=1_000_000)
    engine.taken_in([now_available], clock())
    assert engine.scheduler.jobs["moved"].state == JobState.AVAILABLE
    connect(engine, clock)
    assert [c["id"] for c in assign(engine, clock)] == ["moved"]


def test_a_status_quo_pushed_through_another_server_gates_this_servers_workers(engine, clock):
    connect(engine, clock)  # declares echo at version 1
    v2 = JobSpec(name="echo", version="2")
    effects = engine.status_quo_read({"echo": v2}, {"echo": checksum(v2)}, {}, clock())
    assert of(Wake, effects)
    assert engine.scheduler.status_quo["echo"] == checksum(v2)
    enqueue(engine, clock, 1)
    assert not of(Reserve, engine.dispatch(clock()))  # w1 runs the old echo: nothing for it
    # Reading the same status quo again changes nothing.
    assert engine.status_quo_read({"echo": v2}, {"echo": checksum(v2)}, {}, clock()) == []


def test_a_retirement_through_another_server_refuses_new_jobs_here(engine, clock):
    engine.status_quo_read({"echo": SPEC}, {"echo": checksum(SPEC)}, {"echo": 1.0}, clock())
    refused = engine.build(EnqueueRequest(spec="echo"), OPEN, clock())
    assert not isinstance(refused, JobRecord) and refused.code == "spec_retired"


def test_a_job_whose_key_is_known_twice_is_assigned_once(engine, clock):
    """A stale key (another server took the job) and a fresh one (it came back) for one
    row: a round may claim both; the store reserves the row once, and the worker is
    sent the job once."""
    connect(engine, clock, capacity=2)
    [job] = enqueue(engine, clock, 1)  # kept as a key
    engine.taken_in([row_of(engine, clock, job.id, job.seq)], clock())  # the key again
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert [c.seq for c in reserve.claims] == [job.seq, job.seq]
    claimed = row_of(engine, clock, job.id, job.seq)
    claimed.state, claimed.worker_id, claimed.attempt = JobState.ACTIVE, "w1", 1
    claimed.checksum = reserve.claims[0].checksum
    effects = engine.committed(reserve.ticket, None, clock(), Reserved([claimed, None]))
    assert [j["id"] for f in sent(effects) for j in f["jobs"]] == [job.id]
    assert engine.scheduler.workers["w1"].free() == 1


def test_after_a_lapsed_lease_a_job_given_out_again_is_cancelled_on_the_worker_here(
        engine, clock):
    """This server stalled past its lease; another recovered its workers' jobs. Of the
    two its worker runs, one was taken back (its row names this server again) and one
    was given out again elsewhere: that run is cancelled as a lost reservation, its slot
    is free, and nothing is sent about the other."""
    connect(engine, clock, capacity=2)
    kept, lost = enqueue(engine, clock, 2, priority=1_000_000)
    assert sorted(c["id"] for c in assign(engine, clock)) == sorted([kept.id, lost.id])
    assert {j.id for j in engine.running_here()} == {kept.id, lost.id}
    effects = engine.lapse_settled([lost.id], clock())
    assert sent(effects) == [{"type": "cancel", "job_ids": [lost.id],
                              "reason": "reservation_lost"}]
    assert of(Wake, effects)
    assert lost.id not in engine.scheduler.jobs
    assert engine.scheduler.jobs[kept.id].state == JobState.ACTIVE
    assert engine.scheduler.workers["w1"].free() == 1
    assert [j.id for j in engine.running_here()] == [kept.id]
    # A job that ended here meanwhile (its result came first) is left as it is.
    assert engine.lapse_settled(["no-such-job"], clock()) == [Wake()]


# -- this server's lease (rota/core/standing.py) ----------------------------------------------
LEASE = 4.0


def shared(engine: Engine, clock: FakeClock) -> None:
    """The engine as one of several servers: its lease taken now, for LEASE seconds."""
    engine.standing.lease = LEASE
    engine.lease_taken(clock().mono, clock())


def test_a_server_that_cannot_renew_hands_out_no_work_before_its_lease_can_lapse(
        engine, clock):
    shared(engine, clock)
    connect(engine, clock, capacity=1)
    enqueue(engine, clock, 3)
    assert len(assign(engine, clock)) == 1  # a lease held: work goes out
    clock.advance(LEASE / 2)  # renewals failed meanwhile: half the lease is left
    engine.lease_failed()
    connect(engine, clock, worker="w2", conn=2, capacity=1)
    assert of(Reserve, engine.dispatch(clock()))  # more than a quarter left: still
    clock.advance(LEASE / 4 + 0.01)  # a quarter left, or less: nothing more is reserved
    connect(engine, clock, worker="w3", conn=3, capacity=1)
    assert not engine.dispatch(clock())
    assert not engine.standing.may_hand_out(clock().mono)
    # The next renewal that works gives it a lease again, and wakes the rounds.
    started = clock().mono
    effects = engine.lease_renewed(started, clock.advance(0.5))
    assert of(Wake, effects)
    assert of(Reserve, engine.dispatch(clock()))


def test_a_renewal_holds_the_lease_from_when_it_began_not_from_when_it_committed(
        engine, clock):
    shared(engine, clock)
    started = clock().mono
    clock.advance(LEASE * 0.6)  # a renewal that waited (a slow commit, a lock)
    engine.lease_renewed(started, clock())
    assert engine.standing.left(clock().mono) == pytest.approx(LEASE * 0.4)
    assert not engine.standing.may_hand_out(clock.advance(LEASE * 0.2).mono)


def test_a_server_on_its_own_database_has_no_lease_to_lose(engine, clock):
    connect(engine, clock, capacity=1)
    enqueue(engine, clock, 1)
    clock.advance(1000)
    assert len(assign(engine, clock)) == 1


def renew_every(engine: Engine, clock: FakeClock, seconds: float, step: float = LEASE / 4
                ) -> None:
    """Renew in time (every quarter lease) for ``seconds``."""
    end = clock().mono + seconds
    while clock().mono < end:
        started = clock().mono
        engine.lease_renewed(started, clock.advance(step))


def test_another_servers_lease_is_judged_only_after_a_whole_lease_of_renewals_in_time(
        engine, clock):
    shared(engine, clock)
    assert not engine.standing.may_judge(clock().mono)  # just started
    renew_every(engine, clock, LEASE)
    assert engine.standing.may_judge(clock().mono)
    # The database is away: no vantage while it is, nor for a lease after it came back.
    engine.lease_failed()
    assert not engine.standing.may_judge(clock().mono)
    clock.advance(2 * LEASE)
    renew_every(engine, clock, LEASE - 0.5)
    assert not engine.standing.may_judge(clock().mono)
    renew_every(engine, clock, 1.0)
    assert engine.standing.may_judge(clock().mono)


def test_a_late_renewal_or_a_stall_of_its_own_starts_the_vantage_anew(engine, clock):
    shared(engine, clock)
    renew_every(engine, clock, LEASE)
    assert engine.standing.may_judge(clock().mono)
    started = clock().mono  # this server was stopped (SIGSTOP) with a renewal in flight
    engine.lease_renewed(started, clock.advance(3 * LEASE))
    assert not engine.standing.may_judge(clock().mono)
    renew_every(engine, clock, LEASE + 1)  # (a whole lease from the first renewal after)
    assert engine.standing.may_judge(clock().mono)
    # Its tick came late: it stalled, whatever its renewals say.
    connect(engine, clock)
    engine.tick(clock.advance(engine.tick_every + 1.0))
    assert not engine.standing.may_judge(clock().mono)
    renew_every(engine, clock, LEASE + 1)  # (a whole lease from the first renewal after)
    assert engine.standing.may_judge(clock().mono)


def test_an_unversioned_type_another_server_took_is_unversioned_here_too(engine, clock):
    other = Engine(engine.settings)  # the server whose OJS route took the job
    job = other.build(EnqueueRequest(spec="x.y", ojs=OjsExtras()), OPEN, clock())
    assert isinstance(job, JobRecord) and "x.y" in other.unversioned
    job.seq = 7
    engine.taken_in([job], clock())
    pull = WorkerSlot(id="ojs:p", queues=["default"], concurrency=0, specs={}, any_type=True)
    assert "x.y" in engine.unversioned and engine.scheduler.matches(pull, "x.y")
