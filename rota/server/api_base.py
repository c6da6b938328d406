"""What every HTTP route shares: JSON answers, the error body and the mapping of the
core's refusals and of Starlette's to statuses, the body read within its limit and deadline
and decoded, and the check of the caller's scope (rota/server/api.py's routes, and rota/server/operate.py's,
rota/server/feeds.py's and the dashboard's).

Every error has the body ``{"error": {"code": ..., "message": ...}}``: a 4xx for what the
client can fix, 503 with ``Retry-After`` while the disk refuses writes (``storage_*``),
and 500 ``internal`` (with an incident id, from rota/server/safety.py) for a bug.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.websockets import WebSocket

from rota.core.auth import Principal, Scope
from rota.server.coordinator import Coordinator
from rota.base.errors import (Conflict, DomainError, Forbidden, Invalid, NotFound, RequestError,
                         StorageError, TooLarge)
from rota.server.gate import principal_of
from rota.base.inputs import BadJson, explain, screen
from rota.base.protocol import Name
from rota.base.wording import NAME_RULE, plainly
from rota.base.logs import printable

log = logging.getLogger("rota.server")


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def error(status: int, code: str, message: str, details: Any = None) -> JSON:
    """The error body; ``details`` (a refusal's own, e.g. the job a unique key is held
    by) only where there are some."""
    body = {"code": code, "message": message}
    if details is not None:
        body["details"] = details
    return JSON({"error": body}, status_code=status)


# The core's refusals, as HTTP statuses: decided here, at the edge, not in the engine.
STATUS: dict[type[DomainError], int] = {NotFound: 404, Conflict: 409, Invalid: 422,
                                        Forbidden: 403, TooLarge: 413, DomainError: 422}


def status_of(exc: RequestError | DomainError) -> int:
    if isinstance(exc, RequestError):
        return exc.status
    return next((STATUS[kind] for kind in type(exc).__mro__ if kind in STATUS), 422)


def coordinator_of(request: Request) -> Coordinator:
    return request.app.state.coordinator


def path_name(request: Request, key: str, code: str, what: str) -> str:
    """A name in the path (a queue's, a schedule's), or 400 ``code`` saying what one is."""
    try:
        return msgspec.convert(request.path_params[key], Name)
    except msgspec.ValidationError:
        raise RequestError(400, code, f"{what} is {NAME_RULE}") from None


def need(request: Request, *scopes: Scope) -> Principal:
    """The caller, if its token's scope allows this route; else 403."""
    principal = principal_of(request.scope)
    if not principal.may(*scopes):
        raise forbidden(principal, request.method, request.url.path, scopes)
    return principal


def forbidden(principal: Principal, method: str, path: str, scopes: tuple[Scope, ...]
              ) -> RequestError:
    return RequestError(403, "forbidden", f"a {principal.scope} token may not {method} {path}:"
                        f" {takes(scopes)}")


