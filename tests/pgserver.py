"""A throwaway PostgreSQL for the suite, from the machine's own binaries (Debian's
``postgresql`` package: /usr/lib/postgresql/<version>/bin; scripts/test installs it).

One cluster per test process (each xdist worker starts its own, on a free port, in a
temporary directory), tuned for speed: nothing a test writes needs to survive the
machine, so fsync and synchronous commit are off. Each test gets a fresh database in it
(``create_database``). Run as root, the cluster belongs to the ``postgres`` user
(PostgreSQL refuses to run as root).

Missing binaries are a failure that says what to install, never a skip: the backend
must be tested wherever the suite runs.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg

USER = "rota"  # the cluster's superuser, trusted on loopback: no password to manage


def find_bin() -> Path:
    """The newest PostgreSQL's bin directory here."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name))
    if not found:
        raise RuntimeError("no PostgreSQL binaries in /usr/lib/postgresql/*/bin: install"
                           " Debian's postgresql package (scripts/test does: apt-get install"
                           " postgresql)")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A PostgreSQL cluster in a temporary directory. ``stop()``/``start()`` take the
    server down and back up on the same port (what the storage-failure tests need).
    ``durable=True`` keeps PostgreSQL's own defaults (fsync, synchronous commit, full
    page writes on): the benchmarks compare it with SQLite at ``synchronous=FULL``, so
    a commit must reach the disk there too."""

    def __init__(self, durable: bool = False) -> None:
        self.bin = find_bin()
        self.durable = durable
        self.root = Path(tempfile.mkdtemp(prefix="rota-pg-"))
        self.data = self.root / "data"
        self.port = 0
        self._names = itertools.count(1)
        self._migrated = False  # the template of create_database(migrated=True) exists
        # PostgreSQL will not run as root: as root, the directory is given to postgres
        # and every command runs as that user.
        self._as: list[str] = []
        if os.geteuid() == 0:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self._as, str(self.bin / tool), *args], capture_output=True,
                              text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stdout}{done.stderr}")

    def start(self) -> None:
        """Start the server (on a new free port the first time, the same one after)."""
        fast = ("" if self.durable else
                " -c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        options = (f"-c listen_addresses=127.0.0.1{fast} -c max_connections=200"
                   f" -k {self.root} -p {{port}}")
        for attempt in range(5):  # another process may take a free port before we do
            port = self.port or _free_port()
            try:
                self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"),
                          "-w", "-t", "30", "-o", options.format(port=port), "start")
            except RuntimeError:
                if self.port or attempt == 4:
                    raise RuntimeError(f"PostgreSQL did not start: {self.log()}") from None
                continue
            self.port = port
            return

    def stop(self) -> None:
        """Stop the server at once (fast: clients are disconnected, as by a crash of it)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def log(self) -> str:
        try:
            return (self.root / "log").read_text()[-2000:]
        except OSError:
            return "(no log)"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, *, migrated: bool = False) -> str:
        """A fresh database, empty or (``migrated``) with Rota's schema already in it; its
        URL. A migrated one is a copy of a template migrated once per cluster: copying
        costs a test less than migrating (about 0.2 s against 0.4 s here)."""
        name = f"t{os.getpid()}_{next(self._names)}"
        template = self._template() if migrated else "template1"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        return self.url(name)

    def _template(self) -> str:
        if not self._migrated:
            from rota.store import pg  # (the suite's own store code: migrated as Rota does it)

            with psycopg.connect(self.url(), autocommit=True) as conn:
                conn.execute('CREATE DATABASE "rota_template"')
            pg.migrate(self.url("rota_template"))
            self._migrated = True
        return "rota_template"

    def destroy(self) -> None:
        try:
            self.stop()
        except RuntimeError:
            pass  # it was down already
        shutil.rmtree(self.root, ignore_errors=True)
