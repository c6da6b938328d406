"""What an operator watches: GET /events (server-sent events), GET /stats and GET /metrics.

All three read what rota/core/observe.py recorded. The event stream is pulled by each
subscriber from the observer's ring at its own pace: a subscriber whose client reads
slowly waits in its own ``send`` (the transport's flow control), never holds the loop or
anyone else, and, once the ring has moved past it, gets a ``gap`` event and goes on
from the oldest event kept. /metrics turns the observer's plain numbers, and gauges
read at scrape time, into Prometheus's text format through a collector of our own: no
prometheus-client object is touched per job (nor imported before the first scrape).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from rota.server.api_base import DROP, JSON, need, token_revoked, too_many_waits
from rota.core.auth import Principal
from rota.server.coordinator import Coordinator
from rota.base.errors import RequestError
from rota.core.limits import LimitUse, fold_keys
from rota.core.listing import NAME, JobFilter
from rota.core.model import JOB_STATES
from rota.core.observe import (COUNTS, DURATION_BOUNDS, KINDS, UNFINISHED, WAIT_BOUNDS, Event,
                          Filter, Observer, event_data, fold_queues)
from rota.base.protocol import rfc3339

if TYPE_CHECKING:
    from prometheus_client.core import Metric

CHUNK = 256  # events taken from the ring per send: a slow client's backlog is bounded
CHUNK_BYTES = 16 << 10  # ... and about this many bytes of them
KEEP_ALIVE = b": keep-alive\n\n"
ENCODED_KEPT = 4096  # events kept encoded for subscribers (about 1 MB at most)
WORKER_STATES = ("running", "quiet", "terminate")


# -- GET /events --------------------------------------------------------------------------
def _last_event_id(request: Request) -> int | None:
    text = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if text is None or text == "":
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 19:
        raise RequestError(400, "invalid_last_event_id", "Last-Event-ID (or last_event_id)"
                           " must be an event id: at most 19 digits")
    return int(text)


def _known_params(request: Request, known: tuple[str, ...], repeatable: tuple[str, ...] = ()
                  ) -> None:
    """A misspelt or repeated parameter is refused, as GET /jobs does, rather than
    silently widening (or narrowing) what is answered."""
    params = request.query_params
    for key in params:
        if key not in known:
            raise RequestError(400, "invalid_filter", f"unknown parameter {key[:40]!r}: the"
                               f" parameters are {', '.join(known)}")
        if key not in repeatable and len(params.getlist(key)) > 1:
            raise RequestError(400, "invalid_filter", f"{key} may be given once")


def _filter(request: Request) -> Filter:
    _known_params(request, ("last_event_id", "event", "spec", "queue", "worker"),
                  repeatable=("event",))
    params = request.query_params
    for key in ("spec", "queue", "worker"):
        value = params.get(key)
        if value and not NAME.fullmatch(value):
            raise RequestError(400, "invalid_filter",
                               f"{key} is not a name (letters, digits and _.:- up to 128)")
    kinds = None
    if "event" in params:
        kinds = frozenset(k.strip() for value in params.getlist("event")
                          for k in value.split(",") if k.strip())
        unknown = sorted(kinds - set(KINDS))
        if unknown or not kinds:
            raise RequestError(400, "invalid_filter", f"unknown event kind(s)"
                               f" {', '.join(unknown) or '(none given)'}; the kinds are"
                               f" {', '.join(KINDS)}")
    return Filter(kinds=kinds, spec=params.get("spec") or None,
                  queue=params.get("queue") or None, worker=params.get("worker") or None)


class EventsResponse(Response):
    """A text/event-stream that runs until the client goes, the server stops or the
    caller's token is revoked.

    What it holds for a client that does not read is bounded: a part is at most
    CHUNK_BYTES, and the next is made only once the last one was taken by the transport
    (uvicorn's send waits while the transport holds more than its high-water mark, 64
    KiB). Events themselves wait in the observer's ring, shared by every subscriber."""

    media_type = "text/event-stream"

    def __init__(self, coordinator: Coordinator, last_id: int, only: Filter,
                 principal: Principal) -> None:
        # As StreamingResponse does: no body, so no content-length among the headers.
        self.status_code, self.background = 200, None
        self.init_headers({"cache-control": "no-store", "x-accel-buffering": "no"})
        self.coordinator, self.last_id, self.only = coordinator, last_id, only
        self.principal = principal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        coordinator = self.coordinator
        hold = coordinator.hold(self.principal)
        if hold is None or hold.revoked.done():  # (revoked since the request was let in)
            refusal = too_many_waits(coordinator) if hold is None else token_revoked()
            await refusal(scope, receive, send)
            if hold is not None:
                coordinator.release(hold)
            return
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            gone = asyncio.ensure_future(_disconnected(receive))
            coordinator.subscribe()
            try:
                await self._stream(Sender(send, scope, hold.revoked), gone, hold.revoked)
            finally:
                coordinator.unsubscribe()
                gone.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await gone
        finally:
            coordinator.release(hold)

    async def _stream(self, sender: Sender, gone: asyncio.Future[None],
                      revoked: asyncio.Future[None]) -> None:
        coordinator = self.coordinator
        observer = coordinator.observer
        keepalive = coordinator.settings.events_keepalive
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while not gone.done() and not revoked.done() and not coordinator.stopping:
            before = self.last_id
            chunk = self._take(observer)
            if chunk:
                if not await sender.part(chunk):
                    return
                quiet_since = loop.time()
                continue
            if self.last_id != before:
                # A chunk none of which passed the filter: read on at once (the buffer
                # may hold matching events further on), letting others run between.
                await asyncio.sleep(0)
                continue
            left = quiet_since + keepalive - loop.time()
            if left <= 0:
                if not await sender.part(KEEP_ALIVE):
                    return
                quiet_since = loop.time()
                continue
            await asyncio.wait([coordinator.events_pulse(), gone, revoked], timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)
        if not gone.done():  # the server stops, or the token was revoked: end it cleanly
            await sender.part(b"", more=False)

    def _take(self, observer: Observer) -> bytes:
        """What this subscriber has not had yet, up to CHUNK events and about
        CHUNK_BYTES, encoded."""
        missed, events = observer.after(self.last_id, CHUNK)
        parts = []
        size = 0
        if missed:  # (then events holds the oldest kept)
            parts.append(gap(missed, events[0][0] - 1, observer.latest))
        only = self.only
        for event_id, event in events:
            self.last_id = event_id
            if only.matches(event):
                part = encoding(observer, event_id, event)
                parts.append(part)
                size += len(part)
                if size >= CHUNK_BYTES:
                    break
        return b"".join(parts)


