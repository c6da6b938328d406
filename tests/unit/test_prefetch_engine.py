"""Prefetch on the server, decided in-process with a fake clock: a worker that registers
``prefetch`` is given up to ``concurrency + prefetch`` jobs; a job it gives back unstarted
(``released``) goes back at once and costs no attempt; waiting jobs' leases are renewed
and reclaimed like running ones (docs/protocol.md §3.5)."""

from __future__ import annotations

import json
from typing import Any

from test_engine import ROWS, FakeClock, assign, done, enqueue, of, run_for, sent
from test_engine import clock, engine  # noqa: F401  (fixtures)

from rota.base import protocol as p
from rota.core.auth import OPEN
from rota.core.effects import Effect, Save
from rota.core.engine import Engine
from rota.core.model import JobRecord, JobState
from rota.core.scheduler import WorkerSlot
from rota.base.specs import JobSpec, checksum

SPEC = JobSpec(name="echo", version="1")


def beat(worker: str, seq: int, *, prefetch: int | None = None, concurrency: int = 2,
         active: list[str] | None = None, prefetched: list[str] | None = None,
         results: list[p.Result] | None = None, capacity: int | None = None,
         state: str = "running") -> p.Heartbeat:
    registration = None
    if prefetch is not None:
        registration = p.Registration(
            hostname="h", os="linux", pid=7, sdk="test", queues=["default"],
            concurrency=concurrency, specs=[p.SpecRef(SPEC.name, checksum(SPEC))],
            started_at="t0", prefetch=prefetch)
    status = p.Status(state=state, active_job_ids=active or [],  # type: ignore[arg-type]
                      prefetched_job_ids=prefetched or [])
    return p.Heartbeat(seq=seq, worker_id=worker, registration=registration, status=status,
                       results=results or [], capacity=capacity)


def join(engine: Engine, clock: FakeClock, *, prefetch: int, concurrency: int = 2,
         capacity: int = 100, worker: str = "w1", conn: int = 1) -> None:
    first = beat(worker, 0, prefetch=prefetch, concurrency=concurrency, capacity=capacity)
    engine.register(conn, first, OPEN, clock())
    engine.heartbeat(conn, worker, first, clock())


def job_of(engine: Engine, job_id: str) -> JobRecord:
    """The job, whether the scheduler holds it whole or only as a key (rota/core/ready.py):
    the test store keeps every job it was given (test_engine.ROWS)."""
    return next(job for job in ROWS[engine].values() if job.id == job_id)


def released(job: dict[str, Any]) -> p.Result:
    return p.Result(job_id=job["id"], attempt=job["attempt"], outcome="failed",
                    error=p.ErrorInfo(type="released", message="given back unstarted"))


def commit(engine: Engine, clock: FakeClock, effects: list[Effect]) -> list[Effect]:
    [save] = of(Save, effects)
    return engine.committed(save.ticket, None, clock())


# -- the rule ---------------------------------------------------------------------------
def test_free_slots_count_the_prefetch_beyond_concurrency():
    slot = WorkerSlot(id="w", queues=["q"], concurrency=10, specs={}, capacity=100, prefetch=5)
    assert slot.free() == 15
    slot.active = {f"j{i}" for i in range(12)}
    assert slot.free() == 3 and slot.running() == 10
    slot.capacity = 1  # the worker's own wish still caps it
    assert slot.free() == 1
    old = WorkerSlot(id="o", queues=["q"], concurrency=10, specs={}, capacity=100)
    assert old.free() == 10  # no prefetch field: today's rule


def test_a_worker_is_given_concurrency_plus_prefetch_and_no_more(engine, clock):
    join(engine, clock, prefetch=3, concurrency=2)
    enqueue(engine, clock, 9)
    assert len(assign(engine, clock)) == 5
    assert engine.dispatch(clock()) == []  # full: nothing more until something ends


def test_an_older_worker_without_prefetch_gets_concurrency(engine, clock):
    reg = p.Registration(hostname="h", os="linux", pid=7, sdk="old", queues=["default"],
                         concurrency=2, specs=[p.SpecRef(SPEC.name, checksum(SPEC))])
    # An older worker's registration has no prefetch field at all: it decodes to 0.
    frame = json.loads(p.encode(p.Heartbeat(seq=0, worker_id="w1", registration=reg,
                                            capacity=100)))
    del frame["registration"]["prefetch"]
    first = p.decode_heartbeat(json.dumps(frame))
    assert first.registration is not None and first.registration.prefetch == 0
    engine.register(1, first, OPEN, clock())
    engine.heartbeat(1, "w1", first, clock())
    enqueue(engine, clock, 5)
    assert len(assign(engine, clock)) == 2


def test_a_released_job_goes_back_at_once_and_costs_no_attempt(engine, clock):
    join(engine, clock, prefetch=2, concurrency=1)
    enqueue(engine, clock, 3, max_attempts=1)
    copies = assign(engine, clock)
    assert len(copies) == 3
    waiting = copies[1:]
    effects = engine.heartbeat(1, "w1", beat("w1", 1, active=[copies[0]["id"]],
                                             results=[released(j) for j in waiting],
                                             capacity=0, state="quiet"), clock())
    after = commit(engine, clock, effects)
    [ack] = [f for f in sent(after) if f["type"] == "ack"]
    assert sorted(ack["accepted"]) == sorted(j["id"] for j in waiting)
    for copy in waiting:
        job = job_of(engine, copy["id"])
        # max_attempts is 1 and one lease was taken, yet the job is available again.
        assert job.state == JobState.AVAILABLE and job.attempt == 1 and job.fails == 0
    # Another worker runs them: their next attempt is number 2, and it may still run.
    join(engine, clock, prefetch=0, concurrency=2, worker="w2", conn=2)
    again = assign(engine, clock)
    assert sorted(j["id"] for j in again) == sorted(j["id"] for j in waiting)
    assert {j["attempt"] for j in again} == {2}
    effects = engine.heartbeat(2, "w2", beat("w2", 1, results=[done(j) for j in again]),
                               clock())
    commit(engine, clock, effects)
    assert all(engine.scheduler.jobs.get(j["id"]) is None for j in again)  # completed


