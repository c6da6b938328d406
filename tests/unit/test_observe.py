"""rota/core/observe.py alone: every wall time is given (a fake clock), nothing runs."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from rota.core.model import Change, JobRecord, shared_limits
from rota.core.observe import (COUNTS, DURATION_BOUNDS, MINUTES, OTHER, WAIT_BOUNDS, Event, Filter,
                          Observer, busiest, event_data, fold_queues)

T0 = 1_800_000_000.0  # a minute boundary (divisible by 60)


def said(event: Event) -> dict[str, Any]:
    """What an event says, as its subscriber decodes it (rota/server/feeds.py puts it on the wire)."""
    return json.loads(msgspec.json.encode(event_data(event)))


def error_record(message: str) -> bytes:
    return msgspec.json.encode({"type": "ValueError", "message": message, "attempt": 1})


def job(job_id: str, spec: str = "s", queue: str = "q", *, state: str = "available",
        attempt: int = 0, reserved_at: float | None = None, enqueued_at: float = T0,
        run_at: float | None = None, worker: str | None = None) -> JobRecord:
    return JobRecord(id=job_id, spec=spec, queue=queue, args=msgspec.Raw(b"{}"), priority=0,
               enqueued_at=enqueued_at, seq=1, limits=shared_limits(3, None, 1.0, 60.0, 3),
               state=state, attempt=attempt, reserved_at=reserved_at, run_at=run_at,
               checksum="c1", worker_id=worker)


def ended(state: str, ending: str | None, *, job_id: str = "j", attempt: int = 1,
          reserved_at: float | None = T0, error: bytes | None = None) -> Change:
    return Change(job(job_id, state=state, attempt=attempt, reserved_at=reserved_at,
                      worker="w"), error=error, ending=ending)


def test_events_are_numbered_from_the_first_id_and_the_ring_is_bounded():
    obs = Observer(buffer=5, first_id=100)
    obs.enqueued([job(f"j{i}") for i in range(3)], T0)
    assert obs.next_id == 103 and obs.first_kept == 100
    missed, events = obs.after(100, 10)
    assert missed == 0 and [(i, e[2]) for i, e in events] == [(101, "j1"), (102, "j2")]
    obs.assigned([job(f"j{i}", attempt=1) for i in range(4)], "w", T0 + 1)
    assert obs.next_id == 107 and obs.first_kept == 102  # 100 and 101 fell off
    assert [i for i, _ in obs.after(101, 10)[1]] == [102, 103, 104, 105, 106]
    assert obs.after(106, 10) == (0, [])  # caught up
    assert [i for i, _ in obs.after(101, 2)[1]] == [102, 103]  # at most limit


def test_a_reader_behind_the_ring_hears_what_it_missed():
    obs = Observer(buffer=3, first_id=1)
    obs.enqueued([job(f"j{i}") for i in range(10)], T0)  # ids 1..10
    missed, events = obs.after(2, 100)
    assert missed == 3  # ids 3..7 are gone
    assert [i for i, _ in events] == [8, 9, 10]


def test_counts_per_minute_keep_the_last_hour_only():
    obs = Observer()
    obs.enqueued([job("a")], T0 + 5)
    obs.enqueued([job("b"), job("c"), job("x", spec="t")], T0 + 65)
    starts, rows = obs.window(3, T0 + 70)
    assert starts == [int(T0 // 60) - 1, int(T0 // 60), int(T0 // 60) + 1]
    zeros = {name: [0, 0, 0] for name in COUNTS if name != "enqueued"}
    assert rows == [{"queue": "q", "spec": "s", "enqueued": [0, 1, 2], **zeros},
                    {"queue": "q", "spec": "t", "enqueued": [0, 0, 1], **zeros}]
    # An hour later the old minutes are gone from memory, not only from the window.
    obs.enqueued([job("d")], T0 + 60 * MINUTES + 1)
    series = obs.series["q", "s"]
    assert sorted(series.minutes) == [int(T0 // 60) + 1, int(T0 // 60) + MINUTES]
    assert series.totals[0] == 4  # totals (the Prometheus counters) never drop
    assert obs.window(60, T0 + 60 * MINUTES + 1)[1][0]["enqueued"][-1] == 1
    assert obs.window(5, T0 + 9 * 3600)[1] == []  # nothing in that window


def test_how_attempts_end_count_and_show():
    obs = Observer(first_id=1)
    obs.assigned([job("ok", attempt=1, enqueued_at=T0 - 0.003)], "w", T0)
    obs.ended([ended("completed", None, job_id="ok")], T0 + 0.02, worker="w", reported=True)
    obs.ended([ended("retryable", "failed", job_id="f", error=error_record("boom")),
               ended("discarded", "failed", job_id="f", attempt=2, reserved_at=T0 + 0.5,
                     error=error_record("boom again"))], T0 + 1, worker="w", reported=True)
    obs.ended([ended("available", "worker_death", job_id="d")], T0 + 3, reported=False)
    obs.ended([ended("available", "released", job_id="r"),
               ended("cancelled", "cancelled", job_id="x", reserved_at=None)], T0 + 4,
              worker="w", reported=True)
    series = obs.series["q", "s"]
    assert dict(zip(COUNTS, series.totals, strict=True)) == {
        "enqueued": 0, "completed": 1, "failed": 3, "retried": 2, "discarded": 1,
        "cancelled": 1}
    kinds = [(e[1], e[2], e[8]) for _, e in obs.after(0, 100)[1]]
    assert kinds == [("assign", "ok", "active"), ("result", "ok", "completed"),
                     ("result", "f", "retryable"), ("retry", "f", "retryable"),
                     ("result", "f", "discarded"), ("discard", "f", "discarded"),
                     ("retry", "d", "available"),  # the server ended it: no result event
                     ("result", "r", "available"),  # released: no failure, no retry
                     ("result", "x", "cancelled"), ("cancel", "x", "cancelled")]
    # Durations: results reported with a start, but for the released job (it never
    # ran): ok, and f twice; the wait of the assign.
    assert sum(series.duration.counts) == 3
    assert series.duration.counts[DURATION_BOUNDS.index(0.025)] == 1  # 20 ms
    assert series.duration.counts[DURATION_BOUNDS.index(0.5)] == 1  # 500 ms
    assert sum(series.wait.counts) == 1 and series.wait.counts[WAIT_BOUNDS.index(0.005)] == 1
    assert abs(series.wait.sum - 0.003) < 1e-6


def test_an_event_says_only_what_applies():
    obs = Observer(first_id=7)
    obs.ended([ended("retryable", "failed", job_id="f", attempt=2, reserved_at=T0 + 1,
                     error=error_record("it broke"))], T0 + 1.5, worker="w", reported=True)
    obs.event(T0, "alert", job=None, worker="w", message=("warning", "disk low"))
    obs.event(T0, "worker_disconnect", worker="w", message="closed")
    (i1, result), (_, retry), (i3, alert), (_, bye) = obs.after(6, 10)[1]
    assert (i1, i3) == (7, 9)
    assert said(result) == {
        "at": "2027-01-15T08:00:01.500Z", "kind": "result", "job": "f", "spec": "s",
        "queue": "q", "worker": "w", "attempt": 2, "state": "retryable",
        "duration_ms": 500.0, "message": "it broke"}
    assert said(retry)["message"] == "it broke"
    assert said(alert) == {"at": "2027-01-15T08:00:00.000Z", "kind": "alert", "worker": "w",
                           "level": "warning", "message": "disk low"}
    assert said(bye) == {"at": "2027-01-15T08:00:00.000Z", "kind": "worker_disconnect",
                         "worker": "w", "message": "closed"}
    obs.assigned([job("late", run_at=T0 + 100)], "w", T0 + 50)  # ran before its run_at
    assert obs.series["q", "s"].wait.counts[0] == 1  # counted as no wait, not negative


def test_counted_moves_and_the_filter():
    obs = Observer(first_id=1)
    obs.counted(T0, "cancel", "a", "s", "q1")
    obs.counted(T0, "retry", "b", "s", "q2", attempt=3, message="retried by an operator")
    obs.counted(T0, "discard", "c", "t", "q1", message="expired")
    events = [e for _, e in obs.after(0, 10)[1]]
    assert [(e[1], e[8]) for e in events] == [("cancel", "cancelled"), ("retry", "available"),
                                               ("discard", "discarded")]
    assert obs.series["q1", "s"].totals[COUNTS.index("cancelled")] == 1
    assert obs.series["q2", "s"].totals[COUNTS.index("retried")] == 1
    assert obs.series["q1", "t"].totals[COUNTS.index("discarded")] == 1
    assert [e[2] for e in events if Filter(queue="q1").matches(e)] == ["a", "c"]
    assert [e[2] for e in events if Filter(kinds=frozenset({"retry"})).matches(e)] == ["b"]
    assert [e[2] for e in events if Filter(spec="t", queue="q1").matches(e)] == ["c"]
    assert not any(Filter(worker="w").matches(e) for e in events)


def test_a_listener_hears_every_record_and_recording_works_without_one():
    obs = Observer()
    heard: list[int] = []
    obs.listener = lambda: heard.append(obs.next_id)
    obs.enqueued([job("a")], T0)
    obs.assigned([job("a", attempt=1)], "w", T0)
    obs.ended([ended("completed", None, job_id="a")], T0, worker="w", reported=True)
    obs.event(T0, "worker_state", worker="w", state="quiet")
    assert len(heard) == 4 and heard == sorted(heard)
    obs.listener = None
    obs.event(T0, "worker_state", worker="w", state="running")
    assert len(heard) == 4 and obs.latest == T0


def totals_of(obs: Observer) -> dict[tuple[str, str], int]:
    return {(queue, spec): series.totals[COUNTS.index("enqueued")]
            for queue, spec, series in obs.totals()}


def test_series_past_the_bound_count_under_other_and_idle_ones_make_room():
    obs = Observer(max_series=2)
    obs.enqueued([job("a", queue="q1"), job("b", queue="q2"), job("c", queue="q3")], T0)
    obs.enqueued([job("d", queue="q4")], T0 + 1)
    assert totals_of(obs) == {("q1", "s"): 1, ("q2", "s"): 1, (OTHER, OTHER): 2}
    # q1 busy again a while later; q2 idle for the whole window: q5 takes its place, and
    # q2's numbers go to OTHER, so that every total only ever grows.
    obs.enqueued([job("e", queue="q1")], T0 + 60 * (MINUTES - 1))
    obs.assigned([job("e", queue="q1", attempt=1)], "w", T0 + 60 * MINUTES)
    obs.enqueued([job("f", queue="q5")], T0 + 60 * MINUTES)
    assert totals_of(obs) == {("q1", "s"): 2, ("q5", "s"): 1, (OTHER, OTHER): 3}
    assert sum(totals_of(obs).values()) == 6
    # No idle one left (q1 and q5 were touched in the window): q6 goes to OTHER.
    obs.enqueued([job("g", queue="q6")], T0 + 60 * MINUTES + 1)
    assert totals_of(obs)[OTHER, OTHER] == 4 and len(obs.series) == 2
    starts, rows = obs.window(1, T0 + 60 * MINUTES + 1)
    assert {(r["queue"], r["spec"]): r["enqueued"] for r in rows} == {
        ("q5", "s"): [1], (OTHER, OTHER): [1]}


def test_sixty_thousand_queues_keep_a_bounded_number_of_series():
    obs = Observer(max_series=100)
    for n in range(60):
        obs.enqueued([job(f"j{n}-{i}", queue=f"q{n}-{i}") for i in range(1000)], T0 + n)
    assert len(obs.series) == 100 and obs.other is not None
    assert sum(totals_of(obs).values()) == 60_000


def test_a_scrape_names_the_busiest_queues_and_sums_the_rest():
    counts = {f"q{i}": {"available": i % 7, "completed": i} for i in range(50)}
    folded = fold_queues(counts, 3, ("available",))
    assert sorted(folded) == sorted(["q48", "q41", "q34", OTHER])  # 6 available each
    assert sum(per["completed"] for per in folded.values()) == sum(range(50))
    assert fold_queues({"a": {"completed": 1}}, 3, ("available",)) == {"a": {"completed": 1}}
    assert busiest({"a": 1, "b": 3, "c": 3}, 2) == ["b", "c"]


def test_the_counts_kept_in_the_store_are_each_written_once_and_restored():
    # What the shell writes every few seconds (rota/server/watching.py): the increments
    # since the last write, per minute and (queue, spec); none per job.
    obs = Observer()
    obs.enqueued([job("a"), job("b")], T0 + 1)
    rows, mark = obs.unsaved(T0 + 2)
    assert rows == [(T0 // 60, "q", "s", 2, 0, 0, 0, 0, 0)]
    assert obs.unsaved(T0 + 2)[0] == rows  # not written yet: asked again, the same
    obs.saved(mark)
    assert obs.unsaved(T0 + 3)[0] == []
    obs.enqueued([job("c")], T0 + 30)  # the same minute: only its increment
    obs.ended([ended("completed", "completed")], T0 + 61, reported=True)  # and the next minute
    rows, mark = obs.unsaved(T0 + 62)
    assert sorted(rows) == [(T0 // 60, "q", "s", 1, 0, 0, 0, 0, 0),
                            (T0 // 60 + 1, "q", "s", 0, 1, 0, 0, 0, 0)]
    obs.saved(mark)
    assert obs.unsaved(T0 + 200)[0] == []
    # A restart takes in what was kept within the hour, and writes none of it again.
    kept = [(T0 // 60 - MINUTES, "q", "s", 9, 0, 0, 0, 0, 0),  # past the hour: left out
            (T0 // 60, "q", "s", 3, 0, 0, 0, 0, 0), (T0 // 60 + 1, "q", "s", 0, 1, 0, 0, 0, 0),
            (T0 // 60 + 1, OTHER, OTHER, 0, 0, 1, 0, 0, 0)]
    again = Observer()
    again.restore(kept, T0 + 70)
    starts, series = again.window(3, T0 + 70)
    assert [(r["queue"], r["enqueued"], r["completed"], r["failed"]) for r in series] == [
        ("q", [0, 3, 0], [0, 0, 1], [0, 0, 0]), (OTHER, [0, 0, 0], [0, 0, 0], [0, 0, 1])]
    assert again.unsaved(T0 + 80)[0] == []
    again.enqueued([job("d")], T0 + 90)  # the minute it started in goes on from the kept
    assert again.unsaved(T0 + 95)[0] == [(T0 // 60 + 1, "q", "s", 1, 0, 0, 0, 0, 0)]
    assert all(n == 0 for _, _, series in again.totals() for n in series.totals[1:])
