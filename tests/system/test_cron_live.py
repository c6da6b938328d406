"""Cron schedules with real processes: a ``rota serve`` killed with -9 mid-run and started
again on the same SQLite file makes no second job for a tick and catches up as its misfire
policy says; two servers on one PostgreSQL make exactly one job per tick."""

from __future__ import annotations

import asyncio
import calendar
import re
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from conftest import write_spec
from helpers import end, free_port, spawn_serve, wait_until
from test_crash import ServerProcess

from rota import JobContext, Worker

pytestmark = pytest.mark.timeout(120)


def second(job_id: str) -> int:
    return calendar.timegm(time.strptime(job_id[-16:], "%Y%m%dT%H%M%SZ"))


async def tick_ids(http: httpx.AsyncClient, name: str) -> list[str]:
    jobs = (await http.get("/jobs", params={"q": f"cron-{name}-", "limit": 500})).json()["jobs"]
    return sorted(j["id"] for j in jobs if j["id"].startswith(f"cron-{name}-"))


async def run_through_a_kill(tmp_path: Path, before: float, down: float, after: float) -> None:
    specs = tmp_path / "specs"
    spec = write_spec(specs, "beat")
    server = ServerProcess(tmp_path)
    await server.start()
    await server.push(spec)
    worker = Worker(url=server.ws, specs_dir=specs, heartbeat_interval=0.1)
    ran: list[str] = []

    @worker.handler("beat")
    async def beat(ctx: JobContext) -> None:
        ran.append(ctx.id)

    task = asyncio.create_task(worker.run())
    try:
        await server.http.put("/schedules/beat", json={"spec": "beat", "cron": "@every 1s",
                                                             "overlap": "allow"})
        await wait_until(lambda: len(ran) >= before, timeout=before + 10, what="ticks run")
        await server.kill()
        await asyncio.sleep(down)  # noqa: sleep-ok (the downtime under test)
        await server.start()
        count = len(ran)
        await wait_until(lambda: len(ran) >= count + after, timeout=after + 10,
                         what="ticks after the restart")
        await server.http.post("/schedules/beat/pause")
        await asyncio.sleep(0.3)  # noqa: sleep-ok (a tick in flight at the pause lands)
        ids = await tick_ids(server.http, "beat")
        log = "".join(p.read_text() for p in server.logs)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 10)
        await end([server.proc] if server.proc else [], [server.http])
    assert len(ids) == len(set(ids))
    assert sorted(set(ran)) == sorted(set(ran) & set(ids))  # every run was a tick's job
    seconds = [second(i) for i in ids]
    gaps = [(a, b) for a, b in zip(seconds, seconds[1:]) if b - a != 1]
    misses = re.findall(r"cron miss schedule=beat missed=(\d+) fired=(\d+)", log)
    # the downtime's ticks were missed; the latest of them was caught up (catch_up = 1),
    # and the others made no job: only they are absent
    assert len(misses) == 1 and int(misses[0][1]) == 1, (seconds, misses)
    assert sum(b - a - 1 for a, b in gaps) == int(misses[0][0]) - 1, (seconds, misses)
    assert len(gaps) <= 1


async def test_a_server_killed_and_restarted_makes_each_tick_once(tmp_path: Path):
    await run_through_a_kill(tmp_path, before=2, down=3.0, after=2)


@pytest.mark.soak
async def test_a_minute_of_every_second_through_a_kill(tmp_path: Path):
    await run_through_a_kill(tmp_path, before=30, down=5.0, after=25)


async def run_cluster(tmp_path: Path, pg_url: str, servers: int, ticks: int,
                      kill_one: bool = False) -> None:
    """``servers`` servers on one PostgreSQL and an every-second schedule, until it made
    ``ticks`` jobs (``kill_one``: the first server killed with -9 half way)."""
    specs = tmp_path / "specs"
    spec = write_spec(specs, "beat")
    ports = [free_port() for _ in range(servers)]
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{p}", timeout=10) for p in ports]
    procs = []

    def enough(count: int) -> Any:
        async def check() -> list[str] | None:
            ids = await tick_ids(clients[-1], "beat")
            return ids if len(ids) >= count else None
        return check

    try:
        for n, (port, http) in enumerate(zip(ports, clients)):
            procs.append(await spawn_serve(http, [
                "--port", str(port), "--db", pg_url, "--server-id", f"s{n}",
                "--log-level", "info"], tmp_path / f"server-{n}.log"))
        body = {"specs": [msgspec.to_builtins(spec)]}
        assert (await clients[0].put("/specs", json=body)).status_code == 200
        await clients[-1].put("/schedules/beat", json={"spec": "beat", "cron": "@every 1s",
                                                       "overlap": "allow"})  # (no worker)
        if kill_one:
            await wait_until(enough(ticks // 2), timeout=ticks, what="half the ticks")
            procs[0].kill()
            await procs[0].wait()
        await wait_until(enough(ticks), timeout=ticks + 15, what=f"{ticks} ticks")
        assert (await clients[-1].post("/schedules/beat/pause")).status_code == 200
        await asyncio.sleep(0.5)  # noqa: sleep-ok (a tick in flight at the pause lands)
        ids = await tick_ids(clients[-1], "beat")
        logs = [(tmp_path / f"server-{n}.log").read_text() for n in range(servers)]
    finally:
        await end(procs, clients)
    made = [tick for log in logs for tick in re.findall(r"cron fire schedule=beat tick=(\S+)",
                                                        log)]
    assert len(made) == len(set(made))  # no tick made twice
    if kill_one:  # (the killed server's last lines may not have reached its log)
        assert set(made) <= {i[-16:] for i in ids}
    else:
        assert sorted(made) == [i[-16:] for i in ids]  # each tick made, by one server
    seconds = [second(i) for i in ids]
    gaps = sum(b - a - 1 for a, b in zip(seconds, seconds[1:]))
    misses = re.findall(r"cron miss schedule=beat missed=(\d+) fired=(\d+)", "".join(logs))
    assert gaps == sum(int(m) - int(f) for m, f in misses), (seconds, misses)


async def test_two_servers_on_one_postgresql_make_one_job_per_tick(tmp_path: Path, pg_url: str):
    await run_cluster(tmp_path, pg_url, servers=2, ticks=4)


@pytest.mark.soak
async def test_three_servers_on_one_postgresql_through_a_kill(tmp_path: Path, pg_url: str):
    await run_cluster(tmp_path, pg_url, servers=3, ticks=60, kill_one=True)