# -- the wire format of GET /events --------------------------------------------------
_json = msgspec.json.Encoder()


def frame(event_id: int, kind: str, data: bytes) -> bytes:
    """One server-sent event: its id (a client resumes with it as Last-Event-ID), its kind
    and its data, a JSON object."""
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event_id, kind.encode(), data)


def encode(event_id: int, event: Event) -> bytes:
    """A recorded event as a server-sent event. Only here, for a subscriber that reads
    it, does an event cost its encoding."""
    return frame(event_id, event[1], _json.encode(event_data(event)))


def encoding(observer: Observer, event_id: int, event: Event) -> bytes:
    """``encode(event_id, event)``, made once for every subscriber that reads it, and
    kept for the others in ``observer.encoded`` (at most ENCODED_KEPT)."""
    data = observer.encoded.get(event_id)
    if data is None:
        data = observer.encoded[event_id] = encode(event_id, event)
        if len(observer.encoded) > ENCODED_KEPT:  # the first made is the first to go
            del observer.encoded[next(iter(observer.encoded))]
    return data


def gap(missed_from: int, missed_to: int, wall: float) -> bytes:
    """What a subscriber that fell behind the ring gets before the events it can have."""
    return frame(missed_to, "gap", _json.encode({"at": rfc3339(wall), "kind": "gap",
                                                "missed_from": missed_from,
                                                "missed_to": missed_to}))


