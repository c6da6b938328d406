"""A fleet of raw /work clients cheap enough that the clients never set the pace.

Run from the repository root, against a server that is already running (``rota serve``
with ``--max-connections`` and ``--max-worker-connections-per-token`` above N):

    .venv/bin/python bench/fleet.py ws://127.0.0.1:8000/work --workers 10000 --seconds 10
    .venv/bin/python bench/fleet.py ws://127.0.0.1:8000/work --workers 10000 --lean
    .venv/bin/python bench/fleet.py --storm --workers 10000   # starts and kills its own server

Each client is an ``asyncio.Protocol`` on a raw socket (uvloop when installed), spread
over ``--procs`` processes: a hand-written handshake (``GET /work`` with the Upgrade
headers, and ``Authorization: Bearer`` with ``--token``), then the registration, the
welcome, and one idle beat a second as the SDK sends it
(``{"type":"heartbeat","seq":N,"worker_id":W,"capacity":0,"status":{"state":"running"}}``),
each client at its own phase of the second, never waiting for an ack. A client frame must
be masked; its mask key is four zero bytes, which leaves the payload as it is (RFC 6455
allows any key). What comes back is counted, not decoded: a frame holding ``"ack"`` is an
ack, ``"welcome"`` a welcome, anything else "other"; pings are answered. ``--lean``
registers with ``"lean_acks": true`` (a server that does not know the field ignores it);
``--sparse`` adds ``"idle_ack_interval": 10``, as the Python SDK does (docs/protocol.md §4.2).
``--free N``: each client says it has N free slots (``capacity``), as an SDK worker
waiting for work does; every beat from a worker with a free slot wakes a scheduling round.

A lost connection is reconnected with the SDK's policy (rota/worker/link.py): 0.1 s
doubling per failed attempt, capped at 2.5 s (half the default heartbeat timeout),
jittered over [half, full], and it registers again with the same ``worker_id``.

``--storm``: a ``rota serve`` of its own (temp dir, free port), N clients registered and
beating, then the server is killed with SIGKILL and started again on the same port and
database; every client reconnects at once. Reported: the time until all N have a welcome
again (from the kill and from the restarted server's first answer to ``/healthz``), the
clients' failed handshakes, refused connects and errors, and the WARNING/ERROR lines and
"stalled" warnings in the restarted server's log.

The orchestrating process talks to the fleet's processes over pipes; ``Fleet`` is the API
that bench/compare.py and bench/edges.py use.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing as mp
import os
import random
import resource
import signal
import struct
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TICKS = 100  # a process sends its beats in this many slices of each second
HANDSHAKE_TIMEOUT = 10.0  # seconds from the connect to the 101
REGISTER_TIMEOUT = 10.0  # seconds from the 101 to the welcome
SDK_IDLE_ACK_INTERVAL = 10.0  # what the Python SDK asks for (rota/worker/link.py)
BACKOFF_FIRST, BACKOFF_CAP = 0.1, 2.5  # the SDK's (rota/worker/link.py, timeout 5 s)


def raise_nofile() -> None:
    """The open-files limit up to the hard one (inherited by what this process starts)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def client_frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """A final client frame, masked with the key 0000 (the payload unchanged)."""
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + b"\0\0\0\0" + payload


class Stats:
    """One process's counters (plain ints: the loop is the only writer)."""

    def __init__(self) -> None:
        self.c: Counter[str] = Counter()
        self.close_codes: Counter[str] = Counter()  # "code reason"
        self.registered = 0  # clients with a welcome on their present connection
        self.connected = 0  # clients with a 101 on their present connection
        # When each refused connect was begun (monotonic, one clock for every process):
        # a refusal is read when the client's loop gets to it, which in a storm may be
        # well after the server listens again, so its count alone misdates it.
        self.refused_begun: list[float] = []


