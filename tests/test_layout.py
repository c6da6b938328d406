"""Imports point one way: protocol at the bottom, cli on top, the worker SDK beside the server."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rota"

# module -> the rota modules it may import
ALLOWED: dict[str, set[str]] = {
    "protocol": {"errors"},
    "ids": set(),
    "specs": {"protocol"},
    "settings": set(),
    "db": set(),
    "logs": set(),
    "errors": set(),
    "policy": set(),
    "auth": set(),
    "store": {"db", "policy", "protocol", "specs"},
    "jobs": {"errors", "ids", "policy", "protocol", "specs", "store"},
    "scheduler": {"store"},
    "coordinator": {"auth", "errors", "jobs", "policy", "protocol", "scheduler", "settings",
                    "specs", "store"},
    "gate": {"auth", "coordinator"},
    "sessions": {"auth", "coordinator", "gate", "policy", "protocol"},
    "api": {"auth", "coordinator", "errors", "gate", "jobs", "policy", "protocol", "specs",
            "store"},
    "openapi": {"api", "jobs"},
    "server": {"api", "coordinator", "gate", "openapi", "sessions", "settings"},
    "context": {"protocol"},
    "manual": {"context"},
    "worker": {"context", "ids", "manual", "protocol", "specs"},
    "client": {"specs"},
    "demo": {"client", "server", "settings", "specs", "worker"},
    "cli": {"auth", "logs", "client", "protocol", "specs", "server", "settings", "store",
            "worker", "demo"},
    "__init__": {"context", "specs", "worker"},
    "__main__": {"cli"},
}
SERVER_ONLY = {"starlette", "uvicorn", "sqlite_utils", "sqlite3", "httpx"}


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(rota modules, top-level third-party/stdlib packages) imported by a file."""
    inner: set[str] = set()
    outer: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] if node.module != "rota" else [
                f"rota.{alias.name}" for alias in node.names]
        for name in names:
            if name.startswith("rota."):
                inner.add(name.split(".")[1])
            else:
                outer.add(name.split(".")[0])
    return inner, outer


def test_every_module_is_in_the_layer_map():
    assert {p.stem for p in PACKAGE.glob("*.py")} == set(ALLOWED)


def test_imports_point_one_way():
    for path in PACKAGE.glob("*.py"):
        inner, _ = imports_of(path)
        assert inner <= ALLOWED[path.stem], f"{path.name} imports {sorted(inner - ALLOWED[path.stem])}"


def test_the_worker_sdk_needs_no_server_dependency():
    for module in ("worker", "context", "manual", "protocol", "specs", "ids"):
        _, outer = imports_of(PACKAGE / f"{module}.py")
        assert not outer & SERVER_ONLY, f"{module} imports {sorted(outer & SERVER_ONLY)}"
