"""The web dashboard at /ui: the pages (overview, queues, specs, limits, workers, jobs, a job;
the workflows' are rota/server/flowpages.py's), server-rendered over what the JSON API
shows, and the operator's actions as HTML forms.
How a page is rendered, refreshed, and posted to, and the login, are in rota/server/pages.py.
"""

from __future__ import annotations

import contextlib
from typing import Any
from urllib.parse import urlencode

import msgspec
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from rota.server import flowpages
from rota.server.api import job_detail, worker_views
from rota.server.api_base import coordinator_of, need
from rota.core import display
from rota.core.charts import SERIES, start_index, throughput_svg
from rota.server.coordinator import Coordinator
from rota.base.errors import RequestError
from rota.base.ids import path_segment
from rota.core.limits import LimitRule, LimitUse, limit_name
from rota.core.listing import (FIELDS, NAME, JobFilter, decode_cursor, filter_params,
                                parse_filter)
from rota.store.lookup import COUNT_CAP
from rota.server.pages import (HERE, STATES, action, counted_queues, login, login_form, logout,
                        render)
from rota.core.policy import TERMINAL_STATES
from rota.base.protocol import Name, rfc3339

DIRECTIVES = ("quiet", "running", "terminate")  # running: resume a quiet worker
VERBS = {"quiet": "go quiet", "running": "resume", "terminate": "terminate"}
PAGE = 50  # jobs a page of the list shows
TRAIL = 100  # pages back a Newer link can retrace (then it goes to the first)
BULK_LIMIT = 1000  # jobs one bulk action from the dashboard touches at most
CHART_MINUTES = 60
KEYS_SHOWN = 50  # concurrency keys a limit's panel lists, the busiest (then "N more")


# -- pages ----------------------------------------------------------------------------
async def overview(request: Request) -> Response:
    need(request, "admin")
    coordinator = coordinator_of(request)
    queues, note, others = await counted_queues(request)
    totals = dict.fromkeys(STATES, 0)
    for counts in [q["counts"] for q in queues] + [others["counts"] if others else {}]:
        for state, n in counts.items():
            totals[state] += n
    endpoints = coordinator.endpoint_views()  # apart: no process, a breaker instead
    named = {e["id"] for e in endpoints}
    workers = [w for w in worker_views(coordinator) if w["id"] not in named]
    by_state: dict[str, int] = {}
    for worker in workers:
        by_state[worker["state"]] = by_state.get(worker["state"], 0) + 1
    degraded = coordinator.storage_degraded()
    chart, hour = throughput(await coordinator.stats(CHART_MINUTES))
    return render(request, "overview", totals=totals, chart=chart, hour=hour,
                  counts_note=note, queues=queues, workers=by_state,
                  worker_count=len(workers), blocked=blocked(coordinator),
                  endpoints=len(endpoints),
                  paused_endpoints=sum(e["state"] != "closed" for e in endpoints),
                  live_jobs=coordinator.live_jobs(), specs=len(coordinator.specs),
                  storage=None if degraded is None else degraded.message,
                  uptime=coordinator.uptime())


def throughput(stats: dict[str, Any]) -> tuple[str, dict[str, int]]:
    """The chart of every queue and spec together, per minute, and the hour's totals."""
    minutes = len(stats["minute_starts"])
    totals = {name: [0] * minutes for name in SERIES}
    for row in stats["series"]:
        for name in SERIES:
            for i, n in enumerate(row[name]):
                totals[name][i] += n
    labels = [start[11:16] for start in stats["minute_starts"]]  # HH:MM, UTC
    start = start_index(stats["minute_starts"], stats.get("started_at"))  # if within
    marker = None if start is None else (start, f"server started {stats['started_at'][11:16]}")
    return (throughput_svg(labels, totals, marker),
            {name: sum(v) for name, v in totals.items()})


def blocked(coordinator: Coordinator) -> list[dict[str, Any]]:
    """Available jobs that no worker will take as things stand, per queue and spec, and
    why: not a backlog behind busy workers, which is no incident (Wait.blocked)."""
    rows = coordinator.waiting()
    return [row._asdict() for row in rows if row.blocked] + [
        {**row._asdict(), "jobs": row.held["no_label"], "reason": display.no_labels(
            {"missing_labels": row.missing_labels, "missing_labels_more": row.missing_more})}
        for row in rows if not row.blocked and row.held.get("no_label")]


