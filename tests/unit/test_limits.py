"""Flow-control rules (rota/core/limits.py): the rate shorthand, validation, windows."""

from __future__ import annotations

import random

import msgspec
import pytest

from rota.base.errors import Invalid
from rota.core.limits import (OTHER_KEYS, LimitRule, LimitUse, Rate, Window, check_rule, fold_keys,
                              parse_rate)
from rota.core.model import Instant, JobRecord, JobState, Limits
from rota.core.scheduler import Claim, Scheduler, WorkerSlot


@pytest.mark.parametrize("text, rate", [
    ("100/min", Rate(100, 60.0)), ("5/s", Rate(5, 1.0)), ("1000/h", Rate(1000, 3600.0)),
    ("10/30s", Rate(10, 30.0)), ("5/sec", Rate(5, 1.0)), ("5/second", Rate(5, 1.0)),
    ("5/m", Rate(5, 60.0)), ({"limit": 100, "period": 60, "burst": 10}, Rate(100, 60.0, 10)),
])
def test_rate_shorthand(text: object, rate: Rate) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("bad, words", [
    ("0/s", "limit must be at least 1, got 0"),
    ("5/fortnight", "expected N/unit, e.g. '100/min', '5/s', '1000/h' or '10/30s' (units: s,"
     " sec, second, m, min, minute, h, hour, d, day)"),
    ("99999999999999999999/s", "limit 99999999999999999999 is too large: at most 2147483647"),
    ({"limit": 2**31, "period": 1}, "limit 2147483648 is too large: at most 2147483647"),
    ({"limit": 1, "period": 0}, "period must be above 0"), ("1/2d", "got 172800"),
    ({"limit": 2, "period": 1, "burst": 3}, "burst 3 is above the limit 2"),
    ({"limit": 1, "period": 1, "every": 1}, "unknown field `every`"), (7, "expected a string"),
])
def test_bad_rates_say_what_is_wrong(bad: object, words: str) -> None:
    with pytest.raises(Invalid) as caught:
        parse_rate(bad)
    assert caught.value.code == "invalid_limit" and words in str(caught.value)


def test_bad_rules() -> None:
    with pytest.raises(Invalid, match="key_concurrency must be at least 1, got 0"):
        check_rule(LimitRule(key_concurrency=0))
    with pytest.raises(Invalid, match="at least one of"):
        check_rule(LimitRule())
    check_rule(LimitRule(concurrency=3, key_rate=Rate(5, 1.0)))


def test_window_slides_and_bursts_then_spaces() -> None:
    window = Window(Rate(3, 10.0))
    for at in (0.0, 1.0, 2.0):
        assert window.allows(at)
        window.start(at)
    assert window.next_start(2.0) == 10.0  # the first start leaves the window then
    assert window.in_window(10.5) == 2
    spaced = Window(Rate(10, 10.0, burst=2))
    starts = []
    now = 0.0
    for _ in range(5):
        now = spaced.next_start(now)
        spaced.start(now)
        starts.append(now)
    assert starts == [0.0, 0.0, 1.0, 2.0, 3.0]  # two back to back, then 1 s apart
    assert Window(Rate(10, 10.0, burst=2), starts).next_start(3.0) == 4.0  # replayed


def test_a_pending_start_counts_as_now_until_it_is_made() -> None:
    window = Window(Rate(2, 10.0))
    window.start(0.0)
    window.begin(1.0)  # planned; its commit has not landed
    assert window.next_start(5.0) == 10.0  # two in the window: the made one leaves at 10
    assert window.next_start(12.0) == 12.0  # 0.0 left; the pending one counts as at 12
    window.begin(12.0)
    assert window.next_start(12.0) == 22.0  # two pending fill it: a period from now at least
    window.unstart(12.0)
    window.made(1.0, 12.5)  # landed late: made then
    assert list(window.starts) == [0.0, 12.5] and not window.pending
    assert window.next_start(13.0) == 13.0  # 0.0 left the window; 12.5 is one of two
    window.begin(13.0)
    window.unstart(13.0)  # its commit failed: taken back
    assert window.next_start(13.0) == 13.0 and window.in_window(13.0) == 1


