"""Liveness under stress: what the server does to workers and jobs when a worker floods
it, when a job keeps killing its workers, when the wall clock steps, and when the server
itself freezes. Black-box, against real servers (in-process or ``rota serve``
subprocesses), real WebSocket clients and real worker processes:

1. A rate limit throttles a fast worker (the server reads its socket more slowly) and
   never cuts it off, so its jobs do not run twice.
2. A job whose attempts end in ``worker_death`` several times in a row (3 by default,
   ``[retry] max_worker_deaths`` in its spec) is quarantined: ``discarded``, its last
   error record of type ``poison``, never handed to another worker.
3. A step of the server's wall clock, forward or back, cancels no running job whose
   worker keeps beating (``rota serve`` under libfaketime, monotonic time left real).
4. A server frozen longer than the heartbeat timeout (SIGSTOP, then SIGCONT) drops no
   worker that kept sending heartbeats meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from conftest import Api, Live, RawWorker, start_server, stop_server, wait_until, write_spec
from helpers import COSTLY_POLL, clean_env, spawn_serve
from helpers import free_port
from hookrig import Receiver

TERMINAL = {"completed", "discarded", "cancelled"}
# A spec whose jobs are quarantined after two worker deaths in a row.
TWO_DEATHS = "[retry]\nmax_worker_deaths = 2\n"
# Debian's package faketime (it pulls in libfaketime) puts it in /usr/lib/<triplet>/faketime/.
LIBFAKETIME = next((path for pattern in ("/usr/lib/*/faketime/libfaketime.so.1",
                                         "/usr/lib/faketime/libfaketime.so.1",
                                         "/usr/local/lib/faketime/libfaketime.so.1")
                    for path in sorted(Path("/").glob(pattern.lstrip("/")))), None)


def running(*job_ids: str) -> dict[str, Any]:
    """A status section vouching for ``job_ids``."""
    return {"state": "running", "active_job_ids": list(job_ids)}


def completed(copy: dict[str, Any], result: Any = None) -> dict[str, Any]:
    return {"job_id": copy["id"], "attempt": copy["attempt"], "outcome": "completed",
            "result": result}


def error_types(job: dict[str, Any]) -> list[tuple[str, int]]:
    return [(e["type"], e["attempt"]) for e in job["errors"]]


def wall_clock(stamp: str) -> float:
    """An RFC 3339 ``...Z`` time from the server, as a Unix timestamp."""
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


async def never(predicate: Callable[[], Any], *, within: float, what: str) -> None:
    """A bounded negative check: ``predicate`` stays false for ``within`` seconds. (What
    it looks for, a job run or moved, stays once it happens: a coarse poll misses none.)"""
    try:
        value = await wait_until(predicate, timeout=within, what=what, step=COSTLY_POLL)
    except AssertionError:
        return
    raise AssertionError(f"{what}: {value!r}")


async def quarantined(api: Api, job_id: str, *, deaths: int, timeout: float = 5.0
                      ) -> dict[str, Any]:
    """Wait for ``job_id`` to end after ``deaths`` worker deaths; it must be poison."""
    async def settled() -> dict[str, Any] | None:
        job = await api.job(job_id)
        return job if job["state"] in TERMINAL or job["attempt"] > deaths else None

    try:
        job = await wait_until(settled, timeout=timeout, what=f"job {job_id} to be quarantined")
    except AssertionError:
        job = await api.job(job_id)
    assert job["state"] == "discarded", (
        f"after {deaths} worker deaths in a row the job is {job['state']} at attempt"
        f" {job['attempt']}, errors {error_types(job)}")
    assert job["errors"][-1]["type"] == "poison", error_types(job)
    return job


class ServeProcess(Api):
    """``rota serve`` as a subprocess, with options and environment of the test's choosing."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        # Idle connections dropped before the server's 5 s keep-alive ends them: a request
        # sent on one as the server closes it fails (ReadError), as it did under load here.
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=10,
                                      limits=httpx.Limits(keepalive_expiry=2.0))
        self.proc: asyncio.subprocess.Process | None = None
        self.log = tmp / "server.log"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/work"

    async def start(self, *options: str, env: dict[str, str] | None = None) -> None:
        args = ["--port", str(self.port), "--db", str(self.tmp / "rota.db"),
                "--log-level", "info", *options]
        self.proc = await spawn_serve(self.http, args, self.log, env)

    def signal(self, signum: int) -> None:
        assert self.proc is not None and self.proc.returncode is None
        self.proc.send_signal(signum)

    async def workers(self) -> list[str]:
        return [w["id"] for w in (await self.http.get("/workers")).json()["workers"]]

    async def close(self) -> None:
        await self.http.aclose()
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:  # a graceful stop lets libfaketime clean up after itself
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        for stale in (f"faketime_shm_{proc.pid}", f"sem.faketime_sem_{proc.pid}"):
            # left by a libfaketime process that did not exit cleanly; a later process
            # that happens to get the same pid would fail to start
            Path("/dev/shm", stale).unlink(missing_ok=True)


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[ServeProcess]:
    server = ServeProcess(tmp_path)
    try:
        yield server
    finally:
        await server.close()


