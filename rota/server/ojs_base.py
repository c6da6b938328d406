"""What every /ojs route shares: OJS's error answer, its headers on every answer (OJS-Version,
its content type, X-Request-Id), the mapping of Rota's refusals to OJS codes, and the body
read within Rota's limits (rota/server/api_base.py).
"""

from __future__ import annotations

import contextvars
import re
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rota.base.errors import (Conflict, DomainError, Forbidden, NotFound, RequestError,
                              StorageError, TooLarge)
from rota.base.ids import uuid7
from rota.base.logs import printable
from rota.base.ojs import OJS_MEDIA, OJS_VERSION
from rota.core.ojs_map import OjsRefusal, error_body
from rota.server.api_base import read_body

# Where an error's docs_url points (H4 points it at the published docs/ojs.md).
OJS_DOCS_URL = "https://github.com/rota-dev/rota/blob/main/docs/ojs.md#errors"
# A client's X-Request-Id is echoed when it is short and printable; else one is made.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("ojs_request_id",
                                                                  default="")
# Rota's refusal codes that OJS names otherwise.
_CODES = {"unknown_spec": "invalid_job_type", "spec_retired": "invalid_job_type",
          "id_conflict": "duplicate", "unique_conflict": "duplicate"}


class OjsJSON(Response):
    media_type = OJS_MEDIA

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def request_id() -> str:
    """This request's id (set by OjsHeaders), or a new one outside a request."""
    return _request_id.get() or f"req_{uuid7()}"


def ojs_error(status: int, code: str, message: str, *, type: str, details: Any = None,
              hint: str | None = None) -> Response:
    """OJS's error answer. A 404 also says where the errors are documented (L0-OPS-030)."""
    docs = OJS_DOCS_URL if status == 404 else None
    if status == 404 and hint is None:
        hint = "check the id: GET /ojs/v1/jobs/{id} shows a job while it is kept"
    message = printable(message, 1000)  # ids and names from the request: one clean line
    body = error_body(status, code, message, type=type, request_id=request_id(),
                      details=details, hint=hint, docs_url=docs)
    response = OjsJSON(body, status_code=status)
    if status == 503:
        response.headers["retry-after"] = "1"
    return response


def refused(exc: OjsRefusal) -> Response:
    return ojs_error(exc.status, exc.code, exc.message, type=exc.type, details=exc.details)


def domain_error(exc: DomainError) -> Response:
    """A refusal of Rota's engine or store, as OJS says it (Rota's code in details)."""
    code = _CODES.get(exc.code)
    details = {"rota_code": exc.code}
    if (more := getattr(exc, "details", None)) is not None:
        details["rota_details"] = more
    if isinstance(exc, Conflict) or code == "duplicate":
        return ojs_error(409, code or "conflict", exc.message, type="conflict",
                         details=details)
    if isinstance(exc, NotFound):
        return ojs_error(404, "not_found", exc.message, type="not_found", details=details)
    if isinstance(exc, Forbidden):
        return ojs_error(403, "permission_denied", exc.message, type="auth_error",
                         details=details)
    if isinstance(exc, TooLarge):
        return ojs_error(413, "payload_too_large", exc.message, type="validation_error",
                         details=details)
    return ojs_error(400, code or "invalid_request", exc.message, type="validation_error",
                     details=details)


async def ojs_body(request: Request) -> bytes:
    """The body, within max_body_bytes and body_timeout, as Rota reads every body."""
    return await read_body(request)


# -- the sub-app's exception handlers: every refusal in OJS's shape ----------------------
async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    if exc.status == 413:
        return ojs_error(413, "payload_too_large", exc.message, type="validation_error")
    if exc.status == 403:
        return ojs_error(403, "permission_denied", exc.message, type="auth_error")
    if exc.status == 401:
        return ojs_error(401, "unauthenticated", exc.message, type="auth_error")
    return ojs_error(exc.status, exc.code, exc.message, type="validation_error")


async def _domain_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, DomainError)
    return domain_error(exc)


async def _ojs_refusal(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, OjsRefusal)
    return refused(exc)


async def _storage(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StorageError)
    return ojs_error(503, "backend_unavailable", exc.message, type="backend_error",
                     details={"rota_code": exc.code})


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = printable(request.url.path, 100)
    if exc.status_code == 405:
        return ojs_error(405, "method_not_allowed", f"no route {request.method} {path}",
                         type="validation_error")
    if exc.status_code == 404:
        return ojs_error(404, "not_found", f"no route {request.method} {path}",
                         type="not_found", hint="the OJS routes are under /ojs/v1 (docs/ojs.md)")
    return ojs_error(exc.status_code, "invalid_request", str(exc.detail),
                     type="validation_error")


exception_handlers = {RequestError: _request_error, DomainError: _domain_error,
                      OjsRefusal: _ojs_refusal, StorageError: _storage,
                      HTTPException: _http_error}


class OjsHeaders:
    """ASGI middleware of the /ojs mount: a request id for every request, OJS's headers
    on every answer, and 422 for a client that speaks an OJS version other than 1.x."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else f"req_{uuid7()}"
        token = _request_id.set(rid)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", [])
                        if k.lower() not in (b"content-type", b"ojs-version", b"x-request-id")]
                message["headers"] = [*kept, (b"content-type", OJS_MEDIA.encode()),
                                      (b"ojs-version", OJS_VERSION.encode()),
                                      (b"x-request-id", rid.encode())]
            await send(message)

        try:
            version = headers.get(b"ojs-version", b"1.0").decode("latin-1")
            if not version.startswith("1"):
                response = ojs_error(422, "unsupported", f"OJS-Version {printable(version, 20)}"
                                     f" is not supported; this server speaks {OJS_VERSION}",
                                     type="validation_error")
                await response(scope, receive, send_with_headers)
                return
            await self.app(scope, receive, send_with_headers)
        finally:
            _request_id.reset(token)

