"""The OJS binding's mapping, pure: a PUSH body to Rota's EnqueueRequest, a stored row
to the OJS job view, and OJS's times, durations and args (docs/ojs.md, §1 of the design).

Nothing here reads a store or an engine: the routes (rota/server/ojs_api.py) call these
with what they read, and answer what they return.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import Any

import msgspec

from rota.base.errors import RequestError
from rota.base.inputs import BadJson, explain, screen
from rota.base.logs import printable
from rota.base.ojs import (ID_PATTERN, KNOWN_KEYS, MAX_PRIORITY, MAX_QUEUE, MAX_TYPE,
                           MIN_PRIORITY, OJS_ARGS, QUEUE_PATTERN, TYPE_PATTERN, OjsExtras,
                           OjsJobIn, OjsOptions, OjsPolicy, OjsRetry, OjsUnique)
from rota.base.protocol import MAX_COUNT, rfc3339
from rota.base.specs import MAX_VISIBILITY
from rota.base.unique import MAX_PERIOD, UniqueOptions, options_problem
from rota.base.wording import plainly
from rota.core.jobs import MAX_AHEAD, MAX_MOMENT, EnqueueRequest

_ID = re.compile(ID_PATTERN)
_TYPE = re.compile(TYPE_PATTERN)
_QUEUE = re.compile(QUEUE_PATTERN)
_DURATION = re.compile(r"P(?:(\d+(?:\.\d+)?)W)?(?:(\d+(?:\.\d+)?)D)?(?:T(?:(\d+(?:\.\d+)?)H)?"
                       r"(?:(\d+(?:\.\d+)?)M)?(?:(\d+(?:\.\d+)?)S)?)?")
_UNITS = (7 * 86400.0, 86400.0, 3600.0, 60.0, 1.0)
_TERMINAL = frozenset({"completed", "discarded", "cancelled"})
_LATER = frozenset({"scheduled", "retryable"})  # shown available once due
_CONFLICTS = {"reject": "reject", "ignore": "existing", "replace": "replace"}
_DIMENSIONS = {"type": "spec", "args": "args", "queue": "queue"}
_FIELDS = frozenset(OjsJobIn.__struct_fields__) - {"ext"}


class OjsRefusal(RequestError):
    """A request the OJS binding refuses: its status and OJS error (ojs_base.ojs_error)."""

    def __init__(self, status: int, code: str, type: str, message: str,
                 details: Any = None) -> None:
        super().__init__(status, code, message)
        self.type = type
        self.details = details


def error_body(status: int, code: str, message: str, *, type: str, request_id: str,
               details: Any = None, hint: str | None = None,
               docs_url: str | None = None) -> dict[str, Any]:
    """OJS's error body: ``retryable`` only for 5xx, absent parts omitted."""
    error: dict[str, Any] = {"code": code, "message": message, "retryable": status >= 500,
                             "type": type}
    for name, value in (("details", details), ("hint", hint), ("docs_url", docs_url)):
        if value is not None:
            error[name] = value
    error["request_id"] = request_id
    return {"error": error}


def _bad(message: str, code: str = "invalid_request", status: int = 400) -> OjsRefusal:
    return OjsRefusal(status, code, "validation_error", message)


def _said(value: Any) -> str:
    """A client's value in a message: its repr, cut short and printable."""
    return printable(repr(value), 80)


def _retry_bad(message: str) -> OjsRefusal:
    # ERR says 400; L1-RTR-011/012 assert 422 (docs/ojs.md, Contradictions).
    return _bad(message, "invalid_retry_policy", 422)


# -- times ------------------------------------------------------------------------------
def ojs_time(ts: float) -> str:
    """RFC 3339 UTC with milliseconds, ``.000`` dropped when they are zero (L2-TTL-002
    compares ``2099-12-31T23:59:59Z`` character by character)."""
    text = rfc3339(ts)
    return text[:-5] + "Z" if text.endswith(".000Z") else text


