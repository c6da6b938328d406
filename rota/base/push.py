"""Push execution's two messages: a ``Delivery`` (what the engine asks the shell to POST
to a spec's ``[execute]`` endpoint) and a ``Delivered`` (what came of it, classified).
Plain data: the engine (rota/core/endpoints.py) makes the first and takes the second;
the shell (rota/server/deliverer.py) does the HTTP between them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rota.base.protocol import ErrorInfo

MAX_SHOWN_BODY = 2048  # bytes of an endpoint's answer kept in the attempt's record
Kind = Literal["completed", "failed", "accepted"]


class Delivery(msgspec.Struct, kw_only=True):
    """One attempt's POST. ``delivery_id`` is new for every POST (ojs-serverless §8.1)."""

    job_id: str
    attempt: int
    spec: str
    checksum: str
    queue: str
    args: Any
    priority: int
    url: str
    timeout: float  # seconds the shell waits for the answer
    headers: dict[str, str]
    secret: str  # the NAME of the signing secret
    delivery_id: str
    deadline: float  # unix seconds: when the server stops waiting for this attempt
    callback_token: str  # proves a callback is this attempt's (POST /jobs/{id}/callback)


class Delivered(msgspec.Struct, kw_only=True):
    """What one POST came to. ``accepted`` is a 202: the job runs on, its result comes by
    callback. ``fault`` marks the endpoint's failures (5xx, 408, 429, 401, 403, 404,
    timeouts, connection errors, unusable answers), which the circuit breaker counts;
    a job's own failures (another 4xx, a ``"status": "failed"`` body) are not counted."""

    job_id: str
    attempt: int
    delivery_id: str
    kind: Kind
    result: Any = None
    error: ErrorInfo | None = None
    status: int | None = None  # the HTTP status; None: no answer (timeout, connection)
    ms: float = 0.0  # how long the POST took
    body: str = ""  # the answer's first MAX_SHOWN_BODY bytes, as text
    retry_in: float | None = None  # seconds: the endpoint's Retry-After
    fault: bool = False

    def record(self) -> dict[str, Any]:
        """What the attempt's record keeps of it."""
        return {"delivery_id": self.delivery_id, "status": self.status,
                "ms": round(self.ms, 1), "body": self.body}