class Beater:
    """A raw worker that heartbeats on its own every ``interval`` seconds, vouching for
    its jobs, while a reader keeps every frame the server sends (and how it closed)."""

    def __init__(self, worker: RawWorker, job_ids: list[str], interval: float = 0.2) -> None:
        self.worker = worker
        self.job_ids = job_ids
        self.interval = interval
        self.frames: list[dict[str, Any]] = list(worker.held)
        worker.held.clear()
        self.sent: list[tuple[int, float]] = []  # (seq, monotonic) of every heartbeat sent
        self.closed: str | None = None  # how the connection ended, if it did
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._beat()), asyncio.create_task(self._read())]

    async def stop(self) -> None:
        """Stop beating and reading; the connection stays open."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _beat(self) -> None:
        while True:
            seq = self.worker.seq
            # Small frames fit in the socket buffers even when nobody reads them; the
            # timeout only makes sure a stalled send cannot hang the test.
            await asyncio.wait_for(self.worker.beat(status=running(*self.job_ids)), 1.0)
            self.sent.append((seq, time.monotonic()))
            await asyncio.sleep(self.interval)  # noqa: sleep-ok (the worker's heartbeat cadence)

    async def _read(self) -> None:
        try:
            async for message in self.worker.ws:
                self.frames.append(json.loads(message))
        except websockets.ConnectionClosed as exc:
            self.closed = repr(exc)
        else:
            self.closed = f"closed normally ({self.worker.ws.close_code})"

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == kind]

    def acked_through(self) -> int:
        return max((a["seq"] for a in self.of_type("ack")), default=-1)

    def trouble(self) -> str | None:
        """What went wrong on this connection, if anything: an error, a cancel, a close."""
        bad = self.of_type("error") + self.of_type("cancel")
        if bad or self.closed is not None or self.worker.ws.close_code is not None:
            return (f"worker {self.worker.worker_id}: frames {bad}, connection"
                    f" {self.closed or self.worker.ws.close_code}")
        return None


# -- 1. a rate limit throttles, it never cuts a worker off --------------------------------
async def test_a_worker_over_the_rate_limit_is_slowed_down_not_cut_off(tmp_path: Path):
    live = await start_server(tmp_path, rate_limit=50.0, rate_burst=5)
    ws = None
    try:
        echo = write_spec(tmp_path / "specs", "echo")
        await live.push(echo)
        ws = await websockets.connect(live.ws)
        worker = RawWorker(ws, "eager")
        await worker.register([echo], concurrency=3)
        job_ids = [(await live.enqueue("echo", {"n": n}, id=f"job-{n}"))["id"] for n in range(3)]
        copies = {copy["id"]: copy for copy in await worker.jobs(3)}
        assert sorted(copies) == job_ids and {c["attempt"] for c in copies.values()} == {1}

        # 60 heartbeats back to back: 12 times the burst, more than a second's worth.
        beats, first = 60, worker.seq
        began = time.monotonic()
        acks: list[dict[str, Any]] = []
        cut_off: websockets.ConnectionClosed | None = None
        try:
            for _ in range(beats):
                await asyncio.wait_for(worker.beat(status=running(*job_ids)), 5)
            for _ in range(beats):
                acks.append(await worker.expect("ack", timeout=5))
        except websockets.ConnectionClosed as exc:
            cut_off = exc
            with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
                while True:  # what the server said before it closed
                    worker.held.append(json.loads(await asyncio.wait_for(ws.recv(), 1)))
        took = time.monotonic() - began
        errors = [f for f in worker.held if f["type"] == "error"]
        assert cut_off is None and not errors, (
            f"the server cut the worker off: {errors}, {cut_off!r}")
        assert [ack["seq"] for ack in acks] == list(range(first, first + beats))
        # Throttled all the same: the frames past the burst were read at about 50 a second.
        assert took >= 0.7 * (beats - 5) / 50, f"{beats} heartbeats acked in {took:.2f}s"

        await worker.beat(results=[completed(copy, copy["args"]) for copy in copies.values()])
        ack = await worker.expect("ack")
        assert sorted(ack["accepted"]) == job_ids and "rejected" not in ack
        for job_id in job_ids:
            job = await live.job(job_id)
            assert (job["state"], job["attempt"], job["errors"]) == ("completed", 1, []), job
        assert not [f for f in worker.held if f["type"] in ("error", "cancel")], worker.held
    finally:
        if ws is not None:
            await ws.close()
        await stop_server(live)


# -- 2. poison jobs ----------------------------------------------------------------------
async def take_one_and_die(connect: Callable[..., Any], worker_id: str,
                           spec: Any) -> dict[str, Any]:
    """A raw worker takes one job, then closes without a goodbye: its worker died."""
    worker = await connect(worker_id)
    await worker.register([spec], concurrency=1)
    [copy] = await worker.jobs(1)
    await worker.ws.close()
    return copy


async def test_a_job_that_kills_its_workers_in_a_row_is_quarantined(live: Live, connect,
                                                                    tmp_path: Path):
    spec = write_spec(tmp_path / "specs", "crashy", extra=TWO_DEATHS)
    await live.push(spec)
    await live.enqueue("crashy", {}, id="poison")
    for attempt, name in enumerate(["w1", "w2"], start=1):
        copy = await take_one_and_die(connect, name, spec)
        assert (copy["id"], copy["attempt"]) == ("poison", attempt)

    job = await quarantined(live, "poison", deaths=2)
    assert job["attempt"] == 2 and job["worker_id"] in (None, "w2")
    assert error_types(job)[0] == ("worker_death", 1)
    assert job["errors"][-1]["attempt"] == 2

    w3 = await connect("w3")
    await w3.register([spec], concurrency=1)
    await w3.assert_no_assign(within=0.5)
    assert (await live.job("poison"))["state"] == "discarded"


async def test_one_worker_death_then_a_completion_is_not_poison(live: Live, connect,
                                                                tmp_path: Path):
    spec = write_spec(tmp_path / "specs", "crashy", extra=TWO_DEATHS)
    await live.push(spec)
    await live.enqueue("crashy", {}, id="unlucky")
    await take_one_and_die(connect, "w1", spec)  # one death, one short of the limit

    w2 = await connect("w2")
    await w2.register([spec], concurrency=1)
    [copy] = await w2.jobs(1)
    assert (copy["id"], copy["attempt"]) == ("unlucky", 2)
    assert (await w2.complete(copy, "fine"))["accepted"] == ["unlucky"]
    job = await live.job("unlucky")
    assert (job["state"], job["attempt"], job["result"]) == ("completed", 2, "fine")
    assert error_types(job) == [("worker_death", 1)]


async def test_worker_deaths_count_only_in_a_row(live: Live, connect, tmp_path: Path):
    spec = write_spec(tmp_path / "specs", "crashy",
                      extra=TWO_DEATHS + "backoff_base = 0.05\nbackoff_max = 0.05\n")
    await live.push(spec)
    await live.enqueue("crashy", {}, id="flaky")
    await take_one_and_die(connect, "w1", spec)  # death 1

    w2 = await connect("w2")
    await w2.register([spec], concurrency=1)
    [second] = await w2.jobs(1)
    assert second["attempt"] == 2
    await w2.beat(results=[{"job_id": "flaky", "attempt": 2, "outcome": "failed",
                            "error": {"type": "ValueError", "message": "bad input"}}],
                  capacity=1)
    assert (await w2.expect("ack"))["accepted"] == ["flaky"]  # a failure: the count restarts
    [third] = await w2.jobs(1)  # after the short backoff
    assert third["attempt"] == 3
    await w2.ws.close()  # death 1 again, not 2

    w3 = await connect("w3")
    await w3.register([spec], concurrency=1)
    [fourth] = await w3.jobs(1)
    assert (fourth["id"], fourth["attempt"]) == ("flaky", 4)
    assert (await w3.complete(fourth, "at last"))["accepted"] == ["flaky"]
    job = await live.job("flaky")
    assert (job["state"], job["result"]) == ("completed", "at last")
    assert error_types(job) == [("worker_death", 1), ("ValueError", 2), ("worker_death", 3)]


CRASHING_WORKER = '''
"""Written by tests/system/test_liveness.py: every job kills the worker process."""
import os
from pathlib import Path

from rota import Worker

worker = Worker(specs_dir="specs", concurrency=1, heartbeat_interval=0.1)


@worker.handler("crashy")
async def crashy(ctx):
    Path(f"ran-{ctx.id}-{ctx.attempt}-{os.getpid()}").touch()
    os._exit(1)
'''


async def test_a_job_that_crashes_worker_processes_is_quarantined_after_three(tmp_path: Path):
    # A crashed process drops its connection without a close frame, so its job waits out
    # the reconnect grace before it counts as a worker death: keep the grace short.
    live = await start_server(tmp_path, reconnect_grace=0.3)
    procs: list[asyncio.subprocess.Process] = []
    try:
        await live.push(write_spec(tmp_path / "specs", "crashy"))  # the default limit: 3
        (tmp_path / "crashing_worker.py").write_text(CRASHING_WORKER)
        # Four processes at once: each death hands the job to the next, until it is poison.
        for n in range(4):
            with (tmp_path / f"worker-{n}.log").open("wb") as sink:
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "rota", "worker", "crashing_worker:worker",
                    "--url", live.base, cwd=tmp_path, env=clean_env(), stdout=sink,
                    stderr=sink))

        async def all_registered() -> bool:
            workers = (await live.http.get("/workers")).json()["workers"]
            return {w["pid"] for w in workers} == {p.pid for p in procs}

        await wait_until(all_registered, timeout=15, what="4 worker processes to register",
                         step=COSTLY_POLL)
        await live.enqueue("crashy", {}, id="poison")

        def dead() -> list[asyncio.subprocess.Process]:
            return [p for p in procs if p.returncode is not None]

        await wait_until(lambda: len(dead()) >= 3, timeout=10, what="3 worker processes to die")
        job = await quarantined(live, "poison", deaths=3)
        assert job["attempt"] == 3
        assert error_types(job)[:2] == [("worker_death", 1), ("worker_death", 2)]
        ran = sorted(p.name.split("-")[2] for p in tmp_path.glob("ran-poison-*"))
        assert ran == ["1", "2", "3"]

        [survivor] = [p for p in procs if p.returncode is None]
        await never(lambda: survivor.returncode is not None or list(tmp_path.glob("ran-*-4-*")),
                    within=1.0, what="the 4th worker process was given the poison job")
        assert (await live.job("poison"))["state"] == "discarded"
        survivor.send_signal(signal.SIGTERM)  # alive and well: it stops cleanly
        assert await asyncio.wait_for(survivor.wait(), 15) == 0
        assert [p.returncode for p in dead()].count(1) == 3
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await stop_server(live)


# -- 3. a wall-clock step -----------------------------------------------------------------
async def echo_worker(serve: ServeProcess, tmp_path: Path, concurrency: int = 1) -> RawWorker:
    """The echo spec pushed, and a raw worker registered for it (the caller closes it)."""
    echo = write_spec(tmp_path / "specs", "echo")
    await serve.push(echo)
    worker = RawWorker(await websockets.connect(serve.ws), "w1")
    await worker.register([echo], concurrency=concurrency)
    return worker



async def test_a_wall_clock_step_cancels_no_running_job(serve: ServeProcess, tmp_path: Path):
    if LIBFAKETIME is None:
        pytest.fail("libfaketime.so.1 is missing: apt-get install faketime")
    clock = tmp_path / "faketime.rc"  # the server's wall clock: real time plus this offset

    def set_clock(offset: str) -> None:  # atomically: the server reads the file at any time
        (tmp_path / "faketime.new").write_text(f"{offset}\n")
        os.replace(tmp_path / "faketime.new", clock)

    set_clock("+0")
    await serve.start("--heartbeat-interval", "0.2", "--heartbeat-timeout", "2", env={
        "LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_TIMESTAMP_FILE": str(clock),
        "FAKETIME_NO_CACHE": "1",  # read the file at every call: a step takes effect at once
        # monotonic time stays real, as under a real NTP step (both spellings of the switch)
        "FAKETIME_DONT_FAKE_MONOTONIC": "1", "DONT_FAKE_MONOTONIC": "1"})
    worker = await echo_worker(serve, tmp_path)
    ws = worker.ws
    try:
        await serve.enqueue("echo", {"n": 1}, id="steady", visibility_timeout=2)
        [copy] = await worker.jobs(1)
        assert (copy["attempt"], copy["visibility_timeout"]) == (1, 2.0)

        async def beat_for(seconds: float, *, first_after: float = 0.0) -> list[dict[str, Any]]:
            """Heartbeat every 0.2 s for ``seconds``, the first one ``first_after`` late."""
            acks = []
            await asyncio.sleep(first_after)  # noqa: sleep-ok (the worker is late: the workload)
            until = time.monotonic() + seconds
            while True:
                await worker.beat(status=running("steady"))
                acks.append(await worker.expect("ack", timeout=3))
                if time.monotonic() >= until:
                    return acks
                await asyncio.sleep(0.2)  # noqa: sleep-ok (the worker's heartbeat cadence)

        def trouble() -> list[dict[str, Any]]:
            return [f for f in worker.held if f["type"] in ("cancel", "error")]

        await beat_for(0.2)
        for offset, direction in (("+2h", 1), ("-2h", -1)):
            set_clock(offset)
            # The step lands just after a heartbeat; the next one comes 1.4 s later (late,
            # but within the 2 s lease and the 2 s heartbeat timeout), by when the server's
            # lease timer (it wakes at least once a second) has looked at the job.
            acks = await beat_for(0.7, first_after=1.4)  # 2.1 s in all: past one lease
            skew = wall_clock(acks[0]["server_time"]) - time.time()
            assert direction * skew > 3600, f"the server clock did not step {offset}: {skew:+.0f}s"
            assert not trouble(), f"after a {offset} step of the wall clock: {trouble()}"

        ack = await worker.complete(copy, {"n": 1})
        assert ack.get("accepted") == ["steady"] and "rejected" not in ack, ack
        assert not trouble(), trouble()
        job = await serve.job("steady")
        assert (job["state"], job["attempt"], job["errors"]) == ("completed", 1, []), job
    finally:
        await ws.close()


def faketime_env(tmp_path: Path, offset: str) -> dict[str, str]:
    """The environment of a ``rota serve`` whose wall clock is real time plus ``offset``
    (monotonic and boot clocks left real, as under a real NTP step)."""
    if LIBFAKETIME is None:
        pytest.fail("libfaketime.so.1 is missing: apt-get install faketime")
    (tmp_path / "faketime.rc").write_text(f"{offset}\n")
    return {"LD_PRELOAD": str(LIBFAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(tmp_path / "faketime.rc"),
            "FAKETIME_DONT_FAKE_MONOTONIC": "1", "DONT_FAKE_MONOTONIC": "1"}


@pytest.mark.soak  # a restart under faketime; the quick step case stays
async def test_a_wall_clock_step_across_a_restart_moves_no_deadline(serve: ServeProcess,
                                                                    tmp_path: Path):
    """The server stops; its machine's wall clock steps 2 h ahead (NTP, by hand) before
    it starts again. A delayed job does not run at once and a job with a time to live is
    not discarded: each is as far away as the last run left it (issue 20)."""
    await serve.start(env=faketime_env(tmp_path, "+0"))
    echo = write_spec(tmp_path / "specs", "echo")
    await serve.push(echo)
    await serve.enqueue("echo", id="later", delay=3600)
    await serve.enqueue("echo", id="short-lived", ttl=3600)
    before = {job_id: await serve.job(job_id) for job_id in ("later", "short-lived")}
    serve.signal(signal.SIGTERM)
    assert serve.proc is not None and await asyncio.wait_for(serve.proc.wait(), 15) == 0

    await serve.start(env=faketime_env(tmp_path, "+2h"))

    def moved() -> list[str]:
        return [job_id for job_id, job in jobs.items()
                if job["state"] != before[job_id]["state"]]

    jobs: dict[str, dict[str, Any]] = {}

    async def look() -> list[str]:
        jobs.update({job_id: await serve.job(job_id) for job_id in before})
        return moved()

    # The timers look at once at start (and at least once a second): 2 s is plenty.
    await never(look, within=2.0, what="a job whose deadline the step moved")
    later = await serve.job("later")
    # Stored on the new clock now: still about an hour ahead of it.
    ahead = wall_clock(later["run_at"]) - (time.time() + 7200)
    assert 3000 < ahead <= 3600, ahead
    ws = await websockets.connect(serve.ws)
    try:  # and the job with a time to live is still there to run
        worker = RawWorker(ws, "w1")
        await worker.register([echo], concurrency=2)
        [copy] = await worker.jobs(1)
        assert copy["id"] == "short-lived"
        await worker.assert_no_assign(within=0.5)  # "later" waits its hour
    finally:
        await ws.close()
    assert "wall clock stepped +72" in serve.log.read_text()  # +7200 s, give or take


@pytest.mark.soak  # restarts under faketime
@pytest.mark.parametrize("seen", [True, False], ids=["seen", "stopped-before-seen"])
async def test_a_wall_clock_step_while_running_then_a_restart_moves_no_deadline(
        serve: ServeProcess, tmp_path: Path, seen: bool):
    """The wall clock steps 2 h back while the server runs, and the server restarts
    later: the delayed job's stored run_at was written again on the new clock (or, if
    the server stopped before it saw the step, the restart sees it), so the restart
    still finds it an hour away (not three)."""
    env = faketime_env(tmp_path, "+0")
    env["FAKETIME_NO_CACHE"] = "1"  # read the file at every call: a step takes effect at once
    # The server looks at the clocks every 5 s, and at each retention pass: a short
    # retention (nothing here finishes to be pruned) has it see the step within 0.25 s.
    await serve.start(*(["--retain-completed", "1s"] if seen else []), env=env)
    await serve.push(write_spec(tmp_path / "specs", "echo"))
    await serve.enqueue("echo", id="later", delay=3600)
    (tmp_path / "faketime.new").write_text("-2h\n")
    os.replace(tmp_path / "faketime.new", tmp_path / "faketime.rc")
    if seen:
        await wait_until(lambda: "restamped jobs=1" in serve.log.read_text(), timeout=15.0,
                         what="the server to see the step")
    serve.signal(signal.SIGTERM)
    assert serve.proc is not None and await asyncio.wait_for(serve.proc.wait(), 15) == 0
    restamped = "restamped jobs=1" in serve.log.read_text()
    await serve.start(env=env)
    # Seen while it ran, or, stopped first, at the start (the log is the new run's).
    assert restamped or "wall clock stepped -72" in serve.log.read_text()
    later = await serve.job("later")
    ahead = wall_clock(later["run_at"]) - (time.time() - 7200)
    assert later["state"] == "scheduled" and 3000 < ahead <= 3600, (later, ahead)


@pytest.mark.soak  # restarts under faketime
async def test_a_rates_starts_follow_a_step_while_running_across_a_restart(
        serve: ServeProcess, tmp_path: Path):
    """A rate of 2 starts in 20 s is used up; the wall clock steps 2 h ahead while the
    server runs, and it restarts soon after. The restart's window still holds those two
    starts (the server wrote them again on the new clock), so a third job waits out the
    window rather than starting at once as if they were 2 h old."""
    env = faketime_env(tmp_path, "+0")
    env["FAKETIME_NO_CACHE"] = "1"  # read the file at every call: a step takes effect at once
    # (a short retention has the server look at the clocks every 0.25 s: see above)
    await serve.start("--retain-completed", "1s", env=env)
    paced = write_spec(tmp_path / "specs", "paced", extra='[limits]\nrate = "2/20s"\n')
    await serve.push(paced)
    ws = await websockets.connect(serve.ws)
    try:
        worker = RawWorker(ws, "w1")
        await worker.register([paced], concurrency=4)
        for n in range(2):
            await serve.enqueue("paced", id=f"before-{n}")
        for copy in await worker.jobs(2):
            assert (await worker.complete(copy))["accepted"] == [copy["id"]]
    finally:
        await ws.close()
    (tmp_path / "faketime.new").write_text("+2h\n")
    os.replace(tmp_path / "faketime.new", tmp_path / "faketime.rc")
    await wait_until(lambda: "restamped rate_starts=2" in serve.log.read_text(),
                     timeout=15.0, what="the server to restamp the rate's starts")
    serve.signal(signal.SIGTERM)
    assert serve.proc is not None and await asyncio.wait_for(serve.proc.wait(), 15) == 0
    await serve.start(env=env)
    ws = await websockets.connect(serve.ws)
    try:
        worker = RawWorker(ws, "w1")
        await worker.register([paced], concurrency=4)
        await serve.enqueue("paced", id="after")
        await worker.assert_no_assign(within=1.0)
        reason = (await serve.job("after"))["waiting_reason"]
        assert reason.startswith("rate limit 2/20s for spec paced"), reason
    finally:
        await ws.close()


@pytest.mark.soak  # restarts under faketime
async def test_a_unique_keys_period_follows_steps_while_running_and_between_runs(
        serve: ServeProcess, tmp_path: Path):
    """A job holds its unique key for an hour from its enqueue. The wall clock steps 2 h
    ahead while the server runs, then 2 h more while it is stopped: after each, the key
    still holds (as much of the hour is left as real time left it), where the stepped
    clock alone would have freed it and let a duplicate in."""
    env = faketime_env(tmp_path, "+0")
    env["FAKETIME_NO_CACHE"] = "1"  # read the file at every call: a step takes effect at once
    await serve.start("--retain-completed", "1s", env=env)
    await serve.push(write_spec(tmp_path / "specs", "echo"))
    unique = {"key": "nightly", "period": 3600}

    async def enqueue() -> dict[str, Any]:
        reply = await serve.http.post("/jobs", json={"spec": "echo", "queue": "nobody",
                                                     "unique": unique})
        assert reply.status_code in (200, 201), reply.text
        return reply.json()

    first = await enqueue()
    assert first["created"] is True
    (tmp_path / "faketime.new").write_text("+2h\n")
    os.replace(tmp_path / "faketime.new", tmp_path / "faketime.rc")
    await wait_until(lambda: "restamped rate_starts=" in serve.log.read_text(),
                     timeout=15.0, what="the server to restamp after the step")
    again = await enqueue()
    assert (again["created"], again["job"]["id"]) == (False, first["job"]["id"]), again
    serve.signal(signal.SIGTERM)
    assert serve.proc is not None and await asyncio.wait_for(serve.proc.wait(), 15) == 0
    (tmp_path / "faketime.rc").write_text("+4h\n")
    await serve.start(env=env)
    assert "wall clock stepped +72" in serve.log.read_text()
    again = await enqueue()
    assert (again["created"], again["job"]["id"]) == (False, first["job"]["id"]), again


@pytest.mark.soak  # a step back under faketime
async def test_events_after_a_step_back_reach_a_webhook_made_before_it(serve: ServeProcess,
                                                                       tmp_path: Path):
    """A subscription made, then the wall clock steps 2 h back: the job events the server
    records from then on are before the subscription's creation by their wall time, and
    are its own all the same (they came after the server followed it), at once, before
    the step is even seen. A delivery whose receiver failed before the step is tried again
    after its backoff, not 2 h later."""
    env = faketime_env(tmp_path, "+0")
    env["FAKETIME_NO_CACHE"] = "1"  # read the file at every call: a step takes effect at once
    receiver = await Receiver().start()
    try:  # (retries 3 s, 12 s... apart; the step seen within 0.25 s)
        await serve.start("--allow-private-endpoints", "--webhook-backoff-scale", "0.1",
                          "--retain-completed", "1s", env=env)
        await serve.push(write_spec(tmp_path / "specs", "echo"))
        made = await serve.http.post("/webhooks", json={"url": receiver.url,
                                                        "kinds": ["enqueue"]})
        assert made.status_code == 201, made.text

        def sent(status: int | None = None) -> set[str]:
            return {got.json["data"]["job"] for got in receiver.got
                    if status is None or got.status == status}

        await serve.enqueue("echo", id="before", queue="nobody")
        await wait_until(lambda: "before" in sent(), what="the first event delivered")
        receiver.status = 500
        await serve.enqueue("echo", id="failed", queue="nobody")
        await wait_until(lambda: "failed" in sent(), what="the second event tried")
        (tmp_path / "faketime.new").write_text("-2h\n")
        os.replace(tmp_path / "faketime.new", tmp_path / "faketime.rc")
        receiver.status = 200  # (a delivery that succeeds would bring the retry on at once)
        await wait_until(lambda: "failed" in sent(200), timeout=15.0,
                         what="the retry after its backoff")
        await serve.enqueue("echo", id="after", queue="nobody")
        await wait_until(lambda: "after" in sent(200), timeout=10.0,
                         what="the event after the step delivered")
    finally:
        await receiver.close()


@pytest.mark.soak  # restarts under faketime
async def test_schedules_go_on_ticking_after_a_step_back_while_running_and_between_runs(
        serve: ServeProcess, tmp_path: Path):
    """An every-second schedule; the wall clock steps 2 h back while the server runs, then
    2 h more while it is stopped: it goes on ticking each time, rather than waiting 2 h
    for its last tick's moment to come round again."""
    env = faketime_env(tmp_path, "+0")
    env["FAKETIME_NO_CACHE"] = "1"  # read the file at every call: a step takes effect at once
    await serve.start("--retain-completed", "1s", env=env)  # (the step seen within 0.25 s)
    await serve.push(write_spec(tmp_path / "specs", "beat", queue="nobody"))
    made = await serve.http.put("/schedules/beat", json={"spec": "beat", "cron": "@every 1s",
                                                         "overlap": "allow"})
    assert made.status_code in (200, 201), made.text

    async def ticks() -> int:
        listed = await serve.http.get("/jobs", params={"spec": "beat", "limit": 500})
        return len(listed.json()["jobs"])

    async def ticking(what: str) -> None:
        count = await ticks()

        async def more() -> bool:
            return await ticks() >= count + 2
        await wait_until(more, timeout=10.0, what=what, step=COSTLY_POLL)

    await ticking("ticks before any step")
    (tmp_path / "faketime.new").write_text("-2h\n")
    os.replace(tmp_path / "faketime.new", tmp_path / "faketime.rc")
    await wait_until(lambda: "the schedules' last ticks follow" in serve.log.read_text(),
                     timeout=15.0, what="the server to restamp after the step")
    await ticking("ticks after a step back while running")
    serve.signal(signal.SIGTERM)
    assert serve.proc is not None and await asyncio.wait_for(serve.proc.wait(), 15) == 0
    (tmp_path / "faketime.rc").write_text("-4h\n")
    await serve.start(env=env)
    assert "wall clock stepped -72" in serve.log.read_text()
    await ticking("ticks after a step back between runs")


