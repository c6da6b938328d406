"""The HTTP routes of cron schedules (admin only): list them, show, add or replace, delete, pause and resume one; rota/server/clockwork.py carries each out."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from rota.base.errors import RequestError
from rota.base.ojs import OJS_ARGS
from rota.core.schedules import name_refusal
from rota.server.api_base import JSON, coordinator_of, decode_as, need, read_body


def _name(request: Request) -> str:
    """The path's schedule name, or 400 ``invalid_name`` with the rule a body's is held to."""
    name: str = request.path_params["name"]
    refused = name_refusal(name)
    if refused is not None:
        raise RequestError(400, "invalid_name", refused)
    return name


async def list_schedules(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).clockwork.list())


async def show_schedule(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).clockwork.get(_name(request)))


async def put_schedule(request: Request) -> Response:
    need(request, "admin")
    name = _name(request)
    data = decode_as(await read_body(request), dict[str, Any])
    args = data.get("args")
    if "ojs" in data or (isinstance(args, dict) and OJS_ARGS in args):
        raise RequestError(400, "invalid_schedule", f"ojs and the args key {OJS_ARGS!r} are"
                           " set by /ojs/v1/cron only")
    shown, change = await coordinator_of(request).clockwork.put(name, data)
    return JSON({"schedule": shown, "change": change},
                status_code=201 if change == "new" else 200)


async def delete_schedule(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).clockwork.delete(_name(request)))


async def pause_schedule(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).clockwork.pause(_name(request), True))


async def resume_schedule(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).clockwork.pause(_name(request), False))