async def queues_page(request: Request) -> Response:
    need(request, "admin")
    queues, note, others = await counted_queues(request)
    return render(request, "queues", queues=queues, states=STATES, counts_note=note,
                  others=others, max_series=coordinator_of(request).settings.max_series)


async def limits_page(request: Request) -> Response:
    need(request, "admin")
    return render(request, "limits", limits=limit_panels(coordinator_of(request)),
                  keys_shown=KEYS_SHOWN, limit_use=display.limit_use)


def limit_panels(coordinator: Coordinator) -> list[dict[str, Any]]:
    """Each limit in force: its rule in words, its own use, and the keys in use, the
    busiest ``KEYS_SHOWN`` of them (producers name keys: there may be 10,000)."""
    uses: dict[str, list[LimitUse]] = {}
    for use in coordinator.limit_use():
        uses.setdefault(use.name, []).append(use)
    panels = []
    for scope, rule in sorted(coordinator.limit_rules().items()):
        name = limit_name(scope)
        own = [msgspec.to_builtins(u) for u in uses.get(name, []) if u.key is None]
        keys = sorted((u for u in uses.get(name, []) if u.key is not None),
                      key=lambda u: (-u.running, -u.starts, u.key))
        source = display.limit_source(coordinator.limiting.entry(scope, rule))
        panels.append({"name": name, "rule": rule_words(rule), "source": source,
                       "own": own[0] if own else None,
                       "key_uses": [msgspec.to_builtins(u) for u in keys[:KEYS_SHOWN]],
                       "more": max(0, len(keys) - KEYS_SHOWN)})
    return panels


def rule_words(rule: LimitRule) -> list[str]:
    """A rule as people say it: "at most 40 running", "100/min starts", "per key: at
    most 3 running", "per key: 5/s starts"."""
    words = []
    if rule.concurrency is not None:
        words.append(f"at most {rule.concurrency} running")
    if rule.rate is not None:
        words.append(f"{rule.rate.text()} starts")
    if rule.key_concurrency is not None:
        words.append(f"per key: at most {rule.key_concurrency} running")
    if rule.key_rate is not None:
        words.append(f"per key: {rule.key_rate.text()} starts")
    return words


async def specs_page(request: Request) -> Response:
    need(request, "admin")
    coordinator = coordinator_of(request)
    stuck = blocked(coordinator)
    retired_specs = coordinator.retired_specs()
    specs = []
    for name, spec in sorted(coordinator.specs.items()):
        workers = coordinator.spec_workers(name)
        retired = retired_specs.get(name)
        specs.append({
            "name": name, "version": spec.version, "checksum": workers.checksum,
            "queue": spec.queue, "description": spec.description,
            "retired_at": None if retired is None else rfc3339(retired),
            "matching": workers.matching, "other": workers.other,
            "blocked": [row for row in stuck if row["spec"] == name],
            "history": (await coordinator.spec_history(name))[::-1],
        })
    return render(request, "specs", specs=specs)


async def schedules_page(request: Request) -> Response:
    """Cron schedules: expression, zone, state, last run and its outcome, next 3 fires."""
    need(request, "admin")
    listed = (await coordinator_of(request).clockwork.list())["schedules"]
    return render(request, "schedules", schedules=listed)


async def workers_page(request: Request) -> Response:
    need(request, "admin")
    coordinator = coordinator_of(request)
    workers = worker_views(coordinator)
    # The label chosen last (the by-label form comes back with it), kept chosen even when
    # no worker has it any more: never silently another label, such as a new fleet's.
    chosen = request.query_params.get("label", "")
    labels = sorted({label for worker in workers for label in worker["labels"]}
                    | ({chosen} if NAME.fullmatch(chosen) else set()))
    # push endpoints: no process to direct, their URL and circuit breaker instead
    endpoints = {e["id"]: e for e in coordinator.endpoint_views()}
    shown = [{**endpoints[w["id"]], "queues": w["queues"]} for w in workers
             if w["id"] in endpoints]
    workers = [w for w in workers if w["id"] not in endpoints]
    return render(request, "workers", workers=workers, labels=labels, chosen=chosen,
                  endpoints=shown,
                  shared=coordinator.shares_database(), directives=DIRECTIVES, verbs=VERBS,
                  actions_for=actions_for)


