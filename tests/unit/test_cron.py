"""Cron expressions and their fire times (rota/core/cron.py), on fake times."""

from __future__ import annotations

import time
from datetime import datetime

import pytest

from rota.base.errors import Invalid
from rota.core import cron

UTC = cron.zone()


def at(text: str, tz=UTC) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=tz).timestamp()


def fires(expression: str, after: str, count: int = 3, tz_name: str = "UTC") -> list[str]:
    """The next fire times as local ISO times with their offsets."""
    tz = cron.zone(tz_name)
    return [datetime.fromtimestamp(t, tz).isoformat()
            for t in cron.next_fires(cron.parse(expression), tz, at(after, tz), count)]


@pytest.mark.parametrize(("expression", "after", "expected"), [
    ("* * * * *", "2026-01-01T00:00:00",
     ["2026-01-01T00:01:00", "2026-01-01T00:02:00", "2026-01-01T00:03:00"]),
    ("*/15 * * * *", "2026-01-01T00:07:00",
     ["2026-01-01T00:15:00", "2026-01-01T00:30:00", "2026-01-01T00:45:00"]),
    ("1,15 3 * * *", "2026-01-01T03:01:00",
     ["2026-01-01T03:15:00", "2026-01-02T03:01:00", "2026-01-02T03:15:00"]),
    ("10-40/15 9 * * *", "2026-01-01T00:00:00",
     ["2026-01-01T09:10:00", "2026-01-01T09:25:00", "2026-01-01T09:40:00"]),
    ("50/5 0 * * *", "2026-01-01T00:00:00",
     ["2026-01-01T00:50:00", "2026-01-01T00:55:00", "2026-01-02T00:50:00"]),
    ("*/20 * * * * *", "2026-01-01T00:00:30",
     ["2026-01-01T00:00:40", "2026-01-01T00:01:00", "2026-01-01T00:01:20"]),
    ("0 12 * feb-Mar *", "2026-01-15T00:00:00",
     ["2026-02-01T12:00:00", "2026-02-02T12:00:00", "2026-02-03T12:00:00"]),
    ("0 9 * * MON-fri", "2026-01-02T10:00:00",  # a Friday
     ["2026-01-05T09:00:00", "2026-01-06T09:00:00", "2026-01-07T09:00:00"]),
    ("0 0 * * 7", "2026-01-01T00:00:00",
     ["2026-01-04T00:00:00", "2026-01-11T00:00:00", "2026-01-18T00:00:00"]),
    ("0 0 * * 0", "2026-01-01T00:00:00",
     ["2026-01-04T00:00:00", "2026-01-11T00:00:00", "2026-01-18T00:00:00"]),
    ("0 0 L * *", "2026-01-01T00:00:00",
     ["2026-01-31T00:00:00", "2026-02-28T00:00:00", "2026-03-31T00:00:00"]),
    # the 15th of Feb 2026 is a Sunday, of Mar a Sunday, of Aug a Saturday
    ("0 0 15W 2,3,8 *", "2026-01-01T00:00:00",
     ["2026-02-16T00:00:00", "2026-03-16T00:00:00", "2026-08-14T00:00:00"]),
    ("0 0 1W 8 *", "2026-01-01T00:00:00",  # Sat 1 Aug: not back into July
     ["2026-08-03T00:00:00", "2027-08-02T00:00:00", "2028-08-01T00:00:00"]),
    ("0 0 LW 1 *", "2026-01-01T00:00:00",  # Sat 31 Jan 2026
     ["2026-01-30T00:00:00", "2027-01-29T00:00:00", "2028-01-31T00:00:00"]),
    ("0 0 * * 5L", "2026-01-01T00:00:00",
     ["2026-01-30T00:00:00", "2026-02-27T00:00:00", "2026-03-27T00:00:00"]),
    ("0 0 * * FRI#3", "2026-01-01T00:00:00",
     ["2026-01-16T00:00:00", "2026-02-20T00:00:00", "2026-03-20T00:00:00"]),
    # both day fields restricted: the 13th OR any Friday
    ("0 0 13 * 5", "2026-02-01T00:00:00",
     ["2026-02-06T00:00:00", "2026-02-13T00:00:00", "2026-02-20T00:00:00"]),
    ("0 0 29 2 *", "2026-01-01T00:00:00",
     ["2028-02-29T00:00:00", "2032-02-29T00:00:00", "2036-02-29T00:00:00"]),
    ("0 0 31 * *", "2026-01-31T00:00:00",
     ["2026-03-31T00:00:00", "2026-05-31T00:00:00", "2026-07-31T00:00:00"]),
])
def test_syntax(expression, after, expected):
    assert fires(expression, after) == [e + "+00:00" for e in expected]