def test_made_starts_stay_in_order_and_only_the_last_limit_are_kept() -> None:
    window = Window(Rate(3, 10.0), starts=[1.0, 2.0, 3.0])
    window.begin(0.5)
    window.made(0.5, 0.5)  # (a job ended with its start pending: made when planned)
    assert list(window.starts) == [1.0, 2.0, 3.0]  # older than all three kept
    window.begin(2.5)
    window.made(2.5, 2.5)
    assert list(window.starts) == [2.0, 2.5, 3.0]
    window.start(4.0)
    assert list(window.starts) == [2.5, 3.0, 4.0]


def test_a_round_costs_what_it_assigns_not_what_waits() -> None:
    """1,000,000 waiting over 10,000 keys, 3 per key: a round that assigns N looks at
    O(N) buckets, however many wait (parked keys are out of the rotation)."""
    checksum = "sha256:" + "a" * 64
    sched = Scheduler(compact=True)
    sched.status_quo = {"a": checksum}
    sched.set_limits({("spec", "a"): LimitRule(key_concurrency=3)}, Instant(0.0, 0.0))
    for k in range(10_000):
        base = k * 100 + 1
        sched.ready.load("default", "a", list(range(base, base + 100)), f"k{k}")
    assert sched.ready.keys == 1_000_000
    worker = WorkerSlot("w1", ["default"], concurrency=40_000, specs={"a": checksum},
                        capacity=40_000)
    sched.add_worker(worker)
    plan = sched.plan(1.0)["w1"]
    assert len(plan) == 30_000  # 3 per key
    assert sched.visits <= 30_000 + 10_000 + 10  # each key: its 3 turns, then parked once
    # Ten jobs of ten keys end: the next round assigns ten, looking at a few buckets.
    for claim in plan[:10]:
        assert isinstance(claim, Claim)
        job = JobRecord(id=f"j{claim.seq}", spec="a", queue="default", args=msgspec.Raw(b"{}"),
                        priority=0, enqueued_at=0.0, seq=claim.seq, state="active",
                        worker_id="w1", concurrency_key=claim.concurrency_key,
                        limits=Limits(3, None, 1.0, 60.0))
        sched.claimed(claim, job)
        sched.finish(job)
    worker.capacity = 10_000
    before = sched.visits
    again = sched.plan(2.0)["w1"]
    assert sorted(c.concurrency_key for c in again) == sorted(c.concurrency_key for c in plan[:10])
    assert sched.visits - before <= 3 * len(again) + 10
    before = sched.visits
    assert sched.plan(3.0) == {}  # all at their limit: nothing looked at
    assert sched.visits - before <= 2


def test_stored_starts_given_again_are_not_counted_twice() -> None:
    sched = Scheduler(compact=True)
    rule = {("spec", "a"): LimitRule(rate=Rate(3, 60.0))}
    stored = {("spec:a", None): [100.0, 101.0]}
    sched.set_limits(rule, Instant(200.0, 200.0), starts=stored)
    sched.set_limits(rule, Instant(200.0, 200.0), starts=stored)  # another change: the same rows
    window = sched.limiter.windows[("spec", "a", None)]
    assert list(window.starts) == [100.0, 101.0] and window.allows(200.0)


