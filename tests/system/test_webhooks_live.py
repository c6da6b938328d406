"""Webhooks against a real `rota serve` and a receiver in the test: the server killed with
-9 while deliveries wait for a receiver that is down sends them all after its restart;
and (soak) jobs flow through an SDK worker as fast with the receiver down as up (pairs of
rounds, the receiver a process of its own), and one down for 60 s gets every event
afterwards. On one PostgreSQL, two servers send each delivery once, and a subscription
made through one gets the other's job events of before the other knew of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psycopg
import pytest
from conftest import Api, Live, start_server, stop_server, write_spec
from helpers import free_port, reap, spawn_serve, wait_until
from hookrig import Receiver

from rota import JobContext, Worker
from rota.core import webhooks as wh
from rota.server import hooks


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
    await wait_until(lambda: sum(1 for j in worker_done if j.startswith(f"{tag}-")) == n,
                     timeout=120.0, what=f"{n} jobs of {tag}")
    return n / (time.monotonic() - start)


# A receiver in a process of its own (hookrig's, each request's body a line of a file), so
# that answering the events takes no CPU from the worker in the test's process; down is
# the process gone (its port refuses), up a new one on the same port.
RECEIVE = """
import asyncio, sys
sys.path.insert(0, sys.argv[1])
from hookrig import Receiver
class Lines(list):
    def append(self, got):
        out.write(got.body.decode() + "\\n")
        out.flush()
async def main():
    receiver = await Receiver(got=Lines(), port=int(sys.argv[3])).start()
    print(receiver.port, flush=True)
    await asyncio.Event().wait()
out = open(sys.argv[2], "a")
asyncio.run(main())
"""


class ReceiverProcess:
    def __init__(self, log: Path) -> None:
        self.log, self.port = log, 0
        self.proc: asyncio.subprocess.Process | None = None
        log.touch()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", RECEIVE, str(Path(__file__).parents[1]), str(self.log),
            str(self.port), stdout=asyncio.subprocess.PIPE)
        assert self.proc.stdout is not None
        self.port = int(await asyncio.wait_for(self.proc.stdout.readline(), 20))

    async def down(self) -> None:
        if self.proc is not None:
            await reap(self.proc)
            self.proc = None

    def seen(self) -> set[tuple[str, str]]:
        """(job, kind) of every event received: a redelivery counts once. (A line still
        being written, read while the receiver writes it, is left for the next look.)"""
        text = self.log.read_text()
        found = (json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines())
        return {(event["data"]["job"], event["kind"]) for event in found}


ROUNDS = 9  # pairs of rounds, the receiver up in the first and down in the second
N = 2000  # jobs a round (2 events each: a pair's undelivered stay under MAX_PENDING, 10,000)


@pytest.mark.soak
@pytest.mark.timeout(900)
async def test_a_receiver_down_for_60s_gets_every_event_and_throughput_holds(tmp_path):
    """Job throughput with the receiver down against it up, in pairs of rounds: each pair
    starts with every event so far received, runs N jobs with the receiver up, then at once
    N with it down, so that both rounds meet the same load of a shared machine (the down
    round second: on the larger database, and with the up round's last deliveries still
    to send, which can only count against it). The median of the pairs' ratios is the
    measure; then the receiver stays down for 60 s, and gets every event afterwards."""
    port = free_port()
    receiver = ReceiverProcess(tmp_path / "received.jsonl")
    await receiver.start()
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
        jobs = 200

        async def caught_up() -> None:  # every event so far received: a pair starts clean
            if receiver.proc is None:
                await receiver.start()
            await wait_until(lambda: len(receiver.seen()) >= 2 * jobs, timeout=60.0,
                             what="the receiver to catch up", step=0.2)

        pairs: list[tuple[float, float]] = []
        for r in range(ROUNDS):
            await caught_up()
            healthy = await run_jobs(served, done, N, f"up{r}")
            await receiver.down()  # at once: the two rounds of a pair meet the same load
            dead = await run_jobs(served, done, N, f"down{r}")
            jobs += 2 * N
            pairs.append((healthy, dead))
        await caught_up()
        await receiver.down()  # and now down for 60 s
        went_down = time.monotonic()
        await run_jobs(served, done, N, "outage")
        jobs += N
        await asyncio.sleep(max(0.0, 60.0 - (time.monotonic() - went_down)))  # noqa: sleep-ok (the receiver stays down 60 s)
        await receiver.start()
        await wait_until(lambda: len(receiver.seen()) >= 2 * jobs, timeout=120.0,
                         what="every event after the receiver is back", step=0.2)
        assert len(receiver.seen()) == 2 * jobs  # the enqueue and the result of every job
        log = (await served.http.get(f"/webhooks/{sub['id']}/deliveries",
                                     params={"state": "dead"})).json()["deliveries"]
        assert log == []
        ratios = sorted(dead / healthy for healthy, dead in pairs)
        print("jobs/s (receiver up, down):", ", ".join(f"({h:.0f}, {d:.0f})" for h, d in pairs),
              "ratios:", ", ".join(f"{x:.2f}" for x in ratios))
        # The median ratio of throughput with the receiver down to up: 0.94 to 1.11 in
        # five runs on a shared 2-core machine, single pairs 0.56 to 1.84 beside other
        # suites (docs/webhooks.md §Isolation). A receiver that held the engine back would
        # pull most pairs, so the median, down.
        assert statistics.median(ratios) >= 0.8, ratios
    finally:
        worker.stop()
        await asyncio.wait_for(running, 20)
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)
        await reap(proc)
        await served.http.aclose()
        await receiver.down()


class Pair:
    """Two in-process servers, a and b, on one PostgreSQL, and a receiver."""

    def __init__(self, tmp: Path, pg_url: str) -> None:
        self.tmp = tmp
        self.options = {"database_url": pg_url, "allow_private_endpoints": True,
                        "webhook_backoff_scale": 0.01}
        self.servers: list[Live] = []

    async def start(self, name: str) -> Live:
        live = await start_server(self.tmp / name, server_id=name, **self.options)
        self.servers.append(live)
        return live

    async def subscribe(self, through: Live, receiver: Receiver) -> str:
        """Spec "mail" pushed, and the receiver subscribed to enqueues, through one: the
        subscription's id."""
        await through.push(write_spec(self.tmp / "specs", "mail"))
        made = await through.http.post("/webhooks", json={"url": receiver.url,
                                                          "kinds": ["enqueue"]})
        assert made.status_code == 201, made.text
        return str(made.json()["id"])


