"""Cron schedules, decided without I/O: the definition and its validation, the ticks due since the last one (misfire grace and policy), the overlap verdict, jitter and tick job ids.

A schedule fires its spec once per tick of its expression (rota/core/cron.py) in its time
zone. The shell (rota/server/clockwork.py) reads the clock and the schedule's row and asks
``due`` which ticks to fire and ``overlap`` what to do with each; every server computes the
same answer from the same row, and a tick's job id (``tick_id``) is the same everywhere, so
one tick makes one job however many servers reach it.
"""

from __future__ import annotations

import hashlib
import re
from bisect import bisect_right
from collections.abc import Container, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from rota.base.errors import Invalid
from rota.base.ojs import OjsExtras
from rota.base.protocol import MAX_COUNT, Name, Priority, rfc3339
from rota.base.wording import plainly
from rota.core import cron
from rota.core.model import TERMINAL_STATES

if TYPE_CHECKING:
    from zoneinfo import ZoneInfo

Overlap = Literal["skip", "allow", "cancel_previous", "enqueue"]
Misfire = Literal["skip", "catch_up"]
MIN_INTERVAL = 1.0  # seconds: the documented minimum, '@every 1s'
MAX_NAME = 100  # so that 'cron-<name>-<YYYYmmddTHHMMSSZ>' is a job id (128 at most)
VIEW_FIRES = 5  # next fire times a view lists
MAX_CATCH_UP = 1000
SCAN = 20_000  # ticks examined from the last one before the scan jumps near now


class ScheduleDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A schedule as declared (``[[schedule]]`` in a spec file, or JSON to the API)."""

    name: Name
    spec: Name
    cron: Annotated[str, msgspec.Meta(max_length=1000)]
    args: dict[str, Any] = {}
    timezone: Annotated[str, msgspec.Meta(max_length=200)] = "UTC"
    overlap: Overlap = "skip"
    misfire: Misfire = "catch_up"
    catch_up: Annotated[int, msgspec.Meta(ge=1, le=MAX_CATCH_UP)] = 1
    jitter: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.0
    queue: Name | None = None
    priority: Priority | None = None
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)] | None = None
    description: Annotated[str, msgspec.Meta(max_length=10_000)] = ""
    paused: bool = False
    # A cron job registered through /ojs/v1/cron: its template's OJS-only parts, which
    # each tick's job gets (rota/server/ojs_flows.py; Rota's own routes refuse it).
    ojs: OjsExtras | None = None

    def same_firing(self, other: ScheduleDef) -> bool:
        """Whether the two fire at the same times (a change of anything else keeps the
        ticks already counted)."""
        return (self.cron, self.timezone) == (other.cron, other.timezone)


def check(data: Any, *, where: str = "") -> ScheduleDef:
    """A definition from decoded JSON or TOML, or Invalid naming what is wrong:
    ``invalid_schedule`` (a field), ``invalid_cron`` (the expression, or one that fires
    more often than once a second), ``invalid_timezone``. ``where`` prefixes the message
    (a file, 'schedules[2]')."""
    prefix = f"{where}: " if where else ""
    if not isinstance(data, dict):
        raise Invalid("invalid_schedule", f"{prefix}a schedule must be an object (a table)")
    refused = name_refusal(data.get("name"))
    if refused is not None:
        raise Invalid("invalid_schedule", f"{prefix}{refused}")
    try:
        definition = msgspec.convert(data, type=ScheduleDef)
    except msgspec.ValidationError as exc:
        said = plainly(str(exc), ScheduleDef, lambda: data)
        raise Invalid("invalid_schedule", f"{prefix}{said}") from None
    # spaces, tabs or a newline around the expression (a pasted line) are dropped; one
    # inside it is refused, as a line of `rota schedules` or the log could not show it
    definition = msgspec.structs.replace(definition, cron=definition.cron.strip())
    inside = next((c for c in definition.cron if not c.isprintable()), None)
    if inside is not None:
        raise Invalid("invalid_cron", f"{prefix}schedule {definition.name!r}: the expression"
                      f" {definition.cron!r} holds {inside!r}; separate its fields by spaces")
    try:
        parsed = cron.parse(definition.cron)
        cron.zone(definition.timezone)
    except Invalid as exc:
        raise Invalid(exc.code, f"{prefix}schedule {definition.name!r}: {exc.message}") from None
    if parsed.every is not None and parsed.every < MIN_INTERVAL:
        raise Invalid("invalid_cron", f"{prefix}schedule {definition.name!r}: {definition.cron!r}"
                      f" fires every {parsed.every:g}s; a schedule fires at most once a"
                      " second ('@every 1s')")
    if parsed.every is not None and parsed.every != int(parsed.every):
        raise Invalid("invalid_cron", f"{prefix}schedule {definition.name!r}: {definition.cron!r}"
                      f" fires every {parsed.every:g}s; a schedule ticks in whole seconds"
                      " (its jobs' ids name the second)")
    return definition


NAME_RULE = (f"1 to {MAX_NAME} letters, digits and '_.:-', starting with a letter or digit"
             " (its jobs' ids are cron-<name>-<tick>)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,%d}" % (MAX_NAME - 1))


def name_refusal(name: Any) -> str | None:
    """Why ``name`` is no schedule's name (None: it is one, or it is no text, which the
    definition's type refuses): the one rule, in the body and in the path alike."""
    if not isinstance(name, str) or _NAME.fullmatch(name):
        return None
    said = repr(name) if len(name) <= 60 else f"a name of {len(name)} characters"
    return f"a schedule's name is {NAME_RULE}, not {said}"


