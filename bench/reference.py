"""The reference system for bench/: huey on a local redis-server, run the ordinary way.

Every Rota figure in docs/performance.md stands beside one of these, measured in the
same invocation (bench/compare.py calls the functions below), because absolute figures
drift between runs and machines while ratios carry over.

redis-server runs with persistence off (``--save "" --appendonly no``), as the issue's
peers did: huey's enqueue is acknowledged from memory, Rota's after an fsynced commit.
One ``huey_consumer`` process with 10 worker threads stands for one Rota worker at
concurrency 10. Needs ``pip install -e '.[bench]'`` (huey, redis) and ``redis-server``
(Debian: ``apt-get install redis-server``).

    .venv/bin/python bench/reference.py            # every scenario, printed as JSON
    .venv/bin/python bench/reference.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import redis
from huey import RedisHuey

TASKS_MODULE = "ref_tasks"
# The consumer imports this; each task does what Rota's no-op handler does, plus the
# one redis call that lets the bench see it happen (Rota's worker reports each result too).
TASKS_SOURCE = '''"""Written by bench/reference.py: the reference's tasks."""

import itertools
import os
import time

from huey import RedisHuey

huey = RedisHuey("bench", port=int(os.environ["REF_REDIS_PORT"]), results=False)
TARGET = int(os.environ.get("REF_TARGET", "0"))
DONE = itertools.count(1)  # next() is atomic under the GIL: safe across worker threads


@huey.task()
def noop():
    # Counted in the consumer's memory, so that seeing it costs the task nothing; the
    # last one writes the moment down for the bench.
    if next(DONE) == TARGET:
        with open(os.environ["REF_DONE_FILE"], "w") as out:
            out.write(repr(time.time()))


@huey.task()
def ready():
    huey.storage.conn.set("ready", 1)


@huey.task()
def stamp(sent):
    # From just before the enqueue call to the start of the task, in ms.
    huey.storage.conn.rpush("waits", repr((time.time() - sent) * 1000))
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[int, psutil.Process]]:
    """A throwaway redis-server on a free loopback port, persistence off."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="rota-ref-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--maxclients", "20000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.02)
        yield port, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def consumer(port: int, workers: int = 10, target: int = 0) -> Iterator[Any]:
    """The tasks module, importable here, and a running huey_consumer for it; ``target``:
    after that many ``noop`` tasks the consumer writes the time to ``tasks.DONE_FILE``."""
    workdir = Path(tempfile.mkdtemp(prefix="rota-ref-"))
    os.environ["REF_TARGET"] = str(target)
    os.environ["REF_DONE_FILE"] = str(workdir / "done_at")
    (workdir / f"{TASKS_MODULE}.py").write_text(TASKS_SOURCE)
    os.environ["REF_REDIS_PORT"] = str(port)
    sys.path.insert(0, str(workdir))
    sys.modules.pop(TASKS_MODULE, None)
    import ref_tasks  # type: ignore[import-not-found]

    binary = Path(sys.executable).with_name("huey_consumer")
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    proc = subprocess.Popen([str(binary), f"{TASKS_MODULE}.huey", "-w", str(workers), "-k",
                             "thread", "-q"], cwd=workdir, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Ready when a task goes through.
        conn = ref_tasks.huey.storage.conn
        ref_tasks.ready()
        deadline = time.monotonic() + 20
        while not conn.get("ready"):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("huey_consumer did not start")
            time.sleep(0.01)
        ref_tasks.DONE_FILE = workdir / "done_at"
        yield ref_tasks
    finally:
        proc.terminate()
        proc.wait(10)
        sys.path.remove(str(workdir))
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_list(conn: redis.Redis, key: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (have := conn.llen(key)) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{have} of {count} tasks after {timeout}s")
        time.sleep(0.001)


def _wait_file(path: Path, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the consumer did not finish within {timeout}s")
        time.sleep(0.005)
    return float(path.read_text())


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


# -- scenarios ---------------------------------------------------------------------------
def huey_e2e(jobs: int = 10_000, concurrency: int = 10) -> dict[str, Any]:
    """``jobs`` no-op tasks enqueued one call each while the consumer runs."""
    with redis_server() as (port, _), consumer(port, concurrency, target=jobs) as tasks:
        first = time.time()
        for _ in range(jobs):
            tasks.noop()
        enqueued = time.time()
        last = _wait_file(tasks.DONE_FILE, 300)
    return {"system": "huey " + _version("huey") + " (redis, persistence off)", "jobs": jobs,
            "enqueue_per_s": round(jobs / (enqueued - first)),
            "end_to_end_per_s": round(jobs / (last - first))}


def huey_latency(n: int = 500, rate: float = 100.0) -> dict[str, Any]:
    """One task at a time at ``rate`` a second: enqueue call to task start."""
    with redis_server() as (port, _), consumer(port) as tasks:
        conn = tasks.huey.storage.conn
        calls = []
        due = time.monotonic()
        for _ in range(n):
            due += 1.0 / rate
            while time.monotonic() < due:  # busy wait, as bench/compare.py does
                pass
            sent = time.time()
            tasks.stamp(sent)
            calls.append((time.time() - sent) * 1000)
        _wait_list(conn, "waits", n, 60)
        waits = [float(w) for w in conn.lrange("waits", 0, -1)]
    return {"system": "huey " + _version("huey"), "jobs": n, "p50_ms": pct(waits, 0.5),
            "p99_ms": pct(waits, 0.99), "enqueue_call_p50_ms": pct(calls, 0.5)}


def huey_single_producer(n: int = 5000) -> dict[str, Any]:
    """One producer, one enqueue call at a time, the consumer running the tasks."""
    with redis_server() as (port, _), consumer(port) as tasks:
        start = time.perf_counter()
        for _ in range(n):
            tasks.noop()
        elapsed = time.perf_counter() - start
    return {"system": "huey " + _version("huey"), "jobs": n, "jobs_per_s": round(n / elapsed)}


def huey_concurrent_producers(n: int = 20_000, callers: int = 100) -> dict[str, Any]:
    """``callers`` threads enqueueing at once (huey has no asyncio client); no consumer,
    so only the enqueue path is measured, as for Rota's AsyncClient."""
    with redis_server() as (port, _):
        huey = RedisHuey("bench", port=port, results=False, max_connections=callers + 10)

        @huey.task()
        def noop() -> None:
            return None

        per = n // callers
        barrier = threading.Barrier(callers + 1)

        def produce() -> None:
            barrier.wait()
            for _ in range(per):
                noop()

        threads = [threading.Thread(target=produce) for _ in range(callers)]
        for thread in threads:
            thread.start()
        barrier.wait()
        start = time.perf_counter()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    return {"system": "huey " + _version("huey") + f", {callers} threads", "jobs": per * callers,
            "jobs_per_s": round(per * callers / elapsed)}