def refusal(function, argument: str) -> tuple[str, str]:
    with pytest.raises(Invalid) as caught:
        function(argument)
    return caught.value.code, caught.value.message


@pytest.mark.parametrize(("alias", "expected"), [
    ("@yearly", ["2027-01-01T00:00:00", "2028-01-01T00:00:00"]),
    ("@annually", ["2027-01-01T00:00:00", "2028-01-01T00:00:00"]),
    ("@monthly", ["2026-06-01T00:00:00", "2026-07-01T00:00:00"]),
    ("@weekly", ["2026-05-17T00:00:00", "2026-05-24T00:00:00"]),
    ("@daily", ["2026-05-15T00:00:00", "2026-05-16T00:00:00"]),
    ("@MIDNIGHT", ["2026-05-15T00:00:00", "2026-05-16T00:00:00"]),
    ("@hourly", ["2026-05-14T13:00:00", "2026-05-14T14:00:00"]),
])
def test_aliases(alias, expected):
    assert fires(alias, "2026-05-14T12:00:00", 2) == [e + "+00:00" for e in expected]


def test_every_counts_from_its_anchor():
    schedule = cron.parse("@every 1h30m")
    assert schedule.every == 5400
    anchor = at("2026-01-01T00:10:00")
    assert cron.next_fires(schedule, UTC, at("2026-01-01T04:00:00"), 2, anchor) == [
        anchor + 3 * 5400, anchor + 4 * 5400]
    # the anchor itself is the last fire, never the next
    assert cron.next_fires(schedule, UTC, anchor, 1, anchor) == [anchor + 5400]
    assert cron.next_fires(cron.parse("@every 500ms"), UTC, 100.0, 3, 99.9) == pytest.approx(
        [100.4, 100.9, 101.4])
    assert cron.parse("@every 2h45m30s").every == 9930
    assert cron.next_fires(cron.parse("@every 45s"), UTC, 1000.0, 1) == [1045.0]


def test_spring_forward_skips_the_missing_time():
    # 2026-03-08: 02:00 becomes 03:00 in New York
    assert fires("30 2 * * *", "2026-03-07T12:00:00", 3, "America/New_York") == [
        "2026-03-09T02:30:00-04:00", "2026-03-10T02:30:00-04:00", "2026-03-11T02:30:00-04:00"]
    assert fires("0 * * * *", "2026-03-08T00:30:00", 3, "America/New_York") == [
        "2026-03-08T01:00:00-05:00", "2026-03-08T03:00:00-04:00", "2026-03-08T04:00:00-04:00"]


def test_fall_back_fires_once_at_the_first_time():
    # 2026-11-01: 02:00 EDT becomes 01:00 EST in New York
    assert fires("30 1 * * *", "2026-10-31T12:00:00", 3, "America/New_York") == [
        "2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00", "2026-11-03T01:30:00-05:00"]
    tz = cron.zone("America/New_York")
    second_pass = at("2026-11-01T01:10:00", tz) + 3600  # 01:10 EST, after the first 01:30
    first = cron.next_fires(cron.parse("30 1 * * *"), tz, second_pass, 1)
    assert datetime.fromtimestamp(first[0], tz).isoformat() == "2026-11-02T01:30:00-05:00"
    # Europe/Berlin: 2026-10-25 03:00 CEST becomes 02:00 CET
    assert fires("15 2 * * *", "2026-10-24T12:00:00", 2, "Europe/Berlin") == [
        "2026-10-25T02:15:00+02:00", "2026-10-26T02:15:00+01:00"]
    assert fires("15 2 * * *", "2026-03-28T12:00:00", 2, "Europe/Berlin") == [
        "2026-03-30T02:15:00+02:00", "2026-03-31T02:15:00+02:00"]