@pytest.mark.soak  # a step back under faketime
async def test_after_a_step_back_retention_is_on_time_and_nothing_shows_ahead(
        serve: ServeProcess, tmp_path: Path):
    """The wall clock steps 2 h back while the server runs: a completed job is still
    deleted once its retention has passed (not 2 h later), and the dashboard shows no
    past moment as "in 2 h" (issue 20)."""
    env = faketime_env(tmp_path, "+0")
    env["FAKETIME_NO_CACHE"] = "1"  # read the file at every call: a step takes effect at once
    await serve.start("--retain-completed", "2s", env=env)
    worker = await echo_worker(serve, tmp_path)
    try:
        waiting = await serve.http.post("/jobs", json={"spec": "echo", "id": "waiting",
                                                       "queue": "nobody"})
        assert waiting.status_code == 201, waiting.text
        await serve.enqueue("echo", id="done")
        [copy] = await worker.jobs(1)
        assert (await worker.complete(copy))["accepted"] == ["done"]
        # The step comes at once, well within the retention: the job is still there.
        (tmp_path / "faketime.new").write_text("-2h\n")
        os.replace(tmp_path / "faketime.new", tmp_path / "faketime.rc")
        finished = time.monotonic()
    finally:
        await worker.ws.close()

    async def gone() -> bool:
        return (await serve.http.get("/jobs/done")).status_code == 404

    assert not await gone(), "deleted before the step: the test proves nothing"
    await wait_until(gone, timeout=20.0, what="the completed job deleted after 2 s",
                     step=COSTLY_POLL)
    assert time.monotonic() - finished < 20.0
    page = (await serve.http.get("/ui/jobs/waiting")).text
    enqueued = re.search(r"<dt>Enqueued</dt><dd[^>]*>([^<]*)</dd>", page)
    assert enqueued is not None and enqueued[1] == "just now", page[:2000]
    assert "wall clock stepped -7" in serve.log.read_text()


