"""The OJS binding's operator routes on one SQLite server, over /ojs/v1 only: a job's OJS
retry policy sends it to the dead letter, which lists, retries (attempt 0 again) and
deletes it; queue counts, pause and resume; events read from the rows; a batch stored all
or nothing; unique options; a job's rate limit setting its queue's rate."""

from __future__ import annotations

from typing import Any

from conftest import Live
from helpers import bearer, make_tokens

POLICY = {"max_attempts": 1, "initial_interval": "PT1S", "backoff_coefficient": 1.0,
          "jitter": False, "on_exhaustion": "dead_letter"}
ERROR = {"code": "handler_error", "message": "db down", "retryable": True,
         "details": {"error_class": "ConnectionError"}}


async def _call(live: Live, method: str, path: str, status: int = 200,
                body: Any = None, token: str | None = None) -> dict[str, Any]:
    response = await live.http.request(method, path, json=body,
                                       headers=bearer(token) if token else None)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/openjobspec+json"
    return response.json()


async def _push(live: Live, n: int, status: int = 201, token: str | None = None,
                **options: Any) -> dict[str, Any]:
    body = {"type": "ops.test", "args": [{"n": n}], "options": {"queue": "ops", **options}}
    return await _call(live, "POST", "/ojs/v1/jobs", status, body, token)


async def _fail_next(live: Live, token: str | None = None) -> dict[str, Any]:
    """FETCH the next job of queue ops and NACK it; the NACK's answer."""
    fetched = await _call(live, "POST", "/ojs/v1/workers/fetch", 200,
                          {"queues": ["ops"], "worker_id": "ops-1"}, token)
    [job] = fetched["jobs"]
    return await _call(live, "POST", "/ojs/v1/workers/nack", 200,
                       {"job_id": job["id"], "worker_id": "ops-1", "error": ERROR}, token)


async def test_dead_letter_list_retry_delete_counts_and_events(live: Live):
    dead = (await _push(live, 1, retry=POLICY))["job"]
    kept = (await _push(live, 2, retry={**POLICY, "on_exhaustion": "discard"}))["job"]
    assert (await _fail_next(live))["state"] == "discarded"
    assert (await _fail_next(live))["state"] == "discarded"

    listed = await _call(live, "GET", "/ojs/v1/dead-letter")
    assert [job["id"] for job in listed["jobs"]] == [dead["id"]]  # "discard": not listed
    [job] = listed["jobs"]
    assert (job["state"], job["attempt"], job["type"]) == ("discarded", 1, "ops.test")
    assert [(e["code"], e["type"], e["attempt"]) for e in job["errors"]] == [
        ("handler_error", "ConnectionError", 1)]
    assert listed["pagination"] == {"total": 1, "limit": 50, "offset": 0, "has_more": False}
    assert (await _call(live, "GET", "/ojs/v1/dead-letter?limit=1&offset=1"))["jobs"] == []
    assert (await _call(live, "GET", "/ojs/v1/dead-letter?queue=ops"))["jobs"] == [job]
    other = await _call(live, "GET", "/ojs/v1/dead-letter?queue=other")
    assert (other["jobs"], other["pagination"]["total"]) == ([], 0)
    refused = await _call(live, "GET", "/ojs/v1/dead-letter?limit=0", 400)
    assert refused["error"]["code"] == "invalid_request"

    stats = (await _call(live, "GET", "/ojs/v1/queues/ops/stats"))["queue"]
    assert (stats["name"], stats["discarded"], stats["available"], stats["paused"]) == (
        "ops", 2, 0, False)
    done = await _call(live, "GET", "/ojs/v1/events?types=job.discarded&queues=ops&limit=10")
    assert {e["data"]["job_id"] for e in done["events"]} == {dead["id"], kept["id"]}
    assert all(e["type"] == "job.discarded" and e["data"]["duration_ms"] >= 0
               and e["data"]["attempt"] == 1 for e in done["events"])
    enqueued = await _call(live, "GET", "/ojs/v1/events?types=job.enqueued&queues=ops")
    assert [e["data"]["job_id"] for e in enqueued["events"]] == [kept["id"], dead["id"]]
    refused = await _call(live, "GET", "/ojs/v1/events?types=job.nothing", 400)
    assert refused["error"]["code"] == "invalid_request"

    # A retry: available, attempt 0 as OJS counts it, out of the dead letter; it runs again.
    retried = (await _call(live, "POST", f"/ojs/v1/dead-letter/{dead['id']}/retry"))["job"]
    assert (retried["state"], retried["attempt"]) == ("available", 0)
    assert (await _call(live, "GET", "/ojs/v1/dead-letter"))["jobs"] == []
    await _call(live, "POST", f"/ojs/v1/dead-letter/{dead['id']}/retry", 404)
    await _call(live, "POST", f"/ojs/v1/dead-letter/{kept['id']}/retry", 404)  # not dead
    assert (await _fail_next(live))["state"] == "discarded"
    assert [j["id"] for j in (await _call(live, "GET", "/ojs/v1/dead-letter"))["jobs"]] == \
        [dead["id"]]

    deleted = await _call(live, "DELETE", f"/ojs/v1/dead-letter/{dead['id']}")
    assert deleted == {"deleted": True, "job_id": dead["id"]}
    assert (await _call(live, "GET", "/ojs/v1/dead-letter"))["jobs"] == []
    await _call(live, "GET", f"/ojs/v1/jobs/{dead['id']}", 404)
    gone = await _call(live, "DELETE", f"/ojs/v1/dead-letter/{dead['id']}", 404)
    assert gone["error"]["code"] == "not_found"


