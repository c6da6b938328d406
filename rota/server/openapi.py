"""The HTTP API's OpenAPI 3.1 document (``GET /openapi.json``), made from the route table
(rota/server/routes.py).

Request bodies are the very msgspec types the routes decode with; responses are
described by the Structs of rota/server/openapi_schemas.py. The schemas come from msgspec, so
the document cannot drift from the decoders, and a schemathesis run
(tests/server/test_openapi.py) checks that no answer breaks it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, NamedTuple

import msgspec

from starlette.requests import Request
from starlette.responses import Response

from rota.server.openapi_schemas import ErrorBody, JobState

# Answers that are not JSON: the media type and a description for the document.
TEXT_ANSWERS: dict[str, tuple[str, str]] = {
    "/events": ("text/event-stream", "server-sent events: `id:`, `event:` (the kind) and"
                " one JSON object as `data:` per event; `: keep-alive` comments"
                " (docs/protocol.md)"),
    "/metrics": ("text/plain; version=0.0.4", "Prometheus text exposition format"),
}


_TEXT = {"type": "string"}
QUERIES: dict[str, dict[str, Any]] = {
    "/events": {"last_event_id": {"type": "string", "pattern": "^[0-9]{1,19}$"},
                "event": _TEXT, "spec": _TEXT, "queue": _TEXT, "worker": _TEXT},
    "/stats": {"minutes": {"type": "integer", "minimum": 1, "maximum": 60}},
    "/webhooks/{webhook_id}/deliveries": {
        "limit": {"type": "integer", "minimum": 1, "maximum": 1000},
        "state": {"type": "string", "enum": ["pending", "delivered", "dead"]}},
}


class Op(NamedTuple):
    """One operation: it makes both a Starlette route and an entry of the document, so
    the two cannot drift apart. Every route may also answer 401 (no valid token) and
    403 (its scope does not allow it), which ``document`` adds."""

    method: str
    path: str
    handler: Callable[[Request], Awaitable[Response]]
    summary: str
    body: Any  # the request body's type, or None
    answers: dict[int, Any]  # status -> response body type


def document(table: Sequence[Op], *, stored: Collection[str], tokenless: Collection[str]
             ) -> dict[str, Any]:
    """The document of the operations in ``table``: those at ``stored`` paths may also
    answer 503 (the database failed), those at ``tokenless`` paths need no token."""
    types = [t for op in table for t in [op.body, *op.answers.values()] if t]
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}")
    refs = dict(zip(types, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path, _, summary, body, answers in table:
        operation: dict[str, Any] = {"summary": summary, "responses": {}}
        params = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if params:
            operation["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in params]
        if path.endswith("/result"):
            operation["parameters"].append(
                {"name": "wait", "in": "query", "required": False,
                 "schema": {"type": "number", "minimum": 0}})
        if path in QUERIES:
            operation["parameters"] = [
                {"name": name, "in": "query", "required": False, "schema": schema}
                for name, schema in QUERIES[path].items()]
        if method == "get" and path == "/jobs":
            operation["parameters"] = _LISTING_PARAMETERS
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[body]}}}
        # Any request may be refused by the HTTP parser before a route sees it: 400 for one
        # that is not valid HTTP/1.1 (a bad Content-Length), 431 for headers over the limit.
        http = {400: ErrorBody, 431: ErrorBody}
        extra = {**http, 401: ErrorBody, 403: ErrorBody, 500: ErrorBody}  # 500: the safety net
        if body is not None:  # not JSON Rota takes (400), or a body that stopped coming (408)
            extra |= {400: ErrorBody, 408: ErrorBody}
        if path in stored:  # what reads or writes the database answers 503 when it fails
            extra[503] = ErrorBody
        if path in tokenless:
            operation["security"] = []  # no token needed
            extra = {**http, 500: ErrorBody}
        for status, answer in sorted({**answers, **extra}.items()):
            if answer is None:  # not JSON
                media, description = TEXT_ANSWERS[path]
                operation["responses"][str(status)] = {"description": description, "content": {
                    media: {"schema": {"type": "string"}}}}
                continue
            operation["responses"][str(status)] = {
                "description": _DESCRIPTIONS.get(status, "answer"),
                "content": {"application/json": {"schema": refs.get(answer)
                                                 or _ref(answer)}}}
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Rota", "version": "0.1.0",
                 "description": "Enqueue and inspect jobs, push specs, direct workers."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


_STATES = {"type": "string", "enum": list(JobState.__args__)}
_LISTING_PARAMETERS: list[dict[str, Any]] = [
    {"name": "state", "in": "query", "required": False, "style": "form", "explode": True,
     "schema": {"type": "array", "items": _STATES}},
    *({"name": name, "in": "query", "required": False, "schema": {"type": "string"}}
      for name in ("spec", "queue", "worker", "schedule", "q", "cursor")),
    {"name": "limit", "in": "query", "required": False,
     "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
]


def _ref(kind: Any) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{kind.__name__}"}


_DESCRIPTIONS = {200: "done", 201: "created", 202: "accepted, not finished",
                 400: "bad input, or a request that is not valid HTTP/1.1",
                 401: "no valid token", 403: "not allowed for this token",
                 404: "not found", 409: "conflict with what exists (a job's state, a taken name, a"
                 " unique job's key: error.details names the job holding it)",
                 408: "the body did not arrive in time (body_timeout)",
                 413: "over a size limit", 422: "invalid request",
                 431: "the request line and headers are over the size limit",
                 500: "a bug in Rota (internal): the error's id names the traceback in the log",
                 503: "storage unavailable (full, read-only or failing); see Retry-After"}
