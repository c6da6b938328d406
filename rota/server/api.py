"""The HTTP API (JSON): enqueue and inspect jobs, push and list specs, see workers and queues.

What the routes share (answers, errors and their statuses, the body, the scope check) is in
rota/server/api_base.py; the route table that serves them is rota/server/routes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Annotated, Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from rota.server.api_base import (JSON, coordinator_of, decode_as, decode_body, error, forbidden,
                                  need, read_body, status_of, token_revoked, too_many_waits)
from rota.core.auth import Principal, Scope, kept_hint
from rota.core.endpoints import is_endpoint
from rota.server.coordinator import Coordinator
from rota.base.errors import DomainError, Invalid, NoSuchJob, RequestError
from rota.base.ojs import OJS_ARGS
from rota.server.gate import principal_of
from rota.base.ids import TOKEN_NAME_PATTERN
from rota.core.jobs import BatchRequest, EnqueueRequest
from rota.core.limits import fold_keys
from rota.core.listing import did_you_mean
from rota.core.observe import UNFINISHED, busiest
from rota.core.policy import TERMINAL_STATES
from rota.base.protocol import Name, rfc3339
from rota.base.specs import JobSpec, checksum
from rota.base.wording import plainly
from rota.store.tokens import token_view
from rota.store.views import job_view

Directive = Literal["quiet", "terminate", "running"]  # running: resume a quiet worker
# Printable, and short enough for a listing; an id is the other way to name a token.
TokenName = Annotated[str, msgspec.Meta(pattern=TOKEN_NAME_PATTERN)]

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
    # the directory's [[schedule]] tables (rota/core/schedules.py checks each)
    schedules: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=10_000)] = []


class TokenRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    scope: Scope
    name: TokenName | None = None  # default: scope and id, as ``rota tokens create``
    queues: Annotated[list[Name], msgspec.Meta(min_length=1)] | None = None  # None: any


# -- jobs -------------------------------------------------------------------------
async def enqueue(request: Request) -> Response:
    principal = need(request, "producer")
    content, status = await enqueued(coordinator_of(request), principal, await read_body(request))
    return JSON(content, status_code=status)


async def enqueued(coordinator: Coordinator, principal: Principal, body: bytes
                   ) -> tuple[Any, int]:
    """``POST /jobs``'s answer (content, status) to a caller its scope lets in: the route
    above, or the protocol's direct one (rota/server/direct.py)."""
    payload = decode_as(body, EnqueueRequest)
    if (refusal := not_ojs(payload)) is not None:
        raise refusal
    [outcome] = await coordinator.enqueue([payload], principal)
    if isinstance(outcome, DomainError):
        raise outcome
    row, created = outcome
    return {"job": job_view(row), "created": created}, 201 if created else 200


async def enqueue_batch(request: Request) -> Response:
    principal = need(request, "producer")
    content, status = await enqueued_batch(coordinator_of(request), principal,
                                           await read_body(request))
    return JSON(content, status_code=status)


async def enqueued_batch(coordinator: Coordinator, principal: Principal, body: bytes
                         ) -> tuple[Any, int]:
    """Many jobs, one transaction; each gets its own status, and a bad one spoils no other."""
    batch: BatchRequest = decode_as(body, BatchRequest)
    parsed: list[EnqueueRequest | DomainError | RequestError] = []
    for raw in batch.jobs:
        try:  # already screened and decoded once, as part of the batch: it is JSON
            item = msgspec.json.decode(raw, type=EnqueueRequest)
            parsed.append(not_ojs(item) or item)
        except msgspec.ValidationError as exc:
            parsed.append(Invalid("invalid_request", plainly(str(exc), EnqueueRequest)))
    valid = [item for item in parsed if isinstance(item, EnqueueRequest)]
    outcomes = iter(await coordinator.enqueue(valid, principal) if valid else [])
    results = []
    for index, item in enumerate(parsed):
        outcome = next(outcomes) if isinstance(item, EnqueueRequest) else item
        if isinstance(outcome, DomainError | RequestError):
            said = {"code": outcome.code, "message": outcome.message}
            if (details := getattr(outcome, "details", None)) is not None:
                said["details"] = details
            results.append({"index": index, "status": status_of(outcome), "error": said})
        else:
            row, created = outcome
            results.append({"index": index, "status": 201 if created else 200,
                            "created": created, "job": job_view(row)})
    return {"results": results}, 200