@dataclass(frozen=True)
class Timing:
    """What ``due`` needs of a schedule: its parsed expression, zone and policies."""

    schedule: cron.Schedule
    tz: ZoneInfo
    misfire: Misfire
    catch_up: int
    anchor: float  # @every counts from here (when the schedule was made)

    @classmethod
    def of(cls, definition: ScheduleDef, anchor: float) -> Timing:
        return cls(cron.parse(definition.cron), cron.zone(definition.timezone),
                   definition.misfire, definition.catch_up, anchor)

    def after(self, moment: float, count: int) -> list[float]:
        return cron.next_fires(self.schedule, self.tz, moment, count, self.anchor)


def grace(interval: float) -> float:
    """How late a tick may be reached and still fire as on time: 10% of the interval,
    at least a second, at most a minute."""
    return min(60.0, max(1.0, interval / 10))


@dataclass(frozen=True)
class Due:
    """What ``due`` decides at one instant."""

    fire: tuple[float, ...]  # ticks to fire now, oldest first
    missed: int  # ticks reached past their grace (fired or not)
    passed: int  # of those, how many the policy passes over (not fired)
    last: float | None  # the latest tick reached: the new last_tick (None: none reached)
    counted: bool = True  # False: more were missed than were counted (a long downtime)


def due(timing: Timing, start: float, now: float, reached: float | None = None) -> Due:
    """The ticks in (start, now]: those reached within their grace fire; of the missed
    ones, ``catch_up`` fires the latest ``catch_up`` (each its own job), ``skip`` none.
    ``start``: the last tick decided, or when counting began (made, resumed, changed).
    ``reached``: the instant lateness is measured from (default ``now``): when the loop
    meant to wake for these ticks, so that a loop kept busy by its own rounds misses
    none (only downtime, or a sleep that overslept, does)."""
    ticks, counted = _ticks(timing, start, now)
    if not ticks:
        return Due((), 0, 0, None)
    judged = now if reached is None else min(now, reached)
    on_time, missed = [], []
    for i, tick in enumerate(ticks):
        later = ticks[i + 1:i + 2] or timing.after(tick, 1) or [tick + 60.0]
        following = later[0]
        (on_time if judged - tick <= grace(following - tick) else missed).append(tick)
    caught = missed[-timing.catch_up:] if timing.misfire == "catch_up" and missed else []
    missing = len(missed) if counted else max(len(missed), SCAN)
    fire = tuple(sorted(caught + on_time))
    return Due(fire, missing, missing - len(caught), ticks[-1], counted)


def _ticks(timing: Timing, start: float, now: float) -> tuple[list[float], bool]:
    """The ticks in (start, now], earliest first, and whether all were counted: after
    SCAN of them the count stops and the latest ticks (at most MAX_CATCH_UP + 1, all
    ``due`` may fire) are looked for near ``now`` instead."""
    found: list[float] = []
    moment, size = start, 4  # usually one tick is due: ask for few first
    while len(found) < SCAN:
        batch = timing.after(moment, size)
        size = 500
        if not batch:
            return found, True
        cut = bisect_right(batch, now)
        found += batch[:cut]
        if cut < len(batch):
            return found, True
        moment = batch[-1]
    want, span = MAX_CATCH_UP + 1, 3600.0
    while True:  # widen a window back from now until it holds enough of the latest
        begin = max(moment, now - span)
        window = _within(timing, begin, now)
        if len(window) >= want or begin == moment:
            return window[-want:], False
        span *= 4


def _within(timing: Timing, begin: float, now: float) -> list[float]:
    found: list[float] = []
    moment = begin
    while True:
        batch = timing.after(moment, 500)
        cut = bisect_right(batch, now)
        found += batch[:cut]
        if cut < len(batch) or not batch:
            return found[-(MAX_CATCH_UP + 1):]
        moment = batch[-1]
        found = found[-(MAX_CATCH_UP + 1):]


Verdict = Literal["fire", "skip", "cancel_previous", "pending"]


