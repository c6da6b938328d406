"""The producer clients: synchronous (``Client``), asyncio (``AsyncClient``), and the event
stream's reader.

Its public names can be imported from here as from ``rota`` itself, found on first use.
"""

from rota.base.lazy import exports

_HOMES = {"Client": "client", "Job": "client", "JobHandle": "client",
          "AsyncClient": "producer", "AsyncJob": "producer",
          "Workflow": "flows", "AsyncWorkflow": "flowing",
          "step": "flows", "chain": "flows", "group": "flows", "batch": "flows"}
__all__ = sorted(_HOMES)
__getattr__ = exports(__name__, _HOMES)
