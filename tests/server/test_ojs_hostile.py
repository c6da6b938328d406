"""The hostile corpus (tests/corpus.py) against every /ojs/v1 route (issue 25), on the same
watched server as tests/server/test_hostile.py: every value in every field of every OJS
body, every whole-body oddity, every path segment and query value. For each pair the answer
is a success the field's type admits, or a 4xx in OJS's error shape (``{"error": {code,
message, retryable}}``, an OJS content type); never a 5xx. The log gets no ERROR line and
no traceback, the bystander keeps completing jobs, and no stored job changes (the
``watched`` fixture checks these after each test).
"""

from __future__ import annotations

from typing import Any

import corpus
import httpx
import pytest
from test_hostile import SPREAD, Watch, places, put, spread, watched  # noqa: F401  (fixture)

QUEUE = "hostile-ojs"
JOB = {"type": "hostile.noop", "args": [{"k": "v"}, 2],
       "meta": {"trace": "t"},
       "options": {"queue": QUEUE, "priority": 1, "timeout_ms": 60_000,
                   "visibility_timeout_ms": 30_000, "delay_until": "2099-01-01T00:00:00Z",
                   "expires_at": "2099-12-31T23:59:59Z", "tags": ["a"],
                   "metadata": {"m": 1},
                   "retry": {"max_attempts": 3, "initial_interval": "PT1S",
                             "backoff_coefficient": 2.0, "max_interval": "PT5M",
                             "jitter": True, "non_retryable_errors": ["Auth.*"],
                             "on_exhaustion": "dead_letter"},
                   "unique": {"keys": ["type", "args"], "period": "PT1H",
                              "on_conflict": "reject", "states": ["available"]}}}
# A pull worker that asks only for the corpus's own queue: nothing it takes is stored before.
FETCH = {"queues": [QUEUE], "count": 1, "worker_id": "hostile-puller",
         "visibility_timeout_ms": 30_000}
ACK = {"job_id": "019414d4-8b2e-7c3a-b5d1-f0e2a3b4c5d6", "worker_id": "hostile-puller",
       "result": {"k": "v"}}
NACK = {"job_id": "019414d4-8b2e-7c3a-b5d1-f0e2a3b4c5d6", "worker_id": "hostile-puller",
        "error": {"code": "handler_error", "message": "m", "retryable": True,
                  "details": {"k": "v"}}, "requeue": False}
BEAT = {"worker_id": "hostile-puller", "active_jobs": ["019414d4-8b2e-7c3a-b5d1-f0e2a3b4c5d6"],
        "visibility_timeout_ms": 30_000}
CRON = {"name": "hostile-cron", "expression": "0 0 1 1 *", "timezone": "Europe/Berlin",
        "overlap_policy": "skip",
        "job_template": {"type": "hostile.cron", "args": [1], "options": {"queue": QUEUE}}}
WORKFLOW = {"type": "chain", "name": "w", "steps": [
    {"type": "hostile.a", "args": [1], "options": {"queue": QUEUE}},
    {"type": "hostile.b", "args": [{"k": "v"}]}]}
BATCH_WF = {"type": "batch", "name": "b", "jobs": [{"type": "hostile.a", "args": []}],
            "callbacks": {"on_complete": {"type": "hostile.c", "args": []}}}


def templates() -> list[tuple[str, str, dict[str, Any]]]:
    return [("POST", "/ojs/v1/jobs", JOB), ("POST", "/ojs/v1/jobs/batch", {"jobs": [JOB]}),
            ("POST", "/ojs/v1/workers/fetch", FETCH), ("POST", "/ojs/v1/workers/ack", ACK),
            ("POST", "/ojs/v1/workers/nack", NACK), ("POST", "/ojs/v1/workers/heartbeat", BEAT),
            ("POST", "/ojs/v1/cron", CRON), ("POST", "/ojs/v1/workflows", WORKFLOW),
            ("POST", "/ojs/v1/workflows", BATCH_WF)]


PLACES = [(method, route, index, path)
          for index, (method, route, template) in enumerate(templates())
          for path in places(template)]
PATH_ROUTES = [("GET", "/ojs/v1/jobs/{}"), ("DELETE", "/ojs/v1/jobs/{}"),
               ("POST", "/ojs/v1/jobs/{}/activate"), ("GET", "/ojs/v1/queues/{}/stats"),
               ("POST", "/ojs/v1/queues/{}/pause"), ("POST", "/ojs/v1/queues/{}/resume"),
               ("POST", "/ojs/v1/dead-letter/{}/retry"), ("DELETE", "/ojs/v1/dead-letter/{}"),
               ("DELETE", "/ojs/v1/cron/{}"), ("GET", "/ojs/v1/workflows/{}"),
               ("DELETE", "/ojs/v1/workflows/{}")]
QUERIES = [("/ojs/v1/dead-letter", "limit"), ("/ojs/v1/dead-letter", "offset"),
           ("/ojs/v1/events", "limit"), ("/ojs/v1/events", "types"),
           ("/ojs/v1/events", "queues")]


def assert_ojs(answer: httpx.Response, refused: bool, what: str) -> None:
    """A success the field admits, or a 4xx in OJS's error shape; never a 5xx."""
    status = answer.status_code
    assert status < 500, f"{what}: {status} {answer.text[:300]}"
    if status < 400:
        assert not refused, f"{what}: accepted ({status}) {answer.text[:300]}"
        return
    assert answer.headers.get("content-type", "").startswith(
        ("application/openjobspec+json", "application/json")), what
    error = answer.json()["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str), what
    assert error["retryable"] is False, what  # a 4xx: the same request fails again
    assert "Traceback" not in error["message"] and "Expected `" not in error["message"], what


@pytest.mark.parametrize(("chunk", "every"), SPREAD)
async def test_every_value_in_every_field_of_every_ojs_body(watched: Watch, chunk: int,
                                                            every: int):
    live, bodies = watched.live, templates()
    for place, (method, route, index, path) in enumerate(PLACES[chunk::4]):
        for _, (name, fragment, refused) in spread(corpus.VALUES, place, every):
            answer = await live.http.request(method, route, content=put(bodies[index][2], path,
                                                                         fragment))
            assert_ojs(answer, refused, f"{method} {route} {path} <- {name}")
            watched.pairs += 1


async def test_whole_bodies_segments_and_queries_on_ojs_routes(watched: Watch):
    live = watched.live
    for method, route, _ in templates():
        for name, body in corpus.BODIES:
            answer = await live.http.request(method, route, content=body)
            assert 400 <= answer.status_code < 500, f"{method} {route} <- {name}"
            assert_ojs(answer, True, f"{method} {route} <- {name}")
            watched.pairs += 1
    for method, route in PATH_ROUTES:
        for name, segment in corpus.SEGMENTS:
            answer = await live.http.request(method, route.format(segment))
            assert 400 <= answer.status_code < 500, f"{method} {route} <- {name}: {answer.text}"
            assert_ojs(answer, True, f"{method} {route} <- {name}")
            watched.pairs += 1
    for route, field in QUERIES:
        for name, value in [*corpus.NUMBERS_IN_QUERY, *corpus.SEGMENTS]:
            answer = await live.http.get(f"{route}?{field}={value}")
            assert_ojs(answer, False, f"{route}?{field}={value} ({name})")
            watched.pairs += 1