def ojs_duration(text: str) -> float:
    """An ISO 8601 duration (``PT1S``, ``PT5M``, ``P1DT2H``) in seconds; ValueError if
    it is not one."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) else None
    if match is None or not any(match.groups()) or text.endswith("T"):
        raise ValueError(f"{_said(text)} is not an ISO 8601 duration (e.g. PT1S, PT5M, P1D)")
    return sum(float(part) * unit for part, unit in zip(match.groups(), _UNITS) if part)


def ojs_moment(text: str, now: float) -> float:
    """An absolute RFC 3339 moment, or one relative to now (``+PT5S``), as a timestamp;
    ValueError if it is neither, or too far ahead (docs/ojs.md)."""
    if not isinstance(text, str):
        raise ValueError(f"{_said(text)} is not an RFC 3339 time")
    if text.startswith("+"):
        seconds = ojs_duration(text[1:])
        if seconds > MAX_AHEAD:
            raise ValueError(f"{_said(text)} is more than {MAX_AHEAD / 86400:g} days ahead")
        return now + seconds
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{_said(text)} is not an RFC 3339 time") from None
    if when.tzinfo is None:
        raise ValueError(f"{_said(text)} needs a UTC offset, e.g. 'Z'")
    stamp = when.timestamp()
    if stamp > now + MAX_MOMENT:
        raise ValueError(f"{_said(text)} is more than 100 years ahead")
    return stamp


# -- args -------------------------------------------------------------------------------
def ojs_args_to_rota(args: list[Any]) -> dict[str, Any]:
    """OJS's positional args as a Rota args object, losslessly: exactly one object (with
    no ``_ojs_args`` key) is that object; any other list is kept under ``_ojs_args``."""
    if len(args) == 1 and isinstance(args[0], dict) and OJS_ARGS not in args[0]:
        return args[0]
    return {OJS_ARGS: args}


def rota_args_to_ojs(args: dict[str, Any]) -> list[Any]:
    """The inverse of ojs_args_to_rota: a Rota job's args as OJS shows them."""
    if set(args) == {OJS_ARGS} and isinstance(args[OJS_ARGS], list):
        return args[OJS_ARGS]
    return [args]


# -- a PUSH body ------------------------------------------------------------------------
def ojs_to_request(body: bytes | dict[str, Any], now: float) -> EnqueueRequest:
    """A PUSH body (JSON bytes, or the object a workflow step or cron template holds) as
    Rota's enqueue request, with its OJS-only parts in ``ojs``; OjsRefusal if it is not
    a job OJS allows."""
    envelope = ojs_json(body) if isinstance(body, bytes | bytearray) else body
    if not isinstance(envelope, dict):
        raise _bad("the job must be a JSON object")
    _envelope_checks(envelope)
    known = {k: v for k, v in envelope.items() if k in _FIELDS}
    try:
        job = msgspec.convert(known, OjsJobIn)
    except msgspec.ValidationError as exc:
        raise _bad(plainly(str(exc), OjsJobIn, lambda: known)) from None
    options = job.options or OjsOptions()
    queue = options.queue if options.queue is not None else job.queue
    priority = options.priority if options.priority is not None else job.priority
    if queue is not None and (len(queue) > MAX_QUEUE or not _QUEUE.match(queue)):
        raise _bad(f"queue {_said(queue)} must match {QUEUE_PATTERN} (at most {MAX_QUEUE})")
    if priority is not None and not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise _bad(f"priority {priority} is outside {MIN_PRIORITY}..{MAX_PRIORITY}")
    retry = options.retry or job.retry
    unique = options.unique or job.unique
    policy, max_attempts = _policy(retry) if retry is not None else (None, None)
    visibility_ms = _millis(_ms(options.visibility_timeout_ms, job.visibility_timeout),
                            "visibility_timeout_ms")
    extras = OjsExtras(
        meta=job.meta, tags=options.tags or job.tags, metadata=options.metadata,
        ext={k: v for k, v in envelope.items() if k not in KNOWN_KEYS} or None,
        timeout_ms=_millis(_ms(options.timeout_ms, job.timeout), "timeout_ms"),
        visibility_timeout_ms=visibility_ms,
        retry=retry, unique=unique, rate_limit=options.rate_limit, policy=policy)
    visibility = None
    if visibility_ms:
        visibility = visibility_ms / 1000
        if visibility > MAX_VISIBILITY:
            raise _bad(f"visibility_timeout_ms is over {MAX_VISIBILITY * 1000:g}")
    fields = dict(
        spec=job.type, args=ojs_args_to_rota(job.args), id=job.id, queue=queue,
        priority=priority, max_attempts=max_attempts,
        run_at=_at(options.delay_until or options.scheduled_at or job.scheduled_at,
                   "scheduled_at", now, future_only=True),
        expires_at=_at(options.expires_at or job.expires_at, "expires_at", now),
        visibility_timeout=visibility, unique=None if unique is None else _unique(unique),
        ojs=extras, new_queue=True)  # OJS names queues freely: no "did you mean" refusal
    try:  # converted, not constructed: a Struct's __init__ checks no constraint
        return msgspec.convert({k: v for k, v in fields.items() if v is not None},
                               EnqueueRequest)
    except msgspec.ValidationError as exc:
        raise _bad(plainly(str(exc), EnqueueRequest)) from None


