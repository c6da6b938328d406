"""``rota demo``: a server, the demo specs pushed, a worker, and a stream of jobs.

Everything a real deployment has, in one process so that one command shows it:
the producer talks HTTP to the server and the worker talks to /work, as they would
from other machines.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import socket
from pathlib import Path
from typing import Any

import httpx
import msgspec

from rota.base.ids import ws_url
from rota.server.app import EmbeddedServer, listen_socket, uvicorn_config
from rota.core.settings import ServerSettings
from rota.base.specs import load_dir
from rota.worker.worker import JobContext, Worker

log = logging.getLogger("rota.demo")


class TemporaryFailure(Exception):
    """A failure the demo email job raises now and then, to show failed results."""


def build_worker(url: str, specs_dir: Path) -> Worker:
    # The demo handles its own signals: Ctrl-C stops producer, worker and server in turn.
    worker = Worker(url=url, specs_dir=specs_dir, concurrency=4, labels=["demo"],
                    handle_signals=False)

    @worker.handler("echo")
    async def echo(ctx: JobContext) -> dict[str, Any]:
        return {"message": ctx.args["message"]}

    @worker.handler("resize_image")
    async def resize_image(ctx: JobContext) -> dict[str, Any]:
        await asyncio.sleep(random.uniform(0.05, 0.4))  # stands in for real work
        return {"url": ctx.args["url"], "width": ctx.args["width"]}

    @worker.handler("send_email")
    def send_email(ctx: JobContext) -> dict[str, Any]:  # sync handlers run in a thread
        if random.random() < 0.1:
            raise TemporaryFailure(f"mail server busy for {ctx.args['to']}")
        return {"delivered_to": ctx.args["to"]}

    return worker


def demo_job(n: int) -> dict[str, Any]:
    choice = n % 3
    if choice == 0:
        return {"spec": "echo", "args": {"message": f"hello #{n}"}}
    if choice == 1:
        return {"spec": "resize_image",
                "args": {"url": f"https://example.com/{n}.png", "width": 320}}
    return {"spec": "send_email", "args": {"to": f"user{n}@example.com", "template": "welcome"}}


async def produce(base: str, rate: float, stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(base_url=base) as client:
        n = 0
        while not stop.is_set():
            response = await client.post("/jobs", json=demo_job(n))
            response.raise_for_status()
            n += 1
            try:
                await asyncio.wait_for(stop.wait(), timeout=1 / rate)
            except TimeoutError:
                pass


async def run_demo(*, port: int, db: Path, specs_dir: Path, rate: float,
                   sock: socket.socket | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sock = sock or listen_socket("127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    server = EmbeddedServer(uvicorn_config(ServerSettings(db=db, port=port)))
    server_task = asyncio.create_task(server.serve(sockets=[sock]), name="demo-server")
    while not server.started:
        if server_task.done():
            return server_task.result()
        await asyncio.sleep(0.01)
    specs = load_dir(specs_dir)
    async with httpx.AsyncClient(base_url=base) as client:
        body = {"specs": [msgspec.to_builtins(s) for s in specs]}
        (await client.put("/specs", json=body)).raise_for_status()
    log.info("demo server at %s (the dashboard: %s/ui), db %s; %d specs pushed; Ctrl-C stops",
             base, base, db, len(specs))
    worker = build_worker(ws_url(base), specs_dir)
    worker_task = asyncio.create_task(worker.run(), name="demo-worker")
    producer = asyncio.create_task(produce(base, rate, stop), name="demo-producer")
    await stop.wait()
    log.info("stopping: the worker finishes its jobs, then the server shuts down")
    await producer
    worker.stop()
    await worker_task
    server.request_exit()
    await server_task
