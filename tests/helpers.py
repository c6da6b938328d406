"""What tests share besides fixtures: waiting on a condition, the worker protocol's
messages, and the raw clients that send exactly what a test tells them to.

``registration()`` and ``heartbeat()`` are the one place a registration or a heartbeat is
spelled out; a test that means to send a bad one builds the good one and changes it.
``RawWorker`` drives /work from an event loop, ``SyncRawWorker`` from a thread (hypothesis
state machines): both build their frames with the same functions.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest
import websockets
from websockets.sync.client import ClientConnection as SyncConnection

from click.testing import CliRunner

from rota.core.auth import new_token
from rota.cli.app import main
from rota.base.specs import JobSpec, checksum
from rota.store.tokens import create_token


# How often to ask a question that costs a request or a query (a server starting, a worker
# registering, jobs counted in the store) about something that takes a second or more:
# each question costs the server (or PostgreSQL) and the test CPU.
COSTLY_POLL = 0.05


async def wait_until(predicate: Callable[[], Any], *, timeout: float = 5.0,
                     what: str = "condition", step: float = 0.01) -> Any:
    """Poll ``predicate`` (sync or async) every ``step`` seconds until it returns
    something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)  # noqa: sleep-ok (a poll step bounded by the deadline)


# -- messages ----------------------------------------------------------------------------
def clean_env() -> dict[str, str]:
    """The environment without ROTA_* variables: no inherited ROTA_CRASH_AT on a restart."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}


async def reap(proc: asyncio.subprocess.Process) -> None:
    """A test's subprocess, killed if it still runs (the test failed before it ended)."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