def not_ojs(payload: EnqueueRequest) -> RequestError | None:
    """Why Rota's own enqueue refuses what only /ojs/v1 may set (docs/ojs.md), or None."""
    if payload.ojs is not None:
        return RequestError(400, "invalid_request", "ojs is set by /ojs/v1 only")
    if OJS_ARGS in payload.args:
        return RequestError(400, "reserved_arg", f"the args key {OJS_ARGS!r} is reserved"
                            " for OJS jobs' positional args (/ojs/v1)")
    return None


async def find_job(request: Request, job_id: str) -> dict[str, Any] | None:
    return await find_job_for(coordinator_of(request), need(request, "producer"), job_id)


async def find_job_for(coordinator: Coordinator, principal: Principal, job_id: str
                       ) -> dict[str, Any] | None:
    """The job the caller names ``job_id``: a producer's own, found under the id
    it is kept under (rota/core/auth.py); to a producer, any other job does not exist, exactly
    as a missing one."""
    row = await coordinator.get_job(principal.stored_id(job_id))
    if row is None and (unscoped := principal.unscoped_id(job_id)) is not None:
        # A job enqueued before producers' ids were their own is kept under the id given.
        row = await coordinator.get_job(unscoped)
    if row is None or principal.scope == "admin" or row["created_by"] == principal.token_id:
        return row
    return None


async def _no_job(request: Request, job_id: str, hint: str = "") -> Response:
    return await no_job(coordinator_of(request), principal_of(request.scope), job_id, hint)


async def no_job(coordinator: Coordinator, principal: Principal, job_id: str, hint: str = ""
                 ) -> Response:
    """The 404 for an id that names no job. To an admin, who names jobs by the ids they
    are kept under, it names a producer's job given that id (kept as <token id>:<id>)."""
    found = await coordinator.kept_as(job_id) if principal.scope == "admin" else []
    return error(404, "not_found", f"no job {job_id}{hint}{kept_hint(found)}")


async def show_job(request: Request) -> Response:
    coordinator, job_id = coordinator_of(request), request.path_params["job_id"]
    row = await find_job(request, job_id)
    if row is None:
        return await _no_job(request, job_id, f" (the bulk action is POST /jobs/{job_id})"
                             if job_id in ("retry", "cancel") else "")
    return JSON(await job_detail(coordinator, row))


async def job_detail(coordinator: Coordinator, row: dict[str, Any]) -> dict[str, Any]:
    """A job as GET /jobs/{id} shows it: its view, its logs, and why it waits (also the
    dashboard's job page)."""
    view = job_view(row)
    view["started"] = coordinator.job_started(row["id"], row["state"])
    view["logs"] = await coordinator.job_logs(row["id"])
    if row["state"] == "available":
        view["waiting_reason"] = coordinator.job_waiting_reason(row)
    elif row["state"] in ("scheduled", "retryable"):
        view["waiting_reason"] = f"{row['state']} until {view['run_at']}"
    return view


async def cancel_job(request: Request) -> Response:
    # A producer may take back what it enqueued (it could as well not have); another
    # token's job does not exist for it, as in GET. Retry stays admin-only: it
    # overrides the spec's retry limits, an operator's call.
    principal = need(request, "producer")
    coordinator, job_id = coordinator_of(request), request.path_params["job_id"]
    if principal.scope != "admin":  # (an admin's cancel needs no extra read)
        row = await find_job(request, job_id)
        if row is None:
            return error(404, "not_found", f"no job {job_id}")
        job_id = row["id"]
    try:
        row, done = await coordinator.cancel(job_id)
    except NoSuchJob:
        return await _no_job(request, job_id)
    return JSON(job_view(row), status_code=200 if done else 202)


async def retry_job(request: Request) -> Response:
    need(request, "admin")
    job_id = request.path_params["job_id"]
    try:
        row = await coordinator_of(request).retry(job_id)
    except NoSuchJob:
        return await _no_job(request, job_id)
    return JSON(job_view(row))


async def job_result(request: Request) -> Response:
    # (The route the protocol does not serve itself: an id percent-encoded, an Expect.)
    answer = asyncio.ensure_future(result_of(
        coordinator_of(request), principal_of(request.scope), request.path_params["job_id"],
        request.query_params.get("wait", "0"), request.url.path))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not answer.done():  # its client left: the wait gives its token's place back now
        answer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await answer
        return Response(status_code=499)  # (read by nobody)
    return answer.result()


