"""Manual mode: take jobs yourself instead of registering handlers.

    async with worker.listen("resize_image") as jobs:
        async for job in jobs:
            try:
                job.complete(await resize(job.args))
            except Exception as exc:
                job.fail(exc)

Each spec named gets a handler that hands its job to the iterator and waits for
``complete()`` or ``fail()``, so a taken job holds a slot until then and every rule of
the run loop applies unchanged: capacity, leases (``job.heartbeat()``), cancels, the
grace period at shutdown, reconnects. Leaving the ``async with`` terminates the worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from rota.worker.context import JobContext


class Runnable(Protocol):
    """What the listener needs of a Worker."""

    def handler(self, spec: str, isolation: str | None = None
                ) -> Callable[[Callable[[JobContext], Any]], Any]: ...

    def run(self) -> Coroutine[Any, Any, None]: ...

    def terminate(self) -> None: ...

    def cancel(self, job_id: str, reason: str = "cancelled") -> None: ...


class Listener:
    def __init__(self, worker: Runnable, specs: tuple[str, ...]) -> None:
        if not specs:
            raise ValueError("name at least one spec to listen for")
        self._worker = worker
        self._jobs: asyncio.Queue[JobContext | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        for spec in specs:
            # (in the worker's process, whatever its isolation: the caller's code takes it)
            worker.handler(spec, isolation="thread")(self._hand_over)

    async def _hand_over(self, ctx: JobContext) -> Any:
        ctx._outcome = asyncio.get_running_loop().create_future()
        if self._closing:  # nobody will take it: back to the server at once
            self._worker.cancel(ctx.id, "shutdown")
        else:
            self._jobs.put_nowait(ctx)
        return await ctx._outcome  # cancelled with the run: the worker reports why

    async def _run(self) -> None:
        try:
            await self._worker.run()
        finally:
            self._jobs.put_nowait(None)  # the iteration ends with the worker

    async def __aenter__(self) -> Listener:
        self._task = asyncio.create_task(self._run(), name="rota-listen")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Terminate the worker: jobs taken and not reported get the grace period; jobs
        handed over but never taken go back at once."""
        self._closing = True
        while not self._jobs.empty():
            job = self._jobs.get_nowait()
            if job is not None:
                self._worker.cancel(job.id, "shutdown")
        self._worker.terminate()
        if self._task is not None:
            await self._task

    def __aiter__(self) -> Listener:
        return self

    async def __anext__(self) -> JobContext:
        while True:
            job = await self._jobs.get()
            if job is None:
                self._jobs.put_nowait(None)  # every later call ends too
                raise StopAsyncIteration
            if not job.cancelled:  # one stopped before it was taken is already reported
                return job