def free_port() -> int:
    """A port nothing listens on now, for a server a test starts as a process."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


async def spawn_serve(http: httpx.AsyncClient, args: list[str], log: Path,
                      env: dict[str, str] | None = None, prelude: str = ""
                      ) -> asyncio.subprocess.Process:
    """Start ``rota serve ARGS`` (output to ``log``) and wait until ``http`` gets its
    /healthz; a server that exits first fails the test with its log. ``prelude``: Python
    the process runs first (a test's setting of a module's constant, as monkeypatch
    would in the test's own process)."""
    launch = ["-c", f"{prelude}\nfrom rota.cli.app import main\nmain()"] if prelude else [
        "-m", "rota"]
    with log.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *launch, "serve", *args, env={**clean_env(), **(env or {})},
            stdout=sink, stderr=sink)

    async def healthy() -> bool:
        if proc.returncode is not None:
            raise AssertionError(f"rota serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            return (await http.get("/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    await wait_until(healthy, timeout=15, what="rota serve to answer /healthz",
                     step=COSTLY_POLL)
    return proc


async def end(procs: list[asyncio.subprocess.Process], clients: list[httpx.AsyncClient]
              ) -> None:
    """Stop the `rota serve` processes a test started, and close its clients."""
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
    for client in clients:
        await client.aclose()


def spec_ref(spec: JobSpec | dict[str, str]) -> dict[str, str]:
    """A spec as a registration names it; a ready-made ``{"name", "checksum"}`` passes as is."""
    return spec if isinstance(spec, dict) else {"name": spec.name, "checksum": checksum(spec)}


def registration(specs: Iterable[JobSpec | dict[str, str]] = (), *, concurrency: int = 1,
                 **fields: Any) -> dict[str, Any]:
    """A valid registration section serving ``specs`` on the default queue; ``fields`` add
    to it or replace any part (``queues``, ``started_at``, ``labels``, ``hostname``...)."""
    return {"hostname": "test", "os": "linux", "pid": 1, "sdk": "raw", "queues": ["default"],
            "concurrency": concurrency, "specs": [spec_ref(s) for s in specs], **fields}


def heartbeat(seq: Any = 0, worker_id: Any = "w1", **sections: Any) -> dict[str, Any]:
    """A heartbeat frame; ``sections`` add to it or replace any part (even ``type``)."""
    return {"type": "heartbeat", "seq": seq, "worker_id": worker_id, **sections}


def completed(job: dict[str, Any], result: Any = None) -> dict[str, Any]:
    """The result entry reporting an assigned job copy completed."""
    return {"job_id": job["id"], "attempt": job["attempt"], "outcome": "completed",
            "result": result}


def as_text(message: dict[str, Any] | list[Any] | str) -> str:
    return message if isinstance(message, str) else json.dumps(message)


# -- raw clients ---------------------------------------------------------------------------
@dataclass
class RawWorker:
    """A hand-driven protocol client: it sends exactly what a test tells it to."""

    ws: websockets.ClientConnection
    worker_id: str
    seq: int = 0
    held: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    async def open(cls, url: str, worker_id: str = "w1", **options: Any) -> RawWorker:
        """Connect to ``url`` (``options`` go to ``websockets.connect``)."""
        return cls(await websockets.connect(url, **options), worker_id)

    async def send(self, message: dict[str, Any] | list[Any] | str) -> None:
        await self.ws.send(as_text(message))

    async def beat(self, **sections: Any) -> None:
        await self.send(heartbeat(self.seq, self.worker_id, **sections))
        self.seq += 1

    async def register(self, specs: list[JobSpec], *, queues: list[str] | None = None,
                       concurrency: int = 10, capacity: int | None = None,
                       declared: dict[str, str] | None = None, started_at: str | None = None,
                       **sections: Any) -> dict[str, Any]:
        """Register (more ``sections``, e.g. a status, may ride along); return the welcome."""
        refs = [*specs, *({"name": n, "checksum": c} for n, c in (declared or {}).items())]
        await self.beat(registration=registration(refs, concurrency=concurrency,
                                                  queues=queues or ["default"],
                                                  started_at=started_at),
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

    async def complete(self, job: dict[str, Any], result: Any = None,
                       **extra: Any) -> dict[str, Any]:
        """Report ``job`` completed (``extra`` sections ride along); return the ack."""
        await self.beat(results=[completed(job, result)], **extra)
        return await self.expect("ack")

    async def assert_no_assign(self, within: float = 0.3) -> None:
        """No assign frame arrives within ``within`` seconds (a bounded negative check)."""
        with pytest.raises(TimeoutError):
            await self.expect("assign", timeout=within)


async def silent_worker(url: str, worker_id: str, specs: list[JobSpec], *,
                        concurrency: int = 1000, every: float = 0.2,
                        rcvbuf: int = 4096) -> tuple[RawWorker, asyncio.Task[None]]:
    """A worker that registers, then never reads its socket again but keeps beating every
    ``every`` seconds: the slow consumer of issue 12. Its receive buffer is made small
    (``rcvbuf``) so that the server's frames back up on the server, not in this kernel.
    Returns the worker and its beating task; ``stop_silent`` ends both."""
    address = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sets the window
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (address.hostname, address.port))
    raw = RawWorker(await websockets.connect(url, sock=sock, ping_interval=None, max_size=None,
                                             compression=None), worker_id)
    await raw.register(specs, concurrency=concurrency)
    raw.ws.transport.pause_reading()  # from here on, nothing is read

    async def beat() -> None:
        while True:
            await raw.beat()
            await asyncio.sleep(every)  # noqa: sleep-ok (the worker's heartbeat cadence)

    return raw, asyncio.create_task(beat(), name=f"silent-{worker_id}")


async def stop_silent(raw: RawWorker, beating: asyncio.Task[None]) -> None:
    """Stop beating and drop the connection (a close handshake would need a reader)."""
    beating.cancel()
    await asyncio.gather(beating, return_exceptions=True)
    raw.ws.transport.abort()


class RawWorkers:
    """Opens raw workers on one server, ``await workers("w1")``, and closes them all."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.opened: list[RawWorker] = []

    async def __call__(self, worker_id: str = "w1", **options: Any) -> RawWorker:
        self.opened.append(await RawWorker.open(self.url, worker_id, **options))
        return self.opened[-1]

    async def close(self) -> None:
        for raw in self.opened:
            await raw.ws.close()


@dataclass
class SyncRawWorker:
    """``RawWorker`` for a driver without an event loop, on a ``websockets.sync`` connection:
    the same frames, sent and read blocking."""

    ws: SyncConnection
    worker_id: str
    seq: int = 0

    def send(self, message: dict[str, Any] | list[Any] | str | bytes) -> None:
        self.ws.send(message if isinstance(message, bytes) else as_text(message))

    def beat(self, **sections: Any) -> int:
        """Send a heartbeat; return its seq."""
        seq = self.seq
        self.send(heartbeat(seq, self.worker_id, **sections))
        self.seq += 1
        return seq

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        return json.loads(self.ws.recv(timeout=timeout))


async def raw_http(port: int, request: bytes) -> tuple[int, bytes]:
    """Send bytes as they are (no client tidies them up); return the status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), 5)
        return int(head.split(b" ")[1]), body
    finally:
        writer.close()


