"""The answers an endpoint should not give, through a live `rota serve` and the endpoint
rig (tests/endpoint_rig.py, a subprocess): a 200 that is not JSON, one over the 1 MiB cap,
one not UTF-8, one nested deeper than a parser goes; the allowed empty answers (a 200
with no body, a 204); a 202 that never calls back. Each job ends as docs/push.md's table
says, its record (type, message, status, body) in GET /jobs/{id} and the server's log
line; jobs of a good endpoint complete meanwhile, a stored job nobody runs is untouched,
and the server's log has no traceback and no ERROR line."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import end, free_port, rota, spawn_serve
from test_deliverer import SECRET, Rig, running_rig, socket_closed
from test_push import enqueue, push, settled, spec


@dataclass
class Served:
    http: httpx.AsyncClient
    log: Path


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with running_rig(tmp_path_factory.mktemp("answers") / "rig.log") as rig:
        yield rig


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    port = free_port()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
    log = tmp_path / "serve.log"
    proc = await spawn_serve(http, ["--port", str(port), "--db", str(tmp_path / "rota.db"),
                                    "--allow-private-endpoints"], log,
                             env={"ROTA_SECRET_MAIN": SECRET})
    try:
        yield Served(http, log)
    finally:
        await end([proc], [http])


# path on the rig -> the type and message of each of its two failed attempts
BAD = {
    "/notjson": ("bad_response", "HTTP 200, but the answer is not JSON (JSON is malformed: "),
    "/huge": ("bad_response", "HTTP 200, but the answer is over 1048576 bytes"),
    "/latin1": ("bad_response", "HTTP 200, but the answer is not UTF-8 (byte 13)"),
    "/deep": ("bad_response", "HTTP 200, but the answer is nested too deeply"),
}
SHOWN = {"/notjson": "hello", "/latin1": '{"name": "caf\ufffd"}'}  # the record's body


def name_of(path: str) -> str:
    return path.strip("/").replace("-", "")


async def test_each_bad_answer_fails_precisely_and_hurts_nothing_else(served, rig):
    http = served.http
    await push(http, spec("good", rig.url("/ok")),
               *(spec(name_of(path), rig.url(path)) for path in BAD),
               spec("empty", rig.url("/empty")), spec("nocontent", rig.url("/nocontent")),
               spec("silent", rig.url("/accept-silent"), visibility_timeout=1),
               {"name": "kept", "version": "1"})  # a worker's spec: no worker comes
    kept = [await enqueue(http, "kept", {"k": k}) for k in range(3)]
    before = [(await http.get(f"/jobs/{job_id}")).json() for job_id in kept]
    ids = {path: await enqueue(http, name_of(path), {"n": 1}) for path in BAD}
    good = [await enqueue(http, "good", {"i": i}) for i in range(5)]
    empty, nocontent, silent = [await enqueue(http, name, {"n": 2})
                                for name in ("empty", "nocontent", "silent")]
    good += [await enqueue(http, "good", {"i": i}) for i in range(5, 10)]

    for path, (type_, message) in BAD.items():
        job = await settled(http, ids[path])
        assert job["state"] == "discarded", (path, job)
        assert [e["type"] for e in job["errors"]] == [type_, type_], (path, job["errors"])
        for error in job["errors"]:  # retried once (max_attempts 2), each attempt recorded
            assert error["message"].startswith(message), (path, error)
            assert error["retryable"] is True and error["details"]["status"] == 200, error
            assert error["details"]["delivery_id"] and error["details"]["ms"] > 0, error
            body = error["details"]["body"]
            assert len(body) <= 2048 and body == SHOWN.get(path, body), (path, body[:80])
        assert error["details"]["delivery_id"] != job["errors"][0]["details"]["delivery_id"]
    assert len((await settled(http, ids["/huge"]))["errors"][0]["details"]["body"]) == 2048

    for job_id in (empty, nocontent):  # allowed: completed, with no result
        job = await settled(http, job_id)
        assert (job["state"], job["result"], job["errors"]) == ("completed", None, []), job
        status = 200 if job_id == empty else 204
        [line] = [g["message"] for g in job["logs"] if g["message"].startswith("delivered:")]
        assert re.fullmatch(rf"delivered: HTTP {status} in \d+ ms \(delivery [-0-9a-f]+\)",
                            line), line

    job = await settled(http, silent)  # 202, then silence: each lease lapses (2 s at least)
    assert job["state"] == "discarded" and \
        [e["type"] for e in job["errors"]] == ["visibility_timeout"] * 2, job
    assert job["errors"][0]["message"] == "no result or heartbeat for 2s", job["errors"]
    accepted = [g["message"] for g in job["logs"] if g["message"].startswith("delivered:")]
    assert len(accepted) == 2 and all("HTTP 202" in m and '"accepted"' in m for m in accepted)

    for job_id in good:  # the server kept serving the good endpoint throughout
        job = await settled(http, job_id)
        assert job["state"] == "completed" and job["result"]["echo"]["i"] in range(10), job
    after = [(await http.get(f"/jobs/{job_id}")).json() for job_id in kept]
    assert after == before and {j["state"] for j in after} == {"available"}
    assert (await http.get("/healthz")).status_code == 200

    log = served.log.read_text()
    assert "Traceback" not in log and not re.search(r"^\S+ \S+ (ERROR|CRITICAL) ", log, re.M), log[-3000:]
    for path, (type_, message) in BAD.items():  # one WARNING line per attempt, precise
        lines = [line for line in log.splitlines() if f"job={ids[path]} " in line
                 and " delivered " in line]
        assert len(lines) == 2 and all(f"outcome=failed error={type_}: {message}" in line
                                       and "status=200" in line for line in lines), lines
    posted = [line for line in rig.lines() if line["path"] != "callback"]
    assert all(line["signed"] and line["whole"] for line in posted)


async def test_a_run_on_an_endpoint_that_is_down_says_why_it_has_not_finished(served):
    """A new user's slip: the endpoint not started. `rota run` times out, and names the
    refused connection (before, only "has not finished", the job "retryable", no error)."""
    with socket_closed() as port:
        await push(served.http, spec("nobody", f"http://127.0.0.1:{port}/greet",
                                     retry={"max_attempts": 5, "backoff_base": 30}))
        code, out, err = await rota("run", "nobody", "--args", "{}", "--wait", "3",
                                    env={"ROTA_URL": str(served.http.base_url)})
    assert code == 2 and json.loads(out)["state"] == "retryable", out + err
    assert re.fullmatch(r"job \S+ has not finished after 3s; attempt 1 failed: connect: .*"
                        r"Connection refused.* \(see 'rota jobs show \S+'\)\n", err), err


# The classes test_push.py's test_each_class_of_answer_settles_its_job leaves to the
# deliverer's own test: path -> the errors' types (a retry each, up to max_attempts 2).
CLASSES = {
    "/fail": ["http_500", "http_500"],
    "/gone": ["http_404"],  # not retried: a misconfigured endpoint
    "/redirect": ["redirect"],  # another host: named, not followed, not retried
    "/hang": ["timeout", "timeout"],
}


async def test_the_other_classes_of_answer_live(served, rig):
    http = served.http
    await push(http, *(spec(name_of(path), rig.url(path)) for path in CLASSES
                       if path != "/hang"),
               spec("hang", rig.url("/hang"), execute={"url": rig.url("/hang"),
                                                      "secret": "main", "timeout": 0.5}),
               spec("redirectsame", rig.url("/redirect-same")))
    ids = {path: await enqueue(http, name_of(path), {"n": 3}) for path in CLASSES}
    same = await enqueue(http, "redirectsame", {"n": 3})
    for path, types in CLASSES.items():
        job = await settled(http, ids[path])
        assert job["state"] == "discarded", (path, job)
        assert [e["type"] for e in job["errors"]] == types, (path, job["errors"])
    assert "http://other.invalid/x" in (await settled(http, ids["/redirect"]))["errors"][0][
        "message"]
    hung = (await settled(http, ids["/hang"]))["errors"][0]
    assert hung["details"]["status"] is None and hung["retryable"] is True, hung
    job = await settled(http, same)  # a redirect to the same host is followed
    assert (job["state"], job["result"]) == ("completed", {"echo": {"n": 3}}), job
    assert [line["path"] for line in rig.lines() if line.get("job_id") == same] == \
        ["/redirect-same", "/ok"]
    for path, types in CLASSES.items():  # one POST per attempt, each signed
        posts = [line for line in rig.lines() if line.get("job_id") == ids[path]]
        assert len(posts) == len(types) and all(p["signed"] for p in posts), (path, posts)
    log = served.log.read_text()
    assert "Traceback" not in log and not re.search(r"^\S+ \S+ (ERROR|CRITICAL) ", log, re.M)
