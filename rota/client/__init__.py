"""The producer clients: synchronous (``Client``), asyncio (``AsyncClient``), and the event
stream's reader.
"""

from __future__ import annotations

import importlib
from typing import Any

# The names a user may import from here as from ``rota`` itself, found on first use, so
# that importing one module of this package loads no other.
_HOMES = {
    "Client": "client",
    "Job": "client",
    "JobHandle": "client",
    "AsyncClient": "producer",
    "AsyncJob": "producer",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rota.client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rota.client.{home}"), name)
