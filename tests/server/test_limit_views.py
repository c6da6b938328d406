"""Flow control as the user sees it on a real server: a limit and its use in GET
/metrics, GET /queues and `rota watch`, and why a job waits in GET /jobs/{id}. Limits are
set through the runtime limits API (tests/helpers.py set_limits)."""

from __future__ import annotations

import asyncio
import sys

import pytest
from conftest import Live, write_spec
from helpers import clean_env, reap, set_limits, wait_until
from test_feeds import metric
from test_flow import invoke

from rota.core.limits import LimitRule, Rate

QUIET_WORKERS = pytest.mark.parametrize("live", [{"heartbeat_timeout": 60.0}], indirect=True,
                                        ids=["quiet-raw-workers"])


@QUIET_WORKERS
async def test_a_spec_at_its_limit_shows_in_metrics_queues_the_job_and_watch(
        live: Live, connect, tmp_path):
    spec = write_spec(tmp_path / "specs", "send_email")
    await live.push(spec)
    await set_limits(live.http, {("spec", "send_email"): LimitRule(concurrency=2),
                                 ("queue", "default"): LimitRule(rate=Rate(100, 60.0))})
    worker = await connect("w-mail")
    await worker.register([spec], concurrency=10)
    ids = [(await live.enqueue("send_email", id=f"mail-{n}"))["id"] for n in range(5)]
    running = {job["id"] for job in await worker.jobs(2)}
    await worker.assert_no_assign()
    [waiting, *_] = [job_id for job_id in ids if job_id not in running]

    job = await live.job(waiting)
    assert job["state"] == "available"
    assert job["waiting_reason"] == "concurrency limit 2 for spec send_email: 2 running"
    # A job's own labels, read from its row (a JSON list, or a comma-separated text)
    for labels in ('["gpu", "eu"]', "gpu,eu"):
        assert live.coordinator.job_waiting_reason(
            {"queue": "default", "spec": "send_email", "labels": labels}
        ) == "no connected worker has label eu"

    text = (await live.http.get("/metrics")).text
    assert metric(text, "rota_limit_in_use", limit="spec:send_email", key="") == 2
    assert metric(text, "rota_limit_max", limit="spec:send_email", key="") == 2
    assert metric(text, "rota_limit_in_use", limit="queue:default", key="") == 2
    assert metric(text, "rota_rate_starts", limit="queue:default", key="") == 2
    assert metric(text, "rota_jobs_blocked", spec="send_email", reason="concurrency_limit") == 3

    body = (await live.http.get("/queues")).json()
    assert {"name": "spec:send_email", "concurrency": 2, "running": 2} in body["limits"]
    assert {"name": "queue:default", "rate": "100/min", "running": 2, "starts": 2} \
        in body["limits"]
    [entry] = [q for q in body["queues"] if q["name"] == "default"][0]["waiting"]
    assert entry["reason"] == "concurrency limit 2 for spec send_email: 2 running"
    assert entry["blocked"] is False  # a backlog: it drains as the limit frees up

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "watch", "--interval", "0.2", "--url", live.base,
        env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        lines: list[str] = []

        async def limits_shown() -> bool:
            line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()  # type: ignore[union-attr]
            assert line, "rota watch ended"
            lines.append(line.rstrip())
            return len(lines) > 2 and lines[-3] == "LIMITS"

        await wait_until(limits_shown, timeout=10, what="the LIMITS section of rota watch")
    finally:
        await reap(proc)
    assert lines[-2].split() == ["queue:default", "2", "running", "2", "started", "of",
                                 "100/min"]
    assert lines[-1].split() == ["spec:send_email", "2/2", "running"]


@QUIET_WORKERS
async def test_a_keyed_and_a_labelled_job_say_why_they_wait(live: Live, connect, tmp_path):
    spec = write_spec(tmp_path / "specs", "send_email")
    await live.push(spec)
    await set_limits(live.http, {("spec", "send_email"): LimitRule(key_concurrency=1)})
    worker = await connect("w-mail")
    await worker.register([spec], concurrency=10)
    await live.enqueue("send_email", id="acme-1", concurrency_key="acme")
    await worker.jobs(1)
    await live.enqueue("send_email", id="acme-2", concurrency_key="acme")
    await live.enqueue("send_email", id="gpu-1", labels=["gpu"])
    await worker.assert_no_assign()
    assert (await live.job("acme-2"))["waiting_reason"] == \
        "concurrency limit 1 for spec send_email key acme: 1 running"
    assert (await live.job("gpu-1"))["waiting_reason"] == "no connected worker has label gpu"
    text = (await live.http.get("/metrics")).text
    assert metric(text, "rota_limit_in_use", limit="spec:send_email", key="acme") == 1
    assert metric(text, "rota_limit_max", limit="spec:send_email", key="acme") == 1
    assert metric(text, "rota_jobs_blocked", spec="send_email", reason="concurrency_limit") == 1
    assert metric(text, "rota_jobs_blocked", spec="send_email", reason="no_label") == 1
    [entry] = [q for q in (await live.http.get("/queues")).json()["queues"]
               if q["name"] == "default"][0]["waiting"]
    assert entry["held"] == {"concurrency_limit": 1, "no_label": 1}
    assert (entry["missing_labels"], entry["missing_labels_more"]) == (["gpu"], 0)
    code, out, err = await invoke("queues", "--url", live.base)  # each held, in words
    assert code == 0, err
    assert ("  send_email: 2 waiting: 1 held by their key's concurrency limit, 1 need labels"
            " no connected worker has (gpu)") in out.splitlines(), out
    page = (await live.http.get("/ui/queues")).text
    assert '<span class="warn">1 need labels no connected worker has (gpu)</span>' in page
    overview = (await live.http.get("/ui")).text  # Blocked names the label
    assert '<td class="full">no connected worker has label gpu</td>' in overview, overview
