"""Prefetch lines: which held jobs a worker has started, taking unstarted ones back for an
idle worker, and which of a dead worker's jobs count its death. Pure.

A part of the engine (``Engine`` inherits it). A worker that registers ``reports_starts``
names the jobs it starts (``status.started``); a job it holds and has not named waits in
its line. When a running worker is idle (a free slot, and no ready job it may run: the
round just gave it all it could) and another holds jobs waiting behind full slots that
the idle one may run, the holder is sent ``take_back``; the jobs it names in
``status.given_back`` go back as ``released`` (no attempt used), and the next round
gives them out. A worker that does not report starts is never asked: every job it holds
counts as started, as before (docs/protocol.md §3.5, §4.6).

Start reports live in memory only: jobs loaded at a restart count as started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from rota.base import protocol as p
from rota.core.attempts import held_by
from rota.core.effects import Effect, Send
from rota.core.model import Instant, JobRecord, JobState
from rota.core.registry import ConnectedWorker, Registry
from rota.core.scheduler import Scheduler, WorkerSlot

log = logging.getLogger("rota.server")


def idle_slots(worker: WorkerSlot) -> int:
    """Slots a running worker has free to run a job at once (not to line one up): its
    held jobs all fit in its ``concurrency``, and it asked for more."""
    if worker.state != "running" or worker.blocked or worker.any_type:  # (a pull: no line)
        return 0
    return max(0, min(worker.free(), worker.concurrency - len(worker.active) - worker.claims))


def may_run(worker: WorkerSlot, job: JobRecord, scheduler: Scheduler) -> bool:
    """Whether a round could give ``job`` to ``worker``: its queue, an unpaused one, and
    its spec declared with the status-quo checksum (and the labels the job needs)."""
    labels = getattr(job, "labels", ())  # (jobs that require worker labels: issue 23)
    return (job.queue in worker.queues and job.queue not in scheduler.paused
            and scheduler.matches(worker, job.spec)
            and all(label in worker.labels for label in labels))


def choose_take_backs(idle: list[tuple[WorkerSlot, int]],
                      waiting: list[tuple[str, list[JobRecord]]],
                      runs: Callable[[WorkerSlot, JobRecord], bool], budget: int
                      ) -> dict[str, list[str]]:
    """Which waiting jobs to ask back, by holder: for each idle worker (with its free
    slots), jobs it may run from the holders' lines (each line newest first: the job
    that would wait longest), one per slot, ``budget`` in all."""
    picks: dict[str, list[str]] = {}
    chosen: set[str] = set()
    for worker, slots in idle:
        for holder, jobs in waiting:
            for job in jobs:
                if slots <= 0 or budget <= 0:
                    break
                if job.id in chosen or holder == worker.id or not runs(worker, job):
                    continue
                picks.setdefault(holder, []).append(job.id)
                chosen.add(job.id)
                slots -= 1
                budget -= 1
    return picks


def split_started(held: list[JobRecord], concurrency: int, line: Iterable[str] = ()
                  ) -> tuple[list[JobRecord], list[JobRecord]]:
    """(started, unstarted) of the jobs a worker held when it died. A job may have
    started since the worker's last status: while fewer than ``concurrency`` of its jobs
    had started, its oldest waiting ones (``line``: the assign order), one per free
    slot, count as started, so that a job that kills its worker the moment it starts is
    still counted as the death it is. Those are marked started."""
    started = [job for job in held if job.started]
    waiting = [job for job in held if not job.started]
    free = concurrency - len(started)
    if free > 0 and waiting:
        rank = {job_id: i for i, job_id in enumerate(line)}
        waiting.sort(key=lambda j: (rank.get(j.id, len(rank)), j.reserved_at or 0.0, j.seq))
        for job in waiting[:free]:
            job.started = True
        started += waiting[:free]
        waiting = waiting[free:]
    return started, waiting


def line_counts(connection: ConnectedWorker, jobs: dict[str, JobRecord]) -> tuple[int, int]:
    """(running, prefetched) of a connected worker's held jobs: as it reported them, or,
    for a worker that does not report starts, min(held, concurrency) and the rest."""
    slot = connection.worker
    if not connection.registration.reports_starts:
        return slot.running(), len(slot.active) - slot.running()
    started = sum(1 for job_id in slot.active
                  if (job := jobs.get(job_id)) is not None and job.started)
    return started, len(slot.active) - started


class Lines:
    scheduler: Scheduler
    registry: Registry
    _recover: Callable[..., list[Effect]]  # (jobs, ending, message, now, *, death)
    # holder id -> the ids of its jobs not reported started, in the order assigned
    # (pruned as they are looked at: a job that left is dropped then)
    _lines: dict[str, dict[str, None]]
    _taking: dict[str, str]  # job id -> holder id: a take_back sent and not answered

    def _assigned(self, connection: ConnectedWorker, jobs: list[JobRecord]) -> None:
        """Jobs sent to this worker: in its line until it says it started them."""
        if not connection.registration.reports_starts:
            for job in jobs:
                job.started = True  # it never says: counted as started, as ever
            return
        worker = connection.worker
        line = self._lines.setdefault(worker.id, {})
        for job in jobs:
            job.started = False
            line[job.id] = None
        if len(line) > 2 * (worker.concurrency + worker.prefetch) + 16:
            self._prune(worker.id, line)  # jobs that left unstarted (released, cancelled)

    def _starts(self, connection: ConnectedWorker, status: p.Status) -> None:
        """The jobs a worker says it started (or runs): out of its line."""
        if not connection.registration.reports_starts:
            return
        line = self._lines.get(connection.worker.id)
        # Of the jobs it runs, only those still in its line can be news (a start report
        # lost on a cut connection): a check per held job, not a lookup, on every beat.
        running = [job_id for job_id in status.active_job_ids if job_id in line] if line else []
        for job_id in (*status.started, *running):
            job = held_by(self.scheduler.jobs, connection, job_id)
            if job is None or job.started:
                continue
            job.started = True
            self._taking.pop(job_id, None)
            if line is not None:
                line.pop(job_id, None)

    def _given_back(self, connection: ConnectedWorker, job_ids: list[str], now: Instant
                    ) -> list[Effect]:
        """Jobs a worker removed from its line unstarted: available again, no attempt
        used. It gets no new job until its next heartbeat says what it wants (its line
        was longer than the fleet needs): the round they go out in gives them to the
        idle worker, not straight back to its line."""
        worker = connection.worker
        line = self._lines.get(worker.id, {})
        back: list[JobRecord] = []
        for job_id in dict.fromkeys(job_ids):
            self._taking.pop(job_id, None)
            job = held_by(self.scheduler.jobs, connection, job_id)
            if job is None:
                continue
            if job.started:  # it said it started it: it runs there, whatever it says now
                log.warning("given back refused job=%s worker=%s: it reported the job"
                            " started", job_id, worker.id)
                continue
            line.pop(job_id, None)
            back.append(job)
        if not back:
            return []
        worker.capacity = 0
        log.info("taken back jobs=%s worker=%s: given back unstarted, for an idle worker",
                 ",".join(job.id for job in back), worker.id)
        return self._recover(back, "released", f"taken back unstarted from worker"
                             f" {worker.id}'s line for an idle worker: not counted against"
                             " max_attempts", now, death=False)

    def _take_backs(self, now: Instant) -> list[Effect]:
        """After a round: ask lines to give back what idle workers could run now."""
        if not self._lines:
            return []
        idle = [(w, n) for w in self.scheduler.workers.values() if (n := idle_slots(w)) > 0]
        if not idle:
            return []
        self._prune_taking()
        budget = sum(n for _, n in idle) - len(self._taking)  # answers awaited fill slots
        if budget <= 0:
            return []
        picks = choose_take_backs(idle, self._waiting(),
                                  lambda w, j: may_run(w, j, self.scheduler), budget)
        effects: list[Effect] = []
        for holder, job_ids in picks.items():
            connection = self.registry.get(holder)
            if connection is None:
                continue
            for job_id in job_ids:
                self._taking[job_id] = holder
            log.info("take back jobs=%s worker=%s: unstarted in its line, and a worker is"
                     " idle", ",".join(job_ids), holder)
            effects.append(Send(connection.conn, p.encode(p.TakeBack(job_ids=job_ids))))
        return effects

    def _waiting(self) -> list[tuple[str, list[JobRecord]]]:
        """Each line's jobs that surely wait (newest first): not started, and beyond the
        holder's ``concurrency`` (a job just sent to a free slot is being started)."""
        lines: list[tuple[str, list[JobRecord]]] = []
        for holder_id in list(self._lines):
            holder = self.scheduler.workers.get(holder_id)
            if holder is None:
                del self._lines[holder_id]
                continue
            beyond = len(holder.active) - holder.concurrency
            if beyond <= 0:  # (checked first: a round costs no walk of a line that runs)
                continue
            line = self._prune(holder_id, self._lines[holder_id])
            newest = list(reversed(line))[:beyond]
            lines.append((holder_id, [self.scheduler.jobs[job_id] for job_id in newest
                                      if job_id not in self._taking]))
        return lines

    def _prune(self, holder_id: str, line: dict[str, None]) -> dict[str, None]:
        """Drop from a line the jobs no longer waiting in it (started, ended, gone)."""
        for job_id in list(line):
            job = self.scheduler.jobs.get(job_id)
            if (job is None or job.started or job.state != JobState.ACTIVE
                    or job.worker_id != holder_id or job.orphaned):
                del line[job_id]
        if not line:
            self._lines.pop(holder_id, None)
        return line

    def prefetched(self) -> dict[str, int]:
        """Per queue, the active jobs waiting unstarted in their workers' lines (those of
        workers that report starts: every other held job counts as running)."""
        counts: dict[str, int] = {}
        for holder_id, line in self._lines.items():
            for job_id in line:
                job = self.scheduler.jobs.get(job_id)
                if (job is not None and not job.started and job.state == JobState.ACTIVE
                        and job.worker_id == holder_id):
                    counts[job.queue] = counts.get(job.queue, 0) + 1
        return counts

    def _prune_taking(self) -> None:
        """Forget asks whose job left its holder (ended, recovered, or started)."""
        for job_id, holder in list(self._taking.items()):
            job = self.scheduler.jobs.get(job_id)
            if (job is None or job.started or job.state != JobState.ACTIVE
                    or job.worker_id != holder):
                del self._taking[job_id]

    def _at_death(self, worker: WorkerSlot | None, worker_id: str, held: list[JobRecord]
                  ) -> tuple[list[JobRecord], list[JobRecord]]:
        """A worker left: its line is forgotten, and its jobs split into those that
        (may have) started and those that surely had not (``split_started``)."""
        line = self._lines.pop(worker_id, {})
        for job in held:
            self._taking.pop(job.id, None)
        concurrency = worker.concurrency if worker is not None else len(held)
        return split_started(held, concurrency, line)
