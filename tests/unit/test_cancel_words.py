"""How a cancelled run and a retry are said: the client's JobError, the worker's DEBUG line
and rota jobs retry (issue 22)."""

from __future__ import annotations

import logging

import pytest

from rota.base import protocol as p
from rota.base.errors import JobError
from rota.cli.ops import retried
from rota.worker.execution import _log_end


def test_a_job_cancelled_while_it_ran_is_one_sentence():
    stop = {"type": "cancelled", "message": "stopped by the worker: cancelled"}
    assert str(JobError("j1", "cancelled", stop)) == \
        "job j1 was cancelled (stopped by the worker)"
    assert str(JobError("j1", "cancelled", None)) == "job j1 was cancelled"
    failed = {"type": "ValueError", "message": "melted"}  # a discard still names its error
    assert str(JobError("j1", "discarded", failed)) == \
        "job j1 was discarded: ValueError: melted"


@pytest.mark.parametrize(("error", "said"), [
    ("cancelled", "outcome=cancelled duration_ms="),
    ("ValueError", "outcome=failed error=ValueError duration_ms="),
])
def test_the_workers_line_for_a_cancelled_run_says_cancelled(caplog, error: str, said: str):
    copy = p.JobCopy(id="j1", spec="s", checksum="c", queue="q", args={}, attempt=1,
                     priority=0, visibility_timeout=30.0, enqueued_at="2026-01-01T00:00:00Z")
    result = p.Result(job_id="j1", attempt=1, outcome="failed",
                      error=p.ErrorInfo(type=error, message="m"))
    with caplog.at_level(logging.DEBUG, logger="rota.worker"):
        _log_end(copy, result, 0.01, "cancelled" if error == "cancelled" else None)
    assert "job ended job=j1 spec=s queue=q attempt=1 " + said in caplog.text


def test_a_retry_says_what_it_did_even_when_a_worker_took_the_job_at_once():
    """Two retries of a failing job once read "retryable again", then "available again":
    the first answer was read after a worker had taken the job and failed it."""
    job = {"state": "available", "max_attempts": 3, "attempt": 4}
    assert retried("boom", job) == \
        "boom is available again, with a fresh budget of 3 attempt(s) (4 so far in all)"
    assert retried("boom", job | {"state": "retryable"}) == (
        "boom was put back with a fresh budget of 3 attempt(s) (4 so far in all); a worker"
        " took it at once: it is retryable now")
