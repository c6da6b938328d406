"""Runs OJS conformance test files against a server over HTTP (httpx) and says, step by
step, what held: the thin I/O shell around ojs_verdict's judgement."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from ojs_judge import Reply, render, substitute
from ojs_suites import Case
from ojs_verdict import Failure, judge

OJS_MEDIA_TYPE = "application/openjobspec+json"
Sleep = Callable[[float], Awaitable[None]]


class Spread:
    """Several servers of one cluster as one client: each request goes to the next, round
    robin (so that a test's steps land on different servers, as a cluster's clients
    would); ``each`` is every server's client (a reset is posted to them all)."""

    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        if not clients:
            raise ValueError("no server to send to")
        self.each = list(clients)
        self._turn = 0

    async def request(self, method: str, url: str, **options: Any) -> httpx.Response:
        client = self.each[self._turn % len(self.each)]
        self._turn += 1
        return await client.request(method, url, **options)


Client = httpx.AsyncClient | Spread


@dataclass
class StepVerdict:
    step: str
    status: int | None  # the HTTP status, None for a step that sent nothing
    failures: list[Failure]


@dataclass
class CaseResult:
    test_id: str
    name: str
    level: int
    category: str
    spec_ref: str
    file: str
    status: str  # "pass", "fail", or "error" (a setup step failed)
    duration_ms: int
    failures: list[Failure] = field(default_factory=list)
    steps: list[StepVerdict] = field(default_factory=list)


async def send(client: Client, step: dict[str, Any],
               replies: dict[str, Reply]) -> Reply:
    """The step's request, its templates filled from ``replies``. The body is sent as
    written; ``raw_body`` as its text (the reference sends nothing for it: an unknown field
    there)."""
    headers = {name: render(value, replies) for name, value in (step.get("headers") or {}).items()}
    content: str | None = None
    if "raw_body" in step:
        content = str(step["raw_body"])
    elif "body" in step:
        content = json.dumps(substitute(step["body"], replies))
    if content is not None and not any(name.lower() == "content-type" for name in headers):
        headers["Content-Type"] = OJS_MEDIA_TYPE
    started = time.perf_counter()
    response = await client.request(step["action"], render(step["path"], replies),
                                     headers=headers, content=content)
    elapsed = int((time.perf_counter() - started) * 1000)
    try:
        body = response.json() if response.text.strip() else None
    except ValueError:
        body = None
    first: dict[str, str] = {}
    for name, value in response.headers.multi_items():
        first.setdefault(name.lower(), value)
    return Reply(response.status_code, first, response.text, body, elapsed)


async def run_step(client: Client, step: dict[str, Any], replies: dict[str, Reply],
                   sleep: Sleep) -> StepVerdict:
    sid = step["id"]
    if step.get("delay_ms"):
        await sleep(step["delay_ms"] / 1000)  # noqa: sleep-ok (the suite's own delay_ms)
    if step["action"] == "WAIT":  # as the reference: duration_ms, else delay_ms (again)
        wait = step.get("duration_ms") or step.get("delay_ms") or 0
        await sleep(wait / 1000)  # noqa: sleep-ok (the suite's WAIT step)
        return StepVerdict(sid, None, [])
    if step["action"] == "ASSERT":
        return StepVerdict(sid, None, judge(step, None, replies))
    try:
        reply = await send(client, step, replies)
    except httpx.HTTPError as error:
        return StepVerdict(sid, None, [Failure(sid, "request", f"HTTP request failed: {error!r}")])
    failures = judge(step, reply, replies)
    replies[sid] = reply
    return StepVerdict(sid, reply.status, failures)


def _batches(steps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The steps in order, those linked by ``parallel_with`` (and adjacent) together."""
    linked = {step["id"] for step in steps if step.get("parallel_with")}
    linked |= {step["parallel_with"] for step in steps if step.get("parallel_with")}
    batches: list[list[dict[str, Any]]] = []
    for step in steps:
        if batches and step["id"] in linked and batches[-1][-1]["id"] in linked:
            batches[-1].append(step)
        else:
            batches.append([step])
    return batches


async def run_case(client: Client, case: Case,
                   sleep: Sleep = asyncio.sleep) -> CaseResult:
    """One test file: setup steps (any failure makes the result "error" and stops),
    the steps, then teardown steps (not judged)."""
    started = time.perf_counter()
    replies: dict[str, Reply] = {}
    verdicts: list[StepVerdict] = []
    status = "pass"
    for step in case.setup:
        verdict = await run_step(client, step, replies, sleep)
        if verdict.failures:
            verdicts.append(verdict)
            status = "error"
            break
    if status == "pass":
        for batch in _batches(case.steps):
            verdicts += await asyncio.gather(*(run_step(client, step, replies, sleep)
                                               for step in batch))
        for step in case.teardown:
            await run_step(client, step, replies, sleep)
    failures = [failure for verdict in verdicts for failure in verdict.failures]
    if failures and status == "pass":
        status = "fail"
    return CaseResult(case.test_id, case.name, case.level, case.category, case.spec_ref,
                      str(case.file), status, int((time.perf_counter() - started) * 1000),
                      failures, verdicts)


async def run_cases(client: Client, cases: list[Case], reset: str | None = None,
                    sleep: Sleep = asyncio.sleep) -> list[CaseResult]:
    """The cases one after the other; ``reset``: a path POSTed before each, to every server
    (a server's test-only state reset), its answer ignored as the reference ignores it."""
    results = []
    servers = client.each if isinstance(client, Spread) else [client]
    for case in cases:
        for server in servers if reset else []:
            try:
                await server.post(reset)
            except httpx.HTTPError:
                pass
        results.append(await run_case(client, case, sleep))
    return results
