"""The store's tables as they are now, described once for both backends.

SQLite builds them step by step with its migrations (rota/store/migrations.py, m001..);
PostgreSQL's DDL is made from this description (rota/store/pg_sql.py). tests/store/test_schema.py
checks that the SQLite migrations build exactly what is described here, so a change to
one without the other fails there. Both backends record the names in ``MIGRATIONS`` as
applied, so a Rota that finds a name it does not know refuses the database
(sqlite.NewerDatabase).

Types are SQLite's three (what the store writes and reads): TEXT, INTEGER, REAL.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every migration, in order: the names rota/store/migrations.py's functions have.
MIGRATIONS = (
    "m001_initial", "m002_lifecycle", "m003_failed_is_discarded", "m004_live_status",
    "m005_tokens", "m006_poison", "m007_storage_probe", "m008_retention",
    "m009_retired_specs", "m010_meta", "m011_operator", "m012_servers", "m013_worker_token",
    "m014_throughput", "m015_flow_control", "m016_unique_keys", "m017_active_keys",
    "m018_job_origins", "m019_schedules", "m020_workflows", "m021_ojs",
    "m022_secrets",
    "m023_execute",
)


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str  # "TEXT" | "INTEGER" | "REAL"
    not_null: bool = False
    default: str | None = None  # an SQL literal


@dataclass(frozen=True, slots=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    pk: tuple[str, ...]
    # SQL that names ``rowid`` (the jobs table's insertion order) must work on both: in
    # SQLite it is the hidden row id, in PostgreSQL a real identity column of this name.
    rowid: bool = False

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


@dataclass(frozen=True, slots=True)
class Index:
    name: str
    table: str
    columns: tuple[str, ...]
    where: str | None = None  # a partial index's condition, as SQL both engines read


def _cols(spec: str) -> tuple[Column, ...]:
    """Columns from ``"name TYPE [NOT NULL] [=default], ..."``: a table reads as a line."""
    out = []
    for part in spec.split(","):
        words = part.split()
        name, kind, rest = words[0], words[1], words[2:]
        default = next((w[1:] for w in rest if w.startswith("=")), None)
        out.append(Column(name, kind, not_null="NOT" in rest, default=default))
    return tuple(out)


# Cold states only: every job is inserted available and reserved active, so the indexes
# of m011 leave those two out and cost an enqueue or a reservation nothing.
COLD = "state NOT IN ('available', 'active')"
ACTIVE_KEYED = "state = 'active' AND concurrency_key IS NOT NULL"

TABLES: tuple[Table, ...] = (
    Table("jobs", _cols(
        "id TEXT, spec TEXT NOT NULL, queue TEXT NOT NULL, args TEXT NOT NULL,"
        " priority INTEGER NOT NULL, state TEXT NOT NULL, attempt INTEGER NOT NULL =0,"
        " worker_id TEXT, checksum TEXT, visibility_timeout REAL, enqueued_at REAL NOT NULL,"
        " reserved_at REAL, finished_at REAL, result TEXT, errors TEXT ='[]',"
        " run_at REAL, lease_expires_at REAL, expires_at REAL, max_attempts INTEGER,"
        " max_fails INTEGER, backoff_base REAL, backoff_max REAL,"
        " fails INTEGER NOT NULL =0, budget_start INTEGER NOT NULL =0,"
        " cancel_requested INTEGER NOT NULL =0, capture_logs INTEGER NOT NULL =0,"
        " progress_percent REAL, progress_message TEXT, progress_at REAL, created_by TEXT,"
        " deaths INTEGER NOT NULL =0, max_worker_deaths INTEGER, server_id TEXT,"
        " worker_token TEXT, concurrency_key TEXT, labels TEXT, workflow_id TEXT,"
        " workflow_node INTEGER, parent_results TEXT, schedule TEXT, ojs TEXT,"
        " dead_letter INTEGER NOT NULL =0"),
        pk=("id",), rowid=True),
    Table("spec_versions", _cols("name TEXT, checksum TEXT, version TEXT, body TEXT,"
                                 " first_pushed_at REAL"), pk=("name", "checksum")),
    Table("status_quo", _cols("name TEXT, checksum TEXT, updated_at REAL, retired_at REAL"),
          pk=("name",)),
    Table("spec_pushes", _cols("id INTEGER, name TEXT, checksum TEXT, previous TEXT,"
                               " pushed_at REAL, event TEXT NOT NULL ='push', first_seq INTEGER"),
          pk=("id",)),
    Table("workers", _cols("id TEXT, hostname TEXT, pid INTEGER, queues TEXT, labels TEXT,"
                           " concurrency INTEGER, specs TEXT, connected_at REAL,"
                           " disconnected_at REAL"), pk=("id",)),
    Table("job_logs", _cols("id INTEGER, job_id TEXT, attempt INTEGER, at REAL, kind TEXT,"
                            " level TEXT, message TEXT"), pk=("id",)),
    Table("tokens", _cols("id TEXT, name TEXT, scope TEXT, queues TEXT, hash TEXT,"
                          " created_at REAL, revoked_at REAL"), pk=("id",)),
    Table("storage_probe", _cols("id INTEGER, at REAL"), pk=("id",)),
    Table("meta", _cols("key TEXT, value TEXT"), pk=("key",)),
    Table("queues", _cols("name TEXT, paused INTEGER, updated_at REAL"), pk=("name",)),
    # One row per Rota server sharing the database (m012), with its lease.
    Table("servers", _cols("id TEXT, host TEXT, pid INTEGER, url TEXT, started_at REAL,"
                           " lease_expires_at REAL, stopped_at REAL"), pk=("id",)),
    # The jobs counted per minute, per server and (queue, spec) (m014): a restart loads
    # its own back, so the throughput chart and "the last hour" survive it.
    Table("throughput", _cols(
        "minute INTEGER, server TEXT, queue TEXT, spec TEXT, enqueued INTEGER NOT NULL =0,"
        " completed INTEGER NOT NULL =0, failed INTEGER NOT NULL =0,"
        " retried INTEGER NOT NULL =0, discarded INTEGER NOT NULL =0,"
        " cancelled INTEGER NOT NULL =0"), pk=("minute", "server", "queue", "spec")),
    # Flow control (m015): limits set at runtime (``rota limits set``), by scope, the rule
    # as JSON; and the starts that rate limits count, kept across restarts (pruned).
    Table("limits", _cols("kind TEXT, name TEXT, rule TEXT NOT NULL, updated_at REAL,"
                          " updated_by TEXT"), pk=("kind", "name")),
    Table("limit_starts", _cols("id INTEGER, name TEXT NOT NULL, key TEXT NOT NULL ='',"
                                " at REAL NOT NULL"), pk=("id",)),
    # Unique jobs' keys (m016): the job holding each, what it holds it for, and until when.
    Table("unique_keys", _cols("key TEXT, job_id TEXT NOT NULL, covers TEXT NOT NULL,"
                               " until REAL"), pk=("key",)),
    # Cron schedules (m019): the definition as JSON and the state of its ticks.
    Table("schedules", _cols("name TEXT, definition TEXT NOT NULL, paused INTEGER NOT NULL =0,"
                             " created_at REAL, updated_at REAL, counted_from REAL NOT NULL,"
                             " last_tick REAL, last_job_id TEXT, last_outcome TEXT,"
                             " run_count INTEGER NOT NULL =0"), pk=("name",)),
    # Workflows (m020): one row each, and one per node of its tree (rota/store/flows.py).
    Table("workflows", _cols(
        "id TEXT, type TEXT NOT NULL, name TEXT, state TEXT NOT NULL, digest TEXT NOT NULL,"
        " created_at REAL NOT NULL, started_at REAL, finished_at REAL,"
        " job_count INTEGER NOT NULL, completed_count INTEGER NOT NULL =0,"
        " failed_count INTEGER NOT NULL =0, steps_total INTEGER NOT NULL, error TEXT,"
        " created_by TEXT, max_parent_results INTEGER NOT NULL"), pk=("id",)),
    Table("workflow_nodes", _cols(
        "workflow_id TEXT, node INTEGER, parent INTEGER, end_node INTEGER NOT NULL,"
        " kind TEXT NOT NULL, position INTEGER NOT NULL, role TEXT, state TEXT NOT NULL,"
        " job_id TEXT, spec TEXT, remaining INTEGER NOT NULL =0, failed INTEGER NOT NULL =0,"
        " result TEXT, error TEXT, parent_results TEXT"), pk=("workflow_id", "node")),
    # Endpoint signing secrets (m022): the value, and the one it replaced while that
    # stays valid (until previous_until), for a rotation (rota/store/secrets.py).
    Table("secrets", _cols("name TEXT, value TEXT NOT NULL, previous TEXT, rotated_at REAL,"
                           " previous_until REAL, created_at REAL NOT NULL,"
                           " updated_at REAL NOT NULL"), pk=("name",)),
)

INDEXES: tuple[Index, ...] = (
    Index("idx_jobs_state_queue", "jobs", ("state", "queue")),
    Index("idx_spec_pushes_name", "spec_pushes", ("name",)),
    Index("idx_job_logs_job_id_id", "job_logs", ("job_id", "id")),
    Index("idx_jobs_state_finished_at", "jobs", ("state", "finished_at")),
    Index("idx_jobs_state", "jobs", ("state",), COLD),
    Index("idx_jobs_state_spec", "jobs", ("state", "spec"), COLD),
    Index("idx_jobs_state_worker", "jobs", ("state", "worker_id"),
          f"{COLD} AND worker_id IS NOT NULL"),
    Index("idx_limit_starts_name_key_at", "limit_starts", ("name", "key", "at")),
    Index("idx_unique_keys_job_id", "unique_keys", ("job_id",)),
    # The guard of flow control counts a key's active jobs per reservation (m017): only
    # keyed active jobs are in these, so an unlimited job costs them nothing.
    Index("idx_jobs_active_spec_key", "jobs", ("spec", "concurrency_key"), ACTIVE_KEYED),
    Index("idx_jobs_active_queue_key", "jobs", ("queue", "concurrency_key"), ACTIVE_KEYED),
    # A workflow's jobs, and a schedule's (m018): only the jobs that have one are in these.
    Index("idx_jobs_workflow", "jobs", ("workflow_id", "workflow_node"),
          "workflow_id IS NOT NULL"),
    Index("idx_jobs_schedule", "jobs", ("schedule", "state"), "schedule IS NOT NULL"),
    Index("idx_workflows_created_at", "workflows", ("created_at",)),
    # OJS's dead-letter list (m021): only jobs discarded into it are in this.
    Index("jobs_dead_letter", "jobs", ("dead_letter", "finished_at"), "dead_letter = 1"),
    Index("idx_workflow_nodes_workflow_id_parent", "workflow_nodes", ("workflow_id", "parent")),
)


def table(name: str) -> Table:
    return next(t for t in TABLES if t.name == name)