def ojs_json(body: bytes) -> Any:
    """A body decoded (within Rota's depth and size rules), or 400 invalid_payload."""
    try:
        return msgspec.json.decode(screen(body))
    except BadJson as exc:
        raise _bad(exc.message, "invalid_payload") from None
    except msgspec.ValidationError as exc:  # (a number past a double's range)
        raise _bad(plainly(str(exc)), "invalid_payload") from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise _bad(explain(body, exc).message, "invalid_payload") from None


def _envelope_checks(envelope: dict[str, Any]) -> None:
    """The envelope's own rules, each refused with a message naming the field."""
    kind = envelope.get("type")
    if kind is None:
        raise _bad("type is required")
    if not isinstance(kind, str) or len(kind) > MAX_TYPE or not _TYPE.match(kind):
        raise _bad(f"type {_said(kind)} must be lowercase and dot-namespaced ({TYPE_PATTERN},"
                   f" at most {MAX_TYPE} characters)")
    if "args" not in envelope:
        raise _bad("args is required (a JSON array; [] for none)")
    if not isinstance(envelope["args"], list):
        raise _bad("args must be a JSON array")
    job_id = envelope.get("id")
    if job_id is not None and (not isinstance(job_id, str) or not _ID.match(job_id)):
        raise _bad(f"id {_said(job_id)} must be a lowercase UUIDv7 (or absent: the server"
                   " makes one)")
    if envelope.get("specversion") not in (None, "1.0") and not str(
            envelope["specversion"]).startswith("1."):
        raise _bad(f"specversion {_said(envelope['specversion'])} is not 1.x", "unsupported", 422)


def _ms(millis: int | None, seconds: int | None) -> int | None:
    """An option in milliseconds, else JF's top-level seconds (``timeout: 30``)."""
    if millis is not None or seconds is None:
        return millis
    return seconds * 1000 if 0 <= seconds <= MAX_COUNT // 1000 else -1  # (-1: refused)


def _millis(value: int | None, name: str) -> int | None:
    if value is not None and not 0 <= value <= MAX_COUNT:
        raise _bad(f"{name} must be 0..{MAX_COUNT} milliseconds")
    return value


def _at(text: str | None, name: str, now: float, *, future_only: bool = False) -> str | None:
    """A moment given, as Rota's run_at/expires_at text (None: absent, or a run_at past:
    now)."""
    if text is None:
        return None
    try:
        stamp = ojs_moment(text, now)
    except ValueError as exc:
        raise _bad(f"{name}: {exc}") from None
    return None if future_only and stamp <= now else rfc3339(stamp)


