"""The worker SDK (``Worker``): a sans-I/O protocol core (link), the connection thread, and
the handlers' execution (``JobContext``).
"""

from __future__ import annotations

import importlib
from typing import Any

# The names a user may import from here as from ``rota`` itself, found on first use, so
# that importing one module of this package loads no other.
_HOMES = {
    "Worker": "worker",
    "JobContext": "context",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'rota.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rota.worker.{home}"), name)
