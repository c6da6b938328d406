"""``GET /endpoints`` (admin): every push endpoint (a version of a spec with ``[execute]``),
its circuit breaker and its deliveries in flight; and the answer's shape for OpenAPI."""

from __future__ import annotations

from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from rota.server.api_base import JSON, coordinator_of, need


async def list_endpoints(request: Request) -> Response:
    need(request, "admin")
    return JSON({"endpoints": coordinator_of(request).endpoint_views()})


class EndpointView(msgspec.Struct, kw_only=True):
    id: str  # its worker id: "http:<spec>@<the checksum's first 12 hex>"
    spec: str
    checksum: str
    url: str
    status_quo: bool  # the spec's current version (an older one serves its own jobs still)
    # closed: deliveries flow; open: paused after repeated faults; half_open: one trial
    state: Literal["closed", "open", "half_open"]
    reason: str | None  # why its jobs wait: "endpoint failing: 5 errors in 30 s, ..."
    in_flight: int  # deliveries sent and not answered yet
    accepted: int  # jobs it answered 202 for: running there, reported by callback
    max_in_flight: int
    active: int  # jobs held by it (in flight and accepted)
    opened: int  # times its breaker opened since the server started


class Endpoints(msgspec.Struct):
    endpoints: list[EndpointView]
