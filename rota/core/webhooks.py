"""Webhooks out, decided: what a subscription says (its kinds and filter, checked), which
events it takes, the body an event is sent as, and what a receiver's answer means (done,
retry when, or dead). Pure: rota/server/hooks.py does the I/O around these.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from rota.base.egress import url_problem
from rota.base.ids import uuid7
from rota.base.protocol import rfc3339
from rota.core.observe import KINDS, Event, Filter, event_data

ALL = "*"  # a subscription to every kind
TEST = "test"  # the kind of a test delivery (POST /webhooks/{id}/test)
FILTER_KEYS = ("spec", "queue", "worker")
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
# ojs-webhooks §7.2: the delay before attempts 2..8; an eighth failure is dead.
DELAYS = (30.0, 120.0, 600.0, 3600.0, 14400.0, 43200.0, 86400.0)
MAX_ATTEMPTS = len(DELAYS) + 1
MAX_RETRY_AFTER = 3600.0  # a receiver's Retry-After is honoured up to an hour
ROTATION_WINDOW = 86400.0  # seconds both secrets sign after a rotation (ojs-webhooks §8.3)
KEEP = 1000  # finished deliveries kept per subscription (the log), pruned on insert
MAX_PENDING = 10_000  # deliveries waiting per subscription; more are dropped, and logged
# Job events a restart recovers from the jobs' rows (``facts``), if the pump had not put
# them in the outbox before a crash: their ids are made from the fact, so that one
# recovered and one pumped are known to be the same event.
FACTS = ("enqueue", "result", "discard", "cancel")
MARGIN = 2.0  # seconds before the pump's stored mark a restart looks back from
_json = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Subscription:
    """A subscription as the delivery loop uses it (secrets included)."""

    id: str
    url: str
    kinds: tuple[str, ...]
    filter: Filter
    secret: str
    previous_secret: str | None
    rotated_at: float | None
    enabled: bool
    created_at: float = 0.0

    def takes(self, event: Event, live: bool = False) -> bool:
        """``live``: recorded after the server followed this subscription, so after its
        creation whatever the event's wall time says (a clock stepped back since)."""
        return (self.enabled and (ALL in self.kinds or event[1] in self.kinds)
                and self.filter.matches(event) and (live or event[0] >= self.created_at))

    def secrets(self, now: float) -> list[str]:
        """What signs now: the secret, and the one before it for ROTATION_WINDOW."""
        if (self.previous_secret and self.rotated_at is not None
                and now - self.rotated_at < ROTATION_WINDOW):
            return [self.secret, self.previous_secret]
        return [self.secret]


def check_url(url: object) -> str:
    problem = url_problem(url)
    if problem is not None:
        raise ValueError(f"url {problem}")
    return str(url)


def check_kinds(kinds: object) -> list[str]:
    """A subscription's kinds: a non-empty list of GET /events kinds, or ["*"]."""
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
        raise ValueError(f"kinds must be a non-empty list of event kinds: {ALL} or any of"
                         f" {', '.join(KINDS)}")
    unknown = sorted({k for k in kinds if k != ALL and k not in KINDS})
    if unknown:
        raise ValueError(f"unknown event kind(s) {', '.join(repr(k[:40]) for k in unknown)};"
                         f" the kinds are {ALL} (all) or {', '.join(KINDS)}")
    return list(dict.fromkeys(kinds))


