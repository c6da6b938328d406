"""Flow-control rules: concurrency and rate limits per queue, spec and concurrency key. Pure.

A ``LimitRule`` belongs to a scope, ``("queue", name)`` or ``("spec", name)``; its limit
is named ``queue:emails`` or ``spec:send_email`` (``limit_name``). ``parse_rate`` reads
the rate shorthand of spec files and the CLI ("100/min", "5/s", "1000/h", "10/30s") or a
table ``{limit = 100, period = 60, burst = 10}``; ``check_rule`` refuses a rule that
makes no sense with ``Invalid("invalid_limit", ...)``, naming the field at fault.

The state of a rate is a ``Window``: the times of its last ``limit`` starts (a sliding
window, docs/flow-control.md), from which the next allowed start is read.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import msgspec

from rota.base.errors import Invalid

MAX_PERIOD = 86400.0  # seconds: a rate's period is at most a day
SCOPE_KINDS = ("queue", "spec")
UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
         "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}
_SHORTHAND = re.compile(r"^\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([A-Za-z]+)\s*$")


class Rate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    limit: int  # >= 1: at most ``limit`` starts in ANY window of ``period`` seconds (sliding)
    period: float  # seconds, > 0, <= 86400
    burst: int | None = None  # None = limit; else at most ``burst`` back to back, then spaced
    #                          evenly (period / limit apart): smoothing on top of the window

    def text(self) -> str:
        """The shorthand, as people write it: "100/min", "10/30s" (with ", burst 5")."""
        period = self.period
        unit = next((f"{name}" for name, secs in (("h", 3600.0), ("min", 60.0), ("s", 1.0))
                     if period == secs), None)
        if unit is None:
            unit = f"{period:g}s"
        burst = "" if self.burst is None else f" burst {self.burst}"
        return f"{self.limit}/{unit}{burst}"

    @property
    def spacing(self) -> float:
        """Seconds between starts once a burst is spent (0: no spacing asked)."""
        return 0.0 if self.burst is None or self.burst >= self.limit else self.period / self.limit


class LimitRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    concurrency: int | None = None  # running (reserved) jobs of the scope, fleet-wide
    rate: Rate | None = None  # starts of the scope
    key_concurrency: int | None = None  # per concurrency_key within the scope
    key_rate: Rate | None = None  # per concurrency_key within the scope

    def empty(self) -> bool:
        return (self.concurrency is None and self.rate is None and self.key_concurrency is None
                and self.key_rate is None)


Scope = tuple[str, str]  # ("queue" | "spec", name)


def limit_name(scope: Scope) -> str:
    """``queue:emails``, ``spec:send_email``: how a limit is named in logs, views and guards."""
    return f"{scope[0]}:{scope[1]}"


def parse_rate(value: Any) -> Rate:
    """A ``Rate`` from the shorthand ("100/min", "5/s", "1000/h", "10/30s") or a table
    ``{limit, period, burst}``; checked (``check_rate``)."""
    if isinstance(value, Rate):
        rate = value
    elif isinstance(value, str):
        match = _SHORTHAND.match(value)
        if match is None or match.group(3).lower() not in UNITS:
            raise Invalid("invalid_limit", f"rate {value!r}: expected N/unit, e.g. '100/min',"
                          " '5/s', '1000/h' or '10/30s' (units: s, min, h, d)")
        count, every, unit = match.groups()
        period = float(every or 1) * UNITS[unit.lower()]
        rate = Rate(limit=int(count), period=period)
    elif isinstance(value, dict):
        try:
            rate = msgspec.convert(value, Rate)
        except msgspec.ValidationError as exc:
            raise Invalid("invalid_limit", f"rate {value!r}: {exc}") from None
    else:
        raise Invalid("invalid_limit", f"rate {value!r}: expected a string such as '100/min'"
                      " or a table {limit, period, burst}")
    check_rate(rate, "rate")
    return rate


def check_rate(rate: Rate, field: str) -> None:
    if isinstance(rate.limit, bool) or rate.limit < 1:
        raise Invalid("invalid_limit", f"{field}: limit must be at least 1, got {rate.limit}")
    if not rate.period > 0 or rate.period > MAX_PERIOD:
        raise Invalid("invalid_limit", f"{field}: period must be above 0 and at most"
                      f" {MAX_PERIOD:g} seconds (a day), got {rate.period:g}")
    if rate.burst is not None:
        if rate.burst < 1:
            raise Invalid("invalid_limit", f"{field}: burst must be at least 1, got {rate.burst}")
        if rate.burst > rate.limit:
            raise Invalid("invalid_limit", f"{field}: burst {rate.burst} is above the limit"
                          f" {rate.limit}: a burst is at most the limit")


def check_rule(rule: LimitRule) -> None:
    """Refuse a rule that makes no sense: a limit of 0 or below, a bad rate, or no limit."""
    for field in ("concurrency", "key_concurrency"):
        value = getattr(rule, field)
        if value is not None and (isinstance(value, bool) or value < 1):
            raise Invalid("invalid_limit", f"{field} must be at least 1, got {value}")
    for field in ("rate", "key_rate"):
        rate = getattr(rule, field)
        if rate is not None:
            check_rate(rate, field)
    if rule.empty():
        raise Invalid("invalid_limit", "a limit sets at least one of concurrency, rate,"
                      " key_concurrency, key_rate")


def check_scope(kind: str, name: str) -> Scope:
    if kind not in SCOPE_KINDS:
        raise Invalid("invalid_limit", f"unknown scope kind {kind!r}: expected queue or spec")
    return (kind, name)


class Window:
    """A rate's recent starts (monotonic times, oldest first, at most ``limit`` kept): the
    next start is allowed when fewer than ``limit`` fall in the last ``period`` and, with
    a burst, when the burst allows it: a burst of ``burst`` starts may go back to back,
    then they are spaced ``period / limit`` apart (a GCRA, whose one number ``tat`` is
    replayed from the starts, so stored starts are all a restart needs)."""

    __slots__ = ("rate", "starts", "tat")

    def __init__(self, rate: Rate, starts: Any = ()) -> None:
        self.rate = rate
        self.starts: collections.deque[float] = collections.deque(maxlen=rate.limit)
        self.tat = float("-inf")  # the burst's theoretical arrival time
        for at in sorted(starts)[-rate.limit:]:
            self.start(at)

    def next_start(self, now: float) -> float:
        """The earliest moment (>= now) a start is allowed."""
        rate, starts = self.rate, self.starts
        at = now
        if len(starts) >= rate.limit:
            at = max(at, starts[0] + rate.period)
        spacing = rate.spacing
        if spacing:
            at = max(at, self.tat - ((rate.burst or rate.limit) - 1) * spacing)
        return at

    def allows(self, now: float) -> bool:
        return self.next_start(now) <= now

    def start(self, now: float) -> None:
        self.starts.append(now)
        spacing = self.rate.spacing
        if spacing:
            self.tat = max(self.tat, now) + spacing

    def in_window(self, now: float) -> int:
        """Starts within the last ``period``."""
        edge = now - self.rate.period
        return sum(1 for at in self.starts if at > edge)
