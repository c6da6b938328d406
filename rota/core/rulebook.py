"""The limits in force: a written rule (a spec file's ``[limits]``, an API body) made a ``LimitRule``, and spec files' rules overlaid by those set at runtime. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from rota.base.errors import Invalid
from rota.base.flow import WrittenRate, WrittenRule
from rota.base.specs import JobSpec
from rota.core.limits import LimitRule, Rate, Scope, check_rule, parse_rate

EMPTY = ("a rule must set concurrency, rate, key_concurrency or key_rate (to remove a"
         " limit, clear it)")


def _rate(written: str | WrittenRate | None) -> Rate | None:
    if written is None:
        return None
    if isinstance(written, str):
        return parse_rate(written)
    return Rate(written.limit, float(written.period), written.burst)


def rule_of(written: WrittenRule) -> LimitRule:
    """The rule a written one says (checked as it was decoded: rota/base/flow.py); 422
    invalid_limit for one that sets nothing."""
    rule = LimitRule(concurrency=written.concurrency, rate=_rate(written.rate),
                     key_concurrency=written.key_concurrency, key_rate=_rate(written.key_rate))
    if rule.empty():
        raise Invalid("invalid_limit", EMPTY)
    check_rule(rule)
    return rule


def spec_rules(specs: Mapping[str, JobSpec]) -> dict[Scope, LimitRule]:
    """The rules spec files declare (``[limits]``), by scope."""
    return {("spec", name): rule_of(spec.limits) for name, spec in specs.items()
            if spec.limits is not None}


def effective(specs: Mapping[str, JobSpec], runtime: Mapping[Scope, LimitRule]
              ) -> dict[Scope, LimitRule]:
    """Every rule in force: the spec files' defaults, each replaced by a runtime rule set
    for its scope (``rota limits set``, until ``rota limits clear``)."""
    return {**spec_rules(specs), **runtime}
