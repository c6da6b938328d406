"""What producers and operators ask of the engine: new jobs, cancels, retries, spec pushes.

A part of the engine (``Engine`` inherits it), kept apart because it answers requests
rather than workers. Pure, like the rest of the engine: the shell commits what it
returns and answers the request after.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from rota.base import protocol as p
from rota.core.auth import Principal
from rota.core.effects import Arm, Effect, Finished, Save, Send, Wake, Withdraw
from rota.base.errors import DomainError, Forbidden, Invalid, TooLarge, failure_level
from rota.base.ids import MAX_JOB_ID, job_id_problem
from rota.core.jobs import EnqueueRequest, new_job
from rota.core.unique import claim
from rota.core.listing import did_you_mean, listed
from rota.base.logs import log_lines
from rota.core.model import TERMINAL_STATES, Change, Instant, JobRecord, JobState
from rota.core.observe import Observer
from rota.core.endpoints import is_endpoint
from rota.core.pulls import is_pull
from rota.core.ready import row_labels
from rota.core.registry import Registry, short
from rota.core.scheduler import Scheduler
from rota.core.settings import ServerSettings
from rota.base.specs import JobSpec, SpecError, validate_args

log = logging.getLogger("rota.server")


class Pushed(NamedTuple):
    """A status quo change another server made, as ``status_quo_changed`` reads one."""

    name: str
    checksum: str
    previous: str | None
    change: str


class Intake:
    settings: ServerSettings
    scheduler: Scheduler
    registry: Registry
    specs: dict[str, JobSpec]
    retired: dict[str, float]
    unversioned: dict[str, JobSpec]
    observe: Observer
    endpoints_sync: Callable[[Instant], list[Effect]]  # (Endpoints)

    def build(self, request: EnqueueRequest, principal: Principal, now: Instant
              ) -> JobRecord | DomainError:
        """A new job from an enqueue request, or why it is refused."""
        if request.id is not None and (problem := job_id_problem(request.id)) is not None:
            return Invalid("invalid_id", problem)
        spec = self.specs.get(request.spec)
        if request.spec in self.retired:
            return Invalid("spec_retired", f"spec {request.spec!r} was retired at"
                           f" {p.rfc3339(self.retired[request.spec])}; push it again"
                           " ('rota specs push') to use it")
        if spec is None:
            spec = self._unversioned(request)
        if spec is None:
            return Invalid("unknown_spec", unknown_spec(request.spec, self.specs))
        queue = request.queue or spec.queue
        if not principal.may_use_queue(queue):
            return Forbidden("queue_not_allowed",
                             f"this token may not enqueue into queue {queue!r}")
        if request.id is not None and len(principal.stored_id(request.id)) > MAX_JOB_ID:
            room = MAX_JOB_ID - len(principal.stored_id(""))
            return Invalid("invalid_id", f"id has {len(request.id)} characters; a"
                           f" producer token's ids may have {room} at most (they are kept"
                           f" as <token id>:<id>, {MAX_JOB_ID} characters in all)")
        try:
            validate_args(spec, request.args)
            job = new_job(request, spec, now.wall)
        except SpecError as exc:
            return Invalid("invalid_args", str(exc))
        except DomainError as exc:
            return exc
        job.id = principal.stored_id(job.id)  # a producer's ids are its own (rota/core/auth.py)
        options = request.unique or spec.unique
        if options is not None:  # a producer's keys are its own too, as its ids are
            try:
                job.unique = claim(options, spec=job.spec, queue=job.queue, args=request.args,
                                   now=now.wall, token=principal.token_id if principal.owns_ids
                                   else None)
            except Invalid as exc:
                return exc
        limit = self.settings.max_args_bytes
        if len(job.args) > limit:
            return TooLarge("args_too_large", f"args are {len(job.args)} bytes as JSON;"
                            f" the limit (max_args_bytes) is {limit}")
        job.created_by = principal.token_id
        return job

    def _unversioned(self, request: EnqueueRequest) -> JobSpec | None:
        """The spec of an OJS job whose type no spec describes: unversioned, made once
        (docs/ojs.md); None for a Rota job, or under --ojs-registered-types-only."""
        if request.ojs is None or not self.settings.ojs_unversioned:
            return None
        spec = self.unversioned.get(request.spec)
        if spec is None:
            spec = self.unversioned[request.spec] = JobSpec.unversioned(request.spec)
            log.info("unversioned type spec=%s (an OJS job's; no spec was pushed)", spec.name)
        return spec

    def enqueued(self, job: JobRecord, seq: int | None, now: Instant) -> list[Effect]:
        """Take in a new job: once its row is committed (``seq``: its row id), or, when
        the server made its id (no row can have it), at once, with its write queued
        (``seq`` None: the next in order). Then a reservation of it follows its row
        into the writer, and usually into the same commit: on an idle server that
        saves a whole commit between enqueue and assignment."""
        return self.enqueued_all([(job, seq)], now)

    def enqueued_all(self, jobs: list[tuple[JobRecord, int | None]], now: Instant) -> list[Effect]:
        """``enqueued`` for each (job, seq) of a batch, in order, logged in one record."""
        effects: list[Effect] = []
        for job, seq in jobs:
            if seq is None:  # kept whole until ``stored`` gives its row id
                self.scheduler.unstored.add(job.id)
            job.seq = self.scheduler.last_seq + 1 if seq is None else seq
            job.clocks(now)
            self.scheduler.track(job)
            effects += [Arm(t) for t in (job.due, job.expiry) if t is not None]
        log_lines(log, logging.INFO, "enqueue job=%s spec=%s queue=%s priority=%d state=%s",
                  [(job.id, job.spec, job.queue, job.priority, job.state) for job, _ in jobs])
        self.observe.enqueued([job for job, _ in jobs], now.wall)
        return effects + [Wake()]

    def stored(self, job: JobRecord, seq: int) -> None:
        """The row of a job taken in early (``enqueued`` with no ``seq``) committed."""
        self.scheduler.stored(job, seq)

    def not_stored(self, jobs: list[JobRecord], error: BaseException) -> list[Effect]:
        """Jobs taken in before their rows committed, whose commit failed: forget them.
        The producer hears the error; the job never existed."""
        for job in jobs:
            self.scheduler.drop(job)
        if jobs:
            log.log(failure_level(error), "enqueue of %d job(s) not stored: %s", len(jobs),
                    error)
        return [Wake()]

    def cancel(self, job_id: str, now: Instant) -> tuple[str, list[Effect]]:
        """Cancel a job: at once if it waits ("cancelled"), through its worker if it runs
        ("requested"); "not_live" if it is not live. Sends follow the Save."""
        job = self.scheduler.jobs.get(job_id)
        if job is None or job.state in TERMINAL_STATES:
            return "not_live", []
        # A pull worker's or an endpoint's job: at once (a late answer is fenced off).
        if job.state == JobState.ACTIVE and not is_pull(job.worker_id) \
                and not is_endpoint(job.worker_id):
            job.cancel_requested = True
            effects: list[Effect] = [Save([Change(job)])]
            connection = self.registry.get(job.worker_id or "")
            if connection is not None and not job.orphaned:
                effects.append(Send(connection.conn, p.encode(
                    p.Cancel(job_ids=[job.id], reason="cancelled"))))
            log.info("cancel requested job=%s worker=%s", job.id, job.worker_id)
            return "requested", effects
        was_active = job.state == JobState.ACTIVE
        job.move(JobState.CANCELLED)
        self.scheduler.finish(job)
        log.info("cancelled job=%s spec=%s queue=%s", job.id, job.spec, job.queue)
        self.observe.counted(now.wall, "cancel", job.id, job.spec, job.queue,
                             attempt=job.attempt)
        return "cancelled", [Save([Change(job, finished_at=now.wall)]), Finished([job.id]),
                             *([Wake()] if was_active else [])]  # (its slot is free)

    def activate(self, job_id: str, now: Instant) -> tuple[str, list[Effect]]:
        """Run a scheduled job now (OJS's activate): "activated", or the state that
        refuses it ("not_live": not held here)."""
        job = self.scheduler.jobs.get(job_id)
        if job is None:
            return "not_live", []
        if job.state != JobState.SCHEDULED:
            return str(job.state), []
        self.scheduler.add(job)  # available now (run_at cleared), as when it falls due
        log.info("activated job=%s spec=%s queue=%s", job.id, job.spec, job.queue)
        return "activated", [Save([Change(job)]), Wake()]

    def forget_all(self, now: Instant) -> list[Effect]:
        """The store was emptied (POST /ojs/v1/admin/reset, a test switch): forget every
        job, unversioned type and paused queue, as a start on an empty store would.
        Connected workers stay, holding nothing."""
        old = self.scheduler
        fresh = Scheduler(self.settings.visibility_timeout, compact=True,
                          min_lease=old.min_lease)
        fresh.status_quo, fresh.last_seq, fresh.workers = old.status_quo, old.last_seq, old.workers
        for worker in fresh.workers.values():
            worker.active.clear()
            worker.claims = 0
        self.unversioned.clear()
        fresh.unversioned = self.unversioned
        self.scheduler = fresh
        return [Wake()]

    def cancel_not_stored(self, job: JobRecord, was: tuple[str, bool]) -> list[Effect]:
        """A cancel whose write failed, so the caller heard 503: the job goes on as it was
        (``was``: its state and cancel request before), rather than staying cancelled in
        memory while its row says otherwise."""
        state, requested = was
        job.cancel_requested = requested
        if job.state != JobState.CANCELLED or state == JobState.CANCELLED:
            return []
        job.state = state  # undone, not a move: the move was never stored
        self.scheduler.track(job)
        log.info("cancel not stored job=%s: it goes on %s", job.id, state)
        return [Wake()]

    def cancel_waiting(self, row: dict[str, Any], now: Instant) -> tuple[str, list[Effect]]:
        """Cancel a job whose row (just read) says available and that ``cancel`` did not
        find: kept as a key only. Its key is skipped from now on, and the store cancels
        the row if it is still available: it may be in a reservation written before."""
        if row["id"] in self.scheduler.jobs:  # reserved while its row was read
            return self.cancel(row["id"], now)
        key, labels = row.get("concurrency_key"), row_labels(row.get("labels"))
        self.scheduler.ready.withdraw(row["queue"], row["spec"], row["rowid"], key, labels)
        return "withdrawing", [Withdraw(row["id"], row["rowid"], row["queue"], row["spec"],
                                        row["priority"], now.wall, key, labels)]

    def withdrawn(self, withdraw: Withdraw, cancelled: bool) -> list[Effect]:
        """The outcome of a ``Withdraw``: ``cancelled``, or the job was reserved (or had
        finished) first and goes on as it was."""
        self.scheduler.ready.withdrawn(withdraw.queue, withdraw.spec, withdraw.priority,
                                       withdraw.seq, cancelled, withdraw.concurrency_key,
                                       withdraw.labels)
        if not cancelled:
            return [Wake()]
        log.info("cancelled job=%s spec=%s queue=%s", withdraw.job_id, withdraw.spec,
                 withdraw.queue)
        self.observe.counted(withdraw.wall, "cancel", withdraw.job_id, withdraw.spec,
                             withdraw.queue)
        return [Finished([withdraw.job_id])]

    def replaced(self, rows: list[dict[str, Any]], by: str, now: Instant,
                 reason: str | None = None) -> list[Effect]:
        """Waiting jobs a unique enqueue replaced (job ``by``), or cancelled with their
        workflow ``by`` (``reason``): their rows were cancelled in its transaction. A copy
        held here goes now, whole or as a key; one reserved meanwhile loses at its
        reservation's fence, as a copy another server holds does."""
        effects: list[Effect] = []
        ready = self.scheduler.ready
        for row in rows:
            job = self.scheduler.jobs.get(row["id"])
            if job is not None and job.state in (JobState.AVAILABLE, JobState.SCHEDULED,
                                                 JobState.RETRYABLE):
                job.move(JobState.CANCELLED)
                self.scheduler.finish(job)
            elif job is None:
                key, labels = row.get("concurrency_key"), row_labels(row.get("labels"))
                if ready.holds(row["queue"], row["spec"], row["priority"], row["rowid"], key,
                               labels):
                    ready.withdraw(row["queue"], row["spec"], row["rowid"], key, labels)
                    ready.withdrawn(row["queue"], row["spec"], row["priority"], row["rowid"],
                                    True, key, labels)
            if reason is None:
                log.info("replaced job=%s spec=%s queue=%s by job=%s (unique)", row["id"],
                         row["spec"], row["queue"], by)
            else:
                log.info("cancel job=%s spec=%s queue=%s: %s", row["id"], row["spec"],
                         row["queue"], reason)
            self.observe.counted(now.wall, "cancel", row["id"], row["spec"], row["queue"],
                                 attempt=row["attempt"],
                                 message=reason or f"replaced by job {by}")
            effects.append(Finished([row["id"]]))
        return effects

    def retry(self, job: JobRecord) -> list[Effect]:
        """Put a discarded or cancelled job (loaded from its row) back, with a fresh
        attempt budget: the row first. Only once it is committed (``retried``) do
        workers see the job, so a write the disk refuses leaves nothing behind."""
        job.budget_start, job.fails, job.deaths, job.cancel_requested = job.attempt, 0, 0, False
        job.expires_at = job.expiry = None
        job.move(JobState.AVAILABLE)
        job.run_at = job.due = None
        job.worker_id = None
        return [Save([Change(job, retry=True)])]

    def retried(self, job: JobRecord, now: Instant | None = None) -> list[Effect]:
        """The retry's row is committed: the job waits for a worker again."""
        self.scheduler.add(job)
        log.info("retry job=%s spec=%s queue=%s", job.id, job.spec, job.queue)
        self.observe.counted(self.observe.latest if now is None else now.wall, "retry",
                             job.id, job.spec, job.queue, attempt=job.attempt,
                             message="retried by an operator")
        return [Wake()]

    # -- what other servers on the same database did (docs/scaling.md) ------------------
    def taken_in(self, jobs: list[JobRecord], now: Instant) -> list[Effect]:
        """Jobs another server made wait (new, retried, back from a worker, due), as
        their rows read now. Every server may give them out and the row decides who does
        (fenced reservations), so each takes them in. A copy held here gives way to the
        row, unless this server has it reserved or holds a later attempt of it: its own
        reservation's commit decides then."""
        effects: list[Effect] = []
        for job in jobs:
            known = self.scheduler.jobs.get(job.id)
            if known is not None:
                if (known.state == JobState.ACTIVE or known.attempt > job.attempt
                        or job.id in self.scheduler.unstored):
                    continue
            self._hold_as_read(job, now)
            effects += [Arm(t) for t in (job.due, job.expiry) if t is not None]
        return effects + [Wake()] if jobs else effects

    def taken_over(self, jobs: list[JobRecord], worker_id: str, now: Instant) -> list[Effect]:
        """Jobs a worker held through another server, whose rows name this server now
        (``Coordinator.take_over``): kept for the worker as after a restart, so the
        registration that follows reclaims them and their results are taken."""
        grace = now.mono + self.settings.heartbeat_timeout
        for job in jobs:
            self._hold_as_read(job, now)
            job.started = True  # its start reports went to the other server: as at a restart
            self.scheduler.orphan(job, grace)
        if jobs:
            log_lines(log, logging.INFO, "take over job=%s spec=%s queue=%s worker=%s"
                      " attempt=%d from another server", [(j.id, j.spec, j.queue, worker_id,
                                                          j.attempt) for j in jobs])
        return []

    def running_here(self) -> list[JobRecord]:
        """The jobs this server's workers run, as it holds them: after its lease lapsed,
        the ones it asks to take back (``lapse_settled``)."""
        return [job for job in self.scheduler.jobs.values()
                if job.state == JobState.ACTIVE and job.worker_id is not None]

    def lapse_settled(self, lost: list[str], now: Instant) -> list[Effect]:
        """This server's lease had lapsed and another recovered its workers' jobs; it took
        back those that still waited (their rows name it again), and ``lost`` are the
        rest: another server gave them out again, or they ended there. The run here is
        stale: its worker is told to cancel it, and its slot is free (a result it still
        sends is turned away as unknown here and by the attempt fence in the row; a
        ``reservation_lost`` cancel tells the SDK not to send one)."""
        # A job that ended here meanwhile is left alone: its row decided, nothing runs.
        stale = [job for job in map(self.scheduler.jobs.get, lost)
                 if job is not None and job.state == JobState.ACTIVE]
        log_lines(log, logging.WARNING, "lost job=%s spec=%s queue=%s worker=%s attempt=%d:"
                  " this server's lease had lapsed and another server gave it out again;"
                  " the run here is cancelled",
                  [(j.id, j.spec, j.queue, j.worker_id, j.attempt) for j in stale])
        effects: list[Effect] = []
        for job in stale:
            connection = self.registry.get(job.worker_id or "")
            if connection is not None and not job.orphaned:
                effects.append(Send(connection.conn, p.encode(
                    p.Cancel(job_ids=[job.id], reason="reservation_lost"))))
            self.scheduler.let_go(job)
        return effects + [Wake()] if lost else []

    def _hold_as_read(self, job: JobRecord, now: Instant) -> None:
        """Hold ``job`` as its row was just read, in place of any copy held until now."""
        known = self.scheduler.jobs.get(job.id)
        if known is not None:
            self.scheduler.finish(known)
        if job.spec not in self.specs and job.spec not in self.unversioned:
            # an OJS job another server took, or a step released: its type unversioned here too
            self.unversioned[job.spec] = JobSpec.unversioned(job.spec)
        job.clocks(now)
        self.scheduler.track(job)

    def status_quo_read(self, specs: dict[str, JobSpec], checksums: dict[str, str],
                        retired: dict[str, float], now: Instant) -> list[Effect]:
        """The status quo as the database says after another server's push or
        retirement: what differs from this server's takes effect here too."""
        held = self.scheduler.status_quo
        changes = [Pushed(name, checksum, held.get(name), "changed" if name in held else "new")
                   for name, checksum in checksums.items() if held.get(name) != checksum]
        effects = self.status_quo_changed([specs[c.name] for c in changes], changes, now)
        for name in retired.keys() - self.retired.keys():
            log.info("retired spec=%s (by another server)", name)
        self.retired.clear()
        self.retired.update(retired)
        return effects if changes else []

    def is_live(self, job_id: str) -> bool:
        """Whether the job is held whole (a compact waiting job is not: its row says so)."""
        return job_id in self.scheduler.jobs

    def status_quo_changed(self, specs: list[JobSpec], changes: list[Any],
                           now: Instant | None = None) -> list[Effect]:
        """A push committed: the new checksums rule from now on."""
        by_name = {s.name: s for s in specs}
        for change in changes:
            if change.change == "unchanged":
                continue
            self.retired.pop(change.name, None)
            self.unversioned.pop(change.name, None)  # versioned from now on
            self.specs[change.name] = by_name[change.name]
            self.scheduler.status_quo[change.name] = change.checksum
            log.info("status quo spec=%s checksum=%s previous=%s", change.name,
                     short(change.checksum), short(change.previous))
            self.observe.event(self.observe.latest if now is None else now.wall,
                               "state_change", spec=change.name, checksum=change.checksum,
                               state="status_quo", message=f"spec {change.name} pushed:"
                               f" {change.change}, checksum {short(change.checksum)}")
            for worker_id in self._mismatched(change.name, change.checksum):
                declared = self.scheduler.workers[worker_id].specs[change.name]
                log.warning("spec mismatch worker=%s spec=%s checksum=%s status_quo=%s",
                            worker_id, change.name, short(declared), short(change.checksum))
            first = getattr(change, "first_seq", None)  # (push execution's pins)
            self.scheduler.pins.pushed(by_name[change.name], change.checksum,
                                       self.scheduler.last_seq + 1 if first is None else first)
        synced = self.endpoints_sync(now) if now is not None else []
        return [Wake(), *synced]  # queued jobs may now have (other) capable workers

    def retire(self, name: str, checksum: str, wall: float) -> int:
        """Spec ``name`` takes no new jobs from now on; its status quo stays, so the jobs
        that wait still run on the workers that match it. Returns how many do."""
        self.retired[name] = wall
        matching = self.scheduler.matching_workers(name, checksum)
        log.info("retired spec=%s checksum=%s matching_workers=%d", name, short(checksum),
                 len(matching))
        return len(matching)

    def _mismatched(self, spec: str, checksum: str) -> list[str]:
        """Workers that declare another checksum: not an older version's endpoint, which
        goes on delivering the jobs enqueued under it by design (rota/core/pins.py)."""
        return [w for w in self.scheduler.mismatched_workers(spec, checksum)
                if not is_endpoint(w)]

    def change_report(self, change: Any) -> dict[str, Any]:
        mismatched = self._mismatched(change.name, change.checksum)
        matching = self.scheduler.matching_workers(change.name, change.checksum)
        return {"name": change.name, "change": change.change, "checksum": change.checksum,
                "previous": change.previous, "mismatched_workers": len(mismatched),
                "matching_workers": len(matching)}


def unknown_spec(name: str, known: dict[str, JobSpec]) -> str:
    """Why a spec name is refused: a likely misspelling named, and what is known."""
    guess = did_you_mean(name, known)
    return (f"spec {name!r} has no status quo" + (f"; did you mean {guess}?" if guess else ".")
            + (f" Known specs: {listed(known)}." if known else " No spec has been pushed yet.")
            + " Push a spec with 'rota specs push' first.")
