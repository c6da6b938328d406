"""OJS pull workers over HTTP on one SQLite server (rota/server/pulling.py): FETCH, ACK,
NACK and heartbeat as the OJS suites assert them; a pull worker beside an SDK /work worker
on one queue, every job once; a spec push gates both kinds; a pull worker killed -9 has
its job come back when its visibility timeout lapses, and its late ACK is refused."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from conftest import Live, write_spec
from helpers import bearer, make_tokens, wait_until

from rota import Worker
from rota.base.ids import uuid7
from rota.base.specs import checksum

OJS = "/ojs/v1"


async def fetch(live: Live, worker: str, queue: str = "default", **extra: Any
                ) -> list[dict[str, Any]]:
    reply = await live.http.post(f"{OJS}/workers/fetch",
                                 json={"queues": [queue], "worker_id": worker, **extra})
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("application/openjobspec+json")
    return reply.json()["jobs"]


async def settle(live: Live, verb: str, job_id: str, worker: str | None, **extra: Any
                 ) -> tuple[int, dict[str, Any]]:
    body = {"job_id": job_id, **({"worker_id": worker} if worker else {}), **extra}
    reply = await live.http.post(f"{OJS}/workers/{verb}", json=body)
    return reply.status_code, reply.json()


async def test_fetch_ack_nack_and_heartbeat(live: Live, tmp_path: Path):
    spec = write_spec(tmp_path, "echo")
    await live.push(spec)
    mine = {"echo": checksum(spec)}
    assert await fetch(live, "w1", x_rota_specs=mine) == []  # 200 {"jobs": []}, never 204
    first = await live.enqueue("echo", {"n": 1})
    [job] = await fetch(live, "w1", x_rota_specs=mine, visibility_timeout_ms=30_000)
    assert (job["id"], job["state"], job["attempt"]) == (first["id"], "active", 1)
    assert "started_at" in job and job["args"] == [{"n": 1}]
    reply = await live.http.post(f"{OJS}/workers/heartbeat",
                                 json={"worker_id": "w1", "active_jobs": [job["id"], "nope"]})
    assert reply.status_code == 200 and reply.json()["state"] == "running"
    assert reply.json()["jobs_extended"] == [job["id"]]
    status, body = await settle(live, "ack", job["id"], "w2")  # not its holder
    assert status == 409 and body["error"]["code"] == "conflict"
    assert body["error"]["details"]["current_state"] == "active"
    status, body = await settle(live, "ack", job["id"], "w1", result={"ok": True})
    assert status == 200 and body["acknowledged"] is True
    assert (body["id"], body["job_id"], body["state"]) == (job["id"], job["id"], "completed")
    assert "completed_at" in body
    status, body = await settle(live, "ack", job["id"], "w1")  # once only
    assert status == 409 and body["error"]["details"]["current_state"] == "completed"
    status, body = await settle(live, "ack", "0190a000-0000-7000-8000-000000000000", None)
    assert status == 404 and body["error"]["code"] == "not_found"

    second = await live.enqueue("echo", {"n": 2})
    [job] = await fetch(live, "w1", x_rota_specs=mine)
    status, body = await settle(live, "nack", job["id"], "w1",
                                error={"code": "boom", "message": "it broke"})
    assert status == 200 and body["state"] == "retryable" and body["attempt"] == 1
    assert body["retry_delay_ms"] > 0 and "next_attempt_at" in body
    shown = await live.job(second["id"])
    assert shown["errors"][-1]["type"] == "boom" and shown["errors"][-1]["message"] == "it broke"


async def test_a_pull_worker_and_an_sdk_worker_on_one_queue_run_every_job_once(
        live: Live, tmp_path: Path, sdk_worker):
    spec = write_spec(tmp_path, "mixed")
    await live.push(spec)
    runs: collections.Counter[str] = collections.Counter()
    by: collections.Counter[str] = collections.Counter()
    worker = Worker(specs_dir=tmp_path, concurrency=1, heartbeat_interval=0.1)

    @worker.handler("mixed")
    async def handle(ctx: Any) -> None:
        runs[ctx.id] += 1
        by["sdk"] += 1
        await asyncio.sleep(0.02)  # noqa: sleep-ok  (a handler's work, not a wait)

    await sdk_worker(worker)
    jobs = [await live.enqueue("mixed", {"n": n}) for n in range(30)]
    for _ in range(200):
        pulled = await fetch(live, "puller", count=3, x_rota_specs={"mixed": checksum(spec)})
        for job in pulled:
            runs[job["id"]] += 1
            by["pull"] += 1
            assert (await settle(live, "ack", job["id"], "puller"))[0] == 200
        done = [await live.job(j["id"]) for j in jobs]
        if all(d["state"] == "completed" for d in done):
            break
    assert sorted(runs) == sorted(j["id"] for j in jobs) and set(runs.values()) == {1}
    assert by["sdk"] > 0 and by["pull"] > 0, by


async def test_a_spec_push_gates_pull_and_sdk_workers_alike(live: Live, tmp_path: Path,
                                                            sdk_worker):
    old = write_spec(tmp_path / "v1", "gated")
    await live.push(old)
    ran: list[str] = []
    worker = Worker(specs_dir=tmp_path / "v1", concurrency=1, heartbeat_interval=0.1)
    worker.handler("gated")(lambda ctx: ran.append(ctx.id))
    await sdk_worker(worker)
    new = write_spec(tmp_path / "v2", "gated", version="2")
    await live.push(new)  # the status quo moves on: neither old worker may run it
    job = await live.enqueue("gated")
    reply = await live.http.post(f"{OJS}/workers/fetch", json={
        "queues": ["default"], "worker_id": "old", "x_rota_specs": {"gated": checksum(old)}})
    assert reply.json()["jobs"] == [] and "gated" in reply.headers["x-rota-rejected-specs"]
    assert (await live.job(job["id"]))["state"] == "available" and ran == []
    # A worker that declares nothing hears why it gets nothing, and the checksum to send
    # (a new user's worker got [] in silence: the hardest thing to find, they said).
    silent = await live.http.post(f"{OJS}/workers/fetch", json={"worker_id": "naive"})
    assert silent.json()["jobs"] == []
    assert json.loads(silent.headers["x-rota-waiting-specs"]) == [{
        "name": "gated", "checksum": "", "expected": checksum(new),
        "reason": "its jobs wait in queue default: declare its checksum in x_rota_specs"}]
    [pulled] = await fetch(live, "new", x_rota_specs={"gated": checksum(new)})
    assert pulled["id"] == job["id"]
    assert (await settle(live, "ack", job["id"], "new"))[0] == 200 and ran == []


PULLER = """
import sys, time, httpx
reply = httpx.post(sys.argv[1] + "/ojs/v1/workers/fetch", json={
    "queues": ["default"], "worker_id": "doomed", "visibility_timeout_ms": 1000,
    "x_rota_specs": {"victim": sys.argv[2]}})
