"""Pull workers (OJS FETCH, ACK, NACK, heartbeat) on the one scheduler, decided in-process
with a fake clock (rota/core/pulls.py): a FETCH is one round with open slots, then closed;
ACK and NACK are fenced by holder and attempt; a dead pull worker's job comes back when
its lease lapses, never by silence; a cancel of a pull-held job is immediate."""

from __future__ import annotations

import asyncio
from typing import Any

from test_engine import SPEC, FakeClock, commit, of, run_for, sent
from test_engine import clock, connect, engine, enqueue  # noqa: F401  (fixtures)

from rota.base import protocol as p
from rota.base.ojs import OjsExtras
from rota.base.specs import checksum
from rota.core.auth import OPEN
from rota.core.effects import Effect, Reserve, Save
from rota.core.engine import Engine
from rota.core.model import JobState
from rota.core.pulls import PULL_IDLE, Fetched, nack_error
from rota.core.ready import UNVERSIONED, WorkerSlot, may_take

ECHO = {SPEC.name: checksum(SPEC)}


def fetch(engine: Engine, clock: FakeClock, worker: str | None = "p1", count: int = 1,
          declared: dict[str, str] | None = ECHO, visibility: float | None = None
          ) -> tuple[Fetched, list[dict[str, Any]]]:
    """A FETCH, its round committed: the jobs its assign carries."""
    got = engine.pull_fetch(worker, OPEN, ["default"], count, visibility, declared, clock())
    effects = list(got.effects)
    for reserve in of(Reserve, got.effects):
        effects += commit(engine, reserve, clock)
    frames = [f for f in sent(effects, got.conn) if f["type"] == "assign"]
    assert len(frames) == 1  # exactly one answer, whatever the round did
    return got, frames[0]["jobs"]


def ack(engine: Engine, clock: FakeClock, job_id: str, worker: str | None = "p1",
        **kw: Any) -> dict[str, Any]:
    """An ACK (or NACK with ``outcome="failed"``), committed: its ack frame."""
    settled = engine.pull_result(worker, job_id, kw.pop("outcome", "completed"), now=clock(),
                                 **kw)
    assert settled.refusal is None, settled.refusal
    effects = list(settled.effects)
    for save in of(Save, settled.effects):
        if save.ticket is not None:
            effects += engine.committed(save.ticket, None, clock())
    [frame] = [f for f in sent(effects, settled.conn) if f["type"] == "ack"]
    assert frame["seq"] == settled.seq
    return frame


def test_a_fetch_is_one_round_with_open_slots_then_closed(engine, clock):
    jobs = enqueue(engine, clock, 3)
    got, copies = fetch(engine, clock, count=2)
    assert got.conn < 0 and [c["id"] for c in copies] == [j.id for j in jobs[:2]]
    slot = engine.scheduler.workers["ojs:p1"]
    assert slot.capacity == 0 and slot.blocked and slot.active == {jobs[0].id, jobs[1].id}
    assert not of(Reserve, engine.dispatch(clock()))  # closed: the third waits
    _, more = fetch(engine, clock, count=5)
    assert [c["id"] for c in more] == [jobs[2].id]
    _, none = fetch(engine, clock)  # nothing left: an empty answer at once
    assert none == []


def test_a_pull_worker_gets_a_versioned_type_only_with_its_status_quo_checksum(engine, clock):
    [job] = enqueue(engine, clock)
    assert fetch(engine, clock, declared=None)[1] == []
    got, copies = fetch(engine, clock, declared={"echo": "sha256:old"})
    assert copies == [] and [r.name for r in got.verdict.rejected] == ["echo"]
    got, copies = fetch(engine, clock)
    assert [c["id"] for c in copies] == [job.id] and got.verdict.accepted == ["echo"]


def test_the_gate_lets_unversioned_types_to_pull_workers_and_declaring_ones():
    pull = WorkerSlot(id="ojs:a", queues=["q"], concurrency=1, specs={}, any_type=True)
    work = WorkerSlot(id="w", queues=["q"], concurrency=1, specs={"t": UNVERSIONED})
    other = WorkerSlot(id="x", queues=["q"], concurrency=1, specs={})
    assert may_take(pull, "t", {}, {"t"}) and may_take(work, "t", {}, {"t"})
    assert not may_take(other, "t", {}, {"t"}) and not may_take(pull, "u", {}, {"t"})
    assert not may_take(pull, "t", {"t": "sha256:x"}, {})  # versioned now: declare it


