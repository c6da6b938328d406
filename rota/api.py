"""The HTTP API (JSON): enqueue and inspect jobs, push and list specs, see workers and queues.

Every error has the body ``{"error": {"code": ..., "message": ...}}``: a 4xx for what the
client can fix, 503 with ``Retry-After`` while the disk refuses writes (``storage_*``),
and 500 ``internal`` (with an incident id, from rota/safety.py) for a bug.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Annotated, Any, Literal

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from rota.auth import Principal, Scope
from rota.coordinator import Coordinator
from rota.errors import (Conflict, DomainError, Forbidden, Invalid, NotFound, RequestError,
                         StorageError, TooLarge)
from rota.gate import principal_of
from rota.ids import TOKEN_NAME_PATTERN
from rota.inputs import BadJson, explain, screen
from rota.jobs import BatchRequest, EnqueueRequest
from rota.logs import printable
from rota.observe import UNFINISHED, busiest
from rota.policy import TERMINAL_STATES
from rota.protocol import Name, rfc3339
from rota.specs import JobSpec, checksum
from rota.store_tokens import token_view
from rota.views import job_view

Directive = Literal["quiet", "terminate", "running"]  # running: resume a quiet worker
# Printable, and short enough for a listing; an id is the other way to name a token.
TokenName = Annotated[str, msgspec.Meta(pattern=TOKEN_NAME_PATTERN)]

log = logging.getLogger("rota.server")
SECONDS = re.compile(r"[0-9]{1,20}(\.[0-9]{1,20})?([eE][-+]?[0-9]{1,3})?")


class StateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    state: Directive
    label: Name | None = None  # POST /workers/state: every worker with this label, or
    all: bool = False  # every connected worker


class RetireRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    cancel_waiting: bool = False  # cancel the spec's waiting jobs too


class PushRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    specs: list[JobSpec]
    dry_run: bool = False


class TokenRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    scope: Scope
    name: TokenName | None = None  # default: scope and id, as ``rota tokens create``
    queues: Annotated[list[Name], msgspec.Meta(min_length=1)] | None = None  # None: any


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def error(status: int, code: str, message: str) -> JSON:
    return JSON({"error": {"code": code, "message": message}}, status_code=status)


# The core's refusals, as HTTP statuses: decided here, at the edge, not in the engine.
STATUS: dict[type[DomainError], int] = {NotFound: 404, Conflict: 409, Invalid: 422,
                                        Forbidden: 403, TooLarge: 413, DomainError: 422}


def status_of(exc: RequestError | DomainError) -> int:
    if isinstance(exc, RequestError):
        return exc.status
    return STATUS.get(type(exc), 422)


def _coordinator(request: Request) -> Coordinator:
    return request.app.state.coordinator


def need(request: Request, *scopes: Scope) -> Principal:
    """The caller, if its token's scope allows this route; else 403."""
    principal = principal_of(request.scope)
    if not principal.may(*scopes):
        raise RequestError(403, "forbidden", f"a {principal.scope} token may not"
                           f" {request.method} {request.url.path}")
    return principal