def check_filter(given: object) -> dict[str, str]:
    """A subscription's filter: any of spec, queue, worker, each a name (as GET /events)."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ValueError(f"filter must be an object with any of {', '.join(FILTER_KEYS)}")
    out = {}
    for key, value in given.items():
        if key not in FILTER_KEYS:
            raise ValueError(f"unknown filter key {str(key)[:40]!r}: the keys are"
                             f" {', '.join(FILTER_KEYS)}")
        if value is None:
            continue
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ValueError(f"filter.{key} is not a name (letters, digits and _.:- up to"
                             " 128)")
        out[key] = value
    return out


def as_filter(given: dict[str, str]) -> Filter:
    return Filter(spec=given.get("spec"), queue=given.get("queue"), worker=given.get("worker"))


def event_id(event: Event) -> str:
    """An event's id: for a job's fact (FACTS) the same whoever makes it, else new."""
    kind, job = event[1], event[2]
    if kind not in FACTS or job is None:
        return "evt_" + uuid7()
    attempt = 0 if kind == "enqueue" else event[7]
    state = event[8] if kind == "result" else ""
    digest = hashlib.sha256(f"{kind}\0{job}\0{attempt}\0{state}".encode()).hexdigest()
    return "evt_" + digest[:32]


def facts(rows: list[dict[str, Any]], since: float) -> list[Event]:
    """The FACTS events of job rows (oldest first) at or after ``since``: each job's
    enqueue, and its ending if it ended (a completion's result, a discard, a cancel). What
    a row does not keep (an error's message, a duration) is left out."""
    ending = {"completed": "result", "discarded": "discard", "cancelled": "cancel"}
    events: list[Event] = []
    for r in rows:
        if r["enqueued_at"] >= since:
            events.append((r["enqueued_at"], "enqueue", r["id"], r["spec"], None, r["queue"],
                           None, 0, "available", None, None))
        kind = ending.get(r["state"])
        if kind is not None and r["finished_at"] is not None and r["finished_at"] >= since:
            events.append((r["finished_at"], kind, r["id"], r["spec"], None, r["queue"],
                           r["worker_id"], r["attempt"], r["state"], None, None))
    return sorted(events, key=lambda e: e[0])


def body(event_id: str, event: Event) -> bytes:
    """What a receiver gets for an event: its id (the same on every retry, for
    deduplication), kind, time and the data GET /events sends for it."""
    data = event_data(event)
    return _json.encode({"id": event_id, "kind": data.kind, "at": data.at, "data": data})


def test_body(event_id: str, subscription_id: str, at: str) -> bytes:
    return _json.encode({"id": event_id, "kind": TEST, "at": at,
                         "data": {"subscription": subscription_id}})


def retry_after(value: str | None, now: float) -> float | None:
    """A Retry-After header (seconds or an HTTP date) as seconds from now, at most
    MAX_RETRY_AFTER; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER)
    try:  # the IMF-fixdate form (RFC 9110 §5.6.7), always in GMT
        when = dt.datetime.strptime(value, "%a, %d %b %Y %H:%M:%S GMT").replace(
            tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None
    return min(max(0.0, when - now), MAX_RETRY_AFTER)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One attempt's answer: ``status`` (None: none came), ``error`` (the reason it
    failed, "" if it did not), ``retryable`` and the receiver's ``retry_in``."""

    status: int | None
    error: str = ""
    retryable: bool = False
    retry_in: float | None = None
    ms: float = 0.0
    response: str = ""


def answered(status: int, retry_in: float | None, ms: float, response: str) -> Outcome:
    """An HTTP answer classified: 2xx done; 408, 429, 5xx retried (Retry-After
    honoured); a redirect (to another host: the egress follows same-host ones) and
    another 4xx are dead."""
    if 200 <= status < 300:
        return Outcome(status, ms=ms, response=response)
    if status in (408, 429) or status >= 500:
        return Outcome(status, f"http_{status}", True, retry_in, ms, response)
    if 300 <= status < 400:
        return Outcome(status, f"http_{status}: a redirect to another host is not followed", False, None, ms,
                       response)
    return Outcome(status, f"http_{status}", False, None, ms, response)


def next_step(outcome: Outcome, attempts: int, now: float, scale: float = 1.0
              ) -> tuple[str, float | None]:
    """After attempt number ``attempts``: ("delivered", None), ("pending", when to try
    again) or ("dead", None). ``scale`` shortens the schedule (a test setting)."""
    if not outcome.error:
        return "delivered", None
    if not outcome.retryable or attempts >= MAX_ATTEMPTS:
        return "dead", None
    delay = DELAYS[attempts - 1] * scale
    if outcome.retry_in is not None:
        delay = outcome.retry_in
    return "pending", now + delay


def pause(streak: int, due_in: float, scale: float = 1.0) -> float:
    """How long a subscription whose receiver failed ``streak`` batches in a row waits
    before it tries again (any of its deliveries): the schedule's delay for that many
    failures, or longer if the failed deliveries' own next tries are later. A receiver
    that is down costs one batch per pause, not one try per waiting event."""
    return max(0.0, due_in, DELAYS[min(streak, len(DELAYS)) - 1] * scale)


def subscription_view(row: dict[str, Any], *, secret: bool = False) -> dict[str, Any]:
    """A subscription as the API shows it: its secret only when ``secret`` (at creation
    and rotation)."""
    shown = {"id": row["id"], "url": row["url"], "kinds": row["kinds"],
             "filter": row["filter"], "enabled": bool(row["enabled"]),
             "created_at": rfc3339(row["created_at"]),
             "rotated_at": rfc3339(row["rotated_at"]) if row["rotated_at"] else None}
    if secret:
        shown["secret"] = row["secret"]
    return shown
