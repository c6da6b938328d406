"""What an operator steers, as the shell carries it out: cancel, retry, bulk actions,
retiring a spec, pushing specs, pausing a queue, and (through its Limiting) the
flow-control limits.

The rules are rota/core/verdicts.py's and the engine's; this reads the rows they judge, asks,
and applies what they return (a write is committed before its answer or frames leave:
``run``). The Coordinator owns one and hands it the store, the engine, the clock and its
two ways of applying effects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from rota.core import verdicts as v
from rota.core.effects import Effect
from rota.core.engine import Engine
from rota.base.errors import Conflict, Invalid, NotFound, StorageError
from rota.core.listing import JobFilter
from rota.core.secrets import private_endpoints, unknown_secrets
from rota.core.model import Instant, JobRecord
from rota.base.specs import JobSpec, checksum
from rota.store.store import Store, job_from_row
from rota.server.limiting import Limiting
from rota.server.secretbook import SecretBook
from rota.server.shell_reads import new_queue_problems, refuse_unknown

BULK_CHUNK = 200  # jobs a bulk action handles at once: their writes share commits
Run = Callable[[Iterable[Effect]], Coroutine[Any, Any, dict[str, JobRecord | None]]]


class Steering:
    def __init__(self, store: Store, engine: Engine, clock: Callable[[], Instant],
                 run: Run, apply: Callable[[Iterable[Effect]], None], *,
                 secrets: SecretBook) -> None:
        self.store = store
        self.secrets = secrets  # the signing secrets set (env or database), which a push needs
        self.engine = engine
        self.clock = clock
        self.run = run  # effects, waiting for each write to commit
        self.apply = apply  # effects, waiting for none
        # Flow control's limits in force, which a push changes too (rota/server/limiting.py).
        self.limiting = Limiting(store, engine, clock, apply)
        # Retries whose row is being written: retention skips them (Store.prune).
        self.retrying: set[str] = set()

    async def row(self, job_id: str) -> dict[str, Any]:
        row = await self.store.get_job(job_id)
        assert row is not None
        return row

    # -- cancel -------------------------------------------------------------------------
    async def cancel(self, job_id: str) -> tuple[dict[str, Any], bool]:
        """Cancel a job: at once if it waits, through its worker if it runs.
        Returns the stored job and whether it is cancelled already."""
        for look in range(2):
            job = self.engine.scheduler.jobs.get(job_id)
            was = (job.state, job.cancel_requested) if job is not None else None
            outcome, effects = self.engine.cancel(job_id, self.clock())
            if outcome != "not_live":
                break
            row = await self.store.get_job(job_id)
            verdict = v.cancel_unheld(job_id, row, shared=self.store.shared,
                                      last_look=look == 1)
            if verdict.step == "ask_owner":
                if await self.store.request_cancel(job_id) is not None:
                    return await self.row(job_id), False  # that server passes it on
                verdict = v.cancel_unheld(job_id, row, shared=True, last_look=look == 1,
                                          owner_declined=True)
            if verdict.step == "cancel_waiting":
                assert row is not None
                outcome, effects = self.engine.cancel_waiting(row, self.clock())
                break
            if verdict.error is not None:
                raise verdict.error
            await self.store.barrier()  # "look_again"
        try:
            refused = await self.run(effects)
        except StorageError:
            if job is not None and was is not None:
                self.apply(self.engine.cancel_not_stored(job, was))
            raise
        row = await self.row(job_id)
        if job_id in refused:  # the row moved on behind this server's copy
            return await self._cancel_moved_on(job_id, row)
        verdict = v.cancel_written(row, outcome)
        if verdict.step == "cancel_again":
            outcome, effects = self.engine.cancel(job_id, self.clock())
            if (refusal := v.cancel_again(job_id, row, outcome)) is not None:
                raise refusal
            await self.run(effects)
            row = await self.row(job_id)
            verdict = v.cancel_written(row, outcome, again=True)
        return row, verdict.done

    async def _cancel_moved_on(self, job_id: str, row: dict[str, Any]
                               ) -> tuple[dict[str, Any], bool]:
        verdict = v.cancel_moved_on(job_id, row, shared=self.store.shared)
        if verdict.step == "ask_owner":
            if await self.store.request_cancel(job_id) is not None:
                return await self.row(job_id), False
            verdict = v.cancel_moved_on(job_id, row, shared=True, owner_declined=True)
        if verdict.error is not None:
            raise verdict.error
        return row, verdict.done

    # -- retry --------------------------------------------------------------------------
    async def retry(self, job_id: str) -> dict[str, Any]:
        """Put a discarded or cancelled job back, with a fresh attempt budget."""
        if job_id in self.retrying:
            raise v.retry_busy(job_id)
        # Marked before it is read, and read in the writer's order, so that retention
        # cannot delete the row between this read and the write that puts it back: a
        # prune queued after the read skips ids marked here (Store.prune).
        self.retrying.add(job_id)
        try:
            row = await self.store.get_job_in_order(job_id)
            if (refusal := v.may_retry(job_id, row, live=self.engine.is_live(job_id))):
                raise refusal
            assert row is not None
            job = job_from_row(row)
            if await self.run(self.engine.retry(job)):
                raise v.retry_moved_on(job_id)
            self.apply(self.engine.retried(job, self.clock()))
        finally:
            self.retrying.discard(job_id)
        return await self.row(job_id)

    # -- bulk actions -----------------------------------------------------------------
    async def bulk(self, action: str, ids: list[str] | None = None,
                   flt: JobFilter | None = None, dry_run: bool = False,
                   limit: int = 1000) -> dict[str, Any]:
        """Retry or cancel the jobs named by ``ids`` or matching ``flt``, at most ``limit``
        of them (newest first), each as its single-job route would. A dry run says what
        would be touched and changes nothing."""
        refusal = v.bulk_refusal(action, ids=ids is not None, flt=flt is not None, limit=limit)
        if refusal is not None:
            raise refusal
        if ids is not None:
            chosen, truncated, matched = v.bulk_ids(ids, limit)
            states = await self.store.job_states(chosen)
            found = [(job_id, states.get(job_id)) for job_id in chosen]
        else:
            assert flt is not None
            await refuse_unknown(self.store, self.engine, flt)
            rows, stopped = await self.store.match_jobs(flt, limit)
            found = rows[:limit]
            matched = len(found)
            truncated = stopped or len(rows) > limit
            if len(rows) > limit:  # more than the cap: counted (up to lookup.COUNT_CAP)
                matched = max(await self.store.count_jobs(flt), limit + 1)
        eligible, skipped = v.bulk_sort(action, found)
        touched = eligible
        if not dry_run:
            touched = []
            for start in range(0, len(eligible), BULK_CHUNK):
                chunk = eligible[start:start + BULK_CHUNK]
                outcomes = await asyncio.gather(*(self._bulk_one(action, job_id)
                                                  for job_id in chunk))
                for job_id, refused in zip(chunk, outcomes, strict=True):
                    if refused is None:
                        touched.append(job_id)
                    else:  # it changed since it was read
                        skipped.append({"id": job_id, "reason": refused})
        return v.bulk_answer(action, dry_run=dry_run, matched=matched, touched=touched,
                             skipped=skipped, truncated=truncated)

    async def _bulk_one(self, action: str, job_id: str) -> str | None:
        """One job of a bulk action: None if done, else why not."""
        try:
            if action == "retry":
                await self.retry(job_id)
            else:
                await self.cancel(job_id)
        except (NotFound, Conflict) as exc:
            return exc.message
        return None

    # -- specs and queues ---------------------------------------------------------------
    async def retire_spec(self, name: str, *, cancel_waiting: bool) -> dict[str, Any]:
        """Refuse new jobs of spec ``name`` from now on; say what becomes of its jobs.
        Those waiting still run on workers that match its status quo, unless
        ``cancel_waiting``: then each is cancelled as ``DELETE /jobs/{id}`` would."""
        retired = await self.store.retire_spec(name, self.clock().wall)
        if retired is None:
            raise v.no_status_quo(name)
        checksum_, at, _ = retired
        matching = self.engine.retire(name, checksum_, at)
        counts, waiting = await self.store.spec_jobs(name)
        cancelled = 0
        if cancel_waiting:
            for job_id in waiting:
                try:
                    _, done = await self.cancel(job_id)
                except (NotFound, Conflict):  # it finished or started meanwhile
                    continue
                cancelled += done
            counts, _ = await self.store.spec_jobs(name)
        return v.retire_answer(name, retired, jobs=counts, cancelled=cancelled,
                               matching=matching)

    async def push_specs(self, specs: list[JobSpec], *, dry_run: bool) -> list[dict[str, Any]]:
        if (refusal := v.duplicate_specs([s.name for s in specs])) is not None:
            raise refusal
        if (refusal := private_endpoints(specs, self.engine.settings.allow_private_endpoints)) is not None:
            raise refusal
        if unknown_secrets(specs, self.secrets.known) is not None:
            await self.secrets.reload()  # (another server may have set it a moment ago)
            if (refusal := unknown_secrets(specs, self.secrets.known)) is not None:
                raise refusal  # (a dry run too: the push it tries would be refused)
        changes = await self.store.push_specs([(s, checksum(s)) for s in specs], dry_run=dry_run)
        if not dry_run:
            self.apply(self.engine.status_quo_changed(specs, changes, self.clock()))
            self.limiting.refresh()
        return [self.engine.change_report(c) for c in changes]

    async def pause_queue(self, name: str, paused: bool) -> dict[str, Any]:
        """Pause or resume a queue: stored first, so a restart keeps it; then no round
        assigns its jobs (or, resumed, the next round does)."""
        problems = await new_queue_problems(self.store, self.engine, [name], resuming=not paused)
        if name in problems:  # a slip: the queue meant would go on (issue 22)
            raise Invalid("unknown_queue", problems[name])
        now = self.clock()
        await self.store.set_paused(name, paused, now.wall)
        self.apply(self.engine.pause_queue(name, paused, now))
        return {"queue": name, "paused": paused}
