"""The dashboard's workflow pages: the workflows (newest first, by state and name) and one
workflow's tree of steps with their states, each job linking to its page; its Cancel and
Retry. Through the same Coordinator calls as ``GET /workflows`` and the other workflow
routes (rota/server/workflows.py)."""

from __future__ import annotations

from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from rota.base.errors import DomainError, NotFound
from rota.core.workflows import STATES
from rota.server.api_base import coordinator_of, need
from rota.server.pages import FILTERS, action, render

PAGE = 50  # workflows a page of the list shows


def shown_state(state: str) -> str:
    """The pill class of a workflow's or node's state: the job states' colours (a running
    workflow as an active job, a failed one as a discarded job)."""
    return {"running": "active", "failed": "discarded"}.get(state, state)


FILTERS["flowstate"] = shown_state


async def workflows_page(request: Request) -> Response:
    principal = need(request, "admin")
    params = request.query_params
    state, name = params.get("state") or None, params.get("name") or None
    after = params.get("after") or None
    form = {"state": state or "", "name": name or ""}
    error = None
    if state is not None and state not in STATES:
        error = f"state must be one of {', '.join(STATES)}, not {state!r}"
    else:
        try:
            page = await coordinator_of(request).composing.page(principal, state=state, name=name,
                                                           limit=PAGE, after=after)
        except DomainError as exc:  # a cursor edited by hand
            error = exc.message
    if error is not None:
        return render(request, "workflows", status=400, workflows=[], first=None, older=None,
                      form=form, states=STATES, error=error)
    rows, after_next = page["workflows"], page["next"]
    kept = {key: value for key, value in form.items() if value}
    older = None if after_next is None else "/ui/workflows?" + urlencode(
        {**kept, "after": after_next})
    first = None if after is None else "/ui/workflows" + (f"?{urlencode(kept)}" if kept else "")
    return render(request, "workflows", workflows=rows, first=first, older=older, form=form,
                  states=STATES, error=None)


async def workflow_page(request: Request) -> Response:
    principal = need(request, "admin")
    workflow_id = request.path_params["workflow_id"]
    try:
        view = await coordinator_of(request).composing.view(workflow_id, principal)
    except NotFound:
        return render(request, "missing", status=404, what=f"workflow {workflow_id}")
    return render(request, "workflow", wf=view,
                  cancellable=view["state"] in ("pending", "running"),
                  retryable=view["state"] == "failed")


async def cancel_workflow(request: Request, form: dict[str, str]) -> str:
    view = await coordinator_of(request).composing.cancel(request.path_params["workflow_id"],
                                                         need(request, "admin"))
    return f"workflow {view['id']} is {view['state']}"


async def retry_workflow(request: Request, form: dict[str, str]) -> str:
    view = await coordinator_of(request).composing.retry(request.path_params["workflow_id"],
                                                        need(request, "admin"))
    return f"workflow {view['id']} runs again from its failed steps"


routes: list[BaseRoute] = [
    Route("/ui/workflows", workflows_page, methods=["GET"]),
    Route("/ui/workflows/{workflow_id:path}/cancel", action(cancel_workflow), methods=["POST"]),
    Route("/ui/workflows/{workflow_id:path}/retry", action(retry_workflow), methods=["POST"]),
    Route("/ui/workflows/{workflow_id:path}", workflow_page, methods=["GET"]),
]
