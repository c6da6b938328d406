"""The OJS worker routes (FETCH, ACK, NACK, heartbeat) over the engine's pull workers
(rota/core/pulls.py), and the ``Mailbox`` that carries what the engine sends a pull
worker into the HTTP request that waits for it.

A pull worker's connection is a negative conn with no socket: the Coordinator hands a
``Send`` to it to the mailbox (rota/server/mailbox.py), which resolves the FETCH or the
ACK waiting for it. Answers are read from the rows (``job_view``), after the commit that
made them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rota.base import protocol as p
from rota.base.errors import StorageError
from rota.base.ojs import OJS_MEDIA
from rota.base.tls import default_trust
from rota.base.wording import plainly
from rota.core.auth import Principal
from rota.core.ojs_map import OjsRefusal, job_view, ojs_json, ojs_time
from rota.core.pulls import MAX_FETCH, Settled, is_pull, nack_error, pull_id
from rota.server.api_base import coordinator_of, need
from rota.server.coordinator import Coordinator
from rota.server.ojs_base import OjsJSON, ojs_body, ojs_error

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("rota.server")
ANSWER_WAIT = 5.0  # seconds a FETCH waits for its round's assign (then 503)
ACK_WAIT = 30.0  # seconds an ACK or NACK waits for its result's commit (then 503)
# Rounds one FETCH may run while each loses its rows (several servers: copies of jobs
# another server reserved meanwhile; each lost round forgets the ones it met).
FETCH_ROUNDS = 10
REJECTED_HEADER = "X-Rota-Rejected-Specs"
WAITING_HEADER = "X-Rota-Waiting-Specs"  # an empty FETCH: versioned types it did not declare
FORWARDED = "x-rota-forwarded-by"  # a request another server sent on: not sent on again

Millis = Annotated[int, msgspec.Meta(ge=1, le=p.MAX_COUNT)]
Specs = Annotated[dict[p.Name, p.Checksum], msgspec.Meta(max_length=1000)]


class FetchBody(msgspec.Struct, kw_only=True):
    queues: Annotated[list[p.Name], msgspec.Meta(min_length=1, max_length=100)] = (
        msgspec.field(default_factory=lambda: ["default"]))
    count: Annotated[int, msgspec.Meta(ge=1, le=MAX_FETCH)] = 1
    worker_id: p.Name | None = None
    visibility_timeout_ms: Millis | None = None
    x_rota_specs: Specs | None = None


class ResultBody(msgspec.Struct, kw_only=True):
    job_id: p.JobId
    worker_id: p.Name | None = None
    result: Any = None
    error: dict[str, Any] | None = None
    requeue: bool = False
    x_rota_attempt: Annotated[int, msgspec.Meta(ge=0, le=p.MAX_COUNT)] | None = None


class BeatBody(msgspec.Struct, kw_only=True):
    worker_id: p.Name | None = None
    active_jobs: Annotated[list[p.JobId], msgspec.Meta(max_length=10_000)] = []
    visibility_timeout_ms: Millis | None = None
    x_rota_specs: Specs | None = None


def _decoded(body: bytes, kind: type[Any]) -> Any:
    """The body as ``kind``: 400 invalid_payload if it is not JSON Rota accepts (depth,
    surrogates: ojs_json), 400 invalid_request naming the field in plain words if not."""
    data = ojs_json(body)
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise OjsRefusal(400, "invalid_request", "validation_error",
                         plainly(str(exc), kind, lambda: data)) from None


async def _waited(coordinator: Coordinator, conn: int, future: asyncio.Future[Any],
                  seconds: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(asyncio.shield(future), seconds)
    except TimeoutError:
        raise StorageError("backend_unavailable", f"{what} did not come back within"
                           f" {seconds:g}s; try again", 1) from None
    finally:
        coordinator.mailbox.forget(conn, future)


async def _rows(coordinator: Coordinator, ids: list[str]) -> list[dict[str, Any]]:
    rows = await asyncio.gather(*(coordinator.get_job(job_id) for job_id in ids))
    return [row for row in rows if row is not None]


def _me(worker_id: str | None, principal: Principal) -> str | None:
    """The worker a request speaks for: its ``worker_id``; without one, its token's own
    anonymous worker (``anonymous.<token id>``), or the one ``anonymous`` with tokens off,
    so that two tokens' workers that send no id do not share one."""
    if worker_id is not None or principal.token_id is None:
        return worker_id
    return f"anonymous.{principal.token_id}"