@contextlib.asynccontextmanager
async def pair_on(tmp: Path, pg_url: str) -> AsyncIterator[tuple[Pair, Receiver]]:
    receiver = await Receiver().start()
    pair = Pair(tmp, pg_url)
    try:
        yield pair, receiver
    finally:
        for live in pair.servers:
            await stop_server(live)
        await receiver.close()


async def test_two_servers_on_postgresql_send_each_delivery_once(tmp_path: Path, pg_url: str):
    """Both servers pump their own events into the shared outbox and both deliver: a
    claim keeps any delivery from being sent by both."""
    async with pair_on(tmp_path, pg_url) as (pair, receiver):
        a = await pair.start("a")
        await pair.subscribe(a, receiver)
        b = await pair.start("b")  # (reads it at start)
        ids = {(await (a if n % 2 else b).enqueue("mail", {"n": n}))["id"]
               for n in range(40)}
        await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == ids,
                         timeout=15.0, what="every event, from both servers")
        deliveries = [r.headers["x-rota-delivery-id"] for r in receiver.got]
        assert len(deliveries) == len(set(deliveries)) == 40


@pytest.mark.parametrize("read_fails", [False, True], ids=["read", "read-fails-once"])
async def test_a_subscription_made_through_another_server_gets_this_ones_events_before_it_knew(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch, read_fails: bool,
        caplog: pytest.LogCaptureFixture):
    """A server learns of a subscription made through another at its next read of them
    (every REREAD seconds). Its job events of the moments before went by its pump
    unmatched: they are found in the jobs' rows then, each delivered once. If that read
    of the rows fails, the subscription stays new to the next read, which tries again."""
    # No server reads the subscriptions again until b has had its events (REREAD is
    # read at each turn of the pump); then b reads them at its next turn, which comes
    # within a second (IDLE).
    monkeypatch.setattr(hooks, "REREAD", 3600.0)
    if read_fails:
        recent_jobs = hooks.sql.recent_jobs
        calls = []

        def failing_once(*args: Any) -> Any:
            calls.append(args)
            if len(calls) == 1:
                raise OSError("the database is gone for a moment")
            return recent_jobs(*args)

        monkeypatch.setattr(hooks.sql, "recent_jobs", failing_once)
    async with pair_on(tmp_path, pg_url) as (pair, receiver):
        a, b = await pair.start("a"), await pair.start("b")
        # (b's first read of the subscriptions, begun as it starts, must be over: under
        # load it once came after the subscription was made, and b knew it at once)
        await asyncio.wait_for(b.coordinator.webhooks.started.wait(), 20)
        sub_id = await pair.subscribe(a, receiver)
        ids = {(await b.enqueue("mail", {"n": n}))["id"] for n in range(10)}
        assert sub_id not in b.coordinator.webhooks.subs  # (b's pump passed them over)
        monkeypatch.setattr(hooks, "REREAD", 0.5)
        await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == ids,
                         timeout=20.0, what="b's events, once b knows the subscription")
        events = [r.json["id"] for r in receiver.got]
        assert len(events) == len(set(events)) == 10
        failed = [r for r in caplog.records if "owed to subscription" in r.getMessage()]
        assert len(failed) == read_fails, failed


