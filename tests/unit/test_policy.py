"""The pure retry policy: backoff, limits, and where an unfinished attempt sends a job."""

from __future__ import annotations

import msgspec
import pytest

from rota.base import protocol as p
from rota.core.attempts import end_attempt
from rota.core.model import Instant, JobRecord, JobState
from rota.base.ojs import OjsExtras, OjsPolicy
from rota.core.policy import Limits, after_attempt, backoff, non_retryable, ojs_limits

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


# -- the OJS retry policy's options (rota/core/model.py Limits; docs/ojs.md) -------------
def test_linear_backoff_grows_by_the_base_each_failure():
    linear = Limits(max_attempts=5, max_fails=None, backoff_base=1.0, backoff_max=30.0,
                    linear=True, jitter="none")
    assert [backoff(n, linear, rand=0.9) for n in (1, 2, 3)] == [1.0, 2.0, 3.0]


def test_coefficient_sets_the_growth_and_the_cap_still_holds():
    limits = Limits(max_attempts=9, max_fails=None, backoff_base=1.0, backoff_max=2.0,
                    coefficient=10.0, jitter="none")
    assert [backoff(n, limits, rand=0.5) for n in (1, 2, 3, 5000)] == [1.0, 2.0, 2.0, 2.0]
    constant = Limits(max_attempts=9, max_fails=None, backoff_base=1.0, backoff_max=300.0,
                      coefficient=1.0, jitter="none")
    assert {backoff(n, constant, rand=0.1) for n in range(1, 6)} == {1.0}


def test_ojs_jitter_spreads_over_half_to_one_and_a_half_capped_again():
    limits = Limits(max_attempts=3, max_fails=None, backoff_base=2.0, backoff_max=300.0,
                    coefficient=1.0, jitter="ojs")
    assert backoff(1, limits, rand=0.0) == 1.0
    assert backoff(1, limits, rand=0.999) == pytest.approx(2.998)
    capped = Limits(max_attempts=3, max_fails=None, backoff_base=2.0, backoff_max=2.0,
                    jitter="ojs")
    assert backoff(1, capped, rand=0.999) == 2.0


def test_rota_defaults_are_unchanged():
    assert (LIMITS.coefficient, LIMITS.linear, LIMITS.jitter, LIMITS.non_retryable,
            LIMITS.dead_letter) == (2.0, False, "rota", (), False)
    assert decide(fails=1).dead_letter is False


@pytest.mark.parametrize(("names", "discarded"), [
    (("Auth.TokenExpired", "handler_error"), True), (("AuthenticationError", None), False),
    (("Auth", None), False), (("handler_error", "FatalError"), True),
    (("ConnectionError", "handler_error"), False), (("xAuth.x", None), False),
    (("FatalErrors", None), False)])
def test_non_retryable_entries_match_exactly_or_by_their_prefix(names, discarded):
    """ojs-retry §6.2: exact, or ``X.*`` for every name starting ``X.``."""
    limits = Limits(max_attempts=5, max_fails=None, backoff_base=1.0, backoff_max=30.0,
                    non_retryable=("Auth.*", "FatalError"))
    decision = decide(limits=limits, error_names=names)
    assert (decision.state == "discarded") is discarded
    if discarded:
        assert "non_retryable" in decision.reason


def test_an_entry_is_never_a_regular_expression():
    """A pattern that would backtrack for ages as a regex is a plain string here."""
    limits = Limits(1, None, 1.0, 1.0, non_retryable=("(a+)+$", "(", "a.*"))
    assert non_retryable(limits, ("a" * 40 + "!",)) is None
    assert non_retryable(limits, ("(",)) == "("
    assert non_retryable(limits, ("a.b",)) == "a.b"


def test_a_discard_by_failure_goes_to_the_dead_letter_when_asked():
    limits = Limits(max_attempts=2, max_fails=None, backoff_base=1.0, backoff_max=30.0,
                    dead_letter=True)
    exhausted = decide(limits=limits, attempts_used=2)
    assert exhausted.state == "discarded" and exhausted.dead_letter
    assert decide(limits=limits, retryable=False).dead_letter
    assert decide(limits=limits).state == "retryable"
    assert not decide(limits=limits, attempts_used=2, expires_at=NOW).dead_letter  # expired


def test_a_timeout_fails_the_attempt_with_a_backoff():
    decision = decide(ending="timeout", rand=0.0, fails=1)
    assert decision.state == "retryable" and decision.run_at == NOW + 1.0


def test_an_ended_attempt_records_code_and_backoff_and_marks_the_dead_letter():
    limits = Limits(max_attempts=2, max_fails=None, backoff_base=1.0, backoff_max=30.0,
                    jitter="none", dead_letter=True)
    job = JobRecord(id="j1", spec="s", queue="q", args=msgspec.Raw(b"{}"), priority=0,
                    enqueued_at=0.0, seq=1, limits=limits, state=JobState.ACTIVE, attempt=1)
    error = p.ErrorInfo(type="ConnectionError", message="no", code="handler_error")
    first = end_attempt(job, "failed", error, Instant(5.0, NOW), lambda: 0.5)
    record = msgspec.json.decode(first.error)
    assert (record["code"], record["retry_in"], first.dead_letter) == ("handler_error", 1.0, False)
    job.move(JobState.AVAILABLE)
    job.move(JobState.ACTIVE)
    job.attempt = 2
    last = end_attempt(job, "failed", error, Instant(6.0, NOW), lambda: 0.5)
    assert job.state == "discarded" and last.dead_letter
    assert "retry_in" not in msgspec.json.decode(last.error)


def test_an_ojs_job_takes_its_policy_and_ojs_jitter_and_a_rota_job_keeps_its_limits():
    assert ojs_limits(LIMITS, None) is LIMITS
    plain = ojs_limits(LIMITS, OjsExtras())  # an OJS job with no retry option
    assert (plain.jitter, plain.backoff_base, plain.max_attempts) == ("ojs", 2.0, 5)
    policy = OjsPolicy(backoff_base=1.0, backoff_max=30.0, coefficient=1.0, linear=True,
                       jitter="none", non_retryable=("Auth.*",), dead_letter=True)
    limits = ojs_limits(LIMITS, OjsExtras(policy=policy))
    assert (limits.backoff_base, limits.backoff_max, limits.coefficient, limits.linear,
            limits.jitter, limits.non_retryable, limits.dead_letter) == (
        1.0, 30.0, 1.0, True, "none", ("Auth.*",), True)
    assert ojs_limits(limits, OjsExtras(policy=policy)) is limits  # loaded again: the same
