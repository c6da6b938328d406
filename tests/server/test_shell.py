"""The shell (rota/server/coordinator.py and its parts) on a fake clock, with fake outboxes.

A real Coordinator on a real SQLite store in a temporary directory, without uvicorn or
sockets: the test attaches outboxes that record what the shell sends, drives heartbeats
as a session would, and reads the store's file to see what was committed when.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from rota.base import protocol as p
from rota.server.coordinator import Coordinator
from rota.core.auth import new_token
from rota.base.errors import Conflict
from rota.core.jobs import EnqueueRequest
from rota.core.limits import LimitRule
from rota.core.model import Instant
from rota.core.settings import ServerSettings
from rota.base.specs import JobSpec, checksum
from rota.store.tokens import create_token as store_token
from tests.helpers import wait_until

pytestmark = pytest.mark.sqlite_only("the shell over one SQLite file; the store contract"
                                     " suite covers PostgreSQL")
SPEC = JobSpec(name="echo", version="1")


class FakeClock:
    """Both clocks, moved only by the test."""

    def __init__(self) -> None:
        self.mono, self.wall = 5000.0, 1_800_000_000.0

    def __call__(self) -> Instant:
        return Instant(self.mono, self.wall)

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall += seconds


class FakeOutbox:
    """A worker's connection as the shell sees it: each frame is kept with the job rows
    as committed in the store's file at the moment it was sent."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.gone: Callable[[], None] = lambda: None  # what the session does when closed
        self.frames: list[dict[str, Any]] = []
        self.committed: list[dict[str, str]] = []  # job id -> state, per frame
        self.aborted: list[tuple[str, int]] = []

    def send(self, frame: str) -> None:
        self.frames.append(json.loads(frame))
        with contextlib.closing(sqlite3.connect(self.db)) as conn:
            self.committed.append(dict(conn.execute("SELECT id, state FROM jobs").fetchall()))

    def abort(self, code: str, message: str, close_code: int) -> None:
        self.aborted.append((code, close_code))
        asyncio.get_running_loop().call_soon(self.gone)  # the socket closes, then the session

    def of(self, kind: str) -> list[tuple[dict[str, Any], dict[str, str]]]:
        return [(f, c) for f, c in zip(self.frames, self.committed, strict=True)
                if f["type"] == kind]


class Worker:
    """The heartbeats a worker's session would hand the shell."""

    def __init__(self, shell: Coordinator, outbox: FakeOutbox, worker_id: str = "w1") -> None:
        self.shell, self.outbox, self.id = shell, outbox, worker_id
        self.conn = shell.attach(outbox)
        self.seq = 0
        outbox.gone = self.leave

    def leave(self) -> None:
        if self.id in self.shell.connections:
            self.shell.disconnect(self.conn, self.id, "closed")
        self.shell.detach(self.conn)

    def beat(self, active: list[str] = (), results: list[p.Result] = (),  # type: ignore[assignment]
             state: str = "running") -> None:
        registration = p.Registration(
            hostname="h", os="linux", pid=7, sdk="test", queues=["default"], concurrency=2,
            specs=[p.SpecRef(SPEC.name, checksum(SPEC))], started_at="t0",
        ) if self.seq == 0 else None
        hb = p.Heartbeat(seq=self.seq, worker_id=self.id, registration=registration,
                         status=p.Status(state=state, active_job_ids=list(active)),  # type: ignore[arg-type]
                         results=list(results), capacity=2)
        self.shell.receive(self.conn, hb, first=self.seq == 0)
        self.seq += 1

    async def acked(self, seq: int) -> dict[str, Any]:
        return await wait_until(lambda: next((f for f, _ in self.outbox.of("ack")
                                              if f["seq"] == seq), None), what=f"ack {seq}")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def shell(tmp_path: Path, clock: FakeClock) -> AsyncIterator[Coordinator]:
    settings = ServerSettings(db=tmp_path / "rota.db", heartbeat_interval=1.0,
                              heartbeat_timeout=5.0, reconnect_grace=5.0)
    coordinator = Coordinator(settings, clock=clock)
    await coordinator.start()
    await coordinator.push_specs([SPEC], dry_run=False)
    try:
        yield coordinator
    finally:
        await coordinator.stop()


@pytest.fixture
def outbox(tmp_path: Path) -> FakeOutbox:
    return FakeOutbox(tmp_path / "rota.db")


async def enqueue(shell: Coordinator, job_id: str) -> dict[str, Any]:
    [(row, created)] = await shell.enqueue([EnqueueRequest(spec="echo", id=job_id)])  # type: ignore[misc]
    assert created
    return row


