"""Names a package exports without importing them: each is imported on first use (PEP 562),
so that importing one module of a package loads no other."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that finds each name of ``homes`` (name:
    the module of the package that defines it) when it is first asked for."""
    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{home}"), name)

    return __getattr__
