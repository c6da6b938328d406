"""The two routes a push endpoint uses after it answered a delivery with 202
(rota/core/endpoints.py decides, rota/server/pushing.py runs the deliveries):

- ``POST /jobs/{id}/callback`` ``{"token", "status": "completed"|"failed", "result",
  "error"}``: the attempt's result, answered once it is committed;
- ``POST /jobs/{id}/callback/heartbeat`` ``{"token"}``: the job runs on; its lease (its
  spec's visibility timeout) starts again.

Both authenticate by the per-attempt token the delivery carried, not by a bearer token
(the endpoint has none): the gate lets them through (rota/server/gate.py). A token of an
attempt that moved on gets 409; one that is not the job's, 403.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from rota.base import protocol as p
from rota.base.errors import RequestError, StorageError
from rota.base.logs import printable
from rota.server.api_base import JSON, coordinator_of, decode_body

log = logging.getLogger("rota.server")
COMMIT_WAIT = 30.0  # seconds a callback waits for its result's commit (then 503)


class CallbackError(msgspec.Struct, kw_only=True):
    message: str = "no message"
    type: str | None = None
    code: str | None = None
    retryable: bool = True
    details: Any = None


class CallbackBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    token: str
    status: Literal["completed", "failed"]
    result: Any = None
    error: CallbackError | None = None


class BeatBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    token: str


async def callback(request: Request) -> Response:
    body: CallbackBody = await decode_body(request, CallbackBody)
    error = None
    if body.status == "failed":
        given = body.error or CallbackError()
        error = p.ErrorInfo(type=given.type or given.code or "handler_error",
                            message=p.cut_text(given.message), retryable=given.retryable,
                            details=given.details, code=given.code)
    result = p.Result(job_id=request.path_params["job_id"], attempt=1, outcome=body.status,
                      result=body.result, error=error)
    return await _called(request, body.token, result)


async def callback_beat(request: Request) -> Response:
    body: BeatBody = await decode_body(request, BeatBody)
    return await _called(request, body.token, None)


async def _called(request: Request, token: str, result: p.Result | None) -> Response:
    coordinator = coordinator_of(request)
    job_id = request.path_params["job_id"]
    called = coordinator.engine.endpoint_callback(job_id, token, result, coordinator.clock())
    if called.refusal is not None:
        status, code = (403, "invalid_token") if called.state is None and "token" in \
            called.refusal else (409, "stale_attempt")
        # (the id is the caller's, from the path: never raw into the log)
        log.warning("callback refused job=%s: %s", printable(job_id), called.refusal)
        raise RequestError(status, code, called.refusal)
    if called.seq is None:  # a heartbeat
        coordinator.apply(called.effects)
        return JSON({"job_id": job_id, "state": "active"})
    future = coordinator.mailbox.expect_ack(called.conn, called.seq)
    coordinator.apply(called.effects, source=called.conn)
    try:
        frame: p.Ack = await asyncio.wait_for(asyncio.shield(future), COMMIT_WAIT)
    except TimeoutError:
        raise StorageError("backend_unavailable", f"the result's commit did not come back"
                           f" within {COMMIT_WAIT:g}s; try again", 1) from None
    finally:
        coordinator.mailbox.forget(called.conn, future)
    if job_id not in frame.accepted:
        reason = "; ".join(r.reason for r in frame.rejected) or "the result was refused"
        raise RequestError(409, "stale_attempt", reason)
    row = await coordinator.get_job(job_id)
    return JSON({"job_id": job_id, "state": row["state"] if row else body_state(result)})


def body_state(result: p.Result | None) -> str:
    return "completed" if result is not None and result.outcome == "completed" else "failed"
