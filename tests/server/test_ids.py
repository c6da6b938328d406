"""Job ids a producer gives, with every awkward character of tests/corpus.py JOB_IDS: an
id Rota accepts is reachable through every route (the API, the sync and the asyncio SDK
clients, the CLI); any other is refused at enqueue with 422 ``invalid_id`` naming the
character; and no string given to a client as an id reaches another job (a "/" or a dot
segment is percent-encoded, never resolved). The dashboard's side is in tests/ui/test_ui.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import corpus
import pytest
from conftest import Live, write_spec
from helpers import rota

from rota import ApiError, AsyncClient, Client, JobContext, Worker
from rota.base.ids import job_id_problem, path_segment

ACCEPTED = [job_id for _, job_id, why in corpus.JOB_IDS if why is None]
REFUSED = [(name, job_id, why) for name, job_id, why in corpus.JOB_IDS if why is not None]
# What a client may be asked to look up that must reach no job but one of that very id:
# every refused id, and strings that a URL would resolve to another job.
LOOKUPS = [job_id for _, job_id, _ in REFUSED if job_id] + [
    "victim/..", "./victim", "a%2F..%2Fvictim", "victim?x=1", "victim#x", "victim/result",
    "victim/", "x/../victim/", ""]  # "": an unset shell variable (a JSON 404, not a redirect)


def test_the_rule_names_the_character_and_where_it_is():
    for name, job_id, why in corpus.JOB_IDS:
        problem = job_id_problem(job_id)
        if why is None:
            assert problem is None, name
        else:
            assert problem is not None and why in problem, (name, problem)
            assert "\x1b" not in problem and "\n" not in problem and "\u202e" not in problem


def test_a_path_segment_is_one_segment_whatever_the_text():
    assert path_segment("a/../victim") == "a%2F..%2Fvictim"
    assert path_segment("..") == "%2E%2E" and path_segment(".") == "%2E"
    assert path_segment("a b?c#d%e") == "a%20b%3Fc%23d%25e"
    assert path_segment("user@example.com") == "user%40example.com"
    for _, job_id, _ in corpus.JOB_IDS:
        assert "/" not in path_segment(job_id) and path_segment(job_id) not in (".", "..")


async def parked(live: Live, tmp_path: Path) -> None:
    """A spec whose queue no worker serves, and the bystander every lookup must miss."""
    await live.push(write_spec(tmp_path, "parked", queue="nobody"))
    await live.enqueue("parked", {"k": "v"}, id="victim")


async def victim_untouched(live: Live) -> None:
    victim = await live.job("victim")
    assert (victim["state"], victim["attempt"]) == ("available", 0), victim


async def test_every_accepted_id_through_every_route(live: Live, tmp_path: Path):
    await parked(live, tmp_path)
    for job_id in ACCEPTED:
        made = await live.http.post("/jobs", json={"spec": "parked", "id": job_id})
        assert (made.status_code, made.json()["job"]["id"]) == (201, job_id)
        for segment in (job_id, path_segment(job_id)):  # as typed, and as clients encode it
            shown = await live.http.get(f"/jobs/{segment}")
            assert (shown.status_code, shown.json()["id"]) == (200, job_id), segment
            result = await live.http.get(f"/jobs/{segment}/result")
            assert result.json() == {"id": job_id, "state": "available", "done": False,
                                     "result": None, "error": None}, segment
        cancelled = await live.http.delete(f"/jobs/{path_segment(job_id)}")
        assert (cancelled.status_code, cancelled.json()["state"]) == (200, "cancelled")
        again = await live.http.post(f"/jobs/{path_segment(job_id)}/retry")
        assert (again.status_code, again.json()["state"]) == (200, "available"), job_id
    await victim_untouched(live)


async def test_every_other_id_is_refused_at_enqueue_naming_the_character(
        live: Live, tmp_path: Path):
    await parked(live, tmp_path)
    for name, job_id, why in REFUSED:
        answer = await live.http.post("/jobs", json={"spec": "parked", "id": job_id})
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (422, "invalid_id"), name
        assert why in error["message"], (name, error["message"])
    batch = await live.http.post("/jobs/batch", json={"jobs": [
        {"spec": "parked", "id": job_id} for _, job_id, _ in REFUSED] + [
        {"spec": "parked", "id": "fine"}]})
    results = batch.json()["results"]
    for (name, _, why), item in zip(REFUSED, results, strict=False):
        assert (item["status"], item["error"]["code"]) == (422, "invalid_id"), name
        assert why in item["error"]["message"], name
    assert results[-1]["status"] == 201  # a refused id spoils no other job of the batch
    listed = await live.http.get("/jobs", params={"limit": 100})
    assert sorted(j["id"] for j in listed.json()["jobs"]) == ["fine", "victim"]


async def serve_echo(live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]],
                     tmp_path: Path) -> None:
    await parked(live, tmp_path)
    await live.push(write_spec(tmp_path, "echo"))
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.2)

    @worker.handler("echo")
    async def echo(ctx: JobContext) -> Any:
        return {"id": ctx.id}

    await sdk_worker(worker)


def through_the_sync_client(base: str) -> None:
    with Client(base) as client:
        for job_id in ACCEPTED:
            # Scheduled an hour ahead, so that it waits: cancelled, then retried, it runs.
            made = client.enqueue("echo", {}, id=job_id, delay=3600)
            assert (made.id, made.state) == (job_id, "scheduled")
            assert client.job(job_id)["id"] == job_id
            assert client.result(job_id)["done"] is False
            assert client.cancel(job_id)["state"] == "cancelled"
            assert client.retry(job_id)["id"] == job_id
            assert client.wait(job_id, timeout=20) == {"id": job_id}
            assert made.result(timeout=5) == {"id": job_id}
        for name, job_id, why in REFUSED:
            with pytest.raises(ApiError) as refused:
                client.enqueue("echo", {}, id=job_id)
            assert (refused.value.status, refused.value.code) == (422, "invalid_id"), name
            assert why in refused.value.message
        for job_id in LOOKUPS:
            for call in (client.job, client.result, client.cancel, client.retry):
                with pytest.raises(ApiError) as missed:
                    call(job_id)
                assert missed.value.status == 404, (job_id, call.__name__)


async def test_the_sync_client_reaches_every_accepted_id_and_no_other_job(
        live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]], tmp_path: Path):
    await serve_echo(live, sdk_worker, tmp_path)
    await asyncio.to_thread(through_the_sync_client, live.base)
    await victim_untouched(live)


async def test_the_async_client_reaches_every_accepted_id_and_no_other_job(
        live: Live, sdk_worker: Callable[[Worker], Awaitable[Worker]], tmp_path: Path):
    await serve_echo(live, sdk_worker, tmp_path)
    async with AsyncClient(live.base) as client:
        for job_id in ACCEPTED:
            made = await client.enqueue("echo", {}, id=job_id, delay=3600)
            assert (made.id, made.state) == (job_id, "scheduled")
            assert (await client.job(job_id))["id"] == job_id
            assert (await client.result(job_id))["done"] is False
            assert (await client.cancel(job_id))["state"] == "cancelled"
            assert (await client.retry(job_id))["id"] == job_id
            assert await client.wait(job_id, timeout=20) == {"id": job_id}
            assert await made.result(timeout=5) == {"id": job_id}
        for name, job_id, why in REFUSED:
            with pytest.raises(ApiError) as refused:
                await client.enqueue("echo", {}, id=job_id)
            assert (refused.value.status, refused.value.code) == (422, "invalid_id"), name
            assert why in refused.value.message
        for job_id in LOOKUPS:
            for call in (client.job, client.result, client.cancel, client.retry):
                with pytest.raises(ApiError) as missed:
                    await call(job_id)
                assert missed.value.status == 404, (job_id, call.__name__)
    await victim_untouched(live)


async def test_rota_jobs_show_and_cancel_reach_every_accepted_id_and_no_other_job(
        live: Live, tmp_path: Path):
    await parked(live, tmp_path)
    for job_id in ACCEPTED:
        await live.enqueue("parked", id=job_id)
        code, out, _ = await rota("jobs", "show", job_id, "--url", live.base)
        assert code == 0 and json.loads(out)["id"] == job_id
        code, out, _ = await rota("jobs", "cancel", job_id, "--url", live.base)
        assert (code, out) == (0, f"cancelled {job_id}\n")
    for job_id in ["a/../victim", "..", ".", "victim/..", "a%2F..%2Fvictim", ""]:
        for command in ("show", "cancel"):
            code, _, err = await rota("jobs", command, job_id, "--url", live.base)
            assert code == 1 and "no job" in err, (command, job_id, err)
    code, _, err = await rota("enqueue", "parked", "--id", "tenant-7/order-17",
                              "--url", live.base)
    assert code == 1 and "U+002F '/' at character 9" in err
    await victim_untouched(live)


async def test_an_empty_id_in_a_path_is_a_json_404_not_a_redirect(live: Live):
    """"/jobs/" once answered a 307 to "/jobs" with an empty body, which the clients took
    for an empty success and `rota jobs cancel ""` for a job without a state (a KeyError)."""
    for method, path in [("GET", "/jobs/"), ("DELETE", "/jobs/"), ("POST", "/jobs/"),
                         ("GET", "/jobs//result"), ("POST", "/jobs//retry"),
                         ("GET", "/specs/"), ("DELETE", "/tokens/")]:
        answer = await live.http.request(method, path)
        assert answer.status_code == 404, (method, path, answer.status_code)
        assert answer.json()["error"]["code"] == "not_found", (method, path)
    assert "a job id is never empty" in (await live.http.get("/jobs/")).json()["error"]["message"]
