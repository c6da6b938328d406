"""The OJS cron and workflow routes (/ojs/v1/cron, /ojs/v1/workflows): each body mapped by
rota/core/ojs_flows_map.py, then carried out by Rota's own schedules
(rota/server/clockwork.py) and workflows (rota/server/composing.py), so that an OJS cron
job is a Rota schedule and an OJS workflow a Rota workflow (docs/ojs.md)."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rota.base.errors import Invalid
from rota.base.inputs import BadJson, screen
from rota.core.ojs_flows_map import (CRON_CODES, cron_definition, cron_view, workflow_definition,
                                     workflow_view)
from rota.core.ojs_map import OjsRefusal
from rota.server.api_base import coordinator_of, need, read_body
from rota.server.ojs_base import OjsJSON

TERMINAL = ("completed", "failed", "cancelled")  # a workflow's


async def _body(request: Request) -> Any:
    """The JSON body, within Rota's limits; 400 ``invalid_payload`` if it is not JSON."""
    raw = await read_body(request)
    try:
        return msgspec.json.decode(screen(raw))
    except BadJson as exc:
        raise OjsRefusal(400, "invalid_payload", "validation_error", exc.message) from None
    except msgspec.DecodeError as exc:
        raise OjsRefusal(400, "invalid_payload", "validation_error",
                         f"the body is not JSON: {exc}") from None


# -- cron (admin, as Rota's /schedules) --------------------------------------------------
async def list_crons(request: Request) -> Response:
    need(request, "admin")
    listed = await coordinator_of(request).clockwork.list()
    crons = [cron_view(schedule) for schedule in listed["schedules"]]
    return OjsJSON({"crons": crons, "count": len(crons)})


async def add_cron(request: Request) -> Response:
    """Register a cron job, or replace the one of that name (ojs-cron.md §8.1's upsert):
    201 when new, 200 when replaced."""
    need(request, "admin")
    coordinator = coordinator_of(request)
    definition = cron_definition(await _body(request), coordinator.clock().wall)
    name = definition.get("name")
    if not isinstance(name, str):
        raise OjsRefusal(400, "invalid_request", "validation_error",
                         "name is required: the cron job's name ([a-z0-9][a-z0-9.-]*)")
    try:  # (its template's job is built once now: what the intake refuses is said here)
        shown, change = await coordinator.clockwork.put(name, definition)
    except Invalid as exc:
        if exc.code not in CRON_CODES:
            raise  # (in OJS's shape by ojs_base: invalid_request, invalid_job_type)
        raise OjsRefusal(400, CRON_CODES[exc.code], "validation_error", exc.message,
                         {"rota_code": exc.code}) from None
    return OjsJSON({"cron": cron_view(shown)}, status_code=201 if change == "new" else 200)


async def show_cron(request: Request) -> Response:
    need(request, "admin")
    shown = await coordinator_of(request).clockwork.get(request.path_params["name"])
    return OjsJSON({"cron": cron_view(shown)})


async def toggle_cron(request: Request) -> Response:
    """``{"enabled": false}`` pauses a cron job, ``true`` resumes it (ojs-cron.md §8.5)."""
    need(request, "admin")
    body = await _body(request)
    enabled = body.get("enabled") if isinstance(body, dict) else None
    if not isinstance(enabled, bool) or set(body) != {"enabled"}:
        raise OjsRefusal(400, "invalid_request", "validation_error",
                         'the body is {"enabled": true} or {"enabled": false}')
    shown = await coordinator_of(request).clockwork.pause(request.path_params["name"],
                                                          not enabled)
    return OjsJSON({"cron": cron_view(shown)})


async def delete_cron(request: Request) -> Response:
    need(request, "admin")
    shown = await coordinator_of(request).clockwork.delete(request.path_params["name"])
    return OjsJSON({"cron": cron_view(shown)})


# -- workflows (a producer's own, as Rota's /workflows) ----------------------------------
async def create_workflow(request: Request) -> Response:
    principal = need(request, "producer")
    coordinator = coordinator_of(request)
    definition = workflow_definition(await _body(request), coordinator.clock().wall)
    shown, created = await coordinator.composing.create(definition, principal, ojs=True)
    return OjsJSON({"workflow": workflow_view(shown)}, status_code=201 if created else 200)


async def show_workflow(request: Request) -> Response:
    principal = need(request, "producer")
    shown = await coordinator_of(request).composing.view(request.path_params["id"], principal)
    return OjsJSON({"workflow": workflow_view(shown)})


async def cancel_workflow(request: Request) -> Response:
    """Cancel a running workflow: 409 ``conflict`` once it has ended (ojs-workflows §11.3)."""
    principal = need(request, "producer")
    composing = coordinator_of(request).composing
    workflow_id = request.path_params["id"]
    state = (await composing.view(workflow_id, principal))["state"]
    if state in TERMINAL:
        raise OjsRefusal(409, "conflict", "conflict", f"workflow {workflow_id} has ended"
                         f" ({state}): there is nothing to cancel",
                         {"current_state": state})
    return OjsJSON({"workflow": workflow_view(await composing.cancel(workflow_id, principal))})


routes = [
    Route("/v1/cron", list_crons, methods=["GET"]),
    Route("/v1/cron", add_cron, methods=["POST"]),
    Route("/v1/cron/{name}", show_cron, methods=["GET"]),
    Route("/v1/cron/{name}", toggle_cron, methods=["PATCH"]),
    Route("/v1/cron/{name}", delete_cron, methods=["DELETE"]),
    Route("/v1/workflows", create_workflow, methods=["POST"]),
    Route("/v1/workflows/{id}", show_workflow, methods=["GET"]),
    Route("/v1/workflows/{id}", cancel_workflow, methods=["DELETE"]),
]
