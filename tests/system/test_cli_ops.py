"""The operator's commands against a real server: ``rota jobs list``, bulk ``jobs retry``
and ``jobs cancel`` (by ids or by filter, with --dry-run), ``rota queues`` and its pause and
resume, ``rota workers resume``, ``rota watch`` (a snapshot, and frames redrawn) and
``rota tail`` (one line an event; NDJSON; a lost connection resumed where it stopped)."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import pty
import re
import signal
import struct
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, Proxy, start_server, stop_server, write_spec
from helpers import RawWorker, clean_env, wait_until
from helpers import rota

from rota import JobContext, Worker
from rota.base.specs import JobSpec


# A server whose raw workers need not beat while a command runs: 60 s of silence allowed.
QUIET_WORKERS = pytest.mark.parametrize("live", [{"heartbeat_timeout": 60.0}], indirect=True,
                                        ids=["quiet-raw-workers"])


async def discarded(live: Live, worker: RawWorker, *ids: str) -> None:
    """Enqueue jobs of echo with one attempt each, and fail them on ``worker``."""
    for job_id in ids:
        await live.enqueue("echo", id=job_id, max_attempts=1)
    for copy in await worker.jobs(len(ids)):
        await worker.beat(results=[{"job_id": copy["id"], "attempt": copy["attempt"],
                                    "outcome": "failed", "error": {
                                        "type": "ValueError", "message": f"no file for {copy['id']}"}}])
        await worker.expect("ack")
    for job_id in ids:
        await live.wait_state(job_id, "discarded")


async def setup(live: Live, connect: Any, tmp_path: Path) -> tuple[JobSpec, RawWorker]:
    echo = write_spec(tmp_path / "specs", "echo")
    await live.push(echo, write_spec(tmp_path / "specs", "resize", queue="media"))
    worker = await connect("w-ops")
    await worker.register([echo], concurrency=10)
    return echo, worker


@QUIET_WORKERS
async def test_jobs_list_filters_pages_and_prints_json(live: Live, connect, tmp_path: Path):
    _, worker = await setup(live, connect, tmp_path)
    await discarded(live, worker, "bad-1", "bad-2", "bad-3")
    for n in range(3):
        await live.enqueue("resize", id=f"img-{n}")  # nobody serves media: they wait
    code, out, err = await rota("jobs", "list", "--state", "discarded", "--json",
                                "--url", live.base)
    assert code == 0, err
    listed = json.loads(out)
    assert [j["id"] for j in listed["jobs"]] == ["bad-3", "bad-2", "bad-1"]  # newest first
    assert listed["next_cursor"] is None

    code, out, err = await rota("jobs", "list", "--spec", "resize", "--limit", "2",
                                "--url", live.base)
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["ID", "STATE", "SPEC"]
    assert [line.split()[0] for line in lines[1:]] == ["img-2", "img-1"]
    assert "more match" in err and "--all" in err
    code, out, err = await rota("jobs", "list", "--spec", "resize", "--all", "--url", live.base)
    assert code == 0 and len(out.splitlines()) == 4 and not err

    code, out, _ = await rota("jobs", "list", "--q", "file for bad-2", "--url", live.base)
    assert [line.split()[0] for line in out.splitlines()[1:]] == ["bad-2"]  # error text
    assert "ValueError: no file for bad-2" in out and "discarded" in out
    code, out, _ = await rota("jobs", "list", "--q", "img-", "--state", "available,active",
                              "--queue", "media", "--url", live.base)
    assert code == 0 and len(out.splitlines()) == 4
    code, out, err = await rota("jobs", "list", "--worker", "nobody", "--url", live.base)
    assert code == 0 and out == "" and "no job matches" in err


@QUIET_WORKERS
async def test_bulk_retry_and_cancel_by_filter_and_by_ids(live: Live, connect, tmp_path: Path):
    _, worker = await setup(live, connect, tmp_path)
    await discarded(live, worker, "bad-1", "bad-2")
    code, out, _ = await rota("jobs", "retry", "--state", "discarded", "--dry-run",
                              "--url", live.base)
    assert code == 0 and out.splitlines()[0].startswith("2 matched; would be retried: 2")
    assert "dry run: nothing was changed" in out and "would retry bad-1" in out
    assert (await live.job("bad-1"))["state"] == "discarded"

    code, out, _ = await rota("jobs", "retry", "--state", "discarded", "--spec", "echo",
                              "--url", live.base)
    assert code == 0 and out.splitlines()[0].startswith("2 matched; retried: 2")
    # A known spec that matches nothing: 0 is then true, and said as such (a misspelt
    # one is refused: tests/system/test_cli_failures.py).
    code, out, _ = await rota("jobs", "retry", "--state", "discarded", "--spec", "echo",
                              "--url", live.base)
    assert code == 0 and out.splitlines()[0].startswith("0 matched; retried: 0")
    for copy in await worker.jobs(2):  # they run again, with a fresh budget
        assert copy["id"] in ("bad-1", "bad-2")

    for n in range(3):
        await live.enqueue("resize", id=f"img-{n}")
    code, out, _ = await rota("jobs", "cancel", "img-0", "img-1", "missing", "gone",
                              "--url", live.base)
    assert code == 0 and "cancelled img-0" in out and "cancelled img-1" in out
    assert "skipped 2: no such job, e.g. missing, gone" in out.splitlines()  # grouped (issue 22)
    code, out, _ = await rota("jobs", "cancel", "--queue", "media", "--json", "--url", live.base)
    reply = json.loads(out)
    assert (reply["action"], reply["touched"], reply["ids"]) == ("cancel", 1, ["img-2"])
    assert (await live.job("img-2"))["state"] == "cancelled"
    code, out, _ = await rota("jobs", "retry", "--state", "cancelled", "--limit", "1",
                              "--url", live.base)
    assert code == 0 and "retried: 1" in out and reply["truncated"] is False
    # A state the action cannot take: no run of "skipped" lines, one line and exit 1.
    code, out, err = await rota("jobs", "cancel", "--state", "cancelled", "--yes",
                                "--url", live.base)
    assert (code, out) == (1, "") and _one(err).startswith(
        "error: nothing cancelled: all 2 jobs matched were skipped, as job is cancelled (a"
        " finished job cannot be cancelled), e.g. img-"), err
    code, out, err = await rota("jobs", "retry", "--state", "available", "--spec", "resize",
                                "--yes", "--url", live.base)
    assert (code, out) == (1, "") and _one(err).startswith(
        "error: nothing retried: the 1 job matched was skipped, as job is available (only a"
        " discarded or cancelled job is retried): img-"), err


def _one(err: str) -> str:
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.rstrip("\n")


@QUIET_WORKERS
async def test_queues_pause_and_resume(live: Live, connect, tmp_path: Path):
    _, worker = await setup(live, connect, tmp_path)
    await live.enqueue("resize", id="img-0")  # media: a queue that is not paused
    code, out, _ = await rota("queues", "pause", "default", "--url", live.base)
    assert (code, out.strip()) == (0, "default: paused")
    job = await live.enqueue("echo", id="held")
    await worker.assert_no_assign()
    code, out, _ = await rota("queues", "--url", live.base)
    line = next(line for line in out.splitlines() if line.startswith("default"))
    assert "paused" in line and "waiting=1  later=0" in line
    assert "echo: 1 waiting: " in out and "paused" in out.split("echo: 1 waiting: ")[1]
    code, out, _ = await rota("queues", "--json", "--url", live.base)
    shown = {q["name"]: q for q in json.loads(out)["queues"]}
    assert shown["default"]["paused"] is True and shown["media"]["paused"] is False
    code, out, _ = await rota("queues", "resume", "default", "--url", live.base)
    assert (code, out.strip()) == (0, "default: running")
    [copy] = await worker.jobs(1)
    assert copy["id"] == job["id"]
    # A slip for a known queue would pause nothing, or leave a job waiting forever.
    for argv in (["queues", "pause", "defualt"], ["queues", "resume", "defualt"],
                 ["enqueue", "echo", "--queue", "defualt"]):
        code, out, err = await rota(*argv, "--url", live.base)
        assert (code, out) == (1, "") and "did you mean default?" in err, argv
        assert "(unknown_queue)" in err and "Traceback" not in err
    code, out, _ = await rota("enqueue", "echo", "--queue", "defualt", "--new-queue",
                              "--url", live.base)  # meant new: taken at its word
    assert code == 0 and json.loads(out)["queue"] == "defualt"


@QUIET_WORKERS
async def test_workers_resume(live: Live, sdk_worker, tmp_path: Path):
    echo = write_spec(tmp_path / "specs", "echo")
    await live.push(echo)
    worker = Worker(specs_dir=tmp_path / "specs", heartbeat_interval=0.1, labels=["blue"])

    @worker.handler("echo")
    async def run(ctx: JobContext) -> str:
        return "done"

    await sdk_worker(worker)
    code, out, _ = await rota("workers", "quiet", worker.worker_id, "--url", live.base)
    assert (code, out.strip()) == (0, f"{worker.worker_id}: quiet")
    await wait_until(lambda: worker.state == "quiet", what="the worker to go quiet")
    job = await live.enqueue("echo")
    code, out, _ = await rota("workers", "resume", "--label", "blue", "--url", live.base)
    assert (code, out.strip()) == (0, f"{worker.worker_id}: running")
    await live.wait_state(job["id"], "completed")
    code, _, err = await rota("workers", "resume", "--all", "--url", live.base)
    assert code == 1 and "no connected worker to resume" in err  # none is quiet now


@QUIET_WORKERS
async def test_watch_prints_one_snapshot_as_json(live: Live, connect, tmp_path: Path):
    echo, worker = await setup(live, connect, tmp_path)
    stale = await connect("w-stale")
    await stale.register([], declared={"resize": "sha256:" + "0" * 64}, queues=["media"])
    await live.enqueue("resize", id="blocked-1")
    await live.enqueue("echo", id="done-1")
    [copy] = await worker.jobs(1)
    await worker.complete(copy, result=1)
    await live.enqueue("echo", id="later-1", delay=3600)  # not due: not "waiting"
    code, out, err = await rota("watch", "--json", "--url", live.base)
    assert code == 0, err
    view = json.loads(out)
    queues = {q["name"]: q for q in view["queues"]}
    assert queues["media"]["waiting"] == 1 and queues["media"]["paused"] is False
    assert (queues["default"]["waiting"], queues["default"]["later"]) == (0, 1)
    assert queues["media"]["oldest_available_age"] >= 0
    assert queues["default"]["counts"]["completed"] == 1
    assert {w["id"]: w["state"] for w in view["workers"]} == {"w-ops": "running",
                                                             "w-stale": "running"}
    [blocked] = view["blocked"]
    assert (blocked["queue"], blocked["spec"], blocked["available"]) == ("media", "resize", 1)
    assert "checksum" in blocked["reason"]
    throughput = view["throughput"]
    assert sum(throughput["completed"]) == 1 and sum(throughput["enqueued"]) == 3
    assert len(throughput["completed"]) == len(throughput["minute_starts"])


@QUIET_WORKERS
async def test_watch_redraws_until_interrupted(live: Live, connect, tmp_path: Path):
    await setup(live, connect, tmp_path)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "watch", "--interval", "0.2", "--url", live.base,
        env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        frames = 0
        while frames < 2:  # a frame starts with its title line (no terminal: no clearing)
            line = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode()  # type: ignore[union-attr]
            assert line, "rota watch ended"
            frames += line.startswith("rota watch  ")
            if frames == 1 and line.startswith("w-ops"):
                assert "running" in line and "0/10" in line
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert proc.returncode == 0 and b"Traceback" not in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@QUIET_WORKERS
async def test_watch_fits_80_columns_and_counts_a_burst_at_once(live: Live, connect,
                                                                tmp_path: Path):
    await setup(live, connect, tmp_path)
    long_queue = "thumbnails-for-the-whole-summer-sale-of-2026"  # wider than its column
    response = await live.http.post("/jobs/batch", json={"jobs": [
        {"spec": "resize", "queue": long_queue, "args": {"n": n}} for n in range(200)]})
    assert response.status_code in (200, 201), response.text
    burst = time.gmtime()
    terminal, screen = pty.openpty()  # rota watch on an 80-column terminal
    fcntl.ioctl(screen, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 80, 0, 0))
    env = {k: v for k, v in clean_env().items() if k not in ("COLUMNS", "LINES")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "watch", "--interval", "0.2", "--url", live.base,
        env=env, stdout=screen, stderr=asyncio.subprocess.PIPE)
    os.close(screen)
    os.set_blocking(terminal, False)
    shown = b""

    def two_frames() -> bool:
        nonlocal shown
        try:
            shown += os.read(terminal, 65536)
        except BlockingIOError:
            pass
        return shown.count(b"\x1b[H\x1b[J") >= 2  # each frame homes and clears first

    try:
        await wait_until(two_frames, timeout=10, what="two frames of rota watch")
    finally:
        proc.kill()
        await proc.wait()
        os.close(terminal)
    lines = shown.split(b"\x1b[H\x1b[J")[1].decode().splitlines()
    assert lines[0].startswith("rota watch  ")
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    columns = {line.split()[0]: re.split(r" {2,}", line) for line in lines if line.strip()}
    assert columns["QUEUE"] == ["QUEUE", "STATE", "WAITING", "LATER", "RUNNING", "PREFETCHED",
                                "OLDEST", "WORKERS"]
    [cut] = [row for name, row in columns.items() if name.startswith("thumbnails-")
             and "/" not in name]  # (not its line under BLOCKED)
    assert cut[0].endswith("…") and cut[1:3] == ["running", "200"], cut
    assert columns["WORKER"] == ["WORKER", "STATE", "LOAD", "BEAT", "HOST"]
    assert len(columns["w-ops"]) == 5 and columns["w-ops"][1] == "running"
    # The burst shows at once: the minute under way so far (THIS MIN), beside the last
    # whole one (PREV MIN) and the hour; unless the minute turned before the look.
    assert any(line.split() == ["THIS", "MIN", "PREV", "MIN", "HOUR"] for line in lines)
    this, previous, in_hour = columns["enqueued"][-3:]
    turned = lines[0].split()[3][:5] != time.strftime("%H:%M", burst)
    assert (this, previous, in_hour) == (("0", "200") if turned else ("200", "0")) + ("200",)
    # This server's start, within the minutes shown, marked under them.
    assert any(re.fullmatch(r" +(↑ server started \d\d:\d\d|server started \d\d:\d\d ↑)", line)
               for line in lines), "\n".join(lines)


class Tail:
    """``rota tail`` as a process, read a line at a time."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, url: str, *args: str) -> Tail:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rota", "tail", *args, "--url", url, env=clean_env(),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    async def line(self) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), 10)
        assert raw, "rota tail ended"
        return raw.decode().rstrip("\n")

    async def stop(self) -> str:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(self.proc.communicate(), 10)
        assert self.proc.returncode == 0, err.decode()
        return err.decode()