def test_random_rounds_never_exceed_a_limit_and_run_every_job() -> None:
    """Jobs of 7 keys (and none) in two queues, workers coming and going, jobs ending in
    any order: at every moment no key, spec or queue holds more than its limit, and in
    the end every job ran."""
    rng = random.Random(23)
    checksum = "sha256:" + "a" * 64
    sched = Scheduler()
    sched.status_quo = {"a": checksum, "b": checksum}
    rules = {("spec", "a"): LimitRule(concurrency=5, key_concurrency=2),
             ("queue", "q2"): LimitRule(concurrency=3, key_concurrency=1),
             ("spec", "b"): LimitRule(key_rate=Rate(4, 10.0))}
    sched.set_limits(rules, Instant(0.0, 0.0))
    jobs = []
    for n in range(300):
        job = JobRecord(id=f"j{n}", spec=rng.choice("ab"), queue=rng.choice(["q1", "q2"]),
                        args=msgspec.Raw(b"{}"), priority=rng.randint(0, 2), enqueued_at=0.0,
                        seq=n + 1, limits=Limits(3, None, 1.0, 60.0),
                        concurrency_key=rng.choice([None, *"klmnopq"]))
        sched.track(job)
        jobs.append(job)
    workers = [WorkerSlot(f"w{i}", ["q1", "q2"], concurrency=4, specs={"a": checksum,
                                                                      "b": checksum})
               for i in range(3)]
    for worker in workers:
        sched.add_worker(worker)
    done: set[str] = set()
    starts: dict[str | None, list[float]] = {}
    now = 0.0
    while len(done) < len(jobs) and now < 2000:
        now += 0.5
        sched.unpark_due(now)
        for worker in workers:
            worker.capacity = worker.concurrency
        for batch in sched.plan(now).values():
            for job in batch:
                assert isinstance(job, JobRecord)
                if job.spec == "b" and job.concurrency_key is not None:
                    starts.setdefault(job.concurrency_key, []).append(now)
        active = [job for job in jobs if job.state == "active"]
        per: dict[tuple[str, str | None], int] = {}
        for job in active:
            for scope in (("spec", job.spec), ("queue", job.queue)):
                per[(scope[1], None)] = per.get((scope[1], None), 0) + 1
                if job.concurrency_key:
                    per[(scope[1], job.concurrency_key)] = per.get(
                        (scope[1], job.concurrency_key), 0) + 1
        assert per.get(("a", None), 0) <= 5 and per.get(("q2", None), 0) <= 3
        assert all(n <= 2 for (name, key), n in per.items() if name == "a" and key)
        assert all(n <= 1 for (name, key), n in per.items() if name == "q2" and key)
        for job in active:
            if rng.random() < 0.3:
                job.move(JobState.COMPLETED)
                sched.finish(job)
                done.add(job.id)
    assert len(done) == len(jobs)
    for times in starts.values():  # at most 4 starts of a key of spec b in any 10 s
        assert all(later - earlier >= 10.0 for earlier, later in zip(times, times[4:]))


def test_keys_past_the_cap_are_summed_under_other_after_their_limit():
    uses = [LimitUse(name="spec:a", concurrency=9, running=4),
            LimitUse(name="spec:a", key="k1", concurrency=3, running=1),
            LimitUse(name="spec:a", key="k2", concurrency=3, running=3),
            LimitUse(name="spec:a", key="k3", concurrency=3, running=2),
            LimitUse(name="spec:b", key="x", rate="5/s", starts=4)]
    assert fold_keys(uses, 5) == uses
    assert fold_keys(uses, 2) == [
        uses[0], uses[2], uses[3],
        LimitUse(name="spec:a", key=OTHER_KEYS, running=1),  # k1: the least busy
        LimitUse(name="spec:b", key=OTHER_KEYS, rate="5/s", starts=4)]


def _keyed(limits: LimitRule, *, concurrency: int = 10, prefetch: int = 0,
           keys: dict[str, list[int]] | None = None) -> tuple[Scheduler, WorkerSlot]:
    checksum = "sha256:" + "a" * 64
    sched = Scheduler(compact=True)
    sched.status_quo = {"a": checksum}
    sched.set_limits({("spec", "a"): limits}, Instant(0.0, 0.0))
    for key, seqs in (keys or {"acme": [1, 2, 3]}).items():
        sched.ready.load("default", "a", seqs, key)
    worker = WorkerSlot("w1", ["default"], concurrency=concurrency, specs={"a": checksum},
                        capacity=concurrency + prefetch, prefetch=prefetch)
    sched.add_worker(worker)
    return sched, worker


def test_a_key_picked_twice_in_one_round_counts_once() -> None:
    """A key known twice (pushed back after a failed claim while its first copy waited)
    is picked twice: the job holds its limit once, and its one release frees it."""
    sched, worker = _keyed(LimitRule(key_concurrency=1), keys={"acme": [1, 1]})
    sched.limiter.take(1, "default", "a", "acme", 1.0)
    sched.limiter.take(1, "default", "a", "acme", 1.0)
    assert sched.limiter.use == {("spec", "a", "acme"): 1}
    sched.limiter.release(1, undo=True)
    assert sched.limiter.use == {}