print(reply.json()["jobs"][0]["id"], flush=True)
time.sleep(600)  # noqa: sleep-ok  (holds its job until the test kills it)
"""


async def test_a_killed_pull_workers_job_comes_back_and_its_late_ack_is_refused(
        live: Live, tmp_path: Path):
    spec = write_spec(tmp_path, "victim")
    await live.push(spec)
    job = await live.enqueue("victim")
    puller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PULLER), live.base,
                               checksum(spec)], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.to_thread(puller.stdout.readline)  # type: ignore[union-attr]
        assert line.strip() == job["id"]
        assert (await live.job(job["id"]))["state"] == "active"
    finally:
        os.kill(puller.pid, signal.SIGKILL)
        puller.wait()
        puller.stdout.close()  # type: ignore[union-attr]
    back = await live.wait_state(job["id"], "available", timeout=10)
    assert back["errors"][-1]["type"] == "visibility_timeout"
    # The lease its FETCH asked for (1 s, floored at min_lease), not the spec's 1800 s.
    assert "1800" not in back["errors"][-1]["message"], back["errors"][-1]
    status, body = await settle(live, "ack", job["id"], "doomed")  # its late ACK
    assert status == 409 and body["error"]["details"]["current_state"] == "available"
    [again] = await fetch(live, "heir", x_rota_specs={"victim": checksum(spec)})
    assert (again["id"], again["attempt"]) == (job["id"], 2)

    async def gone() -> bool:
        workers = (await live.http.get("/workers")).json()["workers"]
        return {w["id"]: w["kind"] for w in workers}.get("ojs:heir") == "pull"

    await wait_until(gone, what="the pull worker listed as kind pull")


async def test_with_tokens_a_pull_worker_settles_a_producers_job_by_the_id_it_was_shown(
        live: Live):
    """A producer token's job is kept as ``<token>:<id>`` and shown without the prefix;
    the worker token's ACK, NACK and heartbeat name it as shown (a helper's trial found
    them answered 404: the id was scoped to the worker's own token)."""
    producer, worker = await make_tokens(live, ("producer", None), ("worker", None))
    made = []
    for n in range(2):
        pushed = await live.http.post(f"{OJS}/jobs", headers=bearer(producer), json={
            "type": "tok.job", "args": [n], "id": uuid7(), "options": {"queue": "tokq"}})
        assert pushed.status_code == 201, pushed.text
        made.append(pushed.json()["job"]["id"])
    as_worker = bearer(worker)
    got = await live.http.post(f"{OJS}/workers/fetch", headers=as_worker, json={
        "queues": ["tokq"], "worker_id": "tw", "count": 2})
    jobs = got.json()["jobs"]
    assert sorted(j["id"] for j in jobs) == sorted(made), got.text
    beat = await live.http.post(f"{OJS}/workers/heartbeat", headers=as_worker, json={
        "worker_id": "tw", "active_jobs": made})
    assert sorted(beat.json()["jobs_extended"]) == sorted(made), beat.text
    acked = await live.http.post(f"{OJS}/workers/ack", headers=as_worker, json={
        "job_id": made[0], "worker_id": "tw", "result": {"ok": 1}})
    assert (acked.status_code, acked.json()["id"], acked.json()["state"]) == (
        200, made[0], "completed"), acked.text
    nacked = await live.http.post(f"{OJS}/workers/nack", headers=as_worker, json={
        "job_id": made[1], "worker_id": "tw",
        "error": {"code": "boom", "message": "m", "retryable": False}})
    assert (nacked.status_code, nacked.json()["state"]) == (200, "discarded"), nacked.text
    again = await live.http.post(f"{OJS}/workers/ack", headers=as_worker, json={
        "job_id": made[0], "worker_id": "tw"})
    # Settled once. A producer's job no longer held is not found under the id as shown
    # (docs/ojs.md, Fencing): 404 rather than 409, a refusal all the same.
    assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"


async def test_two_tokens_workers_without_a_worker_id_do_not_share_one(live: Live):
    """OJS makes worker_id optional on FETCH: each token's requests without one speak for
    that token's own anonymous worker (a reviewer's second token got 403 for 60 s)."""
    producer, one, two = await make_tokens(live, ("producer", None), ("worker", None),
                                           ("worker", None))
    for n in range(2):
        pushed = await live.http.post(f"{OJS}/jobs", headers=bearer(producer), json={
            "type": "anon.job", "args": [n], "options": {"queue": "anonq"}})
        assert pushed.status_code == 201, pushed.text
    for token in (one, two):
        got = await live.http.post(f"{OJS}/workers/fetch", headers=bearer(token),
                                   json={"queues": ["anonq"]})
        assert got.status_code == 200, got.text
        [job] = got.json()["jobs"]
        acked = await live.http.post(f"{OJS}/workers/ack", headers=bearer(token),
                                     json={"job_id": job["id"], "result": 1})
        assert (acked.status_code, acked.json()["state"]) == (200, "completed"), acked.text