def takes(scopes: tuple[Scope, ...]) -> str:
    """The tokens a route takes, in words: "it takes a producer or admin token"."""
    names = " or ".join(dict.fromkeys((*scopes, "admin")))
    return f"it takes {'an' if names[0] in 'aeiou' else 'a'} {names} token"


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it passes the limit: never buffered whole."""
    settings = coordinator_of(request).settings
    limit = settings.max_body_bytes
    if declared_over(request.headers.get("content-length", ""), limit):
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    # A body sent a byte a minute would hold its connection for ever: it has a deadline.
    timeout = settings.body_timeout
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, "body_timeout", f"the request body did not arrive within"
                           f" {timeout:g}s (body_timeout)") from None
    return b"".join(chunks)


def declared_over(content_length: str | bytes, limit: int) -> bool:
    """Whether a request's Content-Length header says its body is over ``limit`` (one
    that is not a plain number says nothing: the body is counted as it comes)."""
    return content_length.isdigit() and int(content_length) > limit


def too_large(limit: int) -> RequestError:
    # (made when needed: one made for every request was 1 % of an enqueue's loop time)
    return RequestError(413, "body_too_large",
                        f"the request body is over {limit} bytes (max_body_bytes)")


async def decode_body(request: Request, kind: type[Any]) -> Any:
    return decode_as(await read_body(request), kind)


def decode_as(body: bytes, kind: type[Any]) -> Any:
    """A JSON body as ``kind``: 422 if it does not fit, 400 if it is not JSON Rota takes
    (malformed, too deep, not UTF-8), each with a message that says which."""
    try:
        return msgspec.json.decode(screen(body), type=kind)
    except msgspec.ValidationError as exc:
        said = plainly(str(exc), kind, lambda: msgspec.json.decode(body))
        raise RequestError(422, "invalid_request", said) from None
    except BadJson as exc:
        raise RequestError(400, exc.code, exc.message) from None
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        bad = explain(body, exc)
        raise RequestError(400, bad.code, bad.message) from None


# The scope key of a request's way to drop its connection at once (rota/server/edge.py sets it:
# a weak method, called to get the method), for a stream whose client does not read.
DROP = "rota.drop"


def token_revoked() -> Response:
    """The answer to a request that waits whose token was revoked meanwhile."""
    return error(401, "token_revoked", "the token of this request was revoked while it"
                 " waited")


def too_many_waits(coordinator: Coordinator) -> Response:
    """The answer to a token over its share of HTTP requests that stay open."""
    cap = coordinator.settings.max_waits_per_token
    response = error(429, "too_many_waits", f"this token has {cap} requests open that wait"
                     " (GET /events, ?wait=) already: --max-waits-per-token")
    response.headers["retry-after"] = "1"
    return response


# A body that stopped arriving: the connection ends with the answer. (The rest of a body
# refused as too large is read and dropped by uvicorn, and the connection goes on.)
CLOSE_AFTER = frozenset({"body_timeout"})


def refusal_answer(exc: Exception) -> Response | None:
    """The answer to a refusal a route raised (RequestError, DomainError, StorageError), or
    None for anything else (a bug, for the safety net)."""
    if isinstance(exc, StorageError):
        # Logged once by the store's health when it became degraded, not once per request.
        response = error(503, exc.code, exc.message)
        response.headers["Retry-After"] = str(exc.retry_after)
        return response
    if not isinstance(exc, RequestError | DomainError):
        return None
    response = error(status_of(exc), exc.code, exc.message, getattr(exc, "details", None))
    if exc.code in CLOSE_AFTER:
        response.headers["connection"] = "close"
    return response


async def request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError | DomainError)
    response = refusal_answer(exc)
    assert response is not None
    return response


async def storage_unavailable(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StorageError)
    response = refusal_answer(exc)
    assert response is not None
    return response


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = str(exc.detail)
    if exc.status_code in (404, 405):
        path = printable(request.url.path, 100)
        message = f"no route {request.method} {path}"
        if path.rstrip("/") == "/work":
            message += ": /work is the workers' WebSocket endpoint (ws:// or wss://)"
        elif exc.status_code == 404:
            message += ": the routes are in /openapi.json"
    return error(exc.status_code, code, message)


async def no_such_socket(websocket: WebSocket) -> None:
    """A WebSocket handshake for any path but /work: refused with a JSON 404."""
    path = printable(websocket.url.path, 100)
    await websocket.send_denial_response(error(
        404, "not_found", f"no WebSocket endpoint at {path}: workers connect to /work"))


async def client_gone(request: Request, exc: Exception) -> Response:
    # The client closed its connection before its body arrived: nothing was done, nobody
    # is left to answer, and a traceback per such request is a log line anyone could
    # repeat at will. The answer is dropped by uvicorn.
    log.debug("%s %s: the client went away before its body arrived", request.method,
              printable(request.url.path))
    return error(400, "client_disconnected", "the client closed the connection mid-request")


exception_handlers = {RequestError: request_error, DomainError: request_error,
                      StorageError: storage_unavailable, HTTPException: http_error,
                      ClientDisconnect: client_gone}
