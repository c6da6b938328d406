"""The OJS HTTP binding's producer side, mounted at /ojs (docs/ojs.md): the manifest,
health, and the routes that enqueue, show, cancel and activate jobs.

Each route maps its body with rota/core/ojs_map.py and goes through the same coordinator
calls as Rota's own API (rota/server/api.py); what OJS shares is in rota/server/ojs_base.py.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from rota.base.errors import DomainError
from rota.base.ojs import OJS_VERSION
from rota.core.jobs import EnqueueRequest
from rota.core.ojs_map import OjsRefusal, job_view, ojs_json, ojs_to_request
from rota.server import ojs_ops
from rota.server.api import find_job
from rota.server.api_base import coordinator_of, need
from rota.server.coordinator import Coordinator
from rota.server import pulling  # the worker routes: FETCH, ACK, NACK, heartbeat
from rota.server.ojs_base import (OjsHeaders, OjsJSON, domain_error, exception_handlers,
                                  ojs_body, ojs_error)
from rota.server.ojs_shell import OjsShell
from rota.server.safety import SafetyNet

log = logging.getLogger("rota.server")
MAX_BATCH = 1000  # jobs in one batch (JF §8.3 recommends at most 1,000)

# The OJS conformance level Rota reaches, with tests/ojs/excused.toml's test excused, as
# tests/ojs/run.py measures it, on SQLite and on two servers sharing PostgreSQL (strictly:
# 0); README.md and docs/ojs.md say the same (tests/house/test_docs.py).
CONFORMANCE_LEVEL = 4
try:
    VERSION = importlib.metadata.version("rota")
except importlib.metadata.PackageNotFoundError:  # (run from a source tree)
    VERSION = "unknown"
# Rota's own OJS extensions, named in the manifest.
EXTENSIONS = ["x_rota_specs", "x_rota_attempt"]


async def manifest(request: Request) -> Response:
    settings = coordinator_of(request).settings
    return OjsJSON({
        "specversion": OJS_VERSION,
        "implementation": {"name": "rota", "version": VERSION, "language": "python"},
        "conformance_level": CONFORMANCE_LEVEL, "protocols": ["http"],
        "backend": "sqlite" if settings.database_url is None else "postgresql",
        "extensions": EXTENSIONS})


async def health(request: Request) -> Response:
    """200 while the server answers: "degraded" while the store refuses writes (it still
    serves reads and workers, as /healthz says)."""
    coordinator = coordinator_of(request)
    degraded = coordinator.storage_degraded()
    backend = {"type": "sqlite" if coordinator.settings.database_url is None else "postgresql",
               "status": "ok" if degraded is None else "degraded"}
    if degraded is not None:
        backend["error"] = degraded.message
    return OjsJSON({"status": "ok" if degraded is None else "degraded",
                    "version": VERSION, "uptime_seconds": round(coordinator.uptime()),
                    "backend": backend})


# -- jobs -------------------------------------------------------------------------------
async def push(request: Request) -> Response:
    """PUSH: one job. 201 with its view; 200 with the job that holds its unique key (its
    on_conflict "ignore"); 409 duplicate for an id that exists, even as the same job."""
    principal = need(request, "producer")
    job = _registered(request, ojs_to_request(await ojs_body(request), time.time()))
    coordinator = coordinator_of(request)
    [outcome] = await coordinator.enqueue([job], principal)
    if isinstance(outcome, DomainError):
        return domain_error(outcome)
    # Its rate_limit sets its queue's rate (docs/ojs.md): once it is stored, so only a
    # token that may use the queue, with a job the queue took, sets it.
    await coordinator.ojs_rates([job])
    row, created = outcome
    if not created and row.get("unique_met") != "existing":
        return _duplicate(row)
    return OjsJSON({"job": job_view(row, time.time())}, status_code=201 if created else 200)


async def push_batch(request: Request) -> Response:
    """Many jobs, all or nothing: one the mapping refuses and none is stored (400, its
    index in details)."""
    principal = need(request, "producer")
    envelope = ojs_json(await ojs_body(request))
    given = envelope.get("jobs") if isinstance(envelope, dict) else None
    if not isinstance(given, list) or not 1 <= len(given) <= MAX_BATCH:
        raise OjsRefusal(400, "invalid_request", "validation_error", "a batch is an object"
                         f" whose jobs is a list of 1 to {MAX_BATCH} jobs")
    now = time.time()
    jobs = []
    for index, raw in enumerate(given):
        try:
            jobs.append(_registered(request, ojs_to_request(raw, now)))
        except OjsRefusal as exc:
            raise OjsRefusal(exc.status, exc.code, exc.type, f"jobs[{index}]: {exc.message}",
                             {"index": index}) from None
    # All or nothing: a job the engine refuses (a token's queue, a spec's args) leaves no
    # other stored.
    coordinator = coordinator_of(request)
    outcomes = await coordinator.enqueue(jobs, principal, all_or_nothing=True)
    refusals = [o for o in outcomes if isinstance(o, DomainError)]
    if refusals:  # the refusal itself, rather than another job's "unstored for its sake"
        return domain_error(next((r for r in refusals if r.code != "unstored"), refusals[0]))
    await coordinator.ojs_rates(jobs)  # (as for one job: once they are stored)
    for outcome in outcomes:
        if not outcome[1] and outcome[0].get("unique_met") != "existing":
            return _duplicate(outcome[0])
    now = time.time()
    views = [job_view(row, now) for row, _ in outcomes]  # type: ignore[misc]
    return OjsJSON({"jobs": views, "count": len(views)}, status_code=201)


async def info(request: Request) -> Response:
    row = await _find(request)
    return OjsJSON({"job": job_view(row, time.time())})


async def cancel(request: Request) -> Response:
    """CANCEL: a waiting job is cancelled at once; one a /work worker runs is asked to
    stop (200, state active, cancel_requested); a terminal one is 409."""
    row = await _find(request)
    # A job a pull worker holds is cancelled at once by the engine's cancel (H2's hook in
    # Intake.cancel); through the server that holds it, when that is another.
    if (relayed := await pulling.relayed_cancel(request, row)) is not None:
        return relayed
    row, _ = await coordinator_of(request).cancel(row["id"])
    return OjsJSON({"job": job_view(row, time.time())})


async def activate(request: Request) -> Response:
    row = await _find(request)
    row = await request.app.state.ojs.activate(row["id"])
    return OjsJSON({"job": job_view(row, time.time())})


async def reset(request: Request) -> Response:
    """Empty the store (a test switch): 404, as any unknown path, without it."""
    if not coordinator_of(request).settings.unsafe_test_endpoints:
        raise HTTPException(404)
    need(request, "admin")
    await request.app.state.ojs.reset()
    return OjsJSON({"reset": True})


def _registered(request: Request, job: EnqueueRequest) -> EnqueueRequest:
    """Under --ojs-registered-types-only, a job of a type no spec describes is refused."""
    coordinator = coordinator_of(request)
    if coordinator.settings.ojs_registered_types_only and job.spec not in coordinator.specs:
        raise OjsRefusal(400, "invalid_job_type", "validation_error",
                         f"type {job.spec!r} has no spec, and this server takes only"
                         " registered types (--ojs-registered-types-only): push its spec"
                         " with 'rota specs push' first")
    return job


def _duplicate(row: dict[str, Any]) -> Response:
    return ojs_error(409, "duplicate", f"job {row['id']} exists already (state"
                     f" {row['state']}); an id is given once", type="conflict",
                     details={"job_id": row["id"], "state": row["state"]})


async def _find(request: Request) -> dict[str, Any]:
    """The job the path names, as the caller may see it (a producer token its own:
    rota/server/api.py); 404 not_found otherwise."""
    job_id = request.path_params["job_id"]
    row = await find_job(request, job_id)
    if row is None:
        raise OjsRefusal(404, "not_found", "not_found", f"no job {job_id}")
    return row


routes = [
    Route("/manifest", manifest, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/v1/jobs", push, methods=["POST"]),
    Route("/v1/jobs/batch", push_batch, methods=["POST"]),
    Route("/v1/jobs/{job_id}", info, methods=["GET"]),
    Route("/v1/jobs/{job_id}", cancel, methods=["DELETE"]),
    Route("/v1/jobs/{job_id}/activate", activate, methods=["POST"]),
    Route("/v1/admin/reset", reset, methods=["POST"]),
    *ojs_ops.routes,  # queues, dead letter, events (admin)
]


def ojs_app(coordinator: Coordinator, extra: list[BaseRoute] | None = None) -> Starlette:
    """The /ojs mount: its own exception handlers, so that every refusal under it is in
    OJS's shape, and its headers on every answer. ``extra``: more OJS route tables
    (operations, cron and workflows)."""
    app = Starlette(routes=[*routes, *pulling.routes, *(extra or [])],
                    exception_handlers=exception_handlers,  # type: ignore[arg-type]
                    # A bug under /ojs: its JSON 500 (rota/server/safety.py) with OJS's
                    # headers, before this app's own ServerErrorMiddleware sends plain text.
                    middleware=[Middleware(OjsHeaders), Middleware(SafetyNet)])
    app.state.coordinator = coordinator
    app.state.ojs = OjsShell(coordinator)
    if coordinator.settings.unsafe_test_endpoints:
        log.warning("UNSAFE TEST ENDPOINTS ARE ON (--unsafe-test-endpoints): POST"
                    " /ojs/v1/admin/reset empties the store. Never in production.")
    return app
