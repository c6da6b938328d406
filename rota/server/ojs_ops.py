"""The OJS binding's operator routes (admin), under the /ojs mount (rota/server/ojs_api.py):
queues, a queue's counts, pause and resume, the dead letter (list, retry, delete), and
events derived from the jobs' rows (docs/ojs.md). Answers in the shapes the OJS suites
read (design §3); the shell does the work (rota/server/ojs_operating.py).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rota.base.protocol import Name
from rota.base.wording import NAME_RULE
from rota.core.ojs_map import OjsRefusal, job_view, ojs_time, shown_id
from rota.server.api_base import coordinator_of, need
from rota.server.ojs_base import OjsJSON, ojs_error
from rota.store.ojs_reads import EVENT_TIMES

DEFAULT_PAGE, MAX_PAGE = 50, 100  # dead-letter jobs per page (HB §12.1)
MAX_QUEUES = 1000  # queues per page (by name)
MAX_EVENTS = 100  # events per answer (of each type read, then merged)
MAX_EVENTS_ASKED = 1000  # a larger limit is refused (ojs-events §6.4); past 100, 100 come


def _queue(request: Request) -> str:
    return _name(request.path_params["queue"])


def _name(text: str) -> str:
    """A queue's name, or 400."""
    try:
        return msgspec.convert(text, Name)
    except msgspec.ValidationError:
        raise _bad(f"a queue name is {NAME_RULE}") from None


def _count(request: Request, name: str, default: int, low: int, high: int) -> int:
    """A whole number in the query (``name``), from ``low`` to ``high``, or 400."""
    text = request.query_params.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 9 and low <= int(text) <= high):
        raise _bad(f"{name} must be a whole number from {low} to {high}")
    return int(text)


def _listed(request: Request, name: str) -> list[str]:
    """A comma-separated query parameter, each given once ([] when absent)."""
    return list(dict.fromkeys(v for text in request.query_params.getlist(name)
                              for v in text.split(",") if v))


def _bad(message: str) -> OjsRefusal:
    return OjsRefusal(400, "invalid_request", "validation_error", message)


def _not_found(what: str, job_id: str) -> Response:
    return ojs_error(404, "not_found", f"{what} {job_id[:100]} was not found", type="not_found",
                     hint="GET /ojs/v1/dead-letter lists the jobs the dead letter holds")


def _queue_view(name: str, paused: bool) -> dict[str, Any]:
    return {"name": name, "paused": paused, "status": "paused" if paused else "active"}


# -- queues ---------------------------------------------------------------------------
async def list_queues(request: Request) -> Response:
    need(request, "admin")
    limit = _count(request, "limit", MAX_QUEUES, 1, MAX_QUEUES)
    offset = _count(request, "offset", 0, 0, 10**9)
    found = await coordinator_of(request).ojs_queues()
    page = found[offset:offset + limit]
    return OjsJSON({"queues": [_queue_view(name, paused) for name, paused in page],
                    "pagination": {"total": len(found), "limit": limit, "offset": offset,
                                   "has_more": offset + len(page) < len(found)}})


async def queue_stats(request: Request) -> Response:
    need(request, "admin")
    name = _queue(request)
    counts, paused, at = await coordinator_of(request).ojs_queue_stats(name)
    return OjsJSON({"queue": {**_queue_view(name, paused), **counts},
                    "computed_at": ojs_time(at)})


async def pause_queue(request: Request) -> Response:
    return await _pause(request, True)


async def resume_queue(request: Request) -> Response:
    return await _pause(request, False)


async def _pause(request: Request, paused: bool) -> Response:
    need(request, "admin")
    name = _queue(request)
    await coordinator_of(request).ojs_pause(name, paused)
    return OjsJSON({"queue": _queue_view(name, paused)})


