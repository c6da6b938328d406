"""The garbage-collector steward (rota/server/gcsteward.py) on a real
server: what a closed /work connection leaves for the collector, once frozen.

A closed connection's server-side transport (and its socket) is cyclic garbage: only a
full pass reclaims it. Frozen, it is reclaimed only after a thaw, and the steward thaws
only when the connections fall to half: a fleet that churns at a steady size (workers
restarted in a rolling deploy, flaky networks) leaks every frozen connection's
transport for good."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from conftest import Live
from helpers import wait_until
from wirepeer import Opener, gone
from wirepeer import fake, log, wire  # noqa: F401 (fixtures)

from rota.server.edge import LeanWebSocket
from rota.server.gcsteward import Steward


def lean_protocols(live: Live) -> list[LeanWebSocket]:
    return [c for c in live.server.server_state.connections if isinstance(c, LeanWebSocket)]


async def test_connections_frozen_then_replaced_one_for_one_are_collected(
        wire: Live, fake: Opener) -> None:
    n = 20
    steward = Steward(asyncio.get_running_loop(), lambda: len(wire.server.server_state.connections),
                      lambda: LeanWebSocket.closed)
    first = [await fake(f"churn-a{i}") for i in range(n)]
    for peer in first:
        await peer.register()
    await wait_until(lambda: len(lean_protocols(wire)) >= n, what="the first connections")
    refs = [weakref.ref(p.transport) for p in lean_protocols(wire)]  # the server's side
    gc.collect()
    steward._act("freeze", 0.5)  # as after a slow full pass, with n connections open
    try:
        for peer in first:  # a churn: each worker goes and another comes in its place
            peer.abort()
        for i in range(n):
            await gone(wire, f"churn-a{i}")
        second = [await fake(f"churn-b{i}") for i in range(n)]
        for peer in second:
            await peer.register()
        steward.look()  # the periodic look: the number of connections did not fall
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
        assert alive == 0, f"{alive} of {n} closed connections' transports still in memory"
    finally:
        gc.unfreeze()
