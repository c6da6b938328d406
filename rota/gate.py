"""The door: every HTTP request and WebSocket handshake proves who it is before any
route runs. A refused WebSocket handshake gets an HTTP answer (401, 403), never an
accepted socket. Routes then check the scope they need (``need``).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from starlette.types import ASGIApp, Receive, Scope, Send

from rota.auth import Principal
from rota.coordinator import Coordinator

log = logging.getLogger("rota.server")
# Load balancers probe health without a token; the API's description is public.
OPEN_PATHS = frozenset({"/healthz", "/openapi.json"})


class Gate:
    """Pure ASGI middleware: authenticate, check the WebSocket Origin, refuse early."""

    def __init__(self, app: ASGIApp, coordinator: Coordinator) -> None:
        self.app = app
        self.coordinator = coordinator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        # No local may keep the headers: on /work this frame lives as long as the
        # connection (10,000 idle workers held 12 MiB of decoded headers this way).
        refusal = self._refusal(scope, {k.decode("latin-1"): v.decode("latin-1")
                                        for k, v in scope["headers"]})
        if refusal is not None:
            await deny(scope, send, *refusal)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str, str] | None:
        settings = self.coordinator.settings
        origin = headers.get("origin")
        if scope["type"] == "websocket" and origin is not None \
                and origin not in settings.allowed_origins:
            # Browsers send Origin; workers do not. A page must not borrow a browser's
            # network position to take jobs.
            log.warning("refused websocket origin=%r client=%s", origin, _client(scope))
            return 403, "origin_not_allowed", f"Origin {origin} is not allowed on /work"
        principal = self.coordinator.tokens.authenticate(headers.get("authorization"))
        if principal is None:
            log.warning("refused %s %s client=%s: no valid token", scope["type"], scope["path"],
                        _client(scope))
            return 401, "unauthorized", "send a valid token: 'Authorization: Bearer rota_...'"
        scope["rota.principal"] = principal
        return None


def principal_of(scope: Scope) -> Principal:
    principal: Principal = scope["rota.principal"]
    return principal


async def deny(scope: Scope, send: Send, status: int, code: str, message: str) -> None:
    """Answer with a JSON error; on a WebSocket handshake, as its HTTP response."""
    body = error_body(code, message)
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="rota"'))
    prefix = "websocket.http.response" if scope["type"] == "websocket" else "http.response"
    await send({"type": f"{prefix}.start", "status": status, "headers": headers})
    await send({"type": f"{prefix}.body", "body": body})


def error_body(code: str, message: str) -> bytes:
    """Rota's one error shape, for answers given outside the routes."""
    return msgspec.json.encode({"error": {"code": code, "message": message}})


def _client(scope: Scope) -> Any:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"
