"""SQLite plumbing: the schema, one writer thread with group commit, a pool of readers.

Nothing here runs on the event loop. ``Writer.submit`` hands a function to the writer
thread and returns an asyncio future; the writer runs everything that has queued up
in one ``BEGIN IMMEDIATE`` transaction (a savepoint per function, so one failing
function does not undo the others) and resolves the futures only after COMMIT.

A disk that is full, read-only or failing is an expected fault: its SQLite errors
become ``StorageError`` (``storage_error``), and ``Health`` says whether the store is
degraded and notices when it recovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from rota.errors import RotaError, StorageError

T = TypeVar("T")
log = logging.getLogger("rota.server")
Op = Callable[[sqlite3.Connection], Any]

MAX_BATCH = 512
# Times a writer's transaction runs before its failure is the callers': more than one
# only where another process's transactions can collide with it (rota/pg.py).
TRANSACTION_ATTEMPTS = 5
CHECKPOINT_EVERY = 0.5  # seconds between background WAL checkpoints
migrations = sqlite_utils.Migrations("rota")


@migrations()
def m001_initial(db: sqlite_utils.Database) -> None:
    db["jobs"].create(
        {
            "id": str,
            "spec": str,
            "queue": str,
            "args": str,
            "priority": int,
            "state": str,
            "attempt": int,
            "worker_id": str,
            "checksum": str,
            "visibility_timeout": float,
            "enqueued_at": float,
            "reserved_at": float,
            "finished_at": float,
            "result": str,
            "errors": str,
        },
        pk="id",
        not_null={"spec", "queue", "args", "priority", "state", "attempt", "enqueued_at"},
        defaults={"attempt": 0, "errors": "[]"},
    )
    db["jobs"].create_index(["state", "queue"])
    db["spec_versions"].create(
        {"name": str, "checksum": str, "version": str, "body": str, "first_pushed_at": float},
        pk=("name", "checksum"),
    )
    db["status_quo"].create({"name": str, "checksum": str, "updated_at": float}, pk="name")
    db["spec_pushes"].create(
        {"id": int, "name": str, "checksum": str, "previous": str, "pushed_at": float}, pk="id"
    )
    db["spec_pushes"].create_index(["name"])
    db["workers"].create(
        {
            "id": str,
            "hostname": str,
            "pid": int,
            "queues": str,
            "labels": str,
            "concurrency": int,
            "specs": str,
            "connected_at": float,
            "disconnected_at": float,
        },
        pk="id",
    )


@migrations()
def m002_lifecycle(db: sqlite_utils.Database) -> None:
    jobs = db["jobs"]
    for name, kind in (("run_at", float), ("lease_expires_at", float), ("expires_at", float),
                       ("max_attempts", int), ("max_fails", int), ("backoff_base", float),
                       ("backoff_max", float)):
        jobs.add_column(name, kind)
    for name in ("fails", "budget_start", "cancel_requested"):
        jobs.add_column(name, int, not_null_default=0)


@migrations()
def m003_failed_is_discarded(db: sqlite_utils.Database) -> None:
    # Before retries existed a failed job was final; "discarded" is that state now.
    db.execute("UPDATE jobs SET state = 'discarded' WHERE state = 'failed'")


@migrations()
def m004_live_status(db: sqlite_utils.Database) -> None:
    jobs = db["jobs"]
    jobs.add_column("capture_logs", int, not_null_default=0)
    for name, kind in (("progress_percent", float), ("progress_message", str),
                       ("progress_at", float)):
        jobs.add_column(name, kind)
    # Log lines (when the job asked for capture_logs) and alerts, one row each.
    db["job_logs"].create({"id": int, "job_id": str, "attempt": int, "at": float, "kind": str,
                           "level": str, "message": str}, pk="id")
    db["job_logs"].create_index(["job_id", "id"])


@migrations()
def m005_tokens(db: sqlite_utils.Database) -> None:
    # Only a hash of each token's secret is kept (rota/auth.py).
    db["tokens"].create({"id": str, "name": str, "scope": str, "queues": str, "hash": str,
                         "created_at": float, "revoked_at": float}, pk="id")
    db["jobs"].add_column("created_by", str)  # the token that enqueued it


@migrations()
def m006_poison(db: sqlite_utils.Database) -> None:
    # Attempts in a row that ended in worker_death, and how many make a job poison.
    db["jobs"].add_column("deaths", int, not_null_default=0)
    db["jobs"].add_column("max_worker_deaths", int)


@migrations()
def m007_storage_probe(db: sqlite_utils.Database) -> None:
    # One row the writer rewrites while the store is degraded, to see whether writes
    # work again when no other write comes (Writer._probe).
    db["storage_probe"].create({"id": int, "at": float}, pk="id")


@migrations()
def m008_retention(db: sqlite_utils.Database) -> None:
    # Finished jobs are pruned oldest first by state (rota/retention.py): an index on
    # (state, finished_at) finds a batch without scanning the table.
    db["jobs"].create_index(["state", "finished_at"])


@migrations()
def m009_retired_specs(db: sqlite_utils.Database) -> None:
    # A retired spec keeps its status quo (waiting jobs still run on matching workers)
    # but takes no new jobs; its history records the retirement ("retire").
    db["status_quo"].add_column("retired_at", float)
    db["spec_pushes"].add_column("event", str, not_null_default="push")


@migrations()
def m010_meta(db: sqlite_utils.Database) -> None:
    # Which Rota last migrated the file: an older one refusing it can name both versions.
    db["meta"].create({"key": str, "value": str}, pk="key")


@migrations()
def m011_operator(db: sqlite_utils.Database) -> None:
    # Paused queues (POST /queues/{name}/pause): a restart keeps them paused.
    db["queues"].create({"name": str, "paused": int, "updated_at": float}, pk="name")
    # GET /jobs, newest first, with 1,000,000 jobs (rota/lookup.py): one walk per state
    # in row id order (every index ends with the row id); (state, queue) is m001's.
    # Partial: every job is inserted available and reserved active, so leaving those
    # two states out spares an enqueue and a reservation every write to them
    # (bench/listing.py --index-cost, docs/performance.md).
    cold = "state NOT IN ('available', 'active')"
    db.execute(f"CREATE INDEX idx_jobs_state ON jobs (state) WHERE {cold}")
    db.execute(f"CREATE INDEX idx_jobs_state_spec ON jobs (state, spec) WHERE {cold}")
    db.execute("CREATE INDEX idx_jobs_state_worker ON jobs (state, worker_id)"
               f" WHERE {cold} AND worker_id IS NOT NULL")


@migrations()
def m012_servers(db: sqlite_utils.Database) -> None:
    # Several Rota servers on one PostgreSQL (docs/scaling.md): the server whose worker
    # holds a job's reservation, and each server's lease. SQLite has one server, but the
    # schema is one description (rota/schema.py) for both stores.
    db["jobs"].add_column("server_id", str)
    db["servers"].create({"id": str, "host": str, "pid": int, "url": str, "started_at": float,
                          "lease_expires_at": float, "stopped_at": float}, pk="id")


@migrations()
def m013_worker_token(db: sqlite_utils.Database) -> None:
    # The id of the token the holding worker connected with: only a worker with that
    # token may reclaim the job, after a lost connection, a restart, or on another server
    # (docs/protocol.md, §2). NULL: reserved by a worker without a token.
    db["jobs"].add_column("worker_token", str)


# -- a full or failing disk ------------------------------------------------------------
# SQLite's primary result codes that blame the storage rather than the statement: what
# the client is told (code, sentence) and how many seconds it should wait before asking
# again (HTTP Retry-After). The waits stay below RECOVER_AFTER, so that producers that
# honour them keep a degraded store's state steady rather than letting it seem to
# recover between two attempts.
STORAGE_ERRORS: dict[str, tuple[str, str, int]] = {
    "SQLITE_FULL": ("storage_full", "the database or its disk is full", 3),
    "SQLITE_READONLY": ("storage_read_only", "the database file cannot be written", 3),
    "SQLITE_IOERR": ("storage_io_error", "the disk failed a read or a write", 3),
    "SQLITE_CANTOPEN": ("storage_io_error", "a database file could not be opened", 3),
    "SQLITE_BUSY": ("storage_busy", "the database is locked by another process", 1),
    "SQLITE_LOCKED": ("storage_busy", "the database is locked by another process", 1),
    "SQLITE_CORRUPT": ("storage_corrupt", "the database file is damaged", 3),
    "SQLITE_NOTADB": ("storage_corrupt", "the database file is not an SQLite database", 3),
}
RECOVER_AFTER = 5.0  # seconds with no storage failure before a good write means recovery
PROBE_EVERY = 1.0  # seconds between the writer's probe writes while degraded and idle
# Bytes of a --max-db-size quota kept free for each job not yet finished, so that the
# jobs accepted can still be reserved and finish once new ones are refused: measured, a
# reservation and a small result grow a job's row by about 170 bytes, and page splits
# can double that.
ROOM_PER_JOB = 1024


def classify(errorname: str | None) -> tuple[str, str, int] | None:
    """What an SQLite error name means for clients, or None if the storage is not at
    fault (a constraint, a bug). Names are a primary code with an optional extended
    part: ``SQLITE_IOERR_WRITE`` is an ``SQLITE_IOERR``."""
    for primary, meaning in STORAGE_ERRORS.items():
        if errorname is not None and (errorname == primary or
                                      errorname.startswith(primary + "_")):
            return meaning
    return None


def storage_error(exc: BaseException) -> StorageError | None:
    """``exc`` as a StorageError (with ``exc`` as its cause) if it blames the storage."""
    if isinstance(exc, StorageError):
        return exc
    name = getattr(exc, "sqlite_errorname", None) if isinstance(exc, sqlite3.Error) else None
    meaning = classify(name)
    if meaning is None:
        return None
    code, sentence, retry_after = meaning
    error = StorageError(code, f"{sentence} ({name})", retry_after)
    error.__cause__ = exc
    return error


def has_room(quota: int, used: int, live: int, new: list[int]) -> bool:
    """Whether jobs whose args take ``new`` bytes each may be enqueued into a database
    of ``used`` bytes under a quota of ``quota`` bytes while ``live`` jobs are not yet
    finished: each new job takes its args and ROOM_PER_JOB, and every live job keeps
    ROOM_PER_JOB for its run."""
    return used + sum(new) + (live + len(new)) * ROOM_PER_JOB <= quota


def quota_full(quota: int) -> StorageError:
    return StorageError("storage_full", f"the database is at its quota (--max-db-size"
                        f" {quota} bytes); the room left is kept for the jobs accepted",
                        STORAGE_ERRORS["SQLITE_FULL"][2])


def used_bytes(conn: sqlite3.Connection) -> int:
    """What the database's pages in use take (free pages are room)."""
    row = conn.execute("SELECT (page_count - freelist_count) * page_size FROM"
                       " pragma_page_count(), pragma_freelist_count(), pragma_page_size()"
                       ).fetchone()
    return int(row[0])


