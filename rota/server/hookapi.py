"""The HTTP routes of webhooks out (admin only): subscriptions (add, list, show, change,
delete), a subscription's delivery log, a test delivery and a secret's rotation;
rota/server/hooks.py carries each out. The request and answer shapes are here, for the
OpenAPI document.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from rota.base.errors import RequestError
from rota.core import webhooks as wh
from rota.server.api_base import JSON, coordinator_of, decode_as, need, read_body

STATES = ("pending", "delivered", "dead")
MAX_LIMIT = wh.KEEP


class WebhookRequest(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    kinds: list[str]  # GET /events kinds, or ["*"]
    filter: dict[str, str] | None = None  # any of spec, queue, worker
    enabled: bool = True


class WebhookChange(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    url: str | None = None
    kinds: list[str] | None = None
    filter: dict[str, str] | None = None  # {} clears it
    enabled: bool | None = None


class WebhookView(msgspec.Struct, kw_only=True):
    id: str
    url: str
    kinds: list[str]
    filter: dict[str, str]
    enabled: bool
    created_at: str
    rotated_at: str | None


class NewWebhook(WebhookView, kw_only=True):
    secret: str  # shown at creation and rotation only


class WebhookList(msgspec.Struct):
    webhooks: list[WebhookView]


class DeliveryView(msgspec.Struct, kw_only=True):
    id: str  # X-Rota-Delivery-Id: the same on every attempt
    subscription_id: str
    event_id: str
    kind: str
    state: str  # pending, delivered, dead
    attempts: int
    created_at: str
    next_at: str | None
    last_at: str | None
    status: int | None
    ms: float | None
    error: str | None
    response: str | None


class DeliveryList(msgspec.Struct):
    deliveries: list[DeliveryView]


class TestReply(msgspec.Struct, kw_only=True):
    ok: bool
    delivery_id: str
    event_id: str
    status: int | None
    ms: float
    error: str | None
    response: str


def _invalid(exc: ValueError) -> RequestError:
    return RequestError(422, "invalid_webhook", str(exc))


def _checked(data: WebhookRequest | WebhookChange) -> dict[str, Any]:
    """The given fields, each checked (422 invalid_webhook saying what is wrong)."""
    out: dict[str, Any] = {}
    try:
        if data.url is not None:
            out["url"] = wh.check_url(data.url)
        if data.kinds is not None:
            out["kinds"] = wh.check_kinds(data.kinds)
        if data.filter is not None:
            out["filter"] = wh.check_filter(data.filter)
    except ValueError as exc:
        raise _invalid(exc) from None
    if data.enabled is not None:
        out["enabled"] = data.enabled
    return out


async def create_webhook(request: Request) -> Response:
    need(request, "admin")
    data = decode_as(await read_body(request), WebhookRequest)
    given = _checked(data)
    shown = await coordinator_of(request).webhooks.create(
        given["url"], given["kinds"], given.get("filter", {}), data.enabled)
    return JSON(shown, status_code=201)


async def list_webhooks(request: Request) -> Response:
    need(request, "admin")
    return JSON({"webhooks": await coordinator_of(request).webhooks.list()})


async def show_webhook(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).webhooks.get(request.path_params["webhook_id"]))


async def change_webhook(request: Request) -> Response:
    need(request, "admin")
    data = decode_as(await read_body(request), WebhookChange)
    hooks = coordinator_of(request).webhooks
    return JSON(await hooks.update(request.path_params["webhook_id"], _checked(data)))


async def delete_webhook(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).webhooks.delete(
        request.path_params["webhook_id"]))


async def webhook_deliveries(request: Request) -> Response:
    need(request, "admin")
    params = request.query_params
    for key in params:
        if key not in ("limit", "state"):
            raise RequestError(400, "invalid_filter", f"unknown parameter {key[:40]!r}: the"
                               " parameters are limit, state")
    text = params.get("limit", "50")
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= MAX_LIMIT):
        raise RequestError(400, "invalid_limit", f"limit must be a whole number from 1 to"
                           f" {MAX_LIMIT}")
    state = params.get("state")
    if state is not None and state not in STATES:
        raise RequestError(400, "invalid_filter", f"state must be one of {', '.join(STATES)}")
    rows = await coordinator_of(request).webhooks.deliveries(
        request.path_params["webhook_id"], int(text), state)
    return JSON({"deliveries": rows})


async def test_webhook(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).webhooks.test(request.path_params["webhook_id"]))


async def rotate_webhook_secret(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).webhooks.rotate(
        request.path_params["webhook_id"]))