async def opened(tail: Tail, says: str = "following the events of") -> None:
    """Wait for the tail's word that its stream is open: from then on the server sends
    it every event (one enqueued before would not show)."""
    assert tail.proc.stderr is not None
    line = (await asyncio.wait_for(tail.proc.stderr.readline(), 10)).decode()
    assert line.startswith("rota tail: ") and says in line, line


@QUIET_WORKERS
async def test_tail_prints_a_line_an_event_and_ndjson(live: Live, connect, tmp_path: Path):
    _, worker = await setup(live, connect, tmp_path)
    # A misspelt name would follow nothing, silently (issue 22): refused, with the likely one.
    for argv, says in ((["tail", "--queue", "defualt"], "did you mean default? Known queues:"),
                       (["tail", "--spec", "ecoh"], "did you mean echo? Known specs:"),
                       (["specs", "history", "ecoh"], "never pushed; did you mean echo?")):
        code, out, err = await rota(*argv, "--url", live.base, timeout=10)
        assert (code, out) == (1, "") and says in err, (argv, err)
    tail = await Tail.start(live.base, "--event", "enqueue,result", "--spec", "echo", "--json")
    text = await Tail.start(live.base, "--queue", "default", "--event", "result")
    try:
        await opened(tail)
        await opened(text)
        await live.enqueue("resize", id="other")  # another spec: filtered out
        await live.enqueue("echo", id="t-1")
        [copy] = await worker.jobs(1)
        await worker.complete(copy, result=1)
        first, second = json.loads(await tail.line()), json.loads(await tail.line())
        assert (first["kind"], first["job"], first["spec"]) == ("enqueue", "t-1", "echo")
        assert (second["kind"], second["job"], second["worker"]) == ("result", "t-1", "w-ops")
        assert second["duration_ms"] >= 0 and second["id"] > first["id"]
        line = await text.line()
        assert " result " in line and "job=t-1" in line and "worker=w-ops" in line
        assert "duration_ms=" in line and "\n" not in line
    finally:
        await tail.stop()
        await text.stop()


