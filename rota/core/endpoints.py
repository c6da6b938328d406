"""Push execution: each version of a spec with ``[execute]`` is an endpoint, a virtual
connected worker the scheduler hands jobs to like any other. Pure.

A part of the engine (``Engine`` inherits it). An endpoint worker (``http:<spec>@<12
hex>``, negative ``conn``) serves its spec at its checksum, in every queue its jobs wait
in, with ``max_in_flight`` slots. A round reserves for it, the reservation commits, and
instead of an ``assign`` frame each job becomes a ``Deliver`` effect: the shell POSTs it
(rota/server/deliverer.py) and hands back a ``Delivered``, which settles the attempt
through the same result path as a worker's heartbeat (retries, backoff, fencing by
attempt). A 202 leaves the job running on its spec's visibility timeout: the endpoint
reports (or beats) by callback with a per-attempt token. Jobs enqueued under a version
go to that version's endpoint (rota/core/pins.py), so a deploy that moves the URL sends
no old job to the new one. An endpoint that keeps failing is paused by its circuit
breaker (rota/core/breaker.py), and its jobs say why they wait.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from rota.base import protocol as p
from rota.base.ids import uuid7
from rota.base.push import Delivered, Delivery
from rota.base.specs import Execute, JobSpec
from rota.core.auth import OPEN
from rota.core.breaker import Breaker
from rota.core.effects import Arm, Deliver, Effect, Note, Wake
from rota.core.model import Instant, JobRecord, JobState, StatusNote
from rota.core.observe import Observer
from rota.core.pins import Window
from rota.core.registry import ConnectedWorker, Registry, short
from rota.core.scheduler import Scheduler, WorkerSlot

log = logging.getLogger("rota.server")
PREFIX = "http:"  # an endpoint's id in the registry: "http:<spec>@<checksum's first 12 hex>"
# Seconds a delivery's lease runs beyond its timeout: the answer may be on its way.
DELIVERY_MARGIN = 10.0
MAX_NOTE = 500  # characters of a successful answer kept in the job's log line


def endpoint_id(spec: str, checksum: str) -> str:
    return f"{PREFIX}{spec}@{checksum.removeprefix('sha256:')[:12]}"


def is_endpoint(worker_id: str | None) -> bool:
    return worker_id is not None and worker_id.startswith(PREFIX)


def callback_token(key: bytes, job_id: str, attempt: int) -> str:
    """The token that proves a callback speaks for this attempt of this job."""
    digest = hmac.new(key, f"{job_id}.{attempt}".encode(), hashlib.sha256).hexdigest()
    return f"{attempt}.{digest[:40]}"


def token_attempt(key: bytes, job_id: str, token: str) -> int | None:
    """The attempt a callback token was made for (None: it is not one of ours)."""
    if not token.isascii():  # (compare_digest refuses non-ASCII text)
        return None
    head, _, _ = token.partition(".")
    if not (head.isascii() and head.isdigit()) or len(head) > 9:  # ("²", "١": digits to str)
        return None
    attempt = int(head)
    return attempt if hmac.compare_digest(callback_token(key, job_id, attempt), token) else None


@dataclass(slots=True)
class EndpointState:
    """What the engine keeps of one endpoint beside its connection."""

    id: str
    spec: JobSpec
    checksum: str
    conn: int
    breaker: Breaker = field(default_factory=Breaker)
    deliveries: dict[str, str] = field(default_factory=dict)  # job id -> its delivery id
    accepted: set[str] = field(default_factory=set)  # answered 202: running there
    trials: set[str] = field(default_factory=set)  # delivered while its breaker tries
    seq: int = 0  # the last synthetic heartbeat's seq

    @property
    def execute(self) -> Execute:
        assert self.spec.execute is not None
        return self.spec.execute


class Called(NamedTuple):
    """A callback: refused (``refusal``: why; ``state``: the job's state here, None if it
    is not held here), or taken (its effects; ``seq``: the synthetic heartbeat on
    ``conn`` whose ack says the result committed, None for a heartbeat)."""

    refusal: str | None
    state: str | None
    effects: list[Effect]
    conn: int = 0
    seq: int | None = None


class Endpoints:
    scheduler: Scheduler
    registry: Registry
    observe: Observer
    endpoints: dict[str, EndpointState]
    _endpoint_conns: dict[int, EndpointState]
    callback_key: bytes
    _pull_conns: int  # (Pulls: the negative connection numbers are shared)
    heartbeat: Callable[[int, str, p.Heartbeat, Instant], list[Effect]]  # (Heartbeats)

    def _init_endpoints(self) -> None:
        self.endpoints = {}
        self._endpoint_conns = {}
        self.callback_key = b""  # set by the shell from the store (one per database)

    # -- the virtual workers -------------------------------------------------------------
    def load_pins(self, windows: dict[str, list[Window]], now: Instant) -> list[Effect]:
        """The versions of push-executed specs as the store holds them (at a start, or
        after another server's push): their pins and their endpoint workers."""
        self.scheduler.pins.load(windows)
        return self.endpoints_sync(now)

    def endpoints_sync(self, now: Instant) -> list[Effect]:
        """An endpoint worker for every version with ``[execute]`` that the pins know
        (the status quo's and older ones whose jobs may still wait)."""
        added = False
        for window in self.scheduler.pins.executed():
            eid = endpoint_id(window.spec.name, window.checksum)
            if eid in self.endpoints or window.spec.execute is None:
                continue
            execute = window.spec.execute
            self._pull_conns += 1
            state = EndpointState(eid, window.spec, window.checksum, -self._pull_conns)
            slot = WorkerSlot(id=eid, queues=[window.spec.queue],
                              concurrency=execute.max_in_flight,
                              specs={window.spec.name: window.checksum},
                              capacity=execute.max_in_flight)
            reg = p.Registration(hostname=urlsplit(execute.url).hostname or "-", os="-", pid=0,
                                 sdk="http-endpoint", queues=slot.queues,
                                 concurrency=execute.max_in_flight,
                                 specs=[p.SpecRef(name=window.spec.name, checksum=window.checksum)])
            self.scheduler.add_worker(slot)
            self.registry.add(ConnectedWorker(state.conn, slot, reg, now.wall, now.mono, OPEN))
            self.endpoints[eid] = self._endpoint_conns[state.conn] = state
            log.info("endpoint ready worker=%s spec=%s@%s url=%s max_in_flight=%d timeout=%gs",
                     eid, window.spec.name, short(window.checksum), execute.url,
                     execute.max_in_flight, execute.timeout)
            added = True
        return [Wake()] if added else []

    def _endpoint_queues(self) -> None:
        """Before a round: each endpoint serves every queue its spec's jobs wait in, with
        its free slots counted afresh (a job cancelled, or whose lease lapsed, frees one)."""
        buckets = self.scheduler.ready.buckets
        for state in self.endpoints.values():
            self._room(state)
            name = state.spec.name
            slot = self.registry.connections[state.id].worker
            queues = [q for q, by_spec in buckets.items() if name in by_spec]
            if state.spec.queue not in queues:
                queues.insert(0, state.spec.queue)
            if queues != slot.queues:
                slot.queues = queues

    def _room(self, state: EndpointState) -> None:
        """Its free slots: ``max_in_flight`` (one while its breaker tries, none while
        open); a job answered 202 holds none."""
        slot = self.registry.connections[state.id].worker
        state.accepted &= slot.active
        state.deliveries = {j: d for j, d in state.deliveries.items() if j in slot.active}
        slot.prefetch = len(state.accepted)
        room = state.breaker.room(state.execute.max_in_flight)
        state.trials &= state.deliveries.keys()
        if state.breaker.state == "half_open":  # one trial at a time, counting one reserved
            # whose commit is pending (not delivered yet): rounds run meanwhile
            pending = len(slot.active - state.deliveries.keys() - state.accepted) + slot.claims
            room = max(0, room - len(state.trials) - pending)
        slot.capacity = room

    # -- delivering ------------------------------------------------------------------------
    def _deliveries(self, connection: ConnectedWorker, jobs: list[JobRecord], now: Instant
                    ) -> list[Effect] | None:
        """Jobs just reserved for an endpoint, committed: one ``Deliver`` each (None: not
        an endpoint's connection). Its lease: the delivery's timeout and a margin."""
        state = self._endpoint_conns.get(connection.conn)
        if state is None:
            return None
        execute = state.execute
        effects: list[Effect] = []
        lease = execute.timeout + DELIVERY_MARGIN
        for job in jobs:
            job.lease_expires_at = now.wall + lease
            self.scheduler.hold(job, now.mono + lease)
            delivery_id = state.deliveries[job.id] = uuid7()
            if state.breaker.state == "half_open":
                state.trials.add(job.id)
            effects.append(Deliver(Delivery(
                job_id=job.id, attempt=job.attempt, spec=job.spec, checksum=state.checksum,
                queue=job.queue, args=job.args, priority=job.priority, url=execute.url,
                timeout=execute.timeout, headers=dict(execute.headers), secret=execute.secret,
                delivery_id=delivery_id, deadline=now.wall + execute.timeout,
                callback_token=callback_token(self.callback_key, job.id, job.attempt))))
        if jobs:
            effects.append(Arm(now.mono + lease))
        return effects

    def endpoint_result(self, delivered: Delivered, now: Instant) -> list[Effect]:
        """What a delivery came to: counted by the breaker, then the attempt settles (or,
        answered 202, runs on). A delivery of an attempt that moved on changes nothing."""
        job = self.scheduler.jobs.get(delivered.job_id)
        state = self.endpoints.get(job.worker_id or "") if job is not None else None
        if (job is None or state is None or job.state != JobState.ACTIVE or job.orphaned
                or job.attempt != delivered.attempt
                or state.deliveries.get(job.id) != delivered.delivery_id):
            log.info("delivery answer ignored job=%s attempt=%d delivery=%s status=%s: the"
                     " attempt moved on", delivered.job_id, delivered.attempt,
                     delivered.delivery_id, delivered.status or "-")
            return [Wake()]  # (its slot may be free: the round counts it afresh)
        effects = self._judged(state, delivered, now)
        log.log(logging.INFO if delivered.kind != "failed" else logging.WARNING,
                "delivered job=%s spec=%s@%s queue=%s worker=%s attempt=%d status=%s ms=%.0f"
                " outcome=%s%s", job.id, job.spec, short(state.checksum), job.queue, state.id,
                job.attempt, delivered.status or "-", delivered.ms, delivered.kind,
                f" error={delivered.error.type}: {delivered.error.message}"
                if delivered.error is not None else "")
        if delivered.kind != "failed":  # (a failure's record is its error's details)
            effects.append(Note([StatusNote(job.id, job.attempt, now.wall, line=(
                "log", "info", f"delivered: HTTP {delivered.status} in {delivered.ms:.0f} ms"
                f" (delivery {delivered.delivery_id}){': ' if delivered.body else ''}"
                f"{delivered.body[:MAX_NOTE]}"))]))
        if delivered.kind == "accepted":
            state.accepted.add(job.id)
            lease = max(job.visibility_timeout or self.scheduler.visibility_timeout,
                        self.scheduler.min_lease)
            job.lease_expires_at = now.wall + lease
            self.scheduler.hold(job, now.mono + lease)
            self._room(state)
            return [*effects, Arm(now.mono + lease), Wake()]
        error = delivered.error
        if error is not None:
            details: dict[str, Any] = delivered.record()
            if delivered.retry_in is not None:
                details["retry_after"] = delivered.retry_in
            error = p.ErrorInfo(type=error.type, message=error.message,
                                retryable=error.retryable, details=details, code=error.code)
        outcome = "completed" if delivered.kind == "completed" else "failed"
        return effects + self._settle(state, job, p.Result(
            job_id=job.id, attempt=job.attempt, outcome=outcome, result=delivered.result,
            error=error), now)

    def _judged(self, state: EndpointState, delivered: Delivered, now: Instant) -> list[Effect]:
        """The breaker's count of one answer; its openings and closings are logged. While
        it tries, only its trial's answer counts (one sent before it opened proves
        nothing about now)."""
        breaker = state.breaker
        if breaker.state == "half_open" and delivered.job_id not in state.trials:
            return []
        if delivered.fault and breaker.fault(now.mono):
            reason = breaker.reason(now.mono)
            log.warning("endpoint paused worker=%s url=%s: %s", state.id, state.execute.url,
                        reason)
            self.observe.event(now.wall, "state_change", worker=state.id, state="paused",
                               spec=state.spec.name, message=f"{state.id} {reason}")
            self._room(state)
            return [Arm(breaker.until)]
        if not delivered.fault and breaker.success():
            log.info("endpoint recovered worker=%s url=%s", state.id, state.execute.url)
            self.observe.event(now.wall, "state_change", worker=state.id, state="recovered",
                               spec=state.spec.name, message=f"{state.id} recovered")
        self._room(state)
        return []

    def _settle(self, state: EndpointState, job: JobRecord, result: p.Result, now: Instant
                ) -> list[Effect]:
        """An endpoint's result, as a one-result heartbeat on its connection."""
        state.deliveries.pop(job.id, None)
        state.accepted.discard(job.id)
        state.seq += 1
        beat = p.Heartbeat(seq=state.seq, worker_id=state.id, results=[result])
        effects = self.heartbeat(state.conn, state.id, beat, now)
        self._room(state)
        return effects

    # -- callbacks (after a 202) ---------------------------------------------------------
    def endpoint_callback(self, job_id: str, token: str, result: p.Result | None,
                          now: Instant) -> Called:
        """A callback of an endpoint's long job: its result (``result``), or a heartbeat
        (None: the lease starts again). The token fences by attempt."""
        attempt = token_attempt(self.callback_key, job_id, token) if self.callback_key else None
        if attempt is None:
            return Called("the token is not this job's", None, [])
        job = self.scheduler.jobs.get(job_id)
        if job is not None and job.orphaned and is_endpoint(job.worker_id):
            self._adopt_endpoint_job(job, now)  # held before a restart: its callback reclaims
        state = self.endpoints.get(job.worker_id or "") if job is not None else None
        shown = None if job is None else str(job.state)
        if job is None or state is None or job.state != JobState.ACTIVE or job.orphaned:
            return Called(f"the job is not running on an endpoint: it is {shown}" if shown
                          else "the job is not running on an endpoint here (it finished,"
                          " or its attempt moved on)", shown, [])
        if job.attempt != attempt:
            return Called(f"attempt {attempt} is not the job's current attempt {job.attempt}",
                          shown, [])
        if result is None:
            lease = max(job.visibility_timeout or self.scheduler.visibility_timeout,
                        self.scheduler.min_lease)
            job.lease_expires_at = now.wall + lease
            self.scheduler.hold(job, now.mono + lease)
            return Called(None, shown, [Arm(now.mono + lease)], state.conn)
        log.info("callback job=%s spec=%s@%s worker=%s attempt=%d outcome=%s", job.id, job.spec,
                 short(state.checksum), state.id, job.attempt, result.outcome)
        result = p.Result(job_id=job.id, attempt=job.attempt, outcome=result.outcome,
                          result=result.result, error=result.error)
        effects = self._settle(state, job, result, now)
        return Called(None, shown, effects, state.conn, state.seq)

    def _adopt_endpoint_job(self, job: JobRecord, now: Instant) -> None:
        state = self.endpoints.get(job.worker_id or "")
        if state is None:
            return
        slot = self.registry.connections[state.id].worker
        for taken in self.scheduler.adopt(slot, [job.id], now.mono):
            state.accepted.add(taken.id)
            log.info("reclaim job=%s queue=%s worker=%s attempt=%d (by callback)", taken.id,
                     taken.queue, state.id, taken.attempt)
        self._room(state)

    # -- clock and views -------------------------------------------------------------------
    def _endpoints_tick(self, now: Instant) -> list[Effect]:
        """From ``tick``: a breaker whose pause is over tries one delivery."""
        effects: list[Effect] = []
        for state in self.endpoints.values():
            if state.breaker.tick(now.mono):
                log.info("endpoint trying worker=%s: one delivery after its pause", state.id)
                self._room(state)
                effects.append(Wake())
        return effects

    def endpoint_wait(self, queue: str, spec: str, now: Instant) -> str | None:
        """Why jobs of (queue, spec) wait on their endpoint (None: they do not)."""
        checksum = self.scheduler.status_quo.get(spec)
        state = self.endpoints.get(endpoint_id(spec, checksum)) if checksum else None
        return None if state is None else state.breaker.reason(now.mono)

    def endpoint_view(self, now: Instant) -> list[dict[str, Any]]:
        """Every endpoint with its breaker, for GET /endpoints, the dashboard and /metrics."""
        views = []
        for state in self.endpoints.values():
            slot = self.registry.connections[state.id].worker
            views.append({
                "id": state.id, "spec": state.spec.name, "checksum": state.checksum,
                "url": state.execute.url, "status_quo":
                    self.scheduler.status_quo.get(state.spec.name) == state.checksum,
                "state": state.breaker.state, "reason": state.breaker.reason(now.mono),
                "in_flight": len(state.deliveries), "accepted": len(state.accepted),
                "max_in_flight": state.execute.max_in_flight, "active": len(slot.active),
                "opened": state.breaker.opened})
        return views
