"""The OJS HTTP binding's producer side, mounted at /ojs (docs/ojs.md): the manifest,
health, and the routes that enqueue, show, cancel and activate jobs.

Each route maps its body with rota/core/ojs_map.py and goes through the same coordinator
calls as Rota's own API (rota/server/api.py); what OJS shares is in rota/server/ojs_base.py.
"""

from __future__ import annotations

import importlib.metadata

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rota.base.ojs import OJS_VERSION
from rota.server.api_base import coordinator_of
from rota.server.coordinator import Coordinator
from rota.server import pulling  # the worker routes: FETCH, ACK, NACK, heartbeat
from rota.server.ojs_base import OjsHeaders, OjsJSON, exception_handlers
from rota.server.ojs_flows import routes as flow_routes

# The OJS conformance level Rota reaches (tests/ojs/run.py measures it; docs/ojs.md).
CONFORMANCE_LEVEL = 0
try:
    VERSION = importlib.metadata.version("rota")
except importlib.metadata.PackageNotFoundError:  # (run from a source tree)
    VERSION = "unknown"
# Rota's own OJS extensions, named in the manifest.
EXTENSIONS = ["x_rota_specs", "x_rota_attempt"]


async def manifest(request: Request) -> Response:
    settings = coordinator_of(request).settings
    return OjsJSON({
        "specversion": OJS_VERSION,
        "implementation": {"name": "rota", "version": VERSION, "language": "python"},
        "conformance_level": CONFORMANCE_LEVEL, "protocols": ["http"],
        "backend": "sqlite" if settings.database_url is None else "postgresql",
        "extensions": EXTENSIONS})


async def health(request: Request) -> Response:
    """200 while the server answers: "degraded" while the store refuses writes (it still
    serves reads and workers, as /healthz says)."""
    coordinator = coordinator_of(request)
    degraded = coordinator.storage_degraded()
    backend = {"type": "sqlite" if coordinator.settings.database_url is None else "postgresql",
               "status": "ok" if degraded is None else "degraded"}
    if degraded is not None:
        backend["error"] = degraded.message
    return OjsJSON({"status": "ok" if degraded is None else "degraded",
                    "version": VERSION, "uptime_seconds": round(coordinator.uptime()),
                    "backend": backend})


routes = [
    Route("/manifest", manifest, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
]
routes += flow_routes  # cron and workflows (rota/server/ojs_flows.py)


def ojs_app(coordinator: Coordinator) -> Starlette:
    """The /ojs mount: its own exception handlers, so that every refusal under it is in
    OJS's shape, and its headers on every answer."""
    app = Starlette(routes=[*routes, *pulling.routes], exception_handlers=exception_handlers,  # type: ignore[arg-type]
                    middleware=[Middleware(OjsHeaders)])
    app.state.coordinator = coordinator
    return app
