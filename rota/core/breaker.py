"""The circuit breaker of one push endpoint: an endpoint that keeps failing is left
alone for a growing while, then tried with one delivery. Pure: every call says the
monotonic time.

Closed: deliveries flow; ``THRESHOLD`` faults within ``WINDOW`` seconds open it. Open: no
delivery for ``pause`` seconds (5 s at first, doubled at each failed trial, at most 5
minutes). Half-open: one delivery; its success closes the breaker (and the pause starts
from 5 s again), its fault opens it for twice as long.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

THRESHOLD = 5  # faults ...
WINDOW = 30.0  # ... within this many seconds open the breaker
FIRST_PAUSE = 5.0
MAX_PAUSE = 300.0
State = Literal["closed", "open", "half_open"]


@dataclass(slots=True)
class Breaker:
    state: State = "closed"
    faults: deque[float] = field(default_factory=deque)  # when (monotonic), in the window
    pause: float = FIRST_PAUSE  # the next opening's length
    until: float = 0.0  # open: when the trial may go
    opened: int = 0  # times opened (a gauge's companion)

    def fault(self, now: float) -> bool:
        """A delivery failed through the endpoint's fault. True if that opened it."""
        self.faults.append(now)
        while self.faults and self.faults[0] < now - WINDOW:
            self.faults.popleft()
        if self.state == "half_open" or (self.state == "closed"
                                         and len(self.faults) >= THRESHOLD):
            self.state, self.until = "open", now + self.pause
            self.pause = min(self.pause * 2, MAX_PAUSE)
            self.opened += 1
            return True
        return False

    def success(self) -> bool:
        """A delivery the endpoint answered as it should. True if that closed it: only a
        trial does (an answer to a delivery sent before it opened proves nothing new)."""
        if self.state != "half_open":
            return False
        self.state, self.pause = "closed", FIRST_PAUSE
        self.faults.clear()
        return True

    def tick(self, now: float) -> bool:
        """Open past its pause: half-open (True: it changed)."""
        if self.state == "open" and now >= self.until:
            self.state = "half_open"
            return True
        return False

    def room(self, limit: int) -> int:
        """Deliveries that may be in flight now, of ``limit``."""
        return limit if self.state == "closed" else 1 if self.state == "half_open" else 0

    def reason(self, now: float) -> str | None:
        """Why its jobs wait (None: they do not wait on it)."""
        if self.state == "closed":
            return None
        count = len(self.faults)
        errors = f"{count} error{'s' if count != 1 else ''} in {WINDOW:g} s"
        if self.state == "half_open":
            return f"endpoint failing: {errors}, trying one delivery now"
        return f"endpoint failing: {errors}, next try in {max(0.0, self.until - now):.0f} s"