def overlap(policy: Overlap, previous_state: str | None) -> Verdict:
    """What a tick does given the state of the schedule's previous job (None: none, or
    it is gone): a live one (not finished) overlaps. ``fire``: enqueue it; ``skip``:
    nothing; ``cancel_previous``: cancel that one, then enqueue; ``pending``: insert it
    held, released when the previous ends (rota/store/ticks.py release_next)."""
    if previous_state is None or previous_state in TERMINAL_STATES:
        return "fire"
    if policy == "allow":
        return "fire"
    if policy == "enqueue":
        return "pending"
    return "cancel_previous" if policy == "cancel_previous" else "skip"


def of_round(policy: Overlap, fire: tuple[float, ...]) -> tuple[float, ...]:
    """The ticks of one round's ``fire`` (``due``) that make jobs: all of them under
    ``allow`` and ``enqueue`` (held, one after another); under ``skip`` and
    ``cancel_previous`` only the newest, as each older one would only overlap the next
    (the others are passed over, as misses the policy does not fire)."""
    return fire if policy in ("allow", "enqueue") else fire[-1:]


def jitter_offset(name: str, tick: float, jitter: float) -> float:
    """A tick's delay in [0, jitter), from a hash of (name, tick): every server computes
    the same one, so a job made twice is the same job."""
    if jitter <= 0:
        return 0.0
    digest = hashlib.sha256(f"{name}\0{tick:.3f}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * jitter


def tick_id(name: str, tick: float) -> str:
    """The job id of a tick: ``cron-<name>-<UTC tick as YYYYmmddTHHMMSSZ>``."""
    moment = datetime.fromtimestamp(int(tick // 1), timezone.utc)
    return f"cron-{name}-{moment:%Y%m%dT%H%M%SZ}"


def next_fires(timing: Timing, after: float, count: int = VIEW_FIRES) -> list[float]:
    """The next ``count`` fire times after ``after``, for views."""
    return timing.after(after, count)


def waiting_reason(spec: str, known: Container[str], retired: Container[str]) -> str | None:
    """Why a schedule cannot fire now (None: it can): its spec was retired, or has no
    status quo. Its ticks meanwhile count as misfires when it can fire again."""
    if spec in retired:
        return f"spec {spec} was retired"
    if spec not in known:
        return f"spec {spec} has no status quo"
    return None


def view(definition: ScheduleDef, row: Mapping[str, Any], waiting: str | None,
         fires: list[float]) -> dict[str, Any]:
    """A schedule as the API shows it: every field, its state and its ticks' record.
    ``row``: its stored state (rota/store/ticks.py); ``fires``: its next fire times."""
    state = "paused" if definition.paused else "waiting" if waiting else "active"
    outcome = row.get("last_outcome")
    if outcome is None and row.get("last_job_id") is not None:
        outcome = row.get("last_job_state") or "deleted"  # the job's state, as it is now
    return {**fields_of(definition), "state": state,
            "waiting_reason": waiting if state == "waiting" else None,
            **_record(row, outcome, fires)}


def fields_of(definition: ScheduleDef) -> dict[str, Any]:
    """A definition's fields, ``ojs`` only when it is set (a Rota schedule's are as they
    were before OJS: its stored text, and so its "unchanged", stay the same)."""
    fields = msgspec.to_builtins(definition)
    if fields.get("ojs") is None:
        fields.pop("ojs", None)
    return dict(fields)


def _record(row: Mapping[str, Any], outcome: str | None, fires: list[float]
            ) -> dict[str, Any]:
    """A view's record of ticks; a fire time past year 9999 is left out."""
    return {"last_tick": _rfc3339(row.get("last_tick")), "last_job_id": row.get("last_job_id"),
            "last_outcome": outcome,
            "next_fires": [t for t in map(_rfc3339, fires) if t is not None],
            "run_count": row.get("run_count", 0), "created_at": _rfc3339(row.get("created_at"))}


def unreadable(row: Mapping[str, Any], reason: str) -> dict[str, Any]:
    """A schedule whose stored row this Rota cannot read (its definition or expression
    refused since it was stored): shown waiting, with what could be read, so that one
    odd row never fails a listing of all."""
    try:
        stored = msgspec.json.decode(row["definition"])
    except (msgspec.DecodeError, TypeError, KeyError):
        stored = {}
    known = {f: stored.get(f) for f in ScheduleDef.__struct_fields__
             if f != "ojs" or stored.get(f) is not None}
    known.update(name=row.get("name"), paused=bool(row.get("paused")))
    return {**known, "state": "waiting", "waiting_reason": f"it cannot be read: {reason}",
            **_record(row, row.get("last_outcome"), [])}


def _rfc3339(moment: float | None) -> str | None:
    """None for a moment no RFC 3339 time can say (past year 9999): a view shows it so."""
    try:
        return None if moment is None else rfc3339(moment)
    except (ValueError, OverflowError):
        return None
