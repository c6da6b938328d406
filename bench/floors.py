"""How fast one enqueue could be: the floors under Rota's producer path, beside Rota and huey.

Run from the repository root (the reference needs ``pip install -e '.[bench]'`` and a
``redis-server`` on the PATH, as for bench/compare.py):

    .venv/bin/python bench/floors.py            # every row, about a minute
    .venv/bin/python bench/floors.py --quick

Issue 27 asks for enqueue-to-handler latency at or under huey's "with durable enqueue",
and one producer at 0.4x huey's rate with ``synchronous=FULL``. This measures what the
parts of any Python server built like Rota cost, one at a time, with the client every
row shares (Rota's sync transport, rota/client/transport.py, sending the same
``POST /jobs`` body):

- a minimal server: uvloop and httptools (the event loop and HTTP parser Rota's edge
  runs on) answering a fixed 201 once the request is parsed, nothing else;
- the same, its answer sent only after a writer thread has taken the request and handed
  it back (a ``SimpleQueue`` there and ``call_soon_threadsafe`` back, as
  rota/store/writer.py does), with no write;
- an SQLite insert and commit of one row into a WAL database, on the loop ("inline") or
  on the writer thread, with ``synchronous=NORMAL`` (Rota's ``--durability process``)
  and ``FULL`` (its default: an fsync a commit);
- ``rota serve`` itself with each durability, no worker;
- huey's enqueue call on a local redis (``reference.huey_latency``'s and
  ``huey_single_producer``'s figures: its consumer runs the tasks).

Each row gets the two shapes the issue measures: calls paced at 100 a second (each
after a busy wait, as bench/compare.py's latency run) and calls back to back for a few
seconds. The figures say what a design can reach before any of Rota's own work is
added, so that a target out of every design's reach is seen as such.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import compare  # noqa: E402
import throughput as tp  # noqa: E402

from rota.client.transport import Transport  # noqa: E402

BODY = json.dumps({"spec": tp.SPEC_NAME, "args": {}}).encode()
ANSWER = b'{"job":{"id":"x"}}'
RESPONSE = (b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: %d"
            b"\r\n\r\n%s" % (len(ANSWER), ANSWER))
# (mode, write): where the answer waits, and what is written first
MINIMAL = [("inline", "none"), ("thread", "none"), ("inline", "NORMAL"), ("thread", "NORMAL"),
           ("inline", "FULL"), ("thread", "FULL")]


# -- the minimal server (run as a child: ``floors.py --serve PORT MODE WRITE DB``) ----------
def serve(port: int, mode: str, write: str, db: str) -> None:
    import httptools
    import uvloop

    conn = None
    if write != "none":
        conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {write}")
        conn.execute("CREATE TABLE IF NOT EXISTS jobs (id INTEGER PRIMARY KEY, args TEXT,"
                     " state TEXT)")
        conn.execute("CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state)")

    def work(body: bytes) -> None:
        if conn is not None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO jobs (args, state) VALUES (?, 'available')", (body,))
            conn.execute("COMMIT")

    inbox: queue.SimpleQueue[tuple[bytes, asyncio.Future[None]]] = queue.SimpleQueue()

    def writer(loop: asyncio.AbstractEventLoop) -> None:
        while True:
            body, future = inbox.get()
            work(body)
            loop.call_soon_threadsafe(future.set_result, None)

    class Minimal(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport: Any = transport
            self.parser = httptools.HttpRequestParser(self)
            self.body = b""

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            body, self.body = self.body, b""
            if mode == "inline":
                work(body)
                self.transport.write(RESPONSE)
                return
            future = asyncio.get_running_loop().create_future()
            future.add_done_callback(lambda _: self.transport.write(RESPONSE))
            inbox.put((body, future))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        threading.Thread(target=writer, args=(loop,), daemon=True).start()
        server = await loop.create_server(Minimal, "127.0.0.1", port)
        print("ready", flush=True)
        await server.serve_forever()

    uvloop.run(main())


@contextlib.contextmanager
def minimal_server(mode: str, write: str) -> Iterator[str]:
    workdir = Path(tempfile.mkdtemp(prefix="rota-floors-"))
    port = tp.free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), mode, write,
                             str(workdir / "floor.db")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def rota_server(durability: str) -> Iterator[str]:
    workdir = Path(tempfile.mkdtemp(prefix="rota-floors-"))
    children = tp.Children()
    try:
        setup = tp.prepare(workdir, 1)
        port = setup.base_url.rsplit(":", 1)[1]
        children.start("server", [sys.executable, "-m", "rota", "serve", "--port", port,
                                  "--db", str(setup.db), "--durability", durability], workdir)
        tp.wait_until("GET /healthz", lambda: tp._healthy(setup.base_url), children,
                      tp.STARTUP_TIMEOUT)
        tp.push_specs(setup)
        yield setup.base_url
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


# -- the measure --------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)


def measure(url: str, paced: int, seconds: float) -> dict[str, Any]:
    transport = Transport(url, timeout=10.0, headers={})
    try:
        status, _ = transport.request("POST", "/jobs", body=BODY)  # the connection is open
        if status != 201:
            raise RuntimeError(f"{url}: POST /jobs answered {status}")
        calls = [took for _, took, _ in compare.paced(
            paced, lambda: transport.request("POST", "/jobs", body=BODY))]
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            transport.request("POST", "/jobs", body=BODY)
            count += 1
    finally:
        transport.close()
    return {"paced_p50_ms": pct(calls, 0.5), "paced_p99_ms": pct(calls, 0.99),
            "back_to_back_per_s": round(count / elapsed)}


def huey(paced: int, seconds: float) -> dict[str, Any] | None:
    ref = compare.reference()  # (None, said why, when huey or redis-server is missing)
    if ref is None:
        return None
    latency = ref.huey_latency(n=paced, rate=100)
    single = ref.huey_single_producer(n=int(4000 * seconds / 3))
    return {"system": latency["system"], "paced_p50_ms": latency["enqueue_call_p50_ms"],
            "handler_start_p50_ms": latency["p50_ms"],
            "back_to_back_per_s": single["jobs_per_s"]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        serve(int(argv[1]), argv[2], argv[3], argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls: for CI")
    parser.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    opts = parser.parse_args(argv)
    paced, seconds = (100, 1.0) if opts.quick else (500, 3.0)
    rows: dict[str, Any] = {}
    for mode, write in MINIMAL:
        name = f"minimal, answer {'on the loop' if mode == 'inline' else 'via a writer thread'}" + (
            "" if write == "none" else f", an SQLite commit ({write})")
        with minimal_server(mode, write) as url:
            rows[name] = measure(url, paced, seconds)
        print(f"  {name}: {rows[name]}", flush=True)
    for durability in ("process", "full"):
        name = f"rota serve --durability {durability}, no worker"
        with rota_server(durability) as url:
            rows[name] = measure(url, paced, seconds)
        print(f"  {name}: {rows[name]}", flush=True)
    reference = huey(paced, seconds)
    if reference is not None:
        print(f"  {reference['system']}, enqueue call: {reference}")
    figures = {"scenario": "floors", "quick": opts.quick,
               "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "rows": rows, "reference": reference}
    out = Path(opts.results) / f"floors{'-quick' if opts.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
