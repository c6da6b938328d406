"""Flow control decided by the engine on a fake clock (rota/core/flow.py): concurrency
limits reached and released, a rate window, keys taking turns, a label miss, a store
guard's refusal, a restart's active jobs counting, and what a round costs."""

from __future__ import annotations

import collections
import json
from typing import Any

import msgspec
from test_engine import ROWS, FakeClock, assign, clock, commit, connect, done, engine, hb, of  # noqa: F401
from test_engine import SEQ, SPEC, job_of, read, sent

from rota.base.specs import checksum
from rota.core.auth import OPEN
from rota.core.effects import Arm, Guard, Reserve, Reserved, Wake
from rota.core.engine import Engine
from rota.core.flow import Held, missing_labels
from rota.core.jobs import EnqueueRequest
from rota.core.limits import PENDING_AT_MOST, LimitRule, LimitUse, Rate
from rota.core.model import JobRecord, Limits
from rota.core.settings import ServerSettings

SPEC_LIMIT = ("spec", "echo")


def put(engine: Engine, clock: FakeClock, key: str | None, n: int = 1,
        labels: tuple[str, ...] = (), prefix: str = "") -> list[JobRecord]:
    """``n`` jobs of spec echo with this concurrency key and labels, their rows written."""
    rows = ROWS.setdefault(engine, {})
    jobs = []
    for _ in range(n):
        job = engine.build(EnqueueRequest(spec="echo", id=f"{prefix}{key}-{len(rows)}"), OPEN,
                           clock())
        assert isinstance(job, JobRecord)
        job.concurrency_key, job.labels = key, labels
        rows[len(rows) + 1] = job
        engine.enqueued(job, len(rows), clock())
        jobs.append(job)
    return jobs


def keys_of(assigned: list[dict[str, Any]]) -> list[str]:
    return [job["id"].rsplit("-", 1)[0] for job in assigned]


def finish(engine: Engine, clock: FakeClock, jobs: list[dict[str, Any]], worker: str = "w1",
           conn: int = 1) -> None:
    engine.heartbeat(conn, worker, hb(worker, next(SEQ), results=[done(j) for j in jobs],
                                      capacity=len(jobs)), clock())
    # (the results' commit)
    ticket = max(engine._pending)
    engine.committed(ticket, None, clock(), {})


def test_a_key_limit_is_reached_and_released(engine, clock):
    engine.set_limits({SPEC_LIMIT: LimitRule(key_concurrency=2)}, clock())
    put(engine, clock, "acme", 5)
    connect(engine, clock, capacity=8)
    first = assign(engine, clock)
    assert keys_of(first) == ["acme", "acme"]  # 2 at once, though 8 slots are free
    wait = engine.scheduler.job_wait(_waiting("acme"), clock())
    assert wait is not None and wait.kind == "concurrency_limit" and not wait.blocked
    assert wait.reason == "concurrency limit 2 for spec echo key acme: 2 running"
    assert engine.dispatch(clock()) == []  # parked: nothing to plan
    finish(engine, clock, first[:1])
    assert keys_of(assign(engine, clock)) == ["acme"]  # one left active: one more
    use = engine.limit_use(clock())
    assert use == [LimitUse(name="spec:echo", key="acme", concurrency=2, running=2)]


def _waiting(key: str | None, labels: tuple[str, ...] = ()) -> Any:
    return collections.namedtuple("W", "queue spec concurrency_key labels")(
        "default", "echo", key, labels)


def test_a_spec_limit_holds_every_key_and_the_queue_view_says_so(engine, clock):
    engine.set_limits({SPEC_LIMIT: LimitRule(concurrency=3)}, clock())
    put(engine, clock, "a", 3)
    put(engine, clock, "b", 3)
    connect(engine, clock, capacity=8)
    assert len(assign(engine, clock)) == 3
    wait = engine.scheduler.wait("default", "echo", clock().mono)
    assert wait is not None and wait.reason == "concurrency limit 3 for spec echo: 3 running"
    assert engine.dispatch(clock()) == []