class Client(asyncio.Protocol):
    """One worker: connects, registers, beats; reconnects when its connection is lost."""

    __slots__ = ("fleet", "n", "worker_id", "transport", "state", "buf", "seq", "attempts",
                 "timer", "cause", "_prefix", "_suffix")

    def __init__(self, fleet: ProcessFleet, n: int) -> None:
        self.fleet = fleet
        self.n = n
        self.worker_id = f"{fleet.prefix}{n:05d}"
        self.transport: asyncio.Transport | None = None
        self.state = "idle"  # idle, connecting, upgrading, registering, ready
        self.buf = bytearray()
        self.seq = 0
        self.attempts = 0  # failed attempts since the last welcome
        self.timer: asyncio.TimerHandle | None = None
        self.cause: str | None = None  # why this side ended the connection, when it did
        self._prefix = b'{"type":"heartbeat","seq":'
        self._suffix = (b',"worker_id":"' + self.worker_id.encode() + b'","capacity":'
                        + str(fleet.free).encode() + b',"status":{"state":"running"}}')

    # -- connecting ----------------------------------------------------------------------
    def connect(self) -> None:
        self.timer = None
        self.state = "connecting"
        self.fleet.loop.create_task(self._connect())

    async def _connect(self) -> None:
        fleet = self.fleet
        fleet.stats.c["connect_attempts"] += 1
        begun = time.monotonic()
        try:
            await asyncio.wait_for(fleet.loop.create_connection(
                lambda: self, fleet.host, fleet.port), HANDSHAKE_TIMEOUT)
        except ConnectionRefusedError:
            fleet.stats.refused_begun.append(begun)
            self._failed("refused")
        except TimeoutError:
            self._failed("connect_timeouts")
        except OSError as exc:
            self._failed(f"connect_error_{exc.errno}")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.state = "upgrading"
        self.buf.clear()
        transport.write(self.fleet.request)  # type: ignore[attr-defined]
        self.timer = self.fleet.loop.call_later(HANDSHAKE_TIMEOUT, self._timed_out,
                                                "handshake_timeouts")

    def _timed_out(self, what: str) -> None:
        self.timer = None
        self.fleet.stats.c[what] += 1
        self.cause = what  # counted: connection_lost counts nothing more
        if self.transport is not None:
            self.transport.abort()

    def _failed(self, what: str) -> None:
        """An attempt ended before a welcome: count it, and try again after the backoff."""
        self.fleet.stats.c[what] += 1
        self._retry()

    def _retry(self) -> None:
        self.state = "idle"
        self.transport = None
        if self.fleet.stopping:
            return
        delay = min(BACKOFF_CAP, BACKOFF_FIRST * 2.0 ** self.attempts)
        self.attempts += 1
        self.timer = self.fleet.loop.call_later(delay * (0.5 + random.random() / 2),
                                                self.connect)

    def connection_lost(self, exc: Exception | None) -> None:
        was, cause = self.state, self.cause
        if was in ("idle", "connecting"):
            return
        self.cause = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        stats = self.fleet.stats
        if was == "ready":
            stats.registered -= 1
        if was in ("ready", "registering"):
            stats.connected -= 1
        if self.fleet.stopping:
            self.state = "idle"
            self.transport = None
        elif cause:
            self._retry()
        elif was == "ready":
            stats.c["lost_after_welcome"] += 1
            self.attempts = 0
            self._retry()
        elif was == "registering":
            self._failed("lost_before_welcome")
        else:
            self._failed("reset_in_handshake" if exc else "closed_in_handshake")

    # -- reading -------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if self.state == "upgrading":
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            status = bytes(buf[9:12])
            if status != b"101":
                stats = self.fleet.stats
                stats.c["failed_handshakes"] += 1
                stats.c[f"status_{status.decode(errors='replace')}"] += 1
                self.cause = "failed_handshakes"
                self.transport.abort()  # type: ignore[union-attr]
                return
            del buf[:end + 4]
            self.timer.cancel()  # type: ignore[union-attr]
            self.state = "registering"
            self.fleet.stats.connected += 1
            self.fleet.stats.c["handshakes"] += 1
            self.seq = 0
            self.transport.write(self.fleet.registration(self))  # type: ignore[union-attr]
            self.timer = self.fleet.loop.call_later(REGISTER_TIMEOUT, self._timed_out,
                                                    "register_timeouts")
        while len(buf) >= 2:
            opcode = buf[0] & 0x0F
            n = buf[1] & 0x7F
            at = 2
            if n == 126:
                if len(buf) < 4:
                    return
                n = (buf[2] << 8) | buf[3]
                at = 4
            elif n == 127:
                if len(buf) < 10:
                    return
                n = struct.unpack_from("!Q", buf, 2)[0]
                at = 10
            if len(buf) < at + n:
                return
            self._frame(opcode, bytes(buf[at:at + n]))
            del buf[:at + n]

    def _frame(self, opcode: int, payload: bytes) -> None:
        stats = self.fleet.stats.c
        stats["frames_in"] += 1
        if opcode == 0x1:
            if b'"type":"ack"' in payload[:16]:
                stats["acks_in"] += 1
            elif b'"welcome"' in payload[:20]:
                stats["welcomes_in"] += 1
                if self.state == "registering":
                    self.timer.cancel()  # type: ignore[union-attr]
                    self.timer = None
                    self.state = "ready"
                    self.attempts = 0
                    self.fleet.stats.registered += 1
                    self.fleet.stats.c["registrations"] += 1
            else:
                stats["other_in"] += 1
                if self.fleet.keep_other < 5:
                    self.fleet.keep_other += 1
                    self.fleet.samples.append(payload[:300].decode(errors="replace"))
        elif opcode == 0x9:
            self.transport.write(client_frame(payload, 0xA))  # type: ignore[union-attr]
        elif opcode == 0x8:
            stats["closes_in"] += 1
            code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
            reason = payload[2:40].decode(errors="replace")
            self.fleet.stats.close_codes[f"{code} {reason}".strip()] += 1
            self.transport.write(client_frame(payload[:2], 0x8))  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]

    # -- beating -------------------------------------------------------------------------
    def beat(self) -> None:
        self.seq += 1
        payload = self._prefix + str(self.seq).encode() + self._suffix
        self.transport.write(client_frame(payload))  # type: ignore[union-attr]