async def _client_gone(request: Request) -> None:
    """Returns when the request's client has closed its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def result_of(coordinator: Coordinator, principal: Principal, job_id: str, text: str,
                    path: str) -> Response:
    """``GET /jobs/{id}/result?wait=``'s answer (``path``, for a refusal's words): the
    route above, or the protocol's direct one (rota/server/direct.py)."""
    if not principal.may("producer"):  # (who may ask comes before how it asks)
        raise forbidden(principal, "GET", path, ("producer",))
    # A number as JSON writes one (and str(float)): float() would also take "1_0", "nan",
    # "inf" and " 1 ".
    if not SECONDS.fullmatch(text):
        return error(400, "invalid_wait", "wait must be a number of seconds")
    wait = float(text)
    if not 0 <= wait <= coordinator.settings.max_result_wait:
        return error(400, "invalid_wait",
                     f"wait must be between 0 and {coordinator.settings.max_result_wait} seconds")
    found = await find_job_for(coordinator, principal, job_id)
    if found is None:
        return await no_job(coordinator, principal, job_id)
    if wait > 0:
        hold = coordinator.hold(principal)
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


# -- specs ------------------------------------------------------------------------
async def list_specs(request: Request) -> Response:
    need(request, "producer")  # a producer needs the argument schemas of what it enqueues
    coordinator = coordinator_of(request)
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
    payload: PushRequest = await decode_body(request, PushRequest)
    coordinator = coordinator_of(request)
    # the schedules are checked first: a bad one refuses the push, and nothing is stored
    schedules = coordinator.clockwork.check_push(payload.schedules, payload.specs)
    # stored schedules the new specs would refuse are said, not refused: they wait
    refused = await coordinator.clockwork.args_refused(payload.specs, schedules)
    report = await coordinator.push_specs(payload.specs, dry_run=payload.dry_run)
    changes = await coordinator.clockwork.push(schedules, dry_run=payload.dry_run)
    return JSON({"dry_run": payload.dry_run, "specs": report, "schedules": changes,
                 "args_refused": refused})


async def retire_spec(request: Request) -> Response:
    need(request, "admin")
    body = await read_body(request)
    payload = decode_as(body, RetireRequest) if body.strip() else RetireRequest()
    return JSON(await coordinator_of(request).retire_spec(
        request.path_params["name"], cancel_waiting=payload.cancel_waiting))


async def spec_history(request: Request) -> Response:
    need(request, "admin")
    name = request.path_params["name"]
    coordinator = coordinator_of(request)
    history = await coordinator.spec_history(name)
    if not history:
        guess = did_you_mean(name, coordinator.specs)
        return error(404, "not_found", f"spec {name!r} was never pushed"
                     + (f"; did you mean {guess}?" if guess else ""))
    return JSON({"name": name, "history": history})


# -- tokens (admin only; ``rota tokens --url``) ------------------------------------------
async def create_token(request: Request) -> Response:
    need(request, "admin")
    payload: TokenRequest = await decode_body(request, TokenRequest)
    secret, row = await coordinator_of(request).create_token(payload.scope, payload.name,
                                                           payload.queues)
    return JSON({"token": secret, **token_view(row)}, status_code=201)


async def list_tokens(request: Request) -> Response:
    need(request, "admin")
    rows = await coordinator_of(request).live_tokens()
    return JSON({"tokens": [token_view(row) for row in rows]})


async def revoke_token(request: Request) -> Response:
    need(request, "admin")
    rows = await coordinator_of(request).revoke_token(request.path_params["token"])
    return JSON({"revoked": [token_view(row) for row in rows]})


# -- workers, queues, health ---------------------------------------------------------
async def list_workers(request: Request) -> Response:
    need(request, "admin")
    return JSON({"workers": worker_views(coordinator_of(request))})


