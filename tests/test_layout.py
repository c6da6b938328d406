"""Imports point one way, by rank: a module may import only modules of a lower layer.

The layers (docs/architecture.md): the wire protocol and the job model at the bottom;
specs, policy, the pure scheduler, registry and engine; the store; the async shell
and its HTTP/WebSocket edges; the CLI on top. The worker SDK and the producer client
stand beside the server: they share only the bottom (errors, ids, protocol, specs).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rota"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

# Lowest first. Within a layer no module imports another.
LAYERS: list[set[str]] = [
    {"errors", "ids", "inputs", "logs", "settings", "display", "charts", "schema"},  # leaves:
    # no rota imports (the dashboard's figures and its chart, as text; the store's tables)
    {"protocol", "model", "db", "dblock"},  # the wire format; the job and its lifecycle;
    # SQLite; one server per SQLite file
    {"specs", "policy", "auth", "ready", "retention", "observe", "listing", "pg",
     "standing"},  # spec files and checksums; retry rules; a server's standing by its lease;
    # tokens; the ready index; how long finished jobs are kept;
    # what happened (events, counts, metrics as numbers); job filters; PostgreSQL (db's
    # writer and readers on psycopg, SQLite's SQL translated: just above db, which it extends)
    {"jobs", "scheduler", "effects", "views", "verdicts"},  # building jobs; placing them;
    # effect types; the rules of an operator's actions (cancel, retry, bulk, directives)
    {"registry"},  # connected workers
    {"attempts", "intake", "reservations"},  # how attempts end; what producers ask; rounds
    {"engine"},  # the pure state machine
    {"rows", "lookup", "fleet"},  # jobs as rows: a restart's load, claims; an operator's
    # queries; several servers' leases, notices and recovery
    {"store"},  # SQLite
    {"admission", "steering", "tokenwatch", "upkeep", "watching"},  # the shell's parts:
    # what comes in, what operators steer, tokens, what callers wait on, clocks and retention
    {"coordinator"},  # the async shell
    {"gate", "safety", "cluster"},  # authentication at the door; the net for what nobody
    # expected; one of several servers on one database
    {"sessions", "api"},  # /work and the HTTP routes
    {"feeds", "operate", "pages"},  # what an operator watches (/events, /stats, /metrics)
    # and steers (job listing, bulk actions, queue pause); the dashboard's plumbing
    {"openapi", "edge", "dashboard"},  # the route table; uvicorn's protocols as Rota runs
    # them; the dashboard's pages
    {"server"},
    # the SDK and the producer client, beside the server
    {"context", "client", "link"},  # a handler's context; the producer client; the core
    {"manual", "execution", "producer", "stream"},  # manual mode; running jobs; the asyncio
    # producer; the event stream's client
    {"connection"},  # the connection thread
    {"worker"},
    {"__init__", "demo"},
    {"cli_base"},  # what the commands that call a server share
    {"cli_ops"},  # the operator's commands: jobs list, bulk actions, queues
    {"cli_live"},  # rota watch and rota tail
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
        "reservations", "engine", "verdicts",
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
