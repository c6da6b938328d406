"""Push execution against a local endpoint (issue 26), for bench/compare.py's ``push``
scenario; also runnable alone as the endpoint: ``python bench/push_cost.py --serve``.

A fresh ``rota serve`` (default settings, ``--allow-private-endpoints``, the signing
secret from its environment) gets a spec whose ``[execute]`` points at a local endpoint
with ``max_in_flight = 50``; ``jobs`` jobs are enqueued with their queue paused (1,000 a
request), then the queue is resumed and the server delivers them all. The figures:
deliveries a second from the resume to the last completion (``GET /healthz``'s
``live_jobs`` at 0), and the server's CPU per job over that span.

Two endpoints, to say which bounds the rate: the test rig (tests/endpoint_rig.py's
``/ok``, a ThreadingHTTPServer that checks each signature) and ``--serve`` below, an
asyncio HTTP/1.1 server that answers 200 ``{}`` to any POST without looking (a few tens
of microseconds a request). The reference is huey's end-to-end run of the same number of
no-op tasks at concurrency 50 (bench/reference.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

CHUNK = 1000
IN_FLIGHT = 50
QUEUE = "bench-push"
SPEC = "bench.push"
SECRET = "bench-push-secret"
RIG = Path(__file__).resolve().parents[1] / "tests" / "endpoint_rig.py"
ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
          b"\r\n{}")


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Keep-alive: read each request's head and body, answer 200 {}."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            writer.write(ANSWER)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _serve() -> None:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


@contextmanager
def endpoint(kind: str, workdir: Path) -> Iterator[tuple[str, psutil.Process]]:
    """The endpoint as a subprocess: its URL and its process."""
    if kind == "rig":
        argv = [sys.executable, str(RIG), "--port", "0", "--log", str(workdir / "rig.log"),
                "--secret", SECRET]
        path = "/ok"
    else:
        argv, path = [sys.executable, __file__, "--serve"], "/"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}{path}", psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _run(jobs: int, kind: str, rota_server: Callable[..., Any],
         server_process: Callable[[Any], psutil.Process]) -> dict[str, float]:
    """One drain of ``jobs`` pushed jobs to the ``kind`` endpoint."""
    os.environ["ROTA_SECRET_BENCH"] = SECRET  # (the server inherits it)
    with rota_server(extra=["--allow-private-endpoints"]) as (setup, children):
        server = server_process(children)
        with endpoint(kind, setup.workdir) as (url, target), \
                httpx.Client(base_url=setup.base_url, timeout=120) as http:
            http.put("/specs", json={"specs": [{
                "name": SPEC, "version": "1", "queue": QUEUE,
                "execute": {"url": url, "secret": "bench", "timeout": 30,
                            "max_in_flight": IN_FLIGHT}}]}).raise_for_status()
            http.post(f"/queues/{QUEUE}/pause").raise_for_status()
            body = {"jobs": [{"spec": SPEC, "args": {"n": n}} for n in range(CHUNK)]}
            for _ in range(jobs // CHUNK):
                http.post("/jobs/batch", json=body).raise_for_status()
            cpu_before, target_before = _cpu(server), _cpu(target)
            started = time.perf_counter()
            http.post(f"/queues/{QUEUE}/resume").raise_for_status()
            while http.get("/healthz").json()["live_jobs"] > 0:
                time.sleep(0.02)  # noqa: sleep-ok (polling the drain's end)
            seconds = time.perf_counter() - started
            cpu, target_cpu = _cpu(server) - cpu_before, _cpu(target) - target_before
        with contextlib.closing(sqlite3.connect(setup.db)) as db:
            total = db.execute("SELECT count(*) FROM jobs WHERE state = 'completed'"
                               " AND spec = ?", (SPEC,)).fetchone()[0]
    if total != jobs:
        raise SystemExit(f"push: {total} of {jobs} jobs completed")
    return {"deliveries_per_s": round(jobs / seconds),
            "server_cpu_us_per_job": round(cpu / jobs * 1e6, 1),
            "endpoint_cpu_us_per_job": round(target_cpu / jobs * 1e6, 1),
            "seconds": round(seconds, 2)}


def push(quick: bool, rota_server: Callable[..., Any],
         server_process: Callable[[Any], psutil.Process], reference: Callable[[], Any],
         ratio: Callable[[float | None, float | None], float | None]) -> dict[str, Any]:
    """bench/compare.py's ``push`` scenario: the drain to the fast endpoint and to the
    rig, beside huey's end-to-end run at concurrency 50."""
    jobs = 2_000 if quick else 10_000
    rota: dict[str, Any] = {"jobs": jobs, "max_in_flight": IN_FLIGHT}
    for kind in ("fast", "rig"):
        rota[f"{kind}_endpoint"] = _run(jobs, kind, rota_server, server_process)
        print(f"  {kind} endpoint: {rota[f'{kind}_endpoint']}")
    ref = reference()
    huey = ref.huey_e2e(jobs=jobs, concurrency=IN_FLIGHT) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {
        f"push_{kind}_vs_end_to_end": ratio(rota[f"{kind}_endpoint"]["deliveries_per_s"],
                                            huey and huey.get("end_to_end_per_s"))
        for kind in ("fast", "rig")}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="run the fast endpoint")
    if parser.parse_args().serve:
        asyncio.run(_serve())
