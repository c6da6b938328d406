"""The tick loop's rounds (rota/server/clockwork.py) on a real server: a schedule's
expression and zone are parsed once, not each round; a schedule whose jobs the intake
refuses counts no due ticks; a round's due schedules fire together (on each backend); a
round late through the last one's work misses no tick, one after a sleep does."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec

from rota.core import cron
from rota.server import clockwork


def rounds_of(live: Live) -> clockwork.Clockwork:
    """The server's Clockwork, its own loop stopped: each round is the test's."""
    for task in asyncio.all_tasks():
        if task.get_name() == "rota-cron":
            task.cancel()
    return live.coordinator.clockwork


@pytest.mark.both_backends  # (the fires share a transaction, each its row locked)
async def test_rounds_parse_once_refuse_first_and_fire_together(live: Live, tmp_path: Path,
                                                               monkeypatch):
    work = rounds_of(live)
    await live.push(write_spec(tmp_path / "specs", "echo", extra='[args.level]\ntype = "string"\n'))
    for n in range(3):
        answer = await live.http.put(f"/schedules/s{n}", json={
            "spec": "echo", "cron": "@every 1s", "args": {"level": "x"}})
        assert answer.status_code == 201
    answer = await live.http.put("/schedules/later", json={"spec": "echo", "cron": "@yearly",
                                                            "args": {"level": "x"}})
    await work.round()
    parsed: list[str] = []
    real_parse = cron.parse
    monkeypatch.setattr(cron, "parse", lambda text: parsed.append(text) or real_parse(text))
    submitted: list[int] = []  # how many fires were queued when each was submitted
    writer = live.coordinator.store.writer
    real_submit = writer.submit

    def submit(op: Any, linger: bool = False) -> asyncio.Future[Any]:
        future = real_submit(op, linger)
        pending.append(future)
        submitted.append(sum(not f.done() for f in pending))
        return future

    pending: list[asyncio.Future[Any]] = []
    monkeypatch.setattr(writer, "submit", submit)
    await asyncio.sleep(1.1)  # noqa: sleep-ok (wall time under test: a tick of each comes)
    await work.round()
    assert parsed == []  # nothing new to parse: the last round's timing serves
    assert max(submitted) == 3  # the three due fires went to the writer together

    # a schedule the intake refuses (its spec now requires another argument) waits, and
    # its due ticks are not counted while it does
    await live.push(write_spec(tmp_path / "specs", "echo", version="2",
                               extra='[args.kind]\ntype = "string"\n'))
    counted: list[str] = []
    real_due = clockwork.due
    monkeypatch.setattr(clockwork, "due", lambda timing, *a: counted.append("x")
                        or real_due(timing, *a))
    await asyncio.sleep(1.1)  # noqa: sleep-ok (wall time under test: a tick comes)
    await work.round()
    assert counted == [] and "its jobs are refused" in work.refused["s0"]


async def test_a_round_late_through_the_last_ones_work_misses_no_tick(live: Live,
                                                                      tmp_path: Path, caplog):
    work = rounds_of(live)
    await live.push(write_spec(tmp_path / "specs", "echo"))
    for name in ("busy", "slept"):
        await live.http.put(f"/schedules/{name}", json={
            "spec": "echo", "cron": "@every 1s", "misfire": "skip", "overlap": "allow"})
    await work.round()
    meant = time.time()  # as if the last round meant the next to come now, and ran past it
    await asyncio.sleep(2.3)  # noqa: sleep-ok (wall time: two ticks come, one over 1 s late)
    await live.http.post("/schedules/slept/pause")  # ("slept" is judged after a sleep)
    work._meant, work._busy = meant, True
    caplog.set_level(logging.INFO, "rota.cron")
    await work.round()
    assert (await live.http.get("/schedules/busy")).json()["run_count"] >= 2
    await live.http.post("/schedules/busy/pause")
    await live.http.post("/schedules/slept/resume")
    await work.round()
    await asyncio.sleep(2.3)  # noqa: sleep-ok (wall time under test: ticks pass)
    work._busy = False
    await work.round()
    missed = [r.getMessage().split()[2] for r in caplog.records if "cron miss" in r.getMessage()]
    assert missed == ["schedule=slept"]
