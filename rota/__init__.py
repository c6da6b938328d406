"""Rota: a job coordinator. Workers hold one WebSocket; the server pushes them jobs.

Producers enqueue with ``Client`` (synchronous) or ``AsyncClient`` (asyncio); workers run
``Worker``. None of these needs the server's packages (``pip install 'rota[server]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rota.client import ApiError, Client, Job, JobError, JobHandle, ResultTimeout
from rota.context import JobContext, JobFailed
from rota.specs import JobSpec, checksum
from rota.worker import Worker

if TYPE_CHECKING:
    from rota.producer import AsyncClient, AsyncJob

__version__ = "0.1.0"
__all__ = ["ApiError", "AsyncClient", "AsyncJob", "Client", "Job", "JobContext", "JobError",
           "JobFailed", "JobHandle", "JobSpec", "ResultTimeout", "Worker", "__version__",
           "checksum"]


def __getattr__(name: str) -> Any:
    # The asyncio client is imported on first use: it brings httpx, 80 ms of imports that
    # every `rota` command and every worker process would otherwise pay for nothing.
    if name in ("AsyncClient", "AsyncJob"):
        from rota import producer

        return getattr(producer, name)
    raise AttributeError(f"module 'rota' has no attribute {name!r}")
