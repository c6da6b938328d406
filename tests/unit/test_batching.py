"""Batched heartbeats, seen on the wire: an SDK worker against a protocol peer that the
test drives, so that when an ack comes is the test's choice, not the disk's."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import websockets

from conftest import wait_until, write_spec
from rota import JobContext, Worker


class Peer:
    """A /work endpoint that welcomes one worker, assigns what it is told, and acks
    heartbeats with results only when released."""

    def __init__(self) -> None:
        self.frames: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.ws: Any = None
        self.connected = asyncio.Event()
        self.ack_all = False  # at the end: answer everything, so the worker leaves at once

    async def handle(self, ws: Any) -> None:
        self.ws = ws
        with contextlib.suppress(websockets.ConnectionClosed):
            await self._serve(ws)

    async def _serve(self, ws: Any) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            if frame.get("registration"):
                await ws.send(json.dumps({
                    "type": "welcome", "worker_id": frame["worker_id"],
                    "server_time": "2026-01-01T00:00:00Z", "heartbeat_interval": 30.0,
                    "heartbeat_timeout": 120.0, "visibility_timeout": 60.0,
                    "specs": {"accepted": ["hold"], "rejected": []}}))
                self.connected.set()
            if not frame.get("results") or self.ack_all:  # results wait for the test's ack
                await self.ack(frame)
            await self.frames.put(frame)

    async def ack(self, frame: dict[str, Any]) -> None:
        await self.ws.send(json.dumps({
            "type": "ack", "seq": frame["seq"], "state": "running",
            "server_time": "2026-01-01T00:00:00Z",
            "accepted": [r["job_id"] for r in frame.get("results", [])]}))

    async def assign(self, *job_ids: str) -> None:
        await self.ws.send(json.dumps({"type": "assign", "jobs": [
            {"id": job_id, "spec": "hold", "checksum": "x", "queue": "default", "args": {},
             "attempt": 1, "priority": 0, "visibility_timeout": 60.0,
             "enqueued_at": "2026-01-01T00:00:00Z"} for job_id in job_ids]}))

    async def next_with_results(self, timeout: float = 5.0) -> dict[str, Any]:
        while True:
            frame = await asyncio.wait_for(self.frames.get(), timeout)
            if frame.get("results"):
                return frame


@pytest.fixture
async def peer_and_worker(tmp_path: Path):
    peer = Peer()
    server = await websockets.serve(peer.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    write_spec(tmp_path / "specs", "hold")
    release: dict[str, asyncio.Event] = {}
    # No prefetch: its line, sized by the run times seen, would move the capacity asked.
    worker = Worker(url=f"ws://127.0.0.1:{port}/work", specs_dir=tmp_path / "specs",
                    concurrency=5, reconnect=False, prefetch=0)

    @worker.handler("hold")
    async def hold(ctx: JobContext) -> str:
        await release.setdefault(ctx.id, asyncio.Event()).wait()
        return ctx.id

    task = asyncio.create_task(worker.run())
    await wait_until(lambda: peer.connected.is_set(), what="the worker to register")
    try:
        yield peer, worker, release
    finally:
        peer.ack_all = True
        worker.stop_now()
        server.close()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)


async def test_results_wait_for_the_ack_in_flight_then_leave_together(peer_and_worker):
    peer, worker, release = peer_and_worker
    jobs = [f"j{n}" for n in range(5)]
    for job_id in jobs:
        release[job_id] = asyncio.Event()
    await peer.assign(*jobs)
    await wait_until(lambda: len(worker.running_jobs) == 5, what="five running jobs")

    release["j0"].set()  # alone: nothing in flight, so it leaves at once
    first = await peer.next_with_results()
    assert [r["job_id"] for r in first["results"]] == ["j0"]

    for job_id in jobs[1:]:  # finish one by one while j0's ack is outstanding
        release[job_id].set()
        await wait_until(lambda: job_id not in worker.running_jobs, what=f"{job_id} done")
    with pytest.raises(TimeoutError):  # held back: no frame with results
        await peer.next_with_results(timeout=0.3)

    await peer.ack(first)
    second = await peer.next_with_results()
    assert sorted(r["job_id"] for r in second["results"]) == jobs[1:]
    assert second["capacity"] == 5  # the freed slots ride along


async def test_a_state_change_is_not_held_back_by_results_in_flight(peer_and_worker):
    peer, worker, release = peer_and_worker
    release["a"], release["b"] = asyncio.Event(), asyncio.Event()
    await peer.assign("a", "b")
    await wait_until(lambda: len(worker.running_jobs) == 2, what="two running jobs")
    release["a"].set()
    await peer.next_with_results()  # in flight, never acked
    worker.quiet()
    while True:  # the quiet status goes out at once, ack or no ack
        frame = await asyncio.wait_for(peer.frames.get(), 5)
        if frame["status"]["state"] == "quiet":
            break
    assert frame["capacity"] == 0
