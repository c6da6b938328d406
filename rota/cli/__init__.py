"""The command line: `rota serve`, `rota worker`, `rota specs`, the operator's commands,
one module per command group (app.py gathers them).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # `rota.cli:main` is the console script's entry point (pyproject.toml); imported on
    # first use, so that a module of this package loads only what it needs
    if name == "main":
        from rota.cli.app import main

        return main
    raise AttributeError(f"module 'rota.cli' has no attribute {name!r}")
