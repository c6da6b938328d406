"""The operator's routes on a real server: GET /jobs (filters, cursor), bulk retry and
cancel, queue pause and resume (kept across a restart), worker resume."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import Live, open_store, start_server, stop_server, wait_until, write_spec
from helpers import RawWorkers

from rota import JobContext, Worker
from rota.store import lookup
from rota.base.errors import RequestError
from rota.core.listing import (JobFilter, decode_cursor, did_you_mean, encode_cursor,
                               filter_params, new_queue_problem, parse_filter, unknown_name)

# The server's scenarios run on SQLite; what they rely on the store for runs on both
# backends in tests/store/test_store_contract.py, and the store's own queries below
# (rota/store/lookup.py, called straight) on both here.


async def _fail(live: Live, worker: Any, message: str) -> dict[str, Any]:
    """A job its worker fails for good, with ``message`` as its error."""
    job = await live.enqueue("echo")
    [copy] = await worker.jobs(1)
    await worker.beat(results=[{"job_id": copy["id"], "attempt": copy["attempt"],
                                "outcome": "failed", "error": {"type": "ValueError",
                                                               "message": message,
                                                               "retryable": False}}])
    await worker.expect("ack")
    return await live.wait_state(job["id"], "discarded")


async def _list(live: Live, **params: Any) -> dict[str, Any]:
    response = await live.http.get("/jobs", params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def test_listing_filters_and_pages_newest_first(live: Live, connect, tmp_path: Path):
    echo, other = write_spec(tmp_path, "echo"), write_spec(tmp_path, "other", queue="slow")
    await live.push(echo, other)
    worker = await connect()
    await worker.register([echo])
    failed = [await _fail(live, worker, f"database timeout {n}") for n in range(2)]
    waiting = [await live.enqueue("other") for _ in range(5)]
    everything = await _list(live)
    ids = [job["id"] for job in everything["jobs"]]
    assert ids == [j["id"] for j in waiting[::-1] + failed[::-1]]  # newest first
    assert everything["next_cursor"] is None
    assert [j["id"] for j in (await _list(live, state="discarded"))["jobs"]] == \
        [failed[1]["id"], failed[0]["id"]]
    both = await live.http.get("/jobs?state=discarded&state=available&limit=500")
    assert len(both.json()["jobs"]) == 7
    assert len((await _list(live, state="available,discarded"))["jobs"]) == 7
    assert len((await _list(live, spec="other"))["jobs"]) == 5
    assert len((await _list(live, queue="slow", state="available"))["jobs"]) == 5
    assert [j["id"] for j in (await _list(live, worker=worker.worker_id))["jobs"]] == \
        [failed[1]["id"], failed[0]["id"]]
    assert [j["id"] for j in (await _list(live, q="TIMEOUT 1"))["jobs"]] == [failed[1]["id"]]
    assert [j["id"] for j in (await _list(live, q=waiting[2]["id"][:30]))["jobs"]] == \
        [waiting[2]["id"]]
    # Pages of 2: every job once, in order, whatever is enqueued meanwhile.
    seen, cursor = [], None
    while True:
        page = await _list(live, limit=2, **({"cursor": cursor} if cursor else {}))
        seen += [job["id"] for job in page["jobs"]]
        if not seen[2:]:
            await live.enqueue("other")  # newer than the first page: never in these
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids


async def test_listing_refuses_bad_filters_precisely(live: Live):
    cases = {"/jobs?state=failed": "invalid_filter", "/jobs?state=available,nope": "invalid_filter",
             "/jobs?spec=a%20b": "invalid_filter", "/jobs?spec=a&spec=b": "invalid_filter",
             "/jobs?colour=red": "invalid_filter", "/jobs?limit=0": "invalid_limit",
             "/jobs?limit=501": "invalid_limit", "/jobs?limit=ten": "invalid_limit",
             "/jobs?cursor=xyz": "invalid_cursor", "/jobs?q=" + "x" * 201: "invalid_filter",
             "/jobs?limit=1&limit=2": "invalid_limit"}
    for url, code in cases.items():
        response = await live.http.get(url)
        assert response.status_code == 400, url
        assert response.json()["error"]["code"] == code, url


async def test_bulk_retry_and_cancel_by_filter_and_ids(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo", queue="parked")
    await live.push(echo)
    jobs = [await live.enqueue("echo") for _ in range(5)]  # nobody serves "parked"
    dry = await live.http.post("/jobs/cancel", json={"filter": {"state": ["available"]},
                                                     "dry_run": True, "limit": 3})
    body = dry.json()
    assert (body["action"], body["dry_run"], body["matched"], body["touched"],
            body["truncated"]) == ("cancel", True, 5, 3, True)
    assert body["ids"] == [j["id"] for j in jobs[::-1][:3]]
    assert (await _list(live, state="available"))["jobs"].__len__() == 5  # nothing changed
    done = (await live.http.post("/jobs/cancel", json={"filter": {"spec": "echo"}})).json()
    assert (done["matched"], done["touched"], done["truncated"]) == (5, 5, False)
    assert len((await _list(live, state="cancelled"))["jobs"]) == 5
    retried = await live.http.post("/jobs/retry", json={
        "ids": [jobs[0]["id"], jobs[1]["id"], "no-such-job"]})
    body = retried.json()
    assert (body["matched"], body["touched"]) == (3, 2)
    assert body["skipped"] == [{"id": "no-such-job", "reason": "no such job"}]
    assert {(await live.job(j["id"]))["state"] for j in jobs[:2]} == {"available"}
    again = (await live.http.post("/jobs/retry", json={"ids": [jobs[0]["id"]]})).json()
    assert again["touched"] == 0 and again["skipped"][0]["reason"] == "job is available"


async def test_an_unknown_spec_or_queue_in_a_filter_is_refused_with_the_likely_name(
        live: Live, tmp_path: Path):
    """A misspelt name would match nothing, and a bulk action that touched nothing would
    look done (issue 22): 422, with the name meant. A known name with no job is no error."""
    await live.push(write_spec(tmp_path, "resize_image", queue="media"))
    await live.enqueue("resize_image", id="only-at-enqueue", queue="adhoc")
    for params, code, says in [
            ({"spec": "resize"}, "unknown_spec", "did you mean resize_image?"),
            ({"queue": "meida"}, "unknown_queue", "did you mean media?"),
            ({"queue": "nowhere"}, "unknown_queue", "Known queues: adhoc, media.")]:
        answers = [await live.http.get("/jobs", params=params)]
        for action in ("retry", "cancel"):
            answers.append(await live.http.post(f"/jobs/{action}", json={"filter": params}))
        for answer in answers:
            error = answer.json()["error"]
            assert (answer.status_code, error["code"]) == (422, code), params
            assert says in error["message"], error
    assert (await live.job("only-at-enqueue"))["state"] == "available"  # nothing touched
    # Known, though no job matches: a queue named only at enqueue, a spec with no discards.
    assert len((await _list(live, queue="adhoc"))["jobs"]) == 1
    retried = await live.http.post("/jobs/retry", json={"filter": {"spec": "resize_image",
                                                                   "state": "discarded"}})
    assert retried.status_code == 200 and retried.json()["matched"] == 0
    # What would make a queue anew: a slip for a known one is refused, or the queue meant
    # would run on and the job wait forever; a name close to none is a new queue.
    for path, body, says in [
            ("/queues/meida/pause", None, "is unknown; did you mean media?"),
            ("/queues/meida/resume", None, "was not paused: no queue of that name is known;"
                                            " did you mean media?"),
            ("/jobs", {"spec": "resize_image", "queue": "Adhoc"}, "did you mean adhoc?")]:
        answer = await live.http.post(path, json=body)
        assert (answer.status_code, answer.json()["error"]["code"]) == (422, "unknown_queue")
        assert says in answer.json()["error"]["message"], path
    assert (await live.http.post("/queues/media/resume")).status_code == 200  # not paused: fine
    assert (await live.http.post("/jobs", json={"spec": "resize_image", "queue": "thumbnails"})
            ).status_code == 201
    meant = await live.http.post("/jobs", json={"spec": "resize_image", "queue": "Adhoc",
                                                "new_queue": True})
    assert meant.status_code == 201 and meant.json()["job"]["queue"] == "Adhoc"
    assert (await live.http.post("/queues/meida/pause")).status_code == 422  # still a slip
    assert (await live.http.get("/jobs", params={"queue": "meida"})).status_code == 422


def test_the_likely_name_of_a_slip():
    known = ["resize_image", "send_email", "echo", "emails"]
    assert [did_you_mean(typed, known) for typed in ("resize", "ecoh", "ECHO", "emial",
                                                     "image", "xy", "zzz")] == \
        ["resize_image", "echo", "echo", "emails", "resize_image", None, None]
    assert unknown_name(JobFilter(spec="echo", queue="emails"), known, known) is None
    assert unknown_name(JobFilter(states=("discarded",)), [], []) is None
    refusal = unknown_name(JobFilter(spec="echo", queue="mails"), known, ["emails"])
    assert refusal is not None and (refusal.status, refusal.code) == (422, "unknown_queue")
    # A new queue's name: refused only when spelt like a known one.
    assert [new_queue_problem(typed, ["emails"]) is None
            for typed in ("emails", "emial", "Emails", "emails_bulk", "emails2")] == \
        [True, False, False, True, True]
    assert new_queue_problem("emails", ["emails"], resuming=True) is None
    assert "was not paused" in (new_queue_problem("reports", ["emails"], resuming=True) or "")


async def test_bulk_actions_refuse_bad_bodies_precisely(live: Live):
    cases = [({}, 422, "invalid_request"),
             ({"ids": ["a"], "filter": {"state": "cancelled"}}, 422, "invalid_request"),
             ({"filter": {}}, 422, "invalid_request"),
             ({"filter": {"state": "failed"}}, 400, "invalid_filter"),
             ({"ids": []}, 422, "invalid_request"),
             ({"ids": ["a"], "limit": 10001}, 422, "invalid_request"),
             ({"ids": ["a"], "colour": 1}, 422, "invalid_request"),
             # an unset shell variable must not widen a bulk action to every spec
             ({"filter": {"state": "scheduled", "spec": ""}}, 400, "invalid_filter"),
             ({"filter": {"queue": "", "q": "x"}}, 400, "invalid_filter")]
    for body, status, code in cases:
        for action in ("retry", "cancel"):
            response = await live.http.post(f"/jobs/{action}", json=body)
            assert (response.status_code, response.json()["error"]["code"]) == (status, code), body
    response = await live.http.post("/jobs/retry", content=b"{")
    assert response.status_code == 400


async def test_a_paused_queue_assigns_nothing_and_stays_paused_across_a_restart(
        tmp_path: Path):
    live = await start_server(tmp_path)
    try:
        echo = write_spec(tmp_path / "specs", "echo")
        await live.push(echo)
        paused = await live.http.post("/queues/default/pause")
        assert paused.json() == {"queue": "default", "paused": True}
        job = await live.enqueue("echo")
        [queue] = (await live.http.get("/queues")).json()["queues"]
        assert queue["paused"] is True and queue["oldest_available_age"] >= 0
        assert (await live.job(job["id"]))["waiting_reason"] == "queue paused"
    finally:
        await stop_server(live)
    live = await start_server(tmp_path, port=live.port)
    try:
        workers = RawWorkers(live.ws)
        worker = await workers()
        await worker.register([echo])
        await worker.beat()
        await worker.expect("ack")  # a round ran: still nothing assigned
        assert (await live.job(job["id"]))["state"] == "available"
        [queue] = (await live.http.get("/queues")).json()["queues"]
        assert queue["paused"] is True
        resumed = await live.http.post("/queues/default/resume")
        assert resumed.json() == {"queue": "default", "paused": False}
        [copy] = await worker.jobs(1)
        assert copy["id"] == job["id"]
        bad = await live.http.post("/queues/a%20b/pause")
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_queue")
        await workers.close()
    finally:
        await stop_server(live)


async def test_a_quiet_worker_is_resumed_over_http(live: Live, sdk_worker, tmp_path: Path):
    echo = write_spec(tmp_path / "specs", "echo")
    await live.push(echo)
    worker = Worker(specs_dir=tmp_path / "specs", heartbeat_interval=0.1)

    @worker.handler("echo")
    async def run(ctx: JobContext) -> str:
        return "done"

    await sdk_worker(worker)
    quiet = await live.http.post(f"/workers/{worker.worker_id}/state", json={"state": "quiet"})
    assert quiet.status_code == 200
    await wait_until(lambda: worker.state == "quiet", what="the worker to go quiet")
    job = await live.enqueue("echo")
    resumed = await live.http.post("/workers/state", json={"state": "running", "all": True})
    # On PostgreSQL the directive goes to the other servers' workers too (docs/scaling.md).
    assert resumed.json() == {"workers": [worker.worker_id], "state": "running",
                              "forwarded": live.coordinator.store.shared}
    await wait_until(lambda: worker.state == "running", what="the worker to resume")
    await live.wait_state(job["id"], "completed")


def _store_with(tmp_path: Path, errors: list[str]) -> Any:
    """A migrated store (the test's backend) holding one discarded job per error message,
    oldest first."""
    conn = open_store(tmp_path)
    conn.executemany(
        "INSERT INTO jobs (id, spec, queue, args, priority, state, attempt, enqueued_at,"
        " errors) VALUES (?, 'echo', 'default', '{}', 0, 'discarded', 1, 0, ?)",
        [(f"job-{n:03d}", json.dumps([{"message": m}])) for n, m in enumerate(errors)])
    return conn


@pytest.mark.both_backends
def test_an_error_search_is_bounded_and_pages_on_to_every_match(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(lookup, "MAX_SCAN", 10)
    errors = ["Needle in row" if n % 7 == 0 else "hay" for n in range(45)]
    conn = _store_with(tmp_path, errors)
    flt = parse_filter({"q": "needle"})
    found, before, pages = [], None, 0
    while True:
        rows, cursor = lookup.page(conn, flt, 3, before)
        assert len(rows) <= 3
        found += [row["id"] for _, row in rows]
        pages += 1
        if cursor is None:
            break
        before = decode_cursor(cursor)
    assert found == [f"job-{n:03d}" for n in range(44, -1, -1) if n % 7 == 0]
    assert pages >= 5  # 45 rows, 10 examined at most per page
    # With a state, the bound is per state query; an id prefix goes by the primary key.
    assert [r["id"] for _, r in lookup.page(conn, parse_filter({"q": "job-00"}), 50, None)[0]] \
        == [f"job-00{n}" for n in range(9, -1, -1)]
    assert lookup.count(conn, parse_filter({"state": "discarded"})) == 45
    assert lookup.state_counts(conn)["discarded"] == 45
    conn.close()


def test_filters_and_cursors_parse_strictly():
    flt = parse_filter({"state": ["discarded,cancelled", "discarded"], "spec": "echo"})
    assert flt == JobFilter(("discarded", "cancelled"), "echo")
    assert parse_filter(filter_params(flt)) == flt
    assert decode_cursor(encode_cursor(12345)) == 12345
    too_big = base64.urlsafe_b64encode(b"c9223372036854775808").decode().rstrip("=")
    for bad in ("", "Yzk5eA", "c123", "=" * 50, "Yw", "!!", too_big):
        with pytest.raises(RequestError) as refused:
            decode_cursor(bad)
        assert refused.value.code == "invalid_cursor"


@pytest.mark.both_backends
def test_a_spec_among_available_jobs_is_found_across_queues_and_pages(tmp_path: Path,
                                                                      monkeypatch):
    monkeypatch.setattr(lookup, "MAX_SCAN", 4)
    conn = _store_with(tmp_path, [])
    conn.executemany(
        "INSERT INTO jobs (id, spec, queue, args, priority, state, attempt, enqueued_at)"
        " VALUES (?, ?, ?, '{}', 0, 'available', 0, ?)",
        [(f"a-{n:02d}", "rare" if n % 5 == 0 else "echo", ("q1", "q2")[n % 2], n)
         for n in range(30)])
    assert lookup.queues(conn, "available") == ["q1", "q2"]
    flt = parse_filter({"spec": "rare"})
    found, before = [], None
    while True:
        rows, cursor = lookup.page(conn, flt, 2, before)
        found += [row["id"] for _, row in rows]
        if cursor is None:
            break
        before = decode_cursor(cursor)
    assert found == [f"a-{n:02d}" for n in range(29, -1, -1) if n % 5 == 0]
    rows, _ = lookup.page(conn, parse_filter({"state": "available"}), 50, None)
    assert [r["id"] for _, r in rows] == [f"a-{n:02d}" for n in range(29, -1, -1)]
    assert lookup.count(conn, parse_filter({"state": "available", "queue": "q1"})) == 15
    assert set(lookup.oldest_available(conn, 100.0)) == {"q1", "q2"}
    assert lookup.page(conn, parse_filter({"state": "available", "worker": "w"}), 5,
                       None) == ([], None)
    conn.close()


async def test_a_bulk_action_counts_what_matches_past_the_search_bound(live: Live,
                                                                        tmp_path: Path):
    """More jobs than one bounded text search examines: a q that matches nothing says 0,
    not "more than the cap"; ids beyond the default cap of a filter are all handled."""
    await live.push(write_spec(tmp_path / "specs", "echo"))
    await live.http.post("/queues/default/pause")
    for _ in range(2):
        body = {"jobs": [{"spec": "echo", "args": {}} for _ in range(6_000)]}
        response = await live.http.post("/jobs/batch", json=body, timeout=30)
        assert {item["status"] for item in response.json()["results"]} == {201}
    for limit in (None, 10):
        body: dict[str, Any] = {"filter": {"q": "zzzz-nothing"}, "dry_run": True}
        if limit:
            body["limit"] = limit
        answer = (await live.http.post("/jobs/cancel", json=body, timeout=30)).json()
        assert (answer["matched"], answer["touched"], answer["truncated"]) == (0, 0, False)
    ids = [job["id"] for job in (await _list(live, limit=500))["jobs"]]
    ids += [job["id"] for job in (await _list(live, limit=500, cursor=(
        await _list(live, limit=500))["next_cursor"]))["jobs"]]
    ids += [f"no-such-{n}" for n in range(500)]
    answer = (await live.http.post("/jobs/cancel", json={"ids": ids, "dry_run": True},
                                   timeout=30)).json()
    assert (answer["matched"], answer["touched"], answer["truncated"]) == (1500, 1000, False)
    assert {s["reason"] for s in answer["skipped"]} == {"no such job"}


@pytest.mark.both_backends
def test_the_oldest_available_age_skips_a_queue_emptied_between_its_two_reads(
        tmp_path: Path, monkeypatch):
    """GET /queues lists the queues with available jobs, then reads each one's oldest: on
    a busy server (or another server on one PostgreSQL) the last available job of a queue
    may be taken between those two statements. That queue has no age then, and the
    answer is no 500 (CI saw a TypeError here in the three-server chaos test)."""
    conn = _store_with(tmp_path, [])
    conn.executemany(
        "INSERT INTO jobs (id, spec, queue, args, priority, state, attempt, enqueued_at)"
        " VALUES (?, 'echo', ?, '{}', 0, 'available', 0, ?)",
        [("a-1", "q1", 10.0), ("a-2", "q2", 20.0)])
    listed = lookup.queues

    def then_taken(conn_: Any, state: str) -> list[str]:
        found = listed(conn_, state)
        # What a worker's reservation commits between the two reads.
        conn_.execute("UPDATE jobs SET state = 'active' WHERE id = 'a-1'")
        return found

    monkeypatch.setattr(lookup, "queues", then_taken)
    assert lookup.oldest_available(conn, 100.0) == {"q2": 80.0}
    conn.close()


def test_past_two_hundred_known_queues_a_new_name_is_not_checked_for_a_slip():
    """Queues made per tenant: a slip check would walk them all on every enqueue."""
    from rota.core.listing import SLIP_CHECK_MOST, new_queue_problem
    few = {f"tenant-{n}" for n in range(SLIP_CHECK_MOST)}
    assert new_queue_problem("tenent-1", {"tenant-1"}) is not None  # a slip, when few
    assert new_queue_problem("tenent-1", few | {"tenant-x"}) is None  # many: taken as new
