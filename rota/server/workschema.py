"""The ``/work`` frames as a JSON Schema (``GET /work.schema.json``), made from the msgspec
types the server and the Python SDK decode with (rota/base/protocol.py), so that a worker
in another language can be written, and its frames checked, from one document that cannot
drift from the code. docs/protocol.md is the prose; tests/house/test_docs.py checks the
two name the same messages and fields."""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from rota.base import protocol as p

DIALECT = "https://json-schema.org/draft/2020-12/schema"


@functools.cache
def work_schema() -> dict[str, Any]:
    """The document: ``worker_to_server`` (a heartbeat, the one frame a worker sends) and
    ``server_to_worker`` (one of the server's frames, told apart by ``type``), over the
    shared ``$defs``."""
    (heartbeat, server), defs = msgspec.json.schema_components(
        [p.Heartbeat, p.ServerMessage], ref_template="#/$defs/{name}")
    return {
        "$schema": DIALECT,
        "$id": "/work.schema.json",
        "title": "Rota /work WebSocket frames",
        "description": ("Each WebSocket text frame is one JSON object. A worker sends"
                        " worker_to_server frames; the server sends server_to_worker"
                        " frames. Unknown fields are ignored by both sides, and a field"
                        " left out is its default (docs/protocol.md §1, Versioning)."),
        "oneOf": [{"$ref": "#/$defs/worker_to_server"}, {"$ref": "#/$defs/server_to_worker"}],
        "$defs": {"worker_to_server": heartbeat, "server_to_worker": server, **defs},
    }


@functools.cache
def encoded() -> bytes:
    return msgspec.json.encode(work_schema())
