"""Jobs from enqueue requests: options, defaults from the spec, and the records kept."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

import msgspec

from rota.base import protocol as p
from rota.base.protocol import MAX_COUNT, Priority
from rota.base.errors import Invalid
from rota.base.flow import MAX_LABELS
from rota.base.ojs import OjsExtras
from rota.base.ids import JOB_ID_PATTERN, MAX_JOB_ID, uuid7
from rota.core.model import JobRecord, shared_limits
from rota.core.policy import ojs_limits
from rota.base.specs import MAX_VISIBILITY, JobSpec, Name
from rota.base.unique import UniqueOptions

# The longest wait Rota schedules: a delay, a run_at, a time to live. Past it a request
# is refused rather than kept for years (or, as an overflowing date, never shown).
MAX_AHEAD = 366 * 24 * 3600.0
# The furthest absolute moment (run_at, expires_at) Rota takes: 100 years. OJS clients
# give dates like 2099-12-31 for "never" (docs/ojs.md); relative seconds keep MAX_AHEAD.
MAX_MOMENT = 100 * 365.25 * 24 * 3600.0
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_AHEAD)]
Limit = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
# Checked when the job is built (Intake.build, rota/base/ids.py job_id_problem), not by the
# decoder, so that a refusal names the character and where it is; the schema says the rule.
NewJobId = Annotated[str, msgspec.Meta(extra_json_schema={
    "pattern": JOB_ID_PATTERN, "minLength": 1, "maxLength": MAX_JOB_ID})]


class EnqueueRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    spec: str
    args: dict[str, Any] = {}
    id: NewJobId | None = None
    queue: Name | None = None
    priority: Priority | None = None
    run_at: str | None = None  # RFC 3339; or
    delay: Seconds | None = None  # seconds from now
    ttl: Annotated[float, msgspec.Meta(gt=0, le=MAX_AHEAD)] | None = None  # seconds it may live
    visibility_timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_VISIBILITY)] | None = None
    max_attempts: Limit | None = None
    max_fails: Limit | None = None
    capture_logs: bool = False  # keep the lines the handler logs with ctx.log()
    new_queue: bool = False  # ``queue`` is meant new, even spelt like a known one
    unique: UniqueOptions | None = None  # None: the spec's [unique], if it has one
    # Flow control (README, Flow control): the key per-key limits count the job under
    # (a tenant, a user), and the worker labels it requires (the spec's are added).
    concurrency_key: Name | None = None
    labels: Annotated[list[Name], msgspec.Meta(max_length=MAX_LABELS)] = []
    # An absolute moment (RFC 3339) the job may live until; give it or ttl, not both.
    expires_at: str | None = None
    # The OJS-only parts of a job (rota/base/ojs.py): set by the /ojs/v1 routes only;
    # Rota's own POST /jobs refuses a request that sets it.
    ojs: OjsExtras | None = None


class BatchRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    jobs: Annotated[list[msgspec.Raw], msgspec.Meta(min_length=1, max_length=10_000)]


def new_job(request: EnqueueRequest, spec: JobSpec, now: float) -> JobRecord:
    run_at = _run_at(request, now)
    retry = spec.retry
    limits = ojs_limits(shared_limits(request.max_attempts or retry.max_attempts,
                                      request.max_fails or retry.max_fails, retry.backoff_base,
                                      retry.backoff_max, retry.max_worker_deaths), request.ojs)
    start = run_at if run_at is not None else now
    labels = job_labels(request.labels, spec)
    return JobRecord(
        id=request.id or uuid7(), spec=spec.name, queue=request.queue or spec.queue,
        args=msgspec.Raw(msgspec.json.encode(request.args)),
        priority=spec.priority if request.priority is None else request.priority,
        enqueued_at=now, seq=0, limits=limits,
        visibility_timeout=request.visibility_timeout or spec.visibility_timeout,
        state="scheduled" if run_at is not None else "available", run_at=run_at,
        expires_at=_expires_at(request, start, now),
        capture_logs=request.capture_logs, concurrency_key=request.concurrency_key,
        labels=labels, ojs=request.ojs,
    )


def job_labels(given: list[str], spec: JobSpec) -> tuple[str, ...]:
    """The labels a job requires: its own and its spec's, sorted, each once."""
    if not given and not spec.labels:  # (most jobs: nothing to build)
        return ()
    labels = tuple(sorted(set(given) | set(spec.labels)))
    if len(labels) > MAX_LABELS:
        raise Invalid("invalid_labels", f"the job would require {len(labels)} labels (its"
                      f" own and spec {spec.name}'s); at most {MAX_LABELS}")
    return labels


def labels_text(labels: tuple[str, ...]) -> str | None:
    """Labels as their column holds them: a JSON list, NULL for none."""
    return msgspec.json.encode(labels).decode() if labels else None


def labels_of(text: str | None) -> tuple[str, ...]:
    return tuple(msgspec.json.decode(text)) if text else ()


def _run_at(request: EnqueueRequest, now: float) -> float | None:
    if request.run_at is not None and request.delay is not None:
        raise Invalid("invalid_request", "give run_at or delay, not both")
    if request.delay:
        return now + request.delay
    if request.run_at is None:
        return None
    when = moment(request.run_at, "run_at", now)
    return when if when > now else None  # a moment past, however long ago, means now


def _expires_at(request: EnqueueRequest, start: float, now: float) -> float | None:
    if request.expires_at is not None and request.ttl is not None:
        raise Invalid("invalid_request", "give expires_at or ttl, not both")
    if request.ttl is not None:
        return start + request.ttl
    return None if request.expires_at is None else moment(request.expires_at, "expires_at", now)


def moment(text: str, field: str, now: float) -> float:
    """An RFC 3339 moment a request gives, as a timestamp: at most MAX_MOMENT ahead."""
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise Invalid(f"invalid_{field}", f"{field} is not RFC 3339: {exc}") from exc
    if when.tzinfo is None:
        raise Invalid(f"invalid_{field}", f"{field} needs a UTC offset, e.g. 'Z'")
    stamp = when.timestamp()
    if stamp > now + MAX_MOMENT:
        raise Invalid(f"invalid_{field}",
                      f"{field} is more than {MAX_MOMENT / 86400 / 365.25:g} years ahead")
    return stamp


def same_job(row: dict[str, Any], job: JobRecord, args: dict[str, Any]) -> bool:
    """An enqueue repeated with the same id must describe the same job."""
    return (row["spec"] == job.spec and row["queue"] == job.queue
            and row["priority"] == job.priority and msgspec.json.decode(row["args"]) == args
            and row.get("concurrency_key") == job.concurrency_key
            and labels_of(row.get("labels")) == job.labels)


def error_record(error: p.ErrorInfo, *, attempt: int, worker_id: str | None, now: float,
                 retry_in: float | None = None) -> bytes:
    """A job's error record (one item of ``jobs.errors``). ``code`` (an OJS worker's error
    code) and ``retry_in`` (seconds of backoff it led to) are there only when known."""
    record: dict[str, Any] = {
        "type": error.type, "message": error.message, "retryable": error.retryable,
        "details": error.details, "attempt": attempt, "worker_id": worker_id,
        "at": p.rfc3339(now),
    }
    if error.code is not None:
        record["code"] = error.code
    if retry_in is not None:
        record["retry_in"] = round(retry_in, 3)
    return msgspec.json.encode(record)
