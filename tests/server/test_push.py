"""Push execution end to end: a real `rota serve` delivers jobs of specs with [execute] to
a real endpoint (tests/endpoint_rig.py, a subprocess), and each class of answer settles
the job as it should; a 202 completes by callback; a deploy that moves the URL sends the
jobs enqueued before it to the old URL and the rest to the new one."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sqlite3
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


# -- a deploy while v1's jobs are on their way -------------------------------------------
# Two specs move from one rig (v1) to another (v2) while v1's jobs are being delivered:
# "paced" answers after 60 ms, and every 6th request on its path answers 409 (retried with
# backoff, not counted by the breaker, so it never pauses the endpoint); "called" answers
# 202 and calls back 2.5 s later. The push comes right after a v1 POST: so at the push some
# v1 jobs are mid-delivery, some wait out a backoff, some wait for their callback and most
# have not gone out yet. (A default run: 240 + 60 v1 jobs, about 300 v1 POSTs and
# callbacks after the push, 45 of them retries.)
PATHS = {("paced", 1): "/slow?ms=60", ("called", 1): "/accept?ms=2500",
         ("paced", 2): "/slow?ms=60", ("called", 2): "/accept?ms=200"}
NTH = [arg for k in range(3, 3000, 6) for arg in ("--nth", f"/slow:{k}:409")]  # every 6th


def moving_spec(name: str, rig: Rig, version: int) -> dict[str, Any]:
    return {"name": name, "version": str(version), "visibility_timeout": 60,
            "retry": {"max_attempts": 20, "backoff_base": 0.3, "backoff_max": 0.6},
            "execute": {"url": rig.url(PATHS[name, version]), "secret": "main", "timeout": 5,
                        "max_in_flight": 8}}


async def enqueue_many(http: httpx.AsyncClient, name: str, n: int, tag: str) -> list[str]:
    reply = await http.post("/jobs/batch", json={"jobs": [
        {"spec": name, "args": {"v": tag, "i": i}} for i in range(n)]})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert all(r["status"] == 201 for r in results), results
    return [r["job"]["id"] for r in results]


async def v1_under_way(rig: Rig) -> float:
    """Until 40 v1 POSTs of "paced" went out, the last one (answered after 60 ms) less
    than 30 ms ago, and one of "called": the moment to push v2, which is returned."""
    def under_way() -> float | None:
        now, lines = time.time(), rig.lines()
        slow = [line for line in lines if line["path"] == "/slow"]
        fresh = len(slow) >= 40 and slow[-1]["t"] > now - 0.03
        return now if fresh and any(line["path"] == "/accept" for line in lines) else None
    return float(await wait_until(under_way, timeout=30, what="v1 under way", step=0.005))


async def all_settled(http: httpx.AsyncClient, rigs: tuple[Rig, Rig], callbacks: int,
                      timeout: float = 120) -> dict[str, str]:
    """Until no job waits or runs and the rigs logged every callback (after its answer);
    then every endpoint's URL by its id."""
    async def all_final() -> bool:
        reply = await http.get("/jobs", params={
            "state": "available,active,retryable,scheduled", "limit": 1})
        return reply.json()["jobs"] == []
    await wait_until(all_final, timeout=timeout, what="every job final", step=0.2)
    await wait_until(lambda: sum(x["path"] == "callback" for rig in rigs for x in rig.lines())
                     >= callbacks, timeout=10, what="every callback logged")
    endpoints = (await http.get("/endpoints")).json()["endpoints"]
    return {e["id"]: e["url"] for e in endpoints}


