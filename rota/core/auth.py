"""Bearer tokens: what a caller may do, decided without I/O.

A token reads ``rota_<id>_<secret>``. The store keeps the id, the scope, the queues
it is limited to and a SHA-256 of the secret, never the secret itself (the secret is
32 random bytes, so a fast hash is enough: there is nothing to guess). A presented
token is found by its id and its secret compared in constant time.

Scopes: ``worker`` connects to /work; ``producer`` enqueues, reads the specs, and reads
and cancels the jobs it enqueued, under ids of its own (``Principal.stored_id``);
``metrics`` reads GET /metrics only (for a Prometheus server's scrape config); ``admin``
does everything. A token limited to queues
may register for, or enqueue into, only those. With no token in the store the server
runs open: every caller is an admin (``OPEN``), which ``rota serve`` allows on loopback
only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Scope = Literal["worker", "producer", "admin", "metrics"]
SCOPES: tuple[Scope, ...] = ("worker", "producer", "admin", "metrics")
_TOKEN = re.compile(r"^rota_([0-9a-f]{12})_([A-Za-z0-9_-]{20,100})$")


def bearer(authorization: str | None) -> str | None:
    """The token an ``Authorization`` header carries, or None if it carries none. The
    scheme's case does not matter (RFC 9110, section 11.1: ``bearer`` is ``Bearer``)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the token's id and name, its scope and queue limit."""

    token_id: str | None  # None: the server runs open, without tokens
    name: str
    scope: Scope
    queues: frozenset[str] | None = None  # None: any queue

    def may(self, *scopes: Scope) -> bool:
        return self.scope == "admin" or self.scope in scopes

    def may_use_queue(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues

    # Job ids: a producer token's are its own. The id a producer gives (or the one the
    # server makes for it) is kept as ``<token id>:<id>``, so that two producers using
    # one id make two jobs, and neither can read, confirm or take the other's. That is
    # the job's id everywhere (answers, workers, logs, the dashboard); the producer may
    # name its jobs either way. An admin, and every caller of an open server, names jobs
    # by the ids they are kept under, and its own ids are kept as given.
    @property
    def owns_ids(self) -> bool:
        return self.token_id is not None and self.scope != "admin"

    def stored_id(self, job_id: str) -> str:
        """The id the job this caller names ``job_id`` is kept under."""
        if not self.owns_ids:
            return job_id
        prefix = f"{self.token_id}:"
        return job_id if job_id.startswith(prefix) else prefix + job_id

    def unscoped_id(self, job_id: str) -> str | None:
        """The id a job this caller names ``job_id`` was kept under before producers'
        ids were their own (the id as given), where that differs from ``stored_id``."""
        return job_id if self.stored_id(job_id) != job_id else None


OPEN = Principal(token_id=None, name="open", scope="admin")


def kept_ids(job_id: str, producer_tokens: Iterable[str]) -> list[str]:
    """The ids a job that producer tokens named ``job_id`` would be kept under, one per
    token (Principal.stored_id): where an admin's id that names no job may be."""
    return [f"{token_id}:{job_id}" for token_id in producer_tokens
            if not job_id.startswith(f"{token_id}:")]


def kept_hint(found: list[str]) -> str:
    """What a 404 for an id adds when producers' jobs are kept under it, prefixed."""
    if not found:
        return ""
    return ("; producer ids are stored under their token's prefix: did you mean"
            f" {' or '.join(found)}?")


def new_token() -> tuple[str, str, str]:
    """A fresh token: (id, the full secret token to hand out once, the hash to store)."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return token_id, f"rota_{token_id}_{secret}", digest(secret)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class _Entry:
    principal: Principal
    hash: str


class Tokens:
    """The live tokens, rebuilt from the store whenever they change."""

    def __init__(self, rows: Iterable[dict[str, Any]] = ()) -> None:
        self._by_id: dict[str, _Entry] = {}
        for row in rows:
            queues = row["queues"]
            principal = Principal(token_id=row["id"], name=row["name"], scope=row["scope"],
                                  queues=frozenset(queues) if queues is not None else None)
            self._by_id[row["id"]] = _Entry(principal, row["hash"])

    @property
    def required(self) -> bool:
        """Auth is on as soon as one live token exists."""
        return bool(self._by_id)

    def valid(self, principal: Principal) -> bool:
        """Is a caller admitted earlier still admitted (not revoked; or still open)?"""
        if principal.token_id is None:
            return not self.required
        return principal.token_id in self._by_id

    def valid_id(self, token_id: str) -> bool:
        return token_id in self._by_id

    def unknown(self, authorization: str | None) -> bool:
        """Whether the header names a well-formed token this list does not hold yet (one
        created a moment ago, in the file or by another server)."""
        if not self.required or (token := bearer(authorization)) is None:
            return False
        match = _TOKEN.match(token)
        return match is not None and match[1] not in self._by_id

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The caller behind an ``Authorization`` header, or None if it proves nobody."""
        if not self.required:
            return OPEN
        if (token := bearer(authorization)) is None:
            return None
        match = _TOKEN.match(token)
        if match is None:
            return None
        entry = self._by_id.get(match[1])
        # Compare even for an unknown id, so timing does not tell ids apart.
        expected = entry.hash if entry is not None else "0" * 64
        if not hmac.compare_digest(digest(match[2]), expected) or entry is None:
            return None
        return entry.principal