# -- 4. a frozen server ----------------------------------------------------------------------
async def test_a_frozen_server_drops_no_worker_that_kept_beating(serve: ServeProcess,
                                                                 tmp_path: Path):
    await serve.start("--heartbeat-interval", "0.2", "--heartbeat-timeout", "1.0")
    echo = write_spec(tmp_path / "specs", "echo")
    await serve.push(echo)
    beaters: list[Beater] = []
    stopped = False
    try:
        for name in ("w1", "w2"):
            worker = RawWorker(await websockets.connect(serve.ws), name)
            await worker.register([echo], concurrency=1)
            job = await serve.enqueue("echo", {"by": name}, id=f"job-{name}")
            [copy] = await worker.jobs(1)
            assert (copy["id"], copy["attempt"]) == (job["id"], 1)
            beaters.append(Beater(worker, [copy["id"]]))
        for beater in beaters:
            beater.start()
        await wait_until(lambda: all(len(b.of_type("ack")) >= 2 for b in beaters),
                         what="both workers beating")

        serve.signal(signal.SIGSTOP)
        stopped, frozen_at = True, time.monotonic()
        # The workers keep beating through a freeze well past the 1 s heartbeat timeout;
        # their heartbeats pile up in the socket buffers.
        await wait_until(lambda: all(b.sent[-1][1] - frozen_at >= 2.5 for b in beaters),
                         timeout=6, what="heartbeats through 2.5 s of the freeze")
        serve.signal(signal.SIGCONT)
        stopped = False
        pending = [b.sent[-1][0] for b in beaters]

        def caught_up() -> bool:
            for beater in beaters:
                assert beater.trouble() is None, beater.trouble()
            return all(b.acked_through() >= seq for b, seq in zip(beaters, pending, strict=True))

        await wait_until(caught_up, timeout=5, what="every heartbeat sent in the freeze acked")
        assert sorted(await serve.workers()) == ["w1", "w2"]
        for name in ("w1", "w2"):
            job = await serve.job(f"job-{name}")
            assert (job["state"], job["worker_id"], job["attempt"], job["errors"]) == (
                "active", name, 1, []), job

        for beater in beaters:
            await beater.stop()
            assert beater.trouble() is None, beater.trouble()
            worker = beater.worker
            worker.held = [f for f in beater.frames if f["type"] != "ack"]
            await worker.beat(results=[completed({"id": f"job-{worker.worker_id}", "attempt": 1},
                                                 "done")])
            while (ack := await worker.expect("ack"))["seq"] != worker.seq - 1:
                pass  # the acks of heartbeats sent just before
            assert ack.get("accepted") == [f"job-{worker.worker_id}"], ack
            assert not [f for f in worker.held if f["type"] in ("error", "cancel")], worker.held
        for name in ("w1", "w2"):
            job = await serve.job(f"job-{name}")
            assert (job["state"], job["attempt"], job["errors"]) == ("completed", 1, []), job
    finally:
        if stopped:
            serve.signal(signal.SIGCONT)
        for beater in beaters:
            await beater.stop()
            await beater.worker.ws.close()
