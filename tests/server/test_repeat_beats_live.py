"""Repeated heartbeats on a live server: a frame the same as the last but for its seq is
answered without decoding it (rota/server/sessions.py, ``Heartbeats.repeat``), and a
worker sees no difference: every beat acked in order, a changed beat taking effect, a
seq that does not rise refused as ever."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import RawWorker, closed_with, heartbeat


def compact(worker: RawWorker, **sections: Any) -> str:
    """The next beat, laid out as the SDK's encoder writes it (type, then seq)."""
    frame = json.dumps(heartbeat(worker.seq, worker.worker_id, **sections),
                       separators=(",", ":"))
    worker.seq += 1
    return frame


@pytest.fixture
def counted(live: Live) -> list[int]:
    """The seqs the coordinator answered as repeats (its own method, watched)."""
    coordinator = live.coordinator
    answered: list[int] = []
    original = coordinator.repeat

    def repeat(conn: int, worker_id: str, seq: int, now: Any) -> bool:
        taken = original(conn, worker_id, seq, now)
        if taken:
            answered.append(seq)
        return taken

    coordinator.repeat = repeat  # type: ignore[method-assign]
    return answered


async def test_repeats_are_acked_in_order_and_a_changed_beat_takes_effect(
        live: Live, connect, tmp_path: Path, counted: list[int]):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    worker = await connect("w1")
    await worker.register([echo], concurrency=1, capacity=0)
    job = await live.enqueue("echo")
    idle = {"capacity": 0, "status": {"state": "running"}}
    for _ in range(10):
        await worker.send(compact(worker, **idle))
        assert (await worker.expect("ack"))["seq"] == worker.seq - 1
    assert counted == list(range(2, 11))  # all but the first, which was decoded in full
    view = next(w for w in (await live.http.get("/workers")).json()["workers"]
                if w["id"] == "w1")
    assert view["heartbeats"] == 11 and view["capacity"] == 0
    await worker.send(compact(worker, capacity=1, status={"state": "running"}))
    [copy] = await worker.jobs(1)  # the new capacity is heard: the job goes out
    assert copy["id"] == job["id"]
    await worker.expect("ack")
    holding = {"capacity": 0, "status": {"state": "running", "active_job_ids": [job["id"]]}}
    before = len(counted)
    for _ in range(3):
        await worker.send(compact(worker, **holding))
        await worker.expect("ack")
    assert len(counted) == before  # a worker holding a job is heard in full (its lease)
    await worker.complete(copy)
    assert (await live.wait_state(job["id"], "completed"))["state"] == "completed"


async def test_a_repeat_whose_seq_does_not_rise_is_refused(live: Live, connect, tmp_path: Path,
                                                           counted: list[int]):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    worker = await connect("w1")
    await worker.register([echo], concurrency=1)
    for _ in range(3):
        await worker.send(compact(worker, capacity=1, status={"state": "running"}))
        await worker.expect("ack")
    assert counted
    worker.seq -= 1  # the last seq again: the same frame, byte for byte
    await worker.send(compact(worker, capacity=1, status={"state": "running"}))
    error = await worker.expect("error")
    assert error["code"] == "seq_not_increasing"
    assert await closed_with(worker) == 1008
