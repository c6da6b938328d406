"""The HTTP routes of endpoint signing secrets (admin only): ``PUT /secrets/{name}`` sets or rotates one (or generates it, answered once), ``GET /secrets`` lists them (never a value), ``DELETE /secrets/{name}``; rota/server/secretbook.py carries each out."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from rota.base.errors import RequestError
from rota.core.secrets import MAX_BYTES, name_problem
from rota.server.api_base import JSON, coordinator_of, decode_as, need, read_body


class SecretRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # None (or left out): the server generates one, and answers it this once
    value: Annotated[str, msgspec.Meta(max_length=MAX_BYTES)] | None = None
    # seconds the value this one replaces stays valid (signed with both meanwhile)
    window: float | None = None


def _name(request: Request) -> str:
    name: str = request.path_params["name"]
    if (problem := name_problem(name)) is not None:
        raise RequestError(400, "invalid_name", problem)
    return name


async def put_secret(request: Request) -> Response:
    need(request, "admin")
    name = _name(request)
    payload = decode_as(await read_body(request), SecretRequest)  # ({}: generate one)
    book = coordinator_of(request).secrets
    view, change, made = await book.set(name, payload.value, payload.window)
    answer: dict[str, Any] = {"secret": view, "change": change}
    if made is not None:
        answer["value"] = made
    return JSON(answer, status_code=201 if change == "new" else 200)


async def list_secrets(request: Request) -> Response:
    need(request, "admin")
    coordinator = coordinator_of(request)
    return JSON({"secrets": coordinator.secrets.listing(coordinator.specs.values())})


async def delete_secret(request: Request) -> Response:
    need(request, "admin")
    name = _name(request)
    coordinator = coordinator_of(request)
    return JSON({"deleted": await coordinator.secrets.delete(name, coordinator.specs.values())})


# -- the answers, for the OpenAPI document (rota/server/routes.py) ------------------------
class SecretView(msgspec.Struct, kw_only=True):
    name: str
    source: str | None  # "env", "db", or null: set nowhere (its specs cannot be delivered)
    env: str  # the environment variable that would hold it: ROTA_SECRET_<NAME>
    created_at: str | None
    updated_at: str | None
    rotated_at: str | None
    previous_valid_until: str | None  # a rotation's window: signed with both until then
    specs: list[str] = []  # (GET and DELETE) the status quo's specs that name it


class SecretPut(msgspec.Struct, kw_only=True):
    secret: SecretView
    change: str  # "new", "rotated", "unchanged"
    value: str | None = None  # the generated value, shown only this once


class SecretList(msgspec.Struct, kw_only=True):
    secrets: list[SecretView]


class SecretDeleted(msgspec.Struct, kw_only=True):
    deleted: SecretView
