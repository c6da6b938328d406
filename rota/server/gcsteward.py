"""Keeping the garbage collector's full passes short when thousands of workers connect.

CPython's full collection walks every tracked object and holds the GIL meanwhile. Each
/work connection keeps a few dozen long-lived objects (its protocols, parser, session,
scope), so a server with 5,000 connections walked ~370,000 objects per full pass: 0.4 s
with the event loop stopped, and during a reconnect storm the collector runs a full pass
each time the long-lived objects grow by a quarter (measured: passes of 42, 80, 122,
180, 234 and 390 ms while 5,000 workers connected, each a "server stalled" warning).

The steward freezes (``gc.freeze``) what survives a slow full pass: those objects are
live, since the pass just found them reachable, and later passes skip them, so the next
pass walks only what came since. Frozen objects that become cyclic garbage later (a
connection that closes and whose parts refer to each other) are not reclaimed while
frozen; so once as many connections as half of those open at the last freeze have
closed since (workers gone, or replaced one for one in a rolling deploy), the steward
thaws everything, and the next full pass collects that garbage (one slow pass, after
which it freezes again). The policy is ``decide``, pure; the shell is ``Steward``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rota.server")
SLOW = 0.02  # seconds: a full pass slower than this freezes its survivors


def decide(full_pass: float | None, frozen_at: int | None, closed_since: int) -> str | None:
    """What to do after a collection (``full_pass``: a full pass's seconds, else None) or
    at a periodic look (None): "freeze", "thaw" or nothing. ``frozen_at``: connections
    open at the last freeze (None: nothing is frozen); ``closed_since``: connections
    closed since then."""
    if frozen_at is not None and closed_since * 2 >= max(frozen_at, 2):
        return "thaw"  # much of what was frozen may be garbage now: let a pass see it
    if full_pass is not None and full_pass > SLOW:
        return "freeze"
    return None


class Steward:
    """Watches the collector's passes (``gc.callbacks``) and acts on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, connections: Callable[[], int],
                 closed: Callable[[], int]) -> None:
        self.loop = loop
        self.connections = connections  # open now
        self.closed = closed  # closed in all, ever
        self.frozen_at: int | None = None
        self.closed_at = 0  # ``closed()`` at the last freeze
        self.freezes = 0
        self._began = 0.0
        self._due = False  # an action is scheduled on the loop

    def start(self) -> None:
        gc.callbacks.append(self._observe)

    def stop(self) -> None:
        if self._observe in gc.callbacks:
            gc.callbacks.remove(self._observe)

    def look(self) -> None:
        """A periodic look (the timer loop's storage watch calls it): thaw if due."""
        self._act(self._decide(None), None)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the collector, on whichever thread allocated: only note and hand over.
        if phase == "start":
            self._began = time.perf_counter()
        elif info.get("generation") == 2 and not self._due:
            took = time.perf_counter() - self._began
            if took > SLOW:
                self._due = True
                self.loop.call_soon_threadsafe(self._after_pass, took)

    def _after_pass(self, took: float) -> None:
        self._due = False
        self._act(self._decide(took), took)

    def _decide(self, took: float | None) -> str | None:
        return decide(took, self.frozen_at, self.closed() - self.closed_at)

    def _act(self, action: str | None, took: float | None) -> None:
        if action == "freeze":
            gc.freeze()
            if self.frozen_at is None:
                self.closed_at = self.closed()
            self.frozen_at = max(self.frozen_at or 0, self.connections())
            self.freezes += 1
            # (No count of the frozen in these lines: gc.get_freeze_count walks them all,
            # 10 ms at 1.2 million.)
            log.info("gc: a full pass took %.0f ms; its survivors are frozen, so later passes"
                     " skip them (connections=%d)", 1000 * (took or 0.0), self.connections())
        elif action == "thaw":
            gc.unfreeze()
            log.info("gc: %d connections closed since %d were frozen: thawed for the next"
                     " full pass", self.closed() - self.closed_at, self.frozen_at)
            self.frozen_at = None