def rowcounts(conn: Any, sql: str, rows: list[tuple[Any, ...]]) -> list[int]:
    """Run ``sql`` once per parameter row and say how many rows each run changed: a
    fenced write (``UPDATE ... WHERE id = ? AND attempt = ?``) learns which rows refused
    it, which ``executemany``'s one total cannot say. rota/pg.py's connection pipelines
    the statements; sqlite3 runs them one by one (its statement cache makes that about
    as fast as executemany)."""
    if isinstance(conn, sqlite3.Connection):
        return [conn.execute(sql, row).rowcount for row in rows]
    return list(conn.rowcounts(sql, rows))


@dataclass(frozen=True, slots=True)
class Degraded:
    code: str
    message: str
    since: float  # wall-clock time the store became degraded


class Health:
    """Whether the store can do its work, as its threads find out; thread-safe.

    The first storage failure makes it degraded (one ERROR line; another only if the
    cause changes). A successful write (a commit, or the writer's probe) ends it once
    ``hold`` seconds have passed without a failure (one WARNING line). The wait is
    there because a failing disk often fails only some writes (a small commit fits in
    the WAL's old space where a large one does not), and a state that flipped with every
    commit would tell an operator nothing.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, hold: float = RECOVER_AFTER) -> None:
        self._clock = clock
        self._wall = wall
        self._hold = hold
        self._lock = threading.Lock()
        self.degraded: Degraded | None = None
        self._last_failure = 0.0
        self._failures = 0  # since it became degraded

    def failed(self, error: StorageError) -> StorageError:
        """Record a failure; returns ``error``, for ``raise health.failed(...)``."""
        with self._lock:
            self._last_failure = self._clock()
            self._failures += 1
            was = self.degraded
            if was is not None and was.code == error.code:
                return error
            self.degraded = Degraded(error.code, error.message,
                                     was.since if was is not None else self._wall())
        log.error("storage degraded code=%s: %s%s; refused with 503 until it recovers",
                  error.code, error.message, f" (was {was.code})" if was is not None else "")
        return error

    def succeeded(self) -> None:
        """A write went through."""
        if self.degraded is None:  # the common case, without the lock
            return
        with self._lock:
            was, failures = self.degraded, self._failures
            if was is None or self._clock() - self._last_failure < self._hold:
                return
            self.degraded, self._failures = None, 0
        log.warning("storage recovered code=%s after %.1fs failed_operations=%d", was.code,
                    self._wall() - was.since, failures)


# What a commit survives (``rota serve --durability``): "full" fsyncs every commit, so an
# acknowledged write survives power loss; "process" lets the OS write it back later, so it
# survives a crash of Rota but the last commits may be lost if the machine or its power
# fails. Either way a commit is atomic and the file stays consistent (WAL).
SYNCHRONOUS = {"full": "FULL", "process": "NORMAL"}


def connect(path: Path, *, readonly: bool = False, durability: str = "full"
            ) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA busy_timeout = 5000")
        conn.execute("PRAGMA foreign_keys = ON")
        if not readonly:  # (a file that is not a database fails here)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute(f"PRAGMA synchronous = {SYNCHRONOUS[durability]}")
        else:
            conn.execute("PRAGMA query_only = ON")
    except BaseException:
        conn.close()
        raise
    return conn


def migrate(path: Path) -> None:
    conn = connect(path)
    try:
        database = sqlite_utils.Database(conn)
        known = _known_migrations()
        unknown = [m.name for m in migrations.applied(database) if m.name not in known]
        if unknown:  # its schema may mean what this Rota cannot read, or would undo
            by = database.execute("SELECT value FROM meta WHERE key = 'migrated_by'"
                                  ).fetchone() if database["meta"].exists() else None
            raise NewerDatabase(path, unknown, _version(), by[0] if by else None)
        if migrations.pending(database):
            migrations.apply(database)
            with conn:
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES"
                             " ('migrated_by', ?)", (_version(),))
    finally:
        conn.close()


@functools.cache
def _known_migrations() -> frozenset[str]:
    """Every migration this Rota has: what an empty database would still need."""
    empty = sqlite_utils.Database(memory=True)
    try:
        return frozenset(m.name for m in migrations.pending(empty))
    finally:
        empty.close()


def _version() -> str:
    try:
        return importlib.metadata.version("rota")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class NewerDatabase(RotaError):
    """The database (a file, or a PostgreSQL URL) was migrated by a newer Rota: this one
    refuses to open it."""

    def __init__(self, path: Path | str, unknown: list[str], version: str, by: str | None
                 ) -> None:
        writer = f"Rota {by}" if by else "a newer Rota"
        super().__init__("newer_database", f"{path} was written by {writer}, and this is"
                         f" Rota {version}: its schema has {', '.join(unknown)}, which this"
                         " version does not know. Upgrade Rota, or use another --db")


class Writer:
    """The only thread that writes; it commits whatever has queued up together."""

    def __init__(self, path: Any, durability: str = "full", health: Health | None = None,
                 max_bytes: int | None = None) -> None:
        self._path = path  # a file here; a URL for rota/pg.py's
        self._durability = durability
        self.health = health or Health()
        self.max_bytes = max_bytes  # --max-db-size: SQLite refuses to grow the file past it
        self.used_bytes = 0  # after the last commit, when there is a quota to compare with
        self._queue: queue.SimpleQueue[tuple[Op, asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rota-writer", daemon=True)
        self._conn: Any = None  # the writer thread's own
        self._loop: asyncio.AbstractEventLoop | None = None
        # Callbacks run the moment their write's transaction settles (see ``on_settle``).
        # Only the loop's thread touches this.
        self._hooks: dict[asyncio.Future[Any], Callable[[asyncio.Future[Any]], None]] = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def submit(self, op: Op) -> asyncio.Future[Any]:
        assert self._loop is not None, "Writer.start() first"
        future: asyncio.Future[Any] = self._loop.create_future()
        self._queue.put((op, future))
        return future

    def on_settle(self, future: asyncio.Future[Any],
                  callback: Callable[[asyncio.Future[Any]], None]) -> None:
        """Call ``callback(future)`` as soon as the transaction that carried ``future``'s
        write settles, before any task awaiting a write of the same transaction resumes.
        A done-callback would queue behind those tasks: an ``assign`` released by a
        reservation's commit would then wait while the HTTP answer of the enqueue that
        shared the commit is built and sent (about 0.25 ms on the idle path)."""
        self._hooks[future] = callback

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    # -- what a backend provides (rota/pg.py's Writer: PostgreSQL) ----------------
    def _open(self) -> Any:
        """A new connection of the writer's, ready for work."""
        conn = connect(self._path, durability=self._durability)
        try:
            # Checkpoints belong to the Checkpointer thread: run inline they would fsync the
            # whole database inside some unlucky commit and stall every caller behind it.
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            if self.max_bytes is not None:
                # A hard limit: a write that needs a page past it fails with SQLITE_FULL,
                # storage_full. (Below the file's size, SQLite keeps the size.)
                page_size = conn.execute("PRAGMA page_size").fetchone()[0]
                conn.execute(f"PRAGMA max_page_count = {max(1, self.max_bytes // page_size)}")
                self.used_bytes = used_bytes(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _usable(self, conn: Any) -> bool:
        """Whether ``conn`` can still be used (an SQLite file's always can)."""
        return True

    def _classify(self, exc: BaseException) -> StorageError | None:
        return storage_error(exc)

    def _measure(self, conn: Any) -> int:
        return used_bytes(conn)

    def _connection(self) -> Any:
        """The writer's connection, opened again if the last one broke (a database
        server that went away); what fails to open raises."""
        if self._conn is not None and not self._usable(self._conn):
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None
        if self._conn is None:
            self._conn = self._open()
        return self._conn

    def _run(self) -> None:
        try:
            try:
                self._connection()
            except Exception as exc:  # the storage's fault: degraded, opened again later
                if (failure := self._classify(exc)) is None:
                    raise
                self.health.failed(failure)
            while True:
                try:
                    first = self._queue.get(timeout=PROBE_EVERY)
                except queue.Empty:
                    # Idle. If a failure (here, or a reader's or the checkpointer's) left
                    # the store degraded, only a write tells whether writes work again.
                    if self.health.degraded is not None:
                        self._probe()
                    continue
                if first is None:
                    return
                batch = [first]
                stopping = self._drain_into(batch)
                self._commit(batch)
                if stopping:
                    return
        finally:
            if self._conn is not None:
                self._conn.close()

    def _drain_into(self, batch: list[tuple[Op, asyncio.Future[Any]]]) -> bool:
        while len(batch) < MAX_BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is None:
                return True
            batch.append(item)
        return False

    def _commit(self, batch: list[tuple[Op, asyncio.Future[Any]]]) -> None:
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        conn = None
        for attempt in range(TRANSACTION_ATTEMPTS):
            outcomes = []
            try:
                conn = self._connection()
                _rollback(conn)  # a ROLLBACK that failed last time leaves a transaction open
                conn.execute("BEGIN IMMEDIATE")
                for op, future in batch:
                    outcomes.append((future, *_run_in_savepoint(conn, op, self._classify,
                                                                 self._alone)))
                conn.execute("COMMIT")
            except BaseException as exc:  # the whole transaction is gone
                if conn is not None:
                    _rollback(conn)
                if self._again(exc) and attempt + 1 < TRANSACTION_ATTEMPTS:
                    # Another server's transaction took the same rows in another order
                    # (PostgreSQL broke the deadlock by ending this one): every op of the
                    # batch runs again from the start, in a new transaction.
                    log.info("transaction of %d write(s) ran into another server's and runs"
                             " again (attempt %d): %s", len(batch), attempt + 2,
                             str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                    continue
                error: BaseException = exc
                if (failure := self._classify(exc)) is not None:
                    error = self.health.failed(failure)
                outcomes = [(future, None, error) for _, future in batch]
            else:
                self.health.succeeded()
                if self.max_bytes is not None:
                    self.used_bytes = self._measure(conn)
            break
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._settle, outcomes)

    def _alone(self, exc: BaseException) -> bool:
        """Whether a storage error fails only the op that met it (rota/pg.py: a lock
        held past lock_timeout), its savepoint rolled back, rather than the whole
        transaction (SQLite: never)."""
        return False

    def _again(self, exc: BaseException) -> bool:
        """Whether a failed transaction may simply run again (SQLite: never; its one
        writer has no other to collide with)."""
        return False

    def _settle(self, outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]
                ) -> None:
        for future, value, error in outcomes:
            if not future.done():  # else the caller gave up waiting; the write stands
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(value)
            hook = self._hooks.pop(future, None)
            if hook is not None:
                try:
                    hook(future)
                except Exception:  # one hook's bug must not keep the others' news back
                    log.exception("a commit callback failed")

    def _probe(self) -> None:
        conn = None
        try:
            conn = self._connection()
            _rollback(conn)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT OR REPLACE INTO storage_probe (id, at) VALUES (1, ?)",
                         (time.time(),))
            conn.execute("COMMIT")
        except Exception as exc:
            if conn is not None:
                _rollback(conn)
            if (failure := self._classify(exc)) is None:  # not the disk: say so, go on
                log.warning("storage probe failed: %s", exc)
            else:
                self.health.failed(failure)
        else:
            self.health.succeeded()


