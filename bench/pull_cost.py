"""OJS pull workers against Rota (issue 25), for bench/compare.py's ``pull`` scenario.

A fresh ``rota serve`` (default settings) gets ``jobs`` no-op jobs through
``POST /ojs/v1/jobs/batch`` (1,000 a request) before any worker runs. Then 10 pull
workers, each one asyncio task on its own HTTP connection, loop FETCH of 1 job and ACK
until the queue is empty: the OJS worker protocol at concurrency 10, one job per round
trip pair. The figure is jobs completed per second from the first FETCH to the last ACK,
and the server's CPU per job over that span. The type is unversioned, as the suite's are,
so no checksum is declared.

The reference is huey's end-to-end run of the same number of no-op tasks at concurrency
10 (bench/reference.py): its consumer takes one task per redis round trip, as a pull
worker does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil

CHUNK = 1000
CONCURRENCY = 10
QUEUE = "bench-pull"
TYPE = "bench.pull"


async def _drain(base_url: str, jobs: int) -> tuple[float, int]:
    """Seconds to take every job with CONCURRENCY pull workers; jobs acknowledged."""
    acked = 0

    async def worker(n: int) -> None:
        nonlocal acked
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            while True:
                got = await http.post("/ojs/v1/workers/fetch", json={
                    "queues": [QUEUE], "count": 1, "worker_id": f"bench-{n}"})
                got.raise_for_status()
                batch = got.json()["jobs"]
                if not batch:
                    return
                for job in batch:
                    done = await http.post("/ojs/v1/workers/ack", json={
                        "job_id": job["id"], "worker_id": f"bench-{n}", "result": None})
                    done.raise_for_status()
                    acked += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(CONCURRENCY)))
    return time.perf_counter() - started, acked


def pull(quick: bool, rota_server: Callable[[], Any], server_process: Callable[[Any], Any],
         reference: Callable[[], Any],
         ratio: Callable[[float | None, float | None], float | None]) -> dict[str, Any]:
    """bench/compare.py's ``pull`` scenario."""
    jobs = 2_000 if quick else 10_000
    with rota_server() as (setup, children):
        proc: psutil.Process = server_process(children)
        with httpx.Client(base_url=setup.base_url, timeout=120) as http:
            body = {"jobs": [{"type": TYPE, "args": [n], "options": {"queue": QUEUE}}
                             for n in range(CHUNK)]}
            for _ in range(jobs // CHUNK):
                http.post("/ojs/v1/jobs/batch", json=body).raise_for_status()
        cpu_before = proc.cpu_times()
        seconds, acked = asyncio.run(_drain(setup.base_url, jobs))
        cpu_after = proc.cpu_times()
    if acked != jobs:
        raise SystemExit(f"pull: {acked} of {jobs} jobs acknowledged")
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    rota = {"jobs": jobs, "concurrency": CONCURRENCY, "fetch_ack_per_s": round(jobs / seconds),
            "server_cpu_us_per_job": round(cpu / jobs * 1e6, 1)}
    ref = reference()
    huey = ref.huey_e2e(jobs=jobs, concurrency=CONCURRENCY) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {
        "pull_vs_end_to_end": ratio(rota["fetch_ack_per_s"],
                                    huey and huey.get("end_to_end_per_s"))}}