# -- shared by several test files ----------------------------------------------------

async def rota(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
               timeout: float = 30) -> tuple[int, str, str]:
    """Run the rota command: client commands in-process (click's runner, on a thread so
    that the server in this event loop keeps serving), anything that is a process of its
    own (serve, worker, or a cwd of its own) as a real subprocess."""
    if args[0] not in ("serve", "worker") and cwd is None:
        result = await asyncio.wait_for(
            asyncio.to_thread(CliRunner().invoke, main, list(args), env=env), timeout)
        return result.exit_code, result.stdout, result.stderr
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", *args, cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def closed_with(worker: RawWorker) -> int:
    """Read to the end of the connection and return the server's close code."""
    with pytest.raises(websockets.ConnectionClosed) as closed:
        while True:
            await worker.recv(timeout=5)
    assert closed.value.rcvd is not None
    return closed.value.rcvd.code


async def make_token(live: Any, scope: str, queues: list[str] | None = None) -> str:
    """Create a token in the server's file and wait until the server has read it."""
    [secret] = await make_tokens(live, (scope, queues))
    return secret


async def make_tokens(live: Any, *wanted: tuple[str, list[str] | None]) -> list[str]:
    """Create tokens (scope, queues) in the server's file, as `rota tokens create` does,
    and have the server read them now rather than at its token loop's next look (up to a
    heartbeat interval, about 0.2 s a test over 80 tests). The look at its own pace, and
    at a request's unknown token, are tested in tests/server/test_security.py
    (test_revoking_a_token_disconnects_its_worker, test_a_token_works_the_moment_it_is_created)."""
    made = []
    for scope, queues in wanted:
        token_id, secret, hashed = new_token()
        create_token(live.settings.db, name=f"{scope}-{token_id}", scope=scope, queues=queues,
                     token_id=token_id, hashed=hashed)
        made.append((token_id, secret))
    await live.coordinator.tokenwatch.refresh()  # (read once it returns: no wait)
    assert all(live.coordinator.tokens.valid_id(token_id) for token_id, _ in made)
    return [secret for _, secret in made]

def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def set_limits(http: httpx.AsyncClient, rules: dict[tuple[str, str], Any],
                     headers: dict[str, str] | None = None) -> None:
    """Put ``rules`` (scope -> rota.core.limits.LimitRule) in force through the runtime
    limits' API, ``PUT /limits/{kind}/{name}`` (each replaces its scope's rule)."""
    for (kind, name), rule in rules.items():
        response = await http.put(f"/limits/{kind}/{name}", json=msgspec.to_builtins(rule),
                                  headers=headers)
        assert response.status_code == 200, response.text


def tls_files(tmp: Path) -> tuple[Path, Path, Path]:
    """A new CA (trustme) and a certificate it issued for 127.0.0.1, as files in ``tmp``:
    (the certificate and its chain, its private key, the CA's certificate)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    chain, key, ca_file = tmp / "cert.pem", tmp / "key.pem", tmp / "ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(chain))
    cert.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    return chain, key, ca_file