class ProcessFleet:
    """The clients of one process, their beat clock, and the pipe to the orchestrator."""

    def __init__(self, opts: dict[str, Any], first: int, count: int, conn: Any) -> None:
        self.loop = asyncio.get_running_loop()
        url = urlsplit(opts["url"])
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        key = base64.b64encode(os.urandom(16)).decode()
        lines = [f"GET {url.path or '/'} HTTP/1.1", f"Host: {url.netloc}", "Upgrade: websocket",
                 "Connection: Upgrade", f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
        if opts.get("token"):
            lines.append(f"Authorization: Bearer {opts['token']}")
        self.request = ("\r\n".join(lines) + "\r\n\r\n").encode()
        self.lean = bool(opts.get("lean"))
        self.sparse = bool(opts.get("sparse"))
        self.free = int(opts.get("free", 0))  # the slots each client says it has free
        self.prefix = opts.get("prefix", "idle-")
        self.conn = conn
        self.stats = Stats()
        self.stopping = False
        self.beating = True
        self.samples: list[str] = []
        self.keep_other = 0
        self.clients = [Client(self, n) for n in range(first, first + count)]
        self.rate = float(opts.get("connect_rate", 0)) / max(1, opts.get("procs", 1))
        self.done = asyncio.Event()

    def registration(self, client: Client) -> bytes:
        body: dict[str, Any] = {
            "type": "heartbeat", "seq": 0, "worker_id": client.worker_id,
            "registration": {"hostname": "bench", "os": "linux", "pid": os.getpid(),
                             "sdk": "bench", "queues": ["idle"], "concurrency": 1,
                             "specs": []},
            "capacity": self.free}
        if self.lean or self.sparse:
            body["registration"]["lean_acks"] = True
        if self.sparse:
            body["registration"]["idle_ack_interval"] = SDK_IDLE_ACK_INTERVAL
        return client_frame(json.dumps(body, separators=(",", ":")).encode())

    async def run(self) -> None:
        self.loop.add_reader(self.conn.fileno(), self._command)
        clock = self.loop.create_task(self._clock())
        if self.rate > 0:  # in waves of a tenth of a second, as a fleet would start
            wave = max(1, int(self.rate / 10))
            for start in range(0, len(self.clients), wave):
                for client in self.clients[start:start + wave]:
                    client.connect()
                await asyncio.sleep(0.1)
        else:  # all at once
            for client in self.clients:
                client.connect()
        await self.done.wait()
        clock.cancel()

    async def _clock(self) -> None:
        """Every 1/TICKS s, the clients of the next slice beat (each client once a second)."""
        slices = [self.clients[i::TICKS] for i in range(TICKS)]
        tick = 0
        due = self.loop.time()
        while True:
            due += 1.0 / TICKS
            await asyncio.sleep(max(0.0, due - self.loop.time()))
            if self.beating:
                sent = 0
                for client in slices[tick]:
                    if client.state == "ready":
                        client.beat()
                        sent += 1
                self.stats.c["beats"] += sent
            tick = (tick + 1) % TICKS

    def snapshot(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"pid": os.getpid(), "counters": dict(self.stats.c),
                "close_codes": dict(self.stats.close_codes),
                "registered": self.stats.registered, "connected": self.stats.connected,
                "cpu_s": usage.ru_utime + usage.ru_stime, "at": time.monotonic(),
                "samples": self.samples, "refused_begun": self.stats.refused_begun}

    def _command(self) -> None:
        command = self.conn.recv()
        if command == "snapshot":
            self.conn.send(self.snapshot())
        elif command == "pause":
            self.beating = False
            self.conn.send(None)
        elif command == "stop":
            self.stopping = True
            for client in self.clients:
                if client.timer is not None:
                    client.timer.cancel()
                if client.transport is not None:
                    client.transport.abort()
            self.loop.remove_reader(self.conn.fileno())
            self.conn.send(self.snapshot())
            self.done.set()


def _process_main(opts: dict[str, Any], first: int, count: int, conn: Any) -> None:
    raise_nofile()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator stops us
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass

    async def main() -> None:
        await ProcessFleet(opts, first, count, conn).run()

    asyncio.run(main())


class Fleet:
    """N clients over ``procs`` processes; ``snapshot`` sums their counters."""

    def __init__(self, url: str, workers: int, *, procs: int = 2, lean: bool = False,
                 token: str | None = None, connect_rate: float = 2000.0,
                 prefix: str = "idle-", sparse: bool = False, free: int = 0) -> None:
        self.workers = workers
        opts = {"url": url, "lean": lean, "sparse": sparse, "free": free, "token": token,
                "connect_rate": connect_rate,
                "procs": procs, "prefix": prefix}
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        per = -(-workers // procs)
        for i in range(procs):
            first, count = i * per, max(0, min(per, workers - i * per))
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_process_main, args=(opts, first, count, child),
                               daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def _ask(self, command: str) -> list[Any]:
        for pipe in self.pipes:
            pipe.send(command)
        return [pipe.recv() for pipe in self.pipes]

    def snapshot(self) -> dict[str, Any]:
        return merge(self._ask("snapshot"))

    def wait_registered(self, timeout: float, count: int | None = None) -> float:
        """Seconds until ``count`` (all) clients hold a welcome; raises on timeout."""
        count = self.workers if count is None else count
        started = time.monotonic()
        while True:
            snap = self.snapshot()
            if snap["registered"] >= count:
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"{snap['registered']} of {count} registered after"
                                   f" {timeout:.0f} s: {snap['counters']}")
            time.sleep(0.05)

    def pause(self) -> None:
        self._ask("pause")

    def close(self) -> dict[str, Any]:
        final = merge(self._ask("stop"))
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        return final

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.close()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()


def merge(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    counters: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    for snap in snaps:
        counters.update(snap["counters"])
        codes.update(snap["close_codes"])
    return {"registered": sum(s["registered"] for s in snaps),
            "connected": sum(s["connected"] for s in snaps),
            "counters": dict(counters), "close_codes": dict(codes),
            "cpu_s": [round(s["cpu_s"], 3) for s in snaps],
            "at": max(s["at"] for s in snaps),
            "samples": [x for s in snaps for x in s["samples"]][:5],
            "refused_begun": [t for s in snaps for t in s.get("refused_begun", [])]}


def window(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """Rates between two snapshots."""
    def per_s(name: str) -> float:
        return round((after["counters"].get(name, 0) - before["counters"].get(name, 0))
                     / seconds, 1)

    diff = {k: after["counters"].get(k, 0) - before["counters"].get(k, 0)
            for k in after["counters"]}
    return {"beats_per_s": per_s("beats"), "frames_in_per_s": per_s("frames_in"),
            "acks_in_per_s": per_s("acks_in"), "closes_in": diff.get("closes_in", 0),
            "client_cpu_percent": [round(100 * (b - a) / seconds, 1)
                                   for a, b in zip(before["cpu_s"], after["cpu_s"])],
            "changed": {k: v for k, v in diff.items() if v and k not in (
                "beats", "frames_in", "acks_in")}}


def failures(counters: dict[str, int]) -> dict[str, int]:
    """Everything that went wrong for the clients, by kind."""
    good = {"beats", "frames_in", "acks_in", "welcomes_in", "handshakes", "registrations",
            "connect_attempts", "other_in"}
    return {k: v for k, v in counters.items() if k not in good and v}


# -- one idle window, and the storm, against a server --------------------------------------
def measure_idle(url: str, workers: int, seconds: float, *, lean: bool = False,
                 procs: int = 2, token: str | None = None, server_pid: int | None = None,
                 settle: float = 3.0, connect_timeout: float = 120.0,
                 log_path: Path | None = None, connect_rate: float = 2000.0,
                 sparse: bool = False, free: int = 0) -> dict[str, Any]:
    """N clients registered and beating: the rates over ``seconds`` after ``settle``, the
    server's CPU (% of one core) and RSS when its pid is given, and the WARNING/ERROR
    lines its log (``log_path``) gained over the window and over the whole run."""
    import psutil

    server = psutil.Process(server_pid) if server_pid else None
    with Fleet(url, workers, procs=procs, lean=lean, token=token,
               connect_rate=connect_rate, sparse=sparse, free=free) as fleet:
        try:
            connect_s: float | None = round(fleet.wait_registered(connect_timeout), 2)
        except TimeoutError:  # measured all the same, with those that got in
            connect_s = None
        time.sleep(settle)
        before = fleet.snapshot()
        log_from = log_path.stat().st_size if log_path else 0
        cpu0 = server.cpu_times() if server else None
        started = time.monotonic()
        time.sleep(seconds)
        after = fleet.snapshot()
        elapsed = time.monotonic() - started
        log_to = log_path.stat().st_size if log_path else 0
        figures: dict[str, Any] = {"workers": workers, "lean": lean, "sparse": sparse,
                                   "free": free,
                                   "connect_all_s": connect_s,
                                   "registered_at_start": before["registered"],
                                   "seconds": round(elapsed, 1)}
        if server is not None:
            cpu1 = server.cpu_times()
            used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
            figures["server_cpu_percent"] = round(100 * used / elapsed, 1)
            figures["server_cpu_user_percent"] = round(100 * (cpu1.user - cpu0.user) / elapsed, 1)
            figures["server_cpu_system_percent"] = round(
                100 * (cpu1.system - cpu0.system) / elapsed, 1)
            figures["server_rss_mib"] = round(server.memory_info().rss / 2**20, 1)
        figures.update(window(before, after, elapsed))
        if server is not None and figures["beats_per_s"]:
            figures["server_cpu_us_per_beat"] = round(
                used / elapsed / figures["beats_per_s"] * 1e6, 1)
        final = fleet.close()
        figures["registered_at_end"] = after["registered"]
        figures["client_failures"] = failures(final["counters"])
        figures["close_codes"] = final["close_codes"]
        if final["samples"]:
            figures["other_frames_sample"] = final["samples"]
    if log_path is not None:
        with log_path.open("rb") as log:
            log.seek(log_from)
            figures["server_log_window"] = log_warnings(log.read(log_to - log_from).decode(
                errors="replace"))
        figures["server_log_whole_run"] = log_warnings(log_path.read_text(errors="replace"))
    figures["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return figures


def log_warnings(text: str) -> dict[str, Any]:
    """WARNING/ERROR lines of a server log, and its "stalled" warnings with their lengths.
    The lines that say how many registrations were not logged are left out: they are the
    log's own rate limit at work, not a fault."""
    every = text.splitlines()
    lines = [line for line in every if "not logged, nor their" not in line
             and "AUTH IS OFF" not in line]
    bad = [line for line in lines if " WARNING " in line or " ERROR " in line
           or "Traceback" in line]
    stalls = [line for line in lines if "stalled for" in line]
    lengths = []
    for line in stalls:
        with contextlib.suppress(ValueError, IndexError):
            lengths.append(float(line.split("stalled for ")[1].split("s")[0]))
    kinds = Counter(_kind(line) for line in bad)
    return {"warning_or_error_lines": len(bad), "stall_warnings": len(stalls),
            "registrations_not_logged_lines": len(every) - len(lines),
            "longest_stall_s": max(lengths, default=0.0), "kinds": dict(kinds.most_common(8)),
            "first_lines": bad[:5]}


def _kind(line: str) -> str:
    """A log line without its time and numbers, to count lines of one kind."""
    text = line.split(" WARNING ", 1)[-1].split(" ERROR ", 1)[-1]
    return "".join("#" if ch.isdigit() else ch for ch in text)[:90]


@contextlib.contextmanager
def storm_server(workers: int) -> Iterator[Any]:
    """A ``rota serve`` rig that can be killed and restarted on its port and database."""
    import shutil
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import throughput as tp

    raise_nofile()
    workdir = Path(tempfile.mkdtemp(prefix="rota-storm-"))
    children = tp.Children()
    try:
        setup = tp.prepare(workdir, 1)
        port = setup.base_url.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "rota", "serve", "--port", port, "--db", str(setup.db),
                "--max-connections", str(workers + 500),
                "--max-worker-connections-per-token", str(workers + 500)]

        class Rig:
            url = setup.base_url.replace("http", "ws", 1) + "/work"

            def start(self, name: str) -> Any:
                child = children.start(name, argv, workdir)
                tp.wait_until("GET /healthz", lambda: tp._healthy(setup.base_url), children,
                              tp.STARTUP_TIMEOUT)
                return child

            def kill(self, child: Any) -> None:
                child.proc.send_signal(signal.SIGKILL)
                child.proc.wait(30)
                children.items.remove(child)
                child.log_file.close()

            def healthy(self) -> bool:
                return tp._healthy(setup.base_url)

            @property
            def argv(self) -> list[str]:
                return argv

            @property
            def children(self) -> Any:
                return children

            @property
            def workdir(self) -> Path:
                return workdir

        yield Rig()
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def storm(workers: int, *, procs: int = 2, lean: bool = False, sparse: bool = False,
          settle: float = 5.0, deadline: float = 90.0, connect_timeout: float = 90.0
          ) -> dict[str, Any]:
    """N registered and beating; SIGKILL the server, start it again, all reconnect."""
    import psutil

    with storm_server(workers) as rig:
        first = rig.start("server")
        with Fleet(rig.url, workers, procs=procs, lean=lean, sparse=sparse) as fleet:
            try:
                connect_s: float | None = round(fleet.wait_registered(connect_timeout), 2)
            except TimeoutError:  # the storm all the same, with those that got in
                connect_s = None
            time.sleep(settle)
            before = fleet.snapshot()
            killed = time.monotonic()
            rig.kill(first)
            # The clients see their connections reset and start knocking at a closed port.
            again = rig.children.start("server-again", rig.argv, rig.workdir)
            up = None
            while up is None:
                if rig.healthy():
                    up = time.monotonic()
                elif time.monotonic() - killed > 120:
                    raise TimeoutError("the restarted server never answered /healthz")
                else:
                    time.sleep(0.02)
            at_healthz = fleet.snapshot()
            server = psutil.Process(again.proc.pid)
            cpu0 = server.cpu_times()
            curve = []
            while True:
                snap = fleet.snapshot()
                now = time.monotonic()
                curve.append((round(now - killed, 2), snap["registered"]))
                if snap["registered"] >= workers or now - killed > deadline:
                    break
                time.sleep(0.1)
            back = now
            all_back = snap["registered"] >= workers
            cpu1 = server.cpu_times()
            time.sleep(settle)  # the beats after the storm: anything still failing?
            after = fleet.snapshot()
            final = fleet.close()
        log = log_warnings(again.log_path.read_text(errors="replace"))
        first_log = log_warnings(first.log_path.read_text(errors="replace"))
    diff = {k: final["counters"].get(k, 0) - before["counters"].get(k, 0)
            for k in final["counters"]}
    return {
        "workers": workers, "lean": lean, "sparse": sparse, "procs": procs,
        "first_connect_all_s": connect_s,
        "registered_before_kill": before["registered"],
        "all_back": all_back,
        "registered_after": snap["registered"],
        "kill_to_healthz_s": round(up - killed, 2),
        "kill_to_all_registered_s": round(back - killed, 2) if all_back else None,
        "healthz_to_all_registered_s": round(back - up, 2) if all_back else None,
        "kill_to_as_many_as_before_s": next(
            (t for t, n in curve if n >= before["registered"]), None),
        "server_cpu_s_during_storm": round((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
                                           2),
        "client_failures_in_storm": failures(diff),
        # once the restarted server answers: a refused connect begun before it is no
        # fault, however late its client read the refusal
        "client_failures_after_healthz": failures({
            k: final["counters"].get(k, 0) - at_healthz["counters"].get(k, 0)
            for k in final["counters"] if k != "refused"}
            | {"refused": sum(t >= up for t in final["refused_begun"])}),
        "close_codes": final["close_codes"],
        "registered_over_time": curve[:: max(1, len(curve) // 40)],
        "server_log_after_restart": log,
        "server_log_before_kill": {k: first_log[k] for k in (
            "warning_or_error_lines", "stall_warnings", "longest_stall_s")},
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", default="ws://127.0.0.1:8000/work")
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--lean", action="store_true", help='register with "lean_acks": true')
    parser.add_argument("--sparse", action="store_true",
                        help='and "idle_ack_interval": 10, as the Python SDK registers')
    parser.add_argument("--free", type=int, default=0,
                        help="free slots each client says it has (an SDK worker waiting"
                             " for work says its concurrency; 0: none, the default)")
    parser.add_argument("--token", default=os.environ.get("ROTA_TOKEN"))
    parser.add_argument("--server-pid", type=int, help="measure this process's CPU and RSS")
    parser.add_argument("--connect-rate", type=float, default=2000.0,
                        help="new connections a second at the start (0: all at once)")
    parser.add_argument("--storm", action="store_true",
                        help="start a server, kill -9 it, restart it, all reconnect")
    opts = parser.parse_args(argv)
    raise_nofile()
    if opts.storm:
        figures = storm(opts.workers, procs=opts.procs, lean=opts.lean, sparse=opts.sparse)
    else:
        figures = measure_idle(opts.url, opts.workers, opts.seconds, lean=opts.lean,
                               sparse=opts.sparse, free=opts.free,
                               procs=opts.procs, token=opts.token, server_pid=opts.server_pid,
                               connect_rate=opts.connect_rate)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
