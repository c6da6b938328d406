"""Three minimal WebSocket servers side by side: the server's CPU per idle beat.

Run from the repository root (``pip install -e '.[bench]'`` brings picows):

    .venv/bin/python bench/edges.py                    # 10,000 clients x 1 beat/s, each server twice
    .venv/bin/python bench/edges.py --workers 1000 --seconds 5 --rounds 1
    .venv/bin/python bench/edges.py serve picows 8765  # one server alone (to profile it)

Each server answers every text frame with one small constant frame (the first on a
connection a ``{"type":"welcome"}``, then ``{"type":"ack"}``), on uvloop, in a process of
its own; bench/fleet.py's clients (the same load for each: N connections, one beat a
second each, spread over the second) drive it, and the server process's CPU over the
window, divided by the beats the fleet really sent in it, is its cost per beat:

- ``uvicorn``: uvicorn (websockets' sans-I/O protocol, as Rota's edge runs it) and a bare
  ASGI app, a receive/send loop per connection: today's stack shape, without Rota.
- ``sansio``: websockets' sans-I/O ``ServerProtocol`` driven from an ``asyncio.Protocol``
  in ``data_received``: no task per connection or frame.
- ``picows``: picows (Cython) with its ``WSListener`` callbacks; ``picows-small`` the same
  with a first read buffer of 1 KiB per connection instead of 16 KiB (memory).

The servers run in that order, and the whole order again per
``--rounds``, so that a drift in the machine's load shows as a difference between rounds.
Figures go to bench/results/edges.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet  # noqa: E402  (bench/ is not a package)

RESULTS = Path(__file__).resolve().parent / "results" / "edges.json"
IMPLS = ("uvicorn", "sansio", "picows", "picows-small")
WELCOME = b'{"type":"welcome"}'
ACK = b'{"type":"ack"}'
BACKLOG = 4096


# -- the servers --------------------------------------------------------------------------
def serve_uvicorn(port: int) -> None:
    import uvicorn

    welcome, ack = WELCOME.decode(), ACK.decode()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        reply = welcome
        while True:
            message = await receive()
            if message["type"] != "websocket.receive":
                return
            await send({"type": "websocket.send", "text": reply})
            reply = ack

    uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="uvloop", ws="websockets-sansio",
        ws_ping_interval=None, ws_per_message_deflate=False, lifespan="off",
        log_level="warning", access_log=False, backlog=BACKLOG)).run()


class SansIO(asyncio.Protocol):
    """websockets' ServerProtocol fed from data_received; replies written at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        from websockets.server import ServerProtocol

        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.ws = ServerProtocol(max_size=2**20)
        self.reply = WELCOME

    def data_received(self, data: bytes) -> None:
        from websockets.frames import Opcode
        from websockets.http11 import Request

        ws = self.ws
        ws.receive_data(data)
        for event in ws.events_received():
            if isinstance(event, Request):
                ws.send_response(ws.accept(event))
            elif event.opcode is Opcode.TEXT:
                ws.send_text(self.reply)
                self.reply = ACK
        out = ws.data_to_send()
        if out:
            self.transport.write(b"".join(out))
            if out[-1] == b"":  # the protocol's end of stream
                self.transport.close()

    def eof_received(self) -> None:
        self.ws.receive_eof()


def serve_sansio(port: int) -> None:
    import uvloop

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            SansIO, "127.0.0.1", port, backlog=BACKLOG)
        await server.serve_forever()

    uvloop.run(main())


def serve_picows(port: int, read_buffer: int = 16384) -> None:
    import uvloop
    from picows import WSFrame, WSListener, WSMsgType, WSTransport, ws_create_server

    class Listener(WSListener):  # type: ignore[misc]
        def on_ws_connected(self, transport: WSTransport) -> None:
            self.reply = WELCOME

        def on_ws_frame(self, transport: WSTransport, frame: WSFrame) -> None:
            if frame.msg_type == WSMsgType.TEXT:
                transport.send(WSMsgType.TEXT, self.reply)
                self.reply = ACK
            elif frame.msg_type == WSMsgType.CLOSE:
                transport.send_close(frame.get_close_code())
                transport.disconnect()

    async def main() -> None:
        server = await ws_create_server(lambda request: Listener(), "127.0.0.1", port,
                                        backlog=BACKLOG, read_buffer_init_size=read_buffer)
        await server.serve_forever()

    uvloop.run(main())


def serve_picows_small(port: int) -> None:
    """picows with a 1 KiB first read buffer per connection (its default is 16 KiB)."""
    serve_picows(port, read_buffer=1024)


SERVERS = {"uvicorn": serve_uvicorn, "sansio": serve_sansio, "picows": serve_picows,
           "picows-small": serve_picows_small}


# -- the driver ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_listening(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def measure(impl: str, workers: int, seconds: float, procs: int) -> dict[str, Any]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "serve", impl, str(port)],
                            stdin=subprocess.DEVNULL)
    try:
        wait_listening(port, proc)
        figures = fleet.measure_idle(f"ws://127.0.0.1:{port}/work", workers, seconds,
                                     procs=procs, server_pid=proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {"impl": impl, **figures}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("serve", help="run one server in the foreground")
    one.add_argument("impl", choices=IMPLS)
    one.add_argument("port", type=int)
    parser.add_argument("--workers", type=int, default=10000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--procs", type=int, default=2, help="the fleet's processes")
    parser.add_argument("--impl", action="append", choices=IMPLS, help="only these")
    parser.add_argument("--output", type=Path, default=RESULTS)
    opts = parser.parse_args(argv)
    fleet.raise_nofile()
    if opts.command == "serve":
        SERVERS[opts.impl](opts.port)
        return 0
    runs = []
    for round_ in range(opts.rounds):
        for impl in opts.impl or IMPLS:
            figures = measure(impl, opts.workers, opts.seconds, opts.procs)
            figures["round"] = round_ + 1
            runs.append(figures)
            print(f"{impl:12} round {round_ + 1}: {figures['server_cpu_us_per_beat']} µs per beat,"
                  f" {figures['server_cpu_percent']} % of a core (user"
                  f" {figures['server_cpu_user_percent']}, system"
                  f" {figures['server_cpu_system_percent']}), {figures['server_rss_mib']} MiB,"
                  f" {figures['beats_per_s']} beats/s sent, {figures['acks_in_per_s']} acks/s,"
                  f" client CPU {figures['client_cpu_percent']} %, failures"
                  f" {figures['client_failures']}, load {figures['load_average']}", flush=True)
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    opts.output.write_text(json.dumps({
        "workers": opts.workers, "seconds": opts.seconds, "python": sys.version.split()[0],
        "cpus": os.cpu_count(), "runs": runs}, indent=1) + "\n")
    print(f"wrote {opts.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
