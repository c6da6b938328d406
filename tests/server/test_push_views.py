"""What an operator sees of push endpoints, live (a real `rota serve` and the endpoint
rig): an endpoint that keeps failing is paused, and its waiting jobs say so in the job's
view and `rota queues`; GET /endpoints, GET /workers, /metrics, `rota workers list` and
`rota watch` show its breaker; a failed attempt keeps its delivery's record."""

from __future__ import annotations

import json
from typing import Any

import httpx
from helpers import rota, wait_until
from test_push import enqueue, live, push, rig, settled, spec  # noqa: F401 (fixtures)

from rota.cli.live import event_line, render

FAILING = "endpoint failing:"


async def paused_endpoint(http: httpx.AsyncClient) -> dict[str, Any]:
    found: dict[str, Any] = {}

    async def opened() -> bool:
        views = (await http.get("/endpoints")).json()["endpoints"]
        found.update(views[0] if views else {})
        return found.get("state") in ("open", "half_open")
    await wait_until(opened, timeout=20, what="the endpoint's breaker to open")
    return found


async def test_a_failing_endpoint_is_paused_and_its_jobs_say_why(live, rig):  # noqa: F811
    await push(live, spec("down", rig.url("/fail"), retry={"max_attempts": 1}))
    failed = [await enqueue(live, "down", {"i": i}) for i in range(5)]
    endpoint = await paused_endpoint(live)  # 5 faults in 30 s
    assert endpoint["id"].startswith("http:down@") and endpoint["url"] == rig.url("/fail")
    assert endpoint["reason"].startswith(FAILING) and endpoint["opened"] == 1
    # Each trial after a pause takes one job: enough of them wait for what follows.
    waiting = [await enqueue(live, "down", {"i": i}) for i in range(5, 15)]
    job = (await live.get(f"/jobs/{waiting[-1]}")).json()
    assert job["state"] == "available" and job["waiting_reason"].startswith(FAILING), job
    code, out, err = await rota("queues", env={"ROTA_URL": str(live.base_url)})
    assert code == 0 and "  down: " in out and FAILING in out, out + err

    workers = (await live.get("/workers")).json()["workers"]
    assert [(w["id"], w["kind"], w["concurrency"]) for w in workers] == \
        [(endpoint["id"], "endpoint", 10)]
    code, out, err = await rota("workers", "list", env={"ROTA_URL": str(live.base_url)})
    assert code == 0 and out.startswith(f"{endpoint['id']}  endpoint    load="), out + err
    assert f"url={rig.url('/fail')}" in out and "breaker=" in out and FAILING in out
    metrics = (await live.get("/metrics")).text
    named = f'endpoint="{endpoint["id"]}",spec="down"'
    assert f"rota_endpoint_open{{{named}}} 1.0" in metrics
    assert f"rota_endpoint_openings_total{{{named}}} 1.0" in metrics
    assert f"rota_endpoint_in_flight{{{named}}}" in metrics
    assert 'rota_jobs_blocked{reason="endpoint_failing",spec="down"}' in metrics
    assert 'rota_workers{state="running"} 0.0' in metrics  # an endpoint is no worker

    code, out, err = await rota("watch", "--json", env={"ROTA_URL": str(live.base_url)})
    assert code == 0, out + err
    view = json.loads(out)
    assert view["workers"] == [] and view["endpoints"][0]["id"] == endpoint["id"]
    screen = "\n".join(render(view, "http://x", 2, 200))
    assert "ENDPOINT" in screen and FAILING in screen and rig.url("/fail") in screen
    assert any(b["spec"] == "down" and b["reason"].startswith(FAILING)
               for b in view["blocked"])

    # No directive reaches it: quiet, it would never run again (it never says it runs).
    told = await live.post("/workers/state", json={"state": "quiet", "all": True})
    assert told.status_code == 200 and told.json()["workers"] == [], told.text
    told = await live.post(f"/workers/{endpoint['id']}/state", json={"state": "quiet"})
    assert (told.status_code, told.json()["error"]["code"]) == (409, "push_endpoint")
    assert (await live.get("/workers")).json()["workers"][0]["state"] == "running"

    # The attempt's record: the delivery's status, duration, body and id.
    record = (await settled(live, failed[0]))["errors"][0]
    assert record["type"] == "http_500" and record["details"]["status"] == 500
    assert "failing on purpose" in record["details"]["body"]
    assert record["details"]["delivery_id"] and record["details"]["ms"] >= 0


def test_rota_tail_says_an_endpoint_paused_and_recovered():
    paused = {"at": "2026-11-27T19:00:00Z", "kind": "state_change", "worker": "http:down@ab12",
              "state": "paused", "spec": "down",
              "message": "http:down@ab12 endpoint failing: 5 errors in 30 s, next try in 5 s"}
    line = event_line(1, paused)
    assert "spec=down worker=http:down@ab12 state=paused" in line
    assert 'message="http:down@ab12 endpoint failing: 5 errors in 30 s' in line
    recovered = {**paused, "state": "recovered", "message": "http:down@ab12 recovered"}
    assert "state=recovered" in event_line(2, recovered)