# -- the routes ----------------------------------------------------------------------
async def fetch(request: Request) -> Response:
    """Up to ``count`` jobs from ``queues`` (in order), each now active for this worker
    for its visibility timeout; 200 ``{"jobs": []}`` when none is ready."""
    principal = need(request, "worker")
    coordinator = coordinator_of(request)
    body: FetchBody = _decoded(await ojs_body(request), FetchBody)
    visibility = (None if body.visibility_timeout_ms is None
                  else body.visibility_timeout_ms / 1000.0)
    if coordinator.mailbox.barrier is not None:  # several servers: theirs seen first
        await coordinator.mailbox.barrier()
    engine = coordinator.engine
    for _ in range(FETCH_ROUNDS):  # (a round that lost its rows to another server: again)
        fetched = engine.pull_fetch(_me(body.worker_id, principal), principal, body.queues,
                                    body.count,
                                    visibility, body.x_rota_specs, coordinator.clock())
        future = coordinator.mailbox.expect_assign(fetched.conn)
        coordinator.apply(fetched.effects)
        assign: p.Assign = await _waited(coordinator, fetched.conn, future, ANSWER_WAIT,
                                         "the round's reservation")
        if assign.jobs or not fetched.planned:
            break
    now = coordinator.clock().wall
    views = [job_view(row, now) for row in await _rows(coordinator, [j.id for j in assign.jobs])]
    response = OjsJSON({"jobs": views})
    if fetched.verdict is not None and fetched.verdict.rejected:
        response.headers[REJECTED_HEADER] = msgspec.json.encode(
            fetched.verdict.rejected).decode()
    if not views and fetched.undeclared:
        response.headers[WAITING_HEADER] = msgspec.json.encode(fetched.undeclared).decode()
    return response


async def ack(request: Request) -> Response:
    """The job completed (with ``result``)."""
    return await _settle(request, "completed")


async def nack(request: Request) -> Response:
    """The job's attempt failed (``error``): retried or discarded by its retry policy;
    with ``requeue``, given back at once, the attempt not counted."""
    return await _settle(request, "failed")


async def _settle(request: Request, outcome: p.Outcome) -> Response:
    principal = need(request, "worker")
    coordinator = coordinator_of(request)
    raw = await ojs_body(request)
    body: ResultBody = _decoded(raw, ResultBody)
    me = _me(body.worker_id, principal)  # (the holder is checked only when it is named)
    job_id = coordinator.engine.kept_ids(me, [body.job_id])[body.job_id]
    error = None if outcome == "completed" else nack_error(body.error)
    settled = coordinator.engine.pull_result(
        body.worker_id, job_id, outcome, result=body.result, error=error,
        attempt=body.x_rota_attempt, requeue=body.requeue and outcome == "failed",
        principal=principal, now=coordinator.clock())
    if settled.refusal is not None or settled.conn is None:
        if (relayed := await _relay(request, coordinator, job_id, raw)) is not None:
            return relayed  # another server holds it (several servers on one database)
        return await _refused(coordinator, job_id, settled)
    conn = settled.conn
    if settled.seq is None:  # a requeue: answered once its write commits
        coordinator.apply(settled.effects, source=conn)
        await coordinator.settled(conn)
    else:
        future = coordinator.mailbox.expect_ack(conn, settled.seq)
        coordinator.apply(settled.effects, source=conn)
        frame: p.Ack = await _waited(coordinator, conn, future, ACK_WAIT, "the result's commit")
        if job_id not in frame.accepted:
            reason = "; ".join(r.reason for r in frame.rejected) or "the result was refused"
            if "could not be stored" in reason:
                raise StorageError("backend_unavailable", reason, 1)
            return await _refused(coordinator, job_id, Settled(None, None, [], reason))
    row = await coordinator.get_job(job_id)
    if row is None:  # (a retention that ran at once)
        return ojs_error(404, "not_found", f"no job {body.job_id}", type="not_found")
    return OjsJSON(_answer(row, outcome, coordinator.clock().wall))


