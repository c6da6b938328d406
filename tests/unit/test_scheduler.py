"""Unit tests for the pure scheduling policy in rota.core.scheduler (no server, no I/O)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import msgspec
import pytest

from rota.core.policy import Limits
from rota.core.scheduler import Claim, Scheduler, WorkerSlot
from rota.core.model import JobRecord

CA = "sha256:" + "a" * 64
CB = "sha256:" + "b" * 64
OLD = "sha256:" + "0" * 64

_seq = itertools.count(1)
NOW = 1_800_000_000.0
LIMITS = Limits(max_attempts=3, max_fails=None, backoff_base=1.0, backoff_max=60.0)


def make_job(job_id: str, spec: str = "a", queue: str = "default", priority: int = 0,
             seq: int | None = None) -> JobRecord:
    seq = next(_seq) if seq is None else seq
    return JobRecord(id=job_id, spec=spec, queue=queue, args=msgspec.Raw(b"{}"), priority=priority,
               enqueued_at=1_700_000_000.0 + seq, seq=seq, limits=LIMITS)


def make_worker(worker_id: str, specs: dict[str, str] | None = None,
                queues: list[str] | None = None, concurrency: int = 10,
                capacity: int | None = None, state: str = "running") -> WorkerSlot:
    return WorkerSlot(id=worker_id, queues=queues or ["default"], concurrency=concurrency,
                      specs={"a": CA} if specs is None else specs, state=state,
                      capacity=concurrency if capacity is None else capacity)


@pytest.fixture
def sched() -> Scheduler:
    scheduler = Scheduler()
    scheduler.status_quo = {"a": CA, "b": CB}
    return scheduler


def ids(jobs: list[JobRecord]) -> list[str]:
    return [job.id for job in jobs]


def planned_ids(plan: dict[str, list[JobRecord]], worker_id: str) -> list[str]:
    return ids(plan.get(worker_id, []))


# -- spec / checksum matching -------------------------------------------------------
def test_worker_with_status_quo_checksum_gets_the_job(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1"))
    sched.add(make_job("j1"))
    plan = sched.plan(NOW)
    assert planned_ids(plan, "w1") == ["j1"]


def test_worker_with_other_checksum_gets_nothing(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", specs={"a": OLD}))
    sched.add(make_job("j1"))
    assert sched.plan(NOW) == {}
    assert sched.jobs["j1"].state == "available"
    assert sched.jobs["j1"].attempt == 0


def test_worker_without_the_spec_gets_nothing(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", specs={"b": CB}))
    sched.add(make_job("j1", spec="a"))
    assert sched.plan(NOW) == {}


def test_spec_without_status_quo_is_never_planned(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", specs={"a": CA, "ghost": CA}))
    sched.add(make_job("g1", spec="ghost"))
    assert sched.plan(NOW) == {}


def test_worker_gets_only_jobs_of_matching_specs(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", specs={"a": CA, "b": OLD}))
    for n in range(3):
        sched.add(make_job(f"a{n}", spec="a"))
        sched.add(make_job(f"b{n}", spec="b", priority=10))
    plan = sched.plan(NOW)
    assert sorted(planned_ids(plan, "w1")) == ["a0", "a1", "a2"]
    assert all(sched.jobs[f"b{n}"].state == "available" for n in range(3))


# -- ordering ------------------------------------------------------------------------
def test_priority_then_enqueue_order(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1"))
    # Added out of order on purpose: the heap must sort them.
    sched.add(make_job("low-late", priority=0, seq=4))
    sched.add(make_job("high-late", priority=5, seq=3))
    sched.add(make_job("low-early", priority=0, seq=1))
    sched.add(make_job("high-early", priority=5, seq=2))
    sched.add(make_job("negative", priority=-1, seq=0))
    sched.add(make_job("mid", priority=1, seq=5))
    plan = sched.plan(NOW)
    assert planned_ids(plan, "w1") == [
        "high-early", "high-late", "mid", "low-early", "low-late", "negative"]


def test_priority_order_spans_specs_in_one_queue(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", specs={"a": CA, "b": CB}))
    sched.add(make_job("a-old", spec="a", priority=0, seq=1))
    sched.add(make_job("b-new", spec="b", priority=0, seq=2))
    sched.add(make_job("a-urgent", spec="a", priority=9, seq=3))
    sched.add(make_job("b-urgent", spec="b", priority=9, seq=4))
    plan = sched.plan(NOW)
    assert planned_ids(plan, "w1") == ["a-urgent", "b-urgent", "a-old", "b-new"]


def test_one_at_a_time_follows_priority(sched: Scheduler) -> None:
    worker = make_worker("w1", capacity=1)
    sched.add_worker(worker)
    sched.add(make_job("p1", priority=1))
    sched.add(make_job("p7", priority=7))
    sched.add(make_job("p3", priority=3))
    got = []
    for _ in range(3):
        [job] = sched.plan(NOW)["w1"]
        got.append(job.id)
        worker.capacity = 1
    assert got == ["p7", "p3", "p1"]


def test_worker_queue_order_beats_priority(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", queues=["first", "second"], capacity=1))
    sched.add(make_job("urgent", queue="second", priority=100))
    sched.add(make_job("f1", queue="first", priority=0))
    sched.add(make_job("f2", queue="first", priority=0))
    assert planned_ids(sched.plan(NOW), "w1") == ["f1"]
    sched.workers["w1"].capacity = 10
    # The first queue is drained before the second is touched.
    assert planned_ids(sched.plan(NOW), "w1") == ["f2", "urgent"]


def test_queue_not_served_is_never_planned(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", queues=["default"]))
    sched.add(make_job("elsewhere", queue="other"))
    assert sched.plan(NOW) == {}


# -- concurrency and capacity -----------------------------------------------------------
def test_never_more_than_concurrency(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", concurrency=2, capacity=100))
    for n in range(5):
        sched.add(make_job(f"j{n}"))
    plan = sched.plan(NOW)
    assert len(plan["w1"]) == 2
    assert len(sched.workers["w1"].active) == 2
    assert sched.plan(NOW) == {}


def test_capacity_below_concurrency_limits(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", concurrency=10, capacity=3))
    for n in range(5):
        sched.add(make_job(f"j{n}"))
    assert len(sched.plan(NOW)["w1"]) == 3
    assert sched.workers["w1"].capacity == 0
    assert sched.plan(NOW) == {}


def test_capacity_is_decremented_by_what_was_assigned(sched: Scheduler) -> None:
    worker = make_worker("w1", concurrency=10, capacity=5)
    sched.add_worker(worker)
    sched.add(make_job("j1"))
    sched.add(make_job("j2"))
    assert len(sched.plan(NOW)["w1"]) == 2
    assert worker.capacity == 3
    assert worker.active == {"j1", "j2"}
    assert worker.free() == 3


def test_zero_capacity_gets_nothing(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", concurrency=4, capacity=0))
    sched.add(make_job("j1"))
    assert sched.plan(NOW) == {}


def test_replan_without_freeing_gives_nothing(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", concurrency=1, capacity=1))
    sched.add(make_job("j1"))
    sched.add(make_job("j2"))
    assert planned_ids(sched.plan(NOW), "w1") == ["j1"]
    assert sched.plan(NOW) == {}
    # Even if the worker claims more room, concurrency is the law.
    sched.workers["w1"].capacity = 50
    assert sched.plan(NOW) == {}
    assert sched.jobs["j2"].state == "available"


@pytest.mark.parametrize("state", ["quiet", "terminate"])
def test_workers_not_running_get_nothing(sched: Scheduler, state: str) -> None:
    sched.add_worker(make_worker("w1", state=state))
    sched.add(make_job("j1"))
    assert sched.plan(NOW) == {}
    sched.workers["w1"].state = "running"
    assert planned_ids(sched.plan(NOW), "w1") == ["j1"]


def test_work_spreads_across_equal_workers(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", concurrency=4))
    sched.add_worker(make_worker("w2", concurrency=4))
    for n in range(4):
        sched.add(make_job(f"j{n}"))
    plan = sched.plan(NOW)
    assert len(plan["w1"]) == 2
    assert len(plan["w2"]) == 2
    assert sorted(planned_ids(plan, "w1") + planned_ids(plan, "w2")) == ["j0", "j1", "j2", "j3"]


def test_spread_respects_each_workers_room(sched: Scheduler) -> None:
    sched.add_worker(make_worker("small", concurrency=1))
    sched.add_worker(make_worker("big", concurrency=10))
    for n in range(6):
        sched.add(make_job(f"j{n}"))
    plan = sched.plan(NOW)
    assert len(plan["small"]) == 1
    assert len(plan["big"]) == 5


# -- reservation lifecycle ----------------------------------------------------------------
def test_reservation_sets_state_worker_attempt_and_checksum(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1"))
    job = make_job("j1")
    sched.add(job)
    assert (job.state, job.worker_id, job.attempt, job.checksum) == ("available", None, 0, None)
    sched.plan(NOW)
    assert (job.state, job.worker_id, job.attempt, job.checksum) == ("active", "w1", 1, CA)


def test_job_is_never_planned_twice(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", concurrency=1))
    sched.add_worker(make_worker("w2", concurrency=1))
    sched.add(make_job("only"))
    first = sched.plan(NOW)
    assert sum(len(jobs) for jobs in first.values()) == 1
    assert sched.jobs["only"].state == "active"
    assert sched.plan(NOW) == {}


def test_add_twice_does_not_double_plan(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1"))
    job = make_job("j1")
    sched.add(job)
    sched.add(job)
    assert planned_ids(sched.plan(NOW), "w1") == ["j1"]
    assert job.attempt == 1


def test_release_makes_job_available_and_replannable(sched: Scheduler) -> None:
    worker = make_worker("w1")
    sched.add_worker(worker)
    job = make_job("j1")
    sched.add(job)
    sched.plan(NOW)
    sched.release(job)
    assert job.state == "available"
    assert job.worker_id is None
    assert worker.active == set()
    assert job.attempt == 1  # release does not undo the attempt
    assert planned_ids(sched.plan(NOW), "w1") == ["j1"]
    assert job.attempt == 2


def test_finish_frees_the_worker_slot(sched: Scheduler) -> None:
    worker = make_worker("w1", concurrency=1, capacity=5)
    sched.add_worker(worker)
    sched.add(make_job("j1"))
    sched.add(make_job("j2"))
    [done] = sched.plan(NOW)["w1"]
    assert done.id == "j1"
    assert sched.plan(NOW) == {}
    sched.finish(done)
    assert "j1" not in sched.jobs
    assert worker.active == set()
    assert planned_ids(sched.plan(NOW), "w1") == ["j2"]


def test_finished_job_is_not_replanned_after_release_of_others(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1"))
    sched.add(make_job("j1"))
    [job] = sched.plan(NOW)["w1"]
    sched.finish(job)
    assert sched.plan(NOW) == {}
    assert sched.ready_counts() == {}


# -- removing a worker ----------------------------------------------------------------
def test_remove_worker_returns_active_jobs_only(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1"))
    sched.add(make_job("run1"))
    sched.add(make_job("run2"))
    sched.add(make_job("done"))
    plan = sched.plan(NOW)
    assert sorted(planned_ids(plan, "w1")) == ["done", "run1", "run2"]
    sched.jobs["done"].state = "completed"  # its result is being committed

    returned = sched.remove_worker("w1")

    assert sorted(ids(returned)) == ["run1", "run2"]
    assert "w1" not in sched.workers
    for job in returned:  # handed back as they are: the caller applies the retry policy
        assert job.state == "active" and job.worker_id == "w1" and job.attempt == 1
        sched.add(job)
    assert sched.jobs["done"].state == "completed"
    assert sched.ready_counts() == {("default", "a"): 2}

    sched.add_worker(make_worker("w2"))
    replanned = sched.plan(NOW)["w2"]
    assert sorted(ids(replanned)) == ["run1", "run2"]
    assert all(job.attempt == 2 for job in replanned)


def test_remove_worker_also_counts_the_jobs_it_last_reported(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1"))
    sched.add(make_job("j1"))
    [job] = sched.plan(NOW)["w1"]
    sched.workers["w1"].active.discard("j1")  # the server lost track; the worker did not
    assert ids(sched.remove_worker("w1", reported=["j1", "unknown"])) == ["j1"]


def test_remove_unknown_worker_is_harmless(sched: Scheduler) -> None:
    assert sched.remove_worker("nobody") == []


# -- status quo changes --------------------------------------------------------------
def test_status_quo_change_reroutes_jobs(sched: Scheduler) -> None:
    sched.add_worker(make_worker("A", specs={"a": CA}))
    sched.add_worker(make_worker("B", specs={"a": OLD}))
    sched.add(make_job("before"))
    plan = sched.plan(NOW)
    assert planned_ids(plan, "A") == ["before"]
    assert "B" not in plan
    assert sched.jobs["before"].checksum == CA

    sched.status_quo = {**sched.status_quo, "a": OLD}
    sched.add(make_job("after1"))
    sched.add(make_job("after2"))
    plan = sched.plan(NOW)
    assert "A" not in plan  # A still has room, but now declares the wrong checksum
    assert sorted(planned_ids(plan, "B")) == ["after1", "after2"]
    assert all(job.checksum == OLD for job in plan["B"])


def test_released_job_takes_the_new_status_quo_checksum(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", specs={"a": CA}))
    job = make_job("j1")
    sched.add(job)
    sched.plan(NOW)
    assert (job.attempt, job.checksum) == (1, CA)
    sched.release(job)

    sched.status_quo = {"a": OLD}
    sched.add_worker(make_worker("w2", specs={"a": OLD}))
    plan = sched.plan(NOW)
    assert planned_ids(plan, "w2") == ["j1"]
    assert (job.attempt, job.checksum, job.worker_id) == (2, OLD, "w2")


# -- explaining why jobs wait ---------------------------------------------------------
def test_waiting_reasons_are_distinct(sched: Scheduler) -> None:
    reasons: dict[str, str | None] = {}

    reasons["nobody"] = sched.waiting_reason("default", "a")

    sched.add_worker(make_worker("other-sum", specs={"a": OLD}))
    reasons["checksum"] = sched.waiting_reason("default", "a")

    sched.remove_worker("other-sum")
    sched.add_worker(make_worker("no-spec", specs={"b": CB}))
    reasons["no_spec"] = sched.waiting_reason("default", "a")

    sched.add_worker(make_worker("full", specs={"a": CA}, concurrency=1))
    sched.add(make_job("j1"))
    sched.plan(NOW)
    reasons["full"] = sched.waiting_reason("default", "a")

    assert all(isinstance(reason, str) and reason for reason in reasons.values()), reasons
    assert len(set(reasons.values())) == 4, reasons
    assert "'default'" in reasons["nobody"]  # type: ignore[operator]
    assert "checksum" in reasons["checksum"]  # type: ignore[operator]
    assert "none implements" in reasons["no_spec"]  # type: ignore[operator]
    assert "full" in reasons["full"]  # type: ignore[operator]
    # Blocked: nothing will take the jobs as things stand. A backlog behind a busy worker
    # is not (issue 22: the Overview listed it as an incident).
    busy = sched.wait("default", "a")
    assert busy is not None and (busy.kind, busy.blocked) == ("workers_busy", False)
    sched.workers["full"].state = "quiet"
    stopped = sched.wait("default", "a")
    assert stopped is not None and (stopped.kind, stopped.blocked) == ("workers_stopped", True)
    sched.paused.add("default")
    paused = sched.wait("default", "a")
    assert paused is not None and (paused.kind, paused.blocked) == ("queue_paused", True)
    sched.paused.clear()
    sched.remove_worker("full")
    sched.add_worker(make_worker("other-sum", specs={"a": OLD}))
    assert {w.kind: w.blocked for w in [sched.wait("default", "a"), sched.wait("x", "a")]
            if w is not None} == {"checksum_mismatch": True, "no_worker": True}
    sched.remove_worker("other-sum")

    sched.add_worker(make_worker("roomy", specs={"a": CA}, concurrency=2))
    assert sched.waiting_reason("default", "a") is None


# -- a worker that does not read ----------------------------------------------------
def test_a_blocked_worker_gets_nothing_and_others_get_its_share(sched: Scheduler) -> None:
    silent, bystander = make_worker("silent"), make_worker("bystander", concurrency=2)
    sched.add_worker(silent)
    sched.add_worker(bystander)
    silent.blocked = True
    for n in range(3):
        sched.add(make_job(f"j{n}"))
    plan = sched.plan(NOW)
    assert "silent" not in plan and planned_ids(plan, "bystander") == ["j0", "j1"]
    assert "not reading what they are sent" in (sched.waiting_reason("default", "a") or "")
    silent.blocked = False  # it drained: the next round gives it what waited
    assert planned_ids(sched.plan(NOW), "silent") == ["j2"]


def test_waiting_reason_no_worker_for_queue_even_if_others_connected(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", queues=["media"]))
    reason = sched.waiting_reason("emails", "a")
    assert reason is not None and "'emails'" in reason


def test_waiting_reason_capable_but_not_running(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", state="quiet"))
    wait = sched.wait("default", "a")
    assert wait is not None and wait.blocked and wait.reason == (
        "the 1 capable worker is quiet or terminating: none takes jobs")  # (not "worker(s)")
    sched.add_worker(make_worker("w2", state="terminate"))
    assert sched.waiting_reason("default", "a") == (
        "all 2 capable workers are quiet or terminating: none takes jobs")
    sched.remove_worker("w2")
    sched.workers["w1"].state = "running"
    assert sched.waiting_reason("default", "a") is None


def test_waiting_reason_without_status_quo(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w1", specs={"ghost": CA}))
    reason = sched.waiting_reason("default", "ghost")
    assert reason is not None and "status quo" in reason


# -- bookkeeping helpers --------------------------------------------------------------
def test_ready_counts_track_available_jobs(sched: Scheduler) -> None:
    sched.add(make_job("a1", spec="a"))
    sched.add(make_job("a2", spec="a"))
    sched.add(make_job("b1", spec="b", queue="other"))
    assert sched.ready_counts() == {("default", "a"): 2, ("other", "b"): 1}
    sched.add_worker(make_worker("w1", concurrency=1))
    sched.plan(NOW)
    assert sched.ready_counts() == {("default", "a"): 1, ("other", "b"): 1}


def test_mismatched_workers(sched: Scheduler) -> None:
    sched.add_worker(make_worker("w3", specs={"a": OLD}))
    sched.add_worker(make_worker("w1", specs={"a": OLD, "b": CB}))
    sched.add_worker(make_worker("w2", specs={"a": CA}))
    sched.add_worker(make_worker("w4", specs={"b": CB}))
    assert sched.mismatched_workers("a", CA) == ["w1", "w3"]
    assert sched.mismatched_workers("b", CB) == []


# -- memory: timers of finished jobs do not pile up ----------------------------------
def test_timer_entries_stay_bounded_when_jobs_finish_long_before_their_lease(
        sched: Scheduler) -> None:
    """Each reservation pushes a lease entry; finished jobs must not keep theirs until the
    lease would have lapsed (30 minutes), or memory grows with throughput."""
    worker = make_worker("w1", concurrency=10)
    sched.add_worker(worker)
    for n in range(50_000):
        job = make_job(f"j{n}")
        job.expiry = NOW + 3600  # a TTL entry too
        sched.track(job)
        worker.capacity = 10
        (reserved,) = sched.plan(NOW)["w1"]
        sched.finish(reserved)
    assert len(sched.jobs) == 0
    assert sched.timer_entries() < 3 * 4096


def test_compaction_keeps_every_live_deadline(sched: Scheduler) -> None:
    worker = make_worker("w1", concurrency=10_000, capacity=10_000)
    sched.add_worker(worker)
    live = []
    for n in range(9_000):
        job = make_job(f"j{n}")
        sched.track(job)
    plan = sched.plan(NOW)["w1"]
    for job in plan[::2]:
        sched.finish(job)  # half finish; half stay active with a lease
    live = plan[1::2]
    sched.renew(worker, [job.id for job in live], NOW + 100)  # leases move without a push
    sched._compact(sched._leases)
    assert sorted(job_id for _, job_id in sched._leases) == sorted(j.id for j in live)
    assert sched.expired_leases(NOW + 1800 + 50) == []
    assert sorted(ids(sched.expired_leases(NOW + 1800 + 101))) == sorted(ids(live))


# -- compact waiting jobs: keys only (rota/core/ready.py) -----------------------------------
@pytest.fixture
def compact() -> Scheduler:
    scheduler = Scheduler(compact=True)
    scheduler.status_quo = {"a": CA, "b": CB}
    return scheduler


def test_plain_jobs_are_kept_as_keys_and_claimed_in_priority_order(compact: Scheduler) -> None:
    for job in (make_job("low", seq=1), make_job("high", seq=2, priority=5),
                make_job("neg", seq=3, priority=-3), make_job("low2", seq=4)):
        compact.add(job)
    whole = make_job("ttl", seq=5, priority=1)
    whole.expiry = NOW + 60  # a time to live: kept whole, beside the keys in its bucket
    compact.add(whole)
    assert set(compact.jobs) == {"ttl"} and compact.ready.keys == 4 and compact.live() == 5
    compact.add_worker(make_worker("w1", concurrency=10))
    picked = compact.plan(NOW)["w1"]
    assert [(c.seq, c.priority) if isinstance(c, Claim) else c.id for c in picked] == [
        (2, 5), "ttl", (1, 0), (4, 0), (3, -3)]
    assert compact.workers["w1"].claims == 4 and compact.workers["w1"].free() == 5
    assert compact.ready_counts() == {}


def test_a_claim_whose_row_is_gone_gives_its_slot_back(compact: Scheduler) -> None:
    compact.add(make_job("j1", seq=1))
    compact.add_worker(make_worker("w1", concurrency=1))
    [claim] = compact.plan(NOW)["w1"]
    assert isinstance(claim, Claim) and compact.workers["w1"].free() == 0
    assert compact.claimed(claim, None) is False
    assert compact.workers["w1"].free() == 1 and compact.live() == 0


def test_a_failed_claim_puts_the_key_back(compact: Scheduler) -> None:
    compact.add(make_job("j1", seq=1))
    compact.add_worker(make_worker("w1", concurrency=1, capacity=5))
    [claim] = compact.plan(NOW)["w1"]
    compact.unclaim(claim)
    assert compact.ready_counts() == {("default", "a"): 1} and compact.claims == 0
    [again] = compact.plan(NOW)["w1"]
    assert isinstance(again, Claim) and again.seq == 1


def test_a_claimed_job_is_held_by_its_worker_or_left_if_it_is_gone(compact: Scheduler) -> None:
    for n in (1, 2):
        compact.add(make_job(f"j{n}", seq=n))
    compact.add_worker(make_worker("w1", concurrency=2))
    first, second = compact.plan(NOW)["w1"]
    row = make_job("j1", seq=1)
    row.state, row.worker_id, row.lease = "active", "w1", NOW + 30
    assert compact.claimed(first, row) is True
    assert compact.workers["w1"].active == {"j1"} and compact.jobs["j1"] is row
    compact.remove_worker("w1")
    compact.add_worker(make_worker("w1", concurrency=2))  # a new connection, a new slot
    other = make_job("j2", seq=2)
    other.state, other.worker_id, other.lease = "active", "w1", NOW + 30
    assert compact.claimed(second, other) is False  # the caller recovers it
    assert compact.workers["w1"].active == set() and "j2" in compact.jobs


@pytest.mark.parametrize("popped", [False, True])
@pytest.mark.parametrize("cancelled", [False, True])
def test_a_withdrawn_key_is_skipped_and_comes_back_if_the_row_says_so(
        compact: Scheduler, popped: bool, cancelled: bool) -> None:
    """A cancel of a compact job: its key is skipped while the write is in flight (even
    if it reaches the top meanwhile); the row's answer decides whether it comes back."""
    compact.add(make_job("j1", seq=1))
    compact.add(make_job("j2", seq=2))
    compact.ready.withdraw("default", "a", 1)
    assert compact.ready_counts() == {("default", "a"): 1}
    compact.add_worker(make_worker("w1", concurrency=2, capacity=1))
    if popped:
        [claim] = compact.plan(NOW)["w1"]  # the withdrawn key surfaced and was skipped
        assert isinstance(claim, Claim) and claim.seq == 2
        compact.unclaim(claim)
    compact.ready.withdrawn("default", "a", 0, 1, cancelled)
    assert compact.ready.waiting_seqs() == ({2} if cancelled else {1, 2})
    assert compact.ready.keys == (1 if cancelled else 2)
    compact.workers["w1"].capacity = 5
    claims = compact.plan(NOW)["w1"]
    assert [c.seq for c in claims if isinstance(c, Claim)] == ([2] if cancelled else [1, 2])
    assert compact.ready.keys == 0 and compact.ready_counts() == {}


