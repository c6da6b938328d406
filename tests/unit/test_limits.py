"""Flow-control rules (rota/core/limits.py): the rate shorthand, validation, windows."""

from __future__ import annotations

import pytest

from rota.base.errors import Invalid
from rota.core.limits import LimitRule, Rate, Window, check_rule, parse_rate


@pytest.mark.parametrize("text, rate", [
    ("100/min", Rate(100, 60.0)), ("5/s", Rate(5, 1.0)), ("1000/h", Rate(1000, 3600.0)),
    ("10/30s", Rate(10, 30.0)), ({"limit": 100, "period": 60, "burst": 10}, Rate(100, 60.0, 10)),
])
def test_rate_shorthand(text: object, rate: Rate) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("bad, words", [
    ("0/s", "limit must be at least 1, got 0"), ("5/fortnight", "expected N/unit"),
    ({"limit": 1, "period": 0}, "period must be above 0"), ("1/2d", "got 172800"),
    ({"limit": 2, "period": 1, "burst": 3}, "burst 3 is above the limit 2"),
    ({"limit": 1, "period": 1, "every": 1}, "unknown field `every`"), (7, "expected a string"),
])
def test_bad_rates_say_what_is_wrong(bad: object, words: str) -> None:
    with pytest.raises(Invalid) as caught:
        parse_rate(bad)
    assert caught.value.code == "invalid_limit" and words in str(caught.value)


def test_bad_rules() -> None:
    with pytest.raises(Invalid, match="key_concurrency must be at least 1, got 0"):
        check_rule(LimitRule(key_concurrency=0))
    with pytest.raises(Invalid, match="at least one of"):
        check_rule(LimitRule())
    check_rule(LimitRule(concurrency=3, key_rate=Rate(5, 1.0)))


def test_window_slides_and_bursts_then_spaces() -> None:
    window = Window(Rate(3, 10.0))
    for at in (0.0, 1.0, 2.0):
        assert window.allows(at)
        window.start(at)
    assert window.next_start(2.0) == 10.0  # the first start leaves the window then
    assert window.in_window(10.5) == 2
    spaced = Window(Rate(10, 10.0, burst=2))
    starts = []
    now = 0.0
    for _ in range(5):
        now = spaced.next_start(now)
        spaced.start(now)
        starts.append(now)
    assert starts == [0.0, 0.0, 1.0, 2.0, 3.0]  # two back to back, then 1 s apart
    assert Window(Rate(10, 10.0, burst=2), starts).next_start(3.0) == 4.0  # replayed
