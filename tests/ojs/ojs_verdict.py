"""A step of an OJS conformance test judged on the reply it got, with no I/O: status,
headers, body paths, timing, raw substrings, and the two cross-step checks (ASSERT steps)
the suites use. Every assertion kind it does not know is a failure, never a pass."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ojs_judge import (APPROX_TOLERANCE_PCT, MIN_TIMING_TOLERANCE_MS, INTEGER, PathError, Reply,
                       match, render, resolve_path, show, substitute, value_of)

# What each assertion kind of a step is judged on; the loader refuses a file using another.
REPLY_KINDS = ("status", "status_in", "body", "body_absent", "headers", "timing_ms",
               "body_contains")
CROSS_STEP_KINDS = ("exclusive_claim", "equality")  # ASSERT steps: no request of their own
KINDS = REPLY_KINDS + CROSS_STEP_KINDS


@dataclass
class Failure:
    step: str
    field: str
    message: str
    expected: str = ""
    actual: str = ""


def judge(step: Mapping[str, Any], reply: Reply | None,
          replies: Mapping[str, Reply]) -> list[Failure]:
    """The failures of one step; ``replies`` holds the earlier steps' (for templates)."""
    assertions = step.get("assertions") or {}
    sid = str(step.get("id", "?"))
    failures: list[Failure] = []
    for kind in assertions:
        if kind not in KINDS:
            failures.append(Failure(sid, kind, f"assertion kind {kind!r}: this runner cannot"
                                    " judge it"))
    if reply is None:  # an ASSERT step
        for kind in set(assertions) & set(REPLY_KINDS):
            failures.append(Failure(sid, kind, f"{kind}: a step that sends no request"))
        if "exclusive_claim" in assertions:
            failures += _exclusive_claim(sid, value_of(assertions["exclusive_claim"], replies))
        if "equality" in assertions:
            failures += _equality(sid, assertions["equality"], replies)
        return failures
    for kind in set(assertions) & set(CROSS_STEP_KINDS):
        failures.append(Failure(sid, kind, f"{kind}: only an ASSERT step may say it"))
    if "status" in assertions:
        if (why := judge_status(assertions["status"], reply.status)) is not None:
            failures.append(Failure(sid, "status", why, show(assertions["status"]),
                                    str(reply.status)))
    if "status_in" in assertions and reply.status not in assertions["status_in"]:
        failures.append(Failure(sid, "status", f"expected a status in"
                                f" {assertions['status_in']}, got {reply.status}"))
    failures += judge_body(sid, assertions.get("body") or {}, reply, replies)
    for path in assertions.get("body_absent") or []:
        try:
            value = resolve_path(render(path, replies), reply.body)
        except PathError:
            value = None
        if value is not None:
            failures.append(Failure(sid, path, f"expected {path} absent, got {show(value)}"))
    failures += _headers(sid, assertions.get("headers") or {}, reply)
    failures += _timing(sid, assertions.get("timing_ms") or {}, reply.elapsed_ms)
    for needle in assertions.get("body_contains") or []:
        if needle not in reply.text:
            failures.append(Failure(sid, "body_contains", f"the body lacks {needle!r}"))
    return failures


def judge_status(matcher: Any, status: int) -> str | None:
    """A number; "one_of:200,204"; a string matcher ("number:range(400, 422)"); {"$in": []}."""
    if isinstance(matcher, int) and not isinstance(matcher, bool):
        return None if status == matcher else f"expected status {matcher}, got {status}"
    if isinstance(matcher, str) and matcher.startswith("one_of:"):
        codes = [code.strip() for code in matcher[len("one_of:"):].split(",")]
        if not all(INTEGER.fullmatch(code) for code in codes):
            return f"invalid status matcher {matcher!r}"
        return None if status in map(int, codes) else f"expected {matcher}, got {status}"
    if isinstance(matcher, str):
        return match(matcher, status)
    options = matcher.get("$in") if isinstance(matcher, dict) else None
    if isinstance(options, list):
        return None if status in options else f"expected a status in {options}, got {status}"
    return f"unknown status matcher {show(matcher)}"


def _is_empty(reply: Reply) -> bool:
    return reply.body is None and not reply.text.strip()


