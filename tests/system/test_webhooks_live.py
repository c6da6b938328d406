"""Webhooks against a real `rota serve` and a receiver in the test: the server killed with
-9 while deliveries wait for a receiver that is down sends them all after its restart;
and (soak) a receiver down for 60 s gets every event afterwards while jobs flow through
an SDK worker as fast as with no webhook failing."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import Api, start_server, stop_server, write_spec
from helpers import free_port, reap, spawn_serve, wait_until
from hookrig import Receiver

from rota import JobContext, Worker


@dataclass
class Served(Api):
    http: httpx.AsyncClient
    port: int


def serve_args(tmp: Path, port: int, scale: float = 0.01) -> list[str]:
    """A server that may send to the receiver on loopback, on a shortened schedule."""
    return ["--db", str(tmp / "rota.db"), "--port", str(port), "--allow-private-endpoints",
            "--webhook-backoff-scale", str(scale), "--webhook-timeout", "2"]


async def delivered_jobs(receiver: Receiver, kind: str) -> set[str]:
    return {r.json["data"]["job"] for r in receiver.got if r.json["kind"] == kind}


async def test_deliveries_pending_at_a_kill_9_are_sent_after_the_restart(tmp_path):
    port = free_port()
    receiver = await Receiver().start()
    served = Served(httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10), port)
    proc = await spawn_serve(served.http, serve_args(tmp_path, port), tmp_path / "serve.log")
    try:
        await served.push(write_spec(tmp_path / "specs", "mail"))
        sub = (await served.http.post("/webhooks", json={"url": receiver.url,
                                                         "kinds": ["enqueue"]})).json()
        await receiver.down()
        ids = {(await served.enqueue("mail", {"n": n}))["id"] for n in range(20)}

        async def tried() -> bool:
            log = (await served.http.get(f"/webhooks/{sub['id']}/deliveries",
                                         params={"limit": 100})).json()["deliveries"]
            return len(log) == 20 and all(d["state"] == "pending" for d in log) and any(
                d["attempts"] for d in log)
        await wait_until(tried, timeout=10.0, what="pending deliveries, tried")
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        await receiver.start()
        proc = await spawn_serve(served.http, serve_args(tmp_path, port),
                                 tmp_path / "serve2.log")

        async def all_in() -> bool:
            return await delivered_jobs(receiver, "enqueue") == ids
        await wait_until(all_in, timeout=20.0, what="every event after the restart")
        by_delivery: dict[str, set[str]] = {}
        for got in receiver.got:
            by_delivery.setdefault(got.headers["x-rota-delivery-id"], set()).add(got.json["id"])
        assert all(len(events) == 1 for events in by_delivery.values())
    finally:
        await reap(proc)
        await served.http.aclose()
        await receiver.close()


async def run_jobs(served: Served, worker_done: set[str], n: int, tag: str) -> float:
    """Enqueue ``n`` jobs and wait until the worker finished them: jobs per second."""
    start = time.monotonic()
    batch = [{"spec": "work", "args": {"tag": tag, "n": i}} for i in range(n)]
    answer = await served.http.post("/jobs/batch", json={"jobs": batch})
    assert answer.status_code == 200, answer.text
    await wait_until(lambda: sum(1 for j in worker_done if j.startswith(tag)) == n,
                     timeout=120.0, what=f"{n} jobs of {tag}")
    return n / (time.monotonic() - start)


@pytest.mark.soak
@pytest.mark.timeout(400)
async def test_a_receiver_down_for_60s_gets_every_event_and_throughput_holds(tmp_path):
    port = free_port()
    receiver = await Receiver().start()
    served = Served(httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10), port)
    # The schedule at a thousandth: tries at 0, 0.03, 0.15, 0.75, 4.35, 18.75 and 61.95 s.
    proc = await spawn_serve(served.http, serve_args(tmp_path, port, 0.001),
                             tmp_path / "serve.log")
    specs = tmp_path / "specs"
    await served.push(write_spec(specs, "work"))
    done: set[str] = set()
    worker = Worker(url=f"ws://127.0.0.1:{port}/work", specs_dir=specs, concurrency=50)

    @worker.handler("work")
    async def work(ctx: JobContext) -> None:
        done.add(f"{ctx.args['tag']}-{ctx.args['n']}")

    running = asyncio.create_task(worker.run())
    try:
        await wait_until(worker.connected.is_set, what="the worker")
        sub = (await served.http.post("/webhooks", json={
            "url": receiver.url, "kinds": ["enqueue", "result"]})).json()
        await run_jobs(served, done, 200, "warm")
        n = 2000
        healthy = await run_jobs(served, done, n, "up")
        await receiver.down()
        went_down = time.monotonic()
        dead = await run_jobs(served, done, n, "down")
        await asyncio.sleep(max(0.0, 60.0 - (time.monotonic() - went_down)))  # noqa: sleep-ok (the receiver stays down 60 s)
        await receiver.start()
        want = (200 + 2 * n) * 2  # the enqueue and the result of every job

        def seen() -> set[tuple[str, str]]:
            return {(r.json["data"]["job"], r.json["kind"]) for r in receiver.got}
        await wait_until(lambda: len(seen()) >= want, timeout=120.0,
                         what="every event after the receiver is back")
        assert len(seen()) == want
        log = (await served.http.get(f"/webhooks/{sub['id']}/deliveries",
                                     params={"state": "dead"})).json()["deliveries"]
        assert log == []
        # Throughput with the receiver down is that of a healthy one, within the noise of
        # a shared machine: quiet runs gave 0.76 to 1.15 of it, runs beside another suite
        # down to 0.59 (the down phase runs second, on a larger database). Half is what a
        # receiver that held the engine back would miss by far.
        print(f"jobs/s: receiver up {healthy:.0f}, receiver down {dead:.0f}")
        assert dead >= 0.5 * healthy, (dead, healthy)
    finally:
        worker.stop()
        await asyncio.wait_for(running, 20)
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
        await reap(proc)
        await served.http.aclose()
        await receiver.close()


async def test_two_servers_on_postgresql_send_each_delivery_once(tmp_path: Path, pg_url: str):
    """Both servers pump their own events into the shared outbox and both deliver: a
    claim keeps any delivery from being sent by both."""
    options = {"database_url": pg_url, "allow_private_endpoints": True,
               "webhook_backoff_scale": 0.01}
    receiver = await Receiver().start()
    a = await start_server(tmp_path / "a", server_id="a", **options)
    b = None
    try:
        await a.push(write_spec(tmp_path / "specs", "mail"))
        await a.http.post("/webhooks", json={"url": receiver.url, "kinds": ["enqueue"]})
        b = await start_server(tmp_path / "b", server_id="b", **options)  # (reads it at start)
        ids = {(await (a if n % 2 else b).enqueue("mail", {"n": n}))["id"]
               for n in range(40)}
        await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == ids,
                         timeout=15.0, what="every event, from both servers")
        deliveries = [r.headers["x-rota-delivery-id"] for r in receiver.got]
        assert len(deliveries) == len(set(deliveries)) == 40
    finally:
        for live in (a, b):
            if live is not None:
                await stop_server(live)
        await receiver.close()