def delivery_record(details: Any) -> dict[str, Any] | None:
    """A push delivery's record, taken out of an attempt's error details (its status,
    milliseconds, cut body, delivery id: rota/base/push.py Delivered.record); None if
    the attempt was no delivery."""
    if not isinstance(details, dict) or not isinstance(details.get("delivery_id"), str):
        return None
    return {key: details.pop(key, None) for key in ("delivery_id", "status", "ms", "body",
                                                    "retry_after")}


def actions_for(state: str) -> tuple[str, ...]:
    """What may be asked of a worker in this state: never back from terminate."""
    return {"running": ("quiet", "terminate"), "quiet": ("running", "terminate")}.get(state, ())


def job_filter(params: Any) -> JobFilter:
    """The list's filter from the query string (or a form): RequestError if invalid."""
    return parse_filter({key: params.getlist(key) if hasattr(params, "getlist")
                         else [params[key]] for key in FIELDS if key in params})


async def jobs_page(request: Request) -> Response:
    need(request, "admin")
    coordinator = coordinator_of(request)
    params = request.query_params
    form = {"states": (), "spec": "", "queue": "", "worker": "", "schedule": "", "q": ""}
    # Every queue that has live jobs, a worker or a pause, and the one asked for: a queue
    # given only at enqueue must not fall out of the form (the next Filter would widen
    # to every queue, and a bulk action with it).
    asked = {params["queue"]} if params.get("queue") else set()
    choices = {"specs": sorted(set(coordinator.specs)
                               | ({params["spec"]} if params.get("spec") else set())),
               "queues": sorted({spec.queue for spec in coordinator.specs.values()}
                                | coordinator.served_queues()
                                | set(coordinator.live_counts())
                                | coordinator.paused_queues() | asked)}
    try:
        flt = job_filter(params)
    except RequestError as exc:
        return render(request, "jobs", status=400, error=exc.message, flt=None, form=form,
                      jobs=[], total=0, capped=False, query="", pager={}, states=STATES,
                      **choices)
    form = {"states": flt.states, "spec": flt.spec or "", "queue": flt.queue or "",
            "worker": flt.worker or "", "schedule": flt.schedule or "", "q": flt.q or ""}
    q = flt.q
    if q and flt == JobFilter(q=q) and await coordinator.get_job(q) is not None:
        return RedirectResponse(f"/ui/jobs/{path_segment(q)}", status_code=303)  # an id: its page
    cursor = params.get("cursor") or None
    try:
        jobs, after = await coordinator.list_jobs(flt, PAGE, cursor)
    except RequestError as exc:  # a cursor edited by hand, an unknown spec or queue: said
        return render(request, "jobs", status=exc.status, error=exc.message, flt=None, form=form,
                      jobs=[], total=0, capped=False, query="", pager={}, states=STATES,
                      **choices)
    total = await coordinator.count_jobs(flt)
    query = urlencode(filter_params(flt), doseq=True)
    return render(request, "jobs", error=None, flt=flt, form=form, jobs=jobs, total=total,
                  capped=total >= COUNT_CAP, query=query, states=STATES,
                  pager=pager(query, cursor, after, params.get("trail", "")), **choices)


def pager(query: str, cursor: str | None, after: str | None, trail_text: str
          ) -> dict[str, str]:
    """The jobs list's First, Newer and Older links. Each page is a keyset cursor; going
    older, a link carries the cursors of the pages it came through (``trail``), so that
    Newer goes back to the very page seen before, whatever was enqueued since."""
    trail = []
    for text in trail_text.split(".")[-TRAIL:]:
        with contextlib.suppress(RequestError):  # not a cursor (edited by hand): left out
            decode_cursor(text)
            trail.append(text)

    def link(at: str | None, through: list[str]) -> str:
        parts = [query] if query else []
        if at:
            parts.append(urlencode({"cursor": at}))
        if through:
            parts.append(urlencode({"trail": ".".join(through)}))
        return "/ui/jobs" + ("?" + "&".join(parts) if parts else "")

    links = {}
    if cursor is not None:
        links["first"] = link(None, [])
        links["newer"] = link(trail[-1], trail[:-1]) if trail else links["first"]
    if after is not None:
        links["older"] = link(after, [*trail, cursor] if cursor else [])
    return links


