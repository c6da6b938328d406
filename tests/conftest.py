"""Fixtures: a real uvicorn server on a free loopback port with a real SQLite file,
raw protocol clients, SDK workers, and helpers that wait on conditions, never on time."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import websockets

from rota.coordinator import Coordinator
from rota.server import EmbeddedServer, listen_socket, uvicorn_config
from rota.settings import ServerSettings
from rota.specs import JobSpec, checksum, parse_spec
from rota.worker import Worker

REPO = Path(__file__).resolve().parent.parent


async def wait_until(predicate: Callable[[], Any], *, timeout: float = 5.0,
                     what: str = "condition") -> Any:
    """Poll ``predicate`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)  # noqa: sleep-ok (a poll step bounded by the deadline)


def write_spec(directory: Path, name: str, *, version: str = "1", queue: str = "default",
               extra: str = "") -> JobSpec:
    directory.mkdir(parents=True, exist_ok=True)
    text = f'name = "{name}"\nversion = "{version}"\nqueue = "{queue}"\n{extra}'
    (directory / f"{name}.toml").write_text(text)
    return parse_spec(text)


class Api:
    """HTTP helpers for a running server, in-process or a subprocess (it sets ``http``)."""

    http: httpx.AsyncClient

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
    def base(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.settings.port}/work"

    @property
    def coordinator(self) -> Coordinator:
        return self.server.config.loaded_app.app.state.coordinator  # type: ignore[union-attr]


async def start_server(tmp: Path, **overrides: Any) -> Live:
    sock = listen_socket(port=overrides.pop("port", 0))  # a restart may reuse its port
    port = sock.getsockname()[1]
    options: dict[str, Any] = {"db": tmp / "rota.db", "port": port,
                               "heartbeat_interval": 0.2, "heartbeat_timeout": 2.0}
    options.update(overrides)
    settings = ServerSettings(**options)
    server = EmbeddedServer(uvicorn_config(settings, log_level="info"))
    task = asyncio.create_task(server.serve(sockets=[sock]), name="test-server")
    server.test_task = task  # type: ignore[attr-defined]
    await wait_until(lambda: server.started or task.done(), what="server start")
    if task.done():
        task.result()
    return Live(settings, server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}"), tmp)


async def stop_server(live: Live) -> None:
    await live.http.aclose()
    live.server.request_exit()
    await asyncio.wait_for(live.server.test_task, timeout=10)  # type: ignore[attr-defined]


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    server = await start_server(tmp_path)
    try:
        yield server
    finally:
        await stop_server(server)


@dataclass
class RawWorker:
    """A hand-driven protocol client: it sends exactly what a test tells it to."""

    ws: websockets.ClientConnection
    worker_id: str
    seq: int = 0
    held: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, message: dict[str, Any] | str) -> None:
        await self.ws.send(message if isinstance(message, str) else json.dumps(message))

    async def beat(self, **sections: Any) -> None:
        await self.send({"type": "heartbeat", "seq": self.seq, "worker_id": self.worker_id,
                         **sections})
        self.seq += 1

    async def register(self, specs: list[JobSpec], *, queues: list[str] | None = None,
                       concurrency: int = 10, capacity: int | None = None,
                       declared: dict[str, str] | None = None, started_at: str | None = None,
                       **sections: Any) -> dict[str, Any]:
        """Register (more ``sections``, e.g. a status, may ride along); return the welcome."""
        refs = [{"name": s.name, "checksum": checksum(s)} for s in specs]
        refs += [{"name": n, "checksum": c} for n, c in (declared or {}).items()]
        registration = {"hostname": "test", "os": "linux", "pid": 1, "sdk": "raw",
                        "queues": queues or ["default"], "concurrency": concurrency,
                        "specs": refs, "started_at": started_at}
        await self.beat(registration=registration,
                        capacity=concurrency if capacity is None else capacity, **sections)
        welcome = await self.expect("welcome")
        await self.expect("ack")
        return welcome

    async def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        if self.held:
            return self.held.pop(0)
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def expect(self, kind: str, timeout: float = 5.0) -> dict[str, Any]:
        """The next frame of type ``kind``; frames of other types are kept for later."""
        deadline = time.monotonic() + timeout
        skipped: list[dict[str, Any]] = []
        try:
            for index, frame in enumerate(self.held):
                if frame["type"] == kind:
                    return self.held.pop(index)
            while True:
                frame = json.loads(await asyncio.wait_for(
                    self.ws.recv(), max(0.01, deadline - time.monotonic())))
                if frame["type"] == kind:
                    return frame
                skipped.append(frame)
        finally:
            self.held.extend(skipped)

    async def jobs(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Collect ``count`` assigned job copies across assign frames."""
        got: list[dict[str, Any]] = []
        while len(got) < count:
            got.extend((await self.expect("assign", timeout))["jobs"])
        return got

    async def complete(self, job: dict[str, Any], result: Any = None, **extra: Any) -> dict[str, Any]:
        await self.beat(results=[{"job_id": job["id"], "attempt": job["attempt"],
                                  "outcome": "completed", "result": result}], **extra)
        return await self.expect("ack")

    async def assert_no_assign(self, within: float = 0.3) -> None:
        """No assign frame arrives within ``within`` seconds (a bounded negative check)."""
        with pytest.raises(TimeoutError):
            await self.expect("assign", timeout=within)


@pytest.fixture
async def connect(live: Live) -> AsyncIterator[Callable[..., Awaitable[RawWorker]]]:
    opened: list[websockets.ClientConnection] = []

    async def open_worker(worker_id: str = "w1") -> RawWorker:
        ws = await websockets.connect(live.ws)
        opened.append(ws)
        return RawWorker(ws, worker_id)

    yield open_worker
    for ws in opened:
        await ws.close()


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

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/work"

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
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