def _answer(row: dict[str, Any], outcome: str, now: float) -> dict[str, Any]:
    """An ACK's or NACK's answer: the job's id (as ``id`` and ``job_id``), its state, and
    what comes next."""
    view = job_view(row, now)
    answer: dict[str, Any] = {"id": view["id"], "job_id": view["id"], "state": view["state"],
                              "attempt": view["attempt"]}
    if outcome == "completed":
        answer["acknowledged"] = True
    if "max_attempts" in view:
        answer["max_attempts"] = view["max_attempts"]
    for name in ("completed_at", "discarded_at", "cancelled_at", "result", "error"):
        if name in view:
            answer[name] = view[name]
    if row["state"] == "retryable" and row.get("run_at") is not None:
        answer["next_attempt_at"] = ojs_time(row["run_at"])
        answer["retry_delay_ms"] = view.get("retry_delay_ms",
                                            max(0, round((row["run_at"] - now) * 1000)))
    answer["job"] = view
    return answer


async def _refused(coordinator: Coordinator, job_id: str, settled: Settled) -> Response:
    """409 ``conflict`` naming the job's state (from its row), or 404 if there is none."""
    row = await coordinator.get_job(job_id)
    if row is None:
        return ojs_error(404, "not_found", f"no job {job_id}", type="not_found")
    state = job_view(row, coordinator.clock().wall)["state"]
    return ojs_error(409, "conflict", f"job {job_id} cannot be settled by this request:"
                     f" {settled.refusal}", type="conflict",
                     details={"current_state": state, "job_id": job_id})


async def heartbeat(request: Request) -> Response:
    """The worker is alive and runs ``active_jobs``: their leases start again. The
    answer says the state the server wants it in (running, quiet or terminate)."""
    principal: Principal = need(request, "worker")
    coordinator = coordinator_of(request)
    raw = await ojs_body(request)
    body: BeatBody = _decoded(raw, BeatBody)
    visibility = (None if body.visibility_timeout_ms is None
                  else body.visibility_timeout_ms / 1000.0)
    now = coordinator.clock()
    me = _me(body.worker_id, principal)
    shown = {kept: j for j, kept in coordinator.engine.kept_ids(me,
                                                                 body.active_jobs).items()}
    ids = list(shown)
    beat = coordinator.engine.pull_beat(me, principal, ids, visibility,
                                        body.x_rota_specs, now)
    elsewhere, said = await _beat_elsewhere(request, coordinator, [
        j for j in ids if j not in beat.extended], msgspec.json.decode(raw))
    state = beat.state
    if said and p.STATE_RANK[said] > p.STATE_RANK[state]:  # asked there: here too
        coordinator.direct([pull_id(me)], said)
        state = said
    response = OjsJSON({"state": state, "directive": state,
                        "jobs_extended": [shown.get(j, j) for j in beat.extended + elsewhere],
                        "server_time": ojs_time(now.wall)})
    if beat.verdict is not None and beat.verdict.rejected:
        response.headers[REJECTED_HEADER] = msgspec.json.encode(beat.verdict.rejected).decode()
    return response


