"""Open Job Spec (OJS) structs and patterns: the PUSH body and what ``jobs.ojs`` keeps.

No logic here: rota/core/ojs_map.py maps these to and from Rota's own requests and rows
(docs/ojs.md). Fields are optional and omitted when absent, never written as null.
"""

from __future__ import annotations

from typing import Any

import msgspec

OJS_VERSION = "1.0"
OJS_MEDIA = "application/openjobspec+json"
# A client's job id: a lowercase UUIDv7 (L0-ENV-011 refuses v4, uppercase and "").
ID_PATTERN = r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
# A job type: lowercase, dot-namespaced, as OJS's openapi.yaml says (L0-ENV-005 refuses
# "Email.Send"; the level 1 suites use hyphens, "retry.test.max-attempts").
TYPE_PATTERN = r"^[a-z][a-z0-9_\-]*(\.[a-z][a-z0-9_\-]*)*$"
MAX_TYPE = 128
# A queue given on an OJS route (Rota's own queues outside it are still shown).
QUEUE_PATTERN = r"^[a-z0-9][a-z0-9\-\.]*$"
MAX_QUEUE = 255
MIN_PRIORITY, MAX_PRIORITY = -100, 100
# The args key an OJS list that is not one plain object is kept under (docs/ojs.md):
# Rota's own API refuses it, so the mapping back is exact.
OJS_ARGS = "_ojs_args"
# Top-level keys of a PUSH body OJS defines; any other is kept under ``ext``.
KNOWN_KEYS = frozenset({"type", "args", "id", "meta", "options", "specversion", "queue",
                        "priority", "scheduled_at", "expires_at", "retry", "unique",
                        "timeout", "visibility_timeout", "tags", "state", "attempt",
                        "created_at", "enqueued_at", "started_at", "completed_at", "result",
                        "errors", "error"})


class OjsRetry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``options.retry`` as given (ojs-retry.md)."""

    max_attempts: int | None = None
    initial_interval: str | None = None
    backoff_coefficient: float | None = None
    max_interval: str | None = None
    jitter: bool | None = None
    non_retryable_errors: list[str] | None = None
    on_exhaustion: str | None = None
    backoff_strategy: str | None = None


class OjsUnique(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``options.unique`` as given (ojs-unique-jobs.md)."""

    keys: list[str] | None = None
    key: list[str] | None = None  # JF §3.5's name: argument names in the key
    period: str | None = None
    on_conflict: str | None = None
    states: list[str] | None = None


class OjsRateLimit(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``options.rate_limit`` as given (ojs-rate-limiting.md)."""

    max_per_second: float | None = None
    max_per_minute: float | None = None
    key: str | None = None


class OjsOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    queue: str | None = None
    priority: int | None = None
    timeout_ms: int | None = None
    visibility_timeout_ms: int | None = None
    delay_until: str | None = None
    scheduled_at: str | None = None
    expires_at: str | None = None
    retry: OjsRetry | None = None
    unique: OjsUnique | None = None
    rate_limit: OjsRateLimit | None = None
    tags: list[str] | None = None
    metadata: dict[str, Any] | None = None


class OjsJobIn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A PUSH body: the OJS envelope (JF §3 top-level aliases included) and, in ``ext``,
    every top-level key OJS does not define, echoed back as given (L0-ENV-014)."""

    type: str
    args: list[Any]
    id: str | None = None
    meta: dict[str, Any] | None = None
    options: OjsOptions | None = None
    specversion: str | None = None
    queue: str | None = None
    priority: int | None = None
    scheduled_at: str | None = None
    expires_at: str | None = None
    retry: OjsRetry | None = None
    unique: OjsUnique | None = None
    timeout: int | None = None  # JF's seconds; options.timeout_ms says it in ms
    visibility_timeout: int | None = None  # JF's seconds; options.visibility_timeout_ms
    tags: list[str] | None = None
    ext: dict[str, Any] = {}


class OjsPolicy(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """The retry options Rota's ``Limits`` (rota/core/policy.py) take from a job, parsed:
    what ``EnqueueRequest`` cannot say itself. Absent means the spec's (or OJS's
    defaults, for an unversioned type)."""

    backoff_base: float | None = None  # initial_interval, seconds
    backoff_max: float | None = None  # max_interval, seconds
    coefficient: float | None = None  # backoff_coefficient (>= 1)
    linear: bool = False  # backoff_strategy "linear": initial x n
    jitter: str | None = None  # "ojs" (jitter true), "none" (false); None: the default
    non_retryable: tuple[str, ...] = ()  # patterns matched against an error's type or code
    dead_letter: bool = False  # on_exhaustion "dead_letter"


class OjsExtras(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What ``jobs.ojs`` keeps (JSON): the OJS-only parts of a job, as given."""

    meta: dict[str, Any] | None = None
    tags: list[str] | None = None
    metadata: dict[str, Any] | None = None
    ext: dict[str, Any] | None = None  # unknown top-level fields, shown at the top level
    timeout_ms: int | None = None
    visibility_timeout_ms: int | None = None
    retry: OjsRetry | None = None
    unique: OjsUnique | None = None
    rate_limit: OjsRateLimit | None = None
    policy: OjsPolicy | None = None  # ``retry`` parsed, for the engine (rota/core/policy.py)


_extras_decoder = msgspec.json.Decoder(OjsExtras)


def decode_extras(text: str | bytes | None) -> OjsExtras | None:
    """A ``jobs.ojs`` column as read (None: a Rota job)."""
    return None if text is None else _extras_decoder.decode(text)


def encode_extras(extras: OjsExtras | None) -> str | None:
    """``OjsExtras`` as the ``jobs.ojs`` column holds it."""
    return None if extras is None else msgspec.json.encode(extras).decode()
