"""Server settings: explicit, frozen, with defaults. The CLI maps ROTA_* variables onto them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    db: Path = Path("rota.db")
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
    # Longest a GET /jobs/{id}/result?wait= may hold a request open.
    max_result_wait: float = 300.0
    # Test switch: exit abruptly at a named point (see docs/reliability.md). Never in production.
    crash_at: str | None = None