# -- several servers on one database: a job another server holds ----------------------
async def _relay(request: Request, coordinator: Coordinator, job_id: str, raw: bytes
                 ) -> Response | None:
    """An ACK or NACK of a job whose row another live server holds: sent on to it, and
    its answer relayed (None: not held elsewhere, or that server did not answer)."""
    if not coordinator.shares_database() or FORWARDED in request.headers:
        return None
    row = await coordinator.get_job(job_id)
    if row is None or row["state"] != "active":
        return None
    reply = await _forward(request, coordinator, row.get("server_id"), raw)
    if reply is None:
        return None
    return Response(reply.content, status_code=reply.status_code, media_type=OJS_MEDIA)


async def _beat_elsewhere(request: Request, coordinator: Coordinator, ids: list[str],
                          body: dict[str, Any]) -> tuple[list[str], str | None]:
    """The jobs of a heartbeat that other servers hold: each server hears its own; the
    ones they extended, and the strictest state they want the worker in."""
    if not ids or not coordinator.shares_database() or FORWARDED in request.headers:
        return [], None
    by_server: dict[str, list[str]] = {}
    for row in await _rows(coordinator, ids):
        if row["state"] == "active" and row.get("server_id"):
            by_server.setdefault(row["server_id"], []).append(row["id"])
    extended: list[str] = []
    said: str | None = None
    for server, held in by_server.items():
        part = msgspec.json.encode({**body, "active_jobs": held})
        reply = await _forward(request, coordinator, server, part)
        if reply is not None and reply.status_code == 200:
            answer = reply.json()
            extended += answer.get("jobs_extended", [])
            if answer.get("state") in p.STATE_RANK and (
                    said is None or p.STATE_RANK[answer["state"]] > p.STATE_RANK[said]):
                said = answer["state"]
    return extended, said


async def relayed_cancel(request: Request, row: dict[str, Any]) -> Response | None:
    """An OJS CANCEL of a job a pull worker holds through another server: sent on to
    that server, which cancels it at once (its answer relayed); None for any other job."""
    if row["state"] != "active" or not is_pull(row.get("worker_id")):
        return None
    reply = await _forward(request, coordinator_of(request), row.get("server_id"), b"")
    if reply is None:
        return None
    return Response(reply.content, status_code=reply.status_code, media_type=OJS_MEDIA)


async def _forward(request: Request, coordinator: Coordinator, server: str | None,
                   body: bytes) -> httpx.Response | None:
    """This request (its method and path) with ``body``, to ``server`` (by its
    ``servers.url``), with the same Authorization; None if it is this server, unknown,
    or unreachable."""
    if (server is None or server == coordinator.server_id or FORWARDED in request.headers
            or not coordinator.shares_database()):
        return None
    url = await coordinator.store.server_url(server)
    if not url:
        return None
    scheme = "https" if coordinator.settings.ssl_certfile else "http"
    headers = {name: value for name in ("authorization", "content-type", "ojs-version")
               if (value := request.headers.get(name)) is not None}
    headers[FORWARDED] = coordinator.server_id  # never passed on again (no loop)
    import httpx  # (here: only servers sharing a database forward; see rota/server/outbound.py)

    try:
        async with httpx.AsyncClient(timeout=ACK_WAIT + 5.0, verify=default_trust()) as client:
            reply = await client.request(request.method, f"{scheme}://{url}{request.url.path}",
                                         content=body, headers=headers)
    except httpx.HTTPError as exc:
        log.warning("forward %s to server=%s failed: %s", request.url.path, server, exc)
        return None
    log.info("forwarded %s to server=%s: %d", request.url.path, server, reply.status_code)
    return reply


routes = [
    Route("/v1/workers/fetch", fetch, methods=["POST"]),
    Route("/v1/workers/ack", ack, methods=["POST"]),
    Route("/v1/workers/nack", nack, methods=["POST"]),
    Route("/v1/workers/heartbeat", heartbeat, methods=["POST"]),
]