def test_keys_take_turns_whatever_their_backlog(engine, clock):
    put(engine, clock, "big", 50)
    put(engine, clock, "small", 3)
    put(engine, clock, None, 2)  # jobs with no key are one more group in the rotation
    connect(engine, clock, capacity=4)
    first = assign(engine, clock)
    assert keys_of(first) == ["None", "big", "small", "None"]  # in turn, not by backlog
    finish(engine, clock, first)
    assert keys_of(assign(engine, clock)) == ["big", "small", "big", "small"]


def test_priority_orders_jobs_within_a_key(engine, clock):
    rows = ROWS.setdefault(engine, {})
    for priority in (1, 5, 3):
        job = engine.build(EnqueueRequest(spec="echo", id=f"p{priority}", priority=priority),
                           OPEN, clock())
        assert isinstance(job, JobRecord)
        job.concurrency_key = "k"
        rows[len(rows) + 1] = job
        engine.enqueued(job, len(rows), clock())
    connect(engine, clock, capacity=1)
    assert [j["id"] for j in assign(engine, clock)] == ["p5"]


def test_a_rate_window_slides_and_its_wait_says_when(engine, clock):
    engine.set_limits({SPEC_LIMIT: LimitRule(key_rate=Rate(2, 10.0))}, clock())
    put(engine, clock, "acme", 4)
    connect(engine, clock, capacity=8)
    effects = engine.dispatch(clock())
    [reserve] = of(Reserve, effects)
    assert [a.deadline for a in of(Arm, effects)][:1] == [clock().mono + 10.0]  # when it opens
    assert reserve.starts() == [("spec:echo", "acme")] * 2
    assert set(reserve.guards.values()) == {(Guard("spec:echo", "acme", None, Rate(2, 10.0)),)}
    first = [job for frame in commit_sent(engine, reserve, clock) for job in frame]
    finish(engine, clock, first)  # finished: the rate, not the concurrency, holds them
    clock.advance(9.6)
    wait = engine.scheduler.job_wait(_waiting("acme"), clock())
    assert wait is not None and wait.kind == "rate_limit"
    assert wait.reason == "rate limit 2/10s for key acme: next start in 0.4 s"
    assert not of(Wake, engine.tick(clock()))  # not yet
    clock.advance(0.5)
    assert of(Wake, engine.tick(clock()))  # the timer brings the key back
    assert keys_of(assign(engine, clock)) == ["acme", "acme"]


def commit_sent(engine: Engine, reserve: Reserve, clock: FakeClock) -> list[list[dict[str, Any]]]:
    frames = [json.loads(e.frame) for e in commit(engine, reserve, clock) if hasattr(e, "frame")]
    return [f["jobs"] for f in frames if f["type"] == "assign"]


def test_a_job_needing_a_label_waits_for_a_worker_that_has_it(engine, clock):
    put(engine, clock, None, 1, labels=("gpu",))
    put(engine, clock, None, 1, prefix="plain")
    connect(engine, clock, capacity=4)  # no labels
    assert keys_of(assign(engine, clock)) == ["plainNone"]
    wait = engine.scheduler.job_wait(_waiting(None, ("gpu",)), clock())
    assert wait is not None and wait.kind == "no_label" and wait.blocked
    assert wait.reason == "no connected worker has label gpu"
    assert engine.dispatch(clock()) == []
    labelled(engine, clock, "w2", 2, ["gpu", "region:eu"])
    effects = engine.dispatch(clock())
    [reserve] = of(Reserve, effects)
    assert [c.worker.id for c in reserve.claims] == ["w2"]
    assert engine.scheduler.job_wait(_waiting(None, ("gpu",)), clock()) is None


def test_a_refusal_by_the_store_guard_puts_the_job_back_and_holds_the_key_off(engine, clock):
    engine.set_limits({SPEC_LIMIT: LimitRule(key_concurrency=2)}, clock())
    put(engine, clock, "acme", 3)
    connect(engine, clock, capacity=8)
    [reserve] = of(Reserve, engine.dispatch(clock()))
    refused = reserve.claims[1].seq  # another server holds acme's second slot
    rows = read(engine, reserve)
    ROWS[engine][refused].state = "available"  # the store left it as it was
    rows[1] = None
    effects = engine.committed(reserve.ticket, None, clock(),
                               Reserved(rows, refused=frozenset({refused})))
    assert len([e for e in effects if hasattr(e, "frame")]) == 1  # one assign, one job
    assert of(Arm, effects)
    assert engine.scheduler.workers["w1"].free() == 3  # the slot is back
    assert engine.scheduler.ready.keys == 2  # back in its bucket
    wait = engine.scheduler.job_wait(_waiting("acme"), clock())
    assert wait is not None and "held by another server" in wait.reason
    assert not of(Reserve, engine.dispatch(clock()))  # held off
    clock.advance(0.6)
    assert of(Wake, engine.tick(clock()))
    [again] = of(Reserve, engine.dispatch(clock()))
    assert len(again.claims) == 1  # acme has one running here: one more