@QUIET_WORKERS
async def test_tail_resumes_after_a_lost_connection(live: Live, connect, tmp_path: Path):
    await setup(live, connect, tmp_path)
    proxy = await Proxy(live.port).start()
    tail = await Tail.start(f"http://127.0.0.1:{proxy.port}", "--event", "enqueue", "--json")
    try:
        await opened(tail)
        await live.enqueue("resize", id="r-0")
        assert json.loads(await tail.line())["job"] == "r-0"
        proxy.cut()  # the stream is lost; these happen while it is away
        for n in range(1, 4):
            await live.enqueue("resize", id=f"r-{n}")
        await opened(tail, "reconnecting in")
        await opened(tail, "resumed after event")
        seen = [json.loads(await tail.line()) for _ in range(3)]
        assert [e["job"] for e in seen] == ["r-1", "r-2", "r-3"]  # none lost, none twice
        assert proxy.accepted == 2
    finally:
        await tail.stop()
        await proxy.close()


@QUIET_WORKERS
async def test_a_filter_on_a_terminal_asks_first_with_the_count(live: Live, connect,
                                                               tmp_path: Path):
    await setup(live, connect, tmp_path)
    for n in range(2):
        await live.enqueue("resize", id=f"img-{n}")

    async def answer(reply: bytes) -> tuple[int, str, str]:
        """``rota jobs cancel --queue media`` with a terminal for stdin, answered."""
        terminal, stdin = pty.openpty()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rota", "jobs", "cancel", "--queue", "media", "--url",
            live.base, env=clean_env(), stdin=stdin, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        os.close(stdin)
        try:
            asked = b""
            while b"[y/N]" not in asked:
                chunk = await asyncio.wait_for(proc.stderr.read(200), 10)  # type: ignore[union-attr]
                assert chunk, f"no question: {asked!r}"
                asked += chunk
            os.write(terminal, reply)
            out, err = await asyncio.wait_for(proc.communicate(), 10)
        finally:
            os.close(terminal)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), (asked + err).decode()

    code, out, err = await answer(b"n\n")
    assert "cancel 2 job(s)?" in err and code == 1 and "aborted" in err and out == ""
    assert (await live.job("img-0"))["state"] == "available"
    code, out, err = await answer(b"y\n")
    assert code == 0 and out.splitlines()[0].startswith("2 matched; cancelled: 2"), out + err
    assert (await live.job("img-1"))["state"] == "cancelled"


