"""The hot routes without Starlette's router: the workers' ``/work`` (issue 27), and the
producers' ``POST /jobs``, ``POST /jobs/batch`` and ``GET /jobs/{id}/result`` when the
HTTP protocol leaves them to the app (it serves them itself, rota/server/direct.py, but
for a request that asks for ``100 Continue`` or a path with a "%" in it).

A request to one of them has passed the safety net and the gate (its caller proven, its
scope set) like any other; here it goes straight to its route function, and an error it
raises to the same handler Starlette's exception middleware would have chosen. The
same functions, the same checks, limits and answers: only the layers between go (the
exception middleware, a router matching the path against every route in turn, the
request/response wrapper). Measured, that saves about 3 % of an enqueue's server CPU
(docs/performance.md, "The producer path"): uvicorn's HTTP machinery and the gate cost
more. Every other path, and any other method on these paths, goes on to Starlette.

On ``/work`` it is memory, not time: a session's coroutine lives as long as its
connection, and with it every frame it was awaited through. The router, the route and
Starlette's exception wrappers were nine frames, about 3.5 KiB a connection (35 MiB at
10,000 idle workers, measured with tracemalloc). The session handles its own errors,
and whatever escapes it reaches the safety net as before.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from rota.server import api
from rota.server.sessions import work_endpoint

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Request, Exception], Awaitable[Response]]

POSTS: dict[str, Endpoint] = {"/jobs": api.enqueue, "/jobs/batch": api.enqueue_batch}
RESULT = ("/jobs/", "/result")  # GET /jobs/{job_id}/result
WORK = "/work"


def route(scope: Scope) -> Endpoint | None:
    """The route function for this request, if it is one of the hot ones (and, for a
    result, its job id set in the scope's path parameters, as Starlette would)."""
    path: str = scope["path"]
    method: str = scope["method"]
    if method == "POST":
        return POSTS.get(path)
    if method == "GET" and path.startswith(RESULT[0]) and path.endswith(RESULT[1]):
        job_id = path[len(RESULT[0]):-len(RESULT[1])]
        if job_id and "/" not in job_id:  # Starlette's {job_id}: one non-empty segment
            scope["path_params"] = {"job_id": job_id}
            return api.job_result
    return None


class Express:
    """ASGI middleware, innermost: serves the hot routes itself, passes on the rest."""

    def __init__(self, app: ASGIApp, handlers: Mapping[type[Exception], Handler]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket" and scope["path"] == WORK:
            scope["path_params"] = {}  # (as the router would have set them)
            # The gate has read the headers; the scope lives as long as the connection,
            # and nothing reads them again (0.8 KiB a connection).
            scope["headers"] = []
            await work_endpoint(WebSocket(scope, receive, send))
            return
        endpoint = route(scope) if kind == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise  # a bug: the safety net outside answers 500 and logs it
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Handler | None:
        return next((self.handlers[kind] for kind in type(exc).__mro__
                     if kind in self.handlers), None)