def judge_body(sid: str, body: Mapping[str, Any], reply: Reply,
               replies: Mapping[str, Reply]) -> list[Failure]:
    """Each ``path: matcher`` of a step's body assertions, on the reply's JSON.

    Two choices where the reference is looser: a reply whose body is not a JSON object
    has its paths judged (the reference skips them all), and ``{"$empty": true}`` holds
    only for an empty body (the reference's never holds inside ``$or``, always outside)."""
    failures: list[Failure] = []
    for path, matcher in body.items():
        if path == "$or":
            options = matcher if isinstance(matcher, list) else []
            if not any(isinstance(option, dict) and not judge_body(sid, option, reply, replies)
                       for option in options):
                failures.append(Failure(sid, "$or", f"no alternative of {show(matcher)} holds"))
            continue
        if path == "$empty":
            if (matcher is True) != _is_empty(reply):
                failures.append(Failure(sid, "$empty", f"expected the body empty: {matcher}"))
            continue
        if path.startswith("$") and not path.startswith("$."):
            failures.append(Failure(sid, path, f"body operator {path!r}: this runner cannot"
                                    " judge it"))
            continue
        want = substitute(matcher, replies)
        try:
            value = resolve_path(render(path, replies), reply.body)
        except PathError as error:
            if want != "absent":
                failures.append(Failure(sid, path, f"{path}: {error}", show(want)))
            continue
        if (why := match(want, value)) is not None:
            failures.append(Failure(sid, path, f"{path}: {why}", show(want), show(value)))
    return failures


def _headers(sid: str, headers: Mapping[str, Any], reply: Reply) -> list[Failure]:
    """Exact values, or {"$match": regex} (found anywhere) or {"$eq": value}; a missing
    header is the empty string, as Go's Header.Get answers."""
    failures = []
    for name, want in headers.items():
        got = reply.headers.get(name.lower(), "")
        if isinstance(want, dict) and isinstance(want.get("$match"), str):
            try:
                ok = re.search(want["$match"], got) is not None
            except re.error:
                ok = False
        elif isinstance(want, dict):
            ok = "$eq" not in want or got == want["$eq"]
        else:
            ok = got == want
        if not ok:
            failures.append(Failure(sid, f"header:{name}", f"header {name}: expected"
                                    f" {show(want)}, got {got!r}", show(want), got))
    return failures


def _timing(sid: str, timing: Mapping[str, Any], elapsed: int) -> list[Failure]:
    failures = []
    if "less_than" in timing and not elapsed < timing["less_than"]:
        failures.append(Failure(sid, "timing", f"expected < {timing['less_than']} ms,"
                                f" took {elapsed} ms"))
    if "greater_than" in timing and not elapsed > timing["greater_than"]:
        failures.append(Failure(sid, "timing", f"expected > {timing['greater_than']} ms,"
                                f" took {elapsed} ms"))
    if "approximate" in timing:
        expected = timing["approximate"]
        tolerance = max(expected * APPROX_TOLERANCE_PCT / 100, MIN_TIMING_TOLERANCE_MS)
        if abs(elapsed - expected) > tolerance:
            failures.append(Failure(sid, "timing", f"expected ~{expected} ms (±{tolerance:.0f}),"
                                    f" took {elapsed} ms"))
    return failures


def _exclusive_claim(sid: str, claim: Any) -> list[Failure]:
    """Concurrent fetches: exactly one got the job, exactly one got nothing. (The
    reference does not judge this kind; its intent is plain in the file.)"""
    if not isinstance(claim, dict) or not isinstance(claim.get("fetches"), list):
        return [Failure(sid, "exclusive_claim", f"malformed: {show(claim)}")]
    fetched = [jobs if isinstance(jobs, list) else [] if jobs is None else None
               for jobs in claim["fetches"]]
    if any(jobs is None for jobs in fetched):  # a template that named nothing stays text
        return [Failure(sid, "exclusive_claim", f"a fetch is not a job list: {show(claim)}")]
    holders = sum(any(isinstance(job, dict) and job.get("id") == claim.get("job_id")
                      for job in jobs) for jobs in fetched)
    empties = sum(not jobs for jobs in fetched)
    failures = []
    if claim.get("exactly_one_has_job") and holders != 1:
        failures.append(Failure(sid, "exclusive_claim", f"{holders} fetches got the job"))
    if claim.get("exactly_one_empty") and empties != 1:
        failures.append(Failure(sid, "exclusive_claim", f"{empties} fetches got nothing"))
    return failures


def _equality(sid: str, pairs: Any, replies: Mapping[str, Reply]) -> list[Failure]:
    """``"$.steps.<id>.response.body...": "{{steps...}}"``: two values are equal. (Not
    judged by the reference either.)"""
    if not isinstance(pairs, dict):
        return [Failure(sid, "equality", f"malformed: {show(pairs)}")]
    document = {"steps": {key: {"response": {"body": reply.body, "status": reply.status}}
                          for key, reply in replies.items()}}
    failures = []
    for path, other in pairs.items():
        try:
            left = resolve_path(path, document)
        except PathError as error:
            failures.append(Failure(sid, path, f"{path}: {error}"))
            continue
        right = value_of(other, replies)
        if left is None or left != right:
            failures.append(Failure(sid, path, f"{path} differs", show(right), show(left)))
    return failures
