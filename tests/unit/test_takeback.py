"""Start reports and take-back, decided in-process with a fake clock (rota/core/lines.py):
a job waiting unstarted in a busy worker's line goes to an idle worker once its holder
gives it back, at no attempt's cost; a job that started stays where it runs; a worker's
death counts only against the jobs that started (docs/protocol.md §3.5, §4.6)."""

from __future__ import annotations

from typing import Any

from test_engine import ROWS, FakeClock, assign, of, run_for, sent
from test_engine import clock, engine, enqueue  # noqa: F401  (fixtures)

from rota.base import protocol as p
from rota.base.specs import JobSpec, checksum
from rota.core.auth import OPEN
from rota.core.effects import Effect, Reserve, Save
from rota.core.engine import Engine
from rota.core.lines import choose_take_backs, split_started
from rota.core.model import JobRecord, JobState
from rota.core.scheduler import WorkerSlot

SPEC = JobSpec(name="echo", version="1")


def beat(worker: str, seq: int, *, register: bool = False, reports: bool = True,
         concurrency: int = 1, prefetch: int = 1, active: list[str] | None = None,
         prefetched: list[str] | None = None, started: list[str] | None = None,
         given_back: list[str] | None = None, capacity: int | None = None,
         results: list[p.Result] | None = None) -> p.Heartbeat:
    registration = p.Registration(
        hostname="h", os="linux", pid=7, sdk="test", queues=["default"],
        concurrency=concurrency, specs=[p.SpecRef(SPEC.name, checksum(SPEC))],
        started_at="t0", prefetch=prefetch, reports_starts=reports) if register else None
    status = p.Status(state="running", active_job_ids=active or [],
                      prefetched_job_ids=prefetched or [], started=started or [],
                      given_back=given_back or [])
    return p.Heartbeat(seq=seq, worker_id=worker, registration=registration, status=status,
                       capacity=capacity, results=results or [])


def join(engine: Engine, clock: FakeClock, worker: str, conn: int, *, capacity: int,
         **options: Any) -> list[Effect]:
    first = beat(worker, 0, register=True, capacity=capacity, **options)
    engine.register(conn, first, OPEN, clock())
    return engine.heartbeat(conn, worker, first, clock())


def job_of(engine: Engine, job_id: str) -> JobRecord:
    held = engine.scheduler.jobs.get(job_id)
    return held or next(j for j in ROWS[engine].values() if j.id == job_id)


