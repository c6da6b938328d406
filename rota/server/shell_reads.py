"""What the routes, the dashboard and the feeds read of the shell: jobs, queues, specs,
workers, tokens and the store's health, asked of the ``Coordinator`` (which inherits
this mixin) and never of its store, scheduler or engine (tests/house/test_shell_boundary.py).

The views' shapes (JSON, HTML) stay with the routes; here are only the facts they are
made of, so that a change in how the shell keeps them touches one place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType, SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple

from rota.store.health import Degraded
from rota.core.engine import MAX_LOG_LINES, Engine
from rota.core.auth import kept_ids
from rota.core.limits import LimitRule, LimitUse, Scope
from rota.core.lines import line_counts
from rota.core.listing import JobFilter, new_queue_problem, unknown_name
from rota.core.model import JOB_STATES, Instant
from rota.core.observe import Observer
from rota.core.ready import CONCURRENCY_LIMIT, RATE_LIMIT, Wait, WorkerSlot, row_labels
from rota.core.registry import ConnectedWorker
from rota.store.store import Store


MAX_TOKENS_ASKED = 100  # producer tokens whose kept ids a 404 looks for
NONE_HELD: Mapping[str, int] = MappingProxyType({})
ENDPOINT_FAILING = "endpoint_failing"  # a Wait's kind: the spec's endpoint is paused


class Waiting(NamedTuple):
    """Available jobs of one queue and spec, and why no worker takes them now (None:
    one will); ``wait`` says whether that blocks them (rota/core/ready.py Wait).
    ``held``: of those jobs, the ones their own concurrency key's limit or their labels
    hold, per wait kind (concurrency_limit, rate_limit, no_label), beyond ``wait``;
    ``missing_labels``, the labels no connected worker has that hold some (at most 5,
    rota/core/flow.py Held), and ``missing_more``, how many others."""

    queue: str
    spec: str
    jobs: int
    reason: str | None
    wait: Wait | None = None
    held: Mapping[str, int] = NONE_HELD
    missing_labels: tuple[str, ...] = ()
    missing_more: int = 0

    def kinds(self) -> dict[str, int]:
        """Its jobs per the wait kind that holds them (rota_jobs_blocked's reasons): all
        of them under a blocking reason or a queue's or spec's own limit; else those
        a key's limit or labels hold, each under its kind. A backlog behind busy
        workers is none."""
        wait = self.wait
        if wait is not None and self.jobs and (wait.blocked or wait.kind in LIMIT_KINDS):
            return {wait.kind: self.jobs}
        return dict(self.held)

    @property
    def blocked(self) -> bool:
        """No worker will take them as things stand (not a backlog: Wait.blocked)."""
        return self.wait is not None and self.wait.blocked and self.jobs > 0


LIMIT_KINDS = frozenset({CONCURRENCY_LIMIT, RATE_LIMIT})


class SpecWorkers(NamedTuple):
    """Who serves a spec: its checksum in the status quo ("" if none), the workers that
    declare that checksum, and the others with the checksum each declares."""

    checksum: str
    matching: list[str]
    other: list[tuple[str, str]]


def _queue_names(engine: Engine) -> Iterator[Iterable[str]]:
    """The queues named by the specs, the pauses, the retention rules and the connected
    workers (no job is looked at), cheapest first: a fleet of 10,000 workers comes last."""
    scheduler = engine.scheduler
    yield (s.queue for s in engine.specs.values())
    yield scheduler.paused
    yield (q for q, _, _ in engine.settings.retain_queues)
    yield (q for w in scheduler.workers.values() for q in w.queues)


def _named(engine: Engine, queue: str) -> bool:
    """Whether a spec, a pause, a retention rule or a worker names ``queue``: an enqueue
    that names its queue asks this, and stops at the first source that has it."""
    return any(queue in names for names in _queue_names(engine))


def queues_in_memory(engine: Engine) -> set[str]:
    """The queues the engine knows of without a read: those named, and those of the
    jobs it holds."""
    return set().union(*_queue_names(engine), engine.scheduler.live_counts())


async def _holds_jobs(store: Store, queue: str) -> bool:
    """Whether a stored job is in ``queue`` (a queue named only at enqueue is known by
    its jobs, finished ones too)."""
    held, _ = await store.list_jobs(JobFilter(queue=queue), 1, None)
    return bool(held)


async def refuse_unknown(store: Store, engine: Engine, flt: JobFilter) -> None:
    """Raise listing.unknown_name's refusal if ``flt`` names a spec or queue nothing
    knows. What memory holds is asked first; the store only for a name it lacks."""
    specs: set[str] | dict[str, Any] = engine.specs
    if flt.spec is not None and flt.spec not in specs and store.shared:
        specs = set(specs) | set((await store.status_quo())[0])  # pushed through another server
    queues: set[str] = set()
    if flt.queue is not None:
        queues = queues_in_memory(engine)
        if flt.queue not in queues and await _holds_jobs(store, flt.queue):
            queues.add(flt.queue)
    refusal = unknown_name(flt, specs, queues)
    if refusal is not None:
        raise refusal


async def new_queue_problems(store: Store, engine: Engine, names: Iterable[str], *,
                             resuming: bool = False) -> dict[str, str]:
    """listing.new_queue_problem for each queue a pause, a resume or an enqueue names
    (the refused ones only), with every queue known: memory first, counted once, and
    the store only for a name refused there."""
    problems: dict[str, str] = {}
    names = set(names)
    if not names:
        return problems
    known: set[str] | None = None
    for name in (n for n in names if not _named(engine, n)):  # usually none: named
        known = queues_in_memory(engine) if known is None else known
        problem = new_queue_problem(name, known, resuming=resuming)
        if problem is None or await _holds_jobs(store, name) or (
                store.shared and name in await store.paused_queues()):
            continue  # known after all: by its stored jobs, or paused through another server
        problems[name] = problem
    return problems


class ShellReads:
    """A mixin of the ``Coordinator``: reads, no effects."""

    if TYPE_CHECKING:
        store: Store
        engine: Engine
        clock: Callable[[], Instant]

    # -- jobs ----------------------------------------------------------------------
    async def get_job(self, job_id: str) -> dict[str, Any] | None:
        """The job's row, or None."""
        return await self.store.get_job(job_id)

    async def kept_as(self, job_id: str) -> list[str]:
        """The jobs live producer tokens named ``job_id``, by the ids they are kept under
        (rota/core/auth.py kept_ids): a point read per producer token, for a 404."""
        tokens = [t["id"] for t in await self.store.live_tokens() if t["scope"] == "producer"]
        return sorted([kept for kept in kept_ids(job_id, tokens[:MAX_TOKENS_ASKED])
                       if await self.store.get_job(kept) is not None])

    async def list_jobs(self, flt: JobFilter, limit: int, cursor: str | None
                        ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of the jobs ``flt`` matches, newest first, and the next page's cursor.
        RequestError (422) if it names a spec or queue nothing knows."""
        await refuse_unknown(self.store, self.engine, flt)
        jobs, after = await self.store.list_jobs(flt, limit, cursor)
        for view in jobs:
            view["started"] = self.job_started(view["id"], view["state"])
        return jobs, after

    def job_started(self, job_id: str, state: str) -> bool | None:
        """Whether an active job's worker has started it (False: prefetched, waiting in
        its worker's line); None in any other state. A job this server does not hold
        (another server's worker has it) counts as started, as after a restart."""
        if state != "active":
            return None
        job = self.engine.scheduler.jobs.get(job_id)
        return True if job is None or job.state != "active" else job.started

    def line_counts(self, connection: ConnectedWorker) -> tuple[int, int]:
        """(running, prefetched) of a connected worker's held jobs."""
        return line_counts(connection, self.engine.scheduler.jobs)

    def prefetched(self) -> dict[str, int]:
        """Per queue, the active jobs not started yet (waiting in a worker's line)."""
        return self.engine.prefetched()

    async def check_names(self, flt: JobFilter) -> None:
        """RequestError (422) if ``flt`` names a spec or queue nothing knows."""
        await refuse_unknown(self.store, self.engine, flt)

    async def count_jobs(self, flt: JobFilter) -> int:
        return await self.store.count_jobs(flt)

    async def job_logs(self, job_id: str, limit: int = MAX_LOG_LINES) -> list[dict[str, Any]]:
        return await self.store.job_logs(job_id, limit)

    def waiting_reason(self, queue: str, spec: str) -> str | None:
        """Why an available job of this queue and spec is not taken now (None: it will be)."""
        wait = self._endpoint_wait(self.engine.scheduler.wait(queue, spec), queue, spec)
        return None if wait is None else wait.reason

    def _endpoint_wait(self, wait: Wait | None, queue: str, spec: str) -> Wait | None:
        """``wait``, unless it is only a backlog (or none) and the spec's endpoint is
        paused by its circuit breaker: then that is why (a paused queue, or no endpoint
        of the status quo, still says so first)."""
        if wait is not None and wait.blocked:
            return wait
        paused = self.engine.endpoint_wait(queue, spec, self.clock())
        return wait if paused is None else Wait(ENDPOINT_FAILING, paused)

    def job_waiting_reason(self, row: Mapping[str, Any]) -> str | None:
        """Why this available job (its row) is not taken now (None: it will be): its
        queue's and spec's reason, or its own concurrency key's limit or labels."""
        job = SimpleNamespace(queue=row["queue"], spec=row["spec"],
                              concurrency_key=row.get("concurrency_key"),
                              labels=row_labels(row.get("labels")))
        wait = self.engine.scheduler.job_wait(job, self.clock())
        wait = self._endpoint_wait(wait, job.queue, job.spec)
        return None if wait is None else wait.reason

    # -- queues ----------------------------------------------------------------------
    async def queue_counts(self, states: Sequence[str] = JOB_STATES
                           ) -> dict[str, dict[str, int]]:
        """Stored jobs per queue and state, counted (a scan: not on every refresh)."""
        return await self.store.queue_counts(states)

    async def oldest_waits(self) -> dict[str, float | None]:
        """Per queue, how long its longest-waiting available job has waited (seconds)."""
        return await self.store.oldest_available(self.clock().wall)

    def live_jobs(self) -> int:
        """Jobs held in memory: those not finished."""
        return self.engine.scheduler.live()

    def live_counts(self) -> dict[str, dict[str, int]]:
        """Jobs per queue in the states held in memory, counted there (no row read)."""
        return self.engine.scheduler.live_counts()

    def waiting(self) -> list[Waiting]:
        """The available jobs per queue and spec, by queue and spec, with their reason."""
        scheduler = self.engine.scheduler
        now = self.clock().mono  # (a queue's or spec's own limit may hold them)
        held = scheduler.held(now)  # (and a key's limit, or labels, some of them)
        return [Waiting(queue, spec, n, None if wait is None else wait.reason, wait,
                        *((some.kinds, some.missing, some.more) if some else ()))
                for (queue, spec), n in sorted(scheduler.ready_counts().items())
                for wait, some in [(self._endpoint_wait(scheduler.wait(queue, spec, now), queue,
                                                        spec), held.get((queue, spec)))]]

    # -- limits ----------------------------------------------------------------------
    def limit_use(self) -> list[LimitUse]:
        """Every limit in force and its use now: the scope's own, then each key in use
        (rota/core/flow.py limit_use)."""
        return self.engine.limit_use(self.clock())

    def limit_rules(self) -> dict[Scope, LimitRule]:
        """The limits in force (spec files' rules overlaid by runtime ones), by scope."""
        return dict(self.engine.scheduler.limiter.rules)

    def paused_queues(self) -> frozenset[str]:
        return frozenset(self.engine.scheduler.paused)

    def worker_slots(self) -> list[WorkerSlot]:
        """What the scheduler knows of each connected worker (its queues, specs, state)."""
        return list(self.engine.scheduler.workers.values())

    def served_queues(self) -> set[str]:
        """The queues some connected worker serves."""
        return {q for w in self.engine.scheduler.workers.values() for q in w.queues}

    # -- specs and workers -------------------------------------------------------------
    def matching_specs(self, worker: WorkerSlot) -> list[str]:
        """The specs ``worker`` declares with the status quo's checksum, by name."""
        scheduler = self.engine.scheduler
        return sorted(s for s in worker.specs if scheduler.matches(worker, s))

    def spec_workers(self, name: str) -> SpecWorkers:
        scheduler = self.engine.scheduler
        checksum = scheduler.status_quo.get(name, "")
        declared = {w.id: w.specs for w in scheduler.workers.values()}
        return SpecWorkers(checksum, scheduler.matching_workers(name, checksum),
                           [(w, declared[w][name])
                            for w in scheduler.mismatched_workers(name, checksum)])

    def endpoint_views(self) -> list[dict[str, Any]]:
        """Every push endpoint and its circuit breaker (rota/core/endpoints.py), by id."""
        return sorted(self.engine.endpoint_view(self.clock()), key=lambda e: e["id"])

    def retired_specs(self) -> dict[str, float]:
        """Retired specs (they take no new jobs) and when each was retired (wall)."""
        return dict(self.engine.retired)

    async def spec_history(self, name: str) -> list[dict[str, Any]]:
        """The spec's pushes, oldest first ([] if it was never pushed)."""
        return await self.store.spec_history(name)

    # -- tokens, health, events ----------------------------------------------------
    async def live_tokens(self) -> list[dict[str, Any]]:
        return await self.store.live_tokens()

    def shares_database(self) -> bool:
        """Whether other servers share this one's database (PostgreSQL): a directive by
        label reaches their workers too."""
        return self.store.shared

    def storage_degraded(self) -> Degraded | None:
        """Why the store cannot write now, since when; None while it can."""
        return self.store.health.degraded

    @property
    def observer(self) -> Observer:
        """What happened: the events' ring (GET /events) and the counts (GET /metrics)."""
        return self.engine.observe