async def test_pause_resume_and_queue_list(live: Live):
    paused = await _call(live, "POST", "/ojs/v1/queues/pause-test/pause")
    assert paused == {"queue": {"name": "pause-test", "paused": True, "status": "paused"}}
    assert {"name": "pause-test", "paused": True, "status": "paused"} in \
        (await _call(live, "GET", "/ojs/v1/queues"))["queues"]
    await _push(live, 1)  # (queue ops)
    page = await _call(live, "GET", "/ojs/v1/queues?limit=1")
    assert page["queues"] == [{"name": "ops", "paused": False, "status": "active"}]
    assert page["pagination"] == {"total": 2, "limit": 1, "offset": 0, "has_more": True}
    stats = await _call(live, "GET", "/ojs/v1/queues/pause-test/stats")
    assert stats["queue"]["paused"] is True
    resumed = await _call(live, "POST", "/ojs/v1/queues/pause-test/resume")
    assert resumed["queue"]["paused"] is False
    refused = await _call(live, "POST", "/ojs/v1/queues/no%20such/pause", 400)
    assert refused["error"]["type"] == "validation_error"


async def test_batch_all_or_nothing_unique_options_and_a_jobs_rate_limit(live: Live):
    first = (await _push(live, 0))["job"]
    jobs = [{"type": "ops.test", "args": [{"n": n}], "options": {"queue": "ops"}}
            for n in (1, 2)]
    assert (await _call(live, "POST", "/ojs/v1/jobs/batch", 201, {"jobs": jobs}))["count"] == 2
    # A job whose id is stored already refuses the whole batch: nothing of it is stored.
    again = {"jobs": [*jobs, {**jobs[0], "id": first["id"]}]}
    refused = await _call(live, "POST", "/ojs/v1/jobs/batch", 409, again)
    assert refused["error"]["code"] == "duplicate"
    assert (await _call(live, "GET", "/ojs/v1/queues/ops/stats"))["queue"]["available"] == 3

    unique = {"keys": ["type", "args"], "on_conflict": "reject", "states": ["available"]}
    held = (await _push(live, 9, unique=unique))["job"]
    assert (await _push(live, 9, 409, unique=unique))["error"]["code"] == "duplicate"
    same = await _push(live, 9, 200, unique={**unique, "on_conflict": "ignore"})
    assert same["job"]["id"] == held["id"]
    new = (await _push(live, 9, unique={**unique, "on_conflict": "replace"}))["job"]
    assert new["id"] != held["id"]
    assert (await _call(live, "GET", f"/ojs/v1/jobs/{held['id']}"))["job"]["state"] == \
        "cancelled"
    # In a batch, a held key refuses everything (ignore does not: it gives the holder).
    batch = {"jobs": [jobs[0], {**jobs[0], "args": [{"n": 9}],
                                "options": {"queue": "ops", "unique": unique}}]}
    assert (await _call(live, "POST", "/ojs/v1/jobs/batch", 409, batch))["error"]["code"] == \
        "duplicate"
    assert (await _call(live, "GET", "/ojs/v1/queues/ops/stats"))["queue"]["available"] == 4

    # A batch stored as nothing sets no rate.
    await _call(live, "POST", "/ojs/v1/jobs/batch", 409, {"jobs": [
        {**jobs[0], "options": {"queue": "ops", "rate_limit": {"max_per_second": 7}}},
        {**jobs[0], "id": first["id"]}]})
    assert (await live.http.get("/limits")).json()["limits"] == []
    await _push(live, 5, rate_limit={"max_per_second": 1})
    limits = (await live.http.get("/limits")).json()["limits"]
    assert [(entry["limit"], entry["rule"]) for entry in limits] == [
        ("queue:ops", {"rate": {"limit": 1, "period": 1.0, "burst": 1}})]