def test_a_release_keeps_the_poison_tally(engine, clock):
    join(engine, clock, prefetch=1, concurrency=1)
    [job] = enqueue(engine, clock, 1)
    job.deaths = 2  # two workers died holding it in a row
    [copy] = assign(engine, clock)
    effects = engine.heartbeat(1, "w1", beat("w1", 1, results=[released(copy)]), clock())
    commit(engine, clock, effects)
    assert job.deaths == 2 and job.state == JobState.AVAILABLE


def test_a_released_job_with_a_cancel_requested_is_cancelled(engine, clock):
    join(engine, clock, prefetch=1, concurrency=1)
    enqueue(engine, clock, 2)
    copies = assign(engine, clock)
    job = job_of(engine, copies[1]["id"])
    outcome, effects = engine.cancel(job.id, clock())
    assert outcome == "requested" and [f for f in sent(effects) if f["type"] == "cancel"]
    effects = engine.heartbeat(1, "w1", beat("w1", 1, results=[released(copies[1])]), clock())
    commit(engine, clock, effects)
    assert job.state == JobState.CANCELLED


# -- leases, reclaim, disconnect ---------------------------------------------------------
def test_waiting_jobs_named_as_prefetched_keep_their_lease(engine, clock):
    join(engine, clock, prefetch=1, concurrency=1)
    enqueue(engine, clock, 2, visibility_timeout=10.0)
    running, waiting = assign(engine, clock)
    for seq in range(1, 30):  # 15 s of beats, past the 10 s lease
        clock.advance(0.5)
        engine.heartbeat(1, "w1", beat("w1", seq, active=[running["id"]],
                                       prefetched=[waiting["id"]]), clock())
        assert not [f for f in sent(engine.tick(clock())) if f["type"] == "cancel"]
    assert job_of(engine, waiting["id"]).state == JobState.ACTIVE


def one_running_one_waiting(engine: Engine, clock: FakeClock, *, reported: bool
                            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A worker of concurrency 1 and prefetch 1 holding two jobs (and saying so)."""
    join(engine, clock, prefetch=1, concurrency=1)
    enqueue(engine, clock, 2)
    running, waiting = assign(engine, clock)
    if reported:
        engine.heartbeat(1, "w1", beat("w1", 1, active=[running["id"]],
                                       prefetched=[waiting["id"]]), clock())
    return running, waiting


def come_back(engine: Engine, clock: FakeClock, running: dict[str, Any],
              waiting: dict[str, Any]) -> list[Effect]:
    """The worker reconnects naming both jobs: the running one and the waiting one."""
    first = beat("w1", 0, prefetch=1, concurrency=1, active=[running["id"]],
                 prefetched=[waiting["id"]], capacity=0)
    engine.register(2, first, OPEN, clock())
    return engine.heartbeat(2, "w1", first, clock())


def test_a_lost_worker_reclaims_its_waiting_jobs(engine, clock):
    running, waiting = one_running_one_waiting(engine, clock, reported=True)
    engine.disconnect(1, "w1", "connection_lost", clock())
    effects = come_back(engine, clock, running, waiting)
    assert not [f for f in sent(effects) if f["type"] == "cancel"]  # both are still its own
    job = job_of(engine, waiting["id"])
    assert job.state == JobState.ACTIVE and not job.orphaned
    assert engine.scheduler.workers["w1"].running() == 1


def test_a_waiting_job_taken_back_while_away_is_stopped_on_return(engine, clock):
    running, waiting = one_running_one_waiting(engine, clock, reported=False)
    engine.disconnect(1, "w1", "connection_lost", clock())
    run_for(engine, clock, 6.0)  # the grace ran out: both went back
    [cancel] = [f for f in sent(come_back(engine, clock, running, waiting))
                if f["type"] == "cancel"]
    assert cancel["reason"] == "reservation_lost"
    assert sorted(cancel["job_ids"]) == sorted([running["id"], waiting["id"]])


def test_a_dead_workers_waiting_jobs_go_back_and_count_as_a_death(engine, clock):
    # The server cannot tell a job that started after the worker's last status from one
    # that never started: a job that kills its worker on start must still reach at most
    # max_worker_deaths workers, so every held job counts (docs/protocol.md §5.2).
    running, waiting = one_running_one_waiting(engine, clock, reported=True)
    engine.disconnect(1, "w1", "closed", clock())
    for copy in (running, waiting):
        job = job_of(engine, copy["id"])
        assert job.state == JobState.AVAILABLE and job.deaths == 1


def test_get_workers_counts_running_and_waiting_apart(engine, clock):
    join(engine, clock, prefetch=3, concurrency=2)
    enqueue(engine, clock, 4)
    assign(engine, clock)
    slot = engine.scheduler.workers["w1"]
    assert (slot.running(), len(slot.active) - slot.running()) == (2, 2)
