"""Flow control as people write it: a limit rule's fields, with rates as shorthand ("100/min") or tables, for spec files, the API and the CLI.

The core (rota/core/limits.py) turns a written rule into its ``LimitRule``; this is the
bottom layer's part, so that a spec file is checked wherever it is read (the CLI, the
worker SDK, the server) and gives one checksum everywhere.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from rota.base.protocol import MAX_COUNT

MAX_PERIOD = 86400.0  # a day: the longest window a rate counts over
MAX_LABELS = 16  # labels a job may require
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
UNITS = {"s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0,
         "h": 3600.0, "hour": 3600.0, "d": 86400.0, "day": 86400.0}
_SHORTHAND = re.compile(r"(\d+)\s*/\s*(\d{0,5}(?:\.\d{1,3})?)\s*([a-z]+)")
RATE_WORDS = "a rate such as 100/min, 5/s, 1000/h or 10/30s"
UNIT_WORDS = "units: " + ", ".join(UNITS)  # every unit the shorthand takes, as said in errors


def rate_parts(text: str) -> tuple[int, float]:
    """(limit, period in seconds) of a shorthand rate; ValueError in words if it is not one."""
    m = _SHORTHAND.fullmatch(text.strip())
    if m is None or m[3] not in UNITS:
        raise ValueError(f"must be {RATE_WORDS} ({UNIT_WORDS}), not {text[:40]!r}")
    if len(m[1]) > len(str(MAX_COUNT)) or int(m[1]) > MAX_COUNT:  # (no int() of 5,000 digits)
        raise ValueError(f"must allow at most {MAX_COUNT} starts per period:"
                         f" {m[1][:40]} is too large")
    limit, period = int(m[1]), float(m[2] or 1) * UNITS[m[3]]
    check_rate(limit, period, None)
    return limit, period


def check_rate(limit: int, period: float, burst: int | None) -> None:
    """ValueError in words for a rate no window can hold."""
    if not 1 <= limit <= MAX_COUNT:
        raise ValueError(f"must allow 1 to {MAX_COUNT} starts, not {limit}")
    if not 0 < period <= MAX_PERIOD:
        raise ValueError(f"must have a period over 0 and at most a day ({MAX_PERIOD:g} s),"
                         f" not {period:g} s")
    if burst is not None and burst > limit:
        raise ValueError(f"must have a burst of at most its limit {limit}, not {burst}")


class WrittenRate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A rate as a table: ``{limit = 100, period = 60, burst = 10}``."""

    limit: Count
    period: Annotated[float, msgspec.Meta(gt=0, le=MAX_PERIOD)]
    burst: Count | None = None

    def __post_init__(self) -> None:
        check_rate(self.limit, self.period, self.burst)


Rate = Annotated[str, msgspec.Meta(max_length=40)] | WrittenRate


class WrittenRule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A limit rule as written (a spec file's ``[limits]``, ``PUT /limits/{kind}/{name}``):
    the fields of rota/core/limits.py's ``LimitRule``, rates as shorthand or tables."""

    concurrency: Count | None = None
    rate: Rate | None = None
    key_concurrency: Count | None = None
    key_rate: Rate | None = None

    def __post_init__(self) -> None:
        for name, rate in (("rate", self.rate), ("key_rate", self.key_rate)):
            if isinstance(rate, str):
                try:
                    rate_parts(rate)
                except ValueError as exc:  # worded "<field> must ..." (wording.plainly)
                    raise ValueError(f".{name} {exc}") from None