def _policy(retry: OjsRetry) -> tuple[OjsPolicy, int | None]:
    """The retry options parsed (the engine reads OjsExtras.policy), and max_attempts."""
    if retry.max_attempts is not None and not 1 <= retry.max_attempts <= MAX_COUNT:
        raise _retry_bad(f"retry.max_attempts must be at least 1 (got {retry.max_attempts})")
    if retry.backoff_coefficient is not None and not (
            math.isfinite(retry.backoff_coefficient) and retry.backoff_coefficient >= 1):
        raise _retry_bad("retry.backoff_coefficient must be at least 1"
                         f" (got {retry.backoff_coefficient})")
    try:
        base = None if retry.initial_interval is None else ojs_duration(retry.initial_interval)
        cap = None if retry.max_interval is None else ojs_duration(retry.max_interval)
    except ValueError as exc:
        raise _retry_bad(f"retry interval: {exc}") from None
    if retry.on_exhaustion not in (None, "discard", "dead_letter"):
        raise _retry_bad('retry.on_exhaustion must be "discard" or "dead_letter"')
    strategy = retry.backoff_strategy
    if strategy not in (None, "exponential", "linear", "constant", "polynomial"):
        raise _retry_bad('retry.backoff_strategy must be "exponential", "linear" or "constant"')
    patterns = tuple(retry.non_retryable_errors or ())
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise _retry_bad(f"retry.non_retryable_errors: {_said(pattern)}: {exc}") from None
    coefficient = 1.0 if strategy == "constant" else retry.backoff_coefficient
    jitter = None if retry.jitter is None else ("ojs" if retry.jitter else "none")
    return OjsPolicy(backoff_base=base, backoff_max=cap, coefficient=coefficient,
                     linear=strategy == "linear", jitter=jitter, non_retryable=patterns,
                     dead_letter=retry.on_exhaustion == "dead_letter"), retry.max_attempts


def _unique(unique: OjsUnique) -> UniqueOptions:
    """OJS unique options as Rota's (its covers are coarser: docs/ojs.md)."""
    dimensions = [_DIMENSIONS.get(k) for k in unique.keys or ()]
    if None in dimensions:
        raise _bad(f"unique.keys may name type, args and queue (got {_said(unique.keys)})")
    args_keys = unique.key or None
    if args_keys and "args" not in dimensions:
        dimensions.append("args")
    states = set(unique.states or ())
    covers = ("finished" if states & _TERMINAL else "active" if "active" in states or not states
              else "waiting")
    try:
        period = None if unique.period is None else ojs_duration(unique.period)
    except ValueError as exc:
        raise _bad(f"unique.period: {exc}") from None
    if period is not None and not 0 < period <= MAX_PERIOD:
        raise _bad(f"unique.period must be over 0 and at most {MAX_PERIOD / 86400:g} days")
    conflict = _CONFLICTS.get(unique.on_conflict or "reject")
    if conflict is None:
        raise _bad('unique.on_conflict must be "reject", "ignore" or "replace"')
    try:
        options = msgspec.convert({"keys": dimensions or None, "args_keys": args_keys,
                                   "states": covers, "period": period,
                                   "on_conflict": conflict}, UniqueOptions)
    except msgspec.ValidationError as exc:
        raise _bad(plainly(str(exc), UniqueOptions)) from None
    if (problem := options_problem(options)) is not None:
        raise _bad(problem)
    return options