async def bulk_page(request: Request) -> Response:
    """What a bulk retry or cancel of the list's filter would do, counted by a dry run,
    and the button that does it: the confirmation states the count."""
    need(request, "admin")
    coordinator = coordinator_of(request)
    action = request.query_params.get("action", "")
    if action not in ("retry", "cancel"):
        raise RequestError(400, "invalid_request", "action must be retry or cancel")
    flt = job_filter(request.query_params)
    if flt == JobFilter():
        raise RequestError(400, "invalid_filter", "filter the jobs first: a bulk action"
                           " needs at least one of state, spec, queue, worker, schedule, q")
    preview = await coordinator.bulk(action, flt=flt, dry_run=True, limit=BULK_LIMIT)
    query = urlencode(filter_params(flt), doseq=True)
    # The jobs the dry run looked at (the newest, up to the cap), and those of them left
    # alone (the preview lists only the first 100 skipped).
    examined = BULK_LIMIT if preview["truncated"] else preview["matched"]
    # How many match: counted exactly past the cap of one action, up to the store's cap
    # of a count; "at least" only at that cap, or when a bounded search (q) stopped short.
    at_least = preview["truncated"] and not BULK_LIMIT < preview["matched"] < COUNT_CAP
    return render(request, "bulk", action=action, preview=preview, query=query,
                  examined=examined, left=examined - preview["touched"], at_least=at_least,
                  fields={key: ",".join(v) if isinstance(v, list) else v
                          for key, v in filter_params(flt).items()})


async def bulk_run(request: Request, form: dict[str, str]) -> str:
    action = form.get("action", "")
    if action not in ("retry", "cancel"):
        raise RequestError(400, "invalid_request", "action must be retry or cancel")
    flt = job_filter(form)
    if flt == JobFilter():
        raise RequestError(400, "invalid_filter", "a bulk action needs a filter")
    # At most as many jobs as the confirmation counted: more may match by now.
    limit = form.get("limit", "")
    if not limit.isdigit() or not 1 <= int(limit) <= BULK_LIMIT:
        raise RequestError(422, "invalid_request", f"limit must be 1 to {BULK_LIMIT}")
    done = await coordinator_of(request).bulk(action, flt=flt, limit=int(limit))
    verb = "retried" if action == "retry" else "cancelled"
    message = f"{done['touched']} job(s) {verb}"
    if done["skipped"]:
        message += (f"; {len(done['skipped'])} skipped (such as {done['skipped'][0]['id']}:"
                    f" {done['skipped'][0]['reason']})")
    return message


async def job_page(request: Request) -> Response:
    need(request, "admin")
    coordinator = coordinator_of(request)
    job_id = request.path_params["job_id"]
    row = await coordinator.get_job(job_id)
    if row is None:
        return render(request, "missing", status=404, what=f"job {job_id}" if job_id
                      else "job without an id")
    job = await job_detail(coordinator, row)
    for error in job["errors"]:  # the traceback as lines of its own, not a JSON string
        details = error.get("details")
        trace = details.pop("traceback", None) if isinstance(details, dict) else None
        error["traceback"] = trace if isinstance(trace, str) else None
        error["delivery"] = delivery_record(details)
    # A cancel and a job given back unstarted (released: taken back from a prefetch line
    # for an idle worker) end an attempt too, but neither is a failure, and the latter
    # uses none of the budget: each is counted apart.
    kinds = [e.get("type") for e in job["errors"]]
    cancels, unstarted = kinds.count("cancelled"), kinds.count("released")
    failed = len(kinds) - cancels - unstarted
    return render(request, "job", job=job, terminal=job["state"] in TERMINAL_STATES,
                  attempts=display.attempts(job["attempt"], job["attempts_used"],
                                            job["max_attempts"], unstarted),
                  failures=display.failures(
                      job["fails"], failed,
                      retried=job["attempt"] - unstarted != job["attempts_used"]),
                  ended=display.ended_heading(failed, cancels, unstarted),
                  retryable=job["state"] in ("discarded", "cancelled"))


