"""Fixtures: a real uvicorn server on a free loopback port with a real SQLite file,
raw protocol clients and SDK workers. The raw clients, the protocol message builders and
``wait_until`` (which waits on conditions, never on time) live in helpers.py."""

from __future__ import annotations

import asyncio
import sys
import atexit
import os
import functools
import shutil
import ssl
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
# The tests live in folders by kind (README.md there); a few import a helper of another
# test file (test_engine's fake clock, say), so every folder is on the path, as tests/ is.
KINDS = ("house", "unit", "store", "server", "system", "ui", "ojs")
sys.path[:0] = [str(Path(__file__).resolve().parent / kind) for kind in KINDS]
# The tests start a hundred or so Python processes (rota serve, workers, xdist's own). With
# PYTHONDONTWRITEBYTECODE set, as in some sandboxes, each would compile all of rota again
# (about 0.13 s of CPU a process): they keep their bytecode in a cache of their own
# instead, outside the tree, which is then left as clean as the variable meant.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    os.environ.setdefault("PYTHONPYCACHEPREFIX",
                          str(Path(tempfile.gettempdir()) / f"rota-tests-pycache-{os.getuid()}"))

from helpers import RawWorker as RawWorker  # re-exported: tests import it from here
from helpers import RawWorkers, wait_until
from pgserver import Cluster

from rota.store import sqlite as db, migrations as db_migrations, pg, pg_connection
from rota.server.coordinator import Coordinator
from rota.server.app import EmbeddedServer, listen_socket, uvicorn_config
from rota.core.settings import ServerSettings
from rota.base.specs import JobSpec, parse_spec
from rota.worker.worker import Worker

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("sqlite", "postgres")
# The servers' clients speak plain HTTP on loopback, yet httpx builds a TLS context for
# each client it makes, loading the CA bundle: 50 ms a client here, a few hundred times a
# run. One context, made once, serves them all.
LOOPBACK_TLS = ssl.create_default_context()
# httpcore finds out which async library runs each request by importing sniffio, which is
# not installed (anyio 4 does without it): every request of every client searched
# sys.path for it again, about half the CPU of a loopback request here. A failed import
# that is remembered costs nothing, and httpcore then takes asyncio, as it did.
try:
    import sniffio  # noqa: F401
