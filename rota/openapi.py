"""The HTTP API's OpenAPI 3.1 document (``GET /openapi.json``).

Request bodies are the very msgspec types the routes decode with; responses are
described by the Structs below, whose fields mirror what the routes send. The schemas
come from msgspec, so the document cannot drift from the decoders, and a schemathesis
run (tests/test_openapi.py) checks that no answer breaks it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NamedTuple

import msgspec

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rota import api, feeds, operate
from rota.api import PushRequest, RetireRequest, StateRequest, TokenRequest
from rota.gate import OPEN_PATHS  # one list of what needs no token, the gate's
from rota.jobs import BatchRequest, EnqueueRequest
from rota.operate import BulkRequest

JobState = Literal["scheduled", "available", "active", "retryable", "completed", "discarded",
                   "cancelled"]


class Problem(msgspec.Struct):
    code: str
    message: str
    id: str | None = None  # a 500's incident id, which the server's log names


class ErrorBody(msgspec.Struct):
    error: Problem


class Progress(msgspec.Struct):
    percent: float
    message: str | None
    at: str


class LogEntry(msgspec.Struct):
    at: str
    attempt: int
    kind: Literal["log", "alert"]
    level: str
    message: str


class JobView(msgspec.Struct, kw_only=True):
    id: str
    spec: str
    queue: str
    state: JobState
    priority: int
    attempt: int
    args: Any
    worker_id: str | None
    checksum: str | None
    visibility_timeout: float | None
    enqueued_at: str | None
    reserved_at: str | None
    finished_at: str | None
    result: Any
    errors: list[Any]
    run_at: str | None
    expires_at: str | None
    fails: int
    deaths: int  # attempts in a row whose worker died (see max_worker_deaths)
    max_attempts: int | None
    max_fails: int | None
    cancel_requested: bool
    capture_logs: bool
    progress: Progress | None


class JobDetail(JobView, kw_only=True):
    logs: list[LogEntry]
    waiting_reason: str | None = None


class Enqueued(msgspec.Struct):
    job: JobView
    created: bool


class BatchItem(msgspec.Struct, kw_only=True):
    index: int
    status: int
    created: bool | None = None
    job: JobView | None = None
    error: Problem | None = None


class BatchReply(msgspec.Struct):
    results: list[BatchItem]


class ResultReply(msgspec.Struct):
    id: str
    state: JobState
    done: bool
    result: Any
    error: Any


class SpecEntry(msgspec.Struct):
    name: str
    version: str
    checksum: str
    queue: str
    description: str
    spec: Any
    retired_at: str | None  # when it was retired (POST /specs/{name}/retire), else null


class SpecList(msgspec.Struct):
    specs: list[SpecEntry]


class SpecChange(msgspec.Struct):
    name: str
    change: Literal["new", "changed", "unchanged", "restored"]
    checksum: str
    previous: str | None
    mismatched_workers: int
    matching_workers: int


class PushReply(msgspec.Struct):
    dry_run: bool
    specs: list[SpecChange]


class Push(msgspec.Struct):
    checksum: str
    previous: str | None
    version: str
    pushed_at: str
    event: Literal["push", "retire"]


class SpecJobs(msgspec.Struct):
    scheduled: int
    available: int
    retryable: int
    active: int


class Retired(msgspec.Struct):
    name: str
    checksum: str
    retired_at: str
    already_retired: bool
    jobs: SpecJobs  # the spec's unfinished jobs, after any cancel
    cancelled: int
    matching_workers: int


class History(msgspec.Struct):
    name: str
    history: list[Push]


class TokenView(msgspec.Struct, kw_only=True):
    id: str
    name: str
    scope: Literal["worker", "producer", "admin", "metrics"]
    queues: list[str] | None  # None: any queue
    created_at: str


class NewToken(TokenView, kw_only=True):
    token: str  # the secret, rota_<id>_<secret>: shown this once, never stored


class TokenList(msgspec.Struct):
    tokens: list[TokenView]


class Revoked(msgspec.Struct):
    revoked: list[TokenView]


class WorkerAlert(msgspec.Struct):
    at: str
    level: str
    job_id: str | None
    message: str


class WorkerView(msgspec.Struct, kw_only=True):
    id: str
    hostname: str
    pid: int
    os: str
    sdk: str
    state: Literal["running", "quiet", "terminate"]
    queues: list[str]
    labels: list[str]
    concurrency: int
    prefetch: int  # jobs it may hold beyond concurrency, waiting to start
    active: int  # held jobs that count as running: at most concurrency
    prefetched: int  # held jobs beyond concurrency: waiting in the worker's line
    capacity: int
    specs_matching: list[str]
    specs_mismatching: list[str]
    directive: str | None
    cpu_percent: float | None
    memory_rss: int | None
    alerts: list[WorkerAlert]
    connected_at: str
    last_heartbeat_age: float
    heartbeats: int  # frames read from this connection


class Workers(msgspec.Struct):
    workers: list[WorkerView]


class Directed(msgspec.Struct):
    workers: list[str]
    state: str
    forwarded: bool = False  # also passed on to the other servers sharing the database


class Waiting(msgspec.Struct):
    spec: str
    available: int
    reason: str | None


class QueueView(msgspec.Struct):
    name: str
    counts: dict[str, int]
    workers: int
    waiting: list[Waiting]
    paused: bool  # POST /queues/{queue}/pause: it keeps its jobs and assigns none
    oldest_available_age: float | None  # seconds its longest-waiting available job waited


class QueuePaused(msgspec.Struct):
    queue: str
    paused: bool


class JobList(msgspec.Struct):
    jobs: list[JobView]
    next_cursor: str | None  # GET /jobs?cursor= for the next page; null: the last page


class Skipped(msgspec.Struct):
    id: str
    reason: str


class BulkReply(msgspec.Struct):
    action: Literal["retry", "cancel"]
    dry_run: bool
    matched: int  # jobs that matched (a count stops at 100,000)
    touched: int  # retried or cancelled (in a dry run: would be)
    ids: list[str]  # the first 100 touched
    skipped: list[Skipped]  # the first 100 that matched and were not touched, and why
    truncated: bool  # more matched than the limit


class OtherQueues(msgspec.Struct):
    queues: int  # queues not listed one by one (past --max-series)
    counts: dict[str, int]  # their jobs per state, summed


class Queues(msgspec.Struct):
    queues: list[QueueView]
    others: OtherQueues | None


class StorageState(msgspec.Struct):
    code: str
    message: str
    since: str


class Health(msgspec.Struct):
    status: str  # "ok", or "degraded" while the store cannot write (storage says why)
    workers: int
    live_jobs: int
    specs: int
    uptime: float
    storage: StorageState | None = None


class StatsSeries(msgspec.Struct):
    queue: str
    spec: str
    enqueued: list[int]  # one count per minute, as minute_starts
    completed: list[int]
    failed: list[int]
    discarded: list[int]
    retried: list[int]
    cancelled: list[int]


class Stats(msgspec.Struct):
    now: str
    minute_starts: list[str]  # the minutes counted, oldest first; the last is under way
    series: list[StatsSeries]
    oldest_available: dict[str, float | None]  # per queue: seconds, null if none waits


# Answers that are not JSON: the media type and a description for the document.
TEXT_ANSWERS: dict[str, tuple[str, str]] = {
    "/events": ("text/event-stream", "server-sent events: `id:`, `event:` (the kind) and"
                " one JSON object as `data:` per event; `: keep-alive` comments"
                " (docs/protocol.md)"),
    "/metrics": ("text/plain; version=0.0.4", "Prometheus text exposition format"),
}


_TEXT = {"type": "string"}
QUERIES: dict[str, dict[str, Any]] = {
    "/events": {"last_event_id": {"type": "string", "pattern": "^[0-9]{1,19}$"},
                "event": _TEXT, "spec": _TEXT, "queue": _TEXT, "worker": _TEXT},
    "/stats": {"minutes": {"type": "integer", "minimum": 1, "maximum": 60}},
}


class Op(NamedTuple):
    """One operation: it makes both a Starlette route and an entry of the document, so
    the two cannot drift apart. Every route may also answer 401 (no valid token) and
    403 (its scope does not allow it), added below."""

    method: str
    path: str
    handler: Callable[[Request], Awaitable[Response]]
    summary: str
    body: Any  # the request body's type, or None
    answers: dict[int, Any]  # status -> response body type


BAD = {400: ErrorBody, 413: ErrorBody, 422: ErrorBody}
ROUTES: list[Op] = [
    Op("post", "/jobs", api.enqueue, "Enqueue a job", EnqueueRequest,
     {201: Enqueued, 200: Enqueued, 409: ErrorBody, **BAD}),
    Op("get", "/jobs", operate.list_jobs, "Find jobs, newest first, a page at a time (admin)",
       None, {200: JobList, 400: ErrorBody}),
    Op("post", "/jobs/retry", operate.bulk_retry,
       "Retry discarded and cancelled jobs, by ids or filter (admin)", BulkRequest,
       {200: BulkReply, **BAD}),
    Op("post", "/jobs/cancel", operate.bulk_cancel,
       "Cancel waiting and running jobs, by ids or filter (admin)", BulkRequest,
       {200: BulkReply, **BAD}),
    Op("post", "/jobs/batch", api.enqueue_batch,
       "Enqueue many jobs in one transaction", BatchRequest,
     {200: BatchReply, **BAD}),
    Op("get", "/jobs/{job_id}", api.show_job, "A job, with its logs and why it waits", None,
     {200: JobDetail, 404: ErrorBody}),
    Op("delete", "/jobs/{job_id}", api.cancel_job, "Cancel a job", None,
     {200: JobView, 202: JobView, 404: ErrorBody, 409: ErrorBody}),
    Op("post", "/jobs/{job_id}/retry", api.retry_job, "Put a discarded or cancelled job back", None,
     {200: JobView, 404: ErrorBody, 409: ErrorBody}),
    Op("get", "/jobs/{job_id}/result", api.job_result,
       "A job's result, waiting up to ?wait= seconds", None,
     {200: ResultReply, 202: ResultReply, 400: ErrorBody, 401: ErrorBody, 404: ErrorBody,
      429: ErrorBody}),
    Op("get", "/specs", api.list_specs, "The status quo", None, {200: SpecList}),
    Op("put", "/specs", api.push_specs,
       "Push specs (a deploy)", PushRequest, {200: PushReply, **BAD}),
    Op("post", "/specs/{name}/retire", api.retire_spec,
       "Retire a spec: no new jobs of it", RetireRequest, {200: Retired, 404: ErrorBody, **BAD}),
    Op("get", "/specs/{name}/history", api.spec_history, "Every version pushed for a spec", None,
     {200: History, 404: ErrorBody}),
    Op("get", "/workers", api.list_workers, "Connected workers", None, {200: Workers}),
    Op("post", "/workers/state", api.direct_workers,
       "Quiet or terminate workers by label, or all", StateRequest,
     {200: Directed, **BAD}),
    Op("post", "/workers/{worker_id}/state", api.direct_worker,
       "Quiet or terminate one worker", StateRequest,
     {200: Directed, 202: Directed, 404: ErrorBody, 409: ErrorBody, **BAD}),
    Op("get", "/queues", api.list_queues,
       "Per-queue counts and why jobs wait", None, {200: Queues}),
    Op("post", "/queues/{queue}/pause", operate.pause_queue,
       "Pause a queue: it keeps its jobs and assigns none (admin)", None,
       {200: QueuePaused, 400: ErrorBody}),
    Op("post", "/queues/{queue}/resume", operate.resume_queue,
       "Resume a paused queue (admin)", None, {200: QueuePaused, 400: ErrorBody}),
    Op("post", "/tokens", api.create_token, "Create a token (admin)", TokenRequest,
       {201: NewToken, 409: ErrorBody, **BAD}),
    Op("get", "/tokens", api.list_tokens, "The live tokens, never their secrets (admin)", None,
       {200: TokenList}),
    Op("delete", "/tokens/{token}", api.revoke_token, "Revoke a token by id or name (admin)",
       None, {200: Revoked, 404: ErrorBody}),
    Op("get", "/events", feeds.events, "Server-sent events: what happens, as it happens"
       " (admin)", None, {200: None, 400: ErrorBody, 429: ErrorBody}),
    Op("get", "/stats", feeds.stats, "Counts per minute over the last hour, and the oldest"
       " available job per queue (admin)", None, {200: Stats, 400: ErrorBody}),
    Op("get", "/metrics", feeds.metrics, "Prometheus metrics (admin or metrics scope)", None,
       {200: None}),
    Op("get", "/healthz", api.healthz, "Health (no token needed)", None, {200: Health}),
]
STORED_PATHS = {"/jobs", "/jobs/batch", "/jobs/{job_id}", "/jobs/{job_id}/retry",
                "/jobs/{job_id}/result", "/specs", "/specs/{name}/history", "/queues",
                "/tokens", "/tokens/{token}", "/specs/{name}/retire", "/stats", "/metrics",
                "/jobs/retry", "/jobs/cancel", "/queues/{queue}/pause", "/queues/{queue}/resume"}


def document() -> dict[str, Any]:
    types = [t for op in ROUTES for t in [op.body, *op.answers.values()] if t]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    refs = dict(zip(types, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path, _, summary, body, answers in ROUTES:
        operation: dict[str, Any] = {"summary": summary, "responses": {}}
        params = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if params:
            operation["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in params]
        if path.endswith("/result"):
            operation["parameters"].append(
                {"name": "wait", "in": "query", "required": False,
                 "schema": {"type": "number", "minimum": 0}})
        if path in QUERIES:
            operation["parameters"] = [
                {"name": name, "in": "query", "required": False, "schema": schema}
                for name, schema in QUERIES[path].items()]
        if method == "get" and path == "/jobs":
            operation["parameters"] = _LISTING_PARAMETERS
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[body]}}}
        extra = {401: ErrorBody, 403: ErrorBody, 500: ErrorBody}  # 500: the safety net
        if body is not None:  # not JSON Rota takes (400), or a body that stopped coming (408)
            extra |= {400: ErrorBody, 408: ErrorBody}
        if path in STORED_PATHS:  # what reads or writes the database answers 503 when it fails
            extra[503] = ErrorBody
        if path in OPEN_PATHS:
            operation["security"] = []  # no token needed
            extra = {500: ErrorBody}
        for status, answer in sorted({**answers, **extra}.items()):
            if answer is None:  # not JSON
                media, description = TEXT_ANSWERS[path]
                operation["responses"][str(status)] = {"description": description, "content": {
                    media: {"schema": {"type": "string"}}}}
                continue
            operation["responses"][str(status)] = {
                "description": _DESCRIPTIONS.get(status, "answer"),
                "content": {"application/json": {"schema": refs.get(answer)
                                                 or _ref(answer)}}}
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Rota", "version": "0.1.0",
                 "description": "Enqueue and inspect jobs, push specs, direct workers."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


_STATES = {"type": "string", "enum": list(JobState.__args__)}
_LISTING_PARAMETERS: list[dict[str, Any]] = [
    {"name": "state", "in": "query", "required": False, "style": "form", "explode": True,
     "schema": {"type": "array", "items": _STATES}},
    *({"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
      for name in ("spec", "queue", "worker", "q", "cursor")),
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
]


def _ref(kind: Any) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{kind.__name__}"}


@functools.cache
def _encoded() -> bytes:
    return msgspec.json.encode(document())


async def openapi_json(request: Request) -> Response:
    return Response(_encoded(), media_type="application/json")


# The app's HTTP routes: the table's operations, and the document itself.
routes = [Route(op.path, op.handler, methods=[op.method.upper()]) for op in ROUTES]
routes.append(Route("/openapi.json", openapi_json, methods=["GET"]))


_DESCRIPTIONS = {200: "done", 201: "created", 202: "accepted, not finished", 400: "bad input",
                 401: "no valid token", 403: "not allowed for this token",
                 404: "not found", 409: "conflict with what exists (a job's state, a taken name)",
                 408: "the body did not arrive in time (body_timeout)",
                 413: "over a size limit", 422: "invalid request",
                 500: "a bug in Rota (internal): the error's id names the traceback in the log",
                 503: "storage unavailable (full, read-only or failing); see Retry-After"}
