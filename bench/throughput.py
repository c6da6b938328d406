"""End-to-end throughput and pickup latency of Rota, measured with real processes.

Run from the repository root:

    .venv/bin/python bench/throughput.py --jobs 10000
    .venv/bin/python bench/throughput.py --jobs 10000 --mode backlog
    .venv/bin/python bench/throughput.py --jobs 10000 --client raw

What happens: a temp dir gets a SQLite db, a specs dir holding one no-op spec and a
small worker module. ``rota serve`` starts as a subprocess on a free loopback port,
the spec dir is pushed, and ``--workers`` ``rota worker`` subprocesses connect. Jobs
are then enqueued over HTTP by ``--producers`` concurrent loops, each on its own
keep-alive connection, through httpx (default) or, with ``--client raw``, a minimal
stdlib HTTP/1.1 client (httpx's CPU cost per request can cap the enqueue rate on a
small machine before the server does). In ``stream`` mode the workers run while jobs
go in; in ``backlog`` mode every job is enqueued first and the workers start
afterwards.

Figures: the enqueue rate (acknowledged POST /jobs per second), the end-to-end
throughput (jobs / time from the first enqueue to the last job finished), the drain
throughput (jobs / time from the first reservation to the last job finished), and,
read from the ``jobs`` table after the run, the pickup latency (reserved_at -
enqueued_at) and the enqueue->finished latency. Every job must end ``completed``.

A summary is printed and the figures are written as JSON to
``bench/results/throughput-<mode>.json`` (``throughput-<mode>-raw.json`` with
``--client raw``, ``-batchN`` with ``--batch N``), with the CPU seconds each process used. Server and worker output
goes to log files in the temp dir; warnings and errors found there are printed and
kept in the JSON. ``--keep`` leaves the temp dir in place for a closer look.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime as dt
import importlib.metadata
import itertools
import os
import platform
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
import msgspec

from rota.client.client import Client
from rota.base.specs import load_dir

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SPEC_NAME = "noop"
NOOP_SPEC = f'name = "{SPEC_NAME}"\nversion = "1"\nqueue = "default"\n'
WORKER_MODULE = "bench_worker"
WORKER_SOURCE = '''"""Written by bench/throughput.py: a rota.Worker whose one handler does nothing."""

from rota import JobContext, Worker

worker = Worker(specs_dir={specs_dir!r}, concurrency={concurrency})


@worker.handler({spec!r})
async def noop(ctx: JobContext) -> None:
    return None
'''
POLL_INTERVAL = 0.05
STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
LOG_PROBLEM = re.compile(r"WARNING|ERROR|CRITICAL|Traceback|Exception", re.IGNORECASE)
MAX_LOG_LINES = 40


class BenchError(RuntimeError):
    """The benchmark could not run as planned (a process died, a deadline passed)."""


# -- options ---------------------------------------------------------------------------
class Options(msgspec.Struct, kw_only=True):
    jobs: int
    workers: int
    concurrency: int
    producers: int
    mode: str
    client: str
    timeout: float
    batch: int
    keep: bool
    output: str | None
    log_level: str = "info"
    profile: str | None = None


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs to enqueue (default 10000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--concurrency", type=int, default=50,
                        help="concurrency of each worker (default 50)")
    parser.add_argument("--producers", type=int, default=32,
                        help="concurrent POST /jobs requests, one connection each"
                             " (default 32)")
    parser.add_argument("--mode", choices=["stream", "backlog"], default="stream",
                        help="stream: workers run while enqueueing; backlog: enqueue all, then"
                             " start workers (default stream)")
    parser.add_argument("--client", choices=["httpx", "raw"], default="httpx",
                        help="producer HTTP client: httpx.AsyncClient, or a minimal stdlib"
                             " HTTP/1.1 client that costs far less CPU (default httpx)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for all jobs to finish (default 300)")
    parser.add_argument("--batch", type=int, default=1,
                        help="jobs per request: above 1, producers POST /jobs/batch (httpx"
                             " client only; default 1)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (db and logs)")
    parser.add_argument("--log-level", default="info",
                        help="the server's log level (default info, as `rota serve` runs)")
    parser.add_argument("--profile", metavar="FILE",
                        help="record the server with py-spy into FILE (speedscope JSON)")
    parser.add_argument("--output", help="JSON file to write (default"
                                         " bench/results/throughput-<mode>.json)")
    ns = parser.parse_args(argv)
    for name in ("jobs", "workers", "concurrency", "producers", "batch"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if ns.batch > 1 and ns.client != "httpx":
        parser.error("--batch works with --client httpx")
    return Options(**vars(ns))


# -- subprocesses ------------------------------------------------------------------------
@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: TextIO


@dataclass
class Children:
    """Every subprocess the benchmark started; ``stop_all`` ends workers, then the server."""

    items: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], cwd: Path) -> Child:
        log_path = cwd / f"{name}.log"
        log_file = log_path.open("w")
        # A session of its own: Ctrl-C reaches only this script, which then stops the
        # children in order (workers first, so their last results still commit).
        proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        child = Child(name, proc, log_path, log_file)
        self.items.append(child)
        return child

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each live child has used so far; Linux only."""
        ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        used: dict[str, float] = {}
        for child in self.items:
            try:
                fields = Path(f"/proc/{child.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            used[child.name] = round((int(fields[11]) + int(fields[12])) / ticks, 2)
        return used

    def check_alive(self) -> None:
        for child in self.items:
            code = child.proc.poll()
            if code is not None:
                raise BenchError(f"{child.name} exited with code {code}; see {child.log_path}:\n"
                                 + tail(child.log_path))

    def stop_all(self) -> None:
        for child in self.items:
            if child.name == "py-spy" and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                child.proc.wait(timeout=60)
        workers = [c for c in self.items if c.name not in ("server", "py-spy")]
        server = [c for c in self.items if c.name == "server"]
        try:
            _stop(workers)
            _stop(server)
        except KeyboardInterrupt:  # a second Ctrl-C: no more patience
            for child in self.items:
                _kill(child)
        finally:
            for child in self.items:
                child.log_file.close()


def _stop(children: list[Child]) -> None:
    for child in children:
        if child.proc.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"  {child.name} ignored SIGTERM for {STOP_TIMEOUT}s; killing it", file=sys.stderr)
            _kill(child)


