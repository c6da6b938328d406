"""Push execution on two servers sharing one PostgreSQL (docs/scaling.md): a push through
one gives both its endpoint; jobs enqueued through either are each delivered and
completed once; a deploy that moves the URL, pushed through one server, pins the other's
jobs too."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from test_cluster import servers
from test_push import rig  # noqa: F401  (the endpoint rig's fixture)
from test_deliverer import SECRET, Rig

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
