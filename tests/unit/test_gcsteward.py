"""The collector's steward (rota/server/gcsteward.py): its policy, and the shell against
the real collector."""

from __future__ import annotations

import asyncio
import gc

from rota.server.gcsteward import SLOW, Steward, decide


def test_a_slow_full_pass_freezes_a_quick_one_does_not():
    assert decide(SLOW * 2, 5000, None) == "freeze"
    assert decide(SLOW / 2, 5000, None) is None
    assert decide(None, 5000, None) is None  # a periodic look alone never freezes


def test_connections_halved_since_the_freeze_thaw():
    assert decide(None, 2400, 5000) == "thaw"
    assert decide(SLOW * 2, 2400, 5000) == "thaw"  # garbage first: the pass will see it
    assert decide(None, 2600, 5000) is None
    assert decide(SLOW * 2, 2600, 5000) == "freeze"  # more came since: freeze them too


async def test_the_steward_freezes_after_a_slow_pass_and_thaws_when_connections_go():
    connections = [1000]
    steward = Steward(asyncio.get_running_loop(), lambda: connections[0])
    before = gc.get_freeze_count()
    steward.start()
    try:
        steward._observe("start", {"generation": 2})
        steward._began -= 1.0  # as if the pass took a second
        steward._observe("stop", {"generation": 2, "collected": 0, "uncollectable": 0})
        for _ in range(10):
            if steward.freezes:
                break
            await asyncio.sleep(0)  # the action runs on the loop, at its next turn
        assert steward.freezes == 1 and steward.frozen_at == 1000
        assert gc.get_freeze_count() > before
        connections[0] = 400
        steward.look()
        assert steward.frozen_at is None and gc.get_freeze_count() == 0
    finally:
        steward.stop()
        gc.unfreeze()
    assert steward._observe not in gc.callbacks
