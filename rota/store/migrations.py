"""SQLite's schema, built step by step: one migration per change, in order
(rota/store/schema.py describes the result; tests/store/test_schema.py checks that they agree).
A file a newer Rota migrated is refused (``sqlite.NewerDatabase``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import sqlite_utils

from rota.store.sqlite import NewerDatabase, _version, connect

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
    # Only a hash of each token's secret is kept (rota/core/auth.py).
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
    # Finished jobs are pruned oldest first by state (rota/core/retention.py): an index on
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
    # GET /jobs, newest first, with 1,000,000 jobs (rota/store/lookup.py): one walk per state
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
    # schema is one description (rota/store/schema.py) for both stores.
    db["jobs"].add_column("server_id", str)
    db["servers"].create({"id": str, "host": str, "pid": int, "url": str, "started_at": float,
                          "lease_expires_at": float, "stopped_at": float}, pk="id")


@migrations()
def m013_worker_token(db: sqlite_utils.Database) -> None:
    # The id of the token the holding worker connected with: only a worker with that
    # token may reclaim the job, after a lost connection, a restart, or on another server
    # (docs/protocol.md, §2). NULL: reserved by a worker without a token.
    db["jobs"].add_column("worker_token", str)


@migrations()
def m014_throughput(db: sqlite_utils.Database) -> None:
    # The per-minute counts of the throughput chart, kept for the next start: each server
    # adds what it counted since it last wrote (rota/store/writes.py, keep_throughput);
    # minutes past the hour shown are deleted as it writes.
    columns: dict[str, type] = {"minute": int, "server": str, "queue": str, "spec": str}
    columns |= dict.fromkeys(("enqueued", "completed", "failed", "retried", "discarded",
                              "cancelled"), int)
    db["throughput"].create(columns, pk=("minute", "server", "queue", "spec"),
                            not_null=set(columns) - {"minute", "server", "queue", "spec"},
                            defaults=dict.fromkeys(list(columns)[4:], 0))


@migrations()
def m015_flow_control(db: sqlite_utils.Database) -> None:
    # Flow control (README, Flow control): a job's concurrency key and the worker labels
    # it requires (a JSON list; NULL: none); limits set at runtime, a rule as JSON per
    # scope ("queue" or "spec", and its name); and the starts that rate limits count
    # (name "spec:send_email", key "" for the scope's own), so a restart keeps a window.
    db["jobs"].add_column("concurrency_key", str)
    db["jobs"].add_column("labels", str)
    db["limits"].create({"kind": str, "name": str, "rule": str, "updated_at": float,
                         "updated_by": str}, pk=("kind", "name"), not_null={"rule"})
    db["limit_starts"].create({"id": int, "name": str, "key": str, "at": float}, pk="id",
                              not_null={"name", "key", "at"}, defaults={"key": ""})
    db["limit_starts"].create_index(["name", "key", "at"])


@migrations()
def m016_unique_keys(db: sqlite_utils.Database) -> None:
    # Unique jobs (rota/core/unique.py): one row per key, naming the job that holds it,
    # written in the enqueue transaction. The primary key makes a second claim meet the
    # first; job_id finds a job's key for its view.
    db["unique_keys"].create({"key": str, "job_id": str, "covers": str, "until": float},
                             pk="key", not_null={"job_id", "covers"})
    db["unique_keys"].create_index(["job_id"])


@migrations()
def m017_active_keys(db: sqlite_utils.Database) -> None:
    # The flow-control guard counts the active jobs of a concurrency key (rota/store/
    # limits.py): partial indexes of keyed active jobs make that a lookup, not a scan.
    for column in ("spec", "queue"):
        db.execute(f"CREATE INDEX idx_jobs_active_{column}_key ON jobs ({column},"
                   " concurrency_key) WHERE state = 'active' AND concurrency_key IS NOT NULL")


@migrations()
def m018_job_origins(db: sqlite_utils.Database) -> None:
    # Where a job came from (issue 24): the workflow it is a step of and its node there,
    # what its workflow passes it (JSON), and the cron schedule whose tick made it. The
    # partial indexes hold only the jobs that have one.
    for column, kind in (("workflow_id", str), ("workflow_node", int),
                         ("parent_results", str), ("schedule", str)):
        db["jobs"].add_column(column, kind)
    db.execute("CREATE INDEX idx_jobs_workflow ON jobs (workflow_id, workflow_node)"
               " WHERE workflow_id IS NOT NULL")
    db.execute("CREATE INDEX idx_jobs_schedule ON jobs (schedule, state)"
               " WHERE schedule IS NOT NULL")


@migrations()
def m019_schedules(db: sqlite_utils.Database) -> None:
    # Cron schedules (rota/store/ticks.py): the definition as JSON, whether it is paused,
    # the instant its ticks count from (made, resumed, its expression changed), the last
    # tick decided and the job it made. The fire transaction reads and writes the row
    # (locked on PostgreSQL), so every server sees the same last tick.
    db["schedules"].create({"name": str, "definition": str, "paused": int, "created_at": float,
                            "updated_at": float, "counted_from": float, "last_tick": float,
                            "last_job_id": str, "last_outcome": str, "run_count": int},
                           pk="name", not_null={"definition", "paused", "counted_from",
                                                "run_count"},
                           defaults={"paused": 0, "run_count": 0})


@migrations()
def m020_workflows(db: sqlite_utils.Database) -> None:
    # Workflows (rota/core/workflows.py): one row each, with its counts and the limit on
    # what its steps pass on; and one row per node of its tree, numbered in preorder
    # (end_node: the last node of its subtree, so a subtree is a range of the key).
    db["workflows"].create(
        {"id": str, "type": str, "name": str, "state": str, "digest": str,
         "created_at": float, "started_at": float, "finished_at": float, "job_count": int,
         "completed_count": int, "failed_count": int, "steps_total": int, "error": str,
         "created_by": str, "max_parent_results": int},
        pk="id", not_null={"type", "state", "digest", "created_at", "job_count",
                           "completed_count", "failed_count", "steps_total",
                           "max_parent_results"},
        defaults={"completed_count": 0, "failed_count": 0})
    db["workflows"].create_index(["created_at"])
    db["workflow_nodes"].create(
        {"workflow_id": str, "node": int, "parent": int, "end_node": int, "kind": str,
         "position": int, "role": str, "state": str, "job_id": str, "spec": str,
         "remaining": int, "failed": int, "result": str, "error": str,
         "parent_results": str},
        pk=("workflow_id", "node"), not_null={"end_node", "kind", "position", "state",
                                              "remaining", "failed"},
        defaults={"remaining": 0, "failed": 0})
    db["workflow_nodes"].create_index(["workflow_id", "parent"])


@migrations()
def m021_ojs(db: sqlite_utils.Database) -> None:
    # The OJS binding (docs/ojs.md): a job's OJS-only parts as JSON (rota/base/ojs.py
    # OjsExtras; NULL for a Rota job), and whether it was discarded into the dead-letter
    # list (on_exhaustion "dead_letter"), which a partial index finds.
    db["jobs"].add_column("ojs", str)
    db["jobs"].add_column("dead_letter", int, not_null_default=0)
    db.execute("CREATE INDEX jobs_dead_letter ON jobs (dead_letter, finished_at)"
               " WHERE dead_letter = 1")


@migrations()
def m022_secrets(db: sqlite_utils.Database) -> None:
    # Endpoint signing secrets (rota/store/secrets.py), kept as given: HMAC needs the
    # value itself. ``previous``: the value a rotation replaced, valid until
    # ``previous_until`` so that receivers can switch over.
    db["secrets"].create({"name": str, "value": str, "previous": str, "rotated_at": float,
                          "previous_until": float, "created_at": float, "updated_at": float},
                         pk="name", not_null={"value", "created_at", "updated_at"})


@migrations()
def m023_execute(db: sqlite_utils.Database) -> None:
    # Push execution (rota/core/pins.py): the first job row enqueued after each push, so
    # a job's version follows from its row. NULL for pushes made before this column.
    db["spec_pushes"].add_column("first_seq", int)


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

