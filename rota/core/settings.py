"""Server settings: explicit, frozen, with defaults, each default in one place.

Every field is a ``rota serve`` option: its metadata (``Option``) says the option's name,
its ``ROTA_*`` variable, its help and how its text converts (``kind``, ``minimum``,
``choices``); rota/cli/serve.py builds the command from these, and
tests/unit/test_cli_serve.py checks that every field is an option with the field's default.
A field that is no option says why (``internal``).
"""

from __future__ import annotations

import functools
import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Option:
    """How a setting is given to ``rota serve``: ``name`` (default: the field's, as
    ``--field-name``), ``env`` (default: ``ROTA_FIELD_NAME``), ``help``, and how the text
    converts. The type is the field's own; ``kind`` names a conversion of the CLI's
    ("database": a file or a postgresql:// URL; "duration": 30s, 12h, 7d or never;
    "retain": a per-queue retention rule; "file": a file that exists; "url": an http(s)
    URL, as rota/base/egress.py's url_problem checks it); ``minimum`` bounds a number;
    ``choices`` lists the values allowed; ``multiple`` repeats it."""

    help: str
    name: str | None = None
    env: str | None = None
    kind: str | None = None
    minimum: float | None = None
    choices: tuple[str, ...] = ()
    multiple: bool = False
    hidden: bool = False  # a test switch: not in --help


def option(default: Any, help: str, **how: Any) -> Any:
    """A settings field that is a ``rota serve`` option (see ``Option``)."""
    return field(default=default, metadata={"option": Option(help=help, **how)})


