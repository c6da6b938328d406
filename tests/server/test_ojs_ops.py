"""The OJS binding's operator routes on one SQLite server: a job's OJS retry policy sends it
to the dead letter, which lists, retries (attempt 0 again) and deletes it; queue counts,
pause and resume; events read from the rows; an all-or-nothing batch; a job's rate limit
setting its queue's rate. Jobs are made as the OJS routes make them (ojs_to_request) and
run by a raw /work worker, which needs nothing of the pull workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import Live, write_spec

from rota.core.ojs_map import ojs_to_request

POLICY = {"max_attempts": 1, "initial_interval": "PT1S", "backoff_coefficient": 1.0,
          "jitter": False, "on_exhaustion": "dead_letter"}


async def _push(live: Live, body: dict[str, Any], *, batch: bool = False
                ) -> list[tuple[dict[str, Any], bool] | Exception]:
    """Enqueue as the OJS routes do: the body mapped by ojs_to_request."""
    coordinator = live.coordinator
    request = ojs_to_request(body, coordinator.clock().wall)
    return await coordinator.enqueue([request])


async def _fail(worker: Any, error: dict[str, Any], count: int = 1) -> None:
    copies = await worker.jobs(count)
    await worker.beat(results=[{"job_id": copy["id"], "attempt": copy["attempt"],
                                "outcome": "failed", "error": error} for copy in copies])
    await worker.expect("ack")


async def _get(live: Live, path: str, status: int = 200) -> dict[str, Any]:
    response = await live.http.get(path)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/openjobspec+json"
    return response.json()


async def _post(live: Live, path: str, status: int = 200) -> dict[str, Any]:
    response = await live.http.post(path)
    assert response.status_code == status, response.text
    return response.json()


async def test_dead_letter_list_retry_delete_and_counts(live: Live, connect, tmp_path: Path):
    spec = write_spec(tmp_path, "dlq.test", queue="dlq")
    await live.push(spec)
    [(row, _)] = await _push(live, {"type": "dlq.test", "args": [{"n": 1}],
                                    "options": {"queue": "dlq", "retry": POLICY}})
    [(kept, _)] = await _push(live, {"type": "dlq.test", "args": [{"n": 2}],
                                     "options": {"queue": "dlq",
                                                 "retry": {**POLICY,
                                                           "on_exhaustion": "discard"}}})
    worker = await connect()
    await worker.register([spec], queues=["dlq"])
    error = {"type": "ConnectionError", "code": "handler_error", "message": "db down"}
    await _fail(worker, error, 2)
    await live.wait_state(kept["id"], "discarded")
    await live.wait_state(row["id"], "discarded")

    listed = await _get(live, "/ojs/v1/dead-letter")
    assert [job["id"] for job in listed["jobs"]] == [row["id"]]  # "discard": not listed
    [job] = listed["jobs"]
    assert (job["state"], job["attempt"], job["type"]) == ("discarded", 1, "dlq.test")
    assert [(e["code"], e["type"], e["attempt"]) for e in job["errors"]] == [
        ("handler_error", "ConnectionError", 1)]
    assert listed["pagination"] == {"total": 1, "limit": 50, "offset": 0, "has_more": False}
    assert (await _get(live, "/ojs/v1/dead-letter?limit=1&offset=1"))["jobs"] == []
    assert (await _get(live, "/ojs/v1/dead-letter?limit=0", 400))["error"]["code"] == \
        "invalid_request"

    stats = await _get(live, "/ojs/v1/queues/dlq/stats")
    assert stats["queue"]["name"] == "dlq" and stats["queue"]["discarded"] == 2
    assert stats["queue"]["available"] == 0 and stats["queue"]["paused"] is False
    done = await _get(live, "/ojs/v1/events?types=job.discarded&queues=dlq&limit=10")
    assert {e["data"]["job_id"] for e in done["events"]} == {row["id"], kept["id"]}
    assert all(e["type"] == "job.discarded" and e["data"]["duration_ms"] >= 0
               and e["data"]["attempt"] == 1 for e in done["events"])
    enqueued = await _get(live, "/ojs/v1/events?types=job.enqueued&queues=dlq")
    assert [e["data"]["job_id"] for e in enqueued["events"]][:2] == [kept["id"], row["id"]]
    assert (await _get(live, "/ojs/v1/events?types=job.nothing", 400))["error"]["code"] == \
        "invalid_request"

    # A retry: available, attempt 0 as OJS counts it, out of the dead letter; it runs again
    # (once its queue is resumed: the worker waiting would take it at once).
    await _post(live, "/ojs/v1/queues/dlq/pause")
    retried = (await _post(live, f"/ojs/v1/dead-letter/{row['id']}/retry"))["job"]
    assert (retried["state"], retried["attempt"]) == ("available", 0)
    assert (await _get(live, "/ojs/v1/dead-letter"))["jobs"] == []
    await _post(live, f"/ojs/v1/dead-letter/{row['id']}/retry", 404)
    await _post(live, f"/ojs/v1/dead-letter/{kept['id']}/retry", 404)  # discarded, not dead
    await _post(live, "/ojs/v1/queues/dlq/resume")
    await _fail(worker, error)
    await live.wait_state(row["id"], "discarded")
    assert [j["id"] for j in (await _get(live, "/ojs/v1/dead-letter"))["jobs"]] == [row["id"]]

    deleted = await live.http.delete(f"/ojs/v1/dead-letter/{row['id']}")
    assert deleted.json() == {"deleted": True, "job_id": row["id"]}
    assert (await _get(live, "/ojs/v1/dead-letter"))["jobs"] == []
    assert (await live.http.get(f"/jobs/{row['id']}")).status_code == 404
    gone = await live.http.delete(f"/ojs/v1/dead-letter/{row['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


async def test_pause_resume_and_queue_list(live: Live):
    paused = await _post(live, "/ojs/v1/queues/pause-test/pause")
    assert paused == {"queue": {"name": "pause-test", "paused": True, "status": "paused"}}
    assert {"name": "pause-test", "paused": True, "status": "paused"} in \
        (await _get(live, "/ojs/v1/queues"))["queues"]
    assert (await _get(live, "/ojs/v1/queues/pause-test/stats"))["queue"]["paused"] is True
    resumed = await _post(live, "/ojs/v1/queues/pause-test/resume")
    assert resumed["queue"]["paused"] is False
    assert (await _post(live, "/ojs/v1/queues/no%20such/pause", 400))["error"]["type"] == \
        "validation_error"


async def test_all_or_nothing_batch_unique_options_and_a_jobs_rate_limit(live: Live,
                                                                         tmp_path: Path):
    await live.push(write_spec(tmp_path, "bulk.job", queue="bulk"))
    coordinator = live.coordinator
    now = coordinator.clock().wall

    def job(n: int, **options: Any) -> Any:
        return ojs_to_request({"type": "bulk.job", "args": [{"n": n}],
                               "options": {"queue": "bulk", **options}}, now)

    [(first, created)] = await coordinator.enqueue([job(0)], all_or_nothing=True)
    assert created
    taken = await coordinator.enqueue([job(1), job(2)], all_or_nothing=True)
    assert [new for _, new in taken] == [True, True]
    # A job whose id is stored already refuses the whole batch: nothing of it is stored.
    again = job(3)
    again.id = first["id"]
    refused = await coordinator.enqueue([job(4), again], all_or_nothing=True)
    assert [getattr(r, "code", None) for r in refused] == ["unstored", "id_conflict"]
    stats = await _get(live, "/ojs/v1/queues/bulk/stats")
    assert stats["queue"]["available"] == 3

    unique = {"keys": ["type", "args"], "on_conflict": "reject", "states": ["available"]}
    [(held, _)] = await coordinator.enqueue([job(9, unique=unique)])
    [rejected] = await coordinator.enqueue([job(9, unique=unique)])
    assert rejected.code == "unique_conflict"
    [(same, created)] = await coordinator.enqueue(
        [job(9, unique={**unique, "on_conflict": "ignore"})])
    assert (same["id"], created) == (held["id"], False)
    [(new, created)] = await coordinator.enqueue(
        [job(9, unique={**unique, "on_conflict": "replace"})])
    assert created and new["id"] != held["id"]
    await live.wait_state(held["id"], "cancelled")
    # In a batch, a held key refuses everything (ignore does not: it gives the holder).
    refused = await coordinator.enqueue([job(10), job(9, unique=unique)], all_or_nothing=True)
    assert [getattr(r, "code", None) for r in refused] == ["unstored", "unique_conflict"]

    await coordinator.ojs_rates([job(5, rate_limit={"max_per_second": 1})])
    limits = (await live.http.get("/limits")).json()["limits"]
    assert [(entry["limit"], entry["rule"]) for entry in limits] == [
        ("queue:bulk", {"rate": {"limit": 1, "period": 1.0, "burst": 1}})]
