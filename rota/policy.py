"""Pure job-lifecycle policy: what happens to a job when an attempt ends without success.

No I/O and no clock of its own: callers pass ``now`` and a random number, so every
rule here is tested with plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How an attempt ended. Only "failed" (the handler reported an error) counts toward
# max_fails; every attempt, whatever its end, counts toward max_attempts.
Ending = Literal["failed", "visibility_timeout", "worker_death", "shutdown", "cancelled"]

WAITING_STATES = frozenset({"scheduled", "available", "retryable"})
TERMINAL_STATES = frozenset({"completed", "discarded", "cancelled"})
JOB_STATES = ("scheduled", "available", "active", "retryable", "completed", "discarded",
              "cancelled")


@dataclass(frozen=True, slots=True)
class Limits:
    """A job's retry budget, from its spec with per-job overrides."""

    max_attempts: int
    max_fails: int | None
    backoff_base: float
    backoff_max: float


@dataclass(frozen=True, slots=True)
class Decision:
    state: Literal["available", "retryable", "discarded", "cancelled"]
    run_at: float | None = None  # when a retryable job becomes available again
    reason: str = ""  # why a job was discarded


def backoff(failures: int, limits: Limits, rand: float) -> float:
    """Seconds before retry number ``failures`` (1-based): exponential, capped, and
    jittered over [half, full] so that a burst of failures does not retry in lockstep."""
    full = min(limits.backoff_max, limits.backoff_base * 2.0 ** max(0, failures - 1))
    return full * (0.5 + rand / 2.0)


def after_attempt(*, ending: Ending, retryable: bool, attempts_used: int, fails: int,
                  limits: Limits, expires_at: float | None, cancel_requested: bool,
                  now: float, rand: float) -> Decision:
    """Where a job goes when its attempt ended without completing.

    ``attempts_used`` counts this attempt; ``fails`` counts explicit failures including
    this one when ``ending`` is "failed".
    """
    if cancel_requested or ending == "cancelled":
        return Decision("cancelled")
    if expires_at is not None and now >= expires_at:
        return Decision("discarded", reason="expired")
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
    level: float = -1.0  # tokens left; starts full
    at: float = 0.0

    def take(self, now: float) -> bool:
        """Spend one token if there is one (True), else refuse (False)."""
        if self.level < 0:
            self.level = float(self.burst)
        else:
            self.level = min(float(self.burst), self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True