def test_jobs_active_at_a_restart_count_against_their_limit(clock):
    engine = Engine(ServerSettings(heartbeat_timeout=5.0), rand=lambda: 0.0)
    kept = [JobRecord(id=f"k{i}", spec="echo", queue="default", args=msgspec.Raw(b"{}"),
                      priority=0, enqueued_at=clock.wall - 60, seq=i, state="active", attempt=1,
                      worker_id="gone", checksum=checksum(SPEC), concurrency_key="acme",
                      lease_expires_at=clock.wall + 1000, limits=_limits())
            for i in (1, 2)]
    engine.load({"echo": SPEC}, {"echo": checksum(SPEC)}, kept, clock(),
                waiting={("default", "echo", "acme", ()): [10, 11], ("default", "echo"): [12]})
    engine.set_limits({SPEC_LIMIT: LimitRule(key_concurrency=2, rate=Rate(5, 60.0))}, clock(),
                      starts={("spec:echo", None): [clock.wall - 30.0] * 4})
    connect(engine, clock, capacity=8)
    [reserve] = of(Reserve, engine.dispatch(clock()))
    # acme's two slots are the orphans'; the spec's rate had 4 of 5 starts in the last minute
    assert [c.concurrency_key for c in reserve.claims] == [None]
    wait = engine.scheduler.job_wait(_waiting("acme"), clock())
    assert wait is not None and wait.reason.startswith("rate limit 5/min for spec echo")


def _limits() -> Any:
    return Limits(max_attempts=5, max_fails=None, backoff_base=1, backoff_max=1)


def test_no_limits_and_no_keys_keep_the_plain_path(engine, clock):
    put(engine, clock, None, 3)
    connect(engine, clock, capacity=8)
    assert not engine.scheduler.limited
    assert len(assign(engine, clock)) == 3
    assert engine.scheduler.visits == 0


def test_a_queue_limit_and_a_new_table_that_lifts_it(engine, clock):
    engine.set_limits({("queue", "default"): LimitRule(concurrency=1)}, clock())
    put(engine, clock, "a", 2)
    put(engine, clock, "b", 2)
    connect(engine, clock, capacity=4)
    assert len(assign(engine, clock)) == 1
    assert engine.scheduler.wait("default", "echo", clock().mono).kind == "concurrency_limit"
    assert engine.dispatch(clock()) == []
    engine.set_limits({}, clock())  # cleared: the plain rule of "as many as fit" again
    assert sorted(keys_of(assign(engine, clock))) == ["a", "b", "b"]


def test_a_keyed_job_waiting_as_a_key_is_cancelled_from_its_own_bucket(engine, clock):
    [job] = put(engine, clock, "acme", 1, labels=("gpu",))
    assert engine.scheduler.ready.counts() == {("default", "echo"): 1}
    row = {"id": job.id, "rowid": job.seq, "queue": "default", "spec": "echo", "priority": 0,
           "concurrency_key": "acme", "labels": '["gpu"]'}
    outcome, effects = engine.cancel_waiting(row, clock())
    assert outcome == "withdrawing" and engine.scheduler.ready.counts() == {}
    [withdraw] = [e for e in effects if type(e).__name__ == "Withdraw"]
    engine.withdrawn(withdraw, False)  # the row was reserved first: it waits on
    assert engine.scheduler.ready.counts() == {("default", "echo"): 1}


