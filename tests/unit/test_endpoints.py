"""Push execution decided in-process on a fake clock (rota/core/endpoints.py, pins.py,
breaker.py): an endpoint is a virtual worker with max_in_flight slots; each response
class settles as it should; a 202 waits for a callback fenced by attempt; a failing
endpoint is paused by its breaker and its jobs say why; a deploy pins jobs to the
version they were enqueued under."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from test_engine import ROWS, FakeClock, commit, of
from test_engine import clock, engine  # noqa: F401  (fixtures)

from rota.base import protocol as p
from rota.base.push import Delivered
from rota.base.specs import Execute, JobSpec, checksum
from rota.core.breaker import FIRST_PAUSE, THRESHOLD
from rota.core.effects import Deliver, Reserve, Save, Wake
from rota.core.endpoints import callback_token, endpoint_id
from rota.core.engine import Engine
from rota.core.model import JobRecord, JobState
from rota.core.intake import EnqueueRequest
from rota.core.auth import OPEN

KEY = b"k" * 32


def hook(version: str = "1", url: str = "https://a.example/run", **execute: Any) -> JobSpec:
    return JobSpec(name="hook", version=version, visibility_timeout=60.0,
                   execute=Execute(url=url, secret="main", **execute))


def push(engine: Engine, clock: FakeClock, spec: JobSpec) -> None:
    change = SimpleNamespace(name=spec.name, checksum=checksum(spec),
                             previous=engine.scheduler.status_quo.get(spec.name),
                             change="changed", first_seq=len(ROWS.setdefault(engine, {})) + 1)
    engine.callback_key = KEY
    engine.status_quo_changed([spec], [change], clock())


def enqueue(engine: Engine, clock: FakeClock, n: int = 1) -> list[JobRecord]:
    rows = ROWS.setdefault(engine, {})
    jobs = []
    for _ in range(n):
        job = engine.build(EnqueueRequest(spec="hook", args={"n": len(rows)}), OPEN, clock())
        assert isinstance(job, JobRecord)
        rows[len(rows) + 1] = job
        engine.enqueued(job, len(rows), clock())
        jobs.append(job)
    return jobs


def tick_for(engine: Engine, clock: FakeClock, seconds: float) -> None:
    for _ in range(round(seconds / 0.5)):  # as the shell ticks (a longer gap is a stall)
        clock.advance(0.5)
        engine.tick(clock())


def deliver(engine: Engine, clock: FakeClock) -> list[Any]:
    """A scheduling round, committed: the deliveries it asks the shell for."""
    effects = engine.dispatch(clock())
    out = []
    for reserve in of(Reserve, effects):
        out += [e.delivery for e in of(Deliver, commit(engine, reserve, clock))]
    return out


def answer(engine: Engine, clock: FakeClock, d: Any, kind: str = "completed", *,
           status: int | None = 200, fault: bool = False, retryable: bool = True,
           retry_in: float | None = None, result: Any = None) -> list[Any]:
    error = None if kind != "failed" else p.ErrorInfo(type=f"http_{status}", message="no",
                                                      retryable=retryable)
    got = Delivered(job_id=d.job_id, attempt=d.attempt, delivery_id=d.delivery_id, kind=kind,
                    result=result, error=error, status=status, ms=3.0, fault=fault,
                    retry_in=retry_in)
    effects = engine.endpoint_result(got, clock())
    for save in of(Save, effects):
        if save.ticket is not None:
            effects += engine.committed(save.ticket, None, clock())
    return effects


def test_an_endpoint_gets_its_specs_jobs_up_to_its_max_in_flight(engine, clock):
    push(engine, clock, hook(max_in_flight=2))
    jobs = enqueue(engine, clock, 3)
    first = deliver(engine, clock)
    assert [d.job_id for d in first] == [j.id for j in jobs[:2]]
    d = first[0]
    assert d.url == "https://a.example/run" and d.secret == "main" and d.attempt == 1
    assert d.checksum == checksum(hook(max_in_flight=2)) and d.delivery_id
    assert d.callback_token == callback_token(KEY, d.job_id, 1)
    assert deliver(engine, clock) == []  # both slots in flight: the third waits
    answer(engine, clock, d, result={"ok": True})
    assert engine.scheduler.jobs.get(d.job_id) is None or \
        engine.scheduler.jobs[d.job_id].state == JobState.COMPLETED
    assert [x.job_id for x in deliver(engine, clock)] == [jobs[2].id]


def test_a_4xx_fails_for_good_and_a_5xx_retries_after_its_retry_after(engine, clock):
    push(engine, clock, hook())
    bad, busy = enqueue(engine, clock, 2)
    d_bad, d_busy = deliver(engine, clock)
    answer(engine, clock, d_bad, "failed", status=400, retryable=False)
    assert bad.state == JobState.DISCARDED
    answer(engine, clock, d_busy, "failed", status=429, fault=True, retry_in=120.0)
    assert busy.state == JobState.RETRYABLE and busy.run_at >= clock().wall + 120.0


def test_a_202_runs_on_until_its_callback_and_an_old_attempts_token_is_refused(engine, clock):
    push(engine, clock, hook(max_in_flight=1))
    job, other = enqueue(engine, clock, 2)
    [d] = deliver(engine, clock)
    answer(engine, clock, d, "accepted", status=202)
    assert job.state == JobState.ACTIVE and job.lease_expires_at >= clock().wall + 59
    # An accepted job holds no delivery slot: the next one goes out.
    assert [x.job_id for x in deliver(engine, clock)] == [other.id]
    refusal = engine.endpoint_callback(job.id, callback_token(KEY, job.id, 2), None,
                                       clock()).refusal
    assert refusal is not None and "attempt 2" in refusal
    assert engine.endpoint_callback(job.id, "1.forged", None, clock())[0] is not None
    refusal, _, effects, *_ = engine.endpoint_callback(
        job.id, d.callback_token, p.Result(job_id=job.id, attempt=1, outcome="completed",
                                           result={"done": 1}), clock())
    assert refusal is None
    for save in of(Save, effects):
        engine.committed(save.ticket, None, clock())
    assert job.state == JobState.COMPLETED
    again = engine.endpoint_callback(job.id, d.callback_token, None, clock())
    assert again[0] is not None  # settled: a late callback changes nothing


def test_a_late_answer_for_an_attempt_that_moved_on_changes_nothing(engine, clock):
    push(engine, clock, hook())
    [job] = enqueue(engine, clock)
    [d] = deliver(engine, clock)
    tick_for(engine, clock, 45.0)  # past timeout + margin: the lease lapses, it is retried
    assert job.state in (JobState.AVAILABLE, JobState.RETRYABLE)
    assert not of(Save, answer(engine, clock, d, result=1)) and job.state != JobState.COMPLETED


def test_a_failing_endpoint_is_paused_says_why_and_tries_one_delivery_later(engine, clock):
    push(engine, clock, hook(max_in_flight=10))
    enqueue(engine, clock, 12)
    deliveries = deliver(engine, clock)
    for d in deliveries[:THRESHOLD]:
        answer(engine, clock, d, "failed", status=503, fault=True)
    reason = engine.endpoint_wait("default", "hook", clock())
    assert reason == f"endpoint failing: {THRESHOLD} errors in 30 s, next try in" \
        f" {FIRST_PAUSE:.0f} s"
    for d in deliveries[THRESHOLD:]:  # the rest in flight answer; nothing new goes out
        answer(engine, clock, d, "completed")
    assert deliver(engine, clock) == []
    tick_for(engine, clock, FIRST_PAUSE)
    [trial] = deliver(engine, clock)  # half-open: one delivery
    assert deliver(engine, clock) == []
    answer(engine, clock, trial, "completed")
    assert engine.endpoint_wait("default", "hook", clock()) is None
    assert len(deliver(engine, clock)) > 1  # closed again: the rest go out


def test_jobs_enqueued_before_a_push_go_to_the_old_endpoint_and_new_ones_to_the_new(engine,
                                                                                   clock):
    v1, v2 = hook("1", "https://one.example/"), hook("2", "https://two.example/")
    push(engine, clock, v1)
    old = enqueue(engine, clock, 3)
    push(engine, clock, v2)
    new = enqueue(engine, clock, 3)
    got = deliver(engine, clock) + deliver(engine, clock)
    by_url = {d.job_id: d.url for d in got}
    assert {by_url[j.id] for j in old} == {"https://one.example/"}
    assert {by_url[j.id] for j in new} == {"https://two.example/"}
    assert {d.checksum for d in got if d.job_id in {j.id for j in old}} == {checksum(v1)}
    ids = set(engine.scheduler.workers)
    assert {endpoint_id("hook", checksum(v1)), endpoint_id("hook", checksum(v2))} <= ids


def test_a_cancel_of_a_job_in_delivery_is_at_once_and_frees_its_slot(engine, clock):
    push(engine, clock, hook(max_in_flight=1))
    job, other = enqueue(engine, clock, 2)
    [d] = deliver(engine, clock)
    said, effects = engine.cancel(job.id, clock())
    assert said == "cancelled" and job.state == JobState.CANCELLED
    assert [x.job_id for x in deliver(engine, clock)] == [other.id]  # the slot is free
    assert len(of(Wake, answer(engine, clock, d, result=1))) == 1  # late: ignored
    assert job.state == JobState.CANCELLED


def test_a_half_open_endpoint_has_one_trial_in_flight_whatever_the_rounds(engine, clock):
    push(engine, clock, hook(max_in_flight=10))
    enqueue(engine, clock, 20)
    for d in deliver(engine, clock)[:THRESHOLD]:
        answer(engine, clock, d, "failed", status=500, fault=True)
    tick_for(engine, clock, FIRST_PAUSE)
    assert len(deliver(engine, clock)) == 1
    assert deliver(engine, clock) == [] and deliver(engine, clock) == []


def test_while_trying_only_the_trials_answer_moves_the_breaker(engine, clock):
    push(engine, clock, hook(max_in_flight=10))
    enqueue(engine, clock, 20)
    sent = deliver(engine, clock)
    for d in sent[:THRESHOLD]:
        answer(engine, clock, d, "failed", status=500, fault=True)
    tick_for(engine, clock, FIRST_PAUSE)
    [trial] = deliver(engine, clock)
    answer(engine, clock, sent[THRESHOLD], "failed", status=None, fault=True)  # an old one
    assert engine.endpoint_wait("default", "hook", clock()).endswith("trying one delivery now")
    answer(engine, clock, trial, "completed")
    assert engine.endpoint_wait("default", "hook", clock()) is None


def test_a_token_of_any_text_is_refused_without_an_error(engine, clock):
    push(engine, clock, hook())
    [job] = enqueue(engine, clock)
    deliver(engine, clock)
    for token in ("1.é", "².x", "", ".", "1." + "a" * 5000, "99999999999.x"):
        assert engine.endpoint_callback(job.id, token, None, clock()).refusal is not None


def test_pins_read_back_replay_the_pushes_in_their_order():
    from rota.core.pins import Pins, Window
    plain, v2, v3 = JobSpec(name="hook", version="0"), hook("2"), hook("3", "https://b.example/")
    live = Pins()
    live.pushed(plain, checksum(plain), 101)
    live.pushed(v2, checksum(v2), 60)  # rows went back (a prune): its window starts sooner
    live.pushed(v3, checksum(v3), 200)
    read = Pins()
    read.load({"hook": [Window(101, checksum(plain), plain), Window(60, checksum(v2), v2),
                        Window(200, checksum(v3), v3)]})
    for seq in (1, 60, 101, 150, 200, 300):
        assert read.pin("hook", seq) == live.pin("hook", seq), seq


def test_a_half_open_endpoint_tries_one_delivery_while_its_reservation_commits(engine, clock):
    """Rounds run while a reservation commits (a loaded store takes a while): the trial
    reserved in the first is the only one (a soak run under load sent 60 at once)."""
    push(engine, clock, hook(max_in_flight=10))
    enqueue(engine, clock, 20)
    for d in deliver(engine, clock)[:THRESHOLD]:
        answer(engine, clock, d, "failed", status=500, fault=True)
    tick_for(engine, clock, FIRST_PAUSE)
    reserves = [r for _ in range(3) for r in of(Reserve, engine.dispatch(clock()))]
    sent = [e for r in reserves for e in of(Deliver, commit(engine, r, clock))]
    assert len(sent) == 1, len(sent)
    assert deliver(engine, clock) == []