def test_a_refused_start_does_not_count_against_the_rate() -> None:
    """One start in 10 s for key acme: a pick the store refuses (another server took the
    start) or whose commit fails is no start here; once the hold-off passes, the key may
    start again, not only when 10 s have gone by."""
    sched, worker = _keyed(LimitRule(key_rate=Rate(1, 10.0)))
    [first] = sched.plan(1.0)["w1"]
    assert isinstance(first, Claim)
    sched.refuse(first, 1.0)
    assert sched.plan(1.2) == {}  # held off a moment: the other server's start
    sched.unpark_due(2.0)  # (the engine's tick fires the key's timer)
    [again] = sched.plan(2.0)["w1"]
    assert again.seq == first.seq
    sched.unclaim(again)  # its commit failed: no start either
    [third] = sched.plan(2.1)["w1"]
    assert third.seq == first.seq


def test_a_rated_job_waits_for_a_slot_that_starts_it_not_in_a_line() -> None:
    """A worker running its one slot, with room in its line: a rate-limited job is not
    put in the line (it would start later, bunched past the rate); an unlimited one is."""
    sched, worker = _keyed(LimitRule(key_rate=Rate(5, 1.0)), concurrency=1, prefetch=3,
                           keys={"acme": [1, 2, 3]})
    worker.active.add("running")
    assert sched.plan(1.0) == {}
    worker.active.discard("running")
    [started] = sched.plan(1.1)["w1"]
    assert started.concurrency_key == "acme"


def test_a_key_held_elsewhere_holds_off_that_key_not_its_spec() -> None:
    """The store refused acme's job (another server holds acme's one slot) and said so:
    only acme is held off; bolt, of the same spec, goes out in the next round."""
    sched, worker = _keyed(LimitRule(concurrency=40, key_concurrency=1),
                           keys={"acme": [1], "bolt": [2]})
    plan = sched.plan(1.0)["w1"]
    acme = next(c for c in plan if isinstance(c, Claim) and c.concurrency_key == "acme")
    bolt = next(c for c in plan if isinstance(c, Claim) and c.concurrency_key == "bolt")
    sched.unclaim(bolt)  # (its reservation was written in another round)
    sched.refuse(acme, 1.0, frozenset({("spec:a", "acme")}))
    [again] = sched.plan(1.1)["w1"]
    assert isinstance(again, Claim) and again.concurrency_key == "bolt"


def test_a_labelled_key_is_not_passed_between_two_workers_for_ever() -> None:
    """Keys A and B any worker takes, key L only a gpu worker: a cpu worker and a gpu
    worker taking turns. L keeps its place when the cpu worker looks past it, so the gpu
    worker gets it on its turn (it was sent to the back, and never at the front when
    the gpu worker looked)."""
    checksum = "sha256:" + "a" * 64
    sched = Scheduler(compact=True)
    sched.status_quo = {"a": checksum}
    sched.set_limits({("spec", "a"): LimitRule(key_concurrency=100)}, Instant(0.0, 0.0))
    sched.ready.load("default", "a", list(range(1, 50)), "l", ("gpu",))
    sched.ready.load("default", "a", list(range(100, 150)), "a")
    sched.ready.load("default", "a", list(range(200, 250)), "b")
    cpu = WorkerSlot("c", ["default"], concurrency=100, specs={"a": checksum}, capacity=0)
    gpu = WorkerSlot("g", ["default"], concurrency=100, specs={"a": checksum}, capacity=0,
                     labels=["gpu"])
    sched.add_worker(cpu)
    sched.add_worker(gpu)
    got: list[tuple[str, str | None]] = []
    for n in range(12):  # one job a round, the two workers taking turns
        worker = (cpu, gpu)[n % 2]
        worker.capacity = 1
        for worker_id, batch in sched.plan(float(n)).items():
            got += [(worker_id, c.concurrency_key) for c in batch if isinstance(c, Claim)]
        worker.capacity = 0
    assert ("g", "l") in got, got
    assert not any(worker_id == "c" and key == "l" for worker_id, key in got)