# -- the job view -----------------------------------------------------------------------
def job_view(row: dict[str, Any], now: float) -> dict[str, Any]:
    """A stored job as OJS shows it: absent fields omitted, never null, and nothing that
    changes with time alone but the due state (L0-OPS-020 compares three reads)."""
    extras = _extras(row.get("ojs"))
    state = row["state"]
    if state in _LATER and row.get("run_at") is not None and row["run_at"] <= now:
        state = "available"  # due: Rota flips it on its next round (L2-DEL-003)
    attempt = row["attempt"] - (row.get("budget_start") or 0)
    view: dict[str, Any] = {}
    if extras is not None and extras.ext:
        view.update(extras.ext)  # unknown fields first: OJS's own names win
    view.update(id=_shown_id(row), type=row["spec"], queue=row["queue"],
                args=rota_args_to_ojs(msgspec.json.decode(row["args"])), state=state,
                priority=row["priority"], attempt=attempt)
    if row.get("max_attempts") is not None:
        view["max_attempts"] = row["max_attempts"]
    if extras is not None:
        for name in ("meta", "tags", "metadata", "timeout_ms", "visibility_timeout_ms",
                     "retry", "unique", "rate_limit"):
            if (value := getattr(extras, name)) is not None:
                view[name] = msgspec.to_builtins(value)
    created = ojs_time(row["enqueued_at"])
    view.update(created_at=created, enqueued_at=created)
    if row.get("run_at") is not None:
        view["scheduled_at"] = ojs_time(row["run_at"])
    if row.get("expires_at") is not None:
        view["expires_at"] = ojs_time(row["expires_at"])
    _times(view, row, state, attempt)
    if row.get("result") is not None:
        view["result"] = msgspec.json.decode(row["result"])
    errors = [error_view(e) for e in msgspec.json.decode(row.get("errors") or "[]")]
    if errors:
        view["errors"] = errors
        if state != "completed":
            view["error"] = errors[-1]
            if (retry_in := errors[-1].get("retry_delay_ms")) is not None:
                view["retry_delay_ms"] = retry_in
    if row.get("parent_results") is not None:
        view["parent_results"] = _in_order(msgspec.json.decode(row["parent_results"]))
    if row.get("workflow_id") is not None:
        view["workflow_id"] = row["workflow_id"]
    if state == "active" and row.get("cancel_requested"):
        view["cancel_requested"] = True
    return view


def _times(view: dict[str, Any], row: dict[str, Any], state: str, attempt: int) -> None:
    """started_at, completed_at, discarded_at, cancelled_at: by the rules of docs/ojs.md
    (an expired job has no completed_at, L2-TTL-001; a cancelled one neither, L0-LC-007)."""
    if attempt >= 1 and row.get("reserved_at") is not None:
        view["started_at"] = ojs_time(row["reserved_at"])
    finished = row.get("finished_at")
    if finished is None:
        return
    if state == "completed" or (state == "discarded" and row["attempt"] >= 1):
        view["completed_at"] = ojs_time(finished)
    if state == "discarded":
        view["discarded_at"] = ojs_time(finished)
    elif state == "cancelled":
        view["cancelled_at"] = ojs_time(finished)


def error_view(record: dict[str, Any]) -> dict[str, Any]:
    """One record of a job's errors as OJS shows it (its code: the worker's, else its
    type)."""
    view: dict[str, Any] = {"code": record.get("code") or record.get("type"),
                            "type": record.get("type"), "message": record.get("message"),
                            "retryable": record.get("retryable", True)}
    if record.get("details") is not None:
        view["details"] = record["details"]
    if record.get("attempt") is not None:
        view["attempt"] = record["attempt"]
    if record.get("at") is not None:
        view["occurred_at"] = record["at"]
    if record.get("retry_in") is not None:
        view["retry_delay_ms"] = round(record["retry_in"] * 1000)
    return {k: v for k, v in view.items() if v is not None}


def _extras(text: str | None) -> OjsExtras | None:
    return None if text is None else msgspec.json.decode(text, type=OjsExtras)


def _shown_id(row: dict[str, Any]) -> str:
    """The id as its producer gave it: a producer token's jobs are kept as
    ``<token id>:<id>`` (rota/core/auth.py)."""
    token = row.get("created_by")
    job_id: str = row["id"]
    if token and job_id.startswith(f"{token}:"):
        return job_id[len(token) + 1:]
    return job_id


def _in_order(results: Any) -> Any:
    """A step's parent results (keyed by step index) as a list, in step order."""
    if isinstance(results, dict) and all(k.isdigit() for k in results):
        return [results[k] for k in sorted(results, key=int)]
    return results
