"""A throwaway PostgreSQL for the suite, from the machine's own binaries (Debian's
``postgresql`` package: /usr/lib/postgresql/<version>/bin; scripts/test installs it).

One cluster per test process (each xdist worker starts its own, on a free port, in a
temporary directory), tuned for speed: nothing a test writes needs to survive the
machine, so fsync and synchronous commit are off. Each test gets a fresh database in it
(``create_database``). Run as root, the cluster belongs to the ``postgres`` user
(PostgreSQL refuses to run as root).

A test's database is given back when it ends (``give_back``) and, emptied and renamed,
handed to a later test of the same process: ``CREATE DATABASE`` copies the template's
catalogs and cost about 0.22 s of PostgreSQL's CPU a test here, about 30 s a suite;
taking one back costs about 30 ms of wall time and of PostgreSQL's CPU. A database is
only taken back if nothing is connected to it and its objects are exactly those of a
new one (empty, or Rota's schema); anything else a test left (a table or trigger of its
own, a setting, a server still running) keeps it out of use.

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
import time
from pathlib import Path
from typing import Any

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
        # Databases given back and emptied, by kind (migrated or not), and what each kind
        # holds when new: its objects' fingerprint, and the rows its tables start with.
        self._spare: dict[bool, list[str]] = {False: [], True: []}
        self._shape: dict[bool, str] = {}
        self._seed: dict[str, list[tuple[Any, ...]]] = {}
        self._sequences: list[tuple[str, int, int | None]] = []
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

    def hold_commits(self, held: bool) -> None:
        """With ``held``, every commit made with synchronous_commit on (Rota's writer at
        --durability full) writes its record, then waits for a standby that does not
        exist; without, none waits, and those waiting go on. Returns once a new session
        reads the setting (a reload is a signal). A test that holds them puts it back
        however it ends: the cluster is its worker's."""
        value = "rota_test_no_such_standby" if held else ""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = %s"
                         % ("'rota_test_no_such_standby'" if held else "''"))
            conn.execute("SELECT pg_reload_conf()")
        for _ in range(500):
            with psycopg.connect(self.url(), autocommit=True) as conn:
                if conn.execute("SHOW synchronous_standby_names").fetchone() == (value,):
                    return
            time.sleep(0.01)  # noqa: sleep-ok (a poll step, 5 s at most)
        raise RuntimeError("PostgreSQL did not take synchronous_standby_names")

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
        if self._spare[migrated]:
            return self.url(self._spare[migrated].pop())
        name = f"t{os.getpid()}_{next(self._names)}"
        template = self._template() if migrated else "template1"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
        if migrated not in self._shape:
            with psycopg.connect(self.url(name), autocommit=True) as conn:
                self._shape[migrated] = _fingerprint(conn)
        return self.url(name)

    def give_back(self, url: str) -> None:
        """Take a test's database back for a later test, emptied, if it can be: nothing
        connected to it, and no object in it but those of a new database of its kind."""
        name = url.rsplit("/", 1)[1]
        try:
            if not self._unused(name):
                return
            with psycopg.connect(url, autocommit=True) as conn:
                shape = _fingerprint(conn)
                kind = next((m for m in (True, False) if self._shape.get(m) == shape), None)
                if kind is None:
                    return
                self._empty(conn, kind)
            # A new name: PostgreSQL renames no database anyone is connected to, so a
            # client that came meanwhile keeps it out of use, and one that comes later
            # with the old name finds no database, not a later test's.
            fresh = f"t{os.getpid()}_{next(self._names)}"
            with psycopg.connect(self.url(), autocommit=True) as conn:
                conn.execute(f'ALTER DATABASE "{name}" RENAME TO "{fresh}"')
            self._spare[kind].append(fresh)
        except psycopg.Error:
            return  # (in use, or the cluster is down): the database is not used again

    def _unused(self, name: str) -> bool:
        """Whether no session is connected to ``name``; a server stopped at the end of a
        test closes its connections, and their backends end a moment later."""
        with psycopg.connect(self.url(), autocommit=True) as conn:
            for _ in range(50):
                if conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s"
                                " AND backend_type = 'client backend'", (name,)).fetchone() == (0,):
                    return True
                time.sleep(0.01)  # noqa: sleep-ok (a poll step, 0.5 s at most)
        return False

    def _empty(self, conn: psycopg.Connection[Any], migrated: bool) -> None:
        """Every table's rows deleted and a new one's put back (the migrations' names,
        the schema's own meta rows), and every sequence where a new one's is (an
        identity column's next value), in one transaction."""
        with conn.transaction():
            for table in _tables(conn):
                conn.execute(f'DELETE FROM "{table}"')
            for table, rows in (self._seed if migrated else {}).items():
                if rows:
                    marks = ", ".join(["%s"] * len(rows[0]))
                    conn.cursor().executemany(f'INSERT INTO "{table}" VALUES ({marks})', rows)
            for sequence, start, last in (self._sequences if migrated else []):
                conn.execute("SELECT setval(%s, %s, %s)",
                             (f'public."{sequence}"', start if last is None else last,
                              last is not None))

    def _template(self) -> str:
        if not self._migrated:
            from rota.store import pg  # (the suite's own store code: migrated as Rota does it)

            with psycopg.connect(self.url(), autocommit=True) as conn:
                conn.execute('CREATE DATABASE "rota_template"')
            pg.migrate(self.url("rota_template"))
            with psycopg.connect(self.url("rota_template")) as conn:
                self._seed = {table: conn.execute(f'SELECT * FROM "{table}"').fetchall()
                              for table in _tables(conn)}
                self._sequences = conn.execute(
                    "SELECT sequencename, start_value, last_value FROM pg_sequences"
                    " WHERE schemaname = 'public'").fetchall()
            self._migrated = True
        return "rota_template"

    def destroy(self) -> None:
        try:
            self.stop()
        except RuntimeError:
            pass  # it was down already
        shutil.rmtree(self.root, ignore_errors=True)


