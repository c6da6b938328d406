"""Rota: a job coordinator. Workers hold one WebSocket; the server pushes them jobs.

Producers enqueue with ``Client`` (synchronous) or ``AsyncClient`` (asyncio); workers run
``Worker``. None of these needs the server's packages (``pip install 'rota[server]'``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rota.client.client import Client, Job, JobHandle
    from rota.worker.context import JobContext
    from rota.base.errors import (ApiError, JobError, JobFailed, ResultTimeout, RotaError,
                                  WorkflowError)
    from rota.client.producer import AsyncClient, AsyncJob
    from rota.client.flows import Workflow, batch, chain, group, step
    from rota.client.flowing import AsyncWorkflow
    from rota.base.specs import JobSpec, checksum
    from rota.base.unique import UniqueOptions
    from rota.worker.worker import Worker

__version__ = "0.1.0"

# Each public name and the module that defines it. They are imported on first use (PEP 562):
# `import rota.core.model` runs this file first, and the server's pure core must not pay for the
# worker's websockets, psutil and asyncio, nor a producer for httpx.
_HOMES = {
    "Client": "client.client", "Job": "client.client", "JobHandle": "client.client",
    "JobContext": "worker.context",
    "ApiError": "base.errors", "JobError": "base.errors", "JobFailed": "base.errors",
    "ResultTimeout": "base.errors", "RotaError": "base.errors", "WorkflowError": "base.errors",
    "AsyncClient": "client.producer", "AsyncJob": "client.producer",
    "Workflow": "client.flows", "AsyncWorkflow": "client.flowing",
    "step": "client.flows", "chain": "client.flows", "group": "client.flows",
    "batch": "client.flows",
    "JobSpec": "base.specs", "checksum": "base.specs", "UniqueOptions": "base.unique",
    "Worker": "worker.worker",
}
__all__ = sorted([*_HOMES, "__version__"])


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rota' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"rota.{home}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, "__version__"})
