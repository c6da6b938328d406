"""The operator's HTTP routes (admin only): find jobs (``GET /jobs``), retry or cancel
many at once (``POST /jobs/retry``, ``POST /jobs/cancel``), pause and resume a queue, and
set and clear flow-control limits (``GET /limits``, ``PUT`` and ``DELETE /limits/{kind}/{name}``).

The filter is the same everywhere (rota/core/listing.py): query parameters here, a JSON
``filter`` object in a bulk action's body.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from rota.server.api_base import JSON, coordinator_of, decode_as, need, path_name, read_body
from rota.server.coordinator import MAX_BULK
from rota.base.errors import RequestError
from rota.base.flow import WrittenRule
from rota.core.limits import SCOPE_KINDS
from rota.core.listing import FIELDS, JobFilter, parse_filter
from rota.base.protocol import JobId, Name
from rota.base.wording import NAME_RULE

DEFAULT_LIMIT = 50
DEFAULT_BULK = 1000  # a filter's matches touched by one call unless limit says
MAX_LIMIT = 500
LIST_PARAMS = frozenset({*FIELDS, "limit", "cursor"})


class BulkFilter(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    state: list[str] | str | None = None  # states, a list or "a,b"
    spec: str | None = None
    queue: str | None = None
    worker: str | None = None
    q: str | None = None
    schedule: str | None = None


class BulkRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ids: Annotated[list[JobId], msgspec.Meta(min_length=1, max_length=MAX_BULK)] | None = None
    filter: BulkFilter | None = None
    dry_run: bool = False  # say what would be touched; change nothing
    # The most touched: by default every id given, or 1000 of a filter's matches.
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_BULK)] | None = None


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    if not (text.isascii() and text.isdigit() and len(text) <= 3
            and 1 <= int(text) <= MAX_LIMIT):
        raise RequestError(400, "invalid_limit", f"limit must be 1 to {MAX_LIMIT}")
    return int(text)


async def list_jobs(request: Request) -> Response:
    need(request, "admin")
    query = request.query_params
    unknown = sorted(set(query) - LIST_PARAMS)
    if unknown:
        raise RequestError(400, "invalid_filter", f"unknown parameter {unknown[0][:40]!r}:"
                           f" the filters are {', '.join(FIELDS)} (and limit, cursor)")
    flt = parse_filter({key: query.getlist(key) for key in FIELDS if key in query})
    for key in ("limit", "cursor"):
        if len(query.getlist(key)) > 1:
            raise RequestError(400, f"invalid_{key}", f"{key} may be given once")
    limit = _limit(query.get("limit"))
    cursor = query.get("cursor") or None
    jobs, after = await coordinator_of(request).list_jobs(flt, limit, cursor)
    return JSON({"jobs": jobs, "next_cursor": after})


def _filter(raw: BulkFilter) -> JobFilter:
    params = {k: v for k, v in msgspec.structs.asdict(raw).items() if v is not None}
    # In a query string an empty field is an unset one (an HTML form sends them all);
    # in a bulk action it would widen what is changed (a "spec": "$SPEC" whose variable
    # was unset), so it is refused.
    empty = sorted(k for k, v in params.items() if v == "" or v == [])
    if empty:
        raise RequestError(400, "invalid_filter", f"{empty[0]} is empty: leave it out to"
                           " match any, or give a value")
    flt = parse_filter(params)
    if flt == JobFilter():
        raise RequestError(422, "invalid_request", "the filter is empty: give at least one"
                           " of state, spec, queue, worker, schedule, q (or ids)")
    return flt


async def _bulk(request: Request, action: str) -> Response:
    need(request, "admin")
    body: BulkRequest = decode_as(await read_body(request), BulkRequest)
    if (body.ids is None) == (body.filter is None):
        raise RequestError(422, "invalid_request", "give either ids or filter, not both"
                           if body.ids is not None else "give either ids or filter")
    flt = _filter(body.filter) if body.filter is not None else None
    return JSON(await coordinator_of(request).bulk(action, ids=body.ids, flt=flt,
                                                 dry_run=body.dry_run,
                                                 limit=body.limit or len(body.ids or ())
                                                 or DEFAULT_BULK))


async def bulk_retry(request: Request) -> Response:
    """Put discarded and cancelled jobs back, by ids or filter."""
    return await _bulk(request, "retry")


async def bulk_cancel(request: Request) -> Response:
    """Cancel waiting and running jobs, by ids or filter."""
    return await _bulk(request, "cancel")


def _queue(request: Request) -> str:
    return path_name(request, "queue", "invalid_queue", "a queue name")


async def pause_queue(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).pause_queue(_queue(request), True))


async def resume_queue(request: Request) -> Response:
    need(request, "admin")
    return JSON(await coordinator_of(request).pause_queue(_queue(request), False))



# -- flow control (rota/server/limiting.py) ---------------------------------------------------
async def list_limits(request: Request) -> Response:
    need(request, "admin")
    return JSON(coordinator_of(request).limiting.view())


def _scope(request: Request) -> tuple[str, str]:
    """The scope a /limits/{kind}/{name} path names: 422 invalid_limit for a kind other
    than queue or spec, or a name that is none."""
    kind, name = request.path_params["kind"], request.path_params["name"]
    if kind not in SCOPE_KINDS:
        raise RequestError(422, "invalid_limit", f"a limit's scope is queue or spec, not"
                           f" {kind[:40]!r} (as in /limits/spec/send_email)")
    try:
        return kind, msgspec.convert(name, Name)
    except msgspec.ValidationError:
        raise RequestError(422, "invalid_limit", f"a {kind} name is {NAME_RULE}") from None


async def set_limit(request: Request) -> Response:
    """Set a queue's or spec's limits at runtime: they replace its spec file's until cleared."""
    principal = need(request, "admin")
    kind, name = _scope(request)
    try:
        written: WrittenRule = decode_as(await read_body(request), WrittenRule)
    except RequestError as exc:
        if exc.status != 422:
            raise
        raise RequestError(422, "invalid_limit", exc.message) from None
    return JSON(await coordinator_of(request).limiting.set(kind, name, written, principal))


async def clear_limit(request: Request) -> Response:
    need(request, "admin")
    kind, name = _scope(request)
    return JSON(await coordinator_of(request).limiting.clear(kind, name))