def _tables(conn: psycopg.Connection[Any]) -> list[str]:
    return [row[0] for row in conn.execute(
        "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename")]


def _fingerprint(conn: psycopg.Connection[Any]) -> str:
    """The objects of a database outside PostgreSQL's own schemas, as one text to
    compare: its schemas, tables, indexes, columns, functions (and their code),
    constraints, triggers, policies, grants, types, and its own settings."""
    parts = [conn.execute(sql).fetchall() for sql in (
        "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%'"
        " AND nspname <> 'information_schema' ORDER BY 1",
        "SELECT n.nspname, c.relname, c.relkind FROM pg_class c JOIN pg_namespace n"
        " ON n.oid = c.relnamespace WHERE n.nspname NOT LIKE 'pg\\_%'"
        " AND n.nspname <> 'information_schema' ORDER BY 1, 2",
        "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1",
        "SELECT table_name, column_name, data_type, column_default, is_nullable"
        " FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2",
        "SELECT p.proname, md5(p.prosrc), p.proconfig FROM pg_proc p JOIN pg_namespace n"
        " ON n.oid = p.pronamespace WHERE n.nspname = 'public' ORDER BY 1, 2",
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)"
        " FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2",
        "SELECT tgrelid::regclass::text, tgname, tgenabled FROM pg_trigger"
        " WHERE NOT tgisinternal ORDER BY 1, 2",
        "SELECT polrelid::regclass::text, polname FROM pg_policy ORDER BY 1, 2",
        "SELECT relname, relrowsecurity, relacl::text FROM pg_class"
        " WHERE relnamespace = 'public'::regnamespace ORDER BY 1",
        "SELECT setconfig FROM pg_db_role_setting"
        " WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())",
        "SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace"
        " WHERE n.nspname = 'public' ORDER BY 1",
    )]
    return repr(parts)
