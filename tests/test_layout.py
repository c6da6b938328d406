"""Imports point one way, by rank: a module may import only modules of a lower layer.

The layers (docs/architecture.md): the wire protocol and the job model at the bottom;
specs, policy, the pure scheduler, registry and engine; the store; the async shell
and its HTTP/WebSocket edges; the CLI on top. The worker SDK and the producer client
stand beside the server: they share only the bottom (errors, ids, protocol, specs).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rota"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Lowest first. Within a layer no module imports another.
LAYERS: list[set[str]] = [
    {"errors", "ids", "inputs", "logs", "settings", "display", "charts", "schema",
     "openapi_schemas"},  # leaves: no rota imports (the dashboard's figures and its chart,
    # as text; the store's tables; the HTTP API's answers as Structs)
    {"protocol", "model", "db", "dblock", "db_health", "pg_sql"},  # the wire format; the
    # job and its lifecycle; SQLite's connection and errors; one server per SQLite file;
    # the store's health; SQLite's SQL as PostgreSQL's
    {"specs", "policy", "auth", "ready", "retention", "observe", "listing", "standing",
     "db_migrations", "db_writer", "db_readers", "pg_connection"},  # spec files and
    # checksums; retry rules; a server's standing by its lease; tokens; the ready index;
    # how long finished jobs are kept; what happened (events, counts, metrics as numbers);
    # job filters; SQLite's migrations, writer thread and readers; a sqlite3-like
    # PostgreSQL connection
    {"jobs", "scheduler", "effects", "views", "pg", "fleet", "verdicts"},  # building jobs; placing them;
    # effect types; PostgreSQL (db's writer and readers on pg_connection: above db, which it
    # extends); several servers' leases, notices and recovery
    {"registry"},  # connected workers
    {"attempts", "intake", "reservations", "timers"},  # how attempts end; what producers
    # ask; rounds; the engine's timers, stalls and its server's lease
    {"heartbeats"},  # what workers tell the engine: registrations, heartbeats, disconnects
    {"engine"},  # the pure state machine
    {"rows", "lookup", "store_writes", "store_views", "store_tokens"},  # jobs as rows: a
    # restart's load, claims; an operator's queries; the store's writes on a connection;
    # its reads for the API; tokens, and the CLI's own way into the database
    {"store"},  # SQLite or PostgreSQL: the writer and readers, and what they run
    {"admission", "steering", "tokenwatch", "upkeep", "watching"},  # the shell's parts:
    # enqueue and take-over; cancel, retry, bulk, retire; tokens; clock and retention loops;
    # result waits and /events subscribers
    {"shell_reads", "shell_directives"},  # what routes read of the shell; directives
    {"coordinator"},  # the async shell
    {"gate", "safety", "cluster"},  # authentication at the door; the net for what nobody
    # expected; one of several servers on one database
    {"sessions", "api_base"},  # /work; what the HTTP routes share (answers, errors, bodies)
    {"api"},  # the HTTP routes
    {"feeds", "operate", "pages", "openapi"},  # what an operator watches (/events, /stats,
    # /metrics) and steers (job listing, bulk actions, queue pause); the dashboard's
    # plumbing; the OpenAPI document, made from a route table
    {"routes", "edge", "dashboard"},  # the route table; uvicorn's protocols as Rota runs
    # them; the dashboard's pages
    {"server"},
    {"startup"},  # what a server checks and takes before it serves
    # the SDK and the producer client, beside the server
    {"context", "client", "link"},  # a handler's context; the producer client; the core
    {"manual", "execution", "producer", "stream"},  # manual mode; running jobs; the asyncio
    # producer; the event stream's client
    {"connection"},  # the connection thread
    {"worker"},
    {"__init__", "demo"},
    {"cli_base", "cli_logging"},  # what the commands that call a server share; how the
    # server and the worker write their log lines
    {"cli_ops", "cli_serve", "cli_worker", "cli_specs", "cli_tokens"},  # the operator's
    # commands: jobs list, bulk actions, queues, workers; serve; worker and demo; specs; tokens
    {"cli_live", "cli_jobs"},  # rota watch and rota tail; enqueue, run, jobs show
    {"cli"},
    {"__main__"},
]
RANK = {module: rank for rank, layer in enumerate(LAYERS) for module in layer}
# What the worker SDK and the producer client may use of the rest.
SHARED = {"errors", "ids", "inputs", "protocol", "specs"}
SDK = {"context", "manual", "worker", "client", "link", "execution", "connection", "producer",
       "stream", "__init__"}
SERVER_ONLY = {"starlette", "uvicorn", "sqlite_utils", "sqlite3", "httpx", "psycopg"}
# The pure core: no I/O, no event loop, no clock.
PURE = {"inputs", "model", "policy", "standing", "ready", "retention", "observe", "listing", "display", "charts", "scheduler", "effects", "registry", "attempts", "intake",
        "reservations", "heartbeats", "timers", "engine", "verdicts",
        "link"}


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


def test_every_module_has_a_layer():
    assert {p.stem for p in PACKAGE.glob("*.py")} == set(RANK)


def test_imports_point_down_the_layers():
    for path in PACKAGE.glob("*.py"):
        inner, _ = imports_of(path)
        upward = sorted(m for m in inner if RANK[m] >= RANK[path.stem])
        assert not upward, f"{path.name} imports {upward}, which are not below it"


def test_the_sdk_stands_beside_the_server():
    for module in SDK:
        inner, outer = imports_of(PACKAGE / f"{module}.py")
        assert inner <= SHARED | SDK, f"{module} imports {sorted(inner - SHARED - SDK)}"
        if module != "producer":  # the asyncio producer client speaks HTTP with httpx
            assert not outer & SERVER_ONLY, f"{module} imports {sorted(outer & SERVER_ONLY)}"


def test_the_core_does_no_io():
    for module in PURE:
        _, outer = imports_of(PACKAGE / f"{module}.py")
        forbidden = outer & {"asyncio", "time", "socket", "sqlite3", "threading", "os",
                             "starlette", "uvicorn", "websockets", "httpx"}
        assert not forbidden, f"{module} imports {sorted(forbidden)}"


def test_docs_architecture_shows_these_layers():
    rows = re.findall(r"^\| (\d+|SDK|top) \| ([^|]+) \|", ARCHITECTURE.read_text(), re.M)
    documented = {row: set(re.findall(r"`(\w+)`", names)) for row, names in rows}
    for rank, layer in enumerate(LAYERS):
        if str(rank) in documented:
            assert documented[str(rank)] == layer, f"layer {rank} in docs/architecture.md"
    assert set().union(*documented.values()) == set(RANK)


# What importing the pure core, or `import rota` alone, must not load: I/O libraries, event
# loops, the worker's and the server's packages.
IO_LIBRARIES = {"websockets", "psutil", "asyncio", "ssl", "socket", "selectors", "subprocess",
                "concurrent", "httpx", "http", "starlette", "uvicorn", "sqlite3", "sqlite_utils",
                "psycopg", "jinja2", "prometheus_client", "threading"}


def test_importing_the_core_loads_no_io_library():
    # One interpreter per module, started together: each must load only what it needs.
    runs = {module: subprocess.Popen(
        [sys.executable, "-c", f"import sys, rota.{module}\n"
         "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"],
        stdout=subprocess.PIPE, text=True) for module in sorted(PURE)}
    for module, run in runs.items():
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0, module
        loaded = set(out.split())
        # The core logs through the standard `logging`, which itself imports threading
        # (for its locks); no core module imports threading itself (the AST test above).
        excused = {"threading"} if "logging" in loaded else set()
        assert not (loaded & IO_LIBRARIES) - excused, \
            f"import rota.{module} loads {sorted((loaded & IO_LIBRARIES) - excused)}"


def test_import_rota_alone_loads_nothing_of_rota_yet():
    # `rota` exports lazily (PEP 562): `import rota` runs only rota/__init__.py.
    code = ("import sys, rota\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('rota.'))))")
    packages, submodules = subprocess.run([sys.executable, "-c", code], capture_output=True,
                                          text=True, check=True).stdout.split("\n")[:2]
    assert not set(packages.split()) & (IO_LIBRARIES | {"msgspec", "logging"})
    assert submodules == "", f"import rota loads {submodules}"


def test_every_public_name_is_exported_and_found_on_first_use():
    import rota

    for name in rota.__all__:
        assert getattr(rota, name) is not None, name
    assert set(rota.__all__) <= set(dir(rota))
    with pytest.raises(AttributeError):
        rota.Nothing  # noqa: B018


# Exceptions outside the RotaError tree, and why: a leaf's, turned into a refusal at each
# door (rota/errors.py says so); the demo's handlers' own failure, an example.
# Exceptions no user sees: BadJson is turned into each door's own refusal; the demo's is
# its example of a failing handler; DryRun unwinds a spec push's savepoint in the store.
OUTSIDE_THE_TREE = {"inputs.BadJson", "demo.TemporaryFailure", "store_writes.DryRun"}


def test_every_exception_a_user_can_catch_is_a_rota_error_mapped_in_errors_py():
    import importlib

    from rota import errors

    found = set()
    for path in sorted(PACKAGE.glob("*.py")):
        if path.stem == "__main__":  # (it runs the command line)
            continue
        module = importlib.import_module(f"rota.{path.stem}")
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, BaseException)
                    and value.__module__ == module.__name__ and not name.startswith("_")):
                found.add(f"{path.stem}.{name}")
                if f"{path.stem}.{name}" not in OUTSIDE_THE_TREE:
                    assert issubclass(value, errors.RotaError), f"{path.stem}.{name}"
                    assert re.search(rf"\b{name}\b", errors.__doc__ or ""), \
                        f"{name} is not in rota/errors.py's map"
    assert OUTSIDE_THE_TREE <= found  # (an exception that left needs no excuse)
