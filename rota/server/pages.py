"""The dashboard's plumbing: the Jinja2 templates (rota/server/ui/templates) and how a page is
answered, whole or only its live region; forms, post/redirect/get and one-time
messages; the finished jobs' background count; the login form and its cookie. The pages
themselves are in rota/server/dashboard.py.

Each page puts what changes in one region (``<main id="live">``); rota/server/ui/static/rota.js
fetches the page again every 2 s with ``X-Rota-Live: 1`` and swaps that region, which
is then rendered alone. Actions are plain form POSTs answered by a redirect back with a
one-time message in a cookie; the gate (rota/server/gate.py) lets them in only from this
origin, and not at all with ``--ui-read-only``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

if TYPE_CHECKING:
    import jinja2

from rota.core import display
from rota.server.api import queue_views
from rota.server.api_base import coordinator_of, need, read_body
from rota.server.coordinator import Coordinator
from rota.base.errors import DomainError, RequestError, StorageError
from rota.server.gate import COOKIE
from rota.base.ids import path_segment

HERE = Path(__file__).resolve().parent / "ui"
LIVE = "x-rota-live"  # the poller's header: render the live region only
FLASH = "rota_flash"  # a one-time message after an action, shown by the next page
# Every page: never cached (it holds live figures and the operator's session), never
# framed by another site (a one-click Terminate under a decoy), no script but ours.
HEADERS = {
    "cache-control": "no-store",
    "content-security-policy": "default-src 'self'; img-src 'self' data:; style-src 'self'"
                               " 'unsafe-inline'; frame-ancestors 'none'; form-action 'self';"
                               " base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}
STATES = ("scheduled", "available", "active", "retryable", "completed", "discarded",
          "cancelled", "pending")

# ``segment``: an id or a name as one segment of a link or a form's action (a job id
# with a "/" stored by an earlier version must not reach another route, or another job).
# Other page modules add theirs here (flowpages.py) before the first page is made.
FILTERS: dict[str, Callable[..., Any]] = {
    "size": display.size, "duration": display.duration, "pretty": display.pretty,
    "short": display.short, "count": display.count, "segment": path_segment}


@functools.cache
def env() -> jinja2.Environment:
    """The templates' environment, made at the first page: importing jinja2 costs a
    server's start 14 ms, and a server that only serves workers and the API needs none."""
    import jinja2

    made = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a misspelt name fails the test, not the page
        auto_reload=False,
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=display.visible,  # no direction control in worker or job text is obeyed
    )
    made.filters.update(FILTERS)
    made.globals.update(held_parts=display.held_parts)  # the queues page's held jobs, in words
    return made


def render(request: Request, name: str, status: int = 200, **context: Any) -> Response:
    """A page, or only its live region when the poller asks."""
    coordinator = coordinator_of(request)
    now = coordinator.clock().wall
    context |= {
        "page": name, "path": request.url.path, "here": here(request),
        "read_only": coordinator.settings.ui_read_only,
        "auth": coordinator.tokens.required, "now": now,
        "ago": lambda moment: display.ago(moment, now),  # a moment that may be ahead
        "since": lambda moment: display.since(moment, now),  # one that was
        "flash": unquote(request.cookies.get(FLASH, "")),
    }
    template = env().get_template(f"{name}.html")
    if request.headers.get(LIVE):
        body = "".join(template.blocks["live"](template.new_context(context)))
    else:
        body = template.render(context)
    response = HTMLResponse(body, status_code=status, headers=HEADERS)
    if context["flash"] and not request.headers.get(LIVE):
        response.delete_cookie(FLASH, path="/ui")
    return response


def here(request: Request) -> str:
    """This page's path and query as the browser asked for them: still percent-encoded, so
    that a form's way back names the same page (decoded, "a%2F..%2Fb" would be "b")."""
    raw = request.scope.get("raw_path")
    path = raw.decode("latin-1") if raw else request.url.path
    return path + (f"?{request.url.query}" if request.url.query else "")


def back(request: Request, form: dict[str, str], message: str) -> Response:
    """Back to the page the form was on (only ever a dashboard page), with a message."""
    target = form.get("back", "/ui")
    if not target.startswith("/ui") or target.startswith("//"):
        target = "/ui"
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(FLASH, quote(message), path="/ui", httponly=True, samesite="strict")
    return response


async def read_form(request: Request) -> dict[str, str]:
    """An urlencoded form, within the body limit; a field given twice keeps its last."""
    body = await read_body(request)
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, max_num_fields=100)
    except (UnicodeDecodeError, ValueError):
        raise RequestError(400, "invalid_form", "the form is not URL-encoded text") from None
    return {key: values[-1].strip() for key, values in fields.items()}


def action(run: Callable[[Request, dict[str, str]], Awaitable[str]]
           ) -> Callable[[Request], Awaitable[Response]]:
    """A form POST: admin only; the core's refusal (a job already finished, say) becomes
    the message shown, not an error page."""
    async def handler(request: Request) -> Response:
        need(request, "admin")
        form = await read_form(request)
        try:
            message = await run(request, form)
        except DomainError as exc:
            message = f"refused: {exc.message}"
        return back(request, form, message)

    return handler


