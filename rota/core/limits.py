"""Flow-control rules: the limit rule of a queue or spec (concurrency, rate, per concurrency key), its rates, and their checks. Pure.

(WIRE's branch holds only the model and its checks, with the names and signatures of
CORE's module, which adds the limiter; rota/core/rulebook.py merges the rules in force.)
"""

from __future__ import annotations

from typing import Any

import msgspec

from rota.base.errors import Invalid
from rota.base.flow import MAX_PERIOD as MAX_PERIOD  # a rate's period is at most a day
from rota.base.flow import rate_parts

SCOPE_KINDS = ("queue", "spec")


class Rate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    limit: int  # >= 1: at most `limit` starts in any window of `period` seconds (sliding)
    period: float  # seconds, > 0, <= 86400
    burst: int | None = None  # None = limit; else at most `burst` back to back, then spaced


class LimitRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    concurrency: int | None = None  # running (reserved) jobs of the scope, fleet-wide
    rate: Rate | None = None  # starts of the scope
    key_concurrency: int | None = None  # per concurrency_key within the scope
    key_rate: Rate | None = None  # per concurrency_key within the scope

    def empty(self) -> bool:
        return self == LimitRule()


Scope = tuple[str, str]  # ("queue", name) | ("spec", name)


def limit_name(scope: Scope) -> str:
    """How a limit is named: ``spec:send_email``, ``queue:emails``."""
    return f"{scope[0]}:{scope[1]}"


def parse_rate(value: Any) -> Rate:
    """A rate from its shorthand ("100/min", "5/s", "10/30s"), a table or a Rate;
    422 invalid_limit if it is none."""
    if isinstance(value, str):
        try:
            return Rate(*rate_parts(value))
        except ValueError as exc:
            raise Invalid("invalid_limit", f"rate {exc}") from None
    try:
        rate = value if isinstance(value, Rate) else msgspec.convert(value, Rate)
    except msgspec.ValidationError as exc:
        raise Invalid("invalid_limit", f"rate {value!r}: {exc}") from None
    check_rate(rate, "rate")
    return rate


def check_rate(rate: Rate, field: str) -> None:
    """422 invalid_limit for a rate no window can hold, naming ``field``."""
    if rate.limit < 1:
        raise Invalid("invalid_limit", f"{field} must allow 1 start at least, not {rate.limit}")
    if not 0 < rate.period <= MAX_PERIOD:
        raise Invalid("invalid_limit", f"{field} must have a period over 0 and at most a day"
                      f" ({MAX_PERIOD:g} s), not {rate.period:g} s")
    if rate.burst is not None and not 1 <= rate.burst <= rate.limit:
        raise Invalid("invalid_limit", f"{field} must have a burst of 1 to its limit"
                      f" {rate.limit}, not {rate.burst}")


def check_rule(rule: LimitRule) -> None:
    """422 invalid_limit naming what no scope can be held to: a limit of 0 or below, a
    rate no window holds, or no limit at all."""
    for field in ("concurrency", "key_concurrency"):
        count = getattr(rule, field)
        if count is not None and count < 1:
            raise Invalid("invalid_limit", f"{field} must be 1 or more, not {count}")
    for field in ("rate", "key_rate"):
        rate = getattr(rule, field)
        if rate is not None:
            check_rate(rate, field)
    if rule.empty():
        raise Invalid("invalid_limit", "a rule must set concurrency, rate, key_concurrency"
                      " or key_rate")


def check_scope(kind: str, name: str) -> Scope:
    """A scope from its kind and name; 422 invalid_limit for a kind Rota does not know."""
    if kind not in SCOPE_KINDS:
        raise Invalid("invalid_limit", f"a limit's scope is queue or spec, not {kind[:40]!r}")
    return kind, name