def huey_soak(seconds: float = 120.0, workers: int = 50) -> dict[str, Any]:
    """Tasks streaming through for ``seconds`` (a producer keeps ~5,000 waiting, as Rota's
    soak does); the consumer's and redis-server's RSS every 5 s."""
    curve: list[tuple[float, float, float]] = []  # (elapsed s, consumer MiB, redis MiB)
    with redis_server() as (port, redis_proc), consumer(port, workers) as tasks:
        huey_proc = next(p for p in psutil.Process().children() if "huey_consumer" in
                         " ".join(p.cmdline()))
        started = time.monotonic()
        next_sample = started
        while (now := time.monotonic()) - started < seconds:
            if tasks.huey.pending_count() < 5000:
                for _ in range(1000):
                    tasks.noop()
            if now >= next_sample:
                curve.append((round(now - started, 1),
                              round(huey_proc.memory_info().rss / 2**20, 1),
                              round(redis_proc.memory_info().rss / 2**20, 1)))
                next_sample += 5.0
            else:
                time.sleep(0.02)
    warm = [c + r for elapsed, c, r in curve if elapsed >= seconds / 3]
    return {"system": "huey " + _version("huey"), "seconds": seconds, "curve": curve,
            "growth_after_warmup_mib": round(max(warm) - warm[0], 1) if warm else None}


def redis_idle(clients: int, seconds: float = 10.0) -> dict[str, Any]:
    """``clients`` idle connections that each PING once a second: redis-server's CPU, the
    nearest thing a redis-backed queue has to Rota's idle workers beating every second."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    figures: dict[str, Any] = {}
    with redis_server() as (port, proc):
        async def one(n: int, ready: list[int], stop: asyncio.Event) -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            ready.append(n)
            await asyncio.sleep(n % 1000 / 1000)
            while not stop.is_set():
                writer.write(b"*1\r\n$4\r\nPING\r\n")
                await reader.readline()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
            writer.close()

        async def main() -> None:
            ready: list[int] = []
            stop = asyncio.Event()
            tasks = [asyncio.create_task(one(n, ready, stop)) for n in range(clients)]
            while len(ready) < clients:
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.0)
            before = proc.cpu_times()
            await asyncio.sleep(seconds)
            after = proc.cpu_times()
            used = (after.user - before.user) + (after.system - before.system)
            figures["cpu_percent"] = round(100 * used / seconds, 1)
            figures["rss_mib"] = round(proc.memory_info().rss / 2**20, 1)
            stop.set()
            await asyncio.gather(*tasks)

        asyncio.run(main())
    return {"system": "redis-server " + _redis_version(), "clients": clients, **figures}


def redis_backlog(jobs: int = 1_000_000) -> dict[str, Any]:
    """``jobs`` waiting huey tasks (no consumer): redis-server's memory. Enqueued as huey
    does (one serialized message per LPUSH), pipelined 1,000 at a time for speed."""
    with redis_server() as (port, proc):
        huey = RedisHuey("bench", port=port, results=False)

        @huey.task()
        def noop(n: int) -> None:
            return None

        empty = proc.memory_info().rss
        conn = huey.storage.conn
        queue = huey.storage.queue_key
        for start in range(0, jobs, 1000):
            pipe = conn.pipeline(transaction=False)
            for _ in range(min(1000, jobs - start)):
                message = huey.serialize_task(noop.s(0))
                pipe.lpush(queue, message)
            pipe.execute()
        assert huey.pending_count() == jobs
        held = proc.memory_info().rss
    return {"system": "redis-server " + _redis_version() + " + huey", "jobs": jobs,
            "rss_mib": round(held / 2**20, 1),
            "kib_per_job": round((held - empty) / 1024 / jobs, 3)}


def _version(dist: str) -> str:
    import importlib.metadata
    return importlib.metadata.version(dist)


def _redis_version() -> str:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
    return next((part[2:] for part in out.split() if part.startswith("v=")), "?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args(argv)
    q = opts.quick
    figures = {
        "e2e": huey_e2e(2_000 if q else 10_000),
        "latency": huey_latency(100 if q else 500),
        "single_producer": huey_single_producer(1_000 if q else 5_000),
        "concurrent_producers": huey_concurrent_producers(2_000 if q else 20_000),
        "idle": [redis_idle(n, 3.0 if q else 10.0) for n in ([200] if q else [1000, 5000, 10000])],
        "backlog": redis_backlog(50_000 if q else 1_000_000),
    }
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
