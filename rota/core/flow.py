"""The scheduler's limited path: limits, rates, key turns and labels, decided per round. Pure.

A part of the scheduler (``Scheduler`` inherits it). Taken only while limits are set or
jobs wait with a concurrency key or labels (``limited``); otherwise ``plan`` runs the
plain path as before, at its cost.

Within a (queue, spec), the buckets of each concurrency key and label set take turns
(``Lanes.turn``, rota/core/ready.py): each pick serves the bucket at the front and sends
it to the back, so a key with 100,000 jobs waiting and one with 5 alternate. Priority
then enqueue order still order the jobs within a bucket; across the specs of a queue,
the best job at the front of each spec's rotation is taken, as on the plain path.

A bucket whose key is at a limit leaves the rotation (it is *parked* on that limit's
counter) and comes back when a job of the counter leaves ``active`` (``_released``) or
at its next allowed start (a timer: ``flow_deadline``, ``unpark_due``), so a round costs
what it assigns, not what waits. A scope's own limit (a queue's or a spec's) is checked
once per visit of it, in O(1). docs/flow-control.md says what is decided and why.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from rota.core.effects import Guard
from rota.core.limits import NEVER, Check, Counter, Limiter, LimitRule, LimitUse, Scope, limit_name
from rota.core.model import Instant, JobRecord
from rota.core.pins import Pins
from rota.core.ready import (CONCURRENCY_LIMIT, NO_LABEL, PLAIN, RATE_LIMIT, Bucket, Claim,
                             Lanes, Ready, SubId, Wait, WorkerSlot, why_waiting)

LABELS: Counter = ("labels", "", None)  # buckets no connected worker has the labels for
REFUSED_BACKOFF = 0.5  # seconds a limit a store guard refused is held off (or a release)
Found = tuple[SubId, Bucket, tuple[int, int]]


class Flow:
    ready: Ready
    workers: dict[str, WorkerSlot]
    paused: set[str]
    status_quo: dict[str, str]
    unversioned: dict[str, Any]
    jobs: dict[str, JobRecord]
    claims: int
    matches: Callable[[WorkerSlot, str], bool]
    pins: Pins
    unreserve: Callable[[JobRecord], None]
    unclaim: Callable[[Claim], None]
    _reserve: Callable[[JobRecord, WorkerSlot, float], None]

    def _init_flow(self) -> None:
        self.limiter = Limiter()
        self._parked: dict[Counter, list[tuple[str, str, SubId]]] = {}
        # (when, tie-breaker, counter): counters hold None beside str, so two timers of
        # one moment must never be compared by their counters.
        self._flow_timers: list[tuple[float, int, Counter]] = []
        self._timer_seq = itertools.count()
        self._armed: dict[Counter, float] = {}
        self.visits = 0  # buckets looked at on the limited path (the cost the tests count)

    @property
    def limited(self) -> bool:
        return bool(self.limiter.rules) or bool(self.ready.lanes)

    # -- picking -----------------------------------------------------------------------
    def may_run(self, worker: WorkerSlot, spec: str, seq: int) -> bool:
        """``matches`` for row ``seq``: a job pinned to a version (rota/core/pins.py) too."""
        pin = self.pins.pin(spec, seq) if self.pins.windows else None
        return self.matches(worker, spec) if pin is None else worker.specs.get(spec) == pin

    def checksum_for(self, spec: str, seq: int) -> str | None:  # its pin, or the status quo
        return (self.pins.pin(spec, seq) if self.pins.windows else None) or self.status_quo.get(spec)

    def _pop_limited(self, worker: WorkerSlot, now: float) -> JobRecord | Claim | None:
        """Reserve, in memory, the best job this worker may run within every limit."""
        ready, limiter = self.ready, self.limiter
        # A job a rate governs goes only to a slot that starts it now, never to a line:
        # held there, its start would come later, bunched with others past the rate.
        runs_now = len(worker.active) + worker.claims < worker.concurrency
        for queue in worker.queues:
            plain = ready.buckets.get(queue) or {}
            lanes_of = ready.lanes.get(queue) or {}
            if (not plain and not lanes_of) or queue in self.paused \
                    or not self._scope_open("queue", queue, now, runs_now):
                continue
            best: tuple[tuple[int, int], str, SubId, Bucket, Lanes | None] | None = None
            for spec in itertools.chain(lanes_of, (s for s in plain if s not in lanes_of)):
                pinned = spec in self.pins.windows
                if not (pinned or self.matches(worker, spec)) \
                        or not self._scope_open("spec", spec, now, runs_now):
                    continue
                lanes = lanes_of.get(spec)
                if lanes is None:
                    found: Found | None = None
                    head = ready.head(plain[spec])
                    if head is not None:
                        found = (PLAIN, plain[spec], head)
                else:
                    found = self._front(queue, spec, lanes, plain.get(spec), worker, now)
                if found is not None and pinned and not self.may_run(worker, spec, found[2][1]):
                    continue
                if found is not None and (best is None or found[2] < best[0]):
                    best = (found[2], spec, found[0], found[1], lanes)
            if best is None:
                continue
            _, spec, sub, bucket, lanes = best
            if lanes is not None:  # it had its turn: to the back of the rotation
                if lanes.turn[0] == sub:
                    lanes.turn.rotate(-1)
                else:  # behind buckets this worker looked past
                    lanes.turn.remove(sub)
                    lanes.turn.append(sub)
            taken = ready.pop(bucket)
            key, labels = sub
            if isinstance(taken, JobRecord):
                self._reserve(taken, worker, now)
                ident: str | int = taken.id
                picked: JobRecord | Claim = taken
            else:
                worker.claims += 1
                worker.capacity -= 1
                self.claims += 1
                ident = taken[1]
                picked = Claim(taken[1], queue, spec, taken[0], worker,
                               self.checksum_for(spec, taken[1]), key, labels)
            if limiter.rules:
                limiter.take(ident, queue, spec, key, now)
            return picked
        return None

    def _front(self, queue: str, spec: str, lanes: Lanes, plain: Bucket | None,
               worker: WorkerSlot, now: float) -> Found | None:
        """Turn the rotation until its front has a job this worker may take now within
        the key's limits; parks, on the way, the buckets at a limit or with labels no
        connected worker has, and drops those found empty. None: nothing for it."""
        turn = lanes.turn
        # Buckets this worker may not take (labels another worker has, or a rate and no
        # slot free to start it) are looked past, not sent to the back: they keep their
        # place for the next worker that may take them, or two workers taking turns
        # could pass a bucket between them for ever.
        skipped: list[SubId] = []
        try:
            return self._first_open(queue, spec, lanes, plain, worker, now, skipped)
        finally:
            turn.extendleft(reversed(skipped))

    def _first_open(self, queue: str, spec: str, lanes: Lanes, plain: Bucket | None,
                    worker: WorkerSlot, now: float, skipped: list[SubId]) -> Found | None:
        turn = lanes.turn
        for _ in range(len(turn)):
            sub = turn[0]
            self.visits += 1
            bucket = plain if sub == PLAIN else lanes.subs.get(sub)
            head = None if bucket is None else self.ready.head(bucket)
            if head is None or bucket is None:
                if sub == PLAIN:
                    turn.rotate(-1)
                else:
                    lanes.leave(park=False)  # a push brings it back
                continue
            key, labels = sub
            if labels and not all(label in worker.labels for label in labels):
                if not any(all(label in w.labels for label in labels)
                           for w in self.workers.values()):
                    self._park(LABELS, NEVER, queue, spec, lanes)
                else:
                    skipped.append(turn.popleft())  # another worker may take it
                continue
            checks = self.limiter.key_checks(queue, spec, key)
            if (any(check[2] is not None for check in checks)
                    and len(worker.active) + worker.claims >= worker.concurrency):
                skipped.append(turn.popleft())  # rated: for a slot free to start it now
                continue
            blocked = self.limiter.blocked(checks, now)
            if blocked is not None:
                self._park(blocked[0], blocked[1], queue, spec, lanes)
                continue
            return sub, bucket, head
        return None

    def _scope_open(self, kind: str, name: str, now: float, runs_now: bool = True) -> bool:
        """Whether a queue's or a spec's own limit allows a start now (a timer armed for
        when it will, if it is a rate); a rate allows none into a worker's line
        (``runs_now`` False: the worker has no slot free to start it at once)."""
        if not self.limiter.rules:
            return True
        check = self.limiter.scope_checks(kind, name)
        if check is None:
            return True
        if check[2] is not None and not runs_now:
            return False
        until = self.limiter.until(check, now)
        if until <= now:
            return True
        self._arm(check[0], until)
        return False

    # -- parking -----------------------------------------------------------------------
    def _park(self, counter: Counter, until: float, queue: str, spec: str, lanes: Lanes) -> None:
        """Take the front bucket out of the rotation until ``counter`` frees up (a
        release) or ``until`` (a timer, unless NEVER)."""
        sub = lanes.leave(park=True)
        self._parked.setdefault(counter, []).append((queue, spec, sub))
        self._arm(counter, until)

    def _arm(self, counter: Counter, until: float) -> None:
        if until != NEVER and self._armed.get(counter) != until:
            self._armed[counter] = until
            heapq.heappush(self._flow_timers, (until, next(self._timer_seq), counter))

    def _unpark(self, counter: Counter) -> bool:
        """Bring back every bucket parked on ``counter``; True if there were any."""
        parked = self._parked.pop(counter, None)
        if not parked:
            return False
        for queue, spec, sub in parked:
            lanes = self.ready.lanes.get(queue, {}).get(spec)
            if lanes is not None:
                lanes.unpark(sub)
        return True

    def unpark_due(self, now: float) -> bool:
        """Fire the limit timers due by ``now``: True if a round may now assign more."""
        fired = False
        timers = self._flow_timers
        while timers and timers[0][0] <= now:
            when, _, counter = heapq.heappop(timers)
            if self._armed.get(counter) == when:
                del self._armed[counter]
                self._unpark(counter)
                fired = True
        return fired

    def flow_deadline(self) -> float | None:
        return self._flow_timers[0][0] if self._flow_timers else None

    def made(self, ident: str | int, now: float) -> None:
        """A job's reservation committed: its rates' starts are made now, and buckets
        parked while those starts were pending come back (``Window``)."""
        for counter in self.limiter.made(ident, now):
            self._unpark(counter)

    def _released(self, ident: str | int, *, undo: bool = False) -> None:
        """A job (or a claim) left ``active``: what it held is freer, its parked buckets
        come back. ``undo``: its reservation never happened (its start does not count)."""
        for counter in self.limiter.release(ident, undo=undo):
            self._unpark(counter)

    def workers_changed(self) -> None:
        """A worker came: buckets parked for labels nobody had may find one now."""
        if LABELS in self._parked:
            self._unpark(LABELS)

    # -- limits set, refused, reported ---------------------------------------------------
    def set_limits(self, rules: Mapping[Scope, LimitRule], now: Instant,
                   starts: Mapping[tuple[str, str | None], list[float]] | None = None) -> None:
        """The whole table of limits in force (replacing the last), and, at a start, the
        starts stored for the rates (wall times, by limit name and key)."""
        limiter = self.limiter
        limiter.reset(dict(rules))
        if rules:
            for job in self.jobs.values():
                if job.state == "active" and job.id not in limiter.held:
                    limiter.hold(job.id, job.queue, job.spec, job.concurrency_key)
        if starts:  # (a start stored later than now, by a clock since stepped back: now)
            limiter.load_starts({name: [now.deadline(min(at, now.wall)) for at in times]
                                 for name, times in starts.items()})
        for counter in list(self._parked):
            self._unpark(counter)
        self._flow_timers.clear()
        self._armed.clear()

    def guards(self, ident: str | int) -> tuple[Guard, ...]:
        """The limits a reserved job or claim counts against, for the store's guard."""
        held = self.limiter.held.get(ident)
        if held is None:
            return ()
        guards = []
        for kind, name, key in held[3]:
            rule = self.limiter.rules.get((kind, name))
            if rule is None:
                continue
            concurrency, rate = ((rule.concurrency, rule.rate) if key is None
                                 else (rule.key_concurrency, rule.key_rate))
            guards.append(Guard(limit_name((kind, name)), key, concurrency, rate))
        return tuple(guards)

    def refuse(self, taken: JobRecord | Claim, now: float,
               full: frozenset[tuple[str, str | None]] = frozenset()) -> float:
        """A store guard refused this reservation: another server's reservations hold
        the limit. The job is available again, its worker has the slot back, and the
        limits it counted against are held off until a release or a short while (the
        deadline, returned)."""
        ident = taken.id if isinstance(taken, JobRecord) else taken.seq
        held = self.limiter.held.get(ident)
        if isinstance(taken, JobRecord):
            self.unreserve(taken)
        else:
            self.unclaim(taken)
        until = now + REFUSED_BACKOFF
        counters = held[3] if held else ()
        # Only the limits the store found full: one key held elsewhere must not hold
        # off its spec's other keys (unless the store did not say which).
        named = [c for c in counters if (limit_name((c[0], c[1])), c[2]) in full]
        for counter in named or counters:
            self.limiter.off[counter] = until
            self._arm(counter, until)
        return until

    def limit_use(self, now: float) -> list[LimitUse]:
        """Every limit in force with its use: the scope's own, then each key in use."""
        limiter = self.limiter
        keyed: dict[Scope, set[str]] = {}
        for counter in itertools.chain(limiter.use, limiter.windows):
            if counter[2] is not None:
                keyed.setdefault(counter[:2], set()).add(counter[2])  # type: ignore[arg-type]
        uses = []
        for scope, rule in sorted(limiter.rules.items()):
            check = limiter.scope_checks(*scope)
            if check is not None:
                uses.append(self._use(check, now))
            if rule.key_concurrency is not None or rule.key_rate is not None:
                for key in sorted(keyed.get(scope, ())):
                    use = self._use(((*scope, key), rule.key_concurrency, rule.key_rate), now)
                    if use.running or use.starts:
                        uses.append(use)
        return uses

    def _use(self, check: Check, now: float) -> LimitUse:
        (kind, name, key), concurrency, rate = check
        window = None if rate is None else self.limiter.windows.get((kind, name, key))
        wait = self.limiter.until(check, now) - now if rate is not None else 0.0
        return LimitUse(name=limit_name((kind, name)), key=key, concurrency=concurrency,
                        running=self.limiter.use.get((kind, name, key), 0),
                        rate=None if rate is None else rate.text(),
                        starts=0 if window is None else window.in_window(now),
                        next_start=round(wait, 3) if 0 < wait < NEVER else None)

    # -- explaining --------------------------------------------------------------------
    def job_wait(self, job: Any, now: Instant | float) -> Wait | None:
        """Why this waiting job (anything with queue, spec, and optionally
        concurrency_key and labels) is not running; None if it will be."""
        mono = now.mono if isinstance(now, Instant) else now
        queue, spec = job.queue, job.spec
        wait = why_waiting(self.workers.values(), self.paused, self.status_quo, queue, spec,
                           self.unversioned)
        if wait is not None and wait.blocked:
            return wait
        labels = tuple(getattr(job, "labels", ()) or ())
        if labels:
            capable = [w for w in self.workers.values()
                       if queue in w.queues and self.matches(w, spec)]
            for label in labels:
                if not any(label in w.labels for w in capable):
                    return Wait(NO_LABEL, f"no connected worker has label {label}")
            if not any(all(label in w.labels for label in labels) for w in capable):
                return Wait(NO_LABEL, "no connected worker has all the labels "
                            + ", ".join(labels))
        limited = self._limit_wait(self.limiter.checks(queue, spec,
                                                       getattr(job, "concurrency_key", None)), mono)
        return limited or wait

    def _limit_wait(self, checks: list[Check], now: float) -> Wait | None:
        for check in checks:
            until = self.limiter.until(check, now)
            if until <= now:
                continue
            (kind, name, key), concurrency, rate = check
            scope = f"{kind} {name}" + ("" if key is None else f" key {key}")
            running = self.limiter.use.get(check[0], 0)
            if self.limiter.off.get(check[0], now) > now:
                return Wait(CONCURRENCY_LIMIT, f"limit {limit_name((kind, name))}"
                            + ("" if key is None else f" key {key}") + " is held by another"
                            f" server: next try in {until - now:.1f} s")
            if until == NEVER:
                return Wait(CONCURRENCY_LIMIT, f"concurrency limit {concurrency} for {scope}:"
                            f" {running} running")
            said = f"key {key}" if key is not None else f"{kind} {name}"
            return Wait(RATE_LIMIT, f"rate limit {rate.text() if rate else '?'} for {said}:"
                        f" next start in {max(0.1, until - now):.1f} s")
        return None

    def scope_wait(self, queue: str, spec: str, now: float) -> Wait | None:
        """A queue's or a spec's own limit that holds its jobs now, if any."""
        if not self.limiter.rules:
            return None
        checks = [check for check in (self.limiter.scope_checks("queue", queue),
                                      self.limiter.scope_checks("spec", spec)) if check]
        return self._limit_wait(checks, now)

    def held(self, now: float) -> dict[tuple[str, str], Held]:
        """Per (queue, spec), the available jobs of its keyed and labelled buckets that
        their own key's limit or labels hold now, per wait kind (concurrency_limit,
        rate_limit, no_label): what ``wait`` (the queue's and spec's reason) does not
        see; and the labels that hold them, named (``Held``). For the surfaces (GET
        /metrics, GET /queues): a look at each bucket with jobs, the whole jobs once,
        and the connected workers once per (queue, spec)."""
        lanes_by_queue = self.ready.lanes
        if not lanes_by_queue:
            return {}
        whole: dict[tuple[str, str, SubId], int] = {}
        for job in self.jobs.values():
            if job.state == "available" and (job.concurrency_key is not None or job.labels):
                sub = (job.queue, job.spec, (job.concurrency_key, job.labels))
                whole[sub] = whole.get(sub, 0) + 1
        held: dict[tuple[str, str], Held] = {}
        for queue, lanes_of in lanes_by_queue.items():
            for spec, lanes in lanes_of.items():
                expected = self.status_quo.get(spec)
                carried = {frozenset(w.labels) for w in self.workers.values()
                           if queue in w.queues and w.specs.get(spec) == expected}
                kinds: dict[str, int] = {}
                missing: set[str] = set()
                for sub, bucket in lanes.subs.items():
                    n = bucket.count + whole.get((queue, spec, sub), 0)
                    if not n:
                        continue
                    key, labels = sub
                    if labels and not any(carries.issuperset(labels) for carries in carried):
                        kind: str | None = NO_LABEL
                        missing.update(missing_labels(labels, carried))
                    else:
                        wait = self._limit_wait(self.limiter.key_checks(queue, spec, key), now)
                        kind = None if wait is None else wait.kind
                    if kind is not None:
                        kinds[kind] = kinds.get(kind, 0) + n
                if kinds:
                    named = sorted(missing)
                    held[(queue, spec)] = Held(kinds, tuple(named[:MISSING_NAMED]),
                                               max(0, len(named) - MISSING_NAMED))
        return held


MISSING_NAMED = 5  # labels a (queue, spec)'s summary names; the rest are counted


class Held(NamedTuple):
    """Of a (queue, spec)'s available jobs, those their key's limit or labels hold, per
    wait kind; the labels no connected worker has that hold some (at most
    ``MISSING_NAMED``, sorted: ``missing_labels``), and how many more there are."""

    kinds: dict[str, int]
    missing: tuple[str, ...] = ()
    more: int = 0


def missing_labels(labels: tuple[str, ...], carried: Iterable[frozenset[str]]) -> list[str]:
    """The labels of a set that no worker able to run it carries; if each is carried by
    some worker but none carries them all, the set itself, as "gpu+region:eu"."""
    carried = list(carried)
    alone = [label for label in labels if not any(label in carries for carries in carried)]
    return alone or ["+".join(labels)]