# -- the dead letter --------------------------------------------------------------------
async def dead_letter(request: Request) -> Response:
    need(request, "admin")
    limit = _count(request, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
    offset = _count(request, "offset", 0, 0, 10**9)
    queue = request.query_params.get("queue")
    coordinator = coordinator_of(request)
    rows, total = await coordinator.dead_letter(limit, offset,
                                                None if queue is None else _name(queue))
    now = coordinator.clock().wall
    return OjsJSON({"jobs": [job_view(row, now) for row in rows],
                    "pagination": {"total": total, "limit": limit, "offset": offset,
                                   "has_more": offset + len(rows) < total}})


async def retry_dead(request: Request) -> Response:
    need(request, "admin")
    job_id = request.path_params["job_id"]
    coordinator = coordinator_of(request)
    row = await coordinator.retry_dead(job_id)
    if row is None:
        return _not_found("dead-letter job", job_id)
    return OjsJSON({"job": job_view(row, coordinator.clock().wall)})


async def delete_dead(request: Request) -> Response:
    need(request, "admin")
    job_id = request.path_params["job_id"]
    if await coordinator_of(request).delete_dead(job_id) is None:
        return _not_found("dead-letter job", job_id)
    return OjsJSON({"deleted": True, "job_id": job_id})


# -- events -----------------------------------------------------------------------------
def event_view(kind: str, row: dict[str, Any]) -> tuple[float, dict[str, Any]] | None:
    """When one job's event of ``kind`` happened (wall), and the event as OJS shows it
    (ojs-events §2), from its row; None if the row does not say when it happened."""
    if kind == "job.retrying":
        errors = msgspec.json.decode(row.get("errors") or "[]")
        at = errors[-1].get("at") if errors else None  # (RFC 3339, as error_record writes it)
        moment = None if at is None else dt.datetime.fromisoformat(at).timestamp()
    else:
        moment = row.get(EVENT_TIMES[kind])
    if moment is None:
        return None
    job_id = shown_id(row)  # (as the job's view shows it: a producer's without its prefix)
    data: dict[str, Any] = {"job_id": job_id, "job_type": row["spec"], "queue": row["queue"],
                            "attempt": row["attempt"] - (row.get("budget_start") or 0),
                            "state": row["state"]}
    finished, started = row.get("finished_at"), row.get("reserved_at")
    if kind in ("job.completed", "job.discarded", "job.cancelled"):
        data["duration_ms"] = (None if finished is None or started is None
                               else max(0, round((finished - started) * 1000)))
    return moment, {"specversion": "1.0", "id": f"evt_{job_id}_{kind[4:]}_{row['attempt']}",
                    "type": kind, "source": "ojs://rota", "time": ojs_time(moment),
                    "subject": job_id, "data": data}


async def events(request: Request) -> Response:
    need(request, "admin")
    types = _listed(request, "types") or list(EVENT_TIMES)
    unknown = [t for t in types if t not in EVENT_TIMES]
    if unknown:
        raise _bad(f"event type {unknown[0][:60]!r} is not one Rota derives:"
                   f" {', '.join(EVENT_TIMES)}")
    queues = _listed(request, "queues")
    limit = min(MAX_EVENTS, _count(request, "limit", MAX_EVENTS, 1, MAX_EVENTS_ASKED))
    found = await coordinator_of(request).job_events(types, queues[:MAX_PAGE], limit)
    events = [e for kind, row in found if (e := event_view(kind, row)) is not None]
    events.sort(key=lambda e: e[0], reverse=True)  # newest first, all types merged
    return OjsJSON({"events": [view for _, view in events[:limit]]})


# Paths under the /ojs mount (rota/server/ojs_api.py includes them).
routes = [
    Route("/v1/queues", list_queues, methods=["GET"]),
    Route("/v1/queues/{queue}/stats", queue_stats, methods=["GET"]),
    Route("/v1/queues/{queue}/pause", pause_queue, methods=["POST"]),
    Route("/v1/queues/{queue}/resume", resume_queue, methods=["POST"]),
    Route("/v1/dead-letter", dead_letter, methods=["GET"]),
    Route("/v1/dead-letter/{job_id}/retry", retry_dead, methods=["POST"]),
    Route("/v1/dead-letter/{job_id}", delete_dead, methods=["DELETE"]),
    Route("/v1/events", events, methods=["GET"]),
]