except ImportError:
    sys.modules["sniffio"] = None  # type: ignore[assignment]


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller: xdist's workers would run
        # nothing for a path that names no file, silently (pytest-xdist #109), and the
        # test files moved into folders by kind: say so instead
        here = config.invocation_params.dir
        for arg in config.args:
            path = arg.split("::")[0]
            if not arg.startswith("-") and not (here / path).exists():
                raise pytest.UsageError(f"no such test file or folder: {path} (the tests"
                                        " are in tests/unit, store, server, system, ui, ojs"
                                        " and house: tests/README.md)")
    config.addinivalue_line("markers", "both_backends: run each test on SQLite and on"
                            " PostgreSQL (the backend fixture; servers started by the test"
                            " use it)")
    config.addinivalue_line("markers", "sqlite_only(reason): in a both_backends module, a"
                            " test that means SQLite only (a file, its locks, its disk)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    node = metafunc.definition
    if node.get_closest_marker("both_backends") and not node.get_closest_marker("sqlite_only"):
        metafunc.parametrize("backend", BACKENDS, indirect=True)


# Where start_server puts a test's store when its backend is PostgreSQL: one database per
# tmp directory, so that a server restarted on the same tmp finds its jobs as it would
# find its SQLite file. None: SQLite (the file in tmp).
_server_database: Callable[[Path], str] | None = None


def store_url(tmp: Path) -> str | None:
    """The PostgreSQL database of the test's store in ``tmp`` (backend postgres), or None
    for SQLite (the file tmp/rota.db): for Store(..., database_url=store_url(tmp))."""
    return _server_database(tmp) if _server_database is not None else None


def open_store(tmp: Path) -> Any:
    """A migrated connection to the test's store in ``tmp``, on its backend, for the
    store's own functions (rows.py, lookup.py) called straight: sqlite3's, or
    rota/store/pg_connection.py's sqlite3-like one. The caller closes it."""
    url = store_url(tmp)
    if url is not None:
        pg.migrate(url)
        return pg_connection.connect(url)
    db_migrations.migrate(tmp / "rota.db")
    return db.connect(tmp / "rota.db")


def write_spec(directory: Path, name: str, *, version: str = "1", queue: str = "default",
               extra: str = "") -> JobSpec:
    directory.mkdir(parents=True, exist_ok=True)
    text = f'name = "{name}"\nversion = "{version}"\nqueue = "{queue}"\n{extra}'
    (directory / f"{name}.toml").write_text(text)
    return parse_spec(text)


class Api:
    """HTTP helpers for a running server on loopback, in-process or a subprocess (it sets
    ``http`` and ``port``)."""

    http: httpx.AsyncClient
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/work"

    async def push(self, *specs: JobSpec) -> dict[str, Any]:
        body = {"specs": [msgspec.to_builtins(s) for s in specs]}
        response = await self.http.put("/specs", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def enqueue(self, spec: str, args: dict[str, Any] | None = None,
                      **extra: Any) -> dict[str, Any]:
        response = await self.http.post("/jobs", json={"spec": spec, "args": args or {}, **extra})
        assert response.status_code in (200, 201), response.text
        return response.json()["job"]

    async def job(self, job_id: str) -> dict[str, Any]:
        response = await self.http.get(f"/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return response.json()

    async def wait_state(self, job_id: str, state: str, timeout: float = 5.0) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            job = await self.job(job_id)
            return job if job["state"] == state else None

        return await wait_until(check, timeout=timeout, what=f"job {job_id} {state}")


@dataclass
class Live(Api):
    """A running in-process server and what tests need to talk to it."""

    settings: ServerSettings
    server: EmbeddedServer
    http: httpx.AsyncClient
    tmp: Path

    @property
    def port(self) -> int:  # type: ignore[override]
        return self.settings.port

    @property
    def coordinator(self) -> Coordinator:
        return self.server.config.loaded_app.app.state.coordinator  # type: ignore[union-attr]


@functools.cache
def _migrated_sqlite() -> Path:
    """A SQLite file with Rota's schema, migrated once per test process (as
    pgserver.Cluster keeps a migrated template): a copy costs a server's start less than
    migrating a new file (about 5 ms against 80 ms here)."""
    path = Path(tempfile.mkdtemp(prefix="rota-template-")) / "rota.db"
    atexit.register(shutil.rmtree, path.parent, True)
    db_migrations.migrate(path)  # closed: its WAL checkpointed into the file, which is whole alone
    assert not path.with_name("rota.db-wal").exists()
    return path


async def start_server(tmp: Path, **overrides: Any) -> Live:
    sock = listen_socket(port=overrides.pop("port", 0))  # a restart may reuse its port
    port = sock.getsockname()[1]
    # Durability "process" (no fsync per commit) unless a test asks for "full": an
    # in-process server's commits need only survive the test's own crashes, and the
    # fsyncs cost the suite a fifth of its CPU. The `rota serve` processes that tests
    # kill -9 run with the default, "full".
    options: dict[str, Any] = {"db": tmp / "rota.db", "port": port,
                               "heartbeat_interval": 0.2, "heartbeat_timeout": 2.0,
                               "durability": "process"}
    if _server_database is not None:
        options["database_url"] = _server_database(tmp)
    elif "db" not in overrides and "database_url" not in overrides:
        if not (tmp / "rota.db").exists():  # a new store; a restart finds its own
            tmp.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(_migrated_sqlite(), tmp / "rota.db")
    options.update(overrides)
    settings = ServerSettings(**options)
    server = EmbeddedServer(uvicorn_config(settings, log_level="info"))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="test-server")
    server.test_task = task  # type: ignore[attr-defined]
    # (a deadline, not a wait: 15 s, as for a `rota serve` process, for a loaded machine)
    await wait_until(lambda: server.started or task.done(), timeout=15, what="server start")
    if task.done():
        sock.close()
        task.result()
    # (idle connections dropped before the server's 5 s keep-alive closes them under a request)
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", verify=LOOPBACK_TLS,
                             limits=httpx.Limits(keepalive_expiry=2.0))
    return Live(settings, server, http, tmp)


async def stop_server(live: Live) -> None:
    await live.http.aclose()
    live.server.request_exit()
    await asyncio.wait_for(live.server.test_task, timeout=10)  # type: ignore[attr-defined]


@pytest.fixture
async def live(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Live]:
    """A server; a test parametrizes it indirectly with settings of its own."""
    server = await start_server(tmp_path, **getattr(request, "param", {}))
    try:
        yield server
    finally:
        await stop_server(server)


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[Cluster]:
    """A throwaway PostgreSQL for this test process (tests/pgserver.py): one per xdist
    worker, started at the first test that needs it."""
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def pg_url(pg_cluster: Cluster) -> Iterator[str]:
    """The URL of a fresh, empty database of its own for this test."""
    url = pg_cluster.create_database()
    yield url
    pg_cluster.give_back(url)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The store the test's servers run on: "sqlite" unless the module is marked
    both_backends (then each test runs once with each)."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture(autouse=True)
def _servers_backend(backend: str, request: pytest.FixtureRequest) -> Iterator[None]:
    """Servers the test starts run on its backend (start_server, the live fixture)."""
    global _server_database
    if backend != "postgres":
        yield
        return
    cluster: Cluster = request.getfixturevalue("pg_cluster")
    databases: dict[Path, str] = {}

    def database(tmp: Path) -> str:
        if tmp not in databases:
            databases[tmp] = cluster.create_database(migrated=True)
        return databases[tmp]

    _server_database = database
    try:
        yield
    finally:
        _server_database = None
        for url in databases.values():
            cluster.give_back(url)


@pytest.fixture
async def connect(live: Live) -> AsyncIterator[RawWorkers]:
    workers = RawWorkers(live.ws)
    yield workers
    await workers.close()


@pytest.fixture
async def sdk_worker(live: Live) -> AsyncIterator[Callable[..., Awaitable[Worker]]]:
    """Start SDK workers in this event loop; each is stopped at the end of the test."""
    running: list[tuple[Worker, asyncio.Task[None]]] = []

    async def start(worker: Worker) -> Worker:
        worker.url = live.ws
        task = asyncio.create_task(worker.run(), name=f"sdk-{worker.worker_id}")
        running.append((worker, task))
        await wait_until(lambda: worker.connected.is_set() or task.done(), what="SDK connect")
        if task.done():
            task.result()
        return worker

    yield start
    for worker, task in running:
        worker.stop()
        await asyncio.wait_for(task, timeout=10)


class Proxy:
    """A TCP relay between workers and the server on loopback, so a test can break the
    network under a live connection: ``cut()`` resets both sides (each sees the connection
    lost), ``blackhole()`` stops relaying and leaves both sides open and unanswered (as a
    network partition does: no FIN, no RST, only silence)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._pairs: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self._pumps: set[asyncio.Task[None]] = set()
        self._silent: list[asyncio.StreamWriter] = []  # sockets left open by blackhole()
        self._open = asyncio.Event()  # hold() clears it: new connections wait, unrelayed
        self._open.set()

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/work"

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await self._open.wait()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._pairs.append((writer, up_writer))
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            return  # blackholed: the other side stays open and hears nothing
        sink.close()

    def hold(self) -> None:
        """Keep the connections made from now on waiting (the peer is away) until
        ``release()``: a test decides when a reconnect gets through."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def cut(self) -> None:
        for worker_side, server_side in self._pairs:
            worker_side.transport.abort()
            server_side.transport.abort()
        self._pairs.clear()

    def blackhole(self) -> None:
        for task in list(self._pumps):  # stop relaying; both sides stay open, unanswered
            task.cancel()
        for pair in self._pairs:
            self._silent.extend(pair)
        self._pairs.clear()

    async def close(self) -> None:
        self.cut()
        for writer in self._silent:
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._pumps):
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


class ThreadedServer:
    """A live server on an event loop of its own, in a thread: for synchronous drivers
    (hypothesis state machines, schemathesis)."""

    def __init__(self, tmp: Path, **overrides: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.live: Live = self._run(start_server(tmp, **overrides))

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=20)

    def close(self) -> None:
        self._run(stop_server(self.live))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
