"""Push execution on two servers sharing one PostgreSQL (docs/scaling.md): a push through
one gives both its endpoint; jobs enqueued through either are each delivered and
completed once; a deploy that moves the URL, pushed through one server, pins the other's
jobs too, also while v1's jobs are mid-delivery, in backoff or awaiting callbacks; and a
job enqueued through one server just after a push through the other goes to the new URL
(the other server learns of a push by a notice and a read, a moment later: an enqueue of
a push-executed job waits for its barrier, rota/server/admission.py)."""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import wait_until
from test_cluster import servers
from test_push import rig  # noqa: F401  (the endpoint rig's fixture)
from test_push import (NTH, all_settled, check_deploy, enqueue_many, moving_spec, push,
                       v1_under_way)
from test_deliverer import SECRET, Rig, running_rig

from rota.base.specs import Execute, JobSpec, RetryPolicy


def hook(url: str, version: str = "1") -> JobSpec:
    return JobSpec(name="hook", version=version, retry=RetryPolicy(max_attempts=3),
                   execute=Execute(url=url, secret="main", timeout=5, max_in_flight=8))


async def test_two_servers_deliver_each_job_once_and_keep_a_deploys_pins(
        tmp_path: Path, pg_url: str, rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROTA_SECRET_MAIN", SECRET)
    async with servers(tmp_path, pg_url, 2, allow_private_endpoints=True) as (a, b):
        await a.push(hook(rig.url("/ok")))
        await a.http.post("/queues/default/pause")
        old = [(await (a, b)[n % 2].enqueue("hook", {"n": n}))["id"] for n in range(40)]
        await b.push(hook(rig.url("/slow?ms=1"), version="2"))
        new = [(await (a, b)[n % 2].enqueue("hook", {"n": n}))["id"] for n in range(40, 80)]
        await a.http.post("/queues/default/resume")

        async def done() -> bool:
            states = [(await a.job(j))["state"] for j in old + new]
            return all(s == "completed" for s in states)
        await wait_until(done, timeout=30, what="80 jobs completed")
        seen: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for line in rig.lines():
            if line.get("job_id") in set(old + new):
                seen[line["job_id"]].append(line)
        assert all(len(lines) == 1 for lines in seen.values()), seen  # each delivered once
        assert {seen[j][0]["path"] for j in old} == {"/ok"}
        assert {seen[j][0]["path"] for j in new} == {"/slow"}


async def shown(http: httpx.AsyncClient, ids: list[str]
                ) -> tuple[dict[str, dict[str, Any]], collections.Counter[str]]:
    """GET /jobs/{id} of each: its row, and its count of 2xx delivery log lines."""
    rows: dict[str, dict[str, Any]] = {}
    for start in range(0, len(ids), 50):
        for reply in await asyncio.gather(*(http.get(f"/jobs/{j}")
                                            for j in ids[start:start + 50])):
            rows[reply.json()["id"]] = reply.json()
    logs = collections.Counter({j: sum(line["message"].startswith("delivered: HTTP 2")
                                       for line in row["logs"]) for j, row in rows.items()})
    return rows, +logs


async def test_a_deploy_through_one_server_while_both_deliver_keeps_each_job_on_its_url(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests/server/test_push.py's deploy under load, on two servers: v1's jobs are
    enqueued through both and delivered by both; v2 is pushed through b while they are
    mid-delivery, in backoff and awaiting callbacks, and v2's jobs are enqueued through
    both at once after it."""
    await deploy_on_two(tmp_path, pg_url, monkeypatch, paced=80, called=20)


@pytest.mark.soak
async def test_a_deploy_through_one_server_while_both_deliver_1000_v1_jobs(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    await deploy_on_two(tmp_path, pg_url, monkeypatch, paced=400, called=100)


async def deploy_on_two(tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch, *,
                        paced: int, called: int) -> None:
    """``paced`` and ``called`` v1 jobs through each server, half as many v2 jobs."""
    monkeypatch.setenv("ROTA_SECRET_MAIN", SECRET)
    with running_rig(tmp_path / "v1.log", *NTH) as one, \
            running_rig(tmp_path / "v2.log", *NTH) as two:
        async with servers(tmp_path, pg_url, 2, allow_private_endpoints=True) as (a, b):
            await push(a.http, moving_spec("paced", one, 1), moving_spec("called", one, 1))
            old = {name: [j for live in (a, b) for j in await enqueue_many(live.http, name, n,
                                                                         f"v1-{live.port}")]
                   for name, n in (("paced", paced), ("called", called))}
            began = await v1_under_way(one)
            await push(b.http, moving_spec("paced", two, 2), moving_spec("called", two, 2))
            pushed = (began, time.time())
            new = {name: [j for live in (a, b) for j in await enqueue_many(live.http, name, n,
                                                                         f"v2-{live.port}")]
                   for name, n in (("paced", paced // 2), ("called", called // 2))}
            callbacks = 2 * called + called // 2 * 2
            urls = await all_settled(a.http, (one, two), callbacks)
            urls |= await all_settled(b.http, (one, two), callbacks)
            ids = [j for group in (*old.values(), *new.values()) for j in group]
            check_deploy(*await shown(a.http, ids), old, new, one.lines(), two.lines(),
                         pushed, urls, (one, two))


async def ojs_batch(http: httpx.AsyncClient, name: str, n: int) -> list[str]:
    """Jobs enqueued by OJS's batch (all or nothing: rota/server/ojs_api.py)."""
    reply = await http.post("/ojs/v1/jobs/batch", json={"jobs": [
        {"type": name, "args": [i]} for i in range(n)]})
    assert reply.status_code == 201, reply.text
    return [job["id"] for job in reply.json()["jobs"]]


async def test_jobs_enqueued_just_after_another_servers_push_go_to_the_new_url(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The push is answered before the other server hears of it (a notice, then a read):
    a job enqueued through that server at once is still the new version's. 20 pushes,
    through either server, each moving the URL from one rig to the other, each followed
    at once by jobs enqueued through both (by Rota's batch and by OJS's)."""
    monkeypatch.setenv("ROTA_SECRET_MAIN", SECRET)
    with running_rig(tmp_path / "odd.log") as odd, running_rig(tmp_path / "even.log") as even:
        async with servers(tmp_path, pg_url, 2, allow_private_endpoints=True) as lives:
            rig_of: dict[str, Rig] = {}
            for version in range(1, 21):
                rig = (even, odd)[version % 2]
                through = lives[version % 2]
                await through.push(hook(rig.url("/ok"), version=str(version)))
                for live in (lives[1 - version % 2], through):
                    for job_id in [*await enqueue_many(live.http, "hook", 2, str(version)),
                                   *await ojs_batch(live.http, "hook", 2)]:
                        rig_of[job_id] = rig
            await all_settled(lives[0].http, (odd, even), 0)
            for rig in (odd, even):  # (before the fix: 38 to 40 of 160 went to the old one)
                went = {line["job_id"] for line in rig.lines()}
                mine = {j for j, r in rig_of.items() if r is rig}
                assert went == mine, f"{len(went - mine)} sent to the old URL, {len(mine - went)}" \
                    " missing"
