"""An idle fleet's rounds: every heartbeat of a worker with free slots wakes a round, so a
round with nothing waiting must not look at the workers (10,000 of them took 41 ms)."""

from __future__ import annotations

import pytest

from rota.core.effects import Reserve
from rota.core.engine import Engine
from rota.core.ready import WorkerSlot

from test_engine import FakeClock, connect, enqueue, of
from test_engine import clock, engine  # noqa: F401  (fixtures)


def test_a_round_with_nothing_waiting_reads_no_worker(engine: Engine, clock: FakeClock,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for n in range(50):
        connect(engine, clock, worker=f"w{n}", conn=n + 1)

    def looked_at(self: WorkerSlot) -> int:
        raise AssertionError("an idle round looked at a worker")

    with monkeypatch.context() as patch:
        patch.setattr(WorkerSlot, "free", looked_at)
        assert engine.dispatch(clock()) == []
        engine.pause_queue("default", True, clock())
        enqueue(engine, clock)  # a job in a paused queue waits, and no worker is looked at
        assert engine.dispatch(clock()) == []
    engine.pause_queue("default", False, clock())  # resumed: a round finds it a worker
    [reserve] = of(Reserve, engine.dispatch(clock()))
    assert len(reserve.jobs) + len(reserve.claims) == 1
