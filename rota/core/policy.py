"""Pure job-lifecycle policy: what happens to a job when an attempt ends without success.

No I/O and no clock of its own: callers pass ``now`` and a random number, so every
rule here is tested with plain values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rota.base.ojs import OjsExtras, OjsPolicy
from rota.core.model import JOB_STATES, TERMINAL_STATES, WAITING_STATES, Limits, shared_limits

__all__ = ["JOB_STATES", "TERMINAL_STATES", "WAITING_STATES", "Limits", "Ending", "Decision",
           "backoff", "after_attempt", "non_retryable", "ojs_limits",
           "TokenBucket", "RateLimits"]

# How an attempt ended. Only "failed" (the handler reported an error) and "timeout" (it
# ran past its job's execution timeout, an OJS option) count toward max_fails and back
# off; every attempt counts toward max_attempts, except one "released" (its worker gave
# it back unstarted), which the caller takes off the attempts used.
Ending = Literal["failed", "timeout", "visibility_timeout", "worker_death", "shutdown",
                 "cancelled", "released"]
FAILING: frozenset[str] = frozenset({"failed", "timeout"})


@dataclass(frozen=True, slots=True)
class Decision:
    state: Literal["available", "retryable", "discarded", "cancelled"]
    run_at: float | None = None  # when a retryable job becomes available again
    reason: str = ""  # why a job was discarded
    dead_letter: bool = False  # discarded by failure under Limits.dead_letter


def backoff(failures: int, limits: Limits, rand: float) -> float:
    """Seconds before retry number ``failures`` (1-based), from ``rand`` in [0, 1).

    Rota's default: base doubling on each failure, capped at backoff_max, jittered over
    [half, full] so that a burst of failures does not retry in lockstep. An OJS policy
    may grow it linearly (base × n) or by another coefficient, and jitter it over
    [½, 1½]× (capped again) or not at all."""
    n = max(1, failures)
    if limits.linear:
        raw = limits.backoff_base * n
    else:
        try:
            raw = limits.backoff_base * limits.coefficient ** (n - 1)
        except OverflowError:  # a job allowed thousands of attempts: the late ones wait the cap
            raw = limits.backoff_max
    full = min(limits.backoff_max, raw)
    if limits.jitter == "none":
        return full
    if limits.jitter == "ojs":
        return min(limits.backoff_max, full * (0.5 + rand))
    return full * (0.5 + rand / 2.0)


def non_retryable(limits: Limits, names: tuple[str | None, ...]) -> str | None:
    """The first of the error's ``names`` (its type, its code) that one of the limits'
    non_retryable entries matches; None if none does. As ojs-retry §6.2 says: an entry
    matches itself exactly, and one ending in ``.*`` every name that starts with what
    comes before the ``*`` ("auth.*": "auth.expired", not "auth" nor "authx"). Plain
    string tests, never a regular expression: a producer's pattern cannot stall the loop."""
    for entry in limits.non_retryable:
        prefix = entry[:-1] if entry.endswith(".*") else None
        for name in names:
            if name and (name == entry or (prefix is not None and name.startswith(prefix))):
                return name
    return None


def ojs_limits(limits: Limits, extras: OjsExtras | None) -> Limits:
    """An OJS job's limits: those of its spec (or of the columns it was stored with) with
    its retry policy's options over them, and OJS's defaults for the options Rota's specs
    do not have (jitter over [½, 1½]×, ojs-retry §8). A Rota job's (``extras`` None) as
    they are. The same when a job is made and when its row is loaded again."""
    if extras is None:
        return limits
    policy = extras.policy or OjsPolicy()
    return shared_limits(
        limits.max_attempts, limits.max_fails,
        limits.backoff_base if policy.backoff_base is None else policy.backoff_base,
        limits.backoff_max if policy.backoff_max is None else policy.backoff_max,
        limits.max_worker_deaths,
        coefficient=limits.coefficient if policy.coefficient is None else policy.coefficient,
        linear=policy.linear, jitter="ojs" if policy.jitter is None else policy.jitter,  # type: ignore[arg-type]
        non_retryable=tuple(policy.non_retryable), dead_letter=policy.dead_letter)


def after_attempt(*, ending: Ending, retryable: bool, attempts_used: int, fails: int,
                  limits: Limits, expires_at: float | None, cancel_requested: bool,
                  now: float, rand: float, deaths: int = 0,
                  error_names: tuple[str | None, ...] = ()) -> Decision:
    """Where a job goes when its attempt ended without completing.

    ``attempts_used`` counts this attempt; ``fails`` counts explicit failures including
    this one when ``ending`` is "failed" or "timeout"; ``deaths`` counts the attempts in
    a row, this one included, that ended in ``worker_death``; ``error_names`` are the
    error's type and code, for the limits' non_retryable patterns.
    """
    if cancel_requested or ending == "cancelled":
        return Decision("cancelled")
    if expires_at is not None and now >= expires_at:
        return Decision("discarded", reason="expired")
    dead = limits.dead_letter  # every discard below is by failure: the dead letter keeps it
    if ending == "worker_death" and deaths >= limits.max_worker_deaths:
        # A job that takes down every worker that runs it must not reach the next one.
        return Decision("discarded", reason=f"poison: its worker died {deaths} time(s) in a"
                        f" row, max_worker_deaths is {limits.max_worker_deaths}", dead_letter=dead)
    failing = ending in FAILING
    if failing and not retryable:
        return Decision("discarded", reason="error is not retryable", dead_letter=dead)
    if failing and limits.non_retryable and (name := non_retryable(limits, error_names)):
        return Decision("discarded", reason=f"error {name} is non_retryable", dead_letter=dead)
    if failing and limits.max_fails is not None and fails >= limits.max_fails:
        return Decision("discarded", reason=f"failed {fails} time(s), max_fails is"
                        f" {limits.max_fails}", dead_letter=dead)
    if attempts_used >= limits.max_attempts:
        return Decision("discarded", reason=f"used {attempts_used} attempt(s), max_attempts is"
                        f" {limits.max_attempts}", dead_letter=dead)
    if failing:
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
