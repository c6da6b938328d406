"""SQLite's one writer thread, with group commit, and the checkpointer.

Nothing here runs on the event loop. ``Writer.submit`` hands a function to the writer
thread and returns an asyncio future; the writer runs everything that has queued up
in one ``BEGIN IMMEDIATE`` transaction (a savepoint per function, so one failing
function does not undo the others) and resolves the futures only after COMMIT. A
storage failure degrades the store (rota/store/health.py); while degraded and idle, the
writer probes whether writes work again. rota/store/pg.py's Writer is this one on PostgreSQL,
where a COMMIT's answer can be lost with its connection: that transaction is in doubt,
and its futures wait until the database says how it ended (``Doubt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rota.store.sqlite import connect, storage_error, used_bytes
from rota.store.health import Health
from rota.base.errors import StorageError

log = logging.getLogger("rota.server")
Op = Callable[[sqlite3.Connection], Any]

MAX_BATCH = 512
# How long a batch of background writes only (a worker's results, a lease's end) waits
# for company before it commits, with --durability full: any other write ends the wait
# at once and joins it, so one commit and one sync carry both. One producer with a worker
# running its jobs then commits about once a job, not twice (docs/performance.md, issue
# 27, twelfth stop). Without a sync to share (--durability process), none waits.
LINGER = 0.0005
# Times a writer's transaction runs before its failure is the callers': more than one
# only where another process's transactions can collide with it (rota/store/pg.py).
TRANSACTION_ATTEMPTS = 5
CHECKPOINT_EVERY = 0.5  # seconds between background WAL checkpoints
PROBE_EVERY = 1.0  # seconds between the writer's probe writes while degraded and idle
Outcome = tuple[asyncio.Future[Any], Any, BaseException | None]
Queued = tuple[Op, asyncio.Future[Any], bool]  # an op, its future, and whether it may linger


@dataclass(slots=True)
class Doubt:
    """A transaction whose COMMIT was sent and whose answer was lost with the connection
    (rota/store/pg.py): it may have taken effect. Its futures wait until the database
    says which (``Writer._resolve``)."""

    xid: Any  # what names the transaction to the database (``Writer._begin``)
    outcomes: list[Outcome]  # what each op returned, to settle with if it committed
    error: BaseException  # what each future gets if it did not

    def failed(self) -> list[Outcome]:
        """Its futures, each with its error."""
        return [(future, None, self.error) for future, _, _ in self.outcomes]


class Writer:
    """The only thread that writes; it commits whatever has queued up together."""

    def __init__(self, path: Any, durability: str = "full", health: Health | None = None,
                 max_bytes: int | None = None) -> None:
        self._path = path  # a file here; a URL for rota/store/pg.py's
        self._durability = durability
        self.health = health or Health()
        self.max_bytes = max_bytes  # --max-db-size: SQLite refuses to grow the file past it
        self.used_bytes = 0  # after the last commit, when there is a quota to compare with
        self._queue: queue.SimpleQueue[Queued | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rota-writer", daemon=True)
        self._conn: Any = None  # the writer thread's own
        self._loop: asyncio.AbstractEventLoop | None = None
        # Callbacks run the moment their write's transaction settles (see ``on_settle``).
        # Only the loop's thread touches this.
        self._hooks: dict[asyncio.Future[Any], Callable[[asyncio.Future[Any]], None]] = {}
        self._doubts: list[Doubt] = []  # the writer thread's own
        self._stopping = threading.Event()  # (``begin_stop``)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def submit(self, op: Op, linger: bool = False) -> asyncio.Future[Any]:
        """Queue ``op`` for the next transaction. ``linger``: a background write, which
        may wait up to LINGER for others to commit with (alone, it waits; a write that
        does not linger ends the wait)."""
        assert self._loop is not None, "Writer.start() first"
        future: asyncio.Future[Any] = self._loop.create_future()
        self._queue.put((op, future, linger))
        return future

    def on_settle(self, future: asyncio.Future[Any],
                  callback: Callable[[asyncio.Future[Any]], None]) -> None:
        """Call ``callback(future)`` as soon as the transaction that carried ``future``'s
        write settles, before any task awaiting a write of the same transaction resumes.
        A done-callback would queue behind those tasks: an ``assign`` released by a
        reservation's commit would then wait while the HTTP answer of the enqueue that
        shared the commit is built and sent (about 0.25 ms on the idle path)."""
        self._hooks[future] = callback

    def begin_stop(self) -> None:
        """The server begins to stop: commits in doubt are not waited for past the next
        try (a request held by one would hold the stop, which waits for requests).
        A no-op write wakes the writer to make that try; with none in doubt, none is
        needed (one that comes later fails at once: the flag is set)."""
        self._stopping.set()
        if self._doubts and self._loop is not None and self._thread.is_alive():
            self.submit(lambda conn: None)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    # -- what a backend provides (rota/store/pg.py's Writer: PostgreSQL) ----------------
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

    def measure(self, conn: Any) -> int:
        """The bytes the database takes, by this backend's measure (pg.Writer: its own)."""
        return used_bytes(conn)

    def _begin(self, conn: Any) -> Any:
        """Open a transaction; what names it, to ask later whether a COMMIT whose answer
        was lost took effect (None here: SQLite's commit is a call in this process, its
        outcome never lost)."""
        conn.execute("BEGIN IMMEDIATE")
        return None

    def _in_doubt(self, conn: Any, exc: BaseException) -> bool:
        """Whether ``exc``, raised by COMMIT, leaves its outcome unknown."""
        return False

    def _fates(self, conn: Any, xids: list[Any]) -> dict[Any, bool | None]:
        """Per transaction named: True committed, False not, None not known yet (its old
        session still carries it out)."""
        raise NotImplementedError

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
                    if self.health.degraded is not None or self._doubts:
                        self._probe()
                    if self._doubts and self._stopping.is_set():
                        self._abandon()
                    continue
                if first is None:
                    return
                batch = [first[:2]]
                stopping, lingers = self._drain_into(batch, first[2])
                if lingers and not stopping and self._durability == "full":
                    stopping = self._linger(batch)
                self._commit(batch)
                if self._doubts and self._stopping.is_set():
                    self._abandon()
                if stopping:
                    return
        finally:
            self._abandon()
            if self._conn is not None:
                self._conn.close()

    def _drain_into(self, batch: list[tuple[Op, asyncio.Future[Any]]], lingers: bool
                    ) -> tuple[bool, bool]:
        """Add what has queued up to ``batch``: whether the writer is to stop, and whether
        every op of the batch may linger (``lingers``: those in it so far may)."""
        while len(batch) < MAX_BATCH:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return False, lingers
            if item is None:
                return True, lingers
            batch.append(item[:2])
            lingers = lingers and item[2]
        return False, False

    def _linger(self, batch: list[tuple[Op, asyncio.Future[Any]]]) -> bool:
        """Wait up to LINGER for more writes to join a batch of background ones; the
        first that may not wait ends it. Returns whether the writer is to stop."""
        deadline = time.monotonic() + LINGER
        while len(batch) < MAX_BATCH and (left := deadline - time.monotonic()) > 0:
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                return False
            if item is None:
                return True
            batch.append(item[:2])
            if not item[2]:
                break
        return self._drain_into(batch, False)[0]

    def _commit(self, batch: list[tuple[Op, asyncio.Future[Any]]]) -> None:
        outcomes: list[Outcome] = []
        conn = None
        for attempt in range(TRANSACTION_ATTEMPTS):
            outcomes = []
            xid, committing = None, False
            try:
                conn = self._connection()
                _rollback(conn)  # a ROLLBACK that failed last time leaves a transaction open
                if self._doubts:  # settled before anything that commits after them
                    self._resolve(conn)
                xid = self._begin(conn)
                # A lone op needs no savepoint (most commits on a quiet server: one
                # enqueue): its failure may take the whole transaction back.
                alone = len(batch) == 1
                for op, future in batch:
                    outcomes.append((future, *_run_op(conn, op, self._classify, self._alone,
                                                      savepoint=not alone)))
                if conn.in_transaction:  # (not when the only op failed and rolled back)
                    committing = True
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
                if committing and xid is not None and self._in_doubt(conn, exc):
                    # The database may have committed it: its callers hear which once
                    # the database answers again, never a failure that was a success.
                    self._doubts.append(Doubt(xid, outcomes, error))
                    log.warning("a commit's answer was lost with the connection (%d"
                                " write(s), transaction %s): they wait until the database"
                                " says whether it took effect", len(batch), xid)
                    return
                outcomes = [(future, None, error) for _, future in batch]
            else:
                self.health.succeeded()
                if self.max_bytes is not None:
                    try:
                        self.used_bytes = self.measure(conn)
                    except Exception as exc:  # (a connection lost after its COMMIT): the
                        # commit stands; the quota is measured again at the next one
                        log.debug("measuring the database failed: %s", exc)
            break
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._settle, outcomes)

    def _resolve(self, conn: Any) -> None:
        """Settle the transactions in doubt, as the database says they ended: with what
        their ops returned, or with their error. While one is still carried out by its
        old session, nothing else may commit before it: this raises storage_busy, and the
        batch that asked fails (the next asks again)."""
        try:
            fates = self._fates(conn, [doubt.xid for doubt in self._doubts])
        except Exception as exc:
            if self._classify(exc) is not None:
                raise  # the database went away again: they wait for the next connection
            # It cannot say (a transaction id it never had: another cluster, a standby
            # promoted without that transaction): failed, as it was reported before.
            log.warning("the database cannot say how %d commit(s) in doubt ended (%s):"
                        " reported as failed", len(self._doubts), exc)
            fates = {doubt.xid: False for doubt in self._doubts}
        settled: list[Outcome] = []
        waiting = []
        for doubt in self._doubts:
            fate = fates.get(doubt.xid)
            if fate is None:
                waiting.append(doubt)
                continue
            log.warning("the commit in doubt (transaction %s, %d write(s)) %s", doubt.xid,
                        len(doubt.outcomes), "took effect" if fate else "did not take effect")
            settled += doubt.outcomes if fate else doubt.failed()
        self._doubts = waiting
        if settled:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._settle, settled)
        if waiting:
            raise StorageError("storage_busy", f"{len(waiting)} commit(s) in doubt still"
                               " carried out by their old session: writes wait for them", 1)

    def _abandon(self) -> None:
        """At stop: the doubts nobody could settle fail (what their callers would have
        heard before doubts were asked about)."""
        if self._doubts and self._loop is not None:
            log.warning("stopping with %d commit(s) in doubt: reported as failed",
                        len(self._doubts))
            self._loop.call_soon_threadsafe(
                self._settle, [outcome for doubt in self._doubts for outcome in doubt.failed()])
        self._doubts = []

    def _alone(self, exc: BaseException) -> bool:
        """Whether a storage error fails only the op that met it (rota/store/pg.py: a lock
        held past lock_timeout), its savepoint rolled back, rather than the whole
        transaction (SQLite: never)."""
        return False

    def _again(self, exc: BaseException) -> bool:
        """Whether a failed transaction may simply run again (SQLite: never; its one
        writer has no other to collide with)."""
        return False

    def _settle(self, outcomes: list[Outcome]) -> None:
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
            if self._doubts:
                self._resolve(conn)
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