def internal(default: Any, why: str) -> Any:
    """A settings field that is not an option of its own, and why."""
    return field(default=default, metadata={"internal": why})


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """What a server runs with. The limits against hostile or broken clients are in
    docs/operations.md; the fields are in the order ``rota serve --help`` lists them."""

    host: str = option("127.0.0.1", help="Address to listen on.")
    port: int = option(8000, help="Port to listen on.")
    db: Path = option(
        Path("rota.db"), kind="database",
        help="SQLite database file, or a PostgreSQL database's URL"
        " (postgresql://user@host:5432/rota), which several servers may share.")
    # PostgreSQL instead of the file (rota serve --db postgresql://...; rota/store/pg.py), and
    # the store's reader connections (either backend).
    database_url: str | None = internal(None, "--db takes a postgresql:// URL too")
    db_pool: int = option(
        2, minimum=1, help="Reader connections to the database (reads for the API and the"
        " dashboard; writes have one connection of their own).")
    # Several servers on one PostgreSQL database (docs/scaling.md): this server's name
    # among them (None: "host:port"), and its lease, which it renews a few times per
    # lease; the others recover its workers' jobs once it lapsed longer than the
    # reconnect grace.
    server_id: str | None = option(
        None, help="This server's name among those sharing a PostgreSQL database (default:"
        " host:port). A restart under the same name takes back its workers' reservations.")
    server_lease: float = option(
        10.0, minimum=0.2,
        help="Seconds a server's lease lasts (renewed 4 times per lease, on the database's"
        " clock). Servers sharing a database recover a dead one's reservations after its"
        " lease and the reconnect grace; a quarter of it (0.5 s at least) bounds how long"
        " one stalled in a transaction holds the others.")
    # How often workers should beat, and how long silence may last before a worker is
    # dropped and its jobs go back. Timeout >= 3x interval avoids premature recovery.
    heartbeat_interval: float = option(
        1.0, help="Seconds between worker heartbeats (told to workers in the welcome).")
    heartbeat_timeout: float = option(
        5.0, help="Seconds of silence after which a worker is dropped and its jobs requeued.")
    # After a connection is lost (not closed by the worker, not timed out), how long its
    # jobs stay reserved for the worker to reconnect and reclaim them.
    reconnect_grace: float = option(
        5.0, help="Seconds a lost connection's jobs stay reserved for its worker to"
        " reconnect.")
    visibility_timeout: float = option(
        1800.0, help="Default seconds a job stays reserved for its worker.")
    max_args_bytes: int = option(  # a job's args, as JSON
        256 * 1024, help="Largest job args, as JSON (413 args_too_large above).")
    max_result_bytes: int = option(  # a job's result, as JSON
        1 << 20, help="Largest job result, as JSON (the job fails with result_too_large"
        " above).")
    max_parent_results_bytes: int = option(  # what a workflow's step gets of its parents
        1 << 20, minimum=64 * 1024, help="Largest parent_results a workflow's step is"
        " given, as JSON (the step fails with parent_results_too_large above).")
    max_body_bytes: int = option(  # an HTTP request body
        1 << 20, help="Largest HTTP request body (413 body_too_large above).")
    # What an acknowledged write survives: "full" (fsynced: power loss) or "process" (a
    # crash of Rota only; faster, the machine's crash may lose the last commits).
    durability: str = option(
        "full", choices=("full", "process"),
        help="What an acknowledged write survives. full: power loss (every commit is"
        " fsynced). process: a crash of Rota, not of the machine (faster; the last"
        " commits before an OS crash or power cut may be lost).")
    # Bytes the database may take (SQLite's max_page_count); None: what the disk holds.
    # New jobs are refused (503 storage_full) while what is left keeps room for the
    # jobs not yet finished (db.has_room).
    max_db_size: int | None = option(
        None, minimum=1, help="Bytes the database file may take (default: no limit). New"
        " jobs get 503 storage_full once the room left is what the unfinished jobs need.")
    # Seconds finished jobs are kept before they are deleted (None: forever), and
    # per-queue overrides as (queue, state, seconds): rota/core/retention.py.
    retain_completed: float | None = option(
        7 * 86400.0, kind="duration",
        help="How long a completed job is kept, then deleted (30s, 12h, 7d; never).")
    retain_discarded: float | None = option(
        30 * 86400.0, kind="duration", help="How long a discarded job is kept.")
    retain_cancelled: float | None = option(
        7 * 86400.0, kind="duration", help="How long a cancelled job is kept.")
    retain_queues: tuple[tuple[str, str, float | None], ...] = option(
        (), name="--retain", kind="retain", multiple=True,
        help="A queue's own retention, e.g. queue=emails:completed=1d:discarded=90d"
        " (repeat).")
    # Longest a GET /jobs/{id}/result?wait= may hold a request open.
    max_result_wait: float = internal(300.0, "a bound of the API's, set by tests")
    max_connections: int = option(  # open connections of any kind (uvicorn: 503 above)
        1000, help="Open connections of any kind; new ones get 503 above.")
    max_worker_connections_per_token: int = option(
        200, help="Open /work connections per token (429 above).")
    # HTTP requests that stay open (GET /events streams, GET /jobs/{id}/result?wait=) per
    # token at once: one client cannot take every connection (429 too_many_waits above).
    max_waits_per_token: int = option(
        100, minimum=1, help="HTTP requests that stay open (GET /events, result ?wait=) per"
        " token at once (429 too_many_waits above).")
    # A /work connection over these is throttled (not read for a while), never refused:
    # frames a second on average and in a burst, and bytes a second likewise. Set far
    # above what a conforming worker sends at the most the server can carry.
    rate_limit: float = option(
        20_000.0, help="Frames a second one /work connection may send on average; above it,"
        " it is throttled.")
    rate_burst: int = option(20_000, help="Frames one /work connection may send in a burst.")
    rate_bytes: int = option(
        64 << 20, help="Bytes a second one /work connection may send on average; above it,"
        " it is throttled.")
    rate_bytes_burst: int = internal(8 << 20, "follows --rate-bytes; no option asked for it")
    throttle_close_after: float = option(  # over the limits this long without a break
        60.0, help="Seconds a /work connection may stay throttled before it is closed (its"
        " jobs then get the reconnect grace).")
    # What the server holds for one /work connection that its worker has not read yet (the
    # socket's write buffer and Rota's backlog behind it). Above the high-water mark it
    # gets no new jobs until that drains below a quarter of the mark; above it for
    # outbox_close_after without that, it is closed (slow_consumer); over the limit, a
    # WARNING says so.
    outbox_high_water: int = option(
        1 << 20, help="Bytes sent to one /work connection and not yet read by its worker"
        " above which it gets no new jobs, until they drain below a quarter of it.")
    outbox_limit: int = option(
        8 << 20, help="Bytes sent to one /work connection and not read, above which a"
        " WARNING says so (it is closed as any full outbox, after --outbox-close-after).")
    outbox_close_after: float = option(
        30.0, help="Seconds a /work connection may stay over --outbox-high-water, not"
        " drained below a quarter of it, before it is closed (slow_consumer; its jobs then"
        " get the reconnect grace).")
    registration_timeout: float = option(  # a /work socket must register within this
        5.0, help="Seconds a new /work socket has to register.")
    header_timeout: float = option(  # a client must send a request's headers within this
        10.0, help="Seconds a client has to send a request's headers.")
    body_timeout: float = option(  # ... and, once they are in, the whole body within this
        30.0, help="Seconds a client has to send a request's body, once its headers are in.")
    # GET /events: the events kept for clients that resume (Last-Event-ID), and the most
    # seconds between two things sent to a subscriber (a comment if nothing happened).
    events_buffer: int = option(
        10_000, minimum=1, help="Events kept for GET /events clients that resume"
        " (Last-Event-ID); one further behind gets a gap event.")
    events_keepalive: float = option(
        15.0, minimum=0.01,
        help="Most seconds GET /events stays silent: a keep-alive comment then.")
    # Producers name queues: GET /metrics, GET /stats and the dashboard's queues page name
    # at most this many (queue, spec) pairs, and queues, one by one; the rest are counted
    # under "(other)" (rota/core/observe.py).
    max_series: int = option(
        1000, minimum=1, help="(queue, spec) pairs, and queues, that GET /metrics, GET /stats"
        " and the dashboard name one by one; the rest are counted under queue \"(other)\".")
    ssl_certfile: str | None = option(  # serve HTTPS and wss:// with this certificate
        None, kind="file", help="Serve HTTPS/wss with this certificate (PEM).")
    ssl_keyfile: str | None = option(
        None, kind="file", help="The certificate's private key (PEM).")
    allowed_origins: tuple[str, ...] = option(  # browser Origins accepted on /work
        (), name="--allowed-origin", env="ROTA_ALLOWED_ORIGINS", multiple=True,
        help="A browser Origin allowed on /work (repeat; none by default).")
    # The dashboard (/ui) shows and does nothing that changes state; a state-changing
    # request authenticated by its cookie is refused (rota/server/gate.py).
    ui_read_only: bool = option(
        False, help="The dashboard (/ui) shows everything and changes nothing.")
    # The OJS binding (docs/ojs.md): a job of a type no spec describes runs unversioned
    # (OJS's default retry policy, any pull worker), unless this is set.
    ojs_registered_types_only: bool = option(
        False, help="OJS jobs (/ojs/v1) only of types a spec was pushed for (400"
        " invalid_job_type otherwise); by default such a type runs unversioned.")
    # Webhooks out (docs/webhooks.md): how long a receiver has to answer, and (a test
    # switch) a factor on the retry schedule (ojs-webhooks §7.2: 30 s, 2 min ... 24 h).
    webhook_timeout: float = option(
        30.0, minimum=0.1, help="Seconds a webhook receiver has to answer a delivery (a"
        " timeout is retried).")
    webhook_backoff_scale: float = option(
        1.0, hidden=True, minimum=0.0001,
        help="Test switch: a factor on the webhook retry schedule (fast tests).")
    # Push execution (docs/push.md): the server POSTs jobs to their spec's [execute] URL,
    # never to a loopback, link-local or private address unless this is set
    # (rota/base/egress.py), so that a spec cannot reach the server's own network.
    allow_private_endpoints: bool = option(
        False, help="Let push execution and webhooks reach loopback, link-local and private"
        " addresses (refused by default, so that a spec cannot reach this network).")
    # The base of the callback URL an endpoint answering 202 reports to (None: the
    # address the server listens on, which an endpoint elsewhere may not reach).
    public_url: str | None = option(
        None, kind="url", help="This server's URL as endpoints reach it (the base of"
        " push execution's callback URL; default: the address it listens on).")
    # Test switch: POST /ojs/v1/admin/reset (empties the store) and OJS's test directives
    # (docs/ojs.md); a WARNING at start says it is on. Never in production.
    unsafe_test_endpoints: bool = option(
        False, help="Test switch for the OJS conformance suites: POST /ojs/v1/admin/reset"
        " empties the store. Never in production.")
    # Test switch: exit abruptly at a named point (see docs/reliability.md). Never in production.
    crash_at: str | None = option(
        None, hidden=True, choices=("enqueue-before-commit", "enqueue-after-commit",
                                    "reserve-after-commit", "result-after-commit"),
        help="Test switch: exit abruptly at this point (crash-safety tests).")
    # Test switch: seconds each reservation's transaction stays open after its UPDATE
    # (the stall tests catch a server inside a transaction). Never in production.
    hold_reserve: float = option(
        0.0, hidden=True, minimum=0.0,
        help="Test switch: seconds each reservation's transaction stays open (stall tests).")
    # Test switch: seconds without a storage failure before a good write means the store
    # recovered (None: rota/store/health.py's RECOVER_AFTER). Never in production.
    recover_after: float | None = option(
        None, hidden=True, minimum=0.1,
        help="Test switch: seconds without a storage failure before recovery (storage tests).")
    # Test switch: seconds between writes of the per-minute counts (rota/server/watching.py);
    # a kill -9 loses what was counted since the last. Never changed in production.
    counts_every: float = option(
        15.0, hidden=True, minimum=0.05,
        help="Test switch: seconds between writes of the per-minute counts (restart tests).")


    @property
    def ojs_unversioned(self) -> bool:
        """Whether an OJS job of a type no spec describes runs unversioned."""
        return not self.ojs_registered_types_only


@functools.lru_cache(maxsize=256)  # asked at every request while auth is off: 4% of an enqueue
def loopback(host: str) -> bool:
    """Whether a host name or address is this machine's loopback: the only place a server
    without tokens listens, and the only names it answers to (rota/server/gate.py)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