def test_a_quiet_pull_worker_fetches_nothing(engine, clock):
    enqueue(engine, clock, 2)
    assert len(fetch(engine, clock, count=0)[1]) == 1  # count 0 means 1
    engine.registry.direct(["ojs:p1"], "quiet")
    assert fetch(engine, clock)[1] == []
    beat = engine.pull_beat("p1", OPEN, [], None, None, clock())
    assert beat.state == "quiet"


def test_ack_completes_and_its_answer_is_the_ack_frame(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock)
    frame = ack(engine, clock, job.id, result={"ok": True})
    assert frame["accepted"] == [job.id] and job.id not in engine.scheduler.jobs


def test_ack_and_nack_are_fenced_by_holder_and_attempt(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock)
    assert "another worker" in engine.pull_result("p2", job.id, "completed", now=clock()).refusal
    wrong = engine.pull_result("p1", job.id, "completed", attempt=2, now=clock())
    assert "attempt 2" in wrong.refusal
    connect(engine, clock)  # a /work worker's job is not a pull worker's to settle
    [other] = enqueue(engine, clock, spec="boom")
    [reserve] = of(Reserve, engine.dispatch(clock()))
    commit(engine, reserve, clock)
    assert "/work" in engine.pull_result(None, other.id, "completed", now=clock()).refusal
    frame = ack(engine, clock, job.id, worker=None, outcome="failed",  # the holder, unnamed
                error=nack_error({"code": "boom", "message": "no"}))
    assert frame["accepted"] == [job.id]
    refused = engine.pull_result("p1", job.id, "completed", now=clock())
    assert refused.state == JobState.RETRYABLE and "not active" in refused.refusal


def test_nack_requeue_gives_the_job_back_without_counting_the_attempt(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock)
    settled = engine.pull_result("p1", job.id, "failed", requeue=True, now=clock())
    assert settled.seq is None and of(Save, settled.effects)
    assert job.state == JobState.AVAILABLE and job.attempt - job.budget_start == 0
    _, copies = fetch(engine, clock, worker="p2")
    assert [c["id"] for c in copies] == [job.id]


def test_a_dead_pull_worker_is_found_by_its_lease_never_by_silence(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock, visibility=3.0)
    effects: list[Effect] = run_for(engine, clock, 2.5)
    assert job.state == JobState.ACTIVE and "ojs:p1" in engine.connections  # (5 s timeout)
    effects += run_for(engine, clock, 1.0)
    assert job.state == JobState.AVAILABLE
    [change] = [c for s in of(Save, effects) for c in s.changes if c.job is job]
    assert b"visibility_timeout" in (change.error or b"")
    assert engine.pull_result("p1", job.id, "completed", now=clock()).refusal  # late ACK: 409


def test_beats_extend_the_lease_and_name_what_they_extended(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock, visibility=3.0)
    for _ in range(2):
        run_for(engine, clock, 2.0)
        beat = engine.pull_beat("p1", OPEN, [job.id, "unknown"], None, None, clock())
        assert beat.extended == [job.id] and beat.state == "running"
    run_for(engine, clock, 1.0)
    assert job.state == JobState.ACTIVE  # at 5 s, past the first 3 s lease


def test_a_cancel_of_a_pull_held_job_is_immediate(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock)
    outcome, effects = engine.cancel(job.id, clock())
    assert outcome == "cancelled" and job.state == JobState.CANCELLED and job.attempt == 1
    assert not sent(effects) and not engine.scheduler.workers["ojs:p1"].active
    assert engine.pull_result("p1", job.id, "completed", now=clock()).refusal


def test_an_idle_pull_worker_is_forgotten_one_holding_a_job_is_not(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock, worker="busy", visibility=600.0)
    fetch(engine, clock, worker="idle")
    clock.advance(PULL_IDLE + 1)
    engine.tick(clock())
    assert "ojs:busy" in engine.connections and "ojs:idle" not in engine.connections
    assert "ojs:idle" not in engine.scheduler.workers and job.state == JobState.ACTIVE