async def assigned(worker: Worker, job_id: str) -> dict[str, str]:
    """Once the job's assign frame left: the rows as committed when it did."""
    def sent() -> dict[str, str] | None:
        for frame, committed in worker.outbox.of("assign"):
            if any(job["id"] == job_id for job in frame["jobs"]):
                return committed
        return None
    return await wait_until(sent, what=f"the assign of {job_id}")


async def test_an_assignment_is_sent_only_after_its_reservation_committed(
        shell: Coordinator, outbox: FakeOutbox) -> None:
    worker = Worker(shell, outbox)
    worker.beat()
    await worker.acked(0)
    await enqueue(shell, "job-1")
    committed = await assigned(worker, "job-1")
    assert committed["job-1"] == "active"  # the row said so before the frame left
    assert (await shell.store.get_job("job-1"))["worker_id"] == "w1"


async def test_cancelling_a_running_job_sends_its_worker_the_cancel(
        shell: Coordinator, outbox: FakeOutbox) -> None:
    worker = Worker(shell, outbox)
    worker.beat()
    await enqueue(shell, "job-1")
    await assigned(worker, "job-1")
    worker.beat(active=["job-1"])
    row, done = await shell.cancel("job-1")
    assert (row["state"], done) == ("active", False)  # its worker stops it
    [(cancel, committed)] = outbox.of("cancel")
    assert cancel["job_ids"] == ["job-1"]
    assert committed["job-1"] == "active"
    worker.beat(results=[p.Result(job_id="job-1", attempt=1, outcome="cancelled")])
    await wait_until(lambda: shell.store.get_job("job-1"), what="the row")
    row = await wait_until(lambda: _state(shell, "job-1", "cancelled"), what="cancelled")
    assert row["finished_at"] is not None


async def _state(shell: Coordinator, job_id: str, state: str) -> dict[str, Any] | None:
    row = await shell.store.get_job(job_id)
    return row if row is not None and row["state"] == state else None


async def test_a_waiting_job_is_cancelled_at_once_and_a_retry_puts_it_back(
        shell: Coordinator, outbox: FakeOutbox) -> None:
    await enqueue(shell, "job-1")
    row, done = await shell.cancel("job-1")
    assert (row["state"], done) == ("cancelled", True)
    with pytest.raises(Conflict, match="not_cancellable|is cancelled"):
        await shell.cancel("job-1")
    row = await shell.retry("job-1")
    assert row["state"] == "available"
    with pytest.raises(Conflict):  # only discarded or cancelled jobs
        await shell.retry("job-1")
    worker = Worker(shell, outbox)  # the job is live again: a worker gets it
    worker.beat()
    assert (await assigned(worker, "job-1"))["job-1"] == "active"


async def test_a_bulk_cancel_names_what_it_skipped(shell: Coordinator) -> None:
    for n in range(3):
        await enqueue(shell, f"job-{n}")
    await shell.cancel("job-0")
    answer = await shell.bulk("cancel", ids=["job-0", "job-1", "job-2", "nope"])
    assert answer["touched"] == 2 and sorted(answer["ids"]) == ["job-1", "job-2"]
    assert {s["id"]: s["reason"] for s in answer["skipped"]} == {
        "job-0": "job is cancelled", "nope": "no such job"}
    assert (await shell.store.get_job("job-2"))["state"] == "cancelled"


async def test_a_directive_reaches_the_worker_in_its_next_ack(
        shell: Coordinator, outbox: FakeOutbox) -> None:
    worker = Worker(shell, outbox)
    worker.beat()
    assert (await worker.acked(0))["state"] == "running"
    assert shell.direct(["w1"], "quiet") == ["w1"]
    worker.beat()
    assert (await worker.acked(1))["state"] == "quiet"
    assert shell.direct(["w1"], "quiet") == []  # asked already: nothing to do


async def test_a_silent_worker_is_dropped_once_the_fake_clock_passes_its_timeout(
        shell: Coordinator, outbox: FakeOutbox, clock: FakeClock) -> None:
    worker = Worker(shell, outbox)
    worker.beat()
    await worker.acked(0)

    def silent_for(seconds: float) -> None:
        # Ticks as the timer loop makes them, at most tick_every apart: a longer gap
        # would be a stall of the server itself, which pushes every silence back.
        for _ in range(round(seconds / 0.25)):
            clock.advance(0.25)
            shell.apply(shell.engine.tick(clock()))

    silent_for(4.0)  # within heartbeat_timeout
    assert "w1" in shell.connections and not outbox.aborted
    silent_for(2.0)
    assert outbox.aborted
    await wait_until(lambda: "w1" not in shell.connections, what="the worker gone")


