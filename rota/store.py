"""Rota's durable state: jobs, spec versions, the status quo and workers, in one SQLite file.

Every write goes through the single writer thread (``db.Writer``) and is awaited until
its COMMIT; reads run on a reader pool. The in-memory scheduler is rebuilt from
``load()`` at start.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rota import db
from rota.protocol import rfc3339
from rota.specs import JobSpec, spec_from_builtins

TERMINAL_STATES = frozenset({"completed", "failed"})
JOB_STATES = ("available", "active", "completed", "failed")


@dataclass(slots=True)
class Job:
    """A live (not yet terminal) job as the scheduler holds it."""

    id: str
    spec: str
    queue: str
    args: msgspec.Raw
    priority: int
    enqueued_at: float
    seq: int
    visibility_timeout: float | None = None
    state: str = "available"
    attempt: int = 0
    worker_id: str | None = None
    checksum: str | None = None


@dataclass(slots=True)
class Finish:
    """A result the server accepted, to be committed."""

    job_id: str
    state: str
    result: bytes | None
    error: bytes | None
    finished_at: float


@dataclass(slots=True)
class Snapshot:
    status_quo: dict[str, JobSpec]
    checksums: dict[str, str]
    jobs: list[Job]
    requeued: int


@dataclass(slots=True)
class SpecChange:
    name: str
    checksum: str
    previous: str | None
    change: str  # "new" | "changed" | "unchanged"


@dataclass(slots=True)
class Store:
    path: Path
    writer: db.Writer = field(init=False)
    readers: db.Readers = field(init=False)
    checkpointer: db.Checkpointer = field(init=False)

    def __post_init__(self) -> None:
        self.writer = db.Writer(self.path)
        self.readers = db.Readers(self.path)
        self.checkpointer = db.Checkpointer(self.path)

    # -- lifecycle (startup runs in a thread, before the server takes traffic) ----
    def load(self) -> Snapshot:
        db.migrate(self.path)
        conn = db.connect(self.path)
        try:
            return _load(conn)
        finally:
            conn.close()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.writer.start(loop)
        self.checkpointer.start()

    def close(self) -> None:
        self.writer.stop()
        self.readers.close()
        self.checkpointer.stop()

    # -- writes --------------------------------------------------------------------
    async def enqueue(self, job: Job) -> tuple[dict[str, Any], bool]:
        """Insert the job; an existing id gives the stored job back and ``False``."""

        def op(conn: sqlite3.Connection) -> tuple[dict[str, Any], bool]:
            cursor = conn.execute(
                "INSERT INTO jobs (id, spec, queue, args, priority, state, attempt,"
                " visibility_timeout, enqueued_at) VALUES (?, ?, ?, ?, ?, 'available', 0, ?, ?)"
                " ON CONFLICT(id) DO NOTHING",
                (job.id, job.spec, job.queue, bytes(job.args).decode(), job.priority,
                 job.visibility_timeout, job.enqueued_at),
            )
            created = cursor.rowcount == 1
            return _fetch_job(conn, job.id), created

        return await self.writer.submit(op)

    async def reserve(self, jobs: list[Job], now: float) -> None:
        rows = [(j.attempt, j.worker_id, j.checksum, now, j.id) for j in jobs]

        def op(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "UPDATE jobs SET state = 'active', attempt = ?, worker_id = ?, checksum = ?,"
                " reserved_at = ? WHERE id = ?",
                rows,
            )

        await self.writer.submit(op)

    async def finish(self, finishes: list[Finish]) -> None:
        rows = [
            (f.state, _text(f.result), f.finished_at, _text(f.error), _text(f.error), f.job_id)
            for f in finishes
        ]

        def op(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "UPDATE jobs SET state = ?, result = ?, finished_at = ?, errors = CASE"
                " WHEN ? IS NULL THEN errors ELSE json_insert(errors, '$[#]', json(?)) END"
                " WHERE id = ?",
                rows,
            )

        await self.writer.submit(op)

    async def requeue(self, jobs: list[Job], worker_id: str) -> None:
        """Put a gone worker's jobs back; the worker_id guard keeps a newer reservation safe."""
        rows = [(j.id, worker_id) for j in jobs]

        def op(conn: sqlite3.Connection) -> None:
            conn.executemany(
                "UPDATE jobs SET state = 'available', worker_id = NULL"
                " WHERE id = ? AND worker_id = ? AND state = 'active'",
                rows,
            )

        await self.writer.submit(op)

    async def push_specs(self, specs: list[tuple[JobSpec, str]], *, dry_run: bool) -> list[SpecChange]:
        now = time.time()

        def op(conn: sqlite3.Connection) -> list[SpecChange]:
            changes = [_push_one(conn, spec, checksum, now) for spec, checksum in specs]
            if dry_run:
                raise _DryRun(changes)
            return changes

        try:
            return await self.writer.submit(op)
        except _DryRun as dry:  # the savepoint rolled everything back
            return dry.changes

    async def worker_connected(self, row: dict[str, Any]) -> None:
        def op(conn: sqlite3.Connection) -> None:
            cols = ", ".join(row)
            marks = ", ".join("?" for _ in row)
            conn.execute(f"INSERT OR REPLACE INTO workers ({cols}) VALUES ({marks})", list(row.values()))

        await self.writer.submit(op)

    async def worker_disconnected(self, worker_id: str, now: float) -> None:
        def op(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE workers SET disconnected_at = ? WHERE id = ?", (now, worker_id))

        await self.writer.submit(op)

    # -- reads ---------------------------------------------------------------------
    async def get_job(self, job_id: str) -> dict[str, Any] | None:
        return await self.readers.run(lambda conn: _fetch_job(conn, job_id))

    async def queue_counts(self) -> dict[str, dict[str, int]]:
        def read(conn: sqlite3.Connection) -> dict[str, dict[str, int]]:
            counts: dict[str, dict[str, int]] = {}
            for row in conn.execute("SELECT queue, state, count(*) FROM jobs GROUP BY queue, state"):
                counts.setdefault(row[0], dict.fromkeys(JOB_STATES, 0))[row[1]] = row[2]
            return counts

        return await self.readers.run(read)

    async def spec_history(self, name: str) -> list[dict[str, Any]]:
        def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            rows = conn.execute(
                "SELECT p.checksum, p.previous, p.pushed_at, v.version FROM spec_pushes p"
                " JOIN spec_versions v ON v.name = p.name AND v.checksum = p.checksum"
                " WHERE p.name = ? ORDER BY p.id",
                (name,),
            ).fetchall()
            return [
                {"checksum": r["checksum"], "previous": r["previous"], "version": r["version"],
                 "pushed_at": rfc3339(r["pushed_at"])}
                for r in rows
            ]

        return await self.readers.run(read)


def _text(data: bytes | None) -> str | None:
    return data.decode() if data is not None else None


class _DryRun(Exception):
    def __init__(self, changes: list[SpecChange]) -> None:
        super().__init__("dry run")
        self.changes = changes


def _push_one(conn: sqlite3.Connection, spec: JobSpec, checksum: str, now: float) -> SpecChange:
    row = conn.execute("SELECT checksum FROM status_quo WHERE name = ?", (spec.name,)).fetchone()
    previous = row[0] if row else None
    if previous == checksum:
        return SpecChange(spec.name, checksum, previous, "unchanged")
    conn.execute(
        "INSERT OR IGNORE INTO spec_versions (name, checksum, version, body, first_pushed_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (spec.name, checksum, spec.version, msgspec.json.encode(spec).decode(), now),
    )
    conn.execute(
        "INSERT INTO status_quo (name, checksum, updated_at) VALUES (?, ?, ?)"
        " ON CONFLICT(name) DO UPDATE SET checksum = excluded.checksum, updated_at = excluded.updated_at",
        (spec.name, checksum, now),
    )
    conn.execute(
        "INSERT INTO spec_pushes (name, checksum, previous, pushed_at) VALUES (?, ?, ?, ?)",
        (spec.name, checksum, previous, now),
    )
    return SpecChange(spec.name, checksum, previous, "new" if previous is None else "changed")


def _load(conn: sqlite3.Connection) -> Snapshot:
    conn.execute("BEGIN IMMEDIATE")
    # A restart forgets every connection, so no reservation can still be honoured.
    requeued = conn.execute(
        "UPDATE jobs SET state = 'available', worker_id = NULL WHERE state = 'active'"
    ).rowcount
    conn.execute("COMMIT")
    status_quo: dict[str, JobSpec] = {}
    checksums: dict[str, str] = {}
    for row in conn.execute(
        "SELECT q.name, q.checksum, v.body FROM status_quo q"
        " JOIN spec_versions v ON v.name = q.name AND v.checksum = q.checksum"
    ):
        status_quo[row["name"]] = spec_from_builtins(msgspec.json.decode(row["body"]))
        checksums[row["name"]] = row["checksum"]
    jobs = [
        Job(id=r["id"], spec=r["spec"], queue=r["queue"], args=msgspec.Raw(r["args"].encode()),
            priority=r["priority"], enqueued_at=r["enqueued_at"], seq=r["rowid"],
            visibility_timeout=r["visibility_timeout"], attempt=r["attempt"])
        for r in conn.execute(
            "SELECT rowid, * FROM jobs WHERE state = 'available' ORDER BY rowid"
        )
    ]
    return Snapshot(status_quo, checksums, jobs, requeued)


def _fetch_job(conn: sqlite3.Connection, job_id: str) -> dict[str, Any] | None:
    row = conn.execute("SELECT rowid, * FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return dict(row) if row else None


def job_view(row: dict[str, Any]) -> dict[str, Any]:
    """A stored job as the HTTP API shows it."""

    def when(value: float | None) -> str | None:
        return rfc3339(value) if value is not None else None

    return {
        "id": row["id"],
        "spec": row["spec"],
        "queue": row["queue"],
        "state": row["state"],
        "priority": row["priority"],
        "attempt": row["attempt"],
        "args": msgspec.json.decode(row["args"]),
        "worker_id": row["worker_id"],
        "checksum": row["checksum"],
        "visibility_timeout": row["visibility_timeout"],
        "enqueued_at": when(row["enqueued_at"]),
        "reserved_at": when(row["reserved_at"]),
        "finished_at": when(row["finished_at"]),
        "result": msgspec.json.decode(row["result"]) if row["result"] is not None else None,
        "errors": msgspec.json.decode(row["errors"] or "[]"),
    }
