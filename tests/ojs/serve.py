"""Rota servers for the OJS conformance runner: start them, run a command against them,
stop them, and exit with the command's status.

    tests/ojs/serve.py sqlite -- CMD...   one `rota serve` on SQLite, in a temporary folder
    tests/ojs/serve.py pg2 -- CMD...      a throwaway PostgreSQL (tests/pgserver.py) and
                                          two `rota serve` on it, one cluster

The servers run open on loopback (no token is made: none is needed there) with
--unsafe-test-endpoints, which gives the runner POST /ojs/v1/admin/reset. The command gets
their URLs in $OJS_TEST_URL (comma-separated; tests/ojs/run.py reads it), e.g.

    .venv/bin/python tests/ojs/serve.py sqlite -- .venv/bin/python tests/ojs/run.py \\
        --levels 0-4 --reset-url /ojs/v1/admin/reset --excused tests/ojs/excused.toml

Each server's log is kept in the temporary folder while it runs; its end is printed when
the server fails to start or the command fails. Everything started is stopped by its pid
at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: pgserver.py
KINDS = {"sqlite": "one server on SQLite", "pg2": "two servers on one PostgreSQL"}
START_TIMEOUT = 30.0  # seconds a server has to answer /healthz
STOP_TIMEOUT = 10.0  # seconds it has to stop on SIGTERM, before SIGKILL


class StartFailed(Exception):
    """A server exited, or did not answer, before it was ready."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _environment() -> dict[str, str]:
    """This environment without ROTA_* variables (a ROTA_DB here must not reach a server)."""
    return {key: value for key, value in os.environ.items() if not key.startswith("ROTA_")}


class Servers:
    """The `rota serve` processes started, each with its URL and log."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []

    def start(self, name: str, db: str, *extra: str) -> str:
        """Start one server on ``db`` and wait until it answers; its URL."""
        port = _free_port()
        log = self.root / f"{name}.log"
        command = [sys.executable, "-m", "rota", "serve", "--db", db, "--port", str(port),
                   "--durability", "process", "--unsafe-test-endpoints", *extra]
        with log.open("wb") as sink:
            proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                    env=_environment(), start_new_session=True)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(base_url=url, timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise StartFailed(f"{name} exited with {proc.returncode}:\n{_tail(log)}")
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise StartFailed(f"{name} did not answer /healthz in {START_TIMEOUT:g}"
                                      f" s:\n{_tail(log)}")
                time.sleep(0.1)  # noqa: sleep-ok (polling a starting process)
        self.urls.append(url)
        print(f"serve.py: {name} (pid {proc.pid}) at {url}, log {log}", file=sys.stderr)
        return url

    def stop(self) -> None:
        """Every server, by its pid: SIGTERM, then SIGKILL after STOP_TIMEOUT."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _tail(log: Path, size: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-size:]
    except OSError:
        return "(no log)"


def run(kind: str, command: list[str]) -> int:
    root = Path(tempfile.mkdtemp(prefix="rota-ojs-"))
    servers = Servers(root)
    cluster: Any = None
    try:
        if kind == "sqlite":
            servers.start("rota", str(root / "rota.db"))
        else:
            from pgserver import Cluster

            cluster = Cluster()
            cluster.start()
            database = cluster.create_database()
            for name in ("s1", "s2"):  # one after the other: the first migrates
                servers.start(name, database, "--server-id", name)
        env = {**os.environ, "OJS_TEST_URL": ",".join(servers.urls)}
        print(f"serve.py: OJS_TEST_URL={env['OJS_TEST_URL']}", file=sys.stderr)
        status = subprocess.run(command, env=env).returncode
        if status != 0:  # (the logs go with the folder: their ends are kept in the output)
            for log in sorted(root.glob("*.log")):
                print(f"serve.py: the end of {log.name}:\n{_tail(log)}", file=sys.stderr)
        return status
    except StartFailed as error:
        print(f"serve.py: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        servers.stop()
        if cluster is not None:
            cluster.destroy()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in KINDS or argv[1] != "--":
        kinds = "; ".join(f"{kind}: {said}" for kind, said in KINDS.items())
        print(f"usage: tests/ojs/serve.py {{{','.join(KINDS)}}} -- COMMAND... ({kinds})",
              file=sys.stderr)
        return 2
    return run(argv[0], argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