# -- actions --------------------------------------------------------------------------
async def retry_job(request: Request, form: dict[str, str]) -> str:
    row = await coordinator_of(request).retry(request.path_params["job_id"])
    # Not the state read back: a free worker may already have taken it, which made the
    # message (and a test) depend on a race.
    return f"job {row['id']} will run again"


async def cancel_job(request: Request, form: dict[str, str]) -> str:
    row, done = await coordinator_of(request).cancel(request.path_params["job_id"])
    if done:
        return f"job {row['id']} is {row['state']}"
    return f"job {row['id']}: its worker was asked to cancel it"


def _queue(request: Request) -> str:
    try:
        return msgspec.convert(request.path_params["queue"], Name)
    except msgspec.ValidationError:
        raise RequestError(400, "invalid_queue", "not a queue name") from None


async def pause_queue(request: Request, form: dict[str, str]) -> str:
    name = _queue(request)
    await coordinator_of(request).pause_queue(name, True)
    return f"queue {name} is paused: it keeps its jobs and assigns none"


async def resume_queue(request: Request, form: dict[str, str]) -> str:
    name = _queue(request)
    await coordinator_of(request).pause_queue(name, False)
    return f"queue {name} is resumed"


def _directive(form: dict[str, str]) -> str:
    state = form.get("state", "")
    if state not in DIRECTIVES:
        raise RequestError(422, "invalid_request", f"state must be one of {DIRECTIVES}")
    return state


# The same operation as the API's POST /workers/...: refusals (no such worker, no way
# back from terminate) are the shell's, shown as "refused: ..." by ``action``.
async def direct_worker(request: Request, form: dict[str, str]) -> str:
    state, worker_id = _directive(form), request.path_params["worker_id"]
    done = await coordinator_of(request).direct_workers(state, worker_id=worker_id)
    where = " (through the server it is connected to)" if done.forwarded else ""
    return f"worker {worker_id} was told to {VERBS[state]}{where}"


async def direct_label(request: Request, form: dict[str, str]) -> str:
    state, label = _directive(form), form.get("label", "")
    if not label:
        return "refused: choose a label"
    done = await coordinator_of(request).direct_workers(state, label=label)
    form["back"] = f"/ui/workers?{urlencode({'label': label})}"  # the form keeps its label
    others = ", and those of the other servers on the database" if done.forwarded else ""
    return (f"{len(done.workers)} worker(s) labelled {label!r} were told to"
            f" {VERBS[state]}{others}")


routes: list[BaseRoute] = [
    Route("/ui", overview, methods=["GET"]),
    Route("/ui/queues", queues_page, methods=["GET"]),
    Route("/ui/specs", specs_page, methods=["GET"]),
    Route("/ui/limits", limits_page, methods=["GET"]),
    Route("/ui/schedules", schedules_page, methods=["GET"]),
    Route("/ui/workers", workers_page, methods=["GET"]),
    Route("/ui/workers/state", action(direct_label), methods=["POST"]),
    Route("/ui/workers/{worker_id}/state", action(direct_worker), methods=["POST"]),
    Route("/ui/jobs", jobs_page, methods=["GET"]),
    Route("/ui/bulk", bulk_page, methods=["GET"]),
    Route("/ui/bulk", action(bulk_run), methods=["POST"]),
    Route("/ui/queues/{queue}/pause", action(pause_queue), methods=["POST"]),
    Route("/ui/queues/{queue}/resume", action(resume_queue), methods=["POST"]),
    # A job id stored by an earlier version may hold a slash ("order/17"): its links
    # encode it (%2F), the server decodes it, and the path converter takes the id whole.
    Route("/ui/jobs/{job_id:path}/retry", action(retry_job), methods=["POST"]),
    Route("/ui/jobs/{job_id:path}/cancel", action(cancel_job), methods=["POST"]),
    Route("/ui/jobs/{job_id:path}", job_page, methods=["GET"]),
    *flowpages.routes,  # /ui/workflows, a workflow, its cancel and retry
    Route("/ui/login", login_form, methods=["GET"]),
    Route("/ui/login", login, methods=["POST"]),
    Route("/ui/logout", logout, methods=["POST"]),
    Mount("/ui/static", StaticFiles(directory=HERE / "static"), name="static"),
]
