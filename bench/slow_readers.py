"""The server's memory when workers stop reading their sockets (issue 12).

Run from the repository root (it uses the test extras: websockets, httpx, psutil):

    .venv/bin/python bench/slow_readers.py                   # 10 silent workers, 5,000 jobs
    .venv/bin/python bench/slow_readers.py --workers 1 --jobs 500
    .venv/bin/python bench/slow_readers.py -- --outbox-high-water 262144   # options for rota serve

A ``rota serve`` subprocess (temp dir, free port, its defaults) gets ``--workers`` raw
workers that register with concurrency 1000, keep beating every 0.2 s and never read
their sockets after the first ack (tests/helpers.py ``silent_worker``). Then ``--jobs``
jobs with 200 KB of args are enqueued (``POST /jobs``, 8 at a time), and once the
server stops assigning (its active count unchanged for 2 s: a benchmark may wait on
time, a test may not) the server's RSS is read. Figures go to
``bench/results/slow-readers-<workers>x<jobs>[-<label>].json`` and docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers import silent_worker, spawn_serve, stop_silent  # noqa: E402

from rota.base.specs import parse_spec  # noqa: E402

SPEC = 'name = "big"\nversion = "1"\nqueue = "default"\n'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / (1 << 20)


async def counts(http: httpx.AsyncClient) -> dict[str, int]:
    queues = (await http.get("/queues")).json()["queues"]
    return next((q["counts"] for q in queues if q["name"] == "default"), {})


async def main(args: argparse.Namespace) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60)
        proc = await spawn_serve(http, ["--port", str(port), "--db", f"{tmp}/rota.db",
                                        "--log-level", "warning", *args.serve],
                                 Path(tmp) / "serve.log")
        try:
            spec = parse_spec(SPEC)
            body = {"specs": [{"name": "big", "version": "1", "queue": "default"}]}
            assert (await http.put("/specs", json=body)).status_code == 200
            url = f"ws://127.0.0.1:{port}/work"
            silent = [await silent_worker(url, f"silent-{i}", [spec])
                      for i in range(args.workers)]
            start = rss_mib(proc.pid)
            job = {"spec": "big", "args": {"blob": "x" * 200_000}}
            for first in range(0, args.jobs, 8):  # 8 at a time; a batch would pass 1 MiB
                answers = await asyncio.gather(*(http.post("/jobs", json=job) for _ in
                                                 range(min(8, args.jobs - first))))
                assert all(a.status_code == 201 for a in answers), answers[0].text
            began, last, still = time.monotonic(), None, time.monotonic()
            while time.monotonic() - still < 2.0:
                now = await counts(http)
                if now != last:
                    last, still = now, time.monotonic()
                await asyncio.sleep(0.2)
            end = rss_mib(proc.pid)
            print(f"workers={args.workers} jobs={args.jobs} serve_args={args.serve}")
            print(f"  settled after {still - began:.1f}s: counts={last}")
            print(f"  server RSS: {start:.1f} MiB with the workers connected ->"
                  f" {end:.1f} MiB (+{end - start:.1f})")
            name = f"slow-readers-{args.workers}x{args.jobs}" + (
                f"-{args.label}" if args.label else "")
            (ROOT / "bench" / "results" / f"{name}.json").write_text(json.dumps({
                "workers": args.workers, "jobs": args.jobs, "serve_args": args.serve,
                "counts": last, "rss_mib_before": round(start, 1),
                "rss_mib_after": round(end, 1)}, indent=2) + "\n")
            for raw, beating in silent:
                await stop_silent(raw, beating)
        finally:
            proc.terminate()
            await proc.wait()
            await http.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--label", default="", help="added to the results file's name")
    parser.add_argument("serve", nargs="*", help="options for rota serve (after --)")
    asyncio.run(main(parser.parse_args()))