async def test_revoking_a_token_ends_its_holds_and_closes_its_workers(
        shell: Coordinator, outbox: FakeOutbox) -> None:
    await shell.create_token("admin", "ops", None)  # auth stays on after the revoke
    secret, row = await shell.create_token("worker", "app", None)
    principal = shell.tokens.authenticate(f"Bearer {secret}")
    assert principal is not None
    hold = shell.hold(principal)
    assert hold is not None and not hold.revoked.done() and shell.waits[row["id"]] == 1
    worker = Worker(shell, outbox)
    shell.receive(worker.conn, p.Heartbeat(
        seq=0, worker_id="w1", registration=p.Registration(
            hostname="h", os="linux", pid=7, sdk="test", queues=["default"], concurrency=1,
            specs=[], started_at="t0"),
        status=p.Status(state="running", active_job_ids=[])), principal, first=True)
    await worker.acked(0)
    await shell.revoke_token("app")
    assert hold.revoked.done()
    assert outbox.aborted  # its worker is closed
    shell.release(hold)
    assert not shell.waits


def test_the_shell_stays_thin() -> None:
    """The coordinator owns lifecycle, effects, sockets and loops; rules live in the core
    and the rest in the parts it owns (issue 21: at most 400 lines)."""
    source = Path(__file__).resolve().parents[2] / "rota" / "server" / "coordinator.py"
    assert len(source.read_text().splitlines()) <= 400


async def test_a_token_the_cli_created_is_read_on_demand_at_most_every_tenth_of_a_second(
        shell: Coordinator, clock: FakeClock, tmp_path: Path) -> None:
    await shell.create_token("admin", "ops", None)  # auth on: unknown tokens are looked up
    for task in [t for t in shell._tasks if t.get_name() == "rota-tokens"]:
        task.cancel()  # only the reads this test asks for (the loop looks on real time)

    async def from_the_cli(name: str) -> str:
        token_id, secret, hashed = new_token()
        await asyncio.to_thread(store_token, tmp_path / "rota.db", name=name, scope="worker",
                                queues=None, token_id=token_id, hashed=hashed)
        return secret

    first = await from_the_cli("one")
    assert shell.tokens.unknown(f"Bearer {first}")
    clock.advance(1.0)
    await shell.reread_tokens()
    assert shell.tokens.authenticate(f"Bearer {first}") is not None
    second = await from_the_cli("two")
    clock.advance(0.05)  # within REREAD_EVERY of the last read: not read again yet
    await shell.reread_tokens()
    assert shell.tokens.unknown(f"Bearer {second}")
    clock.advance(0.1)
    await shell.reread_tokens()
    assert shell.tokens.authenticate(f"Bearer {second}") is not None


async def test_a_paused_queue_gets_no_assignment_until_it_is_resumed(
        shell: Coordinator, outbox: FakeOutbox) -> None:
    worker = Worker(shell, outbox)
    worker.beat()
    await worker.acked(0)
    assert await shell.pause_queue("default", True) == {"queue": "default", "paused": True}
    await enqueue(shell, "job-1")
    worker.beat()
    await worker.acked(1)  # a round ran on this heartbeat's capacity: nothing went out
    assert not outbox.of("assign") and shell.scheduler.paused == {"default"}
    await shell.pause_queue("default", False)
    assert (await assigned(worker, "job-1"))["job-1"] == "active"


async def test_a_spec_at_its_concurrency_limit_gets_one_job_and_the_queues_view_says_why(
        shell: Coordinator, outbox: FakeOutbox, clock: FakeClock) -> None:
    shell.apply(shell.engine.set_limits({("spec", "echo"): LimitRule(concurrency=1)}, clock()))
    await enqueue(shell, "job-1")
    await enqueue(shell, "job-2")
    worker = Worker(shell, outbox)
    worker.beat()  # two free slots
    await worker.acked(0)
    await wait_until(lambda: outbox.of("assign"), what="an assign")
    [(frame, _)] = outbox.of("assign")
    assert len(frame["jobs"]) == 1
    [row] = shell.waiting()
    assert (row.jobs, row.reason) == (1, "concurrency limit 1 for spec echo: 1 running")
    assert row.wait is not None and not row.wait.blocked  # a backlog, not an alert