class Checkpointer:
    """Copies the WAL back into the database file in the background (PASSIVE: it never
    blocks the writer or readers), so the WAL stays small without stalling commits."""

    def __init__(self, path: Path, interval: float = CHECKPOINT_EVERY,
                 health: Health | None = None) -> None:
        self._path = path
        self._interval = interval
        self._health = health or Health()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rota-checkpoint", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        conn = connect(self._path)
        try:
            while not self._stop.wait(self._interval):
                self._checkpoint(conn, "PASSIVE")
            self._checkpoint(conn, "TRUNCATE")  # leave a tidy file behind
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection, mode: str) -> None:
        # A checkpoint that cannot write (the database file cannot grow) is the first
        # sign of a full disk when the WAL still has room: the store is degraded, and
        # the next tick tries again.
        try:
            conn.execute(f"PRAGMA wal_checkpoint({mode})")
        except sqlite3.Error as exc:
            if (failure := storage_error(exc)) is None:
                raise
            self._health.failed(failure)


def _run_in_savepoint(conn: sqlite3.Connection, op: Op,
                      classify: Callable[[BaseException], StorageError | None],
                      alone: Callable[[BaseException], bool] = lambda exc: False
                      ) -> tuple[Any, BaseException | None]:
    conn.execute("SAVEPOINT op")
    try:
        value = op(conn)
    except Exception as exc:
        failure = classify(exc)
        if failure is not None and alone(exc) and conn.in_transaction:
            conn.execute("ROLLBACK TO op")
            conn.execute("RELEASE op")
            log.warning("a write failed alone, the rest of its transaction goes on: %s",
                        failure.message)
            return None, failure
        if failure is not None or not conn.in_transaction:
            # The storage failed, not this op: SQLite may have rolled the whole
            # transaction back already (it does on a full disk or an I/O error), and
            # the ops after it would hit the same wall. They all fail alike.
            raise
        conn.execute("ROLLBACK TO op")
        conn.execute("RELEASE op")
        return None, exc
    conn.execute("RELEASE op")
    return value, None