async def _read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it passes the limit: never buffered whole."""
    limit = _coordinator(request).settings.max_body_bytes
    too_large = RequestError(413, "body_too_large",
                             f"the request body is over {limit} bytes (max_body_bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    # A body sent a byte a minute would hold its connection for ever: it has a deadline.
    timeout = _coordinator(request).settings.body_timeout
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, "body_timeout", f"the request body did not arrive within"
                           f" {timeout:g}s (body_timeout)") from None
    return b"".join(chunks)


async def _decode(request: Request, kind: type[Any]) -> Any:
    return decode_as(await _read_body(request), kind)


def decode_as(body: bytes, kind: type[Any]) -> Any:
    """A JSON body as ``kind``: 422 if it does not fit, 400 if it is not JSON Rota takes
    (malformed, too deep, not UTF-8), each with a message that says which."""
    try:
        return msgspec.json.decode(screen(body), type=kind)
    except msgspec.ValidationError as exc:
        raise RequestError(422, "invalid_request", str(exc)) from None
    except BadJson as exc:
        raise RequestError(400, exc.code, exc.message) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        bad = explain(body, exc)
        raise RequestError(400, bad.code, bad.message) from None


# -- jobs -------------------------------------------------------------------------
async def enqueue(request: Request) -> Response:
    principal = need(request, "producer")
    payload = await _decode(request, EnqueueRequest)
    [outcome] = await _coordinator(request).enqueue([payload], principal)
    if isinstance(outcome, DomainError):
        raise outcome
    row, created = outcome
    return JSON({"job": job_view(row), "created": created}, status_code=201 if created else 200)


async def enqueue_batch(request: Request) -> Response:
    """Many jobs, one transaction; each gets its own status, and a bad one spoils no other."""
    principal = need(request, "producer")
    batch: BatchRequest = await _decode(request, BatchRequest)
    parsed: list[EnqueueRequest | DomainError] = []
    for raw in batch.jobs:
        try:  # already screened and decoded once, as part of the batch: it is JSON
            parsed.append(msgspec.json.decode(raw, type=EnqueueRequest))
        except msgspec.ValidationError as exc:
            parsed.append(Invalid("invalid_request", str(exc)))
    valid = [item for item in parsed if isinstance(item, EnqueueRequest)]
    outcomes = iter(await _coordinator(request).enqueue(valid, principal) if valid else [])
    results = []
    for index, item in enumerate(parsed):
        outcome = item if isinstance(item, DomainError) else next(outcomes)
        if isinstance(outcome, DomainError):
            results.append({"index": index, "status": status_of(outcome),
                            "error": {"code": outcome.code, "message": outcome.message}})
        else:
            row, created = outcome
            results.append({"index": index, "status": 201 if created else 200,
                            "created": created, "job": job_view(row)})
    return JSON({"results": results})


async def _find(request: Request, job_id: str) -> dict[str, Any] | None:
    """The job the caller names ``job_id``: a producer's own, found under the id
    it is kept under (rota/auth.py); to a producer, any other job does not exist, exactly
    as a missing one."""
    principal = need(request, "producer")
    coordinator = _coordinator(request)
    row = await coordinator.get_job(principal.stored_id(job_id))
    if row is None and (unscoped := principal.unscoped_id(job_id)) is not None:
        # A job enqueued before producers' ids were their own is kept under the id given.
        row = await coordinator.get_job(unscoped)
    if row is None or principal.scope == "admin" or row["created_by"] == principal.token_id:
        return row
    return None


async def show_job(request: Request) -> Response:
    coordinator, job_id = _coordinator(request), request.path_params["job_id"]
    row = await _find(request, job_id)
    if row is None:
        hint = (f" (the bulk action is POST /jobs/{job_id})" if job_id in ("retry", "cancel")
                else "")
        return error(404, "not_found", f"no job {job_id}{hint}")
    return JSON(await job_detail(coordinator, row))


async def job_detail(coordinator: Coordinator, row: dict[str, Any]) -> dict[str, Any]:
    """A job as GET /jobs/{id} shows it: its view, its logs, and why it waits (also the
    dashboard's job page)."""
    view = job_view(row)
    view["logs"] = await coordinator.job_logs(row["id"])
    if row["state"] == "available":
        view["waiting_reason"] = coordinator.waiting_reason(row["queue"], row["spec"])
    elif row["state"] in ("scheduled", "retryable"):
        view["waiting_reason"] = f"{row['state']} until {view['run_at']}"
    return view


async def cancel_job(request: Request) -> Response:
    # A producer may take back what it enqueued (it could as well not have); another
    # token's job does not exist for it, as in GET. Retry stays admin-only: it
    # overrides the spec's retry limits, an operator's call.
    principal = need(request, "producer")
    coordinator, job_id = _coordinator(request), request.path_params["job_id"]
    if principal.scope != "admin":  # (an admin's cancel needs no extra read)
        row = await _find(request, job_id)
        if row is None:
            return error(404, "not_found", f"no job {job_id}")
        job_id = row["id"]
    row, done = await coordinator.cancel(job_id)
    return JSON(job_view(row), status_code=200 if done else 202)


async def retry_job(request: Request) -> Response:
    need(request, "admin")
    row = await _coordinator(request).retry(request.path_params["job_id"])
    return JSON(job_view(row))


async def job_result(request: Request) -> Response:
    coordinator = _coordinator(request)
    text = request.query_params.get("wait", "0")
    # A number as JSON writes one (and str(float)): float() would also take "1_0", "nan",
    # "inf" and " 1 ".
    if not SECONDS.fullmatch(text):
        return error(400, "invalid_wait", "wait must be a number of seconds")
    wait = float(text)
    if not 0 <= wait <= coordinator.settings.max_result_wait:
        return error(400, "invalid_wait",
                     f"wait must be between 0 and {coordinator.settings.max_result_wait} seconds")
    job_id = request.path_params["job_id"]
    found = await _find(request, job_id)
    if found is None:
        return error(404, "not_found", f"no job {job_id}")
    if wait > 0:
        hold = coordinator.hold(principal_of(request.scope))
        if hold is None:
            return too_many_waits(coordinator)
        try:
            row = await coordinator.wait_for_result(found["id"], wait, hold.revoked)
        finally:
            coordinator.release(hold)
        if hold.revoked.done():
            return token_revoked()
    else:
        row = await coordinator.wait_for_result(found["id"], 0)
    if row is None:
        return error(404, "not_found", f"no job {job_id}")
    view = job_view(row)
    done = row["state"] in TERMINAL_STATES
    failed = row["state"] in ("discarded", "cancelled") and view["errors"]
    body = {"id": row["id"], "state": row["state"], "done": done, "result": view["result"],
            "error": view["errors"][-1] if failed else None}
    return JSON(body, status_code=200 if done else 202)


# The scope key of a request's way to drop its connection at once (rota/edge.py sets it:
# a weak method, called to get the method), for a stream whose client does not read.
DROP = "rota.drop"


def token_revoked() -> Response:
    """The answer to a request that waits whose token was revoked meanwhile."""
    return error(401, "token_revoked", "the token of this request was revoked while it"
                 " waited")


def too_many_waits(coordinator: Coordinator) -> Response:
    """The answer to a token over its share of HTTP requests that stay open."""
    cap = coordinator.settings.max_waits_per_token
    response = error(429, "too_many_waits", f"this token has {cap} requests open that wait"
                     " (GET /events, ?wait=) already: --max-waits-per-token")
    response.headers["retry-after"] = "1"
    return response


# -- specs ------------------------------------------------------------------------
async def list_specs(request: Request) -> Response:
    need(request, "producer")  # a producer needs the argument schemas of what it enqueues
    coordinator = _coordinator(request)
    retired = coordinator.retired_specs()
    specs = [
        {"name": s.name, "version": s.version, "checksum": checksum(s), "queue": s.queue,
         "description": s.description, "spec": msgspec.to_builtins(s),
         "retired_at": rfc3339(retired[s.name]) if s.name in retired else None}
        for s in sorted(coordinator.specs.values(), key=lambda s: s.name)
    ]
    return JSON({"specs": specs})


async def push_specs(request: Request) -> Response:
    need(request, "admin")
    payload: PushRequest = await _decode(request, PushRequest)
    report = await _coordinator(request).push_specs(payload.specs, dry_run=payload.dry_run)
    return JSON({"dry_run": payload.dry_run, "specs": report})


async def retire_spec(request: Request) -> Response:
    need(request, "admin")
    body = await _read_body(request)
    payload = decode_as(body, RetireRequest) if body.strip() else RetireRequest()
    return JSON(await _coordinator(request).retire_spec(
        request.path_params["name"], cancel_waiting=payload.cancel_waiting))


async def spec_history(request: Request) -> Response:
    need(request, "admin")
    name = request.path_params["name"]
    history = await _coordinator(request).spec_history(name)
    if not history:
        return error(404, "not_found", f"spec {name!r} was never pushed")
    return JSON({"name": name, "history": history})


# -- tokens (admin only; ``rota tokens --url``) ------------------------------------------
async def create_token(request: Request) -> Response:
    need(request, "admin")
    payload: TokenRequest = await _decode(request, TokenRequest)
    secret, row = await _coordinator(request).create_token(payload.scope, payload.name,
                                                           payload.queues)
    return JSON({"token": secret, **token_view(row)}, status_code=201)


async def list_tokens(request: Request) -> Response:
    need(request, "admin")
    rows = await _coordinator(request).live_tokens()
    return JSON({"tokens": [token_view(row) for row in rows]})


async def revoke_token(request: Request) -> Response:
    need(request, "admin")
    rows = await _coordinator(request).revoke_token(request.path_params["token"])
    return JSON({"revoked": [token_view(row) for row in rows]})


# -- workers, queues, health ---------------------------------------------------------
async def list_workers(request: Request) -> Response:
    need(request, "admin")
    return JSON({"workers": worker_views(_coordinator(request))})


def worker_views(coordinator: Coordinator) -> list[dict[str, Any]]:
    """The connected workers as GET /workers shows them (and the dashboard), by id."""
    now = coordinator.clock().mono
    workers = []
    for conn in coordinator.connections.values():
        slot, reg = conn.worker, conn.registration
        matching = coordinator.matching_specs(slot)
        workers.append({
            "id": slot.id, "hostname": reg.hostname, "pid": reg.pid, "os": reg.os,
            "sdk": reg.sdk, "state": slot.state, "queues": slot.queues, "labels": slot.labels,
            "concurrency": slot.concurrency, "prefetch": slot.prefetch,
            "active": slot.running(), "prefetched": len(slot.active) - slot.running(),
            "capacity": slot.capacity, "specs_matching": matching,
            "specs_mismatching": sorted(set(slot.specs) - set(matching)),
            "directive": conn.directive,
            "cpu_percent": conn.cpu_percent, "memory_rss": conn.memory_rss,
            "alerts": list(conn.alerts),
            "connected_at": rfc3339(conn.connected_at),
            "last_heartbeat_age": round(now - conn.last_seen, 3),
            "heartbeats": conn.frames,
        })
    return sorted(workers, key=lambda w: w["id"])


async def direct_worker(request: Request) -> Response:
    """Ask one worker to go quiet or terminate (it hears it in its next ack); 202 if it
    is connected to another server on the database, which passes it on."""
    need(request, "admin")
    payload: StateRequest = await _decode(request, StateRequest)
    done = await _coordinator(request).direct_workers(
        payload.state, worker_id=request.path_params["worker_id"])
    if done.forwarded:
        return JSON({"workers": done.workers, "state": payload.state, "forwarded": True},
                    status_code=202)
    return JSON({"workers": done.workers, "state": payload.state})


async def direct_workers(request: Request) -> Response:
    """Ask every worker with a label, or all of them, to go quiet or terminate."""
    need(request, "admin")
    payload: StateRequest = await _decode(request, StateRequest)
    if (payload.label is None) == (not payload.all):
        return error(422, "invalid_request", "give either label or all: true")
    done = await _coordinator(request).direct_workers(payload.state, label=payload.label,
                                                      every=payload.all)
    return JSON({"workers": done.workers, "state": payload.state, "forwarded": done.forwarded})


async def list_queues(request: Request) -> Response:
    need(request, "admin")
    coordinator = _coordinator(request)
    views, others = await queue_views(coordinator, limit=coordinator.settings.max_series)
    return JSON({"queues": views, "others": others})


async def queue_views(coordinator: Coordinator, counts: dict[str, dict[str, int]] | None = None,
                      limit: int | None = None
                      ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every queue as GET /queues shows it, by name; the dashboard brings its own
    ``counts`` (rota/dashboard.py: it does not count a million rows every 2 s). With a
    ``limit`` (producers name queues: a page of 60,000 took the loop for seconds), the
    paused ones, those workers serve and the busiest of the rest up to it, and the others
    as ``{"queues": n, "counts": {...}}`` (None if none is left out)."""
    if counts is None:
        counts = await coordinator.queue_counts()
    slots, paused = coordinator.worker_slots(), coordinator.paused_queues()
    served = coordinator.served_queues()
    names = set(counts) | served | paused
    others = None
    if limit is not None and len(names) > limit:
        fixed = served | paused
        weights = {q: (sum(counts[q].get(s, 0) for s in UNFINISHED), sum(counts[q].values()))
                   for q in names - fixed}
        hidden = names
        names = fixed | set(busiest(weights, max(0, limit - len(fixed))))
        hidden = hidden - names
        summed: dict[str, int] = {}
        for queue in hidden:
            for state, n in counts[queue].items():
                summed[state] = summed.get(state, 0) + n
        others = {"queues": len(hidden), "counts": summed}
    waiting: dict[str, list[dict[str, Any]]] = {}
    for queue, spec, n, reason in coordinator.waiting():
        if queue in names:
            waiting.setdefault(queue, []).append({"spec": spec, "available": n, "reason": reason})
    oldest = await coordinator.oldest_waits()
    return [
        {"name": name, "counts": counts.get(name, {}),
         "workers": sum(1 for w in slots if name in w.queues),
         "waiting": waiting.get(name, []), "paused": name in paused,
         "oldest_available_age": oldest.get(name)}
        for name in sorted(names)
    ], others


async def healthz(request: Request) -> Response:
    """200 even while the store is degraded: the server still serves reads and workers,
    and a restart by a liveness probe would not bring the disk back (docs/operations.md)."""
    coordinator = _coordinator(request)
    degraded = coordinator.storage_degraded()
    storage = None if degraded is None else {
        "code": degraded.code, "message": degraded.message, "since": rfc3339(degraded.since)}
    return JSON({"status": "ok" if degraded is None else "degraded",
                 "workers": len(coordinator.connections),
                 "live_jobs": coordinator.live_jobs(), "specs": len(coordinator.specs),
                 "uptime": round(coordinator.uptime(), 3), "storage": storage})


# A body that stopped arriving: the connection ends with the answer. (The rest of a body
# refused as too large is read and dropped by uvicorn, and the connection goes on.)
CLOSE_AFTER = frozenset({"body_timeout"})


async def request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError | DomainError)
    response = error(status_of(exc), exc.code, exc.message)
    if exc.code in CLOSE_AFTER:
        response.headers["connection"] = "close"
    return response


async def storage_unavailable(request: Request, exc: Exception) -> Response:
    # Logged once by the store's health when it became degraded, not once per request.
    assert isinstance(exc, StorageError)
    response = error(503, exc.code, exc.message)
    response.headers["Retry-After"] = str(exc.retry_after)
    return response


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = str(exc.detail)
    if exc.status_code in (404, 405):
        path = printable(request.url.path, 100)
        message = f"no route {request.method} {path}"
        if path.rstrip("/") == "/work":
            message += ": /work is the workers' WebSocket endpoint (ws:// or wss://)"
        elif exc.status_code == 404:
            message += ": the routes are in /openapi.json"
    return error(exc.status_code, code, message)


async def no_such_socket(websocket: WebSocket) -> None:
    """A WebSocket handshake for any path but /work: refused with a JSON 404."""
    path = printable(websocket.url.path, 100)
    await websocket.send_denial_response(error(
        404, "not_found", f"no WebSocket endpoint at {path}: workers connect to /work"))


async def client_gone(request: Request, exc: Exception) -> Response:
    # The client closed its connection before its body arrived: nothing was done, nobody
    # is left to answer, and a traceback per such request is a log line anyone could
    # repeat at will. The answer is dropped by uvicorn.
    log.debug("%s %s: the client went away before its body arrived", request.method,
              printable(request.url.path))
    return error(400, "client_disconnected", "the client closed the connection mid-request")


exception_handlers = {RequestError: request_error, DomainError: request_error,
                      StorageError: storage_unavailable, HTTPException: http_error,
                      ClientDisconnect: client_gone}
