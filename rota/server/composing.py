"""Workflows as the shell carries them out: a definition checked and stored whole, its
views, its cancel and retry.

The definition, its nodes and its first moves are rota/core/workflow_defs.py's and
rota/core/workflows.py's; each step's job is built as an enqueue's would be (the engine's
``build``: spec, args, queue, status quo), so a workflow's jobs are ordinary jobs. The
store writes them all in one transaction, and the jobs released go to the engine at its
commit (``Store.on_released``). The Coordinator owns one and hands it the store, the
engine, its clock and its way of cancelling a job.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rota.base.errors import Conflict, DomainError, Invalid, NotFound
from rota.base.ids import uuid7
from rota.base.ojs import OJS_ARGS
from rota.core import workflow_defs as defs
from rota.core import workflows as wf
from rota.core.auth import Principal
from rota.core.effects import Effect
from rota.core.engine import Engine
from rota.core.jobs import EnqueueRequest
from rota.core.model import Instant, JobRecord, JobState
from rota.core.settings import ServerSettings
from rota.core.workflow_view import summary, view
from rota.server.shell_reads import new_queue_problems
from rota.store.store import Store

log = logging.getLogger("rota.server")


def not_found(workflow_id: str) -> NotFound:
    return NotFound("not_found", f"no workflow {workflow_id}")


class Composing:
    def __init__(self, settings: ServerSettings, store: Store, engine: Engine,
                 clock: Callable[[], Instant],
                 cancel_job: Callable[[str], Awaitable[Any]],
                 reread: Callable[[Instant], Awaitable[bool]],
                 apply: Callable[[list[Effect]], None],
                 waiting_reason: Callable[[dict[str, Any]], str | None]) -> None:
        self.settings = settings
        self.store = store
        self.engine = engine
        self.clock = clock
        self.cancel_job = cancel_job  # the ordinary cancel (Steering.cancel)
        # Whether the status quo was read again since then (Admission's, for an enqueue
        # naming a spec pushed through another server a moment ago).
        self.reread = reread
        self.apply = apply  # the coordinator's: effects carried out in order
        self.waiting_reason = waiting_reason  # why an available job (its row) waits

    async def create(self, data: Any, principal: Principal, *, ojs: bool = False
                     ) -> tuple[dict[str, Any], bool]:
        """POST /workflows: the workflow's view and whether it is new. Bad input raises
        (a DomainError naming the step); nothing is stored then. ``ojs``: from
        /ojs/v1/workflows, whose steps alone may carry OJS's parts."""
        now = self.clock()
        try:
            return await self._create(data, principal, now, ojs)
        except DomainError as exc:
            if exc.code != "unknown_spec" or not await self.reread(now):
                raise
        return await self._create(data, principal, self.clock(), ojs)

    async def _create(self, data: Any, principal: Principal, now: Instant, ojs: bool
                      ) -> tuple[dict[str, Any], bool]:
        jobs: list[JobRecord] = []
        paths: list[str] = []
        queues: dict[str, str] = {}  # a queue a step names (not as new) -> its first step

        def check(path: str, request: EnqueueRequest) -> DomainError | None:
            if not ojs and (request.ojs is not None or OJS_ARGS in request.args):
                return Invalid("invalid_request", "ojs and the args key"
                               f" {OJS_ARGS!r} are set by /ojs/v1/workflows only")
            built = self.engine.build(request, principal, now)
            if isinstance(built, DomainError):
                return built
            jobs.append(built)
            paths.append(path)
            if request.queue is not None and not request.new_queue:
                queues.setdefault(request.queue, path)
            return None

        definition = defs.definition(data, check)
        # A queue that is a slip for a known one would hold its step for ever, as an
        # enqueue's would (rota/server/admission.py): refused the same way.
        problems = await new_queue_problems(self.store, self.engine, queues)
        if problems:
            queue, problem = next(iter(sorted(problems.items())))
            raise Invalid("unknown_queue", f"{queues[queue]}: {problem}; to make it anyway,"
                          " give \"new_queue\": true")
        nodes = defs.plan(definition)
        workflow_id = definition.id or uuid7()
        steps = [node for node in nodes if node.kind == "job"]
        for node, job in zip(steps, jobs, strict=True):
            job.state, job.workflow_id, job.workflow_node = JobState.PENDING, workflow_id, node.node
        rows = wf.new_rows(nodes, {node.node: job.id for node, job in zip(steps, jobs)})
        limit = self.settings.max_parent_results_bytes
        decision = wf.start(wf.Head(workflow_id), rows, limit=limit, now=now.wall)
        row = {"id": workflow_id, "type": nodes[0].kind, "name": definition.name,
               "state": decision.head.state, "digest": defs.digest(definition),
               "created_at": now.wall, "started_at": now.wall, "finished_at": None,
               "job_count": len(jobs), "completed_count": 0, "failed_count": 0,
               "steps_total": sum(1 for node in nodes if node.parent == 0),
               "error": None, "created_by": principal.token_id, "max_parent_results": limit}
        released = len(decision.release)  # (the store takes them from the decision)
        stored, created = await self.store.create_workflow(row, rows, jobs, paths, decision)
        if created:
            log.info("workflow create id=%s type=%s name=%s jobs=%d released=%d", workflow_id,
                     row["type"], row["name"], len(jobs), released)
        return await self.view(stored["id"], principal), created

    async def _owned(self, workflow_id: str, principal: Principal) -> None:
        """A producer's workflows are its own: another token's is not found, as a job."""
        await self.view(workflow_id, principal)

    async def view(self, workflow_id: str, principal: Principal) -> dict[str, Any]:
        """GET /workflows/{id}: the workflow with its tree."""
        found = await self.store.workflow(workflow_id)
        if found is None or (principal.scope != "admin"
                             and found[0]["created_by"] != principal.token_id):
            raise not_found(workflow_id)
        row, nodes, states, waiting = found
        reasons: dict[str, str] = {}
        asked: dict[tuple[Any, ...], str | None] = {}  # one question per kind of job
        for job in waiting:
            kind = (job["queue"], job["spec"], job["concurrency_key"], job["labels"])
            if kind not in asked:
                asked[kind] = self.waiting_reason(job)
            if (reason := asked[kind]) is not None:
                reasons[job["id"]] = reason
        return view(row, nodes, states, reasons)

    async def page(self, principal: Principal, *, state: str | None, name: str | None,
                   limit: int, after: str | None) -> dict[str, Any]:
        """GET /workflows: a page, newest first (a producer's own only)."""
        mine = None if principal.scope == "admin" else principal.token_id
        rows, cursor = await self.store.workflows(state=state, name=name, created_by=mine,
                                                  limit=limit, after=after)
        return {"workflows": [summary(row) for row in rows], "next": cursor}

    async def cancel(self, workflow_id: str, principal: Principal) -> dict[str, Any]:
        """DELETE /workflows/{id}: the workflow cancelled first (its later endings then
        advance nothing), held jobs with it; then its released jobs the ordinary way."""
        await self._owned(workflow_id, principal)
        found = await self.store.cancel_workflow(workflow_id, self.clock().wall)
        if found is None:
            raise not_found(workflow_id)
        _, waiting, live = found  # (the waiting ones are cancelled already, with it)
        self.apply(self.engine.replaced(waiting, workflow_id, self.clock(),
                                        reason=f"its workflow {workflow_id} was cancelled"))
        for job_id in live:
            try:
                await self.cancel_job(job_id)
            except (NotFound, Conflict):  # it ended meanwhile: nothing to cancel
                continue
        log.info("workflow cancel id=%s waiting=%d running=%d", workflow_id, len(waiting),
                 len(live))
        return await self.view(workflow_id, principal)

    async def retry(self, workflow_id: str, principal: Principal) -> dict[str, Any]:
        """POST /workflows/{id}/retry: a failed workflow from where it failed."""
        if await self.store.retry_workflow(workflow_id, self.clock().wall) is None:
            raise not_found(workflow_id)
        log.info("workflow retry id=%s", workflow_id)
        return await self.view(workflow_id, principal)