def test_the_jobs_a_key_limit_a_rate_or_labels_hold_are_counted_per_kind(engine, clock):
    engine.set_limits({("queue", "default"): LimitRule(key_concurrency=1),
                       SPEC_LIMIT: LimitRule(key_rate=Rate(1, 60.0))}, clock())
    put(engine, clock, "acme", 3)
    put(engine, clock, None, 2, labels=("gpu",))
    connect(engine, clock, capacity=8)
    first = assign(engine, clock)
    assert keys_of(first) == ["acme"]
    held = engine.scheduler.held(clock().mono)
    # acme: at the queue's key limit (checked before the spec's); the gpu jobs: no worker
    assert held == {("default", "echo"): Held({"concurrency_limit": 2, "no_label": 2},
                                              ("gpu",))}
    finish(engine, clock, first)
    assert engine.scheduler.held(clock().mono) == {
        ("default", "echo"): Held({"rate_limit": 2, "no_label": 2}, ("gpu",))}
    use = engine.limit_use(clock())
    assert [(u.name, u.key, u.running, u.starts, u.next_start) for u in use] == [
        ("spec:echo", "acme", 0, 1, 60.0)]  # (none runs: the queue's key limit shows none)


def labelled(engine: Engine, clock: FakeClock, worker: str, conn: int,
             labels: list[str]) -> None:
    first = hb(worker, 0, register=True, capacity=1)
    assert first.registration is not None
    first.registration.labels = labels
    engine.register(conn, first, OPEN, clock())
    engine.heartbeat(conn, worker, first, clock())


def test_the_labels_that_hold_jobs_are_named_a_few_and_the_rest_counted(engine, clock):
    """Per (queue, spec): each label no connected worker has, and a set whose labels
    workers have apart but none together, named whole; at most five, then a count."""
    labelled(engine, clock, "w1", 1, ["gpu"])
    labelled(engine, clock, "w2", 2, ["region:eu"])
    put(engine, clock, None, 2, labels=("gpu", "region:eu"))  # each has one, none both
    put(engine, clock, None, 1, labels=("gpu", "tpu"))  # nobody has tpu
    assert engine.scheduler.held(clock().mono) == {
        ("default", "echo"): Held({"no_label": 3}, ("gpu+region:eu", "tpu"))}
    for n in range(5):
        put(engine, clock, None, 1, labels=(f"l{n}",))
    assert engine.scheduler.held(clock().mono) == {
        ("default", "echo"): Held({"no_label": 8}, ("gpu+region:eu", "l0", "l1", "l2", "l3"),
                                  2)}
    assert missing_labels(("a", "b"), [frozenset({"a"})]) == ["b"]


def test_limit_timers_of_one_moment_for_a_scope_and_a_key_fire_together():
    """Two parked counters due at the same moment, one a scope's own (key None) and one a
    key's: the timer heap never compares the counters (None beside a str raised)."""
    from rota.core.scheduler import Scheduler

    scheduler = Scheduler()
    scheduler._arm(("spec", "echo", None), 5.0)
    scheduler._arm(("spec", "echo", "acme"), 5.0)
    scheduler._arm(("queue", "default", "acme"), 5.0)
    assert scheduler.flow_deadline() == 5.0
    scheduler.unpark_due(6.0)
    assert scheduler.flow_deadline() is None


def test_a_start_is_made_when_its_commit_lands_and_the_next_waits_a_period_from_it(
        engine, clock):
    """A rate counts a start when its reservation commits and its job is sent, not when
    its round planned it: a slow commit (a lock wait, a slow disk) must not leave the
    next round free to start a period after the plan, beside the late assigns. The
    job's reserved_at is that moment too."""
    engine.set_limits({SPEC_LIMIT: LimitRule(rate=Rate(2, 1.0))}, clock())
    put(engine, clock, None, 4)
    connect(engine, clock, capacity=8)
    [reserve] = of(Reserve, engine.dispatch(clock()))
    clock.advance(0.5)  # the first commit is slow
    committed = clock()
    first = [job for frame in commit_sent(engine, reserve, clock) for job in frame]
    finish(engine, clock, first)
    clock.advance(0.6)  # a period after the plan, not after the commit
    engine.tick(clock())
    assert not of(Reserve, engine.dispatch(clock()))
    clock.advance(0.4)
    assert of(Wake, engine.tick(clock()))
    again = clock()
    [reserve] = of(Reserve, engine.dispatch(again))
    second = [job for frame in commit_sent(engine, reserve, clock) for job in frame]
    starts = [job_of(engine, job["id"]).reserved_at for job in first + second]
    assert starts == [committed.wall] * 2 + [again.wall] * 2