def worker_views(coordinator: Coordinator) -> list[dict[str, Any]]:
    """The connected workers as GET /workers shows them (and the dashboard), by id."""
    now = coordinator.clock().mono
    workers = []
    for conn in coordinator.connections.values():
        slot, reg = conn.worker, conn.registration
        matching = coordinator.matching_specs(slot)
        running, prefetched = coordinator.line_counts(conn)
        workers.append({
            "id": slot.id, "hostname": reg.hostname, "pid": reg.pid, "os": reg.os,
            "sdk": reg.sdk, "state": slot.state, "queues": slot.queues, "labels": slot.labels,
            # pull: OJS FETCH (rota/core/pulls.py); endpoint: push execution (GET /endpoints)
            "kind": "endpoint" if is_endpoint(slot.id) else "pull" if conn.conn < 0 else "work",
            "concurrency": slot.concurrency if conn.conn > 0 or is_endpoint(slot.id) else 0, "prefetch": slot.prefetch,
            "active": running, "prefetched": prefetched,
            "capacity": slot.capacity, "specs_matching": matching,
            "specs_mismatching": sorted(set(slot.specs) - set(matching)),
            "directive": conn.directive,
            "cpu_percent": conn.cpu_percent, "memory_rss": conn.memory_rss,
            "alerts": list(conn.alerts),
            "connected_at": rfc3339(conn.connected_at),
            "last_heartbeat_age": round(now - conn.last_seen, 3),
            "heartbeats": conn.frames,
            # lean acks (docs/protocol.md §4.2): idle heartbeats it was sent no ack for,
            # and how long one that holds no job may go without one (null: every beat)
            "lean_acks": reg.lean_acks, "acks_skipped": conn.quiet_acks,
            "idle_ack_interval": conn.ack_window or None,
        })
    return sorted(workers, key=lambda w: w["id"])


async def direct_worker(request: Request) -> Response:
    """Ask one worker to go quiet or terminate (it hears it in its next ack); 202 if it
    is connected to another server on the database, which passes it on."""
    need(request, "admin")
    payload: StateRequest = await decode_body(request, StateRequest)
    done = await coordinator_of(request).direct_workers(
        payload.state, worker_id=request.path_params["worker_id"])
    if done.forwarded:
        return JSON({"workers": done.workers, "state": payload.state, "forwarded": True},
                    status_code=202)
    return JSON({"workers": done.workers, "state": payload.state})


async def direct_workers(request: Request) -> Response:
    """Ask every worker with a label, or all of them, to go quiet or terminate."""
    need(request, "admin")
    payload: StateRequest = await decode_body(request, StateRequest)
    if (payload.label is None) == (not payload.all):
        return error(422, "invalid_request", "give either label or all: true")
    done = await coordinator_of(request).direct_workers(payload.state, label=payload.label,
                                                      every=payload.all)
    return JSON({"workers": done.workers, "state": payload.state, "forwarded": done.forwarded})


async def list_queues(request: Request) -> Response:
    need(request, "admin")
    coordinator = coordinator_of(request)
    views, others = await queue_views(coordinator, limit=coordinator.settings.max_series)
    return JSON({"queues": views, "others": others, "limits": limit_views(coordinator)})


def limit_views(coordinator: Coordinator) -> list[dict[str, Any]]:
    """Each limit in force and its use now: the scope's own, then each key in use (at
    most --max-series keys, the rest summed under the key "(other)")."""
    return [msgspec.to_builtins(use) for use in
            fold_keys(coordinator.limit_use(), coordinator.settings.max_series)]


async def queue_views(coordinator: Coordinator, counts: dict[str, dict[str, int]] | None = None,
                      limit: int | None = None
                      ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every queue as GET /queues shows it, by name; the dashboard brings its own
    ``counts`` (rota/server/dashboard.py: it does not count a million rows every 2 s). With a
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
    for row in coordinator.waiting():
        if row.queue in names:
            waiting.setdefault(row.queue, []).append({
                "spec": row.spec, "available": row.jobs, "reason": row.reason,
                "blocked": row.blocked, "held": dict(row.held),
                # the labels no connected worker has that hold some (5 named, a count more)
                "missing_labels": list(row.missing_labels),
                "missing_labels_more": row.missing_more})
    oldest = await coordinator.oldest_waits()
    prefetched = coordinator.prefetched()
    return [
        {"name": name, "counts": counts.get(name, {}),
         # of counts["active"]: those waiting unstarted in their workers' lines
         "prefetched": prefetched.get(name, 0),
         "workers": sum(1 for w in slots if name in w.queues),
         "waiting": waiting.get(name, []), "paused": name in paused,
         "oldest_available_age": oldest.get(name)}
        for name in sorted(names)
    ], others


async def healthz(request: Request) -> Response:
    """200 even while the store is degraded: the server still serves reads and workers,
    and a restart by a liveness probe would not bring the disk back (docs/operations.md)."""
    coordinator = coordinator_of(request)
    degraded = coordinator.storage_degraded()
    storage = None if degraded is None else {
        "code": degraded.code, "message": degraded.message, "since": rfc3339(degraded.since)}
    return JSON({"status": "ok" if degraded is None else "degraded",
                 "workers": len(coordinator.connections),
                 "live_jobs": coordinator.live_jobs(), "specs": len(coordinator.specs),
                 "uptime": round(coordinator.uptime(), 3), "storage": storage})