def _kill(child: Child) -> None:
    if child.proc.poll() is None:
        child.proc.kill()
        child.proc.wait()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(what: str, check: Callable[[], bool], children: Children, timeout: float) -> None:
    """Poll ``check`` until it holds; fail if a child dies or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        children.check_alive()
        if check():
            return
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL_INTERVAL)


# -- setup -------------------------------------------------------------------------------
@dataclass
class Setup:
    workdir: Path
    db: Path
    specs_dir: Path
    base_url: str


def prepare(workdir: Path, concurrency: int) -> Setup:
    specs_dir = workdir / "specs"
    specs_dir.mkdir()
    limits = f"[limits]\nkey_concurrency = {KEY_LIMIT}\n" if KEYS else ""
    (specs_dir / f"{SPEC_NAME}.toml").write_text(NOOP_SPEC + limits)
    source = WORKER_SOURCE.format(specs_dir=str(specs_dir), concurrency=concurrency,
                                  spec=SPEC_NAME)
    (workdir / f"{WORKER_MODULE}.py").write_text(source)
    return Setup(workdir, workdir / "rota.db", specs_dir, f"http://127.0.0.1:{free_port()}")


def start_server(setup: Setup, children: Children, log_level: str = "info",
                 profile: str | None = None) -> None:
    port = setup.base_url.rsplit(":", 1)[1]
    server = children.start("server", [sys.executable, "-m", "rota", "serve", "--port", port,
                                       "--db", str(setup.db), "--log-level", log_level],
                            setup.workdir)
    wait_until("GET /healthz", lambda: _healthy(setup.base_url), children, STARTUP_TIMEOUT)
    if profile:
        py_spy = Path(sys.executable).with_name("py-spy")
        children.start("py-spy", [str(py_spy), "record", "--format", "speedscope", "-o",
                                  str(Path(profile).resolve()), "--pid", str(server.proc.pid),
                                  "--rate", "200"], setup.workdir)


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


def push_specs(setup: Setup) -> None:
    with Client(setup.base_url) as client:
        report = client.push_specs(load_dir(setup.specs_dir))
    changes = {item["name"]: item["change"] for item in report["specs"]}
    if changes.get(SPEC_NAME) not in ("new", "unchanged"):
        raise BenchError(f"unexpected push report: {report}")


def start_workers(setup: Setup, count: int, children: Children) -> float:
    """Start the worker processes; return when all are registered (wall clock of start)."""
    started = time.time()
    for i in range(count):
        children.start(f"worker-{i}", [sys.executable, "-m", "rota", "worker",
                                       f"{WORKER_MODULE}:worker", "--url", setup.base_url,
                                       "--log-level", "warning"], setup.workdir)
    wait_until(f"{count} registered worker(s)", lambda: _ready_workers(setup.base_url) >= count,
               children, STARTUP_TIMEOUT)
    return started


def _ready_workers(base_url: str) -> int:
    with Client(base_url) as client:
        workers = client.workers()["workers"]
    return sum(1 for w in workers if SPEC_NAME in w["specs_matching"])


# -- enqueueing --------------------------------------------------------------------------
class EnqueueStats(msgspec.Struct, kw_only=True):
    first_sent: float  # wall clock
    last_acked: float
    acked: dict[str, float]  # job id -> wall clock of the acknowledgement
    request_latencies: list[float]
    failures: list[str]


Post = Callable[[int], Awaitable[tuple[int, bytes]]]  # n jobs -> (status, body)


async def enqueue_all(base_url: str, jobs: int, producers: int, client: str,
                      batch: int = 1) -> EnqueueStats:
    """POST ``jobs`` jobs from ``producers`` concurrent loops, each on its own connection,
    ``batch`` jobs per request (POST /jobs/batch when above 1)."""
    counter = itertools.count(0, batch)
    acked: dict[str, float] = {}
    latencies: list[float] = []
    failures: list[str] = []

    def record(status: int, content: bytes, sent: float, now: float) -> None:
        if batch == 1:
            if status != 201:
                failures.append(f"HTTP {status}: {content[:200]!r}")
                return
            acked[msgspec.json.decode(content)["job"]["id"]] = now
            latencies.append(now - sent)
            return
        for item in msgspec.json.decode(content)["results"]:
            if item["status"] != 201:
                failures.append(f"job {item['index']}: {item.get('error')}")
                continue
            acked[item["job"]["id"]] = now
            latencies.append(now - sent)

    async def produce(post: Post) -> None:
        while (start := next(counter)) < jobs:
            sent = time.time()
            try:
                status, content = await post(min(batch, jobs - start))
            except (httpx.HTTPError, OSError, ValueError) as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            record(status, content, sent, time.time())

    async with contextlib.AsyncExitStack() as stack:
        # Clients are built before the clock starts: an httpx.AsyncClient takes tens of
        # milliseconds to create (its SSL context), which is no part of enqueueing.
        posts = [await stack.enter_async_context(_connection(client, base_url))
                 for _ in range(producers)]
        first_sent = time.time()
        await asyncio.gather(*(produce(post) for post in posts))
    last = max(acked.values(), default=first_sent)
    return EnqueueStats(first_sent=first_sent, last_acked=last, acked=acked,
                        request_latencies=latencies, failures=failures)


ENQUEUE_BODY = msgspec.json.encode({"spec": SPEC_NAME, "args": {}})
# Concurrency keys the jobs take turns over, with KEY_LIMIT each in the spec's [limits]
# (bench/compare.py e2e_keyed: what per-key limits cost); 0: no keys, no limits.
KEYS = 0
KEY_LIMIT = 3
_turn = itertools.count()


def batch_body(n: int) -> bytes:
    """A POST /jobs/batch body of ``n`` no-op jobs (each with the next key, with KEYS)."""
    if not KEYS:
        return b'{"jobs":[' + b",".join([ENQUEUE_BODY] * n) + b"]}"
    jobs = [msgspec.json.encode({"spec": SPEC_NAME, "args": {},
                                 "concurrency_key": f"k{next(_turn) % KEYS}"}) for _ in range(n)]
    return b'{"jobs":[' + b",".join(jobs) + b"]}"


@contextlib.asynccontextmanager
async def _connection(client: str, base_url: str) -> AsyncIterator[Post]:
    """One keep-alive connection that POSTs the no-op job: through httpx, or hand-written."""
    if client == "raw":
        async with RawPoster(base_url) as raw:
            yield raw.post
        return
    # One AsyncClient per producer: a single shared pool of 32 connections spends far
    # more CPU in httpx/httpcore's pool bookkeeping than the server spends per request.
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=60.0) as http:

        async def post(n: int) -> tuple[int, bytes]:
            if n == 1:
                response = await http.post("/jobs", content=ENQUEUE_BODY,
                                           headers={"content-type": "application/json"})
            else:
                body = batch_body(n)
                response = await http.post("/jobs/batch", content=body,
                                           headers={"content-type": "application/json"})
            return response.status_code, response.content

        yield post


class RawPoster:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams (stdlib only).

    It exists to show what the server can take when the producer costs next to
    nothing: httpx spends a few CPU milliseconds per request, which on a small machine
    caps the enqueue rate below what Rota accepts.
    """

    def __init__(self, base_url: str) -> None:
        host, _, port = base_url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self.request = (f"POST /jobs HTTP/1.1\r\nhost: {host}:{port}\r\n"
                        f"content-type: application/json\r\ncontent-length: {len(ENQUEUE_BODY)}"
                        "\r\n\r\n").encode() + ENQUEUE_BODY
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> RawPoster:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()

    async def post(self, n: int = 1) -> tuple[int, bytes]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(":", 1) for line in header_lines if ":" in line)
        lengths = [v for k, v in headers.items() if k.strip().lower() == "content-length"]
        if not lengths:
            raise ValueError(f"no content-length in reply: {status_line}")
        body = await self.reader.readexactly(int(lengths[0]))
        return int(status_line.split()[1]), body


