"""rota/observe.py alone: every wall time is given (a fake clock), nothing runs."""

from __future__ import annotations

import json

import msgspec

from rota.observe import (COUNTS, DURATION_BOUNDS, MINUTES, WAIT_BOUNDS, Filter, Observer,
                          encode, gap)

T0 = 1_800_000_000.0  # a minute boundary (divisible by 60)


def parse(frame: bytes) -> tuple[int, str, dict]:
    lines = frame.decode().split("\n")
    assert frame.endswith(b"\n\n")
    fields = dict(line.split(": ", 1) for line in lines if line)
    return int(fields["id"]), fields["event"], json.loads(fields["data"])


def error_record(message: str) -> bytes:
    return msgspec.json.encode({"type": "ValueError", "message": message, "attempt": 1})


def test_events_are_numbered_from_the_first_id_and_the_ring_is_bounded():
    obs = Observer(buffer=5, first_id=100)
    obs.enqueued([(f"j{i}", "s", "q", "available") for i in range(3)], T0)
    assert obs.next_id == 103 and obs.first_kept == 100
    missed, events = obs.after(100, 10)
    assert missed == 0 and [(i, e[2]) for i, e in events] == [(101, "j1"), (102, "j2")]
    obs.assigned([(f"j{i}", "s", "c", "q", "w", 1, T0) for i in range(4)], T0 + 1)
    assert obs.next_id == 107 and obs.first_kept == 102  # 100 and 101 fell off
    assert [i for i, _ in obs.after(101, 10)[1]] == [102, 103, 104, 105, 106]
    assert obs.after(106, 10) == (0, [])  # caught up
    assert [i for i, _ in obs.after(101, 2)[1]] == [102, 103]  # at most limit


def test_a_reader_behind_the_ring_hears_what_it_missed():
    obs = Observer(buffer=3, first_id=1)
    obs.enqueued([(f"j{i}", "s", "q", "available") for i in range(10)], T0)  # ids 1..10
    missed, events = obs.after(2, 100)
    assert missed == 3  # ids 3..7 are gone
    assert [i for i, _ in events] == [8, 9, 10]
    event_id, kind, data = parse(gap(missed, events[0][0] - 1, T0))
    assert (event_id, kind) == (7, "gap")
    assert data == {"at": "2027-01-15T08:00:00.000Z", "kind": "gap", "missed_from": 3,
                    "missed_to": 7}


def test_counts_per_minute_keep_the_last_hour_only():
    obs = Observer()
    obs.enqueued([("a", "s", "q", "available")], T0 + 5)
    obs.enqueued([("b", "s", "q", "available"), ("c", "s", "q", "available")], T0 + 65)
    starts, rows = obs.window(3, T0 + 70)
    assert starts == [int(T0 // 60) - 1, int(T0 // 60), int(T0 // 60) + 1]
    assert rows == [{"queue": "q", "spec": "s", "enqueued": [0, 1, 2],
                     **{name: [0, 0, 0] for name in COUNTS if name != "enqueued"}}]
    # An hour later the old minutes are gone from memory, not only from the window.
    obs.enqueued([("d", "s", "q", "available")], T0 + 60 * MINUTES + 1)
    series = obs.series["q", "s"]
    assert sorted(series.minutes) == [int(T0 // 60) + 1, int(T0 // 60) + MINUTES]
    assert series.totals[0] == 4  # totals (the Prometheus counters) never drop
    assert obs.window(60, T0 + 60 * MINUTES + 1)[1][0]["enqueued"][-1] == 1
    assert obs.window(5, T0 + 9 * 3600)[1] == []  # nothing in that window


def test_how_attempts_end_count_and_show():
    obs = Observer(first_id=1)
    obs.assigned([("ok", "s", "c1", "q", "w", 1, T0 - 0.003)], T0)
    obs.ended(T0 + 0.02, "ok", "s", "q", "w", 1, "completed", ending=None, reported=True,
              started=T0)
    obs.ended(T0 + 1, "f", "s", "q", "w", 1, "retryable", ending="failed", reported=True,
              started=T0, error=error_record("boom"))
    obs.ended(T0 + 2, "f", "s", "q", "w", 2, "discarded", ending="failed", reported=True,
              started=T0 + 1.5, error=error_record("boom again"))
    obs.ended(T0 + 3, "d", "s", "q", "w", 1, "available", ending="worker_death",
              reported=False, started=T0)
    obs.ended(T0 + 4, "r", "s", "q", "w", 1, "available", ending="released", reported=True,
              started=T0)
    obs.ended(T0 + 5, "x", "s", "q", "w", 1, "cancelled", ending="cancelled", reported=True,
              started=None)
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
    # ran): ok and f twice; the wait of the assign.
    assert sum(series.duration.counts) == 3
    assert series.duration.counts[DURATION_BOUNDS.index(0.025)] == 1  # 20 ms
    assert sum(series.wait.counts) == 1 and series.wait.counts[WAIT_BOUNDS.index(0.005)] == 1
    assert abs(series.wait.sum - 0.003) < 1e-6


def test_events_encode_only_what_applies():
    obs = Observer(first_id=7)
    obs.ended(T0 + 1.5, "f", "s", "q", "w", 2, "retryable", ending="failed", reported=True,
              started=T0 + 1, error=error_record("it broke"))
    obs.event(T0, "alert", job=None, worker="w", message=("warning", "disk low"))
    obs.event(T0, "worker_disconnect", worker="w", message="closed")
    (i1, result), (i2, retry), (i3, alert), (i4, bye) = obs.after(6, 10)[1]
    assert parse(encode(i1, result)) == (7, "result", {
        "at": "2027-01-15T08:00:01.500Z", "kind": "result", "job": "f", "spec": "s",
        "queue": "q", "worker": "w", "attempt": 2, "state": "retryable",
        "duration_ms": 500.0, "message": "it broke"})
    assert parse(encode(i2, retry))[2]["message"] == "it broke"
    assert parse(encode(i3, alert)) == (9, "alert", {
        "at": "2027-01-15T08:00:00.000Z", "kind": "alert", "worker": "w",
        "level": "warning", "message": "disk low"})
    assert parse(encode(i4, bye))[2] == {"at": "2027-01-15T08:00:00.000Z",
                                         "kind": "worker_disconnect", "worker": "w",
                                         "message": "closed"}


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
    obs.enqueued([("a", "s", "q", "available")], T0)
    obs.assigned([("a", "s", None, "q", "w", 1, T0)], T0)
    obs.ended(T0, "a", "s", "q", "w", 1, "completed", ending=None, reported=True, started=T0)
    obs.event(T0, "worker_state", worker="w", state="quiet")
    assert len(heard) == 4 and heard == sorted(heard)
    obs.listener = None
    obs.event(T0, "worker_state", worker="w", state="running")
    assert len(heard) == 4 and obs.latest == T0
