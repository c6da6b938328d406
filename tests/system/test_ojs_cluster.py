"""OJS pull workers on two servers sharing one PostgreSQL (docs/scaling.md): a FETCH on
one server sees, in order, the jobs pushed through the other a moment before (the notice
barrier), and an ACK, NACK or heartbeat sent to a server that does not hold the job is
forwarded to the one that does."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from conftest import Live, write_spec
from test_cluster import servers

from rota.base.specs import checksum

OJS = "/ojs/v1"


async def fetch(live: Live, worker: str, specs: dict[str, str]) -> list[dict[str, Any]]:
    reply = await live.http.post(f"{OJS}/workers/fetch", json={
        "queues": ["default"], "worker_id": worker, "x_rota_specs": specs})
    assert reply.status_code == 200, reply.text
    return reply.json()["jobs"]


@contextlib.asynccontextmanager
async def two(tmp_path: Path, pg_url: str) -> AsyncIterator[tuple[Live, Live, dict[str, str]]]:
    """Servers A and B on one database, spec echo pushed, and a pull worker's x_rota_specs."""
    spec = write_spec(tmp_path / "specs", "echo")
    async with servers(tmp_path, pg_url, 2) as (a, b):
        await a.push(spec)
        yield a, b, {"echo": checksum(spec)}


async def test_a_fetch_sees_in_order_what_another_server_took_a_moment_before(
        tmp_path: Path, pg_url: str):
    async with two(tmp_path, pg_url) as (a, b, mine):
        for _ in range(5):
            ids = [(await a.enqueue("echo", {"n": n}))["id"] for n in range(3)]
            got = [job["id"] for _ in ids for job in await fetch(b, "puller", mine)]
            assert got == ids
            for job_id in got:
                reply = await b.http.post(f"{OJS}/workers/ack", json={
                    "job_id": job_id, "worker_id": "puller"})
                assert reply.status_code == 200, reply.text


async def test_ack_nack_and_heartbeat_reach_the_server_that_holds_the_job(
        tmp_path: Path, pg_url: str):
    async with two(tmp_path, pg_url) as (a, b, mine):
        first, second = [(await a.enqueue("echo", {"n": n}))["id"] for n in range(2)]
        held = [job["id"] for _ in range(2) for job in await fetch(b, "w", mine)]
        assert held == [first, second]
        beat = await a.http.post(f"{OJS}/workers/heartbeat", json={
            "worker_id": "w", "active_jobs": held})
        assert beat.status_code == 200 and sorted(beat.json()["jobs_extended"]) == sorted(held)
        ack = await a.http.post(f"{OJS}/workers/ack", json={"job_id": first, "worker_id": "w"})
        assert ack.status_code == 200 and ack.json()["state"] == "completed", ack.text
        nack = await a.http.post(f"{OJS}/workers/nack", json={
            "job_id": second, "worker_id": "w", "error": {"code": "x", "message": "no"}})
        assert nack.status_code == 200 and nack.json()["state"] == "retryable", nack.text
        again = await a.http.post(f"{OJS}/workers/ack", json={"job_id": first, "worker_id": "w"})
        assert again.status_code == 409  # settled once: its row says completed


async def test_fetches_alternating_between_servers_take_every_job_in_order(
        tmp_path: Path, pg_url: str):
    """Each server keeps its copy of a job the other reserved until a round meets it: a
    FETCH whose round loses such a row looks further, rather than answer nothing."""
    async with two(tmp_path, pg_url) as (a, b, mine):
        ids = [(await (a if n % 2 else b).enqueue("echo", {"n": n}))["id"] for n in range(6)]
        got = [job["id"] for n in range(6) for job in await fetch(b if n % 2 else a, "w", mine)]
        assert got == ids


async def test_a_cancel_through_another_server_ends_a_pull_held_job_at_once(
        tmp_path: Path, pg_url: str):
    async with two(tmp_path, pg_url) as (a, b, mine):
        job_id = (await a.enqueue("echo", {"n": 1}))["id"]
        assert [job["id"] for job in await fetch(b, "w", mine)] == [job_id]
        reply = await a.http.delete(f"{OJS}/jobs/{job_id}")
        assert reply.status_code == 200 and reply.json()["job"]["state"] == "cancelled"
        late = await a.http.post(f"{OJS}/workers/ack", json={"job_id": job_id, "worker_id": "w"})
        assert late.status_code == 409
