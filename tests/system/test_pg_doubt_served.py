"""End to end, a commit in doubt (rota/store/writer.py ``Doubt``; tests/store/test_pg_doubt.py
for the writer alone): a `rota serve` on PostgreSQL whose COMMIT was carried out and whose
session was ended before the answer."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import psycopg
import pytest
from conftest import start_server, stop_server, write_spec
from helpers import wait_until
from pgserver import Cluster
from test_cluster import Runs, running
from test_pg_doubt import commits_wait_forever, in_commit


async def test_a_job_whose_enqueue_commit_was_in_doubt_is_answered_201_and_runs_once(
        tmp_path, pg_cluster: Cluster, pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """End to end, a `rota serve` on PostgreSQL (--durability full) with a worker: the
    commit of an enqueue (and of whatever shared its transaction) was carried out and its
    session ended before the answer. The producer gets 201, not 503, while every commit
    still waits (so from the doubt settled), and the job runs once. (Reported as failed, the job's row stood with nobody holding it: no server
    would ever run it.)"""
    caplog.set_level(logging.INFO, logger="rota.server")
    specs = tmp_path / "specs"
    spec = write_spec(specs, "echo")
    runs = Runs()
    live = await start_server(tmp_path / "s", database_url=pg_url, durability="full")
    try:
        await live.push(spec)
        async with (running(runs.worker(specs, live.base, "w")),
                    await psycopg.AsyncConnection.connect(pg_url, autocommit=True) as admin):
            live.http.timeout = httpx.Timeout(30)
            async with commits_wait_forever(pg_cluster):
                posted = asyncio.create_task(live.http.post("/jobs", json={"spec": "echo"}))

                async def answered_or_waiting() -> bool | int | None:
                    return posted.done() or await in_commit(admin, "SyncRep")

                # Every commit waits now, so the answer can only come from a commit in
                # doubt: the writer's session is ended in each COMMIT it waits in (the
                # enqueue's, and any other write's that came first) until it does.
                for _ in range(10):
                    pid = await wait_until(answered_or_waiting, timeout=10,
                                           what="the enqueue's COMMIT to wait")
                    if posted.done():
                        break
                    await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                response = await asyncio.wait_for(posted, 10)
            assert response.status_code == 201, response.text
            job = response.json()["job"]["id"]
            await wait_until(lambda: runs.per_job()[job] == 1, timeout=15,
                             what="the job to run")
            await wait_until(lambda: completed(live, job), timeout=15, what="it to complete")
        assert runs.per_job() == {job: 1}
        assert "a commit's answer was lost" in caplog.text and "took effect" in caplog.text
    finally:
        await stop_server(live)


async def completed(live: Any, job: str) -> bool:
    response = await live.http.get(f"/jobs/{job}")
    return response.status_code == 200 and response.json()["state"] == "completed"