@pytest.mark.parametrize("behind", [0.0, 3.0], ids=["same-clock", "a-3s-behind"])
async def test_events_passed_over_before_a_kill_9_reach_a_subscription_made_elsewhere(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch, behind: float):
    """b knew no subscription when it passed its job events over and wrote its mark past
    them; one had been made through a. b is killed with -9 before it read the
    subscriptions again. Restarted, b knows it, and its events of before the kill are
    found in the jobs' rows and delivered, each once: also when a's clock is behind b's
    by more than the margin (the subscription's time then says it was made before b's
    last read, but b did not follow it then)."""
    port = free_port()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
    args = ["--db", pg_url, "--port", str(port), "--server-id", "b",
            "--allow-private-endpoints", "--webhook-backoff-scale", "0.01"]
    # b does not read the subscriptions again before the kill, and marks at every event.
    quick = "import rota.server.hooks as h; h.REREAD = 3600.0; h.MARK_EVERY = 0.0"
    proc = await spawn_serve(http, args, tmp_path / "b.log", prelude=quick)
    async with pair_on(tmp_path, pg_url) as (pair, receiver):
        try:
            a = await pair.start("a")
            if behind:  # (a's clock: the subscription's created_at)
                monkeypatch.setattr(hooks, "time", SimpleNamespace(
                    time=lambda: time.time() - behind, monotonic=time.monotonic))
            await pair.subscribe(a, receiver)

            async def enqueue(n: int) -> tuple[str, float]:
                made = await http.post("/jobs", json={"spec": "mail", "args": {"n": n}})
                assert made.status_code == 201, made.text
                return made.json()["job"]["id"], time.time()
            early = [await enqueue(n) for n in range(10)]
            # One more, later than the restart's margin: b's mark passes the first ten by
            # more than the margin a restart looks back from it.
            await wait_until(lambda: time.time() > early[-1][1] + wh.MARGIN + 0.5,
                             timeout=10.0, what="the margin to pass")
            late = await enqueue(10)

            def mark() -> float | None:
                with psycopg.connect(pg_url) as conn:
                    row = conn.execute("SELECT value FROM meta WHERE key ="
                                       " 'webhooks_pumped:b'").fetchone()
                return None if row is None else float(row[0])
            # (the late one's time is past this: its call began after it)
            await wait_until(lambda: (mark() or 0.0) >= early[-1][1] + wh.MARGIN,
                             timeout=10.0, what="b's mark past its events")
            assert not receiver.got  # (nobody has delivered them)
            proc.kill()
            await proc.wait()
            proc = await spawn_serve(http, args, tmp_path / "b2.log")
            ids = {job_id for job_id, _ in [*early, late]}
            await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == ids,
                             timeout=20.0, what="b's events of before the kill")
            events = [r.json["id"] for r in receiver.got]
            assert len(events) == len(set(events)) == 11
        finally:
            await reap(proc)
            await http.aclose()
