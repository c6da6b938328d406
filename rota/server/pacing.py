"""Pacing WebSocket handshakes: a reconnect storm is spread over turns of the event loop.

After a restart every worker reconnects at once. Each handshake costs the loop about a
millisecond of Python (the request parsed again by websockets, the ASGI scope, the app's
middleware and the session), and the loop handles everything that is ready in one turn:
2,000 handshakes ready together held it for seconds, in which no timer ran and no
connected worker's heartbeat was read. ``Pacer`` lets at most ``per_turn`` handshakes
start in a turn and the rest wait, in arrival order, for the next turns; between them
the loop runs its timers and reads the workers already connected.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import Callable

PER_TURN = 32  # handshakes started in one turn of the loop (~30 ms of work at most)


class Pacer:
    def __init__(self, per_turn: int = PER_TURN) -> None:
        self.per_turn = per_turn
        self.used = 0  # handshakes started this turn
        self.waiting: collections.deque[Callable[[], None]] = collections.deque()
        self.deferred = 0  # handshakes that waited for a later turn, in all
        self._armed = False

    def admit(self, loop: asyncio.AbstractEventLoop, start: Callable[[], None]) -> None:
        """Start a handshake now, or once its turn comes (after those waiting already)."""
        if not self.waiting and self.used < self.per_turn:
            self.used += 1
            self._arm(loop)
            start()
            return
        self.waiting.append(start)
        self.deferred += 1
        self._arm(loop)

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._armed:  # a callback queued now runs in the loop's next turn
            self._armed = True
            loop.call_soon(self._turn, loop)

    def _turn(self, loop: asyncio.AbstractEventLoop) -> None:
        self._armed = False
        self.used = 0
        while self.waiting and self.used < self.per_turn:
            self.used += 1
            self.waiting.popleft()()
        if self.waiting or self.used:
            self._arm(loop)  # the next turn starts afresh (and takes what still waits)


_PACERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Pacer] = weakref.WeakKeyDictionary()


def pacer_for(loop: asyncio.AbstractEventLoop) -> Pacer:
    """The loop's pacer: one per event loop (a process may run several, as the test
    suite's servers do), so that a handshake always starts on its own loop."""
    pacer = _PACERS.get(loop)
    if pacer is None:
        pacer = _PACERS[loop] = Pacer()
    return pacer