class Sender:
    """A stream's sends, each given up when the stream must end (its token revoked) while
    the client does not read: the connection is dropped then, or the stream would wait on
    it for ever."""

    def __init__(self, send: Send, scope: Scope, revoked: asyncio.Future[None]) -> None:
        self.send, self.scope, self.revoked = send, scope, revoked

    async def part(self, body: bytes, *, more: bool = True) -> bool:
        """Send a part; False if the connection was dropped instead."""
        sending = asyncio.ensure_future(self.send({"type": "http.response.body", "body": body,
                                                   "more_body": more}))
        if not sending.done():
            await asyncio.wait([sending, self.revoked], return_when=asyncio.FIRST_COMPLETED)
        if not sending.done():
            drop = self.scope.get(DROP)
            method = drop() if drop is not None else None
            if method is not None:
                method()  # the transport is lost: uvicorn's send returns
            await asyncio.wait([sending])
            sending.exception()  # (retrieved: a send on a dropped connection may fail)
            return False
        sending.result()
        return True


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def events(request: Request) -> Response:
    principal = need(request, "admin")
    coordinator: Coordinator = request.app.state.coordinator
    only = _filter(request)
    # A misspelt name would follow nothing, silently: refused as GET /jobs refuses it.
    await coordinator.check_names(JobFilter(spec=only.spec, queue=only.queue))
    last_id = _last_event_id(request)
    newest = coordinator.observer.next_id - 1
    # No id, or one ahead of this server's (not one it gave): from now on.
    start = newest if last_id is None or last_id > newest else last_id
    return EventsResponse(coordinator, start, only, principal)


# -- GET /stats -----------------------------------------------------------------------------
async def stats(request: Request) -> Response:
    need(request, "admin")
    _known_params(request, ("minutes",))
    text = request.query_params.get("minutes", "60")
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 60):
        raise RequestError(400, "invalid_minutes", "minutes must be a whole number from 1 to 60")
    return JSON(await request.app.state.coordinator.stats(int(text)))


# -- GET /metrics -------------------------------------------------------------------------
# A series as a scrape copies it: (queue, spec, totals, wait, duration), each histogram
# as (counts, sum). Copied on the loop (at most max_series + 1 of them), formatted off it.
Row = tuple[str, str, list[int], tuple[list[int], float], tuple[list[int], float]]


def copy_series(observer: Observer) -> list[Row]:
    return [(queue, spec, list(series.totals), (list(series.wait.counts), series.wait.sum),
             (list(series.duration.counts), series.duration.sum))
            for queue, spec, series in observer.totals()]


class ScrapeCollector:
    """The metrics of one scrape, as a prometheus-client collector (it asks only for
    ``collect``): the observer's numbers as copied, and the gauges read for it."""

    def __init__(self, rows: list[Row], gauges: dict[str, Any]) -> None:
        self.rows, self.gauges = rows, gauges

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)

        labels = ["queue", "spec"]
        counters = [CounterMetricFamily(f"rota_jobs_{name}", f"Jobs {name}, since the"
                                        " server started", labels=labels) for name in COUNTS]
        wait = HistogramMetricFamily("rota_job_queue_wait_seconds", "Seconds from when a job"
                                     " could run to its assignment", labels=labels)
        duration = HistogramMetricFamily("rota_job_duration_seconds", "Seconds from a job's"
                                         " assignment to its result", labels=labels)
        for queue, spec, totals, waits, durations in self.rows:
            for counter, total in zip(counters, totals, strict=True):
                counter.add_metric([queue, spec], total)
            for family, bounds, (counts, total) in ((wait, WAIT_BOUNDS, waits),
                                                    (duration, DURATION_BOUNDS, durations)):
                if any(counts):
                    family.add_metric([queue, spec], _buckets(bounds, counts), total)
        yield from counters
        yield wait
        yield duration
        jobs = GaugeMetricFamily("rota_queue_jobs", "Jobs per queue and state",
                                 labels=["queue", "state"])
        for queue, counts in sorted(self.gauges["queue_counts"].items()):
            for state in JOB_STATES:
                jobs.add_metric([queue, state], counts.get(state, 0))
        yield jobs
        oldest = GaugeMetricFamily("rota_queue_oldest_available_seconds", "Age of the oldest"
                                   " available job per queue (0: none)", labels=["queue"])
        for queue, age in sorted(self.gauges["oldest"].items()):
            oldest.add_metric([queue], age)
        yield oldest
        workers = GaugeMetricFamily("rota_workers", "Connected workers per state",
                                    labels=["state"])
        for state in WORKER_STATES:
            workers.add_metric([state], self.gauges["workers"].get(state, 0))
        yield workers
        blocked = GaugeMetricFamily("rota_jobs_blocked", "Available jobs that cannot run now,"
                                    " per spec and why", labels=["spec", "reason"])
        for (spec, reason), n in sorted(self.gauges["blocked"].items()):
            blocked.add_metric([spec, reason], n)
        yield blocked
        yield from limit_metrics(self.gauges["limits"])
        yield from endpoint_metrics(self.gauges["endpoints"])


