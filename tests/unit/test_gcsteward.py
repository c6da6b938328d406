"""The collector's steward (rota/server/gcsteward.py): its policy, and the shell against
the real collector."""

from __future__ import annotations

import asyncio
import gc

from rota.server.gcsteward import SLOW, Steward, decide


def test_a_slow_full_pass_freezes_a_quick_one_does_not():
    assert decide(SLOW * 2, None, 0) == "freeze"
    assert decide(SLOW / 2, None, 0) is None
    assert decide(None, None, 0) is None  # a periodic look alone never freezes


def test_half_the_frozen_connections_closed_since_thaw():
    assert decide(None, 5000, 2500) == "thaw"  # gone, or replaced one for one (churn)
    assert decide(SLOW * 2, 5000, 2500) == "thaw"  # garbage first: the pass will see it
    assert decide(None, 5000, 2499) is None
    assert decide(SLOW * 2, 5000, 100) == "freeze"  # more came since: freeze them too
    assert decide(None, 0, 0) is None and decide(None, 0, 1) == "thaw"


async def test_the_steward_freezes_after_a_slow_pass_and_thaws_when_connections_go():
    connections, closed = [1000], [7]
    steward = Steward(asyncio.get_running_loop(), lambda: connections[0], lambda: closed[0])
    before = gc.get_freeze_count()
    steward.start()
    try:
        steward._observe("start", {"generation": 2})
        steward._began -= 1.0  # as if the pass took a second
        steward._observe("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
        for _ in range(10):
            if steward.freezes:
                break
            await asyncio.sleep(0)  # noqa: sleep-ok  (one turn: the action runs on the loop then)
        assert steward.freezes == 1 and steward.frozen_at == 1000
        assert gc.get_freeze_count() > before
        closed[0] += 499
        steward.look()
        assert steward.frozen_at == 1000  # 499 closed of 1,000: not yet
        closed[0] += 1
        steward.look()
        assert steward.frozen_at is None and gc.get_freeze_count() == 0
    finally:
        steward.stop()
        gc.unfreeze()
    assert steward._observe not in gc.callbacks
