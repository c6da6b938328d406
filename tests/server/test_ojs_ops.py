"""The OJS binding's operator routes on one SQLite server, over /ojs/v1 only: a job's OJS
retry policy sends it to the dead letter, which lists, retries (attempt 0 again) and
deletes it; queue counts, pause and resume; events read from the rows; a batch stored all
or nothing; unique options; a job's rate limit setting its queue's rate."""

from __future__ import annotations

from typing import Any

from conftest import Live

POLICY = {"max_attempts": 1, "initial_interval": "PT1S", "backoff_coefficient": 1.0,
          "jitter": False, "on_exhaustion": "dead_letter"}
ERROR = {"code": "handler_error", "message": "db down", "retryable": True,
         "details": {"error_class": "ConnectionError"}}


async def _call(live: Live, method: str, path: str, status: int = 200,
                body: Any = None) -> dict[str, Any]:
    response = await live.http.request(method, path, json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/openjobspec+json"
    return response.json()


async def _push(live: Live, n: int, status: int = 201, **options: Any) -> dict[str, Any]:
    body = {"type": "ops.test", "args": [{"n": n}], "options": {"queue": "ops", **options}}
    return await _call(live, "POST", "/ojs/v1/jobs", status, body)


async def _fail_next(live: Live) -> dict[str, Any]:
    """FETCH the next job of queue ops and NACK it; the NACK's answer."""
    fetched = await _call(live, "POST", "/ojs/v1/workers/fetch", 200,
                          {"queues": ["ops"], "worker_id": "ops-1"})
    [job] = fetched["jobs"]
    return await _call(live, "POST", "/ojs/v1/workers/nack", 200,
                       {"job_id": job["id"], "worker_id": "ops-1", "error": ERROR})


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

    await _push(live, 5, rate_limit={"max_per_second": 1})
    limits = (await live.http.get("/limits")).json()["limits"]
    assert [(entry["limit"], entry["rule"]) for entry in limits] == [
        ("queue:ops", {"rate": {"limit": 1, "period": 1.0, "burst": 1}})]
