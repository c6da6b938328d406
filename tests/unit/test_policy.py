"""The pure retry policy: backoff, limits, and where an unfinished attempt sends a job."""

from __future__ import annotations

import pytest

from rota.core.policy import Limits, after_attempt, backoff

LIMITS = Limits(max_attempts=5, max_fails=3, backoff_base=2.0, backoff_max=30.0)
NOW = 1_000.0


def decide(**overrides):
    options = dict(ending="failed", retryable=True, attempts_used=1, fails=1, limits=LIMITS,
                   expires_at=None, cancel_requested=False, now=NOW, rand=1.0)
    options.update(overrides)
    return after_attempt(**options)


@pytest.mark.parametrize(("failures", "full"), [(1, 2.0), (2, 4.0), (3, 8.0), (4, 16.0),
                                                (5, 30.0), (9, 30.0)])
def test_backoff_doubles_up_to_the_cap_and_jitters_over_the_upper_half(failures, full):
    assert backoff(failures, LIMITS, rand=1.0) == full
    assert backoff(failures, LIMITS, rand=0.0) == full / 2
    assert full / 2 <= backoff(failures, LIMITS, rand=0.37) <= full


def test_a_retryable_failure_waits_for_its_backoff():
    decision = decide(fails=2, rand=0.0)
    assert decision.state == "retryable" and decision.run_at == NOW + 2.0


def test_not_retryable_discards_at_once():
    decision = decide(retryable=False)
    assert decision.state == "discarded" and "not retryable" in decision.reason


def test_max_fails_counts_explicit_failures():
    assert decide(fails=2).state == "retryable"
    decision = decide(fails=3)
    assert decision.state == "discarded" and "max_fails" in decision.reason


@pytest.mark.parametrize("ending", ["visibility_timeout", "worker_death", "shutdown"])
def test_outside_endings_retry_at_once_and_ignore_max_fails(ending):
    decision = decide(ending=ending, fails=3, attempts_used=2)
    assert decision.state == "available" and decision.run_at is None


@pytest.mark.parametrize("ending", ["failed", "visibility_timeout", "worker_death"])
def test_max_attempts_counts_every_attempt(ending):
    decision = decide(ending=ending, attempts_used=5, fails=0)
    assert decision.state == "discarded" and "max_attempts" in decision.reason


def test_no_max_fails_means_only_attempts_limit():
    limits = Limits(max_attempts=5, max_fails=None, backoff_base=1.0, backoff_max=1.0)
    assert decide(limits=limits, fails=4, attempts_used=4).state == "retryable"


def test_an_expired_job_is_discarded_whatever_else_holds():
    decision = decide(ending="worker_death", expires_at=NOW)
    assert decision.state == "discarded" and decision.reason == "expired"
    assert decide(expires_at=NOW + 1).state == "retryable"


def test_a_cancel_request_wins():
    assert decide(cancel_requested=True, ending="worker_death").state == "cancelled"
    assert decide(ending="cancelled", cancel_requested=False).state == "cancelled"