def test_a_half_hour_zone():
    assert fires("0 9 * * *", "2026-01-01T00:00:00", 1, "Asia/Kolkata") == [
        "2026-01-01T09:00:00+05:30"]
    tz = cron.zone("Asia/Kolkata")
    assert cron.next_fires(cron.parse("0 9 * * *"), tz, at("2026-01-01T00:00:00"), 1) == [
        at("2026-01-01T03:30:00")]


def test_the_rarest_day_keeps_firing():
    # a fifth Friday in February: leap years whose February starts on a Friday
    assert fires("0 0 * 2 FRI#5", "2027-01-01T00:00:00", 3) == [
        "2036-02-29T00:00:00+00:00", "2064-02-29T00:00:00+00:00", "2092-02-29T00:00:00+00:00"]


def test_a_rare_fire_is_found_without_scanning_minutes():
    schedule = cron.parse("0 0 29 2 *")
    started = time.perf_counter()
    for _ in range(100):
        result = cron.next_fires(schedule, UTC, at("2027-03-01T00:00:00"), 1)
    assert (time.perf_counter() - started) / 100 < 0.005
    assert result == [at("2028-02-29T00:00:00")]


@pytest.mark.parametrize(("expression", "message"), [
    ("", "the cron expression is empty"),
    ("   ", "the cron expression is empty"),
    ("* * * *", "5 or 6 fields expected, got 4"),
    ("* * * * * * *", "5 or 6 fields expected, got 7"),
    ("60 * * * *", "minute 60 is out of range 0-59"),
    ("* 24 * * *", "hour 24 is out of range 0-23"),
    ("* * 32 * *", "day of month 32 is out of range 1-31"),
    ("* * 0 * *", "day of month 0 is out of range 1-31"),
    ("* * * 13 *", "month 13 is out of range 1-12"),
    ("* * * * 8", "day of week 8 is out of range 0-7"),
    ("60 * * * * *", "second 60 is out of range 0-59"),
    ("*/0 * * * *", "step 0 in '*/0' (minute)"),
    ("*/x * * * *", "step 'x' in '*/x' (minute) is not a number"),
    ("30-10 * * * *", "range '30-10' in '30-10' (minute) runs backwards"),
    ("1,,2 * * * *", "empty list item in '1,,2' (minute)"),
    ("* * * FOO *", "month value 'FOO' in 'FOO' is not a number or a name"),
    ("* * * * 5#6", "occurrence '6' in '5#6' (day of week) is not 1-5"),
    ("0 0 30 2 *", "day of month 30 never occurs in month 2; the schedule would never fire"),
    ("0 0 31 2,APR *",
     "day of month 31 never occurs in months 2,4; the schedule would never fire"),
    ("1- * * * *", "minute value '' in '1-' is not a number"),
    ("* * * * 1-5W", "day of week value '5W' in '1-5W' is not a number or a name"),
    ("@fortnightly", "unknown cron alias '@fortnightly'; known: @yearly, @annually, @monthly,"
                     " @weekly, @daily, @midnight, @hourly, @every"),
    ("@every", "@every needs a duration, e.g. '@every 90s'"),
    ("@every 0s", "duration '0s' in '@every 0s' must be more than zero"),
    ("@every 10", "duration '10' in '@every 10' is not like 1h30m, 45s or 2m"),
    ("@everyday", "unknown cron alias '@everyday'; known: @yearly, @annually, @monthly,"
                  " @weekly, @daily, @midnight, @hourly, @every"),
    ("\u00b2 * * * *", "minute value '\u00b2' in '\u00b2' is not a number"),
    ("*/\u00b2 * * * *", "step '\u00b2' in '*/\u00b2' (minute) is not a number"),
    ("* * * * 5#\u00b2", "occurrence '\u00b2' in '5#\u00b2' (day of week) is not 1-5"),
    ("@every 1d", "duration '1d' in '@every 1d' is not like 1h30m, 45s or 2m"),
    ("@every \u0661\u0660s", "duration '\u0661\u0660s' in '@every \u0661\u0660s' is not like"
                              " 1h30m, 45s or 2m"),
    ("@every 1000000000h", "duration '1000000000h' in '@every 1000000000h' is over a year;"
                           " the longest is '@every 8760h' (a yearly time is '@yearly')"),
    ("@every 8760h1s", "duration '8760h1s' in '@every 8760h1s' is over a year; the longest"
                       " is '@every 8760h' (a yearly time is '@yearly')"),
])
def test_refused_expressions(expression, message):
    assert refusal(cron.parse, expression) == ("invalid_cron", message)


