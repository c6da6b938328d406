"""The HTTP API's answers as msgspec Structs: the schemas of the OpenAPI document
(rota/server/openapi.py). Their fields mirror what the routes send, and a schemathesis run
(tests/server/test_openapi.py) checks that no answer breaks them. (Request bodies are the
routes' own decoders' types: rota/server/api.py, rota/core/jobs.py, rota/server/operate.py.)
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

JobState = Literal["scheduled", "available", "active", "retryable", "completed", "discarded",
                   "cancelled", "pending"]


class Held(msgspec.Struct):
    """A 409 unique_conflict's details: the job that holds the unique key."""

    job_id: str
    state: JobState
    unique_key: str | None


class Problem(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    id: str | None = None  # a 500's incident id, which the server's log names
    details: Held | None = None  # unique_conflict (409): who holds the key


class ErrorBody(msgspec.Struct):
    error: Problem


class Progress(msgspec.Struct):
    percent: float
    message: str | None
    at: str


class LogEntry(msgspec.Struct):
    at: str
    attempt: int
    kind: Literal["log", "alert"]
    level: str
    message: str


class JobView(msgspec.Struct, kw_only=True):
    id: str
    spec: str
    queue: str
    state: JobState
    priority: int
    attempt: int
    attempts_used: int  # those max_attempts counts: since enqueue or the last manual retry
    args: Any
    worker_id: str | None
    checksum: str | None
    visibility_timeout: float | None
    enqueued_at: str | None
    reserved_at: str | None
    finished_at: str | None
    result: Any
    errors: list[Any]
    run_at: str | None
    expires_at: str | None
    fails: int
    deaths: int  # attempts in a row whose worker died (see max_worker_deaths)
    max_attempts: int | None
    max_fails: int | None
    cancel_requested: bool
    capture_logs: bool
    unique_key: str | None  # the unique key it holds (sha256 hex), if any
    concurrency_key: str | None  # flow control: the key per-key limits count it under
    labels: list[str]  # worker labels it requires (its own and its spec's)
    workflow_id: str | None  # the workflow it is a step of
    workflow_node: int | None  # its node in that workflow
    schedule: str | None  # the cron schedule whose tick made it
    progress: Progress | None
    # active: whether its worker started it (false: prefetched, waiting in its line); else null
    started: bool | None = None


class JobDetail(JobView, kw_only=True):
    logs: list[LogEntry]
    waiting_reason: str | None = None


class Enqueued(msgspec.Struct):
    job: JobView
    created: bool


class BatchItem(msgspec.Struct, kw_only=True):
    index: int
    status: int
    created: bool | None = None
    job: JobView | None = None
    error: Problem | None = None


class BatchReply(msgspec.Struct):
    results: list[BatchItem]


class ResultReply(msgspec.Struct):
    id: str
    state: JobState
    done: bool
    result: Any
    error: Any


class SpecEntry(msgspec.Struct):
    name: str
    version: str
    checksum: str
    queue: str
    description: str
    spec: Any
    retired_at: str | None  # when it was retired (POST /specs/{name}/retire), else null


class SpecList(msgspec.Struct):
    specs: list[SpecEntry]


class SpecChange(msgspec.Struct):
    name: str
    change: Literal["new", "changed", "unchanged", "restored"]
    checksum: str
    previous: str | None
    mismatched_workers: int
    matching_workers: int


class ScheduleChange(msgspec.Struct):
    name: str
    change: Literal["new", "changed", "unchanged"]


class ArgsRefused(msgspec.Struct):
    """A stored schedule whose args a pushed spec refuses: the push goes on, it waits."""

    name: str
    spec: str
    message: str


class PushReply(msgspec.Struct, kw_only=True):
    dry_run: bool
    specs: list[SpecChange]
    schedules: list[ScheduleChange] = []
    args_refused: list[ArgsRefused] = []


class ScheduleView(msgspec.Struct, kw_only=True):
    """A cron schedule (README, Cron schedules): its definition and its ticks' record."""

    name: str
    spec: str
    cron: str
    args: dict[str, Any]
    timezone: str
    overlap: Literal["skip", "allow", "cancel_previous", "enqueue"]
    misfire: Literal["skip", "catch_up"]
    catch_up: int
    jitter: float
    queue: str | None
    priority: int | None
    max_attempts: int | None
    description: str
    paused: bool
    state: Literal["active", "paused", "waiting"]
    waiting_reason: str | None
    last_tick: str | None
    last_job_id: str | None
    last_outcome: str | None  # the last job's state, "skipped: ...", "missed"
    next_fires: list[str]
    run_count: int
    created_at: str | None
    deleted: bool = False  # (DELETE's answer)


class ScheduleList(msgspec.Struct):
    schedules: list[ScheduleView]


class SchedulePut(msgspec.Struct):
    schedule: ScheduleView
    change: Literal["new", "changed", "unchanged"]


class Push(msgspec.Struct):
    checksum: str
    previous: str | None
    version: str
    pushed_at: str
    event: Literal["push", "retire"]


class SpecJobs(msgspec.Struct):
    scheduled: int
    available: int
    retryable: int
    active: int


class Retired(msgspec.Struct):
    name: str
    checksum: str
    retired_at: str
    already_retired: bool
    jobs: SpecJobs  # the spec's unfinished jobs, after any cancel
    cancelled: int
    matching_workers: int


class History(msgspec.Struct):
    name: str
    history: list[Push]


class TokenView(msgspec.Struct, kw_only=True):
    id: str
    name: str
    scope: Literal["worker", "producer", "admin", "metrics"]
    queues: list[str] | None  # None: any queue
    created_at: str


class NewToken(TokenView, kw_only=True):
    token: str  # the secret, rota_<id>_<secret>: shown this once, never stored


class TokenList(msgspec.Struct):
    tokens: list[TokenView]


class Revoked(msgspec.Struct):
    revoked: list[TokenView]


class WorkerAlert(msgspec.Struct):
    at: str
    level: str
    job_id: str | None
    message: str


class WorkerView(msgspec.Struct, kw_only=True):
    id: str
    hostname: str
    pid: int
    os: str
    sdk: str
    state: Literal["running", "quiet", "terminate"]
    queues: list[str]
    labels: list[str]
    concurrency: int
    prefetch: int  # jobs it may hold beyond concurrency, waiting to start
    active: int  # held jobs it started (one that does not report starts: min(held, concurrency))
    prefetched: int  # held jobs not started: waiting in the worker's line
    capacity: int
    specs_matching: list[str]
    specs_mismatching: list[str]
    directive: str | None
    cpu_percent: float | None
    memory_rss: int | None
    alerts: list[WorkerAlert]
    connected_at: str
    last_heartbeat_age: float
    heartbeats: int  # frames read from this connection
    lean_acks: bool = False  # it registered lean_acks (docs/protocol.md §4.2)
    acks_skipped: int = 0  # its idle heartbeats the server left unanswered (lean acks)
    idle_ack_interval: float | None = None  # seconds an idle one may go unacked (§4.2)
    # pull: an OJS worker that FETCHes over HTTP; endpoint: a push endpoint (GET /endpoints)
    kind: Literal["work", "pull", "endpoint"] = "work"


class Workers(msgspec.Struct):
    workers: list[WorkerView]


class Directed(msgspec.Struct):
    workers: list[str]
    state: str
    forwarded: bool = False  # also passed on to the other servers sharing the database


class Waiting(msgspec.Struct):
    spec: str
    available: int
    reason: str | None
    blocked: bool  # no worker will take them as things stand; false for a backlog
    # of them, those their own concurrency key's limit or labels hold, per wait kind
    # (concurrency_limit, rate_limit, no_label)
    held: dict[str, int] = {}


class QueueView(msgspec.Struct):
    name: str
    counts: dict[str, int]
    workers: int
    waiting: list[Waiting]
    paused: bool  # POST /queues/{queue}/pause: it keeps its jobs and assigns none
    oldest_available_age: float | None  # seconds its longest-waiting available job waited
    prefetched: int = 0  # of its active jobs, those waiting unstarted in workers' lines


class QueuePaused(msgspec.Struct):
    queue: str
    paused: bool


class RateView(msgspec.Struct, kw_only=True):
    limit: int  # starts in any window of period seconds
    period: float
    burst: int | None = None


class RuleView(msgspec.Struct, kw_only=True):  # fields left out are not limited
    concurrency: int | None = None
    rate: RateView | None = None
    key_concurrency: int | None = None
    key_rate: RateView | None = None


class LimitEntry(msgspec.Struct, kw_only=True):
    limit: str  # "spec:send_email", "queue:emails"
    kind: Literal["queue", "spec"]
    name: str
    rule: RuleView
    source: Literal["runtime", "spec_file"]  # set with rota limits set, or the spec file's
    updated_at: str | None  # (runtime rules) when, and by which token's name
    updated_by: str | None


class LimitList(msgspec.Struct, kw_only=True):
    limits: list[LimitEntry]
    use: list[Any] | None = None  # each rule's current use, where the server measures it


class LimitCleared(msgspec.Struct, kw_only=True):
    limit: str
    cleared: bool
    now: LimitEntry | None  # the spec file's rule, in force again (null: none)


class JobList(msgspec.Struct):
    jobs: list[JobView]
    next_cursor: str | None  # GET /jobs?cursor= for the next page; null: the last page


class Skipped(msgspec.Struct):
    id: str
    reason: str


class BulkReply(msgspec.Struct):
    action: Literal["retry", "cancel"]
    dry_run: bool
    matched: int  # jobs that matched (a count stops at 100,000)
    touched: int  # retried or cancelled (in a dry run: would be)
    ids: list[str]  # the first 100 touched
    skipped: list[Skipped]  # the first 100 that matched and were not touched, and why
    truncated: bool  # more matched than the limit


class OtherQueues(msgspec.Struct):
    queues: int  # queues not listed one by one (past --max-series)
    counts: dict[str, int]  # their jobs per state, summed


class LimitUseView(msgspec.Struct):
    name: str  # queue:emails, spec:send_email
    key: str | None = None  # a concurrency key in use ("(other)": the keys past --max-series)
    concurrency: int | None = None  # its concurrency limit
    running: int = 0  # reserved (running or prefetched) jobs counted against it
    rate: str | None = None  # its rate limit, e.g. "100/min"
    starts: int = 0  # starts within the rate's last period
    next_start: float | None = None  # seconds until its rate allows a start (null: now)


class Queues(msgspec.Struct):
    queues: list[QueueView]
    others: OtherQueues | None
    limits: list[LimitUseView] = []  # every limit in force and its use now


class StorageState(msgspec.Struct):
    code: str
    message: str
    since: str


class Health(msgspec.Struct):
    status: str  # "ok", or "degraded" while the store cannot write (storage says why)
    workers: int
    live_jobs: int
    specs: int
    uptime: float
    storage: StorageState | None = None


class StatsSeries(msgspec.Struct):
    queue: str
    spec: str
    enqueued: list[int]  # one count per minute, as minute_starts
    completed: list[int]
    failed: list[int]
    discarded: list[int]
    retried: list[int]
    cancelled: list[int]


class Stats(msgspec.Struct):
    now: str
    started_at: str  # when this server started: the counts before it are the last run's
    minute_starts: list[str]  # the minutes counted, oldest first; the last is under way
    series: list[StatsSeries]
    oldest_available: dict[str, float | None]  # per queue: seconds, null if none waits


# -- workflows (rota/server/workflows.py, rota/core/workflow_view.py) ------------------------
WorkflowState = Literal["pending", "running", "completed", "failed", "cancelled"]
NodeState = Literal["waiting", "pending", "active", "completed", "failed", "cancelled",
                    "skipped"]


class StepError(msgspec.Struct, omit_defaults=True):
    job_id: str
    code: str
    message: str
    attempt: int
    callback: Literal["on_success", "on_failure", "on_complete"] | None = None  # a callback's


class WorkflowError(msgspec.Struct, omit_defaults=True):
    """OJS §9.6: a failed workflow's steps (at most 100 named; failed_count counts all)."""

    failed_job_ids: list[str]
    errors: list[StepError]
    failed_step_index: int | None = None  # a chain's: its step that failed


class WorkflowNode(msgspec.Struct, omit_defaults=True):
    node: int
    kind: Literal["job", "chain", "group", "batch"]
    state: NodeState
    position: int
    children: list[WorkflowNode]
    role: Literal["on_success", "on_failure", "on_complete"] | None = None
    job_id: str | None = None
    spec: str | None = None
    waiting_reason: str | None = None  # a released step's job that no worker takes: why


class WorkflowSummary(msgspec.Struct):
    id: str
    type: Literal["chain", "group", "batch"]
    name: str | None
    state: WorkflowState
    created_at: str
    started_at: str | None
    finished_at: str | None
    job_count: int
    completed_count: int
    failed_count: int
    steps_total: int


class Workflow(WorkflowSummary):
    error: WorkflowError | None
    root: WorkflowNode


class WorkflowCreated(msgspec.Struct):
    workflow: Workflow
    created: bool


class WorkflowList(msgspec.Struct):
    workflows: list[WorkflowSummary]
    next: str | None  # GET /workflows?after= for the next page; null: the last page


class CallbackReply(msgspec.Struct):
    job_id: str
    state: str  # the job's state once the callback is taken
