"""How an attempt ends, and what a worker's status says about the jobs it holds. Pure.

The engine asks these functions; they change the job in memory and return the
``Change`` to commit, or the notes to store, and never touch anything else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import msgspec

from rota.base import protocol as p
from rota.core.jobs import error_record
from rota.core.model import TERMINAL_STATES, Change, Instant, JobRecord, JobState, StatusNote
from rota.core.policy import FAILING, Ending, after_attempt
from rota.core.registry import ALERT_LINES, ConnectedWorker, short

log = logging.getLogger("rota.server")
# Error types a worker may report that say the attempt ended for an outside reason, not
# because the job failed: they do not count toward max_fails and do not back off.
OUTSIDE_ENDINGS: dict[str, Ending] = {"visibility_timeout": "visibility_timeout",
                                      "shutdown": "shutdown", "cancelled": "cancelled",
                                      "released": "released"}
MAX_LOG_LINES = 1000  # captured log lines kept per job (per server run); later ones dropped
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}


def held_by(jobs: dict[str, JobRecord], connection: ConnectedWorker, job_id: str
            ) -> JobRecord | None:
    """The job, if this connection's worker holds it now."""
    job = jobs.get(job_id)
    if (job is None or job.worker_id != connection.worker.id
            or job.state != JobState.ACTIVE or job.orphaned):
        return None
    return job


def result_problem(jobs: dict[str, JobRecord], worker_id: str, result: p.Result) -> str | None:
    """Why a result cannot be accepted from this worker; None if it can."""
    job = jobs.get(result.job_id)
    if job is None or job.state in TERMINAL_STATES:  # (or its result is being stored)
        return "unknown job, or it already finished"
    if job.worker_id != worker_id or job.state != JobState.ACTIVE or job.orphaned:
        return "job is not reserved by this worker"
    if job.attempt != result.attempt:
        return f"attempt {result.attempt} is not the current attempt {job.attempt}"
    return None


def settle(job: JobRecord, result: p.Result, now: Instant, *, max_result_bytes: int,
           rand: Callable[[], float]) -> Change:
    """Decide an accepted result's outcome; the job stays put in the scheduler until
    the change is committed."""
    if result.outcome == "completed":
        encoded = msgspec.json.encode(result.result)
        if len(encoded) <= max_result_bytes:
            job.move(JobState.COMPLETED)
            job.deaths = 0  # deaths in a row: a completion ends the row (protocol §8)
            return Change(job, result=encoded, finished_at=now.wall)
        # Running it again would only make the same result: fail it for good.
        result = p.Result(job_id=job.id, attempt=result.attempt, outcome="failed",
                          error=p.ErrorInfo(type="result_too_large", retryable=False,
                                            message=f"the result is {len(encoded)} bytes as"
                                            f" JSON; the limit (max_result_bytes) is"
                                            f" {max_result_bytes}"))
    error = result.error or p.ErrorInfo(type="error", message="the worker gave no error")
    return end_attempt(job, OUTSIDE_ENDINGS.get(error.type, "failed"), error, now, rand)


def end_attempt(job: JobRecord, ending: Ending, error: p.ErrorInfo, now: Instant,
                rand: Callable[[], float], *, death: bool = True) -> Change:
    """Apply the retry policy to an attempt that did not complete. A ``worker_death``
    counts toward the job's poison tally when ``death`` says its worker really died;
    any other ending sets the tally back to 0."""
    job.started = False  # (the next attempt starts unstarted)
    if ending in FAILING:
        job.fails += 1
    if ending == "released":
        # Given back unstarted from a worker's prefetch line: the job did nothing, so this
        # lease uses none of its budget and says nothing of its poison tally.
        job.budget_start += 1
    elif ending != "worker_death":
        job.deaths = 0
    elif death:
        job.deaths += 1
    decision = after_attempt(
        ending=ending, retryable=error.retryable, attempts_used=job.attempt - job.budget_start,
        fails=job.fails, limits=job.limits, expires_at=job.expires_at,
        cancel_requested=job.cancel_requested, now=now.wall, rand=rand(), deaths=job.deaths,
        error_names=(error.type, error.code))
    if decision.run_at is not None and isinstance(error.details, dict):
        # The failure said when to come back (an endpoint's Retry-After): never sooner.
        asked = error.details.get("retry_after")
        if isinstance(asked, (int, float)) and not isinstance(asked, bool) and 0 < asked <= 3600:
            decision = replace(decision, run_at=max(decision.run_at, now.wall + asked))
    if decision.reason.startswith("poison"):
        error = p.ErrorInfo(type="poison", retryable=False, message=f"{error.message};"
                            f" {decision.reason}", details=error.details)
        log.error("poison job=%s spec=%s@%s queue=%s worker=%s attempt=%d deaths=%d:"
                  " discarded", job.id, job.spec, short(job.checksum), job.queue,
                  job.worker_id, job.attempt, job.deaths)
    record = error_record(error, attempt=job.attempt, worker_id=job.worker_id, now=now.wall,
                          retry_in=None if decision.run_at is None else decision.run_at - now.wall)
    job.move(JobState(decision.state))
    job.run_at = decision.run_at
    job.due = None if decision.run_at is None else now.deadline(decision.run_at)
    log.info("attempt ended job=%s spec=%s@%s queue=%s worker=%s attempt=%d ending=%s"
             " next=%s duration_ms=%s%s", job.id, job.spec, short(job.checksum), job.queue,
             job.worker_id, job.attempt, ending, decision.state, job.took_ms(now.wall),
             f" reason={decision.reason!r}" if decision.reason else "")
    terminal = decision.state in TERMINAL_STATES
    return Change(job, error=record, finished_at=now.wall if terminal else None, ending=ending,
                  dead_letter=decision.dead_letter)


def status_notes(jobs: dict[str, JobRecord], connection: ConnectedWorker, status: p.Status,
                 now: Instant) -> list[StatusNote]:
    """Progress and captured lines of jobs this worker holds, to store; alerts are
    logged and kept on the connection for GET /workers."""
    notes: list[StatusNote] = []
    for item in status.progress:
        if (job := held_by(jobs, connection, item.job_id)) is not None:
            notes.append(StatusNote(job.id, job.attempt, now.wall, progress=(
                item.percent, None if item.message is None else p.cut_text(item.message))))
    for line in status.logs:
        job = held_by(jobs, connection, line.job_id)
        if job is not None and job.capture_logs and job.log_lines < MAX_LOG_LINES:
            job.log_lines += 1
            notes.append(StatusNote(job.id, job.attempt, now.wall,
                                    line=("log", line.level, p.cut_text(line.message))))
    for alert in status.alerts:
        job = held_by(jobs, connection, alert.job_id) if alert.job_id else None
        if connection.may_log_alert(now.mono):
            if connection.alerts_unlogged:
                log.warning("alerts worker=%s: %d not logged (over %g a second; the latest"
                            " are kept for GET /workers)", connection.worker.id,
                            connection.alerts_unlogged, ALERT_LINES)
                connection.alerts_unlogged = 0
            # %r: the worker's text is quoted and escaped, so it cannot forge log lines
            log.log(LEVELS[alert.level], "alert worker=%s job=%s level=%s message=%r",
                    connection.worker.id, alert.job_id or "-", alert.level, alert.message[:200])
        connection.alert({"at": p.rfc3339(now.wall), "level": alert.level,
                          "job_id": alert.job_id, "message": p.cut_text(alert.message)})
        if job is not None:
            notes.append(StatusNote(job.id, job.attempt, now.wall,
                                    line=("alert", alert.level, p.cut_text(alert.message))))
    return notes