# -- completion and the database ------------------------------------------------------------
def read_only(db: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)
    conn.execute("PRAGMA query_only = ON")
    return conn


# Jobs whose id starts with this were in the store before the run (bench/compare.py
# growth puts them there) and are not the run's: never counted.
KEPT_PREFIX = "kept-"


def wait_for_completion(db: Path, expected: int, timeout: float, children: Children,
                        base_url: str | None = None) -> float | None:
    """Poll until ``expected`` jobs are terminal; the wall clock then, None on timeout.
    With ``base_url``, ask the server (GET /healthz: no live job left, read from its memory)
    rather than counting rows, which costs the machine more as the store grows."""
    if base_url is not None:
        return _wait_until_idle(base_url, timeout, children)
    conn = read_only(db)
    deadline = time.monotonic() + timeout
    next_report = time.monotonic() + 5.0
    try:
        while True:
            children.check_alive()
            done = conn.execute(
                "SELECT count(*) FROM jobs WHERE state IN ('completed', 'failed')"
                f" AND id NOT LIKE '{KEPT_PREFIX}%'").fetchone()[0]
            if done >= expected:
                return time.time()
            if time.monotonic() > deadline:
                print(f"  timeout: {done}/{expected} jobs finished after {timeout}s", file=sys.stderr)
                return None
            if time.monotonic() > next_report:
                print(f"  ... {done}/{expected} finished", file=sys.stderr)
                next_report += 5.0
            time.sleep(POLL_INTERVAL)
    finally:
        conn.close()