@pytest.mark.parametrize("seed", range(60))
def test_keys_claims_and_withdraws_agree_with_a_model_of_the_rows(seed: int) -> None:
    """Random adds, rounds, claim outcomes, jobs put back before their rows say so (a
    recovery), and cancels, with the writer's order modelled: a claim is never given for
    a cancelled row or twice, no key is lost, and the counts stay exact."""
    rng = random.Random(seed)
    sched = Scheduler(compact=True)
    sched.status_quo = {"a": CA}
    sched.add_worker(make_worker("w1", concurrency=1000, capacity=0))
    rows: dict[int, str] = {}  # seq -> "available" | "active" | "cancelled" (the truth)
    writer: list[tuple[str, Any]] = []  # writes queued, committed in order
    withdrawing: dict[int, str] = {}  # seq -> "waiting" (its key held) | "claimed"
    placed: set[int] = set()  # put back in memory; the row says so once its write commits
    seq = itertools.count(1)
    for _ in range(300):
        op = rng.random()
        in_flight = {item.seq for kind, item in writer if kind == "reserve"}
        if op < 0.3:
            n = next(seq)
            sched.add(make_job(f"j{n}", seq=n, priority=rng.choice([0, 0, 1, -1])))
            rows[n] = "available"
        elif op < 0.5:
            sched.workers["w1"].capacity = rng.randint(1, 4)
            for claim in sched.plan(NOW).get("w1", []):
                assert isinstance(claim, Claim) and claim.seq not in in_flight
                assert rows[claim.seq] == "available" or claim.seq in placed
                assert withdrawing.get(claim.seq) != "waiting"  # a withdrawn key is skipped
                writer.append(("reserve", claim))
        elif op < 0.65:
            waiting = [s for s, state in rows.items()
                       if state == "available" and s not in withdrawing]
            if waiting:  # the cancel read an available row
                n = rng.choice(waiting)
                sched.ready.withdraw("default", "a", n)
                withdrawing[n] = "claimed" if n in in_flight else "waiting"
                writer.append(("withdraw", n))
        elif writer:  # the writer commits the oldest write (or it fails)
            kind, item = writer.pop(0)
            fails = rng.random() < 0.15
            if kind == "save":
                rows[item] = "available"
                placed.discard(item)
            elif kind == "reserve" and fails:
                sched.unclaim(item)
                if item.seq in withdrawing:
                    withdrawing[item.seq] = "waiting"
            elif kind == "reserve" and rows[item.seq] == "available":
                rows[item.seq] = "active"
                job = make_job(f"j{item.seq}", seq=item.seq)
                job.state, job.worker_id, job.lease = "active", "w1", NOW + 30
                assert sched.claimed(item, job) is True
                sched.workers["w1"].active.discard(job.id)
                if rng.random() < 0.3:  # recovered at once: back before its row says so
                    sched.add(job)
                    placed.add(item.seq)
                    writer.append(("save", item.seq))
                else:
                    sched.finish(job)
            elif kind == "reserve":
                assert sched.claimed(item, None) is False
            else:
                cancelled = not fails and rows[item] == "available"
                if cancelled:
                    rows[item] = "cancelled"
                sched.ready.withdrawn("default", "a", 0, item, cancelled)
                del withdrawing[item]
        in_flight = {item.seq for kind, item in writer if kind == "reserve"}
        expected = {s for s, state in rows.items() if state == "available" or s in placed
                    if s not in in_flight and withdrawing.get(s) != "waiting"}
        assert sched.ready.waiting_seqs() == expected
        assert sched.ready.keys == len(expected)
        assert sum(sched.ready_counts().values()) == len(expected)


def test_buckets_of_queues_with_no_job_left_are_forgotten(sched: Scheduler) -> None:
    """Producers name queues: the ready index does not keep one bucket per name ever
    given, only those with jobs (and at most twice as many between two sweeps)."""
    from rota.core.ready import SWEEP_AT

    sched.add_worker(make_worker("w1", queues=["keep"]))
    kept = make_job("kept", queue="keep")
    sched.add(kept)
    for n in range(20 * SWEEP_AT):  # each in its own queue, and gone (a time to live ran out)
        job = make_job(f"j{n}", queue=f"q{n}")
        sched.add(job)
        sched.finish(job)
    buckets = sum(len(by_spec) for by_spec in sched.ready.buckets.values())
    assert buckets <= 2 * SWEEP_AT
    assert planned_ids(sched.plan(NOW), "w1") == ["kept"]  # a bucket with a job stays
    late = make_job("late", queue="q5")
    sched.add(late)  # a queue forgotten gets a new bucket when it has a job again
    sched.add_worker(make_worker("w2", queues=["q5"]))
    assert planned_ids(sched.plan(NOW), "w2") == ["late"]
