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
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil

CHUNK = 1000
CONCURRENCY = 10
QUEUE = "bench-pull"
TYPE = "bench.pull"


class RawHttp:
    """One keep-alive HTTP/1.1 connection on asyncio streams (stdlib only): a client that
    costs next to nothing, so the figure is the server's, not httpx's (a few CPU
    milliseconds a request on a small machine; bench/throughput.py's RawPoster)."""

    def __init__(self, base_url: str) -> None:
        host, _, port = base_url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)

    async def __aenter__(self) -> RawHttp:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        self.writer.write(f"POST {path} HTTP/1.1\r\nhost: {self.host}\r\ncontent-type:"
                          f" application/json\r\ncontent-length: {len(data)}\r\n\r\n"
                          .encode() + data)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        length = int(head.split("content-length:", 1)[1].split("\r\n", 1)[0])
        reply = await self.reader.readexactly(length)
        if not head.startswith("http/1.1 200"):
            raise RuntimeError(f"{path}: {head.splitlines()[0]} {reply[:200]!r}")
        return json.loads(reply)


class HttpxHttp:
    """The same over httpx, as a newcomer's worker (examples/ojs_worker.py) is written."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, timeout=60)

    async def __aenter__(self) -> HttpxHttp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def post(self, path: str, body: dict[str, Any]) -> Any:
        reply = await self.http.post(path, json=body)
        reply.raise_for_status()
        return reply.json()


async def _drain(base_url: str, client: type[RawHttp] | type[HttpxHttp]) -> tuple[float, int]:
    """Seconds to take every job with CONCURRENCY pull workers; jobs acknowledged."""
    acked = 0

    async def worker(n: int) -> None:
        nonlocal acked
        async with client(base_url) as http:
            while True:
                batch = (await http.post("/ojs/v1/workers/fetch", {
                    "queues": [QUEUE], "count": 1, "worker_id": f"bench-{n}"}))["jobs"]
                if not batch:
                    return
                for job in batch:
                    await http.post("/ojs/v1/workers/ack", {
                        "job_id": job["id"], "worker_id": f"bench-{n}", "result": None})
                    acked += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(CONCURRENCY)))
    return time.perf_counter() - started, acked


def _run(jobs: int, client: type[RawHttp] | type[HttpxHttp], rota_server: Callable[[], Any],
         server_process: Callable[[Any], Any]) -> tuple[float, float]:
    """(jobs a second, server CPU µs a job) for one drain of ``jobs`` through ``client``."""
    with rota_server() as (setup, children):
        proc: psutil.Process = server_process(children)
        with httpx.Client(base_url=setup.base_url, timeout=120) as http:
            body = {"jobs": [{"type": TYPE, "args": [n], "options": {"queue": QUEUE}}
                             for n in range(CHUNK)]}
            for _ in range(jobs // CHUNK):
                http.post("/ojs/v1/jobs/batch", json=body).raise_for_status()
        cpu_before = proc.cpu_times()
        seconds, acked = asyncio.run(_drain(setup.base_url, client))
        cpu_after = proc.cpu_times()
    if acked != jobs:
        raise SystemExit(f"pull: {acked} of {jobs} jobs acknowledged")
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    return jobs / seconds, cpu / jobs * 1e6


def pull(quick: bool, rota_server: Callable[[], Any], server_process: Callable[[Any], Any],
         reference: Callable[[], Any],
         ratio: Callable[[float | None, float | None], float | None]) -> dict[str, Any]:
    """bench/compare.py's ``pull`` scenario: the drain through a raw client (the server's
    rate) and through httpx (a newcomer's worker), beside huey's end-to-end run."""
    jobs = 2_000 if quick else 10_000
    raw_rate, raw_cpu = _run(jobs, RawHttp, rota_server, server_process)
    httpx_rate, httpx_cpu = _run(jobs, HttpxHttp, rota_server, server_process)
    rota = {"jobs": jobs, "concurrency": CONCURRENCY,
            "fetch_ack_per_s_raw_client": round(raw_rate),
            "server_cpu_us_per_job_raw_client": round(raw_cpu, 1),
            "fetch_ack_per_s_httpx": round(httpx_rate),
            "server_cpu_us_per_job_httpx": round(httpx_cpu, 1)}
    ref = reference()
    huey = ref.huey_e2e(jobs=jobs, concurrency=CONCURRENCY) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {
        "pull_raw_vs_end_to_end": ratio(rota["fetch_ack_per_s_raw_client"],
                                        huey and huey.get("end_to_end_per_s")),
        "pull_httpx_vs_end_to_end": ratio(rota["fetch_ack_per_s_httpx"],
                                          huey and huey.get("end_to_end_per_s"))}}
