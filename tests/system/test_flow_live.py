"""Flow control, live: real `rota serve` processes (one on SQLite, or three on one
PostgreSQL), real SDK workers, per-key and per-spec concurrency limits and a rate-limited
spec, with a server killed by -9 midway and started again. The handlers count what runs
at every start: no key and no spec ever runs more than its limit; every job completes
once; the rate-limited spec's starts, as the servers recorded them, never exceed its
window."""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import signal
from pathlib import Path

import httpx
import msgspec
import pytest
from conftest import write_spec
from helpers import COSTLY_POLL, free_port, spawn_serve, wait_until
from test_cluster import end, running

from rota import JobContext, Worker

KEY_LIMIT, SPEC_LIMIT, RATE = 3, 40, 5  # per key, per spec, starts per second


class Meter:
    """What runs now, per key and per spec, and the most ever seen at one start."""

    def __init__(self) -> None:
        self.now: collections.Counter[str] = collections.Counter()
        self.most: collections.Counter[str] = collections.Counter()

    def start(self, *names: str) -> None:
        for name in names:
            self.now[name] += 1
            self.most[name] = max(self.most[name], self.now[name])

    def stop(self, *names: str) -> None:
        for name in names:
            self.now[name] -= 1


def sdk_worker(specs: Path, urls: list[str], name: str, meter: Meter) -> Worker:
    worker = Worker(url=urls, specs_dir=specs, heartbeat_interval=0.1, worker_id=name,
                    concurrency=8)

    @worker.handler("keyed")
    async def keyed(ctx: JobContext) -> int:
        key = ctx.args["key"]
        meter.start(f"key:{key}", "spec:keyed")
        try:
            await asyncio.sleep(0.01)  # noqa: sleep-ok (the job's own work)
        finally:
            meter.stop(f"key:{key}", "spec:keyed")
        return int(ctx.args["n"])

    @worker.handler("paced")
    async def paced(ctx: JobContext) -> int:
        return int(ctx.args["n"])

    return worker


def most_in_a_window(moments: list[float], period: float) -> int:
    """The most moments in any half-open window of ``period`` seconds."""
    moments = sorted(moments)
    most, first = 0, 0
    for last, at in enumerate(moments):
        while at - moments[first] >= period:
            first += 1
        most = max(most, last - first + 1)
    return most


async def run_flow(tmp: Path, db: str, servers: int, workers: int, total: int, keys: int,
                   paced: int) -> None:
    specs = tmp / "specs"
    keyed = write_spec(specs, "keyed", extra=(
        f"[args.key]\ntype = \"string\"\n[args.n]\ntype = \"integer\"\n"
        f"[limits]\nconcurrency = {SPEC_LIMIT}\nkey_concurrency = {KEY_LIMIT}\n"))
    pace = write_spec(specs, "paced", extra=(
        f"[args.n]\ntype = \"integer\"\n[limits]\nrate = \"{RATE}/s\"\n"))
    ports = [free_port() for _ in range(servers)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    # A connection idle for the server's keep-alive (5 s, as a restart can leave one) may
    # be closed as the next request goes out: the client lets go of it sooner.
    clients = [httpx.AsyncClient(base_url=u, timeout=30,
                                 limits=httpx.Limits(keepalive_expiry=2.0)) for u in urls]
    procs: list[asyncio.subprocess.Process] = []

    async def serve(i: int, log: str) -> asyncio.subprocess.Process:
        shared = (["--server-id", f"s{i}", "--server-lease", "1", "--reconnect-grace", "1"]
                  if servers > 1 else [])
        return await spawn_serve(clients[i], [
            "--db", db, "--port", str(ports[i]), "--heartbeat-interval", "0.2",
            "--heartbeat-timeout", "2", *shared], tmp / log)

    meter = Meter()
    try:
        for i in range(servers):
            procs.append(await serve(i, f"s{i}.log"))
        body = {"specs": [msgspec.to_builtins(s) for s in (keyed, pace)]}
        pushed = await clients[0].put("/specs", json=body)
        assert pushed.status_code == 200, pushed.text
        fleet = [sdk_worker(specs, urls[k % servers:] + urls[:k % servers], f"w{k}", meter)
                 for k in range(workers)]
        async with running(*fleet):
            batch = total // 10
            for start in range(0, total, batch):
                via = clients[(start // batch) % servers]
                jobs = [{"spec": "keyed", "args": {"key": f"k{n % keys}", "n": n},
                         "concurrency_key": f"k{n % keys}"} for n in range(start, start + batch)]
                if start == 0:
                    jobs += [{"spec": "paced", "args": {"n": n}} for n in range(paced)]
                response = await via.post("/jobs/batch", json={"jobs": jobs})
                assert response.status_code == 200, response.text
                if start == total // 2:  # midway: kill a server, then start it again
                    victim = 1 % servers
                    procs[victim].send_signal(signal.SIGKILL)
                    await procs[victim].wait()
                    procs[victim] = await serve(victim, f"s{victim}-again.log")

            async def finished() -> bool:
                reply = await clients[0].get("/queues")
                done = sum(q["counts"].get("completed", 0) for q in reply.json()["queues"])
                return done >= total + paced

            await wait_until(finished, timeout=120, what="every job completed",
                             step=COSTLY_POLL)
        over = {name: n for name, n in meter.most.items()
                if n > (SPEC_LIMIT if name.startswith("spec:") else KEY_LIMIT)}
        assert not over, f"ran more than the limit: {over}"
        assert meter.most["spec:keyed"] >= KEY_LIMIT  # the limits let work run at all
        listed = await clients[0].get("/jobs", params={"spec": "paced", "limit": 500})
        assert listed.status_code == 200, listed.text
        rows = listed.json()["jobs"]
        assert len(rows) == paced and all(r["state"] == "completed" for r in rows)
        starts = [dt.datetime.fromisoformat(r["reserved_at"]).timestamp() for r in rows]
        assert most_in_a_window(starts, 1.0) <= RATE, sorted(starts)
        keys_most = max(n for name, n in meter.most.items() if name.startswith("key:"))
        print(f"flow: {total} keyed jobs, at most {meter.most['spec:keyed']} of the spec and"
              f" {keys_most} of a key at once; {paced} paced, at most"
              f" {most_in_a_window(starts, 1.0)} starts in a second")
        counted = await clients[0].get("/queues")
        states = collections.Counter()
        for queue in counted.json()["queues"]:
            states.update(queue["counts"])
        assert states["completed"] == total + paced, states
    finally:
        await end(procs, clients)


@pytest.mark.timeout(150)
async def test_limits_hold_on_sqlite_through_a_kill_9(tmp_path: Path):
    await run_flow(tmp_path, str(tmp_path / "rota.db"), servers=1, workers=6, total=600,
                   keys=20, paced=15)


@pytest.mark.soak
@pytest.mark.timeout(240)
async def test_limits_hold_on_three_postgresql_servers_through_a_kill_9(tmp_path: Path,
                                                                       pg_url: str):
    await run_flow(tmp_path, pg_url, servers=3, workers=20, total=5000, keys=50, paced=40)


@pytest.mark.soak
@pytest.mark.timeout(240)
async def test_limits_hold_on_sqlite_at_full_size(tmp_path: Path):
    await run_flow(tmp_path, str(tmp_path / "rota.db"), servers=1, workers=20, total=5000,
                   keys=50, paced=40)