async def deploy_under_load(http: httpx.AsyncClient, tmp_path: Path, paced: int, called: int
                            ) -> None:
    with running_rig(tmp_path / "v1.log", *NTH) as one, \
            running_rig(tmp_path / "v2.log", *NTH) as two:
        await push(http, moving_spec("paced", one, 1), moving_spec("called", one, 1))
        old = {"paced": await enqueue_many(http, "paced", paced, "v1"),
               "called": await enqueue_many(http, "called", called, "v1")}
        began = await v1_under_way(one)
        await push(http, moving_spec("paced", two, 2), moving_spec("called", two, 2))
        pushed = (began, time.time())
        new = {"paced": await enqueue_many(http, "paced", paced // 2, "v2"),
               "called": await enqueue_many(http, "called", called // 2, "v2")}
        urls = await all_settled(http, (one, two), called * 3 // 2)
        check_deploy(*stored(tmp_path / "rota.db"), old, new, one.lines(), two.lines(),
                     pushed, urls, (one, two))


def stored(db: Path) -> tuple[dict[str, dict[str, Any]], collections.Counter[str]]:
    """The jobs as the SQLite file holds them, and per job its 2xx delivery log lines."""
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as conn:
        conn.row_factory = sqlite3.Row
        rows = {r["id"]: {**dict(r), "errors": json.loads(r["errors"])} for r in conn.execute(
            "SELECT id, state, attempt, worker_id, errors FROM jobs")}
        logs = collections.Counter(r[0] for r in conn.execute(
            "SELECT job_id FROM job_logs WHERE message LIKE 'delivered: HTTP 2%'"))
    return rows, logs


def check_deploy(rows: dict[str, dict[str, Any]], logs: collections.Counter[str],
                 old: dict[str, list[str]], new: dict[str, list[str]],
                 v1: list[dict[str, Any]], v2: list[dict[str, Any]],
                 pushed: tuple[float, float], urls: dict[str, str], rigs: tuple[Rig, Rig]
                 ) -> None:
    """Each job completed once, every POST of it (retries too) on its own version's URL.
    ``pushed``: when the push of v2 began and when it was answered."""
    assert sorted(urls.values()) == sorted(rigs[key[1] - 1].url(PATHS[key]) for key in PATHS)
    version_of = {j: (name, 1) for name, ids in old.items() for j in ids} | \
        {j: (name, 2) for name, ids in new.items() for j in ids}
    # None lost: every job is in the store, completed, by one delivery answered 2xx, on
    # the endpoint of its own version (the store's worker_id: the endpoint's id).
    assert {j: rows[j]["state"] for j in version_of} == dict.fromkeys(version_of, "completed")
    assert logs == collections.Counter(list(version_of)), "a job completed by two deliveries"
    for job_id, key in version_of.items():
        assert urls[rows[job_id]["worker_id"]] == rigs[key[1] - 1].url(PATHS[key]), job_id
    for version, log in ((1, v1), (2, v2)):
        posts = [line for line in log if line["path"] != "callback"]
        assert {version_of[line["job_id"]][1] for line in posts} == {version}  # its URL only
        assert {(version_of[line["job_id"]][0], line["path"]) for line in posts} == \
            {("paced", "/slow"), ("called", "/accept")}
        by_job = collections.defaultdict(list)
        for line in posts:
            by_job[line["job_id"]].append(int(line["attempt"]))
        assert set(by_job) == {j for j, key in version_of.items() if key[1] == version}
        for job_id, attempts in by_job.items():  # one POST per attempt; all but the last
            row = rows[job_id]  # were the rig's 409s, and the last completed it
            assert sorted(attempts) == list(range(1, row["attempt"] + 1)), (job_id, attempts)
            assert [e["type"] for e in row["errors"]] == \
                ["http_409"] * (row["attempt"] - 1)
        callbacks = [line for line in log if line["path"] == "callback"]  # one per job,
        called = [line["url"].split("/jobs/")[1].split("/")[0] for line in callbacks]
        assert sorted(called) == sorted((old, new)[version - 1]["called"])
        assert {line["status"] for line in callbacks} == {200}  # and none refused as stale
    all_ids = [line["delivery_id"] for line in v1 + v2 if line["path"] != "callback"]
    assert len(all_ids) == len(set(all_ids))
    # The push came while v1 was under way: its endpoint kept getting its own jobs after
    # it, first deliveries and retries both, and their callbacks came back after it.
    began, done = pushed
    assert any(began - 0.03 < line["t"] <= began for line in v1
               if line["path"] == "/slow")  # (one still unanswered when the push began)
    late = [line for line in v1 if line["t"] > done]
    assert any(line["path"] == "/slow" and line["attempt"] == "1" for line in late)
    assert any(line["path"] == "/slow" and line["attempt"] != "1" for line in late)
    assert any(line["path"] == "callback" for line in late)


async def test_a_deploy_while_v1_jobs_are_delivered_keeps_each_on_its_own_url(live, tmp_path):
    await deploy_under_load(live, tmp_path, paced=240, called=60)


@pytest.mark.soak
async def test_a_deploy_while_1000_v1_jobs_are_delivered_keeps_each_on_its_own_url(
        live, tmp_path):
    await deploy_under_load(live, tmp_path, paced=800, called=200)