@QUIET_WORKERS
async def test_tail_into_a_reader_that_leaves_ends_quietly(live: Live, connect, tmp_path: Path):
    await setup(live, connect, tmp_path)
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", f"{sys.executable} -m rota tail --json --url {live.base} | head -n 1",
        env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 10)).decode()
    assert "following the events of" in line
    await live.enqueue("resize", id="first")
    first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))  # type: ignore[union-attr]
    assert first["job"] == "first"  # head has its line and leaves; tail finds out next
    await live.enqueue("resize", id="second")
    await live.enqueue("resize", id="third")
    _, err = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0 and b"Traceback" not in err and b"Error" not in err, err


async def test_tail_says_what_the_server_no_longer_had(tmp_path: Path):
    live = await start_server(tmp_path, events_buffer=4)  # a ring of four events
    proxy = await Proxy(live.port).start()
    await live.push(write_spec(tmp_path / "specs", "echo"))
    tail = await Tail.start(f"http://127.0.0.1:{proxy.port}")
    try:
        await opened(tail)
        await live.enqueue("echo", id="e-0")
        assert "job=e-0" in await tail.line()
        proxy.hold()  # its reconnect gets through once all ten are in
        proxy.cut()
        for n in range(1, 11):  # ten while it is away: the ring keeps the last four
            await live.enqueue("echo", id=f"e-{n}")
        await opened(tail, "reconnecting in")
        proxy.release()
        await opened(tail, "resumed after event")
        gap = await tail.line()
        assert " gap " in gap and "missed_from=" in gap and "missed_to=" in gap, gap
        kept = [await tail.line() for _ in range(4)]
        assert [line.split("job=")[1].split()[0] for line in kept] == ["e-7", "e-8", "e-9",
                                                                        "e-10"]
    finally:
        await tail.stop()
        await proxy.close()
        await stop_server(live)
