"""Server settings: explicit, frozen, with defaults. The CLI maps ROTA_* variables onto them."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    db: Path = Path("rota.db")
    # PostgreSQL instead of the file (rota serve --db postgresql://...; rota/pg.py), and
    # the store's reader connections (either backend).
    database_url: str | None = None
    db_pool: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    # How often workers should beat, and how long silence may last before a worker is
    # dropped and its jobs go back. Timeout >= 3x interval avoids premature recovery.
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    # After a connection is lost (not closed by the worker, not timed out), how long its
    # jobs stay reserved for the worker to reconnect and reclaim them.
    reconnect_grace: float = 5.0
    visibility_timeout: float = 1800.0
    # What an acknowledged write survives: "full" (fsynced: power loss) or "process" (a
    # crash of Rota only; faster, the machine's crash may lose the last commits).
    durability: str = "full"
    # Bytes the database may take (SQLite's max_page_count); None: what the disk holds.
    # New jobs are refused (503 storage_full) while what is left keeps room for the
    # jobs not yet finished (db.has_room).
    max_db_size: int | None = None
    # Seconds finished jobs are kept before they are deleted (None: forever), and
    # per-queue overrides as (queue, state, seconds): rota/retention.py.
    retain_completed: float | None = 7 * 86400.0
    retain_discarded: float | None = 30 * 86400.0
    retain_cancelled: float | None = 7 * 86400.0
    retain_queues: tuple[tuple[str, str, float | None], ...] = ()
    # Longest a GET /jobs/{id}/result?wait= may hold a request open.
    max_result_wait: float = 300.0
    # -- limits against hostile or broken clients (docs/operations.md) ----------------
    max_args_bytes: int = 256 * 1024  # a job's args, as JSON
    max_result_bytes: int = 1 << 20  # a job's result, as JSON
    max_body_bytes: int = 1 << 20  # an HTTP request body
    registration_timeout: float = 5.0  # a /work socket must register within this
    max_connections: int = 1000  # open connections of any kind (uvicorn answers 503 above)
    max_worker_connections_per_token: int = 200
    # HTTP requests that stay open (GET /events streams, GET /jobs/{id}/result?wait=) per
    # token at once: one client cannot take every connection (429 too_many_waits above).
    max_waits_per_token: int = 100
    # A /work connection over these is throttled (not read for a while), never refused:
    # frames a second on average and in a burst, and bytes a second likewise. Set far
    # above what a conforming worker sends at the most the server can carry.
    rate_limit: float = 20_000.0
    rate_burst: int = 20_000
    rate_bytes: int = 64 << 20
    rate_bytes_burst: int = 8 << 20
    throttle_close_after: float = 60.0  # over the limits this long without a break: closed
    # What the server holds for one /work connection that its worker has not read yet (the
    # socket's write buffer and Rota's backlog behind it). Above the high-water mark it
    # gets no new jobs until that drains below a quarter of the mark; over the limit for
    # outbox_close_after without a break, it is closed (slow_consumer).
    outbox_high_water: int = 1 << 20
    outbox_limit: int = 8 << 20
    outbox_close_after: float = 30.0
    header_timeout: float = 10.0  # a client must send a request's headers within this
    body_timeout: float = 30.0  # ... and, once they are in, the whole body within this
    allowed_origins: tuple[str, ...] = ()  # browser Origins accepted on /work
    # The dashboard (/ui) shows and does nothing that changes state; a state-changing
    # request authenticated by its cookie is refused (rota/gate.py).
    ui_read_only: bool = False
    ssl_certfile: str | None = None  # serve HTTPS and wss:// with this certificate
    ssl_keyfile: str | None = None
    # GET /events: the events kept for clients that resume (Last-Event-ID), and the most
    # seconds between two things sent to a subscriber (a comment if nothing happened).
    events_buffer: int = 10_000
    events_keepalive: float = 15.0
    # Producers name queues: GET /metrics, GET /stats and the dashboard's queues page name
    # at most this many (queue, spec) pairs, and queues, one by one; the rest are counted
    # under "(other)" (rota/observe.py).
    max_series: int = 1000
    # Several servers on one PostgreSQL database (docs/scaling.md): this server's name
    # among them (None: "host:port"), and its lease, which it renews a few times per
    # lease; the others recover its workers' jobs once it lapsed longer than the
    # reconnect grace.
    server_id: str | None = None
    server_lease: float = 10.0
    # Test switch: exit abruptly at a named point (see docs/reliability.md). Never in production.
    crash_at: str | None = None
    # Test switch: seconds each reservation's transaction stays open after its UPDATE
    # (the stall tests catch a server inside a transaction). Never in production.
    hold_reserve: float = 0.0


def loopback(host: str) -> bool:
    """Whether a host name or address is this machine's loopback: the only place a server
    without tokens listens, and the only names it answers to (rota/gate.py)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
