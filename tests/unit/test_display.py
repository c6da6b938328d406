"""The dashboard's pure pieces: how figures are written, and the throughput chart."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import msgspec
import pytest

from rota.core import display
from rota.core.charts import nice_ceiling, throughput_svg


@pytest.mark.parametrize(("value", "text"), [(None, "–"), (0, "0 B"), (1023, "1023 B"),
                                             (1536, "1.5 KiB"), (5 << 20, "5.0 MiB"),
                                             (3 << 50, "3.0 PiB"),
                                             (2**63 - 1, "8.0 EiB"), (3 << 70, "3072.0 EiB")])
def test_size(value, text):
    assert display.size(value) == text


@pytest.mark.parametrize(("seconds", "text"), [(None, "–"), (0.25, "250 ms"), (3.21, "3.2 s"),
                                               (60, "1 min"), (3725, "1 h 2 min"),
                                               (90000, "1 d 1 h"), (7200, "2 h")])
def test_duration(seconds, text):
    assert display.duration(seconds) == text


def test_ago_and_in():
    assert display.ago("2026-01-01T00:00:10.000Z", 1767225620.0) == "10.0 s ago"
    assert display.ago("2026-01-01T00:01:00.000Z", 1767225600.0) == "in 1 min"
    assert display.ago(None, 0) == "–"


def test_a_moment_that_was_never_reads_as_ahead():
    """A wall clock stepped back after the moment was stored puts it ahead of now."""
    assert display.since("2026-01-01T00:00:10.000Z", 1767225620.0) == "10.0 s ago"
    assert display.since("2026-01-01T02:00:00.000Z", 1767225600.0) == "just now"
    assert display.since(None, 0) == "–"


def test_pretty_takes_stored_json_as_it_is():
    assert display.pretty(msgspec.Raw(b'{"a":[1,2]}')) == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    assert display.pretty("é") == '"é"'
    assert display.short("0123456789abcdef", 4) == "0123…" and display.short(None) == "–"
    assert display.short("01a21208-38b4-71f9-b504-5894784ef97e") == "01a21208…4ef97e"
    assert display.count(1234567) == "1,234,567"


@pytest.mark.parametrize(("value", "top"), [(0, 1), (1, 1), (3, 5), (7, 10), (11, 20),
                                            (999, 1000), (1001, 2000)])
def test_the_axis_ends_on_a_round_figure(value, top):
    assert nice_ceiling(value) == top


def test_the_chart_is_svg_with_a_line_per_series_and_a_title_per_minute():
    labels = [f"10:{m:02d}" for m in range(60)]
    series = {"enqueued": [m % 7 for m in range(60)], "completed": [3] * 60,
              "failed": [0] * 60, "discarded": [1] * 60}
    svg = throughput_svg(labels, series)
    root = ET.fromstring(svg)  # well-formed XML
    ns = {"s": "http://www.w3.org/2000/svg"}
    lines = root.findall("s:polyline", ns)
    assert [line.get("class") for line in lines] == [
        "line enqueued", "line completed", "line failed", "line discarded"]
    assert all(len(line.get("points", "").split()) == 60 for line in lines)
    titles = [t.text for t in root.iter("{http://www.w3.org/2000/svg}title")]
    assert len(titles) == 60
    assert titles[6] == "10:06: enqueued 6, completed 3, failed 0, discarded 1"
    assert re.search(r">10</text>", svg)  # the axis top: 7 rounds up to 10
    assert ">now</text>" in svg


def test_an_empty_chart_still_draws():
    root = ET.fromstring(throughput_svg([], {}))
    assert root.tag.endswith("svg")


def test_attempts_within_the_budget_and_in_all():
    assert display.attempts(2, 2, 3) == "2 of 3"
    assert display.attempts(9, 3, 3) == "3 of 3 (9 in all)"  # after two manual retries
    assert display.attempts(0, 0, None) == "0"


def test_failures_say_which_count_when_the_budget_count_differs():
    assert display.failures(2, 2, retried=False) == "2 failed"
    # max_fails counts since the last retry; the page lists every failed attempt (issue 22)
    assert display.failures(2, 6, retried=True) == "2 failed since the last retry, 6 in all"
    assert display.failures(1, 3, retried=False) == \
        "1 failed, 3 in all with timeouts and worker deaths"


def test_a_lease_given_back_unstarted_is_counted_apart_from_failures():
    """A take-back from a prefetch line read as "Attempts that failed (1)" beside
    "0 failed since the last retry, 1 in all" (a new user's trial, issue 23)."""
    assert display.attempts(2, 1, 3, unstarted=1) == "1 of 3 (2 in all, 1 given back unstarted)"
    assert display.ended_heading(0, 0, 1) == "Attempts given back unstarted (1, not counted)"
    assert display.ended_heading(0, 0, 0) == "Attempts that failed (0)"
    assert display.ended_heading(1, 1, 0) == "Attempts that failed (1) or were cancelled (1)"
    assert display.ended_heading(2, 0, 1) == \
        "Attempts that failed (2) or were given back unstarted (1, not counted)"
