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

import bisect
import collections
import itertools
import re
from typing import Any

import msgspec

from rota.base.errors import Invalid
from rota.base.flow import UNIT_WORDS, UNITS
from rota.base.protocol import MAX_COUNT

MAX_PERIOD = 86400.0  # seconds: a rate's period is at most a day
SCOPE_KINDS = ("queue", "spec")
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
                          f" '5/s', '1000/h' or '10/30s' ({UNIT_WORDS})")
        count, every, unit = match.groups()
        if len(count) > len(str(MAX_COUNT)):  # (too large: and no int() of 5,000 digits)
            raise Invalid("invalid_limit", f"rate: limit {count[:40]} is too large: at most"
                          f" {MAX_COUNT}")
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
    if rate.limit > MAX_COUNT:
        raise Invalid("invalid_limit", f"{field}: limit {rate.limit} is too large: at most"
                      f" {MAX_COUNT}")
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
    """A rate's recent starts (monotonic times): the next start is allowed when fewer
    than ``limit`` fall in the last ``period`` and, with a burst, when the burst allows
    it: a burst of ``burst`` starts may go back to back, then they are spaced ``period /
    limit`` apart (a GCRA, whose one number ``tat`` is replayed from the starts, so
    stored starts are all a restart needs).

    A start is made when its reservation is committed and its job sent, not when its
    round planned it: until then it is ``pending``, and counts as happening now, however
    long its commit takes (a lock wait, a slow disk). So a round planned while an earlier
    one's commit is slow cannot start with it, and the starts a worker sees keep the
    rate. A start pending longer than ``PENDING_AT_MOST`` counts from when it was planned
    (its commit is stuck, or its outcome was lost to a change of rules)."""

    __slots__ = ("rate", "starts", "pending", "tat")

    def __init__(self, rate: Rate, starts: Any = (), pending: Any = ()) -> None:
        self.rate = rate
        # made, oldest first; planned at (in order), their commits awaited
        self.starts: collections.deque[float] = collections.deque(sorted(starts)[-rate.limit:],
                                                                  maxlen=rate.limit)
        self.pending: list[float] = sorted(pending)
        self.tat = float("-inf")  # the burst's theoretical arrival time
        self._replay()

    def _replay(self) -> None:
        spacing = self.rate.spacing
        self.tat = float("-inf")
        if spacing:
            for when in sorted([*self.starts, *self.pending]):
                self.tat = max(self.tat, when) + spacing

    def next_start(self, now: float) -> float:
        """The earliest moment (>= now) a start is allowed. While pending starts fill the
        window: a period from now, the soonest it could open were they made now (their
        commit's outcome brings the window back at once: ``Limiter.made``)."""
        rate, starts = self.rate, self.starts
        at = now
        pending = len(self.pending) - bisect.bisect_right(self.pending, now - PENDING_AT_MOST)
        room = rate.limit - pending  # made starts the window may hold beside them
        if room <= 0:
            return now + rate.period
        if len(starts) >= room:
            at = max(at, starts[-room] + rate.period)
        spacing = rate.spacing
        if spacing:
            at = max(at, self.tat - ((rate.burst or rate.limit) - 1) * spacing)
        return at

    def allows(self, now: float) -> bool:
        return self.next_start(now) <= now

    def begin(self, now: float) -> None:
        """A start planned now: pending until its commit's outcome (``made``, ``unstart``)."""
        bisect.insort(self.pending, now)  # (an append: rounds are planned in time order)
        spacing = self.rate.spacing
        if spacing:
            self.tat = max(self.tat, now) + spacing

    def start(self, at: float) -> None:
        """A start made at ``at``."""
        self._add(at)
        spacing = self.rate.spacing
        if spacing:
            self.tat = max(self.tat, at) + spacing

    def made(self, planned: float, now: float) -> None:
        """The start planned at ``planned`` was made now (its reservation committed)."""
        pending = self.pending
        i = bisect.bisect_left(pending, planned)
        if i == len(pending) or pending[i] != planned:
            return  # made or taken back already, or its window was made again meanwhile
        del pending[i]
        self._add(now)
        if self.rate.spacing:
            self._replay()

    def _add(self, at: float) -> None:
        """Keep the starts in time order, the last ``limit`` of them."""
        starts = self.starts
        if not starts or at >= starts[-1]:
            starts.append(at)  # (nearly always: commits land in order)
            return
        if len(starts) == starts.maxlen:
            if at <= starts[0]:
                return  # older than any the window keeps
            starts.popleft()
        starts.insert(bisect.bisect_right(starts, at), at)

    def unstart(self, at: float) -> None:
        """A start taken at ``at`` did not happen (its reservation was refused, failed or
        lost): it no longer counts, and the burst's spacing is replayed without it."""
        for made in (self.pending, self.starts):
            if at in made:
                made.remove(at)
                break
        else:
            return  # already out of the window
        if self.rate.spacing:
            self._replay()

    def in_window(self, now: float) -> int:
        """Starts within the last ``period``, those pending with them."""
        edge = now - self.rate.period
        return sum(1 for at in self.starts if at > edge) + len(self.pending)


