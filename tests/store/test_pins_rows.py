"""The rows push execution's pins stand on (rota/core/pins.py): a job's version follows
from its row, so SQLite must never give a new job a row before a push it came after,
which it would if the newest row were deleted (it reuses MAX(rowid) + 1)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conftest import open_store

from rota.base.specs import Execute, JobSpec, checksum
from rota.core.pins import Pins
from rota.store import writes
from rota.store.ojs_reads import delete_dead
from rota.store.rows import read_windows

INSERT = ("INSERT INTO jobs (id, spec, queue, args, state, enqueued_at, priority, attempt,"
          " dead_letter) VALUES (?, 'hook', 'default', '{}', ?, 0, 0, 1, ?)")


def hook(version: str, url: str) -> JobSpec:
    return JobSpec(name="hook", version=version, execute=Execute(url=url, secret="main"))


def test_a_job_enqueued_after_a_push_is_its_versions_whatever_was_deleted(tmp_path: Path):
    conn = open_store(tmp_path)
    try:
        check_rows(conn)
    finally:
        conn.close()


def check_rows(conn: Any) -> None:
    v1, v2 = hook("1", "https://a.example/run"), hook("2", "https://b.example/run")
    writes.push_one(conn, v1, checksum(v1), time.time())
    conn.execute(INSERT, ("dead", "discarded", 1))  # the newest row, in the dead letter
    assert writes.push_one(conn, v2, checksum(v2), time.time()).first_seq == 2
    assert delete_dead(conn, "dead")  # out of the dead letter (its row kept)
    assert conn.execute("SELECT count(*) FROM jobs WHERE dead_letter = 1").fetchone()[0] == 0
    conn.execute(INSERT, ("new", "available", 0))  # enqueued under v2
    rowid = conn.execute("SELECT rowid FROM jobs WHERE id = 'new'").fetchone()[0]
    pins = Pins()
    pins.load(read_windows(conn))
    assert pins.pin("hook", rowid) == checksum(v2)