# -- counts ---------------------------------------------------------------------------
FINISHED = ("completed", "discarded", "cancelled")
RECOUNT_AFTER = 20.0  # x the last count's duration: how stale the finished counts may be
RECOUNT_MAX = 60.0  # seconds, at most
FRESH_WAIT = 0.05  # seconds a page waits for a count it started (a small store's is done)


class FinishedCounts:
    """Finished jobs per queue and state, counted in the background. Counting them is a
    scan of every finished row (0.3-0.5 s with a million on 2 cores), so a page never
    waits for more than FRESH_WAIT: it shows the last count, which is redone once it is
    RECOUNT_AFTER times as old as the count took (a small store's: at every refresh; a
    million jobs': every 8 s or so, a few per cent of one core while someone looks). The
    jobs still in play are counted exactly, in memory, on every render
    (``Scheduler.live_counts``)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] | None = None  # None: never counted yet
        self.began = 0.0  # monotonic, when the count shown began
        self.wall = 0.0  # ... as wall-clock time, for the page's note
        self.took = 0.0  # seconds the last count took
        self.task: asyncio.Task[None] | None = None

    async def get(self, coordinator: Coordinator) -> dict[str, dict[str, int]] | None:
        now = coordinator.clock()
        due = min(RECOUNT_MAX, RECOUNT_AFTER * self.took)
        if (self.counts is None or now.mono - self.began > due) and (
                self.task is None or self.task.done()):
            self.task = coordinator.spawn(self._count(coordinator, now.mono, now.wall),
                                          "rota-ui-counts")
            await asyncio.wait({self.task}, timeout=FRESH_WAIT)
        return self.counts

    async def _count(self, coordinator: Coordinator, began: float, wall: float) -> None:
        try:
            counts = await coordinator.queue_counts(FINISHED)
        except StorageError:
            return  # the store's health logs it once; the last counts stay shown
        self.counts, self.began, self.wall = counts, began, wall
        self.took = coordinator.clock().mono - began


def finished_counts(request: Request) -> FinishedCounts:
    state = request.app.state
    if not hasattr(state, "ui_counts"):
        state.ui_counts = FinishedCounts()
    counts: FinishedCounts = state.ui_counts
    return counts


async def counted_queues(request: Request
                         ) -> tuple[list[dict[str, Any]], str | None, dict[str, Any] | None]:
    """The queues as GET /queues shows them, with the jobs in play counted exactly and
    finished ones from the background count, up to --max-series of them (the others
    summed: ``queue_views``); and a note saying how old that is, if it is not from this
    moment."""
    coordinator = coordinator_of(request)
    cache = finished_counts(request)
    finished = await cache.get(coordinator)
    counts: dict[str, dict[str, int]] = {}
    for source in (coordinator.live_counts(), finished or {}):
        for queue, per in source.items():
            merged = counts.setdefault(queue, dict.fromkeys(STATES, 0))
            for state, n in per.items():
                merged[state] += n
    note = None
    if finished is None:
        note = "Still counting the completed, discarded and cancelled jobs…"
    elif (age := coordinator.clock().wall - cache.wall) >= 1:
        note = (f"Completed, discarded and cancelled jobs as counted {display.duration(age)}"
                " ago (a large store is counted in the background); the others now.")
    views, others = await queue_views(coordinator, counts, coordinator.settings.max_series)
    return views, note, others


# -- login ------------------------------------------------------------------------------
async def login_form(request: Request) -> Response:
    coordinator = coordinator_of(request)
    return render(request, "login", next=_next(request.query_params.get("next")),
                  error=None, auth=coordinator.tokens.required)


async def login(request: Request) -> Response:
    """Check the token once here, then keep it in an HttpOnly cookie: scripts on any page
    cannot read it, and SameSite=Strict keeps other sites' requests from carrying it."""
    coordinator = coordinator_of(request)
    form = await read_form(request)
    target = _next(form.get("next"))
    token = form.get("token", "")
    principal = coordinator.tokens.authenticate(f"Bearer {token}")
    if coordinator.tokens.required and (principal is None or principal.scope != "admin"):
        await coordinator.reread_tokens()  # one created a moment ago?
        principal = coordinator.tokens.authenticate(f"Bearer {token}")
    if coordinator.tokens.required and (principal is None or principal.scope != "admin"):
        why = "not a valid token" if principal is None else (
            f"a {principal.scope} token: the dashboard needs an admin token")
        return render(request, "login", status=401, next=target, error=why)
    response = RedirectResponse(target, status_code=303)
    if coordinator.tokens.required:
        response.set_cookie(COOKIE, token, path="/", httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
    return response


async def logout(request: Request) -> Response:
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


def _next(target: str | None) -> str:
    """Where to go after logging in: a dashboard page, never another site."""
    if not target or not target.startswith("/ui") or target.startswith("//"):
        return "/ui"
    return target