def test_nack_error_maps_class_code_and_retryable():
    error = nack_error({"code": "handler_error", "message": "m", "retryable": False,
                        "details": {"error_class": "Auth.TokenExpired"}})
    assert (error.type, error.message, error.retryable, error.code) == (
        "Auth.TokenExpired", "m", False, "handler_error")
    assert nack_error({"code": "x", "message": "m"}).type == "x"
    assert nack_error(None).retryable is True


def test_fetch_refuses_a_queue_the_token_may_not_serve(engine, clock):
    from rota.base.errors import Forbidden
    from rota.core.auth import Principal
    principal = Principal(token_id="t", name="t", scope="worker", queues=frozenset({"o"}))
    try:
        engine.pull_fetch("p", principal, ["default"], 1, None, None, clock())
    except Forbidden as exc:
        assert exc.code == "queue_not_allowed"
    else:
        raise AssertionError("refused")
    assert isinstance(p.encode(p.Assign(jobs=[])), str)


def test_a_fetch_hears_an_empty_assign_when_its_round_loses_the_race_or_fails(engine, clock):
    enqueue(engine, clock, 2)
    got = engine.pull_fetch("p1", OPEN, ["default"], 1, None, ECHO, clock())
    [reserve] = of(Reserve, got.effects)
    lost = engine.committed(reserve.ticket, None, clock(), [None] * len(reserve.claims))
    assert [f["jobs"] for f in sent(lost, got.conn)] == [[]]  # another server took it
    got = engine.pull_fetch("p1", OPEN, ["default"], 1, None, ECHO, clock())
    [reserve] = of(Reserve, got.effects)
    failed = engine.committed(reserve.ticket, OSError("disk full"), clock())
    assert [f["jobs"] for f in sent(failed, got.conn)] == [[]]
    assert engine.scheduler.workers["ojs:p1"].blocked  # and its slots stay closed


def test_timeout_ms_ends_the_attempt_as_timeout_whatever_the_beats_say(engine, clock):
    [job] = enqueue(engine, clock, ojs=OjsExtras(timeout_ms=3000))
    _, [copy] = fetch(engine, clock, visibility=60.0)
    assert copy["id"] == job.id
    effects: list[Effect] = []
    for _ in range(2):
        effects += run_for(engine, clock, 1.0)
        assert engine.pull_beat("p1", OPEN, [job.id], None, None, clock()).extended == [job.id]
    effects += run_for(engine, clock, 1.5)
    assert job.state != JobState.ACTIVE and job.attempt == 1
    # A failed attempt (ojs-timeouts §5): retryable after its backoff, then due again.
    [change] = [c for s in of(Save, effects) for c in s.changes if c.job is job and c.ending]
    assert change.ending == "timeout" and b'"type":"timeout"' in (change.error or b"")
    assert engine.pull_result("p1", job.id, "completed", now=clock()).refusal  # too late


def test_the_test_directive_hook_needs_unsafe_test_endpoints(engine, clock):
    [job] = enqueue(engine, clock, ojs=OjsExtras(metadata={"test_directive": "terminate"}))
    fetch(engine, clock)
    assert engine.pull_beat("p1", OPEN, [job.id], None, None, clock()).state == "running"
    object.__setattr__(engine.settings, "unsafe_test_endpoints", True)  # (rota serve's flag)
    assert engine.pull_beat("p1", OPEN, [job.id], None, None, clock()).state == "terminate"
    assert fetch(engine, clock)[1] == []  # a terminating pull worker gets nothing
    settled = engine.pull_result("p1", job.id, "failed", requeue=True, now=clock())
    assert settled.refusal is None and job.state == JobState.AVAILABLE  # it may give it back


def test_after_a_restart_a_pull_workers_ack_reclaims_its_job(engine, clock):
    [job] = enqueue(engine, clock)
    fetch(engine, clock, visibility=600.0)
    again = Engine(engine.settings, rand=lambda: 0.0)  # the server restarted
    again.load(dict(engine.specs), {"echo": checksum(SPEC)}, [job], clock())
    assert job.orphaned
    beat = again.pull_beat("p1", OPEN, [job.id], None, None, clock())
    assert beat.extended == [job.id] and not job.orphaned
    frame = ack(again, clock, job.id)
    assert frame["accepted"] == [job.id]