class JobRow(msgspec.Struct, array_like=True):
    id: str
    state: str
    attempt: int
    worker_id: str | None
    enqueued_at: float
    reserved_at: float | None
    finished_at: float | None


def _wait_until_idle(base_url: str, timeout: float, children: Children) -> float | None:
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url, timeout=10) as http:
        while True:
            children.check_alive()
            if http.get("/healthz").json()["live_jobs"] == 0:
                return time.time()
            if time.monotonic() > deadline:
                print(f"  timeout: jobs still live after {timeout}s", file=sys.stderr)
                return None
            time.sleep(POLL_INTERVAL)


def load_jobs(db: Path) -> list[JobRow]:
    conn = read_only(db)
    try:
        rows = conn.execute("SELECT id, state, attempt, worker_id, enqueued_at, reserved_at,"
                            f" finished_at FROM jobs WHERE id NOT LIKE '{KEPT_PREFIX}%'"
                            " ORDER BY rowid").fetchall()
    finally:
        conn.close()
    return [JobRow(*row) for row in rows]


# -- figures -----------------------------------------------------------------------------
class Distribution(msgspec.Struct, kw_only=True):
    """Milliseconds; ``count`` values went in."""

    count: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None


def distribution(seconds: list[float]) -> Distribution:
    if not seconds:
        return Distribution(count=0, mean_ms=None, p50_ms=None, p90_ms=None, p99_ms=None,
                            max_ms=None)
    ordered = sorted(seconds)

    def pct(q: float) -> float:  # nearest rank
        rank = max(1, -(-len(ordered) * q // 100))
        return round(ordered[int(rank) - 1] * 1000, 3)

    return Distribution(count=len(ordered), mean_ms=round(sum(ordered) / len(ordered) * 1000, 3),
                        p50_ms=pct(50), p90_ms=pct(90), p99_ms=pct(99),
                        max_ms=round(ordered[-1] * 1000, 3))


def rate(count: int, seconds: float | None) -> float | None:
    return round(count / seconds, 1) if seconds and seconds > 0 else None


class Figures(msgspec.Struct, kw_only=True):
    jobs_requested: int
    jobs_acknowledged: int
    enqueue_failures: int
    enqueue_seconds: float
    enqueue_rate_per_s: float | None
    enqueue_request_latency: Distribution
    jobs_in_db: int
    states: dict[str, int]
    jobs_not_completed: int
    acknowledged_but_missing_from_db: int
    jobs_with_more_than_one_attempt: int
    all_completed: bool
    end_to_end_seconds: float | None
    end_to_end_throughput_per_s: float | None
    drain_seconds: float | None
    drain_throughput_per_s: float | None
    # The drain in two phases: while the producers were still enqueueing (first enqueue to
    # last ack), and after (last ack to last finish). A server that gives its time to the
    # enqueues drains slowly in the first (docs/performance.md, issue 27's eighth stop).
    drain_while_enqueueing_per_s: float | None = None
    drain_after_enqueueing_per_s: float | None = None
    completion_seen_by_poll_seconds: float | None
    pickup_latency: Distribution
    enqueue_to_finished_latency: Distribution
    ack_to_finished_latency: Distribution
    longest_gap_between_finishes_ms: float | None
    jobs_per_worker: list[int]
    workers_started_after_enqueue_s: float | None
    cpu_seconds: dict[str, float] = {}


def compute_figures(opts: Options, stats: EnqueueStats, rows: list[JobRow],
                    done_at: float | None, workers_started: float) -> Figures:
    states = Counter(row.state for row in rows)
    finished = sorted(r.finished_at for r in rows if r.finished_at is not None)
    reserved = [r.reserved_at for r in rows if r.reserved_at is not None]
    last_finish = finished[-1] if finished else None
    first_reserved = min(reserved) if reserved else None
    in_db = {row.id for row in rows}
    enqueue_seconds = stats.last_acked - stats.first_sent
    e2e = last_finish - stats.first_sent if last_finish else None
    drain = last_finish - first_reserved if last_finish and first_reserved else None
    gaps = [b - a for a, b in itertools.pairwise(finished)]
    acked = len(stats.acked)
    early = bisect.bisect_right(finished, stats.last_acked)  # finished before the last ack
    return Figures(
        jobs_requested=opts.jobs,
        jobs_acknowledged=acked,
        enqueue_failures=len(stats.failures),
        enqueue_seconds=round(enqueue_seconds, 4),
        enqueue_rate_per_s=rate(acked, enqueue_seconds),
        enqueue_request_latency=distribution(stats.request_latencies),
        jobs_in_db=len(rows),
        states=dict(states),
        jobs_not_completed=len(rows) - states.get("completed", 0),
        acknowledged_but_missing_from_db=len(set(stats.acked) - in_db),
        jobs_with_more_than_one_attempt=sum(1 for r in rows if r.attempt > 1),
        all_completed=bool(rows) and states.get("completed", 0) == len(rows) == acked,
        end_to_end_seconds=round(e2e, 4) if e2e else None,
        end_to_end_throughput_per_s=rate(len(finished), e2e),
        drain_seconds=round(drain, 4) if drain else None,
        drain_throughput_per_s=rate(len(finished), drain),
        drain_while_enqueueing_per_s=rate(early, enqueue_seconds),
        drain_after_enqueueing_per_s=(rate(len(finished) - early, last_finish - stats.last_acked)
                                      if last_finish else None),
        completion_seen_by_poll_seconds=round(done_at - stats.first_sent, 4) if done_at else None,
        pickup_latency=distribution([r.reserved_at - r.enqueued_at for r in rows
                                     if r.reserved_at is not None]),
        enqueue_to_finished_latency=distribution([r.finished_at - r.enqueued_at for r in rows
                                                  if r.finished_at is not None]),
        ack_to_finished_latency=distribution([r.finished_at - stats.acked[r.id] for r in rows
                                              if r.finished_at is not None and r.id in stats.acked]),
        longest_gap_between_finishes_ms=round(max(gaps) * 1000, 3) if gaps else None,
        jobs_per_worker=sorted(Counter(r.worker_id for r in rows if r.worker_id).values(),
                               reverse=True),
        workers_started_after_enqueue_s=(round(workers_started - stats.first_sent, 4)
                                         if opts.mode == "backlog" else None),
    )


# -- the run -------------------------------------------------------------------------------
def run(opts: Options, workdir: Path, children: Children) -> Figures:
    cpu_start = time.process_time()
    setup = prepare(workdir, opts.concurrency)
    print(f"temp dir {workdir}; server {setup.base_url}; mode {opts.mode}")
    start_server(setup, children, opts.log_level, opts.profile)
    push_specs(setup)
    workers_started = 0.0
    if opts.mode == "stream":
        workers_started = start_workers(setup, opts.workers, children)
        print(f"{opts.workers} worker(s) registered; enqueueing {opts.jobs} jobs"
              f" with {opts.producers} producers")
    stats = asyncio.run(enqueue_all(setup.base_url, opts.jobs, opts.producers,
                                     opts.client, opts.batch))
    print(f"enqueued {len(stats.acked)} jobs in {stats.last_acked - stats.first_sent:.2f}s"
          f" ({len(stats.failures)} failures)")
    if opts.mode == "backlog":
        workers_started = start_workers(setup, opts.workers, children)
        print(f"{opts.workers} worker(s) registered; draining the backlog")
    done_at = wait_for_completion(setup.db, len(stats.acked), opts.timeout, children,
                                  setup.base_url)
    for failure in stats.failures[:5]:
        print(f"  enqueue failure: {failure}", file=sys.stderr)
    figures = compute_figures(opts, stats, load_jobs(setup.db), done_at, workers_started)
    figures.cpu_seconds = {"bench": round(time.process_time() - cpu_start, 2),
                           **children.cpu_seconds()}
    return figures


def scan_logs(workdir: Path) -> dict[str, list[str]]:
    """Lines that look like warnings or errors in each child's log, at most a few each."""
    found: dict[str, list[str]] = {}
    for path in sorted(workdir.glob("*.log")):
        lines = [line for line in path.read_text(errors="replace").splitlines()
                 if LOG_PROBLEM.search(line)]
        if lines:
            found[path.stem] = lines[:MAX_LOG_LINES] + (
                [f"... {len(lines) - MAX_LOG_LINES} more"] if len(lines) > MAX_LOG_LINES else [])
    return found


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "sqlite": sqlite3.sqlite_version,
        "rota": importlib.metadata.version("rota"),
        "httpx": importlib.metadata.version("httpx"),
        "msgspec": importlib.metadata.version("msgspec"),
    }


def _dist_line(label: str, d: Distribution) -> str:
    if not d.count:
        return f"  {label:<28} (no data)"
    return (f"  {label:<28} p50 {d.p50_ms:9.1f}  p90 {d.p90_ms:9.1f}  p99 {d.p99_ms:9.1f}"
            f"  max {d.max_ms:9.1f}  ms  (n={d.count})")


def print_summary(opts: Options, f: Figures, problems: dict[str, list[str]]) -> None:
    print(f"\nRota throughput, mode={opts.mode}: {opts.jobs} jobs, {opts.workers} worker(s)"
          f" x concurrency {opts.concurrency}, {opts.producers} producers ({opts.client}),"
          f" {os.cpu_count()} CPU(s)")
    print(f"  enqueue rate                 {f.enqueue_rate_per_s} jobs/s"
          f" ({f.jobs_acknowledged} acknowledged in {f.enqueue_seconds:.2f}s,"
          f" {f.enqueue_failures} failures)")
    print(f"  end-to-end throughput        {f.end_to_end_throughput_per_s} jobs/s"
          f" (first enqueue -> last finish {f.end_to_end_seconds}s)")
    print(f"  drain throughput             {f.drain_throughput_per_s} jobs/s"
          f" (first reservation -> last finish {f.drain_seconds}s)")
    print(f"  drain while / after enqueue  {f.drain_while_enqueueing_per_s} /"
          f" {f.drain_after_enqueueing_per_s} jobs/s")
    if f.workers_started_after_enqueue_s is not None:
        print(f"  workers started at           +{f.workers_started_after_enqueue_s}s")
    print(_dist_line("enqueue request (client)", f.enqueue_request_latency))
    print(_dist_line("pickup (reserved-enqueued)", f.pickup_latency))
    print(_dist_line("enqueued -> finished", f.enqueue_to_finished_latency))
    print(_dist_line("acked -> finished", f.ack_to_finished_latency))
    print(f"  longest gap between finishes {f.longest_gap_between_finishes_ms} ms")
    print(f"  jobs per worker              {f.jobs_per_worker}")
    print(f"  CPU seconds used             {f.cpu_seconds}")
    print(f"  states {f.states}; not completed {f.jobs_not_completed};"
          f" missing from db {f.acknowledged_but_missing_from_db};"
          f" >1 attempt {f.jobs_with_more_than_one_attempt}")
    print(f"  ALL COMPLETED: {'yes' if f.all_completed else 'NO'}")
    for name, lines in problems.items():
        print(f"  {name}.log warnings/errors:")
        for line in lines:
            print(f"    {line}")
    if not problems:
        print("  server/worker logs: no warnings or errors")


def write_results(opts: Options, figures: Figures, problems: dict[str, list[str]]) -> Path:
    suffix = "" if opts.client == "httpx" else f"-{opts.client}"
    suffix += f"-batch{opts.batch}" if opts.batch > 1 else ""
    default = RESULTS_DIR / f"throughput-{opts.mode}{suffix}.json"
    path = Path(opts.output) if opts.output else default
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "rota throughput",
        "timestamp": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "parameters": msgspec.to_builtins(opts),
        "figures": msgspec.to_builtins(figures),
        "log_problems": problems,
    }
    path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2) + b"\n")
    return path


def _as_interrupt(signum: int, frame: object) -> None:
    # Re-raised as SIGINT so that asyncio.run, if running, cancels its task cleanly.
    signal.raise_signal(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    # Ctrl-C and SIGTERM both end in KeyboardInterrupt and the cleanup below, even when
    # SIGINT came in ignored (as for a background job of a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _as_interrupt)
    workdir = Path(tempfile.mkdtemp(prefix="rota-bench-"))
    children = Children()
    figures: Figures | None = None
    try:
        try:
            figures = run(opts, workdir, children)
        finally:
            children.stop_all()
        problems = scan_logs(workdir)
        print_summary(opts, figures, problems)
        print(f"\nwrote {write_results(opts, figures, problems)}")
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        for name, lines in scan_logs(workdir).items():
            print(f"{name}.log:\n  " + "\n  ".join(lines), file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted; subprocesses stopped", file=sys.stderr)
        return 130
    finally:
        if opts.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0 if figures is not None and figures.all_completed else 1


if __name__ == "__main__":
    sys.exit(main())
