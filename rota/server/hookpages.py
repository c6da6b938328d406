"""The dashboard's webhooks page: each subscription (URL, kinds, filter) with its latest
deliveries and their answers, and a "Send test" button. Through the same calls as the
webhooks API (rota/server/hookapi.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from rota.base.errors import RequestError
from rota.server.api_base import coordinator_of, need
from rota.server.pages import action, render

SHOWN = 10  # deliveries shown per subscription


async def webhooks_page(request: Request) -> Response:
    need(request, "admin")
    hooks = coordinator_of(request).webhooks
    subs = await hooks.list()
    for sub in subs:
        sub["deliveries"] = await hooks.deliveries(sub["id"], SHOWN, None)
    return render(request, "webhooks", webhooks=subs)


async def send_test(request: Request, form: dict[str, str]) -> str:
    sub_id = request.path_params["webhook_id"]
    try:
        got = await coordinator_of(request).webhooks.test(sub_id)
    except RequestError as exc:
        return f"refused: {exc.message}"
    if got["ok"]:
        return f"test delivery to {sub_id}: HTTP {got['status']} in {got['ms']:g} ms"
    return f"refused: the test delivery to {sub_id} failed: {got['error']}"


routes: list[BaseRoute] = [
    Route("/ui/webhooks", webhooks_page, methods=["GET"]),
    Route("/ui/webhooks/{webhook_id}/test", action(send_test), methods=["POST"]),
]
