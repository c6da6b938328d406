"""Push execution end to end: a real `rota serve` delivers jobs of specs with [execute] to
a real endpoint (tests/endpoint_rig.py, a subprocess), and each class of answer settles
the job as it should; a 202 completes by callback; a deploy that moves the URL sends the
jobs enqueued before it to the old URL and the rest to the new one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import end, free_port, rota, spawn_serve, wait_until
from test_deliverer import SECRET, Rig, running_rig

from rota.base.signing import DELIVERY, SIGNATURE, sign

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


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "push"


async def test_the_readme_example_endpoint_runs_greet_and_refuses_a_replay(tmp_path):
    """examples/push/endpoint.py unchanged, as a process; its spec on a free port."""
    port, secret = free_port(), "example-secret-0123456789"
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "greet.toml").write_text((EXAMPLE / "greet.toml").read_text().replace(
        "127.0.0.1:8080", f"127.0.0.1:{port}"))
    endpoint = subprocess.Popen([sys.executable, str(EXAMPLE / "endpoint.py"), "--port",
                                 str(port)], env={**os.environ, "ROTA_SECRET_HOOKS": secret},
                                stdout=subprocess.PIPE, text=True)
    assert endpoint.stdout is not None
    assert "endpoint on" in endpoint.stdout.readline()
    server_port = free_port()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{server_port}", timeout=30)
    server = await spawn_serve(http, ["--port", str(server_port), "--db",
                                      str(tmp_path / "rota.db"), "--allow-private-endpoints"],
                               tmp_path / "serve.log", env={"ROTA_SECRET_HOOKS": secret})
    env = {"ROTA_URL": f"http://127.0.0.1:{server_port}"}
    try:
        code, out, err = await rota("specs", "push", str(specs), env=env)
        assert code == 0, out + err
        code, out, err = await rota("run", "greet", "--args", '{"name": "Ada"}', env=env)
        assert code == 0 and json.loads(out)["result"]["greeting"] == "Hello, Ada!", out + err
        code, out, _ = await rota("run", "greet", "--args", '{"name": ""}', env=env)
        assert json.loads(out)["error"]["type"] == "http_400"  # a 4xx: failed for good
        # A captured delivery sent again is refused by the endpoint (its id was seen).
        body = b'{"job": {"args": {"name": "Eve"}, "attempt": 1}}'
        headers = {**sign([secret], int(time.time()), body), DELIVERY: "d-1"}
        async with httpx.AsyncClient() as raw:
            url = f"http://127.0.0.1:{port}/greet"
            assert (await raw.post(url, content=body, headers=headers)).status_code == 200
            assert (await raw.post(url, content=body, headers=headers)).status_code == 401
            headers[SIGNATURE] = "sha256=" + "0" * 64
            headers[DELIVERY] = "d-2"
            assert (await raw.post(url, content=body, headers=headers)).status_code == 401
        assert "Traceback" not in (tmp_path / "serve.log").read_text()
    finally:
        endpoint.terminate()
        endpoint.wait(timeout=10)
        endpoint.stdout.close()
        await end([server], [http])


async def test_a_completed_delivery_keeps_its_record_in_the_jobs_log(live, rig):
    await push(live, spec("noted", rig.url("/ok")))
    job_id = await enqueue(live, "noted", {"n": 7})
    assert (await settled(live, job_id))["state"] == "completed"
    shown = (await live.get(f"/jobs/{job_id}")).json()
    lines = [line["message"] for line in shown["logs"]]
    assert any(m.startswith("delivered: HTTP 200 in ") and '"echo"' in m for m in lines), shown
