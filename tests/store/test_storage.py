"""A full or failing disk is an expected fault: 503 with a precise code and Retry-After,
a degraded /healthz, results rejected with the reason, recovery by itself, and nothing
acknowledged lost.

The faults are real: SQLite's own errors for the mapping; a ``rota serve`` subprocess
whose file-size limit (RLIMIT_FSIZE, lowered from outside with prlimit, no root needed)
makes its writes fail with an I/O error until the limit is raised again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import start_server, stop_server, write_spec
from helpers import RawWorkers, spawn_serve, wait_until
from helpers import free_port
from test_crash import read_jobs

from rota import JobContext, Worker
from rota.store import sqlite as db, health as db_health, migrations as db_migrations
from rota.base.errors import StorageError


# -- the mapping, on SQLite's own errors ---------------------------------------------------
def sqlite_error(tmp_path: Path, fault: str) -> sqlite3.Error:
    """The error SQLite raises for ``fault``, provoked for real."""
    path = tmp_path / f"{fault}.db"
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, data BLOB)")
    try:
        if fault == "full":
            setup.execute("PRAGMA max_page_count = 2")
            setup.execute("INSERT INTO t (data) VALUES (zeroblob(100000))")
        elif fault == "read_only":
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as ro:
                ro.execute("INSERT INTO t (data) VALUES (1)")
        elif fault == "busy":
            setup.execute("BEGIN IMMEDIATE")
            other = sqlite3.connect(path, timeout=0, isolation_level=None)
            with contextlib.closing(other):
                other.execute("BEGIN IMMEDIATE")
        elif fault == "not_a_database":
            (tmp_path / "junk.db").write_bytes(b"not a database, " * 1024)
            with contextlib.closing(sqlite3.connect(tmp_path / "junk.db")) as junk:
                junk.execute("SELECT * FROM sqlite_master")
        elif fault == "constraint":
            setup.execute("INSERT INTO t (id) VALUES (1), (1)")
        elif fault == "syntax":
            setup.execute("SELEC 1")
    except sqlite3.Error as exc:
        return exc
    finally:
        setup.close()
    raise AssertionError(f"{fault} raised nothing")


@pytest.mark.parametrize(("fault", "code", "name"), [
    ("full", "storage_full", "SQLITE_FULL"),
    ("read_only", "storage_read_only", "SQLITE_READONLY"),
    ("busy", "storage_busy", "SQLITE_BUSY"),
    ("not_a_database", "storage_corrupt", "SQLITE_NOTADB"),
    ("constraint", None, "SQLITE_CONSTRAINT_PRIMARYKEY"),
    ("syntax", None, "SQLITE_ERROR"),
])
def test_sqlite_errors_that_blame_the_storage_become_storage_errors(
        tmp_path: Path, fault: str, code: str | None, name: str):
    exc = sqlite_error(tmp_path, fault)
    assert exc.sqlite_errorname == name
    error = db.storage_error(exc)
    if code is None:  # the statement's fault, not the disk's: left as it is
        assert error is None
        return
    assert isinstance(error, StorageError)
    assert (error.code, error.__cause__) == (code, exc)
    assert name in error.message and 1 <= error.retry_after < db_health.RECOVER_AFTER


def test_extended_codes_map_by_their_primary_code():
    assert db.classify("SQLITE_IOERR_WRITE")[0] == "storage_io_error"
    assert db.classify("SQLITE_IOERR_FSYNC")[0] == "storage_io_error"
    assert db.classify("SQLITE_READONLY_DBMOVED")[0] == "storage_read_only"
    assert db.classify("SQLITE_CORRUPT_INDEX")[0] == "storage_corrupt"
    assert db.classify("SQLITE_BUSY_SNAPSHOT")[0] == "storage_busy"
    assert db.classify("SQLITE_FULLY") is None  # a prefix is not a code
    assert db.classify(None) is None
    assert db.storage_error(ValueError("not SQLite")) is None
    done = StorageError("storage_full", "full", 3)
    assert db.storage_error(done) is done


def test_health_logs_once_per_episode_and_recovers_after_a_quiet_hold(
        caplog: pytest.LogCaptureFixture):
    now = [100.0]
    health = db_health.Health(clock=lambda: now[0], wall=lambda: 1_000 + now[0], hold=5.0)
    full = StorageError("storage_full", "the disk is full", 3)
    with caplog.at_level(logging.DEBUG, "rota.server"):
        health.succeeded()  # healthy: nothing to say
        for _ in range(3):
            assert health.failed(full) is full
            now[0] += 1
        assert health.degraded == db_health.Degraded("storage_full", "the disk is full", 1_100.0)
        health.succeeded()  # 1 s after the last failure: too soon to trust
        assert health.degraded is not None
        health.failed(StorageError("storage_io_error", "EIO", 3))  # the cause changes
        assert health.degraded == db_health.Degraded("storage_io_error", "EIO", 1_100.0)
        now[0] += 5
        health.succeeded()
    assert health.degraded is None
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("ERROR", "storage degraded code=storage_full: the disk is full; refused with 503"
                  " until it recovers"),
        ("ERROR", "storage degraded code=storage_io_error: EIO (was storage_full); refused"
                  " with 503 until it recovers"),
        ("WARNING", "storage recovered code=storage_io_error after 8.0s failed_operations=4"),
    ]


# -- a disk that fails writes, then recovers -------------------------------------------------
def batch(count: int) -> dict[str, Any]:
    return {"jobs": [{"spec": "echo", "args": {"pad": "x" * 200}} for _ in range(count)]}


async def test_io_errors_answer_503_then_the_server_recovers_by_itself(tmp_path: Path):
    port = free_port()
    path = tmp_path / "rota.db"
    log = tmp_path / "server.log"
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10)
    # --recover-after 2: the quiet hold before recovery, 5 s by default, is not under test
    proc = await spawn_serve(http, ["--port", str(port), "--db", str(path), "--recover-after", "2",
                                    "--log-level", "warning"], log)
    acked: set[str] = set()
    refused: list[httpx.Response] = []

    async def enqueue_batch() -> httpx.Response:
        response = await http.post("/jobs/batch", json=batch(50))
        if response.status_code == 200:
            acked.update(r["job"]["id"] for r in response.json()["results"])
        else:
            refused.append(response)
        return response

    try:
        spec = write_spec(tmp_path / "specs", "echo")
        assert (await http.put("/specs", json={"specs": [{"name": spec.name,
                                                          "version": spec.version}]})
                ).status_code == 200
        await enqueue_batch()
        assert len(acked) == 50
        # Writes past this offset now fail with EFBIG (SIGXFSZ is ignored by the server):
        # SQLite's "disk I/O error". The database file can no longer grow, so once a
        # page beyond it is in the WAL no checkpoint completes, and the WAL fills too.
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE,
                         (os.path.getsize(path) + (64 << 10), hard))

        async def until_refused() -> httpx.Response | None:
            response = await enqueue_batch()
            return response if response.status_code != 200 else None

        response = await wait_until(until_refused, timeout=30, what="a 503")
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "storage_io_error"
        assert "SQLITE_IOERR" in response.json()["error"]["message"]
        assert 1 <= int(response.headers["Retry-After"]) <= 5

        async def single_refused() -> httpx.Response | None:
            # A small commit may still fit in the WAL's old space for a while (the
            # checkpoint that rewinds the WAL succeeds until the file must grow).
            await enqueue_batch()
            response = await http.post("/jobs", json={"spec": "echo", "args": {}})
            if response.status_code == 201:
                acked.add(response.json()["job"]["id"])
            return response if response.status_code == 503 else None

        single = await wait_until(single_refused, timeout=30, what="a single enqueue's 503")
        assert single.json()["error"]["code"] == "storage_io_error"
        assert single.headers["Retry-After"] == response.headers["Retry-After"]

        async def degraded() -> dict[str, Any] | None:
            await enqueue_batch()  # keep failing: a lull would let it recover early
            health = (await http.get("/healthz")).json()
            return health if health["status"] == "degraded" else None

        health = await wait_until(degraded, timeout=10, what="/healthz degraded")
        assert health["storage"]["code"] == "storage_io_error"
        assert health["storage"]["since"].endswith("Z")
        some = next(iter(acked))  # reads are still served
        assert (await http.get(f"/jobs/{some}")).json()["state"] == "available"

        # The limit goes back up: no restart, and the server notices by itself.
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, hard))

        async def healthy() -> bool:
            health = (await http.get("/healthz")).json()
            return health["status"] == "ok" and health["storage"] is None

        await wait_until(healthy, timeout=db_health.RECOVER_AFTER + 20, what="recovery")
        assert (await enqueue_batch()).status_code == 200
    finally:
        await http.aclose()
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
    assert proc.returncode == 0
    # Every job that was acknowledged is in the file, after a restart's worth of closing.
    stored = read_jobs(path)
    assert acked <= set(stored) and len(acked) >= 100
    text = log.read_text()
    assert "Traceback" not in text, text
    degraded_lines = text.count("storage degraded code=storage_io_error")
    assert 1 <= degraded_lines <= 2 < len(refused), text  # not a line per refusal
    assert text.count("storage recovered code=storage_io_error") == degraded_lines, text
    errors = [line for line in text.splitlines()
              if " ERROR " in line and "storage degraded" not in line]
    assert errors == [], text


# -- a quota (--max-db-size): full on demand -----------------------------------------------
QUOTA = 340 << 10  # (m024's two webhook tables and their three indexes take five pages)


async def test_a_full_quota_refuses_new_jobs_and_the_accepted_ones_still_finish(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    live = await start_server(tmp_path, max_db_size=QUOTA)
    acked: list[str] = []
    refused: list[httpx.Response] = []

    async def enqueue(body: dict[str, Any], path: str = "/jobs/batch") -> httpx.Response:
        response = await live.http.post(path, json=body)
        if response.status_code == 200:
            acked.extend(r["job"]["id"] for r in response.json()["results"])
        elif response.status_code == 201:
            acked.append(response.json()["job"]["id"])
        else:
            refused.append(response)
        return response

    try:
        specs = tmp_path / "specs"
        await live.push(write_spec(specs, "echo"))

        async def batch_refused() -> httpx.Response | None:
            response = await enqueue(batch(20))
            return response if response.status_code != 200 else None

        response = await wait_until(batch_refused, timeout=30, what="a full quota")
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "storage_full" and "--max-db-size" in error["message"]
        assert int(response.headers["Retry-After"]) >= 1
        # The quota was spent on jobs, not refused at once: three batches of 20 fit (five
        # before m012's servers table and m021's dead-letter index took pages of the 256 KiB;
        # 20 KiB more since m024's webhook tables).
        assert len(acked) >= 60

        async def single_refused() -> httpx.Response | None:  # a lone job may still fit
            response = await enqueue({"spec": "echo", "args": {}}, "/jobs")
            return response if response.status_code != 201 else None

        single = await wait_until(single_refused, timeout=10, what="a single job refused")
        assert single.status_code == 503 and single.json()["error"]["code"] == "storage_full"
        assert single.headers["Retry-After"] == response.headers["Retry-After"]
        assert (await live.job(acked[0]))["state"] == "available"  # reads go on
        # A job sent again with its id (its answer was lost) is found, full or not; a
        # batch of such jobs too; one new job among them spoils the batch.
        first = await live.job(acked[0])
        again = await live.http.post("/jobs", json={"spec": "echo", "args": first["args"],
                                                    "id": acked[0]})
        assert (again.status_code, again.json()["created"]) == (200, False), again.text
        repeat = [{"spec": "echo", "args": (await live.job(i))["args"], "id": i}
                  for i in acked[:3]]
        answer = await live.http.post("/jobs/batch", json={"jobs": repeat})
        assert [r["status"] for r in answer.json()["results"]] == [200, 200, 200]
        mixed = await live.http.post("/jobs/batch", json={"jobs": repeat + [
            {"spec": "echo", "args": {}, "id": "brand-new"}]})
        assert mixed.status_code == 503

        async def degraded() -> dict[str, Any] | None:
            await enqueue({"spec": "echo", "args": {}}, "/jobs")
            health = (await live.http.get("/healthz")).json()
            return health if health["status"] == "degraded" else None

        health = await wait_until(degraded, timeout=10, what="/healthz degraded")
        assert health["storage"]["code"] == "storage_full"

        # Every job acknowledged still runs and finishes: the quota kept room for it.
        worker = Worker(specs_dir=specs, heartbeat_interval=0.2, concurrency=20,
                        url=live.ws)

        @worker.handler("echo")
        async def echo(ctx: JobContext) -> dict[str, Any]:
            return {"done": ctx.id}

        running = asyncio.create_task(worker.run(), name="sdk-worker")
        try:
            async def all_done() -> bool:
                counts = (await live.http.get("/queues")).json()["queues"][0]["counts"]
                return counts.get("completed") == len(acked)

            await wait_until(all_done, timeout=30, what="every acknowledged job completed")
        finally:
            worker.stop()
            await asyncio.wait_for(running, timeout=10)
    finally:
        await stop_server(live)
    stored = read_jobs(tmp_path / "rota.db")
    assert {job_id: stored[job_id]["state"] for job_id in acked} == dict.fromkeys(
        acked, "completed")
    assert len(stored) == len(acked)  # and nothing refused got in
    assert os.path.getsize(tmp_path / "rota.db") <= QUOTA
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors and all(m.startswith("storage degraded code=storage_full") for m in errors)
    assert len(errors) < len(refused)  # not a line per refused request


async def test_a_result_past_the_quota_is_rejected_as_storage_full_and_sent_again(
        tmp_path: Path):
    """The quota's room for a job is for a small result: a large one may not fit. It is
    rejected with the reason, the job stays with its worker, and a result that fits is
    then accepted."""
    live = await start_server(tmp_path, max_db_size=QUOTA)
    workers = RawWorkers(live.ws)
    try:
        echo = write_spec(tmp_path, "echo")
        await live.push(echo)
        worker = await workers()
        await worker.register([echo])
        job = await live.enqueue("echo")
        [copy] = await worker.jobs(1)
        ack = await worker.complete(copy, result="x" * QUOTA)
        [rejection] = ack["rejected"]
        assert rejection["reason"].startswith("could not be stored (storage_full: the"
                                              " database or its disk is full (SQLITE_FULL))")
        assert rejection["reason"].endswith("; report it again")
        assert (await live.job(job["id"]))["state"] == "active"
        ack = await worker.complete(copy, result="small")
        assert ack["accepted"] == [job["id"]]
        assert (await live.job(job["id"]))["result"] == "small"
    finally:
        await workers.close()
        await stop_server(live)


# -- an operator's action the disk refuses --------------------------------------------------
def refuse_writes(monkeypatch: pytest.MonkeyPatch, live: Any) -> None:
    """Every plain write fails as on a full disk (the quota would spare a cancel)."""
    def refused(self: Any, changes: Any, linger: bool = False) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        future.set_exception(StorageError("storage_full", "the disk is full", 1))
        return future

    monkeypatch.setattr(type(live.coordinator.store), "save", refused)


async def test_a_cancel_or_retry_the_disk_refuses_leaves_the_job_as_it_was(
        live: Any, sdk_worker: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    await live.push(write_spec(tmp_path, "echo"))
    later = await live.enqueue("echo", {"n": 1}, delay=3600)  # scheduled: held whole
    refuse_writes(monkeypatch, live)
    refused = await live.http.delete(f"/jobs/{later['id']}")
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "storage_full")
    monkeypatch.undo()
    held = live.coordinator.engine.scheduler.jobs[later["id"]]
    assert held.state == "scheduled" and not held.cancel_requested  # as the row says
    assert (await live.job(later["id"]))["state"] == "scheduled"
    assert (await live.http.delete(f"/jobs/{later['id']}")).status_code == 200

    # A retry whose row is refused puts nothing back in memory either.
    refuse_writes(monkeypatch, live)
    refused = await live.http.post(f"/jobs/{later['id']}/retry")
    assert (refused.status_code, refused.json()["error"]["code"]) == (503, "storage_full")
    monkeypatch.undo()
    assert not live.coordinator.engine.is_live(later["id"])
    assert (await live.job(later["id"]))["state"] == "cancelled"
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)
    worker.handler("echo")(lambda ctx: ctx.args)
    await sdk_worker(worker)
    again = await live.http.post(f"/jobs/{later['id']}/retry")
    assert again.status_code == 200
    done = await live.wait_state(later["id"], "completed")
    assert (done["result"], done["attempt"]) == ({"n": 1}, 1)


async def test_serve_on_a_file_it_cannot_use_says_so_in_one_line(tmp_path: Path):
    from helpers import rota

    damaged = tmp_path / "notes.db"
    damaged.write_bytes(b"these are not the pages you are looking for" * 100)
    # (and closes what it opened: Python 3.13 warns of a connection left open)
    code, out, err = await rota("serve", "--db", str(damaged), "--port", "0",
                                env={"PYTHONWARNINGS": "always::ResourceWarning"})
    assert code == 1 and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert str(damaged) in line and "storage_corrupt" in line and "not an SQLite database" in line


async def test_serve_refuses_a_database_written_by_a_newer_rota(tmp_path: Path):
    from helpers import rota

    path = tmp_path / "rota.db"
    db_migrations.migrate(path)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at)"
                     " VALUES ('rota', 'm999_from_the_future', '2027-01-01')")
        conn.execute("UPDATE meta SET value = '9.9.0' WHERE key = 'migrated_by'")
    code, out, err = await rota("serve", "--db", str(path), "--port", "0")
    assert code == 1 and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert "written by Rota 9.9.0, and this is Rota " in line and "m999_from_the_future" in line
    with contextlib.closing(sqlite3.connect(path)) as conn:  # and it changed nothing
        names = [r[0] for r in conn.execute("SELECT name FROM _sqlite_migrations")]
    assert names[-1] == "m999_from_the_future"


async def test_a_quota_measure_that_fails_after_a_commit_keeps_the_commit_and_the_writer(
        tmp_path: Path) -> None:
    """--max-db-size measures the database after each commit; that measure failing (on
    PostgreSQL, a connection lost just after its COMMIT) fails neither the committed
    write nor the writer thread: the next write goes through and is measured."""
    from rota.store.writer import Writer

    class Flaky(Writer):
        failures = 1

        def measure(self, conn: Any) -> int:
            if self.failures:
                self.failures -= 1
                raise sqlite3.OperationalError("the connection went away")
            return super().measure(conn)

    path = tmp_path / "rota.db"
    db_migrations.migrate(path)
    writer = Flaky(path, max_bytes=1 << 30)
    writer.start(asyncio.get_running_loop())
    try:
        put = "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)"
        assert await writer.submit(lambda c: c.execute(put, ("a", "1")) and "ok") == "ok"
        assert await writer.submit(lambda c: c.execute(put, ("b", "2")) and "ok") == "ok"
        assert writer.used_bytes > 0 and writer.failures == 0
    finally:
        await asyncio.to_thread(writer.stop)