Counter = tuple[str, str, str | None]  # (scope kind, scope name, concurrency key or None)
Check = tuple[Counter, int | None, Rate | None]  # a counter, its concurrency and its rate
NEVER = float("inf")  # blocked until a release, not a time
PENDING_AT_MOST = 60.0  # seconds a planned start waits for its commit before it counts as made
WINDOWS_PRUNE_AT = 4096  # windows kept before those of idle keys are dropped
CHECKS_KEPT = 65536  # (queue, spec, key) whose checks are remembered, at most


class LimitUse(msgspec.Struct, frozen=True, omit_defaults=True):
    """One limit and its current use, for the surfaces: the scope's own (``key`` None) or
    one concurrency key's within it."""

    name: str  # queue:emails, spec:send_email
    key: str | None = None
    concurrency: int | None = None  # the limit of running jobs
    running: int = 0  # reserved jobs counted against it now
    rate: str | None = None  # "100/min"
    starts: int = 0  # starts in the rate's last period
    next_start: float | None = None  # seconds until a start is allowed (None: now)


OTHER_KEYS = "(other)"  # the key the keys beyond a surface's cap are summed under


def fold_keys(uses: list[LimitUse], limit: int) -> list[LimitUse]:
    """``uses`` with at most ``limit`` per-key entries over all limits (keys are named
    by producers: /metrics names at most ``--max-series`` of them), the busiest (most
    running, then most starts), in their order; the others summed per limit under the
    key OTHER_KEYS (after its entries: ``uses`` come grouped by limit, as ``limit_use``
    gives them), which has no concurrency of its own (a sum over keys is not one
    key's use). A scope's own entries are all kept: operators name those."""
    keyed = [i for i, use in enumerate(uses) if use.key is not None]
    if len(keyed) <= limit:
        return list(uses)
    busiest = sorted(keyed, key=lambda i: (-uses[i].running, -uses[i].starts, i))
    kept = set(busiest[:max(0, limit)])
    out: list[LimitUse] = []
    for name, group in itertools.groupby(enumerate(uses), key=lambda pair: pair[1].name):
        other: LimitUse | None = None  # what this limit's keys left out add up to
        for i, use in group:
            if use.key is None or i in kept:
                out.append(use)
                continue
            other = other or LimitUse(name=name, key=OTHER_KEYS, rate=use.rate)
            other = msgspec.structs.replace(other, running=other.running + use.running,
                                            starts=other.starts + use.starts)
        if other is not None:
            out.append(other)
    return out


