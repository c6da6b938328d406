"""The last line at both doors: an exception nobody expected still gets a proper answer.

Every refusal Rota means to make is raised as a RotaError and answered where it is
understood (a 4xx, an ``error`` frame). Anything else is a bug, and this middleware,
outermost in the app, turns it into an answer the client can parse: a JSON 500 on HTTP,
or a 1011 close on a WebSocket. It is logged once, with the traceback and an id that
the answer carries too, so a user's report leads straight to the line in the log.
Nothing is re-raised: uvicorn would log the same traceback a second time, and a client
could repeat that at will.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import msgspec

from rota.base.logs import printable
from rota.base.protocol import CLOSE_INTERNAL

log = logging.getLogger("rota.server")

Scope = dict[str, Any]
Message = dict[str, Any]


def incident_id() -> str:
    return secrets.token_hex(6)


def internal_body(incident: str) -> bytes:
    return msgspec.json.encode({"error": {
        "code": "internal", "id": incident,
        "message": f"the server failed to handle this request; it is logged as {incident}"}})


class SafetyNet:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        started = False  # a response's headers, or a WebSocket's accept or close, went out

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] in ("http.response.start", "websocket.accept",
                                   "websocket.close", "websocket.http.response.start"):
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # noqa: BLE001 (the point of this class)
            incident = incident_id()
            log.error("internal error id=%s on %s %s: %s", incident, scope.get("method", "WS"),
                      printable(scope.get("path", "?")), type(exc).__name__, exc_info=exc)
            try:
                await self._answer(scope, send, incident, started)
            except Exception:  # the connection is gone as well: nobody left to tell
                pass

    @staticmethod
    async def _answer(scope: Scope, send: Any, incident: str, started: bool) -> None:
        if scope["type"] == "websocket" and started:
            await send({"type": "websocket.close", "code": CLOSE_INTERNAL,
                        "reason": f"internal_error {incident}"})
            return
        if started:
            return  # an HTTP answer's headers went out: uvicorn closes the connection
        # An HTTP request, or a handshake not answered yet: a JSON 500 either way.
        prefix = "http" if scope["type"] == "http" else "websocket.http"
        body = internal_body(incident)
        await send({"type": f"{prefix}.response.start", "status": 500, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": f"{prefix}.response.body", "body": body})