def busy_line(engine: Engine, clock: FakeClock, *, reports: bool = True
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Worker w1 (concurrency 1, prefetch 1) runs a long job and holds a quick one in its
    line; it said it started the first."""
    join(engine, clock, "w1", 1, capacity=2, reports=reports)
    enqueue(engine, clock, 2)
    running, waiting = assign(engine, clock)
    engine.heartbeat(1, "w1", beat("w1", 1, active=[running["id"]], prefetched=[waiting["id"]],
                                   started=[running["id"]], capacity=0), clock())
    return running, waiting


def take_backs(effects: list[Effect], conn: int = 1) -> list[list[str]]:
    return [f["job_ids"] for f in sent(effects, conn) if f["type"] == "take_back"]


def test_a_job_waiting_in_a_busy_line_goes_to_an_idle_worker_at_no_attempts_cost(engine,
                                                                                 clock):
    running, waiting = busy_line(engine, clock)
    assert not job_of(engine, waiting["id"]).started and job_of(engine, running["id"]).started
    join(engine, clock, "w2", 2, capacity=1, reports=False)  # idle: any worker may be
    effects = engine.dispatch(clock())
    assert take_backs(effects) == [[waiting["id"]]] and not of(Reserve, effects)
    # Asked once: the next rounds wait for the answer.
    assert take_backs(engine.dispatch(clock())) == []
    # The holder gives it back (and would take another: capacity 1).
    effects = engine.heartbeat(1, "w1", beat("w1", 2, active=[running["id"]],
                                             given_back=[waiting["id"]], capacity=1), clock())
    [save] = of(Save, effects)
    engine.committed(save.ticket, None, clock())
    job = job_of(engine, waiting["id"])
    assert job.state == JobState.AVAILABLE and job.attempt - job.budget_start == 0
    # The next round gives it to the idle worker, not back to the line it left.
    effects = engine.dispatch(clock())
    [reserve] = of(Reserve, effects)
    [claim] = reserve.claims
    assert claim.worker.id == "w2"


def test_a_job_that_started_meanwhile_runs_where_it_is(engine, clock):
    running, waiting = busy_line(engine, clock)
    join(engine, clock, "w2", 2, capacity=1)
    assert take_backs(engine.dispatch(clock())) == [[waiting["id"]]]
    # The long job ended and the quick one started before the take_back arrived.
    engine.heartbeat(1, "w1", beat("w1", 2, active=[waiting["id"]], started=[waiting["id"]]),
                     clock())
    job = job_of(engine, waiting["id"])
    assert job.state == JobState.ACTIVE and job.worker_id == "w1" and job.started
    assert take_backs(engine.dispatch(clock())) == []


def test_an_older_worker_is_never_asked_and_its_jobs_count_as_started(engine, clock):
    running, waiting = busy_line(engine, clock, reports=False)
    join(engine, clock, "w2", 2, capacity=1)
    assert take_backs(engine.dispatch(clock())) == []
    assert job_of(engine, waiting["id"]).started


def test_a_job_sent_to_a_free_slot_is_not_asked_back(engine, clock):
    """Held within concurrency, an unreported job is being started, not waiting."""
    join(engine, clock, "w1", 1, capacity=2, concurrency=2, prefetch=0)
    enqueue(engine, clock, 2)
    assign(engine, clock)
    join(engine, clock, "w2", 2, capacity=1)
    assert take_backs(engine.dispatch(clock())) == []


def test_only_what_the_idle_slots_can_run_is_asked_back():
    idle = WorkerSlot(id="idle", queues=["q"], concurrency=2, specs={})
    jobs = [JobRecord(id=f"j{i}", spec="s", queue="q", args=None, priority=0,  # type: ignore[arg-type]
                      enqueued_at=0.0, seq=i, limits=None) for i in range(4)]  # type: ignore[arg-type]
    picks = choose_take_backs([(idle, 2)], [("h1", jobs[:3]), ("h2", jobs[3:])],
                              lambda w, j: j.id != "j0", budget=5)
    assert picks == {"h1": ["j1", "j2"]}
    assert choose_take_backs([(idle, 2)], [("h1", jobs)], lambda w, j: True, budget=1) == {
        "h1": ["j0"]}


# -- deaths ----------------------------------------------------------------------------
def test_a_dead_workers_unstarted_jobs_go_back_with_no_death_and_no_attempt(engine, clock):
    running, waiting = busy_line(engine, clock)
    engine.disconnect(1, "w1", "closed", clock())
    dead, spared = job_of(engine, running["id"]), job_of(engine, waiting["id"])
    assert dead.state == spared.state == JobState.AVAILABLE
    assert (dead.deaths, dead.attempt - dead.budget_start) == (1, 1)
    assert (spared.deaths, spared.attempt - spared.budget_start) == (0, 0)


def test_a_job_that_may_have_started_since_the_last_status_counts_its_death(engine, clock):
    """Sent to a free slot and the worker died before its next heartbeat: it may be the
    job that killed it, so it counts (a poison job must not go round for ever)."""
    join(engine, clock, "w1", 1, capacity=2)
    enqueue(engine, clock, 2)
    first, second = assign(engine, clock)
    engine.disconnect(1, "w1", "closed", clock())
    assert job_of(engine, first["id"]).deaths == 1  # the first in line: it had a slot
    assert job_of(engine, second["id"]).deaths == 0  # behind it: surely waiting


def test_an_unstarted_job_kept_for_a_lost_worker_goes_back_unused_after_the_grace(engine,
                                                                                 clock):
    running, waiting = busy_line(engine, clock)
    engine.disconnect(1, "w1", "connection_lost", clock())
    run_for(engine, clock, 6.0)  # the reconnect grace (5 s) ran out
    dead, spared = job_of(engine, running["id"]), job_of(engine, waiting["id"])
    assert (dead.deaths, spared.deaths) == (1, 0)
    assert spared.state == JobState.AVAILABLE and spared.attempt - spared.budget_start == 0


def test_split_started_counts_the_oldest_waiting_jobs_as_many_as_free_slots():
    def job(i: int, started: bool = False) -> JobRecord:
        return JobRecord(id=f"j{i}", spec="s", queue="q", args=None, priority=0,  # type: ignore[arg-type]
                         enqueued_at=0.0, seq=i, limits=None, started=started)  # type: ignore[arg-type]

    held = [job(3), job(1, started=True), job(2), job(4)]
    started, unstarted = split_started(held, concurrency=2, line=["j1", "j2", "j3", "j4"])
    assert [j.id for j in started] == ["j1", "j2"] and [j.id for j in unstarted] == ["j3", "j4"]


def test_a_run_whose_result_could_not_be_stored_still_counts_as_started(engine, clock):
    running, _ = busy_line(engine, clock)
    failed = p.Result(job_id=running["id"], attempt=1, outcome="failed",
                      error=p.ErrorInfo(type="ValueError", message="no"))
    effects = engine.heartbeat(1, "w1", beat("w1", 2, results=[failed]), clock())
    [save] = of(Save, effects)
    engine.committed(save.ticket, OSError("disk full"), clock())  # reserved by w1 again
    job = job_of(engine, running["id"])
    assert job.state == JobState.ACTIVE and job.started
