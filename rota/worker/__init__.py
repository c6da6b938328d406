"""The worker SDK (``Worker``): a sans-I/O protocol core (link), the connection thread, and
the handlers' execution (``JobContext``).

Its public names can be imported from here as from ``rota`` itself, found on first use.
"""

from rota.base.lazy import exports

_HOMES = {"Worker": "worker", "JobContext": "context"}
__all__ = sorted(_HOMES)
__getattr__ = exports(__name__, _HOMES)
