"""A push-executed spec's own ``[limits]`` on a fake clock (rota/core/endpoints.py beside
rota/core/flow.py): its rate lets no more deliveries start in any window than it allows,
and the rest start as the window moves; its concurrency caps the deliveries in flight
below the endpoint's ``max_in_flight``, counts a job answered 202 (it runs on, though it
holds no delivery slot), and spans the endpoints of two versions after a deploy."""

from __future__ import annotations

from collections import namedtuple
from typing import Any

from test_endpoints import answer, deliver, enqueue, push
from test_engine import FakeClock
from test_engine import clock, engine  # noqa: F401  (fixtures)

from rota.base import protocol as p
from rota.base.flow import WrittenRule
from rota.base.specs import Execute, JobSpec
from rota.core.effects import Save
from rota.core.engine import Engine
from rota.core.model import JobState
from rota.core.rulebook import effective

Waiting = namedtuple("Waiting", "queue spec concurrency_key labels")


def limited(version: str = "1", url: str = "https://a.example/run", **limits: Any) -> JobSpec:
    return JobSpec(name="hook", version=version, visibility_timeout=60.0,
                   limits=WrittenRule(**limits),
                   execute=Execute(url=url, secret="main", max_in_flight=10))


def deploy(engine: Engine, clock: FakeClock, spec: JobSpec) -> None:
    """A push, then the limits in force handed to the engine again, as the shell does
    after every push (rota/server/limiting.py ``refresh``)."""
    push(engine, clock, spec)
    engine.set_limits(effective(engine.specs, {}), clock())


def why(engine: Engine, clock: FakeClock) -> Any:
    return engine.scheduler.job_wait(Waiting("default", "hook", None, ()), clock())


def test_a_rate_starts_no_more_deliveries_per_window_and_the_rest_as_it_moves(engine, clock):
    deploy(engine, clock, limited(rate="3/10s"))
    jobs = enqueue(engine, clock, 10)
    start = clock().mono
    started: list[float] = []
    while len(started) < 10 and clock().mono - start < 60:
        for d in deliver(engine, clock):  # a round, then each answered at once: only the
            started.append(clock().mono - start)  # rate, not the endpoint's 10 slots, holds
            answer(engine, clock, d, result={"ok": True})
        if len(started) == 3:
            wait = why(engine, clock)
            assert wait is not None and wait.kind == "rate_limit", wait
            assert wait.reason.startswith("rate limit 3/10s for spec hook"), wait.reason
        clock.advance(0.5)
        engine.tick(clock())
    assert started == [0.0] * 3 + [10.0] * 3 + [20.0] * 3 + [30.0]
    for t in started:  # never more than 3 starts in any 10 s window
        assert sum(t <= s < t + 10 for s in started) <= 3
    assert all(job.state == JobState.COMPLETED for job in jobs)


def test_a_concurrency_limit_caps_deliveries_in_flight_below_max_in_flight(engine, clock):
    deploy(engine, clock, limited(concurrency=2))
    jobs = enqueue(engine, clock, 6)
    first = deliver(engine, clock)
    assert [d.job_id for d in first] == [j.id for j in jobs[:2]]  # 2 of the 10 slots
    assert deliver(engine, clock) == []
    wait = why(engine, clock)
    assert wait is not None and wait.kind == "concurrency_limit", wait
    # A job answered 202 frees its delivery slot, but runs on: the limit still counts it.
    answer(engine, clock, first[0], "accepted", status=202)
    assert jobs[0].state == JobState.ACTIVE and deliver(engine, clock) == []
    answer(engine, clock, first[1], result=1)  # one finished: one more goes out
    [third] = deliver(engine, clock)
    assert third.job_id == jobs[2].id and deliver(engine, clock) == []
    refusal, _, effects, *_ = engine.endpoint_callback(
        jobs[0].id, first[0].callback_token,
        p.Result(job_id=jobs[0].id, attempt=1, outcome="completed", result=2), clock())
    assert refusal is None
    for save in of_saves(effects):
        engine.committed(save.ticket, None, clock())
    assert jobs[0].state == JobState.COMPLETED
    assert [d.job_id for d in deliver(engine, clock)] == [jobs[3].id]


def test_a_concurrency_limit_spans_both_versions_endpoints_after_a_deploy(engine, clock):
    deploy(engine, clock, limited("1", "https://one.example/", concurrency=2))
    old = enqueue(engine, clock, 3)
    v1 = deliver(engine, clock)
    assert [d.job_id for d in v1] == [j.id for j in old[:2]]
    deploy(engine, clock, limited("2", "https://two.example/", concurrency=2))
    new = enqueue(engine, clock, 2)
    assert deliver(engine, clock) == []  # v2's endpoint is free, the spec's limit is not
    answer(engine, clock, v1[0], result=1)
    [next_one] = deliver(engine, clock)  # the oldest waiting: v1's third, to v1's URL
    assert (next_one.job_id, next_one.url) == (old[2].id, "https://one.example/")
    answer(engine, clock, v1[1], result=1)
    [v2] = deliver(engine, clock)
    assert (v2.job_id, v2.url) == (new[0].id, "https://two.example/")
    assert deliver(engine, clock) == []


def of_saves(effects: list[Any]) -> list[Save]:
    return [e for e in effects if isinstance(e, Save) and e.ticket is not None]
