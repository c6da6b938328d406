"""Rota's durable state: jobs, spec versions, the status quo and workers, in one SQLite file
or a PostgreSQL database (``database_url``; rota/pg.py runs the same operations there).

Every write goes through the single writer thread (``db.Writer``, ``pg.Writer``): a write method
queues its work at once, in call order, and returns a future that resolves after its
COMMIT. Reads run on a reader pool. The in-memory scheduler is rebuilt from
``load()`` at start (rota/rows.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import socket
import sqlite3
import time
from collections.abc import Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rota import db, fleet, lookup, pg
from rota.errors import Conflict, StorageError
from rota.listing import JobFilter, decode_cursor
from rota.effects import Reserved
from rota.model import (JOB_STATES, WAITING_STATES, Change, ClockReading, JobRecord, StatusNote,
                        wall_step)
from rota.protocol import Registration, rfc3339
from rota.ready import Claim
from rota.retention import Cutoff
from rota.rows import (Snapshot, claim_rows, job_from_row, live_job, load, other_tokens,
                       read_status_quo, take_over_rows, waiting_rows, worker_row)
from rota.specs import JobSpec
from rota.views import job_view

log = logging.getLogger("rota.server")

__all__ = ["Store", "Snapshot", "SpecChange", "Change", "JobRecord", "StatusNote", "job_from_row",
           "create_token", "list_tokens", "revoke_token", "token_view"]  # (Snapshot, job_from_row: rota/rows.py)

MIN_BOUND = 0.5  # seconds: the least lock and idle-in-transaction bound (rota/pg.py)


@dataclass(slots=True)
class SpecChange:
    name: str
    checksum: str
    previous: str | None
    change: str  # "new" | "changed" | "unchanged"


@dataclass(slots=True)
class Store:
    path: Path
    crash_before_commit: bool = False  # test switch: die inside an enqueue transaction
    durability: str = "full"  # db.SYNCHRONOUS: what a commit survives
    max_db_size: int | None = None  # bytes (--max-db-size); None: as much as the disk holds
    health: db.Health = field(default_factory=db.Health)  # degraded while the disk fails
    # PostgreSQL (rota/pg.py) instead of the file at ``path``: the database's URL, and how
    # many reader connections (SQLite's reader pool is that size too).
    database_url: str | None = None
    db_pool: int = 2
    # The server this store writes for: its reservations carry the id. ``shared``: one of
    # several servers on this database (PostgreSQL), which hear of each other's work by
    # the notices its writes send (rota/fleet.py).
    server_id: str | None = None
    lease: float = 10.0  # seconds a shared store's server holds its lease (rota/fleet.py)
    # Test switch: hold each reservation's transaction open this long after its UPDATE,
    # for the stall tests to catch a server inside a transaction. Never in production.
    hold_reserve: float = 0.0
    writer: db.Writer = field(init=False)
    readers: db.Readers = field(init=False)
    checkpointer: db.Checkpointer | None = field(init=False)  # SQLite's WAL only

    def __post_init__(self) -> None:
        if self.database_url is not None:
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
        self.writer = db.Writer(self.path, self.durability, self.health, self.max_db_size)
        self.readers = db.Readers(self.path, self.db_pool, health=self.health)
        self.checkpointer = db.Checkpointer(self.path, health=self.health)

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
        return str(self.path) if self.database_url is None else pg.redact(self.database_url)

    # -- lifecycle (startup runs in a thread, before the server takes traffic) ----
    def load(self, reading: ClockReading | None = None) -> Snapshot:
        """What a start takes in. ``reading``: the clocks now, checked against the last
        run's (``_undo_step``) before anything is read."""
        conn = _open(self.path if self.database_url is None else self.database_url)
        try:
            self.writer.used_bytes = (db.used_bytes(conn) if self.database_url is None
                                      else pg.used_bytes(conn))
            if self.shared:
                self._register(conn)
            step = 0.0 if reading is None or self.shared else _undo_step(conn, reading)
            snapshot = load(conn, self.server_id if self.shared else None)
            snapshot.clock_step = step
            return snapshot
        finally:
            conn.close()

    def note_clock(self, reading: ClockReading) -> asyncio.Future[None]:
        """Keep the clocks' reading for the next start (``_undo_step``)."""
        value = msgspec.json.encode(tuple(reading)).decode()
        return self.writer.submit(lambda conn: _keep_reading(conn, value))

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
                unscoped: Sequence[str | None] = ()
                ) -> asyncio.Future[list[tuple[dict[str, Any], bool]]]:
        """Insert jobs in one transaction; an existing id gives the stored row and False.

        ``unscoped``, per job: the id a producer's job was kept under before producers'
        ids were their own (rota/auth.py), or None. A job whose id is new but whose
        unscoped id names a row its token created is that row, not a new job: a producer
        sending again across the upgrade gets the job it made (and it runs once).

        Under a quota (``max_db_size``) jobs that would not leave room for the ``live``
        ones to finish are refused here, before anything is queued (storage_full), so
        that no reservation or result ever shares a commit with them and fails too."""
        quota = self.max_db_size
        if quota is not None and not db.has_room(quota, self.writer.used_bytes, live,
                                                 [len(job.args) for job in jobs]):
            full = self.health.failed(db.quota_full(quota))
            # A producer sending again jobs that were stored (its first answer was lost)
            # is told so, as on any day: no room is needed for them.
            return asyncio.ensure_future(self._stored_already(jobs, unscoped, full))
        rows = [_insert_row(job) for job in jobs]
        olds = list(unscoped) or [None] * len(jobs)

        def op(conn: sqlite3.Connection) -> list[tuple[dict[str, Any], bool]]:
            outcomes: list[tuple[dict[str, Any], bool]] = []
            template: dict[str, Any] | None = None
            for job, row, old in zip(jobs, rows, olds, strict=True):
                if old is not None and (kept := _made_before(conn, job, old)) is not None:
                    outcomes.append((kept, False))
                    continue
                # RETURNING gives the new row in the same statement; only an id that
                # exists already needs a second look, to be judged the same job or not.
                # The first new row of a batch comes back whole; every other differs from
                # it only in what was inserted, so it is made from that (a third of the
                # cost of reading each back).
                if template is None:
                    inserted = conn.execute(_INSERT + _RETURNING_ROW, row).fetchone()
                    if inserted is not None:
                        template = dict(inserted)
                        outcomes.append((dict(template), True))
                        continue
                else:
                    inserted = conn.execute(_INSERT + " RETURNING rowid", row).fetchone()
                    if inserted is not None:
                        made = dict(template)
                        made.update(zip(_INSERTED, row))
                        made["rowid"] = inserted[0]
                        outcomes.append((made, True))
                        continue
                outcomes.append((_fetch_job(conn, row[0]), False))
            if self.shared:
                fleet.notify(conn, fleet.JOBS, self.server_id or "",
                             [str(row["rowid"]) for row, new in outcomes if new])
            if self.crash_before_commit:
                _crash("enqueue-before-commit")
            return outcomes

        return self.writer.submit(op)

    def reserve(self, jobs: list[JobRecord], now: float, claims: Sequence[Claim] = (),
                lease: float = 1800.0, min_lease: float = 0.0) -> asyncio.Future[Reserved]:
        """Reserve whole jobs as they are in memory, and claimed ones if their rows are
        still available, reading those back (in claim order; None: not available).

        Both are fenced by the row: a whole job is reserved only if its row still waits
        at the attempt memory holds, so a server whose copy went stale (another server
        reserved, cancelled or finished the job first) reserves nothing and hears which
        jobs it lost."""
        server = self.server_id
        rows = [(j.attempt, j.worker_id, j.worker_token, j.checksum, server, now,
                 j.lease_expires_at, j.id, j.attempt - 1) for j in jobs]
        # One statement per (worker, checksum): a round's claims for a worker are one
        # UPDATE ... WHERE rowid IN (...), not one per job.
        groups: dict[tuple[str, str | None, str], list[int]] = {}
        order: list[int] = []
        for c in claims:
            groups.setdefault((c.worker.id, c.worker.token, c.checksum), []).append(c.seq)
            order.append(c.seq)

        def op(conn: sqlite3.Connection) -> Reserved:
            cursor = conn.executemany(_RESERVE, rows)
            lost: frozenset[str] = frozenset()
            if rows and cursor.rowcount != len(rows):  # rare: find which rows moved on
                lost = frozenset(_moved_on(conn, jobs))
            read: dict[int, JobRecord] = {}
            for (worker_id, token, checksum), seqs in groups.items():
                for start in range(0, len(seqs), 500):  # SQLite's limit on parameters
                    for row in claim_rows(conn, worker_id, checksum, now, lease, min_lease,
                                          seqs[start:start + 500], server, token):
                        read[row[0]] = live_job(row)
            if self.hold_reserve:
                time.sleep(self.hold_reserve)  # (test switch: the writer's thread)
            # A key known twice (its job came back while a stale key of it was still
            # waiting) is claimed twice in one round: the row is reserved once, so only
            # the first claim gets the job.
            return Reserved([read.pop(seq, None) for seq in order], lost)

        return self.writer.submit(op)

    async def _stored_already(self, jobs: list[JobRecord], unscoped: Sequence[str | None],
                              full: StorageError) -> list[tuple[dict[str, Any], bool]]:
        """The stored rows of these jobs if every one of them exists; else ``full``."""
        olds = list(unscoped) or [None] * len(jobs)

        def read(conn: sqlite3.Connection) -> list[dict[str, Any] | None]:
            rows = []
            for job, old in zip(jobs, olds, strict=True):
                kept = _made_before(conn, job, old) if old is not None else None
                rows.append(kept or _fetch_job(conn, job.id))
            return rows

        rows = await self.readers.run(read)
        if any(row is None for row in rows):
            raise full
        return [(row, False) for row in rows if row is not None]

    def withdraw(self, seq: int, now: float) -> asyncio.Future[bool]:
        """Cancel row ``seq`` if it is still available; whether it was."""
        def op(conn: sqlite3.Connection) -> bool:
            return conn.execute("UPDATE jobs SET state = 'cancelled', finished_at = ?"
                                " WHERE rowid = ? AND +state = 'available'",
                                (now, seq)).rowcount == 1

        return self.writer.submit(op)

    def save(self, changes: list[Change]) -> asyncio.Future[dict[str, JobRecord | None]]:
        """Commit job transitions. Values are taken now: the job may change again before
        the writer runs, and FIFO order then keeps the later write last.

        Each is fenced by its row (_SAVE): the outcome names the changes the row refused
        (another attempt, server or direct write moved it on), each with the row as it
        now waits (None: it does not wait, or is gone), so that the engine turns the
        result away and holds what the row says instead."""
        rows = [_change_row(c) for c in changes]
        # Jobs that wait again (retried, back from a worker, due): every server may give
        # them out, so every server hears of them (of the writes the rows took).
        keys = [(c.job.id, c.job.seq, c.job.state in WAITING_STATES) for c in changes]

        if self.shared:  # and only from the server whose worker holds the job, if any
            rows = [(*row, self.server_id, int(c.retry)) for row, c in zip(rows, changes)]

        def op(conn: sqlite3.Connection) -> dict[str, JobRecord | None]:
            counts = db.rowcounts(conn, _SAVE_SHARED if self.shared else _SAVE, rows)
            refused = [(job_id, seq) for (job_id, seq, _), n in zip(keys, counts) if n == 0]
            waiting = [str(seq) for (_, seq, waits), n in zip(keys, counts) if waits and n]
            if waiting and self.shared:
                fleet.notify(conn, fleet.JOBS, self.server_id or "", waiting)
            if not refused:
                return {}
            found = {job.id: job for job in map(live_job, waiting_rows(
                conn, [seq for _, seq in refused if seq]))}
            return {job_id: found.get(job_id) for job_id, _ in refused}

        return self.writer.submit(op)

    def prune(self, cutoffs: Sequence[Cutoff], limit: int, keep: Container[str]
              ) -> asyncio.Future[dict[str, int]]:
        """Delete at most ``limit`` finished jobs that are due (rota/retention.py), oldest
        first, with their log lines; deleted rows by state. Ids in ``keep`` (a manual
        retry that read the row and has not written it yet) are left for the next pass;
        the writer thread only asks it ``in``."""
        def op(conn: sqlite3.Connection) -> dict[str, int]:
            deleted: dict[str, int] = {}
            left = limit
            for cut in cutoffs:
                if left <= 0:
                    break
                sql, params = _DUE, [cut.state, cut.before]
                if cut.spans:  # the wall clock stepped while the server ran
                    sql, params = _due_in(cut.spans), [cut.state, *_bounds(cut.spans)]
                if cut.queue is not None:
                    sql, params = sql + " AND queue = ?", [*params, cut.queue]
                elif cut.others:
                    sql += f" AND queue NOT IN ({', '.join('?' * len(cut.others))})"
                    params += cut.others
                rows = [(rowid, job_id) for rowid, job_id in
                        conn.execute(sql + " ORDER BY finished_at LIMIT ?", [*params, left])
                        if job_id not in keep]
                if rows:
                    conn.executemany("DELETE FROM job_logs WHERE job_id = ?",
                                     [(job_id,) for _, job_id in rows])
                    conn.executemany("DELETE FROM jobs WHERE rowid = ?",
                                     [(rowid,) for rowid, _ in rows])
                    deleted[cut.state] = deleted.get(cut.state, 0) + len(rows)
                    left -= len(rows)
            return deleted

        return self.writer.submit(op)

    def barrier(self) -> asyncio.Future[None]:
        """Done once every write queued before it is committed and its outcome reported
        (the writer reports in order)."""
        return self.writer.submit(lambda conn: None)

    def note_status(self, notes: list[StatusNote]) -> asyncio.Future[None]:
        """Store progress (the latest wins) and captured log lines and alerts."""
        progress = [(n.progress[0], n.progress[1], n.at, n.job_id) for n in notes if n.progress]
        lines = [(n.job_id, n.attempt, n.at, *n.line) for n in notes if n.line]

        def op(conn: sqlite3.Connection) -> None:
            conn.executemany("UPDATE jobs SET progress_percent = ?, progress_message = ?,"
                             " progress_at = ? WHERE id = ?", progress)
            conn.executemany("INSERT INTO job_logs (job_id, attempt, at, kind, level, message)"
                             " VALUES (?, ?, ?, ?, ?, ?)", lines)

        return self.writer.submit(op)

    async def push_specs(self, specs: list[tuple[JobSpec, str]], *, dry_run: bool) -> list[SpecChange]:
        now = time.time()

        def op(conn: sqlite3.Connection) -> list[SpecChange]:
            changes = [_push_one(conn, spec, checksum, now) for spec, checksum in specs]
            if dry_run:
                raise _DryRun(changes)
            if self.shared and any(c.change != "unchanged" for c in changes):
                fleet.notify(conn, fleet.SPECS, self.server_id or "")
            return changes

        try:
            return await self.writer.submit(op)
        except _DryRun as dry:  # the savepoint rolled everything back
            return dry.changes

    def worker_connected(self, worker_id: str, registration: Registration,
                         connected_at: float) -> asyncio.Future[None]:
        row = worker_row(worker_id, registration, connected_at)

        def op(conn: sqlite3.Connection) -> None:
            cols = ", ".join(row)
            marks = ", ".join("?" for _ in row)
            conn.execute(f"INSERT OR REPLACE INTO workers ({cols}) VALUES ({marks})", list(row.values()))

        return self.writer.submit(op)

    def worker_disconnected(self, worker_id: str, connected_at: float, now: float
                            ) -> asyncio.Future[None]:
        """Mark that connection ended (not a newer one of the same worker, if it came)."""
        def op(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE workers SET disconnected_at = ? WHERE id = ? AND connected_at = ?",
                         (now, worker_id, connected_at))

        return self.writer.submit(op)

    # -- several servers (rota/fleet.py) ---------------------------------------------
    def renew_lease(self, *, host: str, pid: int, url: str, now: float, lease: float,
                    starting: bool = False) -> asyncio.Future[bool]:
        server = self.server_id or ""
        return self.writer.submit(lambda conn: fleet.renew(
            conn, server, host=host, pid=pid, url=url, now=now, lease=lease, starting=starting))

    def take_back(self, jobs: list[JobRecord]) -> asyncio.Future[list[str]]:
        """fleet.take_back, for jobs this server's workers run (``Engine.running_here``)."""
        server = self.server_id or ""
        rows = [(j.id, j.attempt, j.worker_id or "", j.worker_token, j.reserved_at,
                 j.lease_expires_at) for j in jobs]
        return self.writer.submit(lambda conn: fleet.take_back(conn, server, rows))

    def let_lease_lapse(self) -> asyncio.Future[None]:
        server = self.server_id or ""
        return self.writer.submit(lambda conn: fleet.let_lapse(conn, server))

    async def lapsed_servers(self) -> dict[str, float]:
        """fleet.lapsed: the others whose lease ended, and how long ago."""
        server = self.server_id or ""
        return await self.readers.run(lambda conn: fleet.lapsed(conn, server))

    def recover_server(self, dead: str, now: float, grace: float
                       ) -> asyncio.Future[list[int] | None]:
        server = self.server_id or ""
        return self.writer.submit(lambda conn: fleet.recover(conn, dead, server, now, grace))

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

        def op(conn: sqlite3.Connection) -> tuple[list[JobRecord], set[str]]:
            others = set() if token is None else other_tokens(conn, worker_id, job_ids, token)
            if others:
                return [], others
            return [live_job(r) for r in take_over_rows(conn, server, worker_id, job_ids,
                                                        token, queues)], others

        return self.writer.submit(op)

    def tell_servers(self, state: str, target: str) -> asyncio.Future[None]:
        """Pass an operator's directive on to the other servers' workers (rota/fleet.py)."""
        server = self.server_id or ""
        return self.writer.submit(lambda conn: fleet.notify(conn, fleet.WORKERS, server,
                                                            [state, target]))

    async def connected_somewhere(self, worker_id: str) -> bool:
        return await self.readers.run(lambda conn: fleet.connected_somewhere(conn, worker_id))

    # -- reads ---------------------------------------------------------------------
    async def get_job(self, job_id: str) -> dict[str, Any] | None:
        return await self.readers.run(lambda conn: _fetch_job(conn, job_id))

    def get_job_in_order(self, job_id: str) -> asyncio.Future[dict[str, Any] | None]:
        """The job's row as the writer sees it, in order with the writes: a row a later
        write (a prune) would change is read before it changes."""
        return self.writer.submit(lambda conn: _fetch_job(conn, job_id))

    async def live_tokens(self) -> list[dict[str, Any]]:
        return await self.readers.run(_live_tokens)

    async def create_token(self, *, name: str, scope: str, queues: list[str] | None,
                           token_id: str, hashed: str) -> dict[str, Any]:
        """Store a new token (the API's); its row, or Conflict if the name is taken."""
        return await self.writer.submit(functools.partial(
            _insert_token, name=name, scope=scope, queues=queues, token_id=token_id,
            hashed=hashed))

    async def revoke_token(self, id_or_name: str) -> list[dict[str, Any]]:
        """Revoke the live tokens with this id or name; their rows."""
        return await self.writer.submit(lambda conn: _revoke_tokens(conn, id_or_name))

    async def job_logs(self, job_id: str, limit: int) -> list[dict[str, Any]]:
        """The job's last ``limit`` log lines and alerts, oldest first."""
        def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = conn.execute("SELECT attempt, at, kind, level, message FROM job_logs"
                                " WHERE job_id = ? ORDER BY id DESC LIMIT ?", (job_id, limit))
            return [{"at": rfc3339(r["at"]), "attempt": r["attempt"], "kind": r["kind"],
                     "level": r["level"], "message": r["message"]} for r in rows][::-1]

        return await self.readers.run(read)

    async def queue_counts(self, states: Sequence[str] = JOB_STATES
                           ) -> dict[str, dict[str, int]]:
        """Jobs per queue and state, counted: a scan of the (state, queue) index over
        every job in ``states`` (about 0.3 s per million on a small machine)."""
        marks = ", ".join("?" * len(states))

        def read(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
            counts: dict[str, dict[str, int]] = {}
            # In the (state, queue) index's own order: a walk of it, no sort (a third
            # faster with 1,000,000 jobs: docs/performance.md).
            for row in conn.execute("SELECT state, queue, count(*) FROM jobs WHERE state IN"
                                    f" ({marks}) GROUP BY state, queue", tuple(states)):
                counts.setdefault(row[1], dict.fromkeys(JOB_STATES, 0))[row[0]] = row[2]
            return counts

        return await self.readers.run(read)

    async def oldest_available_since(self, queues: Iterable[str]) -> dict[str, float]:
        """Per queue, the wall time since which its first available job (by insertion
        order) could run: each is one probe of the (state, queue) index, which ends in
        the row id, so MIN(rowid) is its first entry, whatever the backlog."""
        names = list(queues)

        def read(conn: sqlite3.Connection) -> dict[str, float]:
            oldest = {}
            for queue in names:
                row = conn.execute(
                    "SELECT coalesce(run_at, enqueued_at) FROM jobs WHERE rowid ="
                    " (SELECT min(rowid) FROM jobs WHERE state = 'available' AND queue = ?)",
                    (queue,)).fetchone()
                if row is not None:
                    oldest[queue] = row[0]
            return oldest

        return await self.readers.run(read)

    # -- what an operator looks for (rota/lookup.py) --------------------------------
    async def list_jobs(self, flt: JobFilter, limit: int, cursor: str | None
                        ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of matching jobs, newest first, as the API shows them, and the cursor
        of the next page (None: this is the last). RequestError on a bad cursor."""
        before = decode_cursor(cursor) if cursor is not None else None
        found, after = await self.readers.run(
            lambda conn: lookup.page(conn, flt, limit, before))
        return [job_view(row) for _, row in found], after

    async def match_jobs(self, flt: JobFilter, limit: int, pages: int = 20
                         ) -> tuple[list[tuple[str, str]], bool]:
        """(id, state) of up to ``limit + 1`` matching jobs, newest first (one more than
        ``limit`` says more match), and whether a bounded search (q) stopped after
        ``pages`` scans with rows left unexamined."""
        def read(conn: sqlite3.Connection) -> tuple[list[tuple[str, str]], bool]:
            found: list[tuple[str, str]] = []
            before = None
            for _ in range(pages):
                rows, cursor = lookup.page(conn, flt, limit + 1 - len(found), before,
                                           "id, state")
                found += [(row["id"], row["state"]) for _, row in rows]
                if cursor is None or len(found) > limit:
                    return found[:limit + 1], False
                before = decode_cursor(cursor)
            return found, True

        return await self.readers.run(read)

    async def count_jobs(self, flt: JobFilter) -> int:
        """Matching jobs, counted up to lookup.COUNT_CAP (100,000)."""
        return await self.readers.run(lambda conn: lookup.count(conn, flt))

    async def state_counts(self) -> dict[str, int]:
        return await self.readers.run(lookup.state_counts)

    async def oldest_available(self, now: float) -> dict[str, float | None]:
        """Per queue, seconds its longest-waiting available job has waited."""
        return await self.readers.run(lambda conn: lookup.oldest_available(conn, now))

    async def job_states(self, ids: list[str]) -> dict[str, str]:
        """The state of each of these jobs that exists."""
        def read(conn: sqlite3.Connection) -> dict[str, str]:
            states: dict[str, str] = {}
            for start in range(0, len(ids), 500):  # SQLite's limit on parameters
                chunk = ids[start:start + 500]
                states.update(conn.execute(f"SELECT id, state FROM jobs WHERE id IN"
                                           f" ({', '.join('?' * len(chunk))})", chunk))
            return states

        return await self.readers.run(read)

    def set_paused(self, queue: str, paused: bool, now: float) -> asyncio.Future[None]:
        def op(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO queues (name, paused, updated_at) VALUES (?, ?, ?)"
                         " ON CONFLICT(name) DO UPDATE SET paused = excluded.paused,"
                         " updated_at = excluded.updated_at", (queue, int(paused), now))
            if self.shared:
                fleet.notify(conn, fleet.QUEUES, self.server_id or "", [queue])

        return self.writer.submit(op)

    def retire_spec(self, name: str, now: float
                    ) -> asyncio.Future[tuple[str, float, bool] | None]:
        """Mark spec ``name`` retired (rota/intake.py refuses its new jobs)."""
        def op(conn: sqlite3.Connection) -> tuple[str, float, bool] | None:
            retired = _retire(conn, name, now)
            if self.shared and retired is not None:
                fleet.notify(conn, fleet.SPECS, self.server_id or "")
            return retired

        return self.writer.submit(op)

    async def spec_jobs(self, name: str) -> tuple[dict[str, int], list[str]]:
        """Unfinished jobs of spec ``name``: counts by state, and the ids of waiting ones."""
        def read(conn: sqlite3.Connection) -> tuple[dict[str, int], list[str]]:
            counts = dict.fromkeys(("scheduled", "available", "retryable", "active"), 0)
            waiting: list[str] = []
            for job_id, state in conn.execute(
                    "SELECT id, state FROM jobs WHERE state IN ('scheduled', 'available',"
                    " 'retryable', 'active') AND spec = ?", (name,)):
                counts[state] += 1
                if state != "active":
                    waiting.append(job_id)
            return counts, waiting

        return await self.readers.run(read)

    async def spec_history(self, name: str) -> list[dict[str, Any]]:
        def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                "SELECT p.checksum, p.previous, p.pushed_at, p.event, v.version FROM spec_pushes p"
                " JOIN spec_versions v ON v.name = p.name AND v.checksum = p.checksum"
                " WHERE p.name = ? ORDER BY p.id",
                (name,),
            ).fetchall()
            return [
                {"checksum": r["checksum"], "previous": r["previous"], "version": r["version"],
                 "pushed_at": rfc3339(r["pushed_at"]), "event": r["event"]}
                for r in rows
            ]

        return await self.readers.run(read)


# The columns _insert_row gives, in order (attempt is always 0).
_INSERTED = ("id", "spec", "queue", "args", "priority", "state", "visibility_timeout",
             "enqueued_at", "run_at", "expires_at", "max_attempts", "max_fails", "backoff_base",
             "backoff_max", "capture_logs", "created_by", "max_worker_deaths")
_INSERT = (
    f"INSERT INTO jobs ({', '.join(_INSERTED[:6])}, attempt, {', '.join(_INSERTED[6:])})"
    f" VALUES ({', '.join('?' * 6)}, 0, {', '.join('?' * (len(_INSERTED) - 6))})"
    " ON CONFLICT(id) DO NOTHING"
)
_RETURNING_ROW = " RETURNING rowid, *"
_RESERVE = (
    "UPDATE jobs SET state = 'active', attempt = ?, worker_id = ?, worker_token = ?,"
    " checksum = ?, server_id = ?, reserved_at = ?, lease_expires_at = ?"
    " WHERE id = ? AND attempt = ?"
    " AND state IN ('available', 'scheduled', 'retryable')"
)
_DUE = "SELECT rowid, id FROM jobs WHERE state = ? AND finished_at < ?"
_SAVE = (
    "UPDATE jobs SET state = ?, worker_id = ?, server_id = CASE WHEN ? THEN NULL ELSE server_id END,"
    " run_at = ?, fails = ?, deaths = ?, budget_start = ?,"
    " cancel_requested = ?, expires_at = ?, finished_at = ?, result = COALESCE(?, result),"
    " errors = CASE WHEN ? IS NULL THEN errors ELSE json_insert(errors, '$[#]', json(?)) END"
    " WHERE id = ? AND attempt = ? AND (? = 0 OR state IN ('discarded', 'cancelled'))"
)  # "attempt = ?": the fence. Only a reservation moves a row's attempt on, so a server
# whose copy of the job is stale (another one reserved it since) changes nothing. A
# retry keeps the attempt: it is fenced on the state instead, whatever the holder, so of
# two retries of one job (two servers, each from its own read) only the first is stored.
# Servers sharing a database (rota/fleet.py) also fence on the holder: a job another
# server took over from this one (its worker moved there) is not this one's to change.
# A retry is any server's to write (a finished row keeps its last holder, for the audit).
_SAVE_SHARED = _SAVE + " AND (server_id IS NULL OR server_id = ? OR ? = 1)"


# A wall-clock step between runs, undone in the live rows' stored moments (deadlines, and
# the enqueue and reservation times beside them): each deadline is again as far away as
# the last run left it. Rows with no deadline (plain waiting jobs, finished ones) keep
# theirs: shown, never judged by.
_SHIFT = (
    "UPDATE jobs SET run_at = run_at + ?, expires_at = expires_at + ?,"
    " lease_expires_at = lease_expires_at + ?, enqueued_at = enqueued_at + ?,"
    " reserved_at = reserved_at + ?"
    " WHERE state IN ('scheduled', 'available', 'retryable', 'active')"
    " AND (run_at IS NOT NULL OR expires_at IS NOT NULL OR lease_expires_at IS NOT NULL)"
)


def _due_in(spans: Sequence[tuple[float, float]]) -> str:
    """_DUE for rows finished within any of these [from, to) spans."""
    terms = [("finished_at < ?" if math.isinf(low) else "(finished_at >= ? AND finished_at < ?)")
             for low, _ in spans]
    return "SELECT rowid, id FROM jobs WHERE state = ? AND (" + " OR ".join(terms) + ")"


def _bounds(spans: Sequence[tuple[float, float]]) -> list[float]:
    return [x for low, high in spans for x in ((high,) if math.isinf(low) else (low, high))]


def _undo_step(conn: sqlite3.Connection, reading: ClockReading) -> float:
    """Compare the clocks now with the last run's reading (one server per file: its
    own); shift the live rows' deadlines by a step found (model.wall_step); keep the
    reading. The step, 0.0 if none."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'clock'").fetchone()
    try:
        last = None if row is None else ClockReading(
            *msgspec.json.decode(row[0], type=tuple[float, float, str]))
    except msgspec.DecodeError:
        last = None  # unreadable: as if there were none
    step = wall_step(last, reading)
    try:
        conn.execute("BEGIN IMMEDIATE")
        if step:
            conn.execute(_SHIFT, (step,) * 5)
        _keep_reading(conn, msgspec.json.encode(tuple(reading)).decode())
        conn.execute("COMMIT")
    except sqlite3.Error as exc:  # a full or read-only disk: start as before, unshifted
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        log.warning("the clock reading could not be checked at start: %s", exc)
        return 0.0
    return step