class Limiter:
    """The limits in force and their use: reserved jobs per counter, recent starts per
    rated counter, and what a refused reservation holds off. Pure: the caller says what
    time it is (monotonic) and which job (by id, or a claim's seq) starts or ends."""

    def __init__(self) -> None:
        self.rules: dict[Scope, LimitRule] = {}
        self.use: dict[Counter, int] = {}
        self.windows: dict[Counter, Window] = {}
        # job id / claim seq -> (queue, spec, key, the counters it holds, when its start
        # was taken: None if it took none, as a job held at a restart)
        self.held: dict[str | int, tuple[str, str, str | None, tuple[Counter, ...],
                                         float | None]] = {}
        self.off: dict[Counter, float] = {}  # held off until then: a store guard refused
        self._prune_at = WINDOWS_PRUNE_AT
        self._now_hint = 0.0  # the latest time a start was taken at (for pruning)
        # (queue, spec, key) -> its checks under the rules in force: asked per job picked
        self._checks: dict[tuple[str, str, str | None], list[Check]] = {}

    def scope_checks(self, kind: str, name: str) -> Check | None:
        rule = self.rules.get((kind, name))
        if rule is None or (rule.concurrency is None and rule.rate is None):
            return None
        return (kind, name, None), rule.concurrency, rule.rate

    def key_checks(self, queue: str, spec: str, key: str | None) -> list[Check]:
        checks: list[Check] = []
        if key is None:
            return checks
        for kind, name in (("queue", queue), ("spec", spec)):
            rule = self.rules.get((kind, name))
            if rule is not None and (rule.key_concurrency is not None
                                     or rule.key_rate is not None):
                checks.append(((kind, name, key), rule.key_concurrency, rule.key_rate))
        return checks

    def checks(self, queue: str, spec: str, key: str | None) -> list[Check]:
        """Every limit a job of (queue, spec, key) counts against."""
        checks = self._checks.get((queue, spec, key))
        if checks is None:
            if len(self._checks) >= CHECKS_KEPT:
                self._checks.clear()
            checks = self._checks[(queue, spec, key)] = [
                check for check in (self.scope_checks("queue", queue),
                                    self.scope_checks("spec", spec)) if check is not None
            ] + self.key_checks(queue, spec, key)
        return checks

    def blocked(self, checks: list[Check], now: float) -> tuple[Counter, float] | None:
        """The first limit that allows no start now, and until when (NEVER: until a
        release); None if all allow one."""
        for check in checks:
            until = self.until(check, now)
            if until > now:
                return check[0], until
        return None

    def until(self, check: Check, now: float) -> float:
        counter, concurrency, rate = check
        off = self.off.get(counter)
        if off is not None:
            if off > now:
                return off
            del self.off[counter]
        if concurrency is not None and self.use.get(counter, 0) >= concurrency:
            return NEVER
        if rate is not None:
            return self.window(counter, rate).next_start(now)
        return now

    def window(self, counter: Counter, rate: Rate) -> Window:
        window = self.windows.get(counter)
        if window is None or window.rate != rate:
            if len(self.windows) >= self._prune_at:
                self._prune()
            window = self.windows[counter] = (Window(rate, window.starts, window.pending)
                                              if window else Window(rate))
        return window

    def recent_starts(self, now: float) -> dict[tuple[str, str | None], list[float]]:
        """Each rate window's starts within its period (monotonic), by limit name and
        key, as the store keeps them: all a restart's windows need."""
        found: dict[tuple[str, str | None], list[float]] = {}
        for (kind, scope, key), window in self.windows.items():
            recent = [at for at in window.starts if at > now - window.rate.period]
            if recent:
                found[(f"{kind}:{scope}", key)] = recent
        return found

    def _prune(self) -> None:
        """Forget windows with no start left in their period (their keys went quiet): a
        scan made when their number doubled, so its cost per window stays constant."""
        last = {counter: window.starts[-1] for counter, window in self.windows.items()
                if window.starts}
        for counter, window in list(self.windows.items()):
            if window.pending:
                continue  # (its commit's outcome finds it)
            if counter not in last or last[counter] + window.rate.period < self._now_hint:
                del self.windows[counter]
        self._prune_at = max(WINDOWS_PRUNE_AT, 2 * len(self.windows))

    def take(self, ident: str | int, queue: str, spec: str, key: str | None, now: float) -> None:
        """A job of (queue, spec, key) is reserved (started) now: it counts. (A key known
        twice may be picked twice in one round: the job counts once.)"""
        if ident in self.held:
            self.release(ident, undo=True)
        checks = self.checks(queue, spec, key)
        if now > self._now_hint:
            self._now_hint = now
        use = self.use
        for counter, _, rate in checks:
            use[counter] = use.get(counter, 0) + 1
            if rate is not None:
                self.window(counter, rate).begin(now)
        self.held[ident] = (queue, spec, key, tuple([check[0] for check in checks]), now)

    def made(self, ident: str | int, now: float) -> tuple[Counter, ...]:
        """The job's reservation committed: its planned starts are made now. The rate
        counters it counts against, whose windows have room again."""
        held = self.held.get(ident)
        if held is None or held[4] is None:
            return ()
        rated = []
        for counter in held[3]:
            window = self.windows.get(counter)
            if window is not None:
                window.made(held[4], now)
                rated.append(counter)
        self.held[ident] = (*held[:4], now)
        return tuple(rated)

    def hold(self, ident: str | int, queue: str, spec: str, key: str | None) -> None:
        """A job reserved already (loaded active at a restart, or when limits are set)
        counts against the limits, with no start."""
        counters = tuple(check[0] for check in self.checks(queue, spec, key))
        for counter in counters:
            self.use[counter] = self.use.get(counter, 0) + 1
        self.held[ident] = (queue, spec, key, counters, None)

    def moved(self, seq: int, job_id: str) -> None:
        """A claim's row was read: its job holds what the claim held."""
        held = self.held.pop(seq, None)
        if held is not None:
            self.held[job_id] = held

    def release(self, ident: str | int, *, undo: bool = False) -> tuple[Counter, ...]:
        """The job left ``active``: the counters it held, each one freer now (and no
        longer held off). ``undo``: its reservation never happened (refused, failed,
        lost to another server), so its start is taken back out of the rate windows."""
        held = self.held.pop(ident, None)
        if held is None:
            return ()
        counters, at = held[3], held[4]
        if at is not None:
            for counter in counters:
                window = self.windows.get(counter)
                if window is None:
                    continue
                if undo:
                    window.unstart(at)
                else:  # (ended with its start still pending: made when it was planned)
                    window.made(at, at)
        for counter in counters:
            left = self.use[counter] - 1
            if left:
                self.use[counter] = left
            else:
                del self.use[counter]
            self.off.pop(counter, None)
        return counters

    def reset(self, rules: dict[Scope, LimitRule]) -> None:
        """New rules: every held job counts again under them."""
        self.rules = dict(rules)
        self._checks.clear()
        self.off.clear()
        held, self.held, self.use = self.held, {}, {}
        for ident, (queue, spec, key, _, _) in held.items():
            self.hold(ident, queue, spec, key)

    def load_starts(self, starts: dict[tuple[str, str | None], list[float]]) -> None:
        """Recent starts read back from the store (monotonic times), by limit name and key,
        merged with those known: a start known already (to the millisecond) is not
        counted twice, so the stored starts may be given again with every new table."""
        for (name, key), times in starts.items():
            kind, _, scope = name.partition(":")
            rule = self.rules.get((kind, scope))
            rate = None if rule is None else (rule.rate if key is None else rule.key_rate)
            if rate is None:
                continue
            counter = (kind, scope, key)
            old = self.windows.get(counter)
            # A multiset union: the starts of one round share their moment.
            known = collections.Counter(round(at, 3) for at in (old.starts if old else ()))
            given = collections.Counter(round(at, 3) for at in times)
            self.windows[counter] = Window(rate, (known | given).elements(),
                                           old.pending if old else ())
