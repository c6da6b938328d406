"""The layout: packages by rank, imports pointing one way, a pure core, modules a reader
can hold in mind.

Packages, lowest first (docs/architecture.md draws them): ``base`` (what every part
shares), ``core`` (pure decisions), ``store`` (SQLite and PostgreSQL), ``server`` (the
shell and its edges), ``cli`` on top. The worker SDK and the producer client stand
beside the server: they import only ``base`` and themselves. Within a package the
imports form no cycle, so its modules can be read bottom up.
"""

from __future__ import annotations

import ast
import re
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rota"
ARCHITECTURE = ROOT / "docs" / "architecture.md"

RANKED = ["base", "core", "store", "server", "cli"]
# What each package may import, besides itself.
MAY_IMPORT: dict[str, set[str]] = {
    package: set(RANKED[:rank]) for rank, package in enumerate(RANKED)}
MAY_IMPORT["worker"] = {"base"}
MAY_IMPORT["client"] = {"base"}
MAY_IMPORT["cli"] |= {"worker", "client"}
PACKAGES = set(MAY_IMPORT)
# rota/__init__ (the public names) and rota/__main__ (python -m rota)
TOP = {"__init__": {"base", "worker", "client"}, "__main__": {"cli"}}
# The pure core imports none of these: no I/O, no event loop, no clock, no threads.
IMPURE = {"asyncio", "time", "socket", "selectors", "select", "ssl", "sqlite3", "threading",
          "subprocess", "signal", "os", "shutil", "tempfile", "http",
          "starlette", "uvicorn", "websockets", "httpx", "httptools", "psycopg", "psutil",
          "sqlite_utils", "uvloop", "concurrent", "multiprocessing"}
# The server's packages, which the SDK and the clients must not need.
SERVER_ONLY = {"starlette", "uvicorn", "sqlite_utils", "sqlite3", "psycopg", "jinja2",
               "prometheus_client", "httptools"}
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 450


def modules() -> dict[str, Path]:
    """Every module by dotted name under rota (``core.engine``, ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def imports_of(path: Path) -> tuple[set[str], set[str]]:
    """(rota modules as ``package.module`` or ``package``, other top-level packages)."""
    inner: set[str] = set()
    outer: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "rota":
                names = [f"rota.{alias.name}" for alias in node.names]
            elif node.module.startswith("rota.") and node.module.count(".") == 1:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        for name in names:
            if name == "rota" or name.startswith("rota."):
                inner.add(".".join(name.split(".")[1:3]))
            else:
                outer.add(name.split(".")[0])
    return inner, outer


def package_of(module: str) -> str:
    return module.split(".")[0]


def test_every_module_is_in_a_package():
    loose = {m for m in modules() if "." not in m} - set(TOP)
    assert not loose, f"modules outside a package: {sorted(loose)}"
    assert {package_of(m) for m in modules() if "." in m} == PACKAGES


def test_imports_are_absolute():
    # A relative import (``from ..client import x``) would slip past the rule below.
    for module, path in modules().items():
        relative = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ImportFrom) and node.level]
        assert not relative, f"rota/{module.replace('.', '/')}.py: relative import, line {relative}"


def test_packages_import_only_what_is_below_or_beside_them():
    for module, path in modules().items():
        inner, _ = imports_of(path)
        if module in TOP:
            allowed = TOP[module]
        else:
            allowed = MAY_IMPORT[package_of(module)] | {package_of(module)}
        wrong = sorted(m for m in inner if package_of(m) not in allowed)
        assert not wrong, f"rota/{module.replace('.', '/')}.py imports {wrong}"


def test_no_package_imports_in_a_circle():
    for package in PACKAGES:
        graph = {}
        for module, path in modules().items():
            if package_of(module) == package and "." in module:
                inner, _ = imports_of(path)
                graph[module] = {m for m in inner if package_of(m) == package and m != module
                                 and "." in m}
        try:
            list(TopologicalSorter(graph).static_order())
        except CycleError as cycle:
            raise AssertionError(f"rota/{package} imports in a circle: {cycle.args[1]}")


def test_the_core_does_no_io():
    for module, path in modules().items():
        if package_of(module) == "core":
            _, outer = imports_of(path)
            assert not outer & IMPURE, f"rota/{module.replace('.', '/')}.py imports " \
                                       f"{sorted(outer & IMPURE)}"


def test_the_sdk_and_the_clients_need_no_server_package():
    for module, path in modules().items():
        if package_of(module) in ("worker", "client", "base"):
            _, outer = imports_of(path)
            assert not outer & SERVER_ONLY, f"{module} imports {sorted(outer & SERVER_ONLY)}"


def test_modules_and_classes_stay_small_enough_to_read():
    for module, path in modules().items():
        text = path.read_text()
        lines = text.count("\n")
        assert lines <= MAX_MODULE_LINES, f"rota/{module.replace('.', '/')}.py: {lines} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                assert size <= MAX_CLASS_LINES, f"{module}.{node.name}: {size} lines"


def test_docs_architecture_names_every_module_in_its_package():
    text = ARCHITECTURE.read_text()
    for package in RANKED + ["worker", "client"]:
        assert re.search(rf"^### `rota/{package}/`", text, re.M), f"no section for {package}"
    documented = set(re.findall(r"^\| `rota/(\w+)/(\w+)\.py` \|", text, re.M))
    actual = {tuple(m.split(".")) for m in modules()
              if "." in m and not m.endswith("__init__")}
    assert documented == actual, (f"missing: {sorted(actual - documented)}; "
                                  f"gone: {sorted(documented - actual)}")
