"""The HTTP API publishes an OpenAPI document, and schemathesis, generating requests
from it (valid and invalid), finds no 5xx and no answer that breaks the document."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import ThreadedServer, write_spec
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from rota.core.auth import new_token
from rota.server.routes import ROUTES
from rota.store.tokens import create_token

# Examples per operation and mode: a few in the default run, which still reaches every
# operation both ways; the soak run (pytest -m soak) draws as many as ever, or
# ROTA_API_EXAMPLES.
SIZES = [pytest.param(5, id="quick"),
         pytest.param(int(os.environ.get("ROTA_API_EXAMPLES", "15")), id="soak",
                      marks=pytest.mark.soak)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    tmp: Path = tmp_path_factory.mktemp("openapi")
    threaded = ThreadedServer(tmp)
    token_id, secret, hashed = new_token()  # auth on: schemathesis also tries bad tokens
    create_token(tmp / "rota.db", name="admin", scope="admin", queues=None,
                 token_id=token_id, hashed=hashed)
    threaded.headers = {"Authorization": f"Bearer {secret}"}  # type: ignore[attr-defined]
    write_spec(tmp / "specs", "echo")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the server reads new tokens every interval
        reply = httpx.put(f"{threaded.live.base}/specs", headers=threaded.headers,
                          json={"specs": [{"name": "echo", "version": "1"}]})
        if reply.status_code == 200 and threaded.live.coordinator.tokens.required:
            break
        time.sleep(0.05)  # noqa: sleep-ok (a poll step bounded by the deadline)
    assert reply.status_code == 200, reply.text
    yield threaded
    threaded.close()


@pytest.fixture(scope="module")
def api_schema(server: ThreadedServer) -> Any:
    return schemathesis.openapi.from_url(f"{server.live.base}/openapi.json")


def test_the_document_names_every_route(server: ThreadedServer):
    document = httpx.get(f"{server.live.base}/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    routed = {(op.method, op.path) for op in ROUTES}
    listed = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert listed == routed and len(routed) == 54  # main's 46 and the 8 of /webhooks


def cases() -> list[tuple[str, GenerationMode]]:
    """Every operation with valid input; those that take input with invalid input too."""
    chosen = []
    for op in ROUTES:
        label = f"{op.method.upper()} {op.path}"
        if op.path == "/events":  # a stream that never ends: tests/server/test_feeds.py reads it
            continue
        chosen.append((label, GenerationMode.POSITIVE))
        if op.body is not None or "{" in op.path:
            chosen.append((label, GenerationMode.NEGATIVE))
    return chosen


# Driven by hand rather than through schemathesis' pytest plugin: one test per operation
# and generation mode, each a bounded hypothesis run against the live server.
@pytest.mark.parametrize("examples", SIZES)
@pytest.mark.parametrize(("label", "mode"), cases(),
                         ids=[f"{label}-{mode.value}" for label, mode in cases()])
def test_api_conforms_to_its_document(server: ThreadedServer, api_schema: Any, label: str,
                                      mode: GenerationMode, examples: int):
    [operation] = [result.ok() for result in api_schema.get_all_operations()
                   if result.ok().label == label]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        # Not positive_data_acceptance: the document gives shapes, and the routes rightly
        # refuse some well-shaped requests (an unknown spec, a wait over 300 s).
        response = case.call(timeout=10, headers=server.headers)
        if mode is GenerationMode.NEGATIVE and response.status_code == 413:
            return  # invalid and over max_body_bytes: refused for its size first, rightly
        case.validate_response(response, excluded_checks=[positive_data_acceptance])

    check()


def test_every_operation_documents_the_parsers_refusals(server: ThreadedServer):
    """Any request may be refused before a route sees it (found by the soak run: a DELETE
    with a bad Content-Length answered 400, which its operation did not list)."""
    document = httpx.get(f"{server.live.base}/openapi.json").json()
    for path, ops in document["paths"].items():
        for method, operation in ops.items():
            assert {"400", "431"} <= operation["responses"].keys(), (method, path)
    with socket.create_connection(("127.0.0.1", server.live.port), timeout=10) as sock:
        sock.sendall(b"DELETE /jobs/x HTTP/1.1\r\nhost: x\r\ncontent-length: nope\r\n\r\n")
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert httpx.Response(400, content=body).json()["error"]["code"] == "bad_http_request"
