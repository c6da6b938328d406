"""A slim install: ``pip install rota`` (no extra) gives the producer clients, the worker
SDK and the CLI, and none of the server's packages, which are the ``server`` extra.

Two checks, both fast: pyproject's dependency lists against what the SDK's modules import
(the AST, so a new import is caught without building a venv), and the SDK and
``rota serve`` run in a subprocess where the server's packages cannot be imported, as in
a slim install.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "rota"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What a producer or a worker imports: `import rota` and the rest of the SDK; the CLI's
# module-level imports (`rota worker` runs there; server commands import lazily).
SLIM_ROOTS = {"__init__", "client/client", "client/producer", "worker/worker"}
SERVER_PACKAGES = {"starlette", "uvicorn", "sqlite_utils", "psycopg", "httptools", "jinja2",
                   "prometheus_client"}


def distribution(requirement: str) -> str:
    """'uvicorn[standard]>=0.30; ...' -> 'uvicorn', normalised as PEP 503 does."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group()).lower()


def imports(path: Path, *, top_level_only: bool = False) -> tuple[set[str], set[str]]:
    """(rota modules, other top-level packages) that a module imports."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    inner: set[str] = set()
    outer: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            if name.startswith("rota."):
                # rota.client.client, or rota.store + its module sqlite: a file, if one
                inner.add("/".join(name.split(".")[1:]))
            elif name != "rota" and not name.startswith("rota"):
                outer.add(name.split(".")[0])
    return inner, outer - {"rota"}


def slim_packages() -> set[str]:
    """Every non-stdlib package the slim modules import, following rota's own imports."""
    seen: set[str] = set()
    todo = set(SLIM_ROOTS)
    packages: set[str] = {package for path in (PACKAGE / "cli").glob("*.py")  # the CLI's
                          for package in imports(path, top_level_only=True)[1]}
    while todo:
        module = todo.pop()
        seen.add(module)
        inner, outer = imports(PACKAGE / f"{module}.py")
        packages |= outer
        todo |= {m for m in inner if (PACKAGE / f"{m}.py").exists()} - seen
    return {p for p in packages if p not in sys.stdlib_module_names and p != "__future__"}


def test_the_core_dependencies_are_what_the_sdk_imports_and_no_server_package():
    core = {distribution(r) for r in PROJECT["dependencies"]}
    server = {distribution(r) for r in PROJECT["optional-dependencies"]["server"]}
    owners = importlib.metadata.packages_distributions()
    needed = {distribution(dist) for package in slim_packages() for dist in owners[package]}
    assert needed <= core, f"the SDK imports {sorted(needed - core)}, not in dependencies"
    server_dists = {distribution(d) for p in SERVER_PACKAGES for d in owners[p]}
    assert not server_dists & core, f"server packages in dependencies: {server_dists & core}"
    assert server_dists <= server, f"not in the server extra: {server_dists - server}"
    assert not slim_packages() & SERVER_PACKAGES


def test_the_test_extra_installs_the_server():
    assert "rota[server]" in PROJECT["optional-dependencies"]["test"]
    assert "rota[server]" in PROJECT["optional-dependencies"]["bench"]


# Run in a fresh interpreter where importing a server package fails as it would in a
# slim install (a None in sys.modules makes `import starlette` raise ImportError).
BLOCK = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None\n".format(
    names=sorted(SERVER_PACKAGES))


def run_slim(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True,
                          text=True, timeout=30, cwd=cwd)


def test_the_clients_and_the_worker_import_without_the_server(tmp_path: Path):
    done = run_slim("from rota import AsyncClient, Client, Worker\n"
                    "import rota.cli.app, rota.client.producer\n"
                    "print(AsyncClient.__name__, Client.__name__, Worker.__name__)\n", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["AsyncClient", "Client", "Worker"]


def test_server_commands_say_what_to_install_in_one_line(tmp_path: Path):
    for command in (["serve"], ["demo"], ["tokens", "list"]):
        done = run_slim(f"from rota.cli.app import main\nmain({command!r})\n", tmp_path)
        assert done.returncode == 1, (command, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert f"'rota {command[0]}'" in line and "pip install 'rota[server]'" in line
    assert not list(tmp_path.iterdir())  # no database was made on the way


def test_tokens_over_the_api_need_no_server_packages(tmp_path: Path):
    done = run_slim("from rota.cli.app import main\n"
                    "main(['tokens', 'list', '--url', 'http://127.0.0.1:9', '--token', 'x'])\n",
                    tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "cannot reach Rota" in line and "rota[server]" not in line  # a client, nothing more
