"""What the cron tick loop costs with many schedules (issue 24): a round's time, and an idle server's CPU.

Rounds: an in-process server on a fresh SQLite store gets N schedules of one spec; its own
tick loop is stopped and ``Clockwork.round`` is timed twice: with nothing due (N yearly
schedules: what every round pays to look) and with all N due (N per-second schedules,
a tick of each come: the fires of one round). CPU: ``rota serve`` with 1,000 yearly
schedules and one per-second one (which makes the loop go round every second), its CPU
time over ``--seconds`` read from /proc, beside the same server with no schedule.
Figures go to docs/performance.md.

    .venv/bin/python bench/cron_rounds.py [--schedules 1000] [--seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from rota.core.settings import ServerSettings
from rota.server.app import EmbeddedServer, listen_socket, uvicorn_config

SPEC = {"name": "echo", "version": "1", "queue": "default", "args": {}}


async def rounds(count: int) -> dict[str, float]:
    """Milliseconds of one round with ``count`` schedules: nothing due, then all due."""
    with tempfile.TemporaryDirectory() as tmp:
        sock = listen_socket(port=0)
        port = sock.getsockname()[1]
        settings = ServerSettings(db=Path(tmp) / "rota.db", port=port, durability="process")
        server = EmbeddedServer(uvicorn_config(settings, log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.05)
        try:
            coordinator = server.config.loaded_app.app.state.coordinator  # type: ignore
            logging.getLogger("rota").setLevel(logging.ERROR)  # (a line a fire)
            for other in asyncio.all_tasks():  # its own loop stopped: the rounds are ours
                if other.get_name() == "rota-cron":
                    other.cancel()
            work = coordinator.clockwork
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                (await http.put("/specs", json={"specs": [SPEC]})).raise_for_status()
                for n in range(count):
                    (await http.put(f"/schedules/y{n}", json={"spec": "echo",
                                                               "cron": "@yearly"})
                     ).raise_for_status()
                await work.round()  # (the first parses: a server's start)
                idle = await _timed(work.round, 5)
                for n in range(count):
                    (await http.put(f"/schedules/y{n}", json={"spec": "echo", "cron":
                                                               "@every 1s", "overlap": "allow"})
                     ).raise_for_status()
            await work.round()  # (the ticks of the changes above: missed, loop stopped)
            await asyncio.sleep(1.05)  # a tick of each comes
            began = time.perf_counter()
            await work.round()
            firing = (time.perf_counter() - began) * 1000
        finally:
            server.request_exit()
            await task
    return {"idle_round_ms": idle, "firing_round_ms": firing}


async def _timed(call: Any, times: int) -> float:
    """The median milliseconds of ``times`` awaited calls."""
    spans = []
    for _ in range(times):
        began = time.perf_counter()
        await call()
        spans.append((time.perf_counter() - began) * 1000)
    return sorted(spans)[len(spans) // 2]


def idle_cpu(count: int, seconds: float) -> float:
    """Percent of one core a ``rota serve`` uses over ``seconds`` with ``count`` yearly
    schedules and one per-second one (none at all if ``count`` is 0)."""
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "rota", "serve", "--db",
                                 str(Path(tmp) / "rota.db"), "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
                for _ in range(300):
                    try:
                        http.get("/healthz")
                        break
                    except httpx.TransportError:
                        time.sleep(0.1)
                http.put("/specs", json={"specs": [SPEC]}).raise_for_status()
                for n in range(count):
                    http.put(f"/schedules/y{n}", json={"spec": "echo", "cron": "@yearly"}
                             ).raise_for_status()
                if count:
                    http.put("/schedules/beat", json={"spec": "echo", "cron": "@every 1s"}
                             ).raise_for_status()
            time.sleep(2)  # (settled)
            before, began = _cpu(proc.pid), time.monotonic()
            time.sleep(seconds)
            return (_cpu(proc.pid) - before) / (time.monotonic() - began) * 100
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _cpu(pid: int) -> float:
    """Seconds of CPU (user and system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--no-cpu", action="store_true", help="Time the rounds only.")
    options = parser.parse_args()
    for key, value in asyncio.run(rounds(options.schedules)).items():
        print(f"{key} ({options.schedules} schedules): {value:.1f}")
    if not options.no_cpu:
        print(f"idle server CPU, no schedule: {idle_cpu(0, options.seconds):.2f}%")
        print(f"idle server CPU, {options.schedules} schedules + one per second:"
              f" {idle_cpu(options.schedules, options.seconds):.2f}%")


if __name__ == "__main__":
    main()
