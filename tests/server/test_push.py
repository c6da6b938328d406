"""Push execution end to end: a real `rota serve` delivers jobs of specs with [execute] to
a real endpoint (tests/endpoint_rig.py, a subprocess), and each class of answer settles
the job as it should; a 202 completes by callback; a deploy that moves the URL sends the
jobs enqueued before it to the old URL and the rest to the new one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import end, free_port, spawn_serve, wait_until
from test_deliverer import SECRET, Rig, running_rig

FINAL = ("completed", "discarded", "cancelled")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with running_rig(tmp_path_factory.mktemp("pushrig") / "rig.log") as rig:
        yield rig


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    port = free_port()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
    proc = await spawn_serve(http, ["--port", str(port), "--db", str(tmp_path / "rota.db"),
                                    "--allow-private-endpoints"], tmp_path / "serve.log",
                             env={"ROTA_SECRET_MAIN": SECRET})
    try:
        yield http
    finally:
        await end([proc], [http])


def spec(name: str, url: str, version: str = "1", **more: Any) -> dict[str, Any]:
    return {"name": name, "version": version, "visibility_timeout": 30,
            "retry": {"max_attempts": 2, "backoff_base": 0.2, "backoff_max": 0.2},
            "execute": {"url": url, "secret": "main", "timeout": 2}, **more}


async def push(http: httpx.AsyncClient, *specs: dict[str, Any]) -> None:
    reply = await http.put("/specs", json={"specs": list(specs)})
    assert reply.status_code == 200, reply.text


async def enqueue(http: httpx.AsyncClient, name: str, args: dict[str, Any]) -> str:
    reply = await http.post("/jobs", json={"spec": name, "args": args})
    assert reply.status_code in (200, 201), reply.text
    return reply.json()["job"]["id"]


async def settled(http: httpx.AsyncClient, job_id: str, timeout: float = 20) -> dict[str, Any]:
    found: dict[str, Any] = {}

    async def final() -> bool:
        found.update((await http.get(f"/jobs/{job_id}")).json())
        return found.get("state") in FINAL
    await wait_until(final, timeout=timeout, what=f"job {job_id} to finish")
    return found


async def test_each_class_of_answer_settles_its_job(live, rig):
    await push(live, spec("ok", rig.url("/ok")), spec("bad", rig.url("/bad")),
               spec("later", rig.url("/accept?ms=50")), spec("busy", rig.url("/429")),
               spec("lost", rig.url("/reset")))
    ids = {name: await enqueue(live, name, {"n": 1}) for name in
           ("ok", "bad", "later", "busy", "lost")}
    ok = await settled(live, ids["ok"])
    assert ok["state"] == "completed" and ok["result"] == {"echo": {"n": 1}}
    bad = await settled(live, ids["bad"])
    assert bad["state"] == "discarded" and len(bad["errors"]) == 1
    record = bad["errors"][0]
    assert record["type"] == "http_400" and record["details"]["status"] == 400
    assert "bad on purpose" in record["details"]["body"]
    later = await settled(live, ids["later"])
    assert later["state"] == "completed" and later["result"] == {"echo": {"n": 1}}
    busy = await settled(live, ids["busy"])  # 429, Retry-After 1: twice, a second apart
    assert busy["state"] == "discarded" and [e["type"] for e in busy["errors"]] == \
        ["http_429", "http_429"]
    assert busy["errors"][0]["retry_in"] >= 1.0
    lost = await settled(live, ids["lost"])
    assert lost["state"] == "discarded" and lost["errors"][0]["type"] == "connect"
    lines = rig.lines()
    assert all(line["signed"] for line in lines if line["path"] != "callback")
    ids_seen = [line["delivery_id"] for line in lines if line["path"] != "callback"]
    assert len(ids_seen) == len(set(ids_seen))  # a new delivery id per POST


async def test_a_deploy_that_moves_the_url_sends_each_job_to_its_own_versions(live, rig):
    await push(live, spec("moved", rig.url("/ok")))
    assert (await live.post("/queues/default/pause")).status_code == 200
    old = [await enqueue(live, "moved", {"i": i}) for i in range(10)]
    await push(live, spec("moved", rig.url("/slow?ms=1"), version="2"))
    new = [await enqueue(live, "moved", {"i": i}) for i in range(10, 20)]
    assert (await live.post("/queues/default/resume")).status_code == 200
    for job_id in old + new:
        assert (await settled(live, job_id))["state"] == "completed"
    paths = {line["job_id"]: line["path"] for line in rig.lines() if line.get("job_id") in
             set(old + new)}
    assert {paths[j] for j in old} == {"/ok"} and {paths[j] for j in new} == {"/slow"}
