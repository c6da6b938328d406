"""Cron expressions and their fire times (ojs-cron §3-§5): pure, fed the time, never reads it.

``parse`` turns an expression (5 fields, 6 with leading seconds, ``@daily`` and friends,
``@every 1h30m``) into a ``Schedule``; ``zone`` checks an IANA time zone name;
``next_fires`` lists the next fire times after an instant, in epoch seconds.

DST (ojs-cron §5.2): a wall-clock time that a spring-forward skips does not fire that day;
one that a fall-back repeats fires once, at its first occurrence. The search walks whole
months and days that cannot match and only then the hours, minutes and seconds of a day
that can, so a yearly expression costs a few dozen steps, not half a million minutes.
"""

from __future__ import annotations

import calendar
import re
from fractions import Fraction
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (zoneinfo is imported where a zone is made: on Python 3.13 it loads
    from zoneinfo import ZoneInfo  # threading, which the core keeps out of its imports)

from rota.base.errors import Invalid

MONTHS = {name: i for i, name in enumerate(
    ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"), 1)}
WEEKDAYS = {name: i for i, name in enumerate(("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"))}

ALIASES = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
           "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
           "@hourly": "0 * * * *"}

# (name, low, high, names) per field, seconds first
_FIELDS = (("second", 0, 59, None), ("minute", 0, 59, None), ("hour", 0, 23, None),
           ("day of month", 1, 31, None), ("month", 1, 12, MONTHS),
           ("day of week", 0, 7, WEEKDAYS))

_UNITS = {"ms": Fraction(1, 1000), "s": Fraction(1), "m": Fraction(60), "h": Fraction(3600)}
# ASCII digits only: \d would take '١٠' (Arabic-Indic), which float() then reads as 10
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|h|m|s)")
MAX_EVERY = 365 * 86400  # seconds: '@every 8760h', a year; a longer one is refused

# a schedule that has not fired within this many years is taken never to fire again
# (the rarest real pattern, a fifth weekday of a February, recurs within 40 years)
HORIZON_YEARS = 50


def _bad(message: str) -> Invalid:
    return Invalid("invalid_cron", message)


@dataclass(frozen=True)
class Schedule:
    """A parsed expression. ``every`` is set (in seconds) for ``@every`` only; otherwise
    the sets hold the values each field allows (weekday 0 is Sunday)."""

    expression: str
    every: float | None = None
    seconds: frozenset[int] = frozenset()
    minutes: frozenset[int] = frozenset()
    hours: frozenset[int] = frozenset()
    months: frozenset[int] = frozenset()
    days: frozenset[int] = frozenset()          # plain days of the month
    last_day: bool = False                       # L in day of month
    nearest_weekdays: frozenset[int] = frozenset()  # 15W; 0 stands for LW
    weekdays: frozenset[int] = frozenset()       # plain days of the week
    last_weekdays: frozenset[int] = frozenset()  # 5L: the last Friday of the month
    nth_weekdays: frozenset[tuple[int, int]] = frozenset()  # 5#3: (weekday, n)
    dom_restricted: bool = False
    dow_restricted: bool = False

    def day_matches(self, day: date) -> bool:
        """Whether ``day`` is a firing day: when both day fields are restricted, either
        one matching is enough (the standard cron rule); a field that starts with '*'
        is not restricted, and then both must match, as in Vixie cron."""
        if day.month not in self.months:
            return False
        if self.dom_restricted and self.dow_restricted:
            return self._dom(day) or self._dow(day)
        return self._dom(day) and self._dow(day)  # an open field ('*', '*/2') still counts

    def _dom(self, day: date) -> bool:
        length = calendar.monthrange(day.year, day.month)[1]
        if day.day in self.days or (self.last_day and day.day == length):
            return True
        return any(_nearest_weekday(day.year, day.month, n, length) == day.day
                   for n in self.nearest_weekdays)

    def _dow(self, day: date) -> bool:
        weekday = (day.weekday() + 1) % 7
        if weekday in self.weekdays:
            return True
        if weekday in self.last_weekdays and day.day + 7 > calendar.monthrange(
                day.year, day.month)[1]:
            return True
        return (weekday, (day.day - 1) // 7 + 1) in self.nth_weekdays


def _nearest_weekday(year: int, month: int, n: int, length: int) -> int | None:
    """The weekday (Mon-Fri) nearest to day ``n`` (0: the last day), within the month;
    None when the month has no day ``n``."""
    if n > length:
        return None
    n = n or length
    weekday = calendar.weekday(year, month, n)  # Monday is 0
    if weekday == 5:  # Saturday: the Friday before, or the Monday after the 1st
        return n - 1 if n > 1 else n + 2
    if weekday == 6:  # Sunday: the Monday after, or the Friday before the last day
        return n + 1 if n < length else n - 2
    return n


def parse(expression: str) -> Schedule:
    """The schedule an expression describes, or Invalid("invalid_cron") saying what is wrong."""
    text = " ".join(expression.split())
    if not text:
        raise _bad("the cron expression is empty")
    lowered = text.lower()
    if lowered == "@every" or lowered.startswith("@every "):
        return Schedule(expression=text, every=_duration(text[len("@every"):].strip()))
    if text.startswith("@"):
        if lowered not in ALIASES:
            raise _bad(f"unknown cron alias {text!r}; known: {', '.join(ALIASES)}, @every")
        fields = ALIASES[lowered].split()
    else:
        fields = text.split()
    if len(fields) not in (5, 6):
        raise _bad(f"5 or 6 fields expected, got {len(fields)}")
    if len(fields) == 5:
        fields = ["0", *fields]
    sets = [_field(token, *spec) for token, spec in zip(fields[:5], _FIELDS[:5])
            if spec[0] != "day of month"]
    seconds, minutes, hours, months = sets
    # '?' (Quartz) leaves a day field open, as '*' does
    fields = [f if f != "?" or i not in (3, 5) else "*" for i, f in enumerate(fields)]
    dom = _day_of_month(fields[3])
    dow = _day_of_week(fields[5])
    schedule = Schedule(expression=text, seconds=seconds, minutes=minutes, hours=hours,
                        months=months, days=dom[0], last_day=dom[1], nearest_weekdays=dom[2],
                        weekdays=dow[0], last_weekdays=dow[1], nth_weekdays=dow[2],
                        # as in Vixie cron, a field starting with '*' is not 'restricted'
                        dom_restricted=not fields[3].startswith("*"),
                        dow_restricted=not fields[5].startswith("*"))
    _check_possible(schedule)
    return schedule


def _duration(text: str) -> float:
    """A Go-style duration (1h30m, 45s, 500ms) in seconds, > 0."""
    if not text:
        raise _bad("@every needs a duration, e.g. '@every 90s'")
    position, total = 0, Fraction(0)  # exact: '1.1m' is 66 s, not 66.00000000000001
    for match in _DURATION_PART.finditer(text.lower()):
        if match.start() != position:
            break
        total += Fraction(match.group(1)) * _UNITS[match.group(2)]
        position = match.end()
    if position != len(text) or position == 0:
        raise _bad(f"duration {text!r} in '@every {text}' is not like 1h30m, 45s or 2m")
    if total <= 0:
        raise _bad(f"duration {text!r} in '@every {text}' must be more than zero")
    if total > MAX_EVERY:
        raise _bad(f"duration {text!r} in '@every {text}' is over a year; the longest is"
                   " '@every 8760h' (a yearly time is '@yearly')")
    return float(total)


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²', which int() then refuses."""
    return text.isascii() and text.isdigit()


def _value(token: str, part: str, name: str, low: int, high: int,
           names: dict[str, int] | None) -> int:
    if names and part.upper() in names:
        return names[part.upper()]
    if not _digits(part):
        raise _bad(f"{name} value {part!r} in {token!r} is not a number"
                   + (" or a name" if names else ""))
    number = int(part)
    if not low <= number <= high:
        raise _bad(f"{name} {number} is out of range {low}-{high}")
    return number


def _field(token: str, name: str, low: int, high: int,
           names: dict[str, int] | None) -> frozenset[int]:
    """The values a field of ``*``, ``,``, ``-`` and ``/`` allows."""
    values: set[int] = set()
    for item in token.split(","):
        if not item:
            raise _bad(f"empty list item in {token!r} ({name})")
        base, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not _digits(step_text):
                raise _bad(f"step {step_text!r} in {item!r} ({name}) is not a number")
            step = int(step_text)
            if step == 0:
                raise _bad(f"step 0 in {item!r} ({name})")
        if base == "*":
            start, end = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start = _value(item, first, name, low, high, names)
            end = _value(item, last, name, low, high, names)
            if start > end:
                raise _bad(f"range {base!r} in {item!r} ({name}) runs backwards")
        else:
            start = _value(item, base, name, low, high, names)
            end = high if slash else start  # 'a/n': from a to the field's end
        values.update(range(start, end + 1, step))
    return frozenset(values)


def _day_of_month(token: str) -> tuple[frozenset[int], bool, frozenset[int]]:
    """Plain days, whether L (the last day) is in, and the W days (0 for LW)."""
    plain, last, nearest = [], False, set()
    for item in token.split(","):
        upper = item.upper()
        if upper == "L":
            last = True
        elif upper == "LW":
            nearest.add(0)
        elif upper.endswith("W"):
            nearest.add(_value(item, item[:-1], "day of month", 1, 31, None))
        else:
            plain.append(item)
    days = _field(",".join(plain), *_FIELDS[3]) if plain else frozenset()
    return days, last, frozenset(nearest)


def _day_of_week(token: str) -> tuple[frozenset[int], frozenset[int], frozenset[tuple[int, int]]]:
    """Plain weekdays (0 is Sunday, 7 folded into it), the ``5L`` ones, the ``5#3`` ones."""
    name, low, high, names = _FIELDS[5]
    plain, last, nth = [], set(), set()
    for item in token.split(","):
        upper = item.upper()
        if upper == "L":  # alone: the last day of the week, Saturday
            plain.append("6")
        elif upper.endswith("L"):
            last.add(_value(item, item[:-1], name, low, high, names) % 7)
        elif "#" in item:
            day, _, which = item.partition("#")
            if not _digits(which) or not 1 <= int(which) <= 5:
                raise _bad(f"occurrence {which!r} in {item!r} ({name}) is not 1-5")
            nth.add((_value(item, day, name, low, high, names) % 7, int(which)))
        else:
            plain.append(item)
    days = _field(",".join(plain), name, low, high, names) if plain else frozenset()
    return frozenset(d % 7 for d in days), frozenset(last), frozenset(nth)


def _check_possible(schedule: Schedule) -> None:
    """Refuse plain days that no chosen month has (``0 0 30 2 *``): it would never fire.
    A day some chosen months lack is fine; those months are skipped."""
    if not schedule.dom_restricted or schedule.dow_restricted or schedule.last_day:
        return
    longest = max(calendar.monthrange(2024, m)[1] for m in schedule.months)  # a leap year
    days = schedule.days | (schedule.nearest_weekdays - {0})
    if 0 not in schedule.nearest_weekdays and min(days) > longest:
        months = ",".join(str(m) for m in sorted(schedule.months))
        plural = "s" if len(schedule.months) > 1 else ""
        raise _bad(f"day of month {min(days)} never occurs in month{plural} {months}; "
                   "the schedule would never fire")


_OFFSET = re.compile(r"^(?:UTC|GMT|Etc/GMT)?\s*[+-]\s*\d", re.IGNORECASE)


def zone(name: str | None = "UTC") -> ZoneInfo:
    """The IANA time zone ``name`` (default UTC); fixed offsets and abbreviations are
    refused (ojs-cron §5.1), since they do not follow daylight saving time."""
    name = "UTC" if name is None or name == "" else name
    if _OFFSET.match(name):
        raise Invalid("invalid_timezone", f"time zone {name!r} is a fixed offset; use an IANA "
                      "name such as 'America/New_York' or 'UTC'")
    if name not in ("UTC", "Etc/UTC") and "/" not in name:
        raise Invalid("invalid_timezone", f"time zone {name!r} is not an IANA Region/City "
                      "name such as 'Europe/Berlin' (or 'UTC')")
    from zoneinfo import ZoneInfo

    try:
        return ZoneInfo(name)
    except (ValueError, KeyError, OSError):
        raise Invalid("invalid_timezone", f"unknown time zone {name!r}") from None


def next_fires(schedule: Schedule, tz: ZoneInfo, after: float, count: int,
               anchor: float | None = None) -> list[float]:
    """The next ``count`` fire times strictly after ``after`` (epoch seconds), earliest
    first. ``@every`` counts from ``anchor`` (registration or the last fire; ``after``
    when None). Fewer are returned only near year 9999, or if the schedule stops firing for
    ``HORIZON_YEARS`` (which no expression ``parse`` accepts does)."""
    if count <= 0:
        return []
    if schedule.every is not None:
        return _every_fires(schedule.every, after, count, after if anchor is None else anchor)
    fires: list[float] = []
    start = datetime.fromtimestamp(after, tz).date()
    day, end = start, date(min(start.year + HORIZON_YEARS, 9999), 1, 1)
    while day < end:
        if day.month not in schedule.months:
            day = _first_of_next_month(day)  # a whole month skipped at once
            continue
        if schedule.day_matches(day):
            for fire in _day_fires(schedule, tz, day, after):
                fires.append(fire)
                if len(fires) == count:
                    return fires
                end = date(min(day.year + HORIZON_YEARS, 9999), 1, 1)  # counted from a fire
        day += timedelta(days=1)
    return fires


def _every_fires(every: float, after: float, count: int, anchor: float) -> list[float]:
    """anchor + k * every for the smallest k >= 1 past ``after``, and the ones after it."""
    steps = max(1, int((after - anchor) // every) + 1)
    # the division may round either way: settle on the first step strictly after
    while steps > 1 and anchor + (steps - 1) * every > after:
        steps -= 1
    while anchor + steps * every <= after:
        steps += 1
    return [anchor + (steps + i) * every for i in range(count)]


def _first_of_next_month(day: date) -> date:
    return date(day.year + 1, 1, 1) if day.month == 12 else date(day.year, day.month + 1, 1)


def _instant(tz: ZoneInfo, day: date, hour: int, minute: int, second: int) -> float | None:
    """The epoch second of a wall-clock time, its first occurrence if repeated; None
    when a spring-forward skips it."""
    wall = datetime(day.year, day.month, day.day, hour, minute, second, tzinfo=tz)
    stamp = wall.timestamp()  # fold=0: the earlier of a repeated time
    back = datetime.fromtimestamp(stamp, tz)
    if back.replace(tzinfo=None) != wall.replace(tzinfo=None):
        return None  # the wall time does not exist that day
    return stamp


def _latest(tz: ZoneInfo, day: date, hour: int, minute: int, second: int) -> float:
    """The latest instant a wall-clock time can stand for, to skip what ends before ``after``."""
    wall = datetime(day.year, day.month, day.day, hour, minute, second, tzinfo=tz)
    return max(wall.timestamp(), wall.replace(fold=1).timestamp())


def _day_fires(schedule: Schedule, tz: ZoneInfo, day: date, after: float) -> Iterator[float]:
    """The fire times of a matching day after ``after``, in order; an hour or a minute
    that ends before ``after`` is passed over whole."""
    for hour in sorted(schedule.hours):
        if _latest(tz, day, hour, 59, 59) <= after:
            continue
        for minute in sorted(schedule.minutes):
            if _latest(tz, day, hour, minute, 59) <= after:
                continue
            for second in sorted(schedule.seconds):
                stamp = _instant(tz, day, hour, minute, second)
                if stamp is not None and stamp > after:
                    yield stamp
