"""Flow-control limits: the rule of a queue or spec (concurrency, rate, per concurrency key), parsed from what people write and merged from spec files and runtime settings. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from rota.base.errors import Invalid
from rota.base.flow import WrittenRate, WrittenRule, check_rate, rate_parts
from rota.base.specs import JobSpec


class Rate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    limit: int  # >= 1: at most `limit` starts in any window of `period` seconds (sliding)
    period: float  # seconds, > 0, <= 86400
    burst: int | None = None  # None = limit; else at most `burst` back to back, then spaced


class LimitRule(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    concurrency: int | None = None  # running (reserved) jobs of the scope, fleet-wide
    rate: Rate | None = None  # starts of the scope
    key_concurrency: int | None = None  # per concurrency_key within the scope
    key_rate: Rate | None = None  # per concurrency_key within the scope


Scope = tuple[str, str]  # ("queue", name) | ("spec", name)
SCOPE_KINDS = ("queue", "spec")


def parse_rate(value: str | WrittenRate | Mapping[str, Any] | Rate) -> Rate:
    """A rate from its shorthand ("100/min", "5/s", "10/30s") or table; 422 invalid_limit."""
    try:
        if isinstance(value, str):
            return Rate(*rate_parts(value))
        if isinstance(value, Mapping):
            value = msgspec.convert(value, WrittenRate)
        check_rate(value.limit, value.period, value.burst)
    except (ValueError, msgspec.ValidationError) as exc:
        raise Invalid("invalid_limit", f"rate {exc}") from None
    return Rate(value.limit, float(value.period), value.burst)


def rule_of(written: WrittenRule) -> LimitRule:
    """The rule a written one says (already checked as it was decoded)."""
    return check_rule(LimitRule(
        concurrency=written.concurrency, key_concurrency=written.key_concurrency,
        rate=None if written.rate is None else parse_rate(written.rate),
        key_rate=None if written.key_rate is None else parse_rate(written.key_rate)))


def check_rule(rule: LimitRule) -> LimitRule:
    """The rule, or 422 invalid_limit naming what no scope can be held to."""
    for name in ("concurrency", "key_concurrency"):
        count = getattr(rule, name)
        if count is not None and count < 1:
            raise Invalid("invalid_limit", f"{name} must be 1 or more, not {count}")
    for name in ("rate", "key_rate"):
        rate = getattr(rule, name)
        if rate is not None:
            try:
                check_rate(rate.limit, rate.period, rate.burst)
            except ValueError as exc:
                raise Invalid("invalid_limit", f"{name} {exc}") from None
    if rule == LimitRule():
        raise Invalid("invalid_limit", "a rule must set concurrency, rate, key_concurrency"
                      " or key_rate (to remove a limit, clear it)")
    return rule


def scope_of(kind: str, name: str) -> Scope:
    """A scope from its kind and name (the name already checked as a Name); 422 if the
    kind is none Rota knows."""
    if kind not in SCOPE_KINDS:
        raise Invalid("invalid_limit", f"a limit's scope is queue or spec, not {kind[:40]!r}"
                      " (as in queue:emails or spec:send_email)")
    return kind, name


def limit_name(scope: Scope) -> str:
    """How a limit is named: ``spec:send_email``, ``queue:emails``."""
    return f"{scope[0]}:{scope[1]}"


def spec_rules(specs: Mapping[str, JobSpec]) -> dict[Scope, LimitRule]:
    """The rules spec files declare (``[limits]``), by scope."""
    return {("spec", name): rule_of(spec.limits) for name, spec in specs.items()
            if spec.limits is not None and spec.limits != WrittenRule()}


def effective(specs: Mapping[str, JobSpec], runtime: Mapping[Scope, LimitRule]
              ) -> dict[Scope, LimitRule]:
    """Every rule in force: the spec files' defaults, each replaced by a runtime rule set
    for its scope (``rota limits set``, until ``rota limits clear``)."""
    return {**spec_rules(specs), **runtime}


def rate_text(rate: Rate) -> str:
    """A rate as the CLI shows it: ``100/60s``, ``5/1s burst 2``."""
    return f"{rate.limit}/{rate.period:g}s" + (f" burst {rate.burst}" if rate.burst else "")
