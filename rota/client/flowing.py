"""``AsyncClient``'s workflow calls and the handle they return, as rota/client/flows.py has
them for ``Client``: the same definitions, the same routes, awaited."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from rota.base.ids import path_segment
from rota.client.flows import (POLL_FIRST, POLL_MAX, Definition, Step, StepLike,
                               WorkflowHandle, batch, body, chain, group, list_params,
                               result_of, unfinished)


class AsyncWorkflow(WorkflowHandle):
    """A workflow created or read with ``AsyncClient``: ``await wait()``, ``await
    result()``, ``await refresh()``, ``await cancel()``, ``await retry()``, as
    ``Workflow``'s."""

    __slots__ = ("_client",)

    def __init__(self, client: AsyncWorkflows, view: dict[str, Any],
                 created: bool = True) -> None:
        super().__init__(view, created)
        self._client = client

    async def refresh(self) -> AsyncWorkflow:
        self.view = (await self._client.workflow(self.id)).view
        return self

    async def wait(self, timeout: float | None = None) -> AsyncWorkflow:
        """As ``Workflow.wait``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = POLL_FIRST
        while not (await self.refresh()).done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise unfinished(self.view, timeout)
            await asyncio.sleep(pause if left is None else min(pause, left))
            pause = min(POLL_MAX, pause * 2)
        return self

    async def result(self, timeout: float | None = None) -> Any:
        """As ``Workflow.result``."""
        await self.wait(timeout)
        if self.state != "completed":
            raise self.failure()
        ids = self.job_ids
        replies = await asyncio.gather(*(self._client.result(job_id) for job_id in ids))
        return result_of(self.view["root"], {i: r["result"] for i, r in zip(ids, replies)})

    async def cancel(self) -> AsyncWorkflow:
        self.view = (await self._client.cancel_workflow(self.id)).view
        return self

    async def retry(self) -> AsyncWorkflow:
        self.view = (await self._client.retry_workflow(self.id)).view
        return self


class AsyncWorkflows:
    """``AsyncClient``'s workflow calls (a mixin: ``AsyncClient`` has ``_call`` and
    ``result``). Each is one request of its own, never coalesced with enqueues."""

    __slots__ = ()
    _call: Callable[..., Any]
    result: Callable[..., Any]

    async def _json(self, method: str, path: str, sent: Any = None,
                    params: dict[str, Any] | None = None) -> Any:
        content = None if sent is None else msgspec.json.encode(sent)
        return await self._call(method, path, content=content, params=params)

    async def create_workflow(self, definition: Definition | Mapping[str, Any]
                              ) -> AsyncWorkflow:
        """As ``Client.create_workflow``."""
        answer = await self._json("POST", "/workflows", body(definition))
        return AsyncWorkflow(self, answer["workflow"], answer["created"])

    async def chain(self, *steps: StepLike, name: str | None = None, id: str | None = None
                    ) -> AsyncWorkflow:
        return await self.create_workflow(chain(*steps, name=name, id=id))

    async def group(self, *jobs: StepLike, name: str | None = None, id: str | None = None
                    ) -> AsyncWorkflow:
        return await self.create_workflow(group(*jobs, name=name, id=id))

    async def batch(self, *jobs: StepLike, on_success: Step | Mapping[str, Any] | None = None,
                    on_failure: Step | Mapping[str, Any] | None = None,
                    on_complete: Step | Mapping[str, Any] | None = None,
                    name: str | None = None, id: str | None = None) -> AsyncWorkflow:
        return await self.create_workflow(batch(
            *jobs, on_success=on_success, on_failure=on_failure, on_complete=on_complete,
            name=name, id=id))

    async def workflow(self, workflow_id: str) -> AsyncWorkflow:
        view = await self._json("GET", f"/workflows/{path_segment(workflow_id)}")
        return AsyncWorkflow(self, view, False)

    async def workflows(self, *, state: str | None = None, name: str | None = None,
                        limit: int = 50, after: str | None = None) -> dict[str, Any]:
        """As ``Client.workflows``."""
        params = list_params(state, name, limit, after)
        return await self._json("GET", "/workflows", params=params)  # type: ignore[no-any-return]

    async def cancel_workflow(self, workflow_id: str) -> AsyncWorkflow:
        answer = await self._json("DELETE", f"/workflows/{path_segment(workflow_id)}")
        return AsyncWorkflow(self, answer, False)

    async def retry_workflow(self, workflow_id: str) -> AsyncWorkflow:
        answer = await self._json("POST", f"/workflows/{path_segment(workflow_id)}/retry")
        return AsyncWorkflow(self, answer, False)
