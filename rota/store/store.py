"""Rota's durable state: jobs, spec versions, the status quo and workers, in one SQLite file
or a PostgreSQL database (``database_url``; rota/store/pg.py runs the same operations there).

Every write goes through the single writer thread (rota/store/writer.py's ``Writer``, ``pg.Writer``): a
write method queues its work (rota/store/writes.py) at once, in call order, and returns a
future that resolves after its COMMIT. Reads run on a reader pool (the API's:
rota/store/reads.py). The in-memory scheduler is rebuilt from ``load()`` at start
(rota/store/rows.py). Tokens: rota/store/tokens.py.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from rota.store import fleet, limits, sqlite
from rota.store.urls import redact
from rota.store import writes as sql  # the writes' SQL and their functions of a connection
from rota.store.health import Health
from rota.store.reading import Reading
from rota.store.flowing import Flowing
from rota.store.ojs_reads import OjsReading
from rota.store.pushes import PushReading
from rota.store.secrets import Secrets
from rota.store import settle
from rota.store.readers import Readers
from rota.store.writer import Checkpointer, Writer
from rota.base.errors import StorageError
from rota.core.effects import Guard, Reserved
from rota.core.model import WAITING_STATES, Change, ClockReading, JobRecord, StatusNote
from rota.base.protocol import Registration
from rota.core.ready import Claim
from rota.core.retention import Cutoff
from rota.store.rows import (Snapshot, claim_rows, job_from_row, live_job, load, read_status_quo,
                             take_over, waiting_rows, worker_row)
from rota.base.specs import JobSpec
from rota.store.tokens import insert_token, open_database, revoke_tokens
from rota.store.writes import SpecChange

# Snapshot, job_from_row: rota/store/rows.py; SpecChange: rota/store/writes.py.
__all__ = ["Store", "Snapshot", "SpecChange", "Change", "JobRecord", "StatusNote", "job_from_row"]

MIN_BOUND = 0.5  # seconds: the least lock and idle-in-transaction bound (rota/store/pg.py)

T = TypeVar("T")


@dataclass(slots=True)
class Store(Reading, Flowing, OjsReading, PushReading, Secrets):
    path: Path
    crash_before_commit: bool = False  # test switch: die inside an enqueue transaction
    durability: str = "full"  # sqlite.SYNCHRONOUS: what a commit survives
    max_db_size: int | None = None  # bytes (--max-db-size); None: as much as the disk holds
    # degraded while the disk fails
    health: Health = field(default_factory=Health)
    # PostgreSQL (rota/store/pg.py) instead of the file at ``path``: the database's URL, and how
    # many reader connections (SQLite's reader pool is that size too).
    database_url: str | None = None
    db_pool: int = 2
    # The server this store writes for: its reservations carry the id. ``shared``: one of
    # several servers on this database (PostgreSQL), which hear of each other's work by
    # the notices its writes send (rota/store/fleet.py).
    server_id: str | None = None
    lease: float = 10.0  # seconds a shared store's server holds its lease (rota/store/fleet.py)
    # Test switch: hold each reservation's transaction open this long after its UPDATE,
    # for the stall tests to catch a server inside a transaction. Never in production.
    hold_reserve: float = 0.0
    # Jobs a write's endings released to wait (rota/store/settle.py), after its commit:
    # the coordinator hands them to the engine.
    on_released: Callable[[list[JobRecord]], None] = lambda jobs: None
    writer: Writer = field(init=False)
    readers: Readers = field(init=False)
    checkpointer: Checkpointer | None = field(init=False)  # SQLite's WAL only

    def __post_init__(self) -> None:
        if self.database_url is not None:
            from rota.store import pg  # here: psycopg costs a SQLite server's start 50 ms

            self.writer = pg.Writer(self.database_url, self.durability, self.health,
                                    self.max_db_size)
            # A server stalled inside a transaction holds another's writer (and so its
            # lease renewal) this long at most: well inside the lease (docs/scaling.md).
            # Not under half a second: a loaded machine's scheduler can pause a healthy
            # writer between two statements nearly that long.
            self.writer.bound = max(MIN_BOUND, self.lease / 4)
            self.readers = pg.Readers(self.database_url, self.db_pool, health=self.health)
            self.checkpointer = None
            return
        self.writer = Writer(self.path, self.durability, self.health, self.max_db_size)
        self.readers = Readers(self.path, self.db_pool, health=self.health)
        self.checkpointer = Checkpointer(self.path, health=self.health)

    @property
    def backend(self) -> str:
        return "sqlite" if self.database_url is None else "postgres"

    @property
    def shared(self) -> bool:
        """One of several servers that may share this database: PostgreSQL. (A SQLite
        file has one server, which its lock ensures.)"""
        return self.database_url is not None

    @property
    def where(self) -> str:
        """The database, as logs say it (a URL without its password)."""
        return str(self.path) if self.database_url is None else redact(self.database_url)

    # -- lifecycle (startup runs in a thread, before the server takes traffic) ----
    def load(self, reading: ClockReading | None = None) -> Snapshot:
        """What a start takes in. ``reading``: the clocks now, checked against the last
        run's (``writes.undo_step``) before anything is read."""
        conn = open_database(self.path if self.database_url is None else self.database_url)
        try:
            self.writer.used_bytes = self.writer.measure(conn)
            if self.shared:
                self._register(conn)
            step = 0.0 if reading is None or self.shared else sql.undo_step(conn, reading)
            snapshot = load(conn, self.server_id if self.shared else None)
            snapshot.clock_step = step
            snapshot.limits = limits.read_limits(conn)
            snapshot.limit_starts = limits.read_starts(conn, time.time())
            return snapshot
        finally:
            conn.close()

    def note_clock(self, reading: ClockReading) -> asyncio.Future[None]:
        """Keep the clocks' reading for the next start (``writes.undo_step``)."""
        value = msgspec.json.encode(tuple(reading)).decode()
        return self.writer.submit(lambda conn: sql.keep_reading(conn, value))

    def restamp(self, starts: dict[tuple[str, str | None], list[float]], step: float
                ) -> asyncio.Future[None]:
        """After a step seen while running: the rates' starts; the rest by the step."""
        return self.writer.submit(lambda conn: (limits.replace_starts(conn, starts),
                                                sql.follow_step(conn, step, False))[-1])

    def keep_throughput(self, rows: list[tuple[Any, ...]], oldest: int) -> asyncio.Future[None]:
        """Add the per-minute counts to this server's, drop minutes before ``oldest``."""
        return self.writer.submit(
            lambda conn: sql.keep_throughput(conn, self.server_id or "", rows, oldest))

    def _register(self, conn: sqlite3.Connection) -> None:
        """Hold this server's lease before reading the snapshot: a server recovering
        this one's reservations now either commits first (and the snapshot holds none
        of them) or finds the lease renewed and recovers nothing."""
        conn.execute("BEGIN IMMEDIATE")
        fleet.renew(conn, self.server_id or "", host=socket.gethostname(), pid=os.getpid(),
                    url="", now=time.time(), lease=self.lease, starting=True)
        conn.execute("COMMIT")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.writer.start(loop)
        if self.checkpointer is not None:
            self.checkpointer.start()

    def close(self) -> None:
        self.writer.stop()
        self.readers.close()
        if self.checkpointer is not None:
            self.checkpointer.stop()

    # -- writes --------------------------------------------------------------------
    def enqueue(self, jobs: list[JobRecord], *, live: int = 0,
                unscoped: Sequence[str | None] = (), all_or_nothing: bool = False
                ) -> asyncio.Future[list[tuple[dict[str, Any], bool]]]:
        """Insert jobs in one transaction; an existing id gives the stored row and False.
        ``all_or_nothing``: if any is refused so (or by its unique key), none is stored,
        and the future fails with ``writes.Unstored``, which carries the outcomes.

        ``unscoped``, per job: the id a producer's job was kept under before producers'
        ids were their own (rota/core/auth.py), or None. A job whose id is new but whose
        unscoped id names a row its token created is that row, not a new job: a producer
        sending again across the upgrade gets the job it made (and it runs once).

        Under a quota (``max_db_size``) jobs that would not leave room for the ``live``
        ones to finish are refused here, before anything is queued (storage_full), so
        that no reservation or result ever shares a commit with them and fails too."""
        quota = self.max_db_size
        if quota is not None and not sqlite.has_room(quota, self.writer.used_bytes, live,
                                                 [len(job.args) for job in jobs]):
            full = self.health.failed(sqlite.quota_full(quota))
            # A producer sending again jobs that were stored (its first answer was lost)
            # is told so, as on any day: no room is needed for them.
            return asyncio.ensure_future(self._stored_already(jobs, unscoped, full))
        rows = [sql.insert_row(job) for job in jobs]  # taken now: the jobs may change
        olds = list(unscoped) or [None] * len(jobs)

        def op(conn: sqlite3.Connection) -> list[tuple[dict[str, Any], bool]]:
            outcomes = sql.insert_jobs(conn, jobs, rows, olds, time.time())
            if all_or_nothing and sql.refused_any(outcomes):
                raise sql.Unstored(outcomes)  # (its savepoint rolls every insert back)
            if self.shared:
                fleet.notify(conn, fleet.JOBS, self.server_id or "",
                             [str(row["rowid"]) for row, new in outcomes if new])
            if self.crash_before_commit:
                sql.crash("enqueue-before-commit")
            return outcomes

        return self.writer.submit(op)

    def reserve(self, jobs: list[JobRecord], now: float, claims: Sequence[Claim] = (),
                lease: float = 1800.0, min_lease: float = 0.0,
                guards: Mapping[str | int, tuple[Guard, ...]] | None = None
                ) -> asyncio.Future[Reserved]:
        """Reserve whole jobs as they are in memory, and claimed ones if their rows are
        still available, reading those back (in claim order; None: not available).

        Both are fenced by the row: a whole job is reserved only if its row still waits
        at the attempt memory holds, so a server whose copy went stale (another server
        reserved, cancelled or finished the job first) reserves nothing and hears which
        jobs it lost. ``guards``: the limits each job (id) or claim (seq) counts against,
        held by the database among servers (rota/store/limits.py): what would pass one is
        not reserved (``Reserved.refused``; a refused claim reads None)."""
        server, guards = self.server_id, dict(guards or {})
        rows = [(j.attempt, j.worker_id, j.worker_token, j.checksum, server, now,
                 j.lease_expires_at, j.id, j.attempt - 1) for j in jobs]
        order: list[int] = [c.seq for c in claims]
        items: list[str | int] = [j.id for j in jobs] + order  # (the engine's order: whole first)

        def op(conn: sqlite3.Connection) -> Reserved:
            refused, full, at = (limits.guard(conn, guards, items, now) if self.shared
                                 else (frozenset(), frozenset(), now))
            cursor = conn.executemany(sql.RESERVE, rows if not refused else
                                      [r for r in rows if r[7] not in refused])
            lost: frozenset[str] = frozenset()
            kept = [j for j in jobs if j.id not in refused]
            if kept and cursor.rowcount != len(kept):  # rare: find which rows moved on
                lost = frozenset(sql.moved_on(conn, kept))
            # One statement per (worker, checksum): a round's claims for a worker are one
            # UPDATE ... WHERE rowid IN (...), not one per job.
            groups: dict[tuple[str, str | None, str], list[int]] = {}
            for c in claims:
                if c.seq not in refused:
                    groups.setdefault((c.worker.id, c.worker.token, c.checksum), []).append(c.seq)
            read: dict[int, JobRecord] = {}
            for (worker_id, token, checksum), seqs in groups.items():
                for start in range(0, len(seqs), 500):  # SQLite's limit on parameters
                    for row in claim_rows(conn, worker_id, checksum, now, lease, min_lease,
                                          seqs[start:start + 500], server, token):
                        read[row[0]] = live_job(row)
            if self.hold_reserve:
                time.sleep(self.hold_reserve)  # (test switch: the writer's thread)
            if guards:  # (made as this commit lands: a start's moment is its assign's)
                limits.record_starts(conn, limits.started(guards, [
                    *(j.id for j in kept if j.id not in lost), *read]), max(at, time.time()))
            # A key known twice (its job came back while a stale key of it was still
            # waiting) is claimed twice in one round: the row is reserved once, so only
            # the first claim gets the job.
            return Reserved([read.pop(seq, None) for seq in order], lost, refused, full)

        return self.writer.submit(op)

    async def _stored_already(self, jobs: list[JobRecord], unscoped: Sequence[str | None],
                              full: StorageError) -> list[tuple[dict[str, Any], bool]]:
        """The stored rows of these jobs if every one of them exists; else ``full``."""
        olds = list(unscoped) or [None] * len(jobs)
        rows = await self.readers.run(lambda conn: sql.stored_rows(conn, jobs, olds))
        if any(row is None for row in rows):
            raise full
        return [(row, False) for row in rows if row is not None]

    def withdraw(self, seq: int, now: float) -> asyncio.Future[bool]:
        """Cancel row ``seq`` if it is still available; whether it was."""
        released: list[JobRecord] = []

        def op(conn: sqlite3.Connection) -> bool:
            cancelled = sql.withdraw(conn, seq, now)
            if cancelled:
                released[:] = self._settle(conn, settle.ended_row(conn, seq), now)
            return cancelled

        return self._releasing(self.writer.submit(op), released)

    def save(self, changes: list[Change], linger: bool = False
             ) -> asyncio.Future[dict[str, JobRecord | None]]:
        """Commit job transitions. Values are taken now: the job may change again before
        the writer runs, and FIFO order then keeps the later write last. ``linger``: a
        background write (a worker's results, a lease's end), which may wait briefly for
        other writes to commit with (``Writer.submit``).

        Each is fenced by its row (``writes.SAVE``): the outcome names the changes
        the row refused (another attempt, server or direct write moved it on), each with
        the row as it now waits (None: it does not wait, or is gone), so that the engine
        turns the result away and holds what the row says instead."""
        rows = [sql.change_row(c) for c in changes]
        # Jobs that wait again (retried, back from a worker, due): every server may give
        # them out, so every server hears of them (of the writes the rows took).
        keys = [(c.job.id, c.job.seq, c.job.state in WAITING_STATES) for c in changes]

        if self.shared:  # and only from the server whose worker holds the job, if any
            rows = [(*row, self.server_id, int(c.retry)) for row, c in zip(rows, changes)]

        ended = settle.ended_of(changes)  # (taken now, as the rows; most saves: none)
        released: list[JobRecord] = []

        def op(conn: sqlite3.Connection) -> dict[str, JobRecord | None]:
            counts = sqlite.rowcounts(conn, sql.SAVE_SHARED if self.shared else sql.SAVE, rows)
            refused = [(job_id, seq) for (job_id, seq, _), n in zip(keys, counts) if n == 0]
            waiting = [str(seq) for (_, seq, waits), n in zip(keys, counts) if waits and n]
            if ended:  # those whose rows took the change
                released[:] = self._settle(conn, [e for i, e in ended if counts[i]], now)
            if waiting and self.shared:
                fleet.notify(conn, fleet.JOBS, self.server_id or "", waiting)
            if not refused:
                return {}
            found = {job.id: job for job in map(live_job, waiting_rows(
                conn, [seq for _, seq in refused if seq]))}
            return {job_id: found.get(job_id) for job_id, _ in refused}

        now = time.time()
        return self._releasing(self.writer.submit(op, linger), released)

    def _settle(self, conn: sqlite3.Connection, ended: list[settle.Ended], now: float
                ) -> list[JobRecord]:
        """``settle.settle`` in a writer's transaction: the jobs the endings released,
        announced to the other servers sharing the database."""
        return self._announce(conn, settle.settle(conn, ended, now) if ended else [])

    def _announce(self, conn: sqlite3.Connection, released: list[JobRecord]
                  ) -> list[JobRecord]:
        """Jobs a transaction released, announced to the other servers sharing the
        database (they load them at its commit)."""
        if released and self.shared:
            fleet.notify(conn, fleet.JOBS, self.server_id or "",
                         [str(job.seq) for job in released])
        return released

    def _releasing(self, future: asyncio.Future[T], released: list[JobRecord]
                   ) -> asyncio.Future[T]:
        """Hand the jobs a write released (filled by its transaction) to ``on_released``
        once it commits, before whoever waits on the write hears of it."""
        def done(f: asyncio.Future[T]) -> None:
            if released and not f.cancelled() and f.exception() is None:
                self.on_released(list(released))
        future.add_done_callback(done)
        return future

    def prune(self, cutoffs: Sequence[Cutoff], limit: int, keep: Container[str]
              ) -> asyncio.Future[dict[str, int]]:
        """Delete at most ``limit`` finished jobs that are due (rota/core/retention.py), oldest
        first, with their log lines; deleted rows by state. Ids in ``keep`` (a manual
        retry that read the row and has not written it yet) are left for the next pass;
        the writer thread only asks it ``in``."""
        return self.writer.submit(lambda conn: sql.prune(conn, cutoffs, limit, keep))

    def barrier(self) -> asyncio.Future[None]:
        """Done once every write queued before it is committed and its outcome reported
        (the writer reports in order)."""
        return self.writer.submit(lambda conn: None)

    def note_status(self, notes: list[StatusNote]) -> asyncio.Future[None]:
        """Store progress (the latest wins) and captured log lines and alerts."""
        progress, lines = sql.status_rows(notes)  # taken now
        return self.writer.submit(lambda conn: sql.note_status(conn, progress, lines))

    async def push_specs(self, specs: list[tuple[JobSpec, str]], *, dry_run: bool) -> list[SpecChange]:
        now = time.time()

        def op(conn: sqlite3.Connection) -> list[SpecChange]:
            changes = [sql.push_one(conn, spec, checksum, now) for spec, checksum in specs]
            if dry_run:
                raise sql.DryRun(changes)
            if self.shared and any(c.change != "unchanged" for c in changes):
                fleet.notify(conn, fleet.SPECS, self.server_id or "")
            return changes

        try:
            return await self.writer.submit(op)
        except sql.DryRun as dry:  # the savepoint rolled everything back
            return dry.changes

    def worker_connected(self, worker_id: str, registration: Registration,
                         connected_at: float) -> asyncio.Future[None]:
        row = worker_row(worker_id, registration, connected_at)
        return self.writer.submit(lambda conn: sql.worker_connected(conn, row))

    def worker_disconnected(self, worker_id: str, connected_at: float, now: float
                            ) -> asyncio.Future[None]:
        """Mark that connection ended (not a newer one of the same worker, if it came)."""
        return self.writer.submit(
            lambda conn: sql.worker_disconnected(conn, worker_id, connected_at, now))

    # -- several servers (rota/store/fleet.py) ---------------------------------------------
    def renew_lease(self, *, host: str, pid: int, url: str, now: float, lease: float,
                    starting: bool = False) -> asyncio.Future[bool]:
        return self.writer.submit(lambda conn: fleet.renew(
            conn, self.server_id or "", host=host, pid=pid, url=url, now=now, lease=lease, starting=starting))

    def take_back(self, jobs: list[JobRecord]) -> asyncio.Future[list[str]]:
        """fleet.take_back, for jobs this server's workers run (``Engine.running_here``)."""
        server = self.server_id or ""
        rows = [(j.id, j.attempt, j.worker_id or "", j.worker_token, j.reserved_at,
                 j.lease_expires_at) for j in jobs]
        return self.writer.submit(lambda conn: fleet.take_back(conn, server, rows))

    def let_lease_lapse(self) -> asyncio.Future[None]:
        return self.writer.submit(lambda conn: fleet.let_lapse(conn, self.server_id or ""))

    async def lapsed_servers(self) -> dict[str, float]:
        """fleet.lapsed: the others whose lease ended, and how long ago."""
        return await self.readers.run(lambda conn: fleet.lapsed(conn, self.server_id or ""))

    def recover_server(self, dead: str, now: float, grace: float
                       ) -> asyncio.Future[list[int] | None]:
        return self.writer.submit(lambda conn: fleet.recover(conn, dead, self.server_id or "", now, grace))

    async def waiting_jobs(self, seqs: list[int]) -> list[JobRecord]:
        """The jobs of these row ids that wait, as their rows say now."""
        rows = await self.readers.run(lambda conn: waiting_rows(conn, seqs))
        return [live_job(row) for row in rows]

    async def status_quo(self) -> tuple[dict[str, JobSpec], dict[str, str], dict[str, float]]:
        return await self.readers.run(read_status_quo)

    async def paused_queues(self) -> frozenset[str]:
        return await self.readers.run(fleet.paused_queues)

    async def waiting_seqs(self) -> list[int]:
        return await self.readers.run(fleet.waiting_seqs)

    async def cancels_requested(self) -> list[str]:
        server = self.server_id or ""
        return await self.readers.run(lambda conn: fleet.cancels_requested(conn, server))

    def request_cancel(self, job_id: str) -> asyncio.Future[str | None]:
        server = self.server_id or ""
        return self.writer.submit(lambda conn: fleet.request_cancel(conn, job_id, server))

    def take_over(self, worker_id: str, job_ids: list[str], token: str | None = None,
                  queues: Collection[str] | None = None
                  ) -> asyncio.Future[tuple[list[JobRecord], set[str]]]:
        """The jobs this worker holds through other servers, made this server's (only
        those its token's workers hold, of the queues it may serve: ``token``, its id,
        None: no token, any; ``queues``, None: any); or, if other tokens' workers hold
        any of them under this worker id, nothing and those tokens (its registration is
        then refused, and the jobs stay where their worker runs them)."""
        server = self.server_id or ""
        return self.writer.submit(
            lambda conn: take_over(conn, server, worker_id, job_ids, token, queues))

    def tell_servers(self, state: str, target: str) -> asyncio.Future[None]:
        """Pass an operator's directive on to the other servers' workers (rota/store/fleet.py)."""
        server = self.server_id or ""
        return self.writer.submit(lambda conn: fleet.notify(conn, fleet.WORKERS, server,
                                                            [state, target]))

    async def server_url(self, server_id: str) -> str | None:
        return await self.readers.run(lambda conn: fleet.server_url(conn, server_id))

    async def connected_somewhere(self, worker_id: str) -> bool:
        return await self.readers.run(lambda conn: fleet.connected_somewhere(conn, worker_id))

    def get_job_in_order(self, job_id: str) -> asyncio.Future[dict[str, Any] | None]:
        """The job's row as the writer sees it, in order with the writes: a row a later
        write (a prune) would change is read before it changes."""
        return self.writer.submit(lambda conn: sql.fetch_job(conn, job_id))

    async def create_token(self, *, name: str, scope: str, queues: list[str] | None,
                           token_id: str, hashed: str) -> dict[str, Any]:
        """Store a new token (the API's); its row, or Conflict if the name is taken."""
        return await self.writer.submit(functools.partial(
            insert_token, name=name, scope=scope, queues=queues, token_id=token_id,
            hashed=hashed))

    async def revoke_token(self, id_or_name: str) -> list[dict[str, Any]]:
        """Revoke the live tokens with this id or name; their rows."""
        return await self.writer.submit(lambda conn: revoke_tokens(conn, id_or_name))

    def set_paused(self, queue: str, paused: bool, now: float) -> asyncio.Future[None]:
        return self.writer.submit(lambda conn: fleet.set_paused(
            conn, queue, paused, now, self.server_id if self.shared else None))

    # -- flow control (rota/store/limits.py) -----------------------------------------------
    def set_limit(self, kind: str, name: str, rule: str | None, now: float,
                  by: str | None = None) -> asyncio.Future[bool]:
        """Set a scope's runtime rule (its JSON), or clear it (None); whether one changed."""
        server = self.server_id or "" if self.shared else None
        return self.writer.submit(
            lambda conn: limits.change(conn, kind, name, rule, now, by, server))

    def retire_spec(self, name: str, now: float
                    ) -> asyncio.Future[tuple[str, float, bool] | None]:
        """Mark spec ``name`` retired (rota/core/intake.py refuses its new jobs)."""
        def op(conn: sqlite3.Connection) -> tuple[str, float, bool] | None:
            retired = sql.retire(conn, name, now)
            if self.shared and retired is not None:
                fleet.notify(conn, fleet.SPECS, self.server_id or "")
            return retired

        return self.writer.submit(op)