def _keep_reading(conn: sqlite3.Connection, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('clock', ?)", (value,))


def _insert_row(job: JobRecord) -> tuple[Any, ...]:
    lim = job.limits
    return (job.id, job.spec, job.queue, bytes(job.args).decode(), job.priority, str(job.state),
            job.visibility_timeout, job.enqueued_at, job.run_at, job.expires_at,
            lim.max_attempts, lim.max_fails, lim.backoff_base, lim.backoff_max,
            int(job.capture_logs), job.created_by, lim.max_worker_deaths)


def _moved_on(conn: sqlite3.Connection, jobs: list[JobRecord]) -> list[str]:
    """Of jobs just reserved, those whose rows another reservation did not come from
    here (the row's attempt, worker or state differs from what was written)."""
    lost = []
    for job in jobs:
        row = conn.execute("SELECT attempt, worker_id, state FROM jobs WHERE id = ?",
                           (job.id,)).fetchone()
        if row is None or tuple(row) != (job.attempt, job.worker_id, "active"):
            lost.append(job.id)
    return lost


def _change_row(change: Change) -> tuple[Any, ...]:
    job = change.job
    error = _text(change.error)
    # A waiting job belongs to no worker; a finished one keeps who ran it, for audit.
    worker_id = None if job.state in WAITING_STATES else job.worker_id
    return (str(job.state), worker_id, worker_id is None, job.run_at, job.fails, job.deaths,
            job.budget_start,
            int(job.cancel_requested), job.expires_at, change.finished_at,
            _text(change.result), error, error, job.id, job.attempt, int(change.retry))


def _live_tokens(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    rows = conn.execute("SELECT id, name, scope, queues, hash, created_at FROM tokens"
                        " WHERE revoked_at IS NULL ORDER BY created_at, id")
    return [{**dict(r), "queues": msgspec.json.decode(r["queues"]) if r["queues"] else None}
            for r in rows]


def token_view(row: dict[str, Any]) -> dict[str, Any]:
    """A token as the API and the CLI show it: never its hash."""
    return {"id": row["id"], "name": row["name"], "scope": row["scope"],
            "queues": row["queues"], "created_at": rfc3339(row["created_at"])}


# One statement each for the server's writer (the API) and the CLI's own connection.
def _insert_token(conn: sqlite3.Connection, *, name: str, scope: str,
                  queues: list[str] | None, token_id: str, hashed: str) -> dict[str, Any]:
    if conn.execute("SELECT 1 FROM tokens WHERE name = ? AND revoked_at IS NULL",
                    (name,)).fetchone():
        raise Conflict("token_name_taken", f"a live token is already named {name!r}")
    now = time.time()
    conn.execute("INSERT INTO tokens (id, name, scope, queues, hash, created_at)"
                 " VALUES (?, ?, ?, ?, ?, ?)",
                 (token_id, name, scope, msgspec.json.encode(queues).decode() if queues else None,
                  hashed, now))
    return {"id": token_id, "name": name, "scope": scope, "queues": queues, "created_at": now}


def _revoke_tokens(conn: sqlite3.Connection, id_or_name: str) -> list[dict[str, Any]]:
    rows = conn.execute("UPDATE tokens SET revoked_at = ? WHERE revoked_at IS NULL"
                        " AND (id = ? OR name = ?) RETURNING id, name, scope, queues, created_at",
                        (time.time(), id_or_name, id_or_name)).fetchall()
    return [{**dict(r), "queues": msgspec.json.decode(r["queues"]) if r["queues"] else None}
            for r in rows]


def _open(target: Path | str) -> Any:
    """A connection to the database, migrated first: the SQLite file at ``target``, or
    the PostgreSQL database a URL names (a sqlite3-like rota/pg.py connection)."""
    if pg.is_url(target):
        assert isinstance(target, str)
        pg.migrate(target)
        return pg.connect(target)
    db.migrate(Path(target))
    return db.connect(Path(target))


# -- tokens, from the CLI: straight to the database, so the first token needs no server --
def create_token(path: Path | str, *, name: str, scope: str, queues: list[str] | None,
                 token_id: str, hashed: str) -> None:
    """Raises Conflict (token_name_taken) if a live token has this name. ``path``: the
    file, or a PostgreSQL URL."""
    conn = _open(path)
    try:
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            _insert_token(conn, name=name, scope=scope, queues=queues, token_id=token_id,
                          hashed=hashed)
    finally:
        conn.close()


def server_id_in_use(url: str, server_id: str) -> str | None:
    """Why another live server holds ``server_id`` on this database, or None. A server
    on this host whose process is gone (a crash, restarted under the same name) does
    not count: it takes its own reservations back."""
    conn = _open(url)
    try:
        held = fleet.holder(conn, server_id)
    finally:
        conn.close()
    if held is None:
        return None
    host, pid, left = held
    if host == socket.gethostname() and (pid == os.getpid() or not _alive(pid)):
        return None
    return (f"server id {server_id} is in use by rota serve pid {pid} on {host} (its lease"
            f" runs {max(0.0, left):.1f}s more): give this one another"
            " --server-id")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process, alive
        return True
    return True


def list_tokens(path: Path | str) -> list[dict[str, Any]]:
    conn = _open(path)
    try:
        return _live_tokens(conn)
    finally:
        conn.close()


def revoke_token(path: Path | str, id_or_name: str) -> int:
    """Revoke the live token with this id or name; returns how many were revoked."""
    conn = _open(path)
    try:
        with conn:
            conn.execute("BEGIN IMMEDIATE")
            return len(_revoke_tokens(conn, id_or_name))
    finally:
        conn.close()


def _crash(point: str) -> None:
    """Die at once, as a power cut or kill -9 would (crash-point tests only)."""
    logging.getLogger("rota.server").critical("crash point %s: exiting now", point)
    os._exit(86)


def _text(data: bytes | None) -> str | None:
    return data.decode() if data is not None else None


class _DryRun(Exception):
    def __init__(self, changes: list[SpecChange]) -> None:
        super().__init__("dry run")
        self.changes = changes


def _push_one(conn: sqlite3.Connection, spec: JobSpec, checksum: str, now: float) -> SpecChange:
    row = conn.execute("SELECT checksum, retired_at FROM status_quo WHERE name = ?",
                       (spec.name,)).fetchone()
    previous = row[0] if row else None
    retired = row is not None and row[1] is not None
    if previous == checksum and not retired:
        return SpecChange(spec.name, checksum, previous, "unchanged")
    conn.execute(
        "INSERT OR IGNORE INTO spec_versions (name, checksum, version, body, first_pushed_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (spec.name, checksum, spec.version, msgspec.json.encode(spec).decode(), now),
    )
    conn.execute(
        "INSERT INTO status_quo (name, checksum, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT(name) DO UPDATE SET checksum = excluded.checksum,"
        " updated_at = excluded.updated_at, retired_at = NULL",
        (spec.name, checksum, now),
    )
    conn.execute(
        "INSERT INTO spec_pushes (name, checksum, previous, pushed_at) VALUES (?, ?, ?, ?)",
        (spec.name, checksum, previous, now),
    )
    # Pushing a retired spec again brings it back: "restored" when it is the same version.
    change = ("new" if previous is None else "restored" if previous == checksum
              else "changed")
    return SpecChange(spec.name, checksum, previous, change)


def _retire(conn: sqlite3.Connection, name: str, now: float) -> tuple[str, float, bool] | None:
    """Retire spec ``name``: (its checksum, when it was retired, whether it was already);
    None if it has no status quo."""
    row = conn.execute("SELECT checksum, retired_at FROM status_quo WHERE name = ?",
                       (name,)).fetchone()
    if row is None:
        return None
    if row[1] is not None:
        return row[0], row[1], True
    conn.execute("UPDATE status_quo SET retired_at = ? WHERE name = ?", (now, name))
    conn.execute("INSERT INTO spec_pushes (name, checksum, previous, pushed_at, event)"
                 " VALUES (?, ?, ?, ?, 'retire')", (name, row[0], row[0], now))
    return row[0], now, False


def _made_before(conn: sqlite3.Connection, job: JobRecord, unscoped: str) -> dict[str, Any] | None:
    """The row kept under ``unscoped`` if ``job``'s own id is new and that row was
    created by the same token (a producer's job from before its ids were kept scoped)."""
    found = {row["id"]: dict(row) for row in conn.execute(
        "SELECT rowid, * FROM jobs WHERE id IN (?, ?)", (job.id, unscoped))}
    old = found.get(unscoped)
    if job.id in found or old is None or old["created_by"] != job.created_by:
        return None
    return old


def _fetch_job(conn: sqlite3.Connection, job_id: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT rowid, * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return dict(row) if row else None