def _rollback(conn: sqlite3.Connection) -> None:
    """End the open transaction, if any. After a full disk or an I/O error SQLite has
    usually ended it already; if ROLLBACK itself fails, the next commit tries again."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except Exception as exc:  # (SQLite's, or PostgreSQL's lost connection)
            log.debug("rollback failed: %s", exc)


class Readers:
    """A small pool of read-only connections; WAL lets them read while the writer commits."""

    def __init__(self, path: Any, size: int = 2, health: Health | None = None) -> None:
        self._path = path  # a file here; a URL for rota/pg.py's
        self._health = health or Health()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="rota-reader")
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._call, fn)

    # -- what a backend provides (rota/pg.py's Readers: PostgreSQL) ----------------
    def _open(self) -> Any:
        return connect(self._path, readonly=True)

    def _usable(self, conn: Any) -> bool:
        return True

    def _classify(self, exc: BaseException) -> StorageError | None:
        return storage_error(exc)

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        try:
            conn = getattr(self._local, "conn", None)
            if conn is not None and not self._usable(conn):  # its server went away
                self._local.conn = conn = self._forget(conn)
            if conn is None:
                conn = self._open()
                self._local.conn = conn
                with self._lock:
                    self._conns.append(conn)
            return fn(conn)
        except Exception as exc:
            if (failure := self._classify(exc)) is None:
                raise
            raise self._health.failed(failure) from exc

    def _forget(self, conn: Any) -> None:
        """Close a broken connection and drop it from the pool (a new one is opened at
        this thread's next use, which may fail again while the server is away)."""
        with self._lock:
            self._conns.remove(conn)
        with contextlib.suppress(Exception):
            conn.close()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
