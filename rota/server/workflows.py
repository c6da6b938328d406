"""The workflow routes: POST /workflows (a chain, group or batch, stored whole), GET
/workflows and /workflows/{id}, DELETE /workflows/{id} (cancel), POST
/workflows/{id}/retry. Thin: the shell's rota/server/composing.py does each."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from rota.base.errors import RequestError
from rota.core.auth import Principal, Scope
from rota.core.workflows import STATES
from rota.server.api_base import JSON, coordinator_of, decode_as, need, read_body

LIST_PARAMS = ("state", "name", "limit", "after")
DEFAULT_LIMIT, MAX_LIMIT = 50, 500


async def create_workflow(request: Request) -> Response:
    """Creating a workflow takes what enqueueing does (a producer token)."""
    principal = need(request, "producer")
    data = decode_as(await read_body(request), Any)
    shown, created = await coordinator_of(request).composing.create(data, principal)
    return JSON({"workflow": shown, "created": created}, status_code=201 if created else 200)


async def _one(request: Request, scope: Scope,
               act: Callable[[str, Principal], Awaitable[dict[str, Any]]]) -> Response:
    """A route on one workflow: the caller's scope checked, then ``act``'s view."""
    principal = need(request, scope)
    return JSON(await act(request.path_params["workflow_id"], principal))


async def show_workflow(request: Request) -> Response:
    return await _one(request, "producer", coordinator_of(request).composing.view)


async def list_workflows(request: Request) -> Response:
    """Newest first, a page at a time; a producer sees its own."""
    principal = need(request, "producer")
    query = request.query_params
    unknown = sorted(set(query) - set(LIST_PARAMS))
    if unknown:
        raise RequestError(400, "invalid_filter", f"unknown parameter {unknown[0][:40]!r}:"
                           f" the filters are state and name (and limit, after)")
    for key in LIST_PARAMS:
        if len(query.getlist(key)) > 1:
            raise RequestError(400, "invalid_filter", f"{key} may be given once")
    state = query.get("state") or None
    if state is not None and state not in STATES:
        raise RequestError(422, "invalid_filter", f"state must be one of {', '.join(STATES)}")
    text = query.get("limit")
    if text is not None and not (text.isascii() and text.isdigit() and len(text) <= 3
                                 and 1 <= int(text) <= MAX_LIMIT):
        raise RequestError(400, "invalid_limit", f"limit must be 1 to {MAX_LIMIT}")
    page = await coordinator_of(request).composing.page(
        principal, state=state, name=query.get("name") or None,
        limit=DEFAULT_LIMIT if text is None else int(text), after=query.get("after") or None)
    return JSON(page)


async def cancel_workflow(request: Request) -> Response:
    """A producer may cancel its own workflows, as its own jobs."""
    return await _one(request, "producer", coordinator_of(request).composing.cancel)


async def retry_workflow(request: Request) -> Response:
    """Admin only, as a job's retry: it overrides what the steps' failures decided."""
    return await _one(request, "admin", coordinator_of(request).composing.retry)
