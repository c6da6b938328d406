"""Pure job-lifecycle policy: what happens to a job when an attempt ends without success.

No I/O and no clock of its own: callers pass ``now`` and a random number, so every
rule here is tested with plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rota.core.model import JOB_STATES, TERMINAL_STATES, WAITING_STATES, Limits

__all__ = ["JOB_STATES", "TERMINAL_STATES", "WAITING_STATES", "Limits", "Ending", "Decision",
           "backoff", "after_attempt", "TokenBucket", "RateLimits"]

# How an attempt ended. Only "failed" (the handler reported an error) counts toward
# max_fails; every attempt counts toward max_attempts, except one "released" (its worker
# gave it back unstarted), which the caller takes off the attempts used.
Ending = Literal["failed", "visibility_timeout", "worker_death", "shutdown", "cancelled",
                 "released"]


@dataclass(frozen=True, slots=True)
class Decision:
    state: Literal["available", "retryable", "discarded", "cancelled"]
    run_at: float | None = None  # when a retryable job becomes available again
    reason: str = ""  # why a job was discarded


def backoff(failures: int, limits: Limits, rand: float) -> float:
    """Seconds before retry number ``failures`` (1-based): exponential, capped, and
    jittered over [half, full] so that a burst of failures does not retry in lockstep."""
    # The exponent stops at 1023, where 2.0 ** n is still a float (past it, OverflowError):
    # a job allowed thousands of attempts waits backoff_max between the late ones.
    doubling = 2.0 ** min(max(0, failures - 1), 1023)
    full = min(limits.backoff_max, limits.backoff_base * doubling)
    return full * (0.5 + rand / 2.0)


def after_attempt(*, ending: Ending, retryable: bool, attempts_used: int, fails: int,
                  limits: Limits, expires_at: float | None, cancel_requested: bool,
                  now: float, rand: float, deaths: int = 0) -> Decision:
    """Where a job goes when its attempt ended without completing.

    ``attempts_used`` counts this attempt; ``fails`` counts explicit failures including
    this one when ``ending`` is "failed"; ``deaths`` counts the attempts in a row, this
    one included, that ended in ``worker_death``.
    """
    if cancel_requested or ending == "cancelled":
        return Decision("cancelled")
    if expires_at is not None and now >= expires_at:
        return Decision("discarded", reason="expired")
    if ending == "worker_death" and deaths >= limits.max_worker_deaths:
        # A job that takes down every worker that runs it must not reach the next one.
        return Decision("discarded", reason=f"poison: its worker died {deaths} time(s) in a"
                        f" row, max_worker_deaths is {limits.max_worker_deaths}")
    if ending == "failed" and not retryable:
        return Decision("discarded", reason="error is not retryable")
    if ending == "failed" and limits.max_fails is not None and fails >= limits.max_fails:
        return Decision("discarded", reason=f"failed {fails} time(s), max_fails is {limits.max_fails}")
    if attempts_used >= limits.max_attempts:
        return Decision("discarded",
                        reason=f"used {attempts_used} attempt(s), max_attempts is {limits.max_attempts}")
    if ending == "failed":
        return Decision("retryable", run_at=now + backoff(fails, limits, rand))
    # The job did not fail on its own: the worker died, stalled or shut down. Run it
    # again at once (preemptive recovery) rather than after a backoff.
    return Decision("available")


@dataclass(slots=True)
class TokenBucket:
    """A rate limit: ``rate`` events a second on average, at most ``burst`` at once.
    The caller says what time it is."""

    rate: float
    burst: int
    level: float | None = None  # tokens left (negative: borrowed); starts full
    at: float = 0.0

    def _refill(self, now: float) -> float:
        if self.level is None:
            self.level = float(self.burst)
        else:
            self.level = min(float(self.burst), self.level + max(0.0, now - self.at) * self.rate)
        self.at = now
        return self.level

    def take(self, now: float) -> bool:
        """Spend one token if there is one (True), else refuse (False)."""
        level = self._refill(now)
        if level < 1.0:
            return False
        self.level = level - 1.0
        return True

    def wait(self, now: float, cost: float = 1.0) -> float:
        """Spend ``cost`` tokens, borrowing them if too few are left: the seconds the caller must
        pause before going on (0.0 when it is within the limit). Pausing for that long
        throttles a sender to ``rate`` without refusing anything it sent."""
        level = self._refill(now) - cost
        self.level = level
        return 0.0 if level >= 0.0 else -level / self.rate


class RateLimits:
    """Each worker's rate-limit buckets (frames, bytes), the same on every connection it
    opens, for at most ``keep`` workers: the least recently used go first."""

    def __init__(self, frames: tuple[float, int], data: tuple[float, int], keep: int) -> None:
        self.frames, self.data, self.keep = frames, data, keep
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}  # by worker id

    def of(self, worker_id: str) -> tuple[TokenBucket, TokenBucket]:
        buckets = self._buckets.pop(worker_id, None)
        if buckets is None:
            buckets = (TokenBucket(*self.frames), TokenBucket(*self.data))
        self._buckets[worker_id] = buckets  # the most recently used, last
        if len(self._buckets) > self.keep:
            self._buckets.pop(next(iter(self._buckets)))
        return buckets