def limit_metrics(uses: list[LimitUse]) -> Iterator[Metric]:
    """Each limit's use: a scope's own under key="", each key in use under its name
    (at most --max-series of them, the rest summed under key="(other)")."""
    from prometheus_client.core import GaugeMetricFamily

    labels = ["limit", "key"]
    in_use = GaugeMetricFamily("rota_limit_in_use", "Reserved (running or prefetched) jobs"
                               " counted against a limit", labels=labels)
    most = GaugeMetricFamily("rota_limit_max", "A concurrency limit: the most reserved jobs"
                             " it allows", labels=labels)
    starts = GaugeMetricFamily("rota_rate_starts", "Starts within a rate limit's last"
                               " period", labels=labels)
    for use in uses:
        names = [use.name, use.key or ""]
        in_use.add_metric(names, use.running)
        if use.concurrency is not None:
            most.add_metric(names, use.concurrency)
        if use.rate is not None:
            starts.add_metric(names, use.starts)
    yield in_use
    yield most
    yield starts


def endpoint_metrics(views: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per push endpoint (GET /endpoints): whether its breaker holds its jobs, its
    deliveries in flight and how often it opened."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    labels = ["endpoint", "spec"]
    paused = GaugeMetricFamily("rota_endpoint_open", "1 while a push endpoint's circuit"
                               " breaker holds its jobs (open, or half-open: one trial)",
                               labels=labels)
    flying = GaugeMetricFamily("rota_endpoint_in_flight", "Deliveries sent to a push"
                               " endpoint and not answered yet", labels=labels)
    opened = CounterMetricFamily("rota_endpoint_openings", "Times a push endpoint's circuit"
                                 " breaker opened, since the server started", labels=labels)
    for view in views:
        named = [view["id"], view["spec"]]
        paused.add_metric(named, 0 if view["state"] == "closed" else 1)
        flying.add_metric(named, view["in_flight"])
        opened.add_metric(named, view["opened"])
    yield from (paused, flying, opened)


def _buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, float]]:
    cumulative, out = 0, []
    for bound, n in zip([*map(repr, bounds), "+Inf"], counts, strict=True):
        cumulative += n
        out.append((bound, cumulative))
    return out


async def gauges(coordinator: Coordinator) -> dict[str, Any]:
    """The scrape-time gauges: the store's counts per queue and state, and what memory
    says of the oldest waiting jobs, the workers and the blocked jobs. Queues are named
    one by one up to ``max_series`` (rota/core/observe.py): producers name them."""
    now = coordinator.clock().wall
    counts = fold_queues(await coordinator.queue_counts(),
                         coordinator.settings.max_series, UNFINISHED)
    since = await coordinator.oldest_available()
    queues = set(counts) | set(since)
    oldest = {q: (round(max(0.0, now - since[q]), 3) if q in since else 0.0) for q in queues}
    workers: dict[str, int] = {}
    endpoints = coordinator.endpoint_views()  # (counted in rota_endpoint_*, not as workers)
    named = {e["id"] for e in endpoints}
    for worker_id, connection in coordinator.connections.items():
        if worker_id in named:
            continue
        state = connection.worker.state
        workers[state] = workers.get(state, 0) + 1
    blocked: dict[tuple[str, str], int] = {}
    for row in coordinator.waiting():  # a backlog behind busy workers is not counted
        for kind, n in row.kinds().items():
            blocked[(row.spec, kind)] = blocked.get((row.spec, kind), 0) + n
    limits = fold_keys(coordinator.limit_use(), coordinator.settings.max_series)
    return {"queue_counts": counts, "oldest": oldest, "workers": workers, "blocked": blocked,
            "limits": limits, "endpoints": endpoints}


async def metrics(request: Request) -> Response:
    # Imported at the first scrape, not at the start: it takes ~80 ms, and a restart
    # is measured to /healthz (docs/performance.md).
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    need(request, "metrics")
    coordinator: Coordinator = request.app.state.coordinator
    registry = CollectorRegistry(auto_describe=False)
    measured = await gauges(coordinator)
    registry.register(ScrapeCollector(copy_series(coordinator.observer), measured))
    # The text is made on a thread (from copies): the loop goes on serving meanwhile.
    body = await asyncio.to_thread(generate_latest, registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