def test_a_pull_workers_job_is_settled_only_by_its_token(engine, clock):
    from rota.core.auth import Principal
    mine = Principal(token_id="t1", name="t1", scope="worker")
    theirs = Principal(token_id="t2", name="t2", scope="worker")
    [job] = enqueue(engine, clock)
    got = engine.pull_fetch("p1", mine, ["default"], 1, None, ECHO, clock())
    for reserve in of(Reserve, got.effects):
        commit(engine, reserve, clock)
    assert job.state == JobState.ACTIVE
    refused = engine.pull_result(None, job.id, "completed", principal=theirs, now=clock())
    assert "another token" in refused.refusal
    assert engine.pull_result(None, job.id, "completed", principal=mine, now=clock()).conn


def test_after_a_restart_a_pull_workers_job_waits_for_its_lease_not_the_heartbeat_timeout(
        engine, clock):
    """A pull worker is silent between requests: after a restart its job is kept for it
    until its lease would have lapsed, not taken back after heartbeat_timeout (a
    reviewer's run: two jobs fetched for 60 s went to another worker 5 s after a kill)."""
    [job] = enqueue(engine, clock)
    fetch(engine, clock, visibility=600.0)
    job.lease_expires_at = clock().wall + 60.0  # as the reservation stored it
    again = Engine(engine.settings, rand=lambda: 0.0)  # the server restarted
    again.load(dict(engine.specs), {"echo": checksum(SPEC)}, [job], clock())
    run_for(again, clock, engine.settings.heartbeat_timeout + 10)
    assert job.state == JobState.ACTIVE and job.orphaned  # still kept for its worker
    beat = again.pull_beat("p1", OPEN, [job.id], None, None, clock())
    assert beat.extended == [job.id]
    assert ack(again, clock, job.id)["accepted"] == [job.id]


def test_an_id_as_fetch_showed_it_names_the_one_job_the_worker_holds_by_it(engine, clock):
    """Producers' jobs are kept as <token>:<id> and shown without it. Two producers may
    give the same id: then neither is guessed (a reviewer saw results swapped)."""
    [job] = enqueue(engine, clock)
    fetch(engine, clock)
    slot = engine.scheduler.workers["ojs:p1"]
    slot.active |= {"t1:X", "t2:X", "t1:Y"}
    assert engine.kept_ids("p1", ["X", "Y", job.id, "Z"]) == {
        "X": "X", "Y": "t1:Y", job.id: job.id, "Z": "Z"}
    assert engine.kept_ids("other", ["Y"]) == {"Y": "Y"}  # only its own holder's


def test_a_fetch_answer_nobody_heard_gives_its_jobs_back_uncounted(engine, clock):
    """A FETCH whose request ended (a 503 after 5 s, a client gone) before its round's
    commit: the jobs go back at once rather than sit reserved to nobody for 1800 s."""
    jobs = enqueue(engine, clock, 2)
    got, copies = fetch(engine, clock, count=2)
    assert all(job.state == JobState.ACTIVE for job in jobs)
    effects = engine.pull_unheard(got.conn, [c["id"] for c in copies], clock())
    assert [job.state for job in jobs] == [JobState.AVAILABLE] * 2
    assert all(job.attempt - job.budget_start == 0 for job in jobs)  # not counted
    assert of(Save, effects) and not engine.scheduler.workers["ojs:p1"].active
    assert engine.pull_unheard(got.conn, [jobs[0].id], clock()) == []  # once only
    _, again = fetch(engine, clock, worker="p2", count=2)
    assert sorted(c["id"] for c in again) == sorted(j.id for j in jobs)


async def test_the_mailbox_hands_an_unheard_assign_back():
    from rota.server.mailbox import Mailbox
    heard: list[tuple[int, list[str]]] = []
    box = Mailbox(lambda conn, ids: heard.append((conn, ids)))
    frame = p.encode(p.Assign(jobs=[p.JobCopy(
        id="j1", spec="s", checksum="c", queue="q", args={}, attempt=1, priority=0,
        visibility_timeout=30.0, enqueued_at="2026-11-27T00:00:00.000Z")]))
    box.deliver(-1, frame)  # nobody waits on conn -1
    await asyncio.sleep(0)  # noqa: sleep-ok  (one loop turn)
    assert heard == [(-1, ["j1"])]