def test_a_round_planned_while_a_commit_is_pending_does_not_start_beside_it(engine, clock):
    """The window is full of starts whose commit has not come back: however long it takes,
    no round starts more until it does (then a period from it); a commit that fails takes
    its starts back out at once."""
    engine.set_limits({SPEC_LIMIT: LimitRule(rate=Rate(2, 1.0))}, clock())
    put(engine, clock, None, 6)
    connect(engine, clock, capacity=8)
    [slow] = of(Reserve, engine.dispatch(clock()))
    clock.advance(1.5)  # past the period, its commit still pending
    engine.tick(clock())
    assert not of(Reserve, engine.dispatch(clock()))
    wait = engine.scheduler.job_wait(_waiting(None), clock())
    assert wait is not None and wait.kind == "rate_limit"
    effects = commit(engine, slow, clock)  # lands now: made now, the window full from now
    assert len(sent(effects)[0]["jobs"]) == 2
    clock.advance(0.9)
    engine.tick(clock())
    assert not of(Reserve, engine.dispatch(clock()))
    clock.advance(0.2)
    engine.tick(clock())
    [failing] = of(Reserve, engine.dispatch(clock()))
    engine.committed(failing.ticket, OSError("disk I/O error"), clock(), [])
    clock.advance(1.0)  # (the round after a failed commit waits out its pause)
    engine.tick(clock())
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert len(reserve.claims) == 2  # the failed round's starts were taken back


def test_a_start_pending_past_its_bound_counts_from_its_plan(engine, clock):
    """A start whose commit never comes back (its outcome lost to a change of rules, or a
    writer stuck for a minute) stops holding the window as if it were happening now."""
    engine.set_limits({SPEC_LIMIT: LimitRule(rate=Rate(1, 1.0))}, clock())
    put(engine, clock, None, 2)
    connect(engine, clock, capacity=8)
    assert of(Reserve, engine.dispatch(clock()))
    clock.advance(PENDING_AT_MOST + 0.1)
    engine.tick(clock())
    assert of(Reserve, engine.dispatch(clock()))


def test_after_a_step_the_rates_starts_are_given_on_the_new_clock(engine, clock):
    """The wall clock steps while the server runs: the starts its rate windows hold are
    what the store should keep, on the clock as it reads now (a restart judges by them);
    starts out of their period are not kept."""
    engine.set_limits({SPEC_LIMIT: LimitRule(rate=Rate(2, 10.0),
                                             key_rate=Rate(5, 1.0))}, clock())
    put(engine, clock, "acme", 2)
    connect(engine, clock, capacity=8)
    planned = clock()
    assert len(assign(engine, clock)) == 2
    clock.advance(3.0)  # the key's 1 s window is over; the spec's 10 s one is not
    now = clock.step(-7200)
    assert engine.rate_starts(now) == {("spec:echo", None): [planned.wall - 7200] * 2}


def test_a_start_stored_later_than_now_counts_as_now(clock):
    """A start stored by a clock since stepped back (one not undone at the restart) holds
    its rate for one period from now, not until the old clock's moment comes again."""
    engine = Engine(ServerSettings(heartbeat_timeout=5.0), rand=lambda: 0.0)
    engine.load({"echo": SPEC}, {"echo": checksum(SPEC)}, [], clock(),
                waiting={("default", "echo"): [1, 2]})
    engine.set_limits({SPEC_LIMIT: LimitRule(rate=Rate(1, 10.0))}, clock(),
                      starts={("spec:echo", None): [clock.wall + 7200.0]})
    connect(engine, clock, capacity=8)
    assert not of(Reserve, engine.dispatch(clock()))  # the window is full: one start, now
    wait = engine.scheduler.job_wait(_waiting(None), clock())
    assert wait is not None and wait.reason.endswith("next start in 10.0 s"), wait.reason
    clock.advance(10.0)
    engine.tick(clock())
    assert of(Reserve, engine.dispatch(clock()))