def _run_op(conn: sqlite3.Connection, op: Op,
            classify: Callable[[BaseException], StorageError | None],
            alone: Callable[[BaseException], bool] = lambda exc: False, *,
            savepoint: bool = True) -> tuple[Any, BaseException | None]:
    """Run one op of a transaction: its value, or the error that failed it alone, its
    writes undone. ``savepoint``: each op of a group commit runs in one, so that its
    failure leaves the others; a transaction's only op goes without (two statements
    fewer, two round trips on PostgreSQL), its failure rolling the transaction back."""
    if savepoint:
        conn.execute("SAVEPOINT op")
    try:
        value = op(conn)
    except Exception as exc:
        failure = classify(exc)
        if failure is not None and alone(exc) and conn.in_transaction:
            _undo(conn, savepoint)
            log.warning("a write failed alone, the rest of its transaction goes on: %s",
                        failure.message)
            return None, failure
        if failure is not None or not conn.in_transaction:
            # The storage failed, not this op: SQLite may have rolled the whole
            # transaction back already (it does on a full disk or an I/O error), and
            # the ops after it would hit the same wall. They all fail alike.
            raise
        _undo(conn, savepoint)
        return None, exc
    if savepoint:
        conn.execute("RELEASE op")
    return value, None


def _undo(conn: sqlite3.Connection, savepoint: bool) -> None:
    """Take back a failed op's writes: to its savepoint, or the whole transaction."""
    if savepoint:
        conn.execute("ROLLBACK TO op")
        conn.execute("RELEASE op")
    else:
        _rollback(conn)


def _rollback(conn: sqlite3.Connection) -> None:
    """End the open transaction, if any. After a full disk or an I/O error SQLite has
    usually ended it already; if ROLLBACK itself fails, the next commit tries again."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except Exception as exc:  # (SQLite's, or PostgreSQL's lost connection)
            log.debug("rollback failed: %s", exc)

