"""Webhooks' pure rules (rota/core/webhooks.py): what an answer means, the retry schedule
(ojs-webhooks §7.2) and Retry-After, the rotation window, and which events a
subscription takes."""

from __future__ import annotations

import pytest

from rota.core import webhooks as wh
from rota.core.observe import Filter


@pytest.mark.parametrize(("status", "error", "retryable"), [
    (200, "", False), (204, "", False), (202, "", False),
    (408, "http_408", True), (429, "http_429", True), (500, "http_500", True),
    (503, "http_503", True), (400, "http_400", False), (404, "http_404", False),
    (410, "http_410", False), (301, "http_301: a redirect to another host is not followed", False)])
def test_each_answer_is_done_retried_or_dead(status, error, retryable):
    outcome = wh.answered(status, None, 1.0, "")
    assert (outcome.error, outcome.retryable) == (error, retryable)


def test_the_schedule_its_scale_retry_after_and_the_last_attempt():
    failing = wh.Outcome(None, "connect: refused", True)
    assert wh.next_step(failing, 1, 1000.0) == ("pending", 1030.0)
    assert wh.next_step(failing, 2, 1000.0) == ("pending", 1120.0)
    assert wh.next_step(failing, 7, 1000.0) == ("pending", 1000.0 + 86400.0)
    assert wh.next_step(failing, 8, 1000.0) == ("dead", None)  # 8 attempts, ~41 h
    assert wh.next_step(failing, 1, 1000.0, scale=0.01) == ("pending", 1000.3)
    throttled = wh.Outcome(429, "http_429", True, retry_in=7.0)
    assert wh.next_step(throttled, 1, 1000.0) == ("pending", 1007.0)
    assert wh.next_step(wh.Outcome(400, "http_400"), 1, 1000.0) == ("dead", None)
    assert wh.next_step(wh.Outcome(200), 3, 1000.0) == ("delivered", None)


def test_retry_after_in_seconds_or_a_date_capped_at_an_hour():
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert wh.retry_after("12", now) == 12.0
    assert wh.retry_after("99999", now) == 3600.0
    assert wh.retry_after("Tue, 14 Nov 2023 22:13:50 GMT", now) == 30.0
    assert wh.retry_after("Tue, 14 Nov 2023 22:00:00 GMT", now) == 0.0
    assert wh.retry_after("soon", now) is None and wh.retry_after(None, now) is None


def test_both_secrets_sign_within_the_rotation_window_only():
    sub = wh.Subscription("wh_1", "https://x/h", ("*",), Filter(), "new", "old", 1000.0, True)
    assert sub.secrets(1000.0 + 60) == ["new", "old"]
    assert sub.secrets(1000.0 + wh.ROTATION_WINDOW + 1) == ["new"]


def test_a_subscription_takes_its_kinds_and_filter():
    event = (0.0, "discard", "j1", "mail", None, "default", "w1", 1, "discarded", None, None)
    sub = wh.Subscription("wh_1", "https://x/h", ("discard",), Filter(spec="mail"), "s",
                          None, None, True)
    assert sub.takes(event)
    assert not sub.takes((*event[:1], "result", *event[2:]))
    assert not sub.takes((*event[:3], "other", *event[4:]))
    every = wh.Subscription("wh_2", "https://x/h", ("*",), Filter(), "s", None, None, True)
    assert every.takes(event)
    assert not wh.Subscription("wh_3", "https://x/h", ("*",), Filter(), "s", None, None,
                               False).takes(event)


def test_an_event_the_pump_brings_after_a_subscription_is_followed_is_its_own_whenever():
    """Recorded after the server followed the subscription (``live``), an event is taken
    though its wall time is before the subscription's creation (the clock stepped back
    since); found in the rows (not live), it is judged by its time."""
    event = (1000.0, "enqueue", "j1", "mail", None, "default", None, 0, "available", None,
             None)
    sub = wh.Subscription("wh_1", "https://x/h", ("*",), Filter(), "s", None, None, True,
                          created_at=1000.0 + 7200)
    assert sub.takes(event, live=True)
    assert not sub.takes(event)
    assert not sub.takes((*event[:1], "other", *event[2:]), live=False)


def test_a_failing_receiver_is_left_alone_longer_each_time():
    assert [wh.pause(n, 0.0) for n in (1, 2, 3, 8, 20)] == [30.0, 120.0, 600.0, 86400.0,
                                                          86400.0]
    assert wh.pause(1, 45.0) == 45.0  # a Retry-After further off
    assert wh.pause(2, -1.0, scale=0.01) == 1.2
