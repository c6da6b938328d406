"""The cron planner (rota/core/schedules.py) on a fake clock: fire times across DST in two
zones, the misfire grace and policies, the overlap verdicts, jitter, tick ids and the
refusals of bad definitions."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from rota.base.errors import Invalid
from rota.core import cron
from rota.core.schedules import (SCAN, Timing, check, due, grace, jitter_offset, next_fires,
                                 overlap, tick_id)


def timing(expression: str, zone: str = "UTC", misfire: str = "catch_up", catch_up: int = 1,
           anchor: float = 0.0) -> Timing:
    return Timing.of(check({"name": "s", "spec": "x", "cron": expression, "timezone": zone,
                            "misfire": misfire, "catch_up": catch_up}), anchor)


def at(text: str, zone: str = "UTC") -> float:
    return datetime.fromisoformat(text).replace(tzinfo=cron.zone(zone)).timestamp()


def local(stamps, zone: str) -> list[str]:
    tz = cron.zone(zone)
    return [datetime.fromtimestamp(t, tz).isoformat() for t in stamps]


def run_clock(plan: Timing, start: float, end: float, step: float) -> list[float]:
    """A loop that looks every ``step`` seconds from ``start`` to ``end``: what it fires."""
    fired, last, now = [], start, start
    while now <= end:
        decided = due(plan, last, now)
        fired += decided.fire
        last = decided.last if decided.last is not None else last
        now += step
    return fired


# -- DST (ojs-cron §5.2) in two zones ---------------------------------------------------------
@pytest.mark.parametrize(("zone", "expression", "after", "expected"), [
    # New York springs forward on 8 March 2026 (02:00 -> 03:00): 02:30 does not exist
    ("America/New_York", "30 2 * * *", "2026-03-07T00:00:00",
     ["2026-03-07T02:30:00-05:00", "2026-03-09T02:30:00-04:00"]),
    # ... and falls back on 1 November (02:00 -> 01:00): 01:30 happens twice, fires once
    ("America/New_York", "30 1 * * *", "2026-10-31T12:00:00",
     ["2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"]),
    # Berlin springs forward on 29 March 2026, falls back on 25 October (03:00 -> 02:00)
    ("Europe/Berlin", "30 2 * * *", "2026-03-28T12:00:00",
     ["2026-03-30T02:30:00+02:00", "2026-03-31T02:30:00+02:00"]),
    ("Europe/Berlin", "30 2 * * *", "2026-10-24T12:00:00",
     ["2026-10-25T02:30:00+02:00", "2026-10-26T02:30:00+01:00"]),
    # hourly across a spring-forward: one fire per real hour, none lost, none doubled
    ("America/New_York", "0 * * * *", "2026-03-08T00:30:00",
     ["2026-03-08T01:00:00-05:00", "2026-03-08T03:00:00-04:00"]),
    # hourly across a fall-back: the repeated hour fires once, so one real hour fires
    # nothing (New York: 05:00Z, then 07:00Z; Berlin: 00:00Z, then 02:00Z)
    ("America/New_York", "0 * * * *", "2026-11-01T00:30:00",
     ["2026-11-01T01:00:00-04:00", "2026-11-01T02:00:00-05:00"]),
    ("Europe/Berlin", "0 * * * *", "2026-10-25T01:30:00",
     ["2026-10-25T02:00:00+02:00", "2026-10-25T03:00:00+01:00"]),
])
def test_fire_times_across_dst(zone, expression, after, expected):
    assert local(next_fires(timing(expression, zone), at(after, zone), 2), zone) == expected


@pytest.mark.parametrize(("zone", "day"), [("America/New_York", "2026-11-01"),
                                           ("Europe/Berlin", "2026-10-25")])
def test_a_loop_through_the_repeated_hour_fires_each_time_once(zone, day):
    """Every 15 minutes, watched every 20 s across the fall-back night: each wall time
    fires once (the repeated ones at their first occurrence), never twice."""
    plan = timing("*/15 * * * *", zone)
    start = at(f"{day}T00:00:00", zone)
    fired = run_clock(plan, start, start + 5 * 3600, 20.0)
    walls = [datetime.fromtimestamp(t, cron.zone(zone)).strftime("%H:%M") for t in fired]
    assert len(walls) == len(set(walls))  # no wall time twice
    assert fired == sorted(set(fired))
    # 5 real hours, one of them the repeated hour, which fires nothing the second time
    assert len(fired) == 4 * 4


def test_a_loop_across_spring_forward_never_fires_a_missing_time():
    plan = timing("*/30 * * * *", "America/New_York")
    start = at("2026-03-08T00:00:00", "America/New_York")
    fired = run_clock(plan, start, start + 4 * 3600, 30.0)
    assert local(fired, "America/New_York") == [
        "2026-03-08T00:30:00-05:00", "2026-03-08T01:00:00-05:00", "2026-03-08T01:30:00-05:00",
        "2026-03-08T03:00:00-04:00", "2026-03-08T03:30:00-04:00", "2026-03-08T04:00:00-04:00",
        "2026-03-08T04:30:00-04:00", "2026-03-08T05:00:00-04:00"]


# -- misfires ---------------------------------------------------------------------------------
def test_grace_is_a_tenth_of_the_interval_within_one_second_and_a_minute():
    assert [grace(i) for i in (1, 5, 60, 300, 3600, 86400)] == [1, 1, 6, 30, 60, 60]


@pytest.mark.parametrize(("misfire", "catch_up", "now", "fire", "passed"), [
    ("catch_up", 1, 600.5, (540.0, 600.0), 8),
    ("catch_up", 3, 600.5, (420.0, 480.0, 540.0, 600.0), 6),
    ("catch_up", 100, 600.5, tuple(60.0 * k for k in range(1, 11)), 0),
    ("skip", 1, 600.5, (600.0,), 9),
    ("skip", 1, 607.0, (), 10),  # 600 too is past its grace (6 s)
    ("catch_up", 2, 607.0, (540.0, 600.0), 8),
])
def test_misfires_after_downtime(misfire, catch_up, now, fire, passed):
    decided = due(timing("@every 60s", misfire=misfire, catch_up=catch_up), 0.0, now)
    assert decided.fire == fire
    assert decided.passed == passed
    assert decided.missed == (10 if now > 606 else 9)
    assert decided.last == 600.0


def test_nothing_due_before_the_first_tick():
    assert due(timing("@every 60s"), 0.0, 59.9) == due(timing("@every 60s"), 0.0, 0.0)
    assert due(timing("@every 60s"), 0.0, 59.9).last is None


def test_on_time_ticks_fire_under_either_policy():
    for misfire in ("skip", "catch_up"):
        decided = due(timing("* * * * *", misfire=misfire), at("2026-01-01T00:00:30"),
                      at("2026-01-01T00:01:00.5"))
        assert decided.fire == (at("2026-01-01T00:01:00"),)
        assert decided.missed == 0


def test_lateness_counts_from_when_the_loop_meant_to_wake():
    # a per-second schedule reached 3 s late by a loop busy with its last round: the
    # loop meant to wake at its first tick, so none is missed; judged from when the round
    # reached them, two are (the grace is 1 s)
    timed = timing("* * * * * *", misfire="skip")
    busy = due(timed, 100.0, 103.2, reached=101.0)
    assert (busy.fire, busy.missed) == ((101.0, 102.0, 103.0), 0)
    assert due(timed, 100.0, 103.2).missed == 2
    assert due(timed, 100.0, 103.2, reached=200.0) == due(timed, 100.0, 103.2)


def test_a_long_downtime_of_an_every_second_schedule_is_decided_quickly():
    began = time.perf_counter()
    start = at("2026-01-01T00:00:00")
    decided = due(timing("* * * * * *", catch_up=5), start, start + 2 * 86400 + 0.2)
    assert time.perf_counter() - began < 5.0
    assert decided.fire[-1] == start + 2 * 86400  # on time
    assert decided.fire[:5] == tuple(start + 2 * 86400 - k for k in (5, 4, 3, 2, 1))
    assert not decided.counted and decided.missed >= SCAN
    assert decided.last == start + 2 * 86400


def test_every_counts_from_its_anchor():
    plan = timing("@every 90s", anchor=1000.0)
    assert next_fires(plan, 1000.0, 3) == [1090.0, 1180.0, 1270.0]
    assert due(plan, 1090.0, 1180.5).fire == (1180.0,)


# -- overlap ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("policy", "previous", "verdict"), [
    ("skip", None, "fire"), ("skip", "completed", "fire"), ("skip", "discarded", "fire"),
    ("skip", "active", "skip"), ("skip", "available", "skip"), ("skip", "retryable", "skip"),
    ("allow", "active", "fire"), ("allow", None, "fire"),
    ("cancel_previous", "active", "cancel_previous"), ("cancel_previous", "cancelled", "fire"),
    ("enqueue", "active", "pending"), ("enqueue", "pending", "pending"),
    ("enqueue", "completed", "fire"),
])
def test_overlap_verdicts(policy, previous, verdict):
    assert overlap(policy, previous) == verdict


# -- jitter and ids ---------------------------------------------------------------------------
def test_jitter_is_deterministic_and_within_its_bound():
    offsets = [jitter_offset("nightly", 1_800_000_000.0 + 60 * k, 30.0) for k in range(200)]
    assert offsets == [jitter_offset("nightly", 1_800_000_000.0 + 60 * k, 30.0)
                       for k in range(200)]
    assert all(0.0 <= o < 30.0 for o in offsets)
    assert len(set(offsets)) > 150  # spread, not one value
    assert jitter_offset("other", 1_800_000_000.0, 30.0) != offsets[0]
    assert jitter_offset("nightly", 1_800_000_000.0, 0.0) == 0.0


def test_tick_ids_name_the_schedule_and_the_utc_second():
    tick = at("2026-03-08T03:00:00", "America/New_York")
    assert tick_id("report", tick) == "cron-report-20260308T070000Z"
    assert tick_id("report", tick + 0.75) == "cron-report-20260308T070000Z"


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("data", "code", "message"), [
    ({"name": "a", "spec": "x", "cron": "@every 500ms"}, "invalid_cron",
     "schedule 'a': '@every 500ms' fires every 0.5s; a schedule fires at most once a second"
     " ('@every 1s')"),
    ({"name": "a", "spec": "x", "cron": "61 * * * *"}, "invalid_cron",
     "schedule 'a': minute 61 is out of range 0-59"),
    ({"name": "a", "spec": "x", "cron": "@daily", "timezone": "Mars/Base"},
     "invalid_timezone", "schedule 'a': unknown time zone 'Mars/Base'"),
    ({"name": "a", "spec": "x", "cron": "@daily", "timezone": "EST"}, "invalid_timezone",
     "schedule 'a': time zone 'EST' is not an IANA Region/City name such as 'Europe/Berlin'"
     " (or 'UTC')"),
    ({"name": "a", "spec": "x", "cron": "@daily", "overlap": "sometimes"}, "invalid_schedule",
     "overlap must be one of allow, cancel_previous, enqueue, skip, not 'sometimes'"),
    ({"name": "a", "spec": "x", "cron": "@daily", "catch_up": 0}, "invalid_schedule",
     "catch_up must be an integer >= 1"),
    ({"name": "a", "spec": "x", "cron": "@daily", "jitter": 7200}, "invalid_schedule",
     "jitter must be a number <= 3600"),
    ({"name": "a", "spec": "x"}, "invalid_schedule", "cron is required"),
    ({"name": "a b", "spec": "x", "cron": "@daily"}, "invalid_schedule",
     "a schedule's name is 1 to 100 letters, digits and '_.:-', starting with a letter or"
     " digit (its jobs' ids are cron-<name>-<tick>), not 'a b'"),
    ({"name": "a" * 101, "spec": "x", "cron": "@daily"}, "invalid_schedule",
     "a schedule's name is 1 to 100 letters, digits and '_.:-', starting with a letter or"
     " digit (its jobs' ids are cron-<name>-<tick>), not a name of 101 characters"),
    ([1], "invalid_schedule", "a schedule must be an object (a table)"),
    ({"name": "a", "spec": "x", "cron": "@every 1.5s"}, "invalid_cron",
     "schedule 'a': '@every 1.5s' fires every 1.5s; a schedule ticks in whole seconds (its"
     " jobs' ids name the second)"),
    ({"name": "a", "spec": "x", "cron": "0 0\n* * *"}, "invalid_cron",
     "schedule 'a': the expression '0 0\\n* * *' holds '\\n'; separate its fields by spaces"),
])
def test_bad_definitions_are_refused_precisely(data, code, message):
    with pytest.raises(Invalid) as caught:
        check(data)
    assert (caught.value.code, caught.value.message) == (code, message)


def test_spaces_and_newlines_around_an_expression_are_dropped():
    assert check({"name": "a", "spec": "x", "cron": " @every 1.5m\n"}).cron == "@every 1.5m"


def test_the_least_interval_is_one_second():
    assert check({"name": "a", "spec": "x", "cron": "@every 1s"}).cron == "@every 1s"