async def test_a_refused_push_sets_no_rate(live: Live):
    """A reviewer throttled any queue with a token kept to another queue: the push got
    403, its rate_limit was in force all the same."""
    admin, kept = await make_tokens(live, ("admin", None), ("producer", ["elsewhere"]))
    await _push(live, 5, 403, kept, rate_limit={"max_per_minute": 0.0001})
    limits = await live.http.get("/limits", headers=bearer(admin))
    assert limits.json()["limits"] == []


async def test_a_producers_dead_job_is_named_as_its_view_shows_it(live: Live, connect):
    admin, producer, worker = await make_tokens(live, ("admin", None), ("producer", None),
                                                ("worker", None))
    dead = (await _push(live, 1, token=producer, retry=POLICY))["job"]
    # (A /work worker: it names the job by the id it is kept under, <token id>:<id>.)
    raw = await connect("w1", additional_headers=bearer(worker))
    await raw.register([], queues=["ops"], declared={"ops.test": "unversioned"})
    error = {"type": "ConnectionError", "message": "db down"}
    await _fail(raw, error)
    [job] = (await _call(live, "GET", "/ojs/v1/dead-letter", token=admin))["jobs"]
    assert job["id"] == dead["id"] and ":" not in job["id"]
    [event] = (await _call(live, "GET", "/ojs/v1/events?types=job.discarded",
                           token=admin))["events"]
    assert event["data"]["job_id"] == event["subject"] == dead["id"]
    await _call(live, "GET", "/ojs/v1/dead-letter", 403, token=producer)
    await _call(live, "POST", "/ojs/v1/queues/ops/pause", token=admin)  # (the worker waits)
    retried = await _call(live, "POST", f"/ojs/v1/dead-letter/{dead['id']}/retry", token=admin)
    assert (retried["job"]["id"], retried["job"]["attempt"]) == (dead["id"], 0)
    await _call(live, "POST", "/ojs/v1/queues/ops/resume", token=admin)
    await _fail(raw, error)
    deleted = await _call(live, "DELETE", f"/ojs/v1/dead-letter/{dead['id']}", token=admin)
    assert deleted == {"deleted": True, "job_id": dead["id"]}


async def _fail(raw: Any, error: dict[str, Any]) -> None:
    [copy] = await raw.jobs(1)
    await raw.beat(results=[{"job_id": copy["id"], "attempt": copy["attempt"],
                             "outcome": "failed", "error": error}])
    await raw.expect("ack")