def test_an_interval_of_hundreds_of_digits_is_refused_not_infinite():
    code, message = refusal(cron.parse, "@every " + "9" * 400 + "s")
    assert code == "invalid_cron" and message.endswith("is over a year; the longest is"
                                                       " '@every 8760h' (a yearly time is '@yearly')")
    assert cron.parse("@every 8760h").every == 365 * 86400
    assert cron.parse("@every 1.1m").every == 66  # exactly: no float crumbs


@pytest.mark.parametrize(("name", "fragment"), [
    ("+05:00", "time zone '+05:00' is a fixed offset"),
    ("UTC+5", "time zone 'UTC+5' is a fixed offset"),
    ("Etc/GMT+5", "time zone 'Etc/GMT+5' is a fixed offset"),
    ("EST", "time zone 'EST' is not an IANA Region/City name"),
    ("Mars/Olympus_Mons", "unknown time zone 'Mars/Olympus_Mons'"),
    ("../etc/passwd", "unknown time zone '../etc/passwd'"),
])
def test_refused_zones(name, fragment):
    code, message = refusal(cron.zone, name)
    assert code == "invalid_timezone"
    assert message.startswith(fragment)


def test_zone_defaults_to_utc():
    assert cron.zone().key == "UTC"
    assert cron.zone(None).key == "UTC"
    assert cron.zone("Asia/Kolkata").key == "Asia/Kolkata"


def test_day_fields_left_open():
    # '?' leaves a day field open; '*/2' is not 'restricted' (Vixie), so both must match
    assert fires("0 0 ? * MON", "2026-01-01T00:00:00", 2) == [
        "2026-01-05T00:00:00+00:00", "2026-01-12T00:00:00+00:00"]
    assert fires("0 0 */2 * MON", "2026-01-01T00:00:00", 2) == [
        "2026-01-05T00:00:00+00:00", "2026-01-19T00:00:00+00:00"]
    assert cron.next_fires(cron.parse("@daily"), UTC, 0.0, 0) == []


def brute_force(schedule: cron.Schedule, tz, after: float, end: float) -> list[float]:
    """The definition, checked second by second of each minute: an instant fires when its
    wall-clock time matches and is that time's first occurrence (fold 0)."""
    found = []
    instant = int(after) + 1
    while instant < end:
        wall = datetime.fromtimestamp(instant, tz)
        if (wall.fold == 0 and wall.second in schedule.seconds
                and wall.minute in schedule.minutes and wall.hour in schedule.hours
                and schedule.day_matches(wall.date())):
            found.append(float(instant))
        instant += 1 if len(schedule.seconds) > 1 else 60 - wall.second
    return found


@pytest.mark.parametrize(("tz_name", "around"), [
    ("America/New_York", "2026-03-08T00:00:00"), ("America/New_York", "2026-11-01T00:00:00"),
    ("Europe/Berlin", "2026-03-29T00:00:00"), ("Europe/Berlin", "2026-10-25T00:00:00"),
    ("Australia/Lord_Howe", "2026-04-05T00:00:00"),  # a half-hour shift
    ("Australia/Lord_Howe", "2026-10-04T00:00:00"),
])
@pytest.mark.parametrize("expression", ["*/7 * * * *", "0,30 1-3 * * *", "*/20 59 1 * * *"])
def test_agrees_with_the_definition_across_dst(tz_name, around, expression):
    tz = cron.zone(tz_name)
    schedule = cron.parse(expression)
    after = at(around, tz) - 3600
    expected = brute_force(schedule, tz, after, after + 2 * 86400)
    assert cron.next_fires(schedule, tz, after, len(expected)) == expected
