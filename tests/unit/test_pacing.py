"""Handshake pacing (rota/server/pacing.py): at most ``per_turn`` start in a turn of the
loop, the rest in later turns, in arrival order."""

from __future__ import annotations

import asyncio

from rota.server.pacing import Pacer


async def test_a_storm_is_spread_over_turns_in_arrival_order():
    loop = asyncio.get_running_loop()
    pacer = Pacer(per_turn=4)
    turn = [0]
    started: list[tuple[int, int]] = []  # (handshake, turn it started in)
    for n in range(10):
        pacer.admit(loop, lambda n=n: started.append((n, turn[0])))
    assert started == [(0, 0), (1, 0), (2, 0), (3, 0)] and pacer.deferred == 6
    for _ in range(5):
        turn[0] += 1
        await asyncio.sleep(0)  # noqa: sleep-ok  (one turn of the loop is what is tested)
    assert [n for n, _ in started] == list(range(10))
    per_turn: dict[int, int] = {}
    for _, at in started:
        per_turn[at] = per_turn.get(at, 0) + 1
    assert max(per_turn.values()) <= 4 and len(per_turn) >= 3


async def test_a_quiet_loop_starts_every_handshake_at_once():
    loop = asyncio.get_running_loop()
    pacer = Pacer(per_turn=4)
    started: list[int] = []
    for n in range(3):
        pacer.admit(loop, lambda n=n: started.append(n))
        await asyncio.sleep(0)  # noqa: sleep-ok  (a turn of the loop between handshakes)
    assert started == [0, 1, 2] and pacer.deferred == 0


def test_each_event_loop_has_its_own_pacer():
    from rota.server.pacing import pacer_for
    one, two = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert pacer_for(one) is pacer_for(one) and pacer_for(one) is not pacer_for(two)
    finally:
        one.close()
        two.close()
