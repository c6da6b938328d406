"""The dashboard in a real browser: Debian's chromium driven by Playwright, against a real
server with real SDK workers. One browser and one browser context for the module (all the
browser tests); a fresh server, and a fresh page with no cookies and nothing stored for its
server, per test. Every wait is Playwright's ``expect``, which polls the page until the
condition holds or its deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import corpus
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Route, expect
from uirig import Rig, chromium

from rota.core.limits import LimitRule, Rate
from rota.worker.worker import JobContext

pytestmark = pytest.mark.xdist_group("browser")  # one xdist worker runs them: one browser
WAIT = 10_000  # ms: the longest any page condition may take
expect.set_options(timeout=WAIT)  # every expect(): a loaded machine answers slowly
REFRESH_MS = 250  # the pages refresh every 2 s; here faster, so the tests wait less


# One browser for the module, which one xdist worker runs whole. Not for the session:
# while Playwright's sync API is started it holds an event loop as the thread's running
# loop, and the asyncio tests that worker runs next could not start theirs.
@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


# One context for the module's pages: a context of its own per test costs a renderer and
# a cold first page load, about 0.4 s of chromium's CPU a test (measured). fresh_page
# gives each test what a new context would: no cookies, nothing stored for its origin.
@pytest.fixture(scope="module")
def shared(browser: Browser) -> Iterator[BrowserContext]:
    context = browser.new_context()
    context.add_init_script(f"window.ROTA_REFRESH_MS = {REFRESH_MS}")
    yield context
    context.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    rig = Rig(tmp_path)
    yield rig
    rig.close()


def fresh_page(context: BrowserContext, rig: Rig) -> Page:
    """A new page of ``context`` (the shared one) with no cookie, and nothing stored for
    ``rig``'s origin: its server may have the port, so the origin, of an earlier test's,
    whose page may have stored the paused refresh. Its URLs are absolute
    (``rig.base + path``): the shared context has no base URL."""
    context.clear_cookies()
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Storage.clearDataForOrigin", {"origin": rig.base, "storageTypes": "all"})
    cdp.detach()
    page.on("dialog", lambda dialog: dialog.accept())  # data-confirm: the operator agrees
    return page


def open_page(browser: Browser, rig: Rig) -> Page:
    """A page in a context of its own: a second browser, with cookies of its own."""
    context = browser.new_context(base_url=rig.base)
    context.add_init_script(f"window.ROTA_REFRESH_MS = {REFRESH_MS}")
    return context.new_page()


@pytest.fixture
def page(shared: BrowserContext, rig: Rig) -> Iterator[Page]:
    page = fresh_page(shared, rig)
    yield page
    page.close()


def log_in(page: Page, rig: Rig, path: str = "/ui") -> None:
    """Log in through the form, on the way to ``path``."""
    page.goto(rig.base + path)
    expect(page).to_have_url(re.compile(r"/ui/login\?next="))
    assert rig.token is not None
    page.fill("#token", rig.token)
    page.get_by_role("button", name="Log in").click()
    expect(page).to_have_url(re.compile(re.escape(path) + "$"))


def enter(page: Page, rig: Rig, path: str = "/ui") -> None:
    """Open ``path`` logged in, with the cookie the login form sets (as
    test_log_in_with_an_admin_token_and_out_again proves it does): for the tests the
    form is not about, two page loads fewer."""
    assert rig.token is not None
    page.context.add_cookies([{"name": "rota_session", "value": rig.token, "url": rig.base,
                               "httpOnly": True, "sameSite": "Strict"}])
    page.goto(rig.base + path)
    expect(page).to_have_url(re.compile(re.escape(path) + "$"))


def test_log_in_with_an_admin_token_and_out_again(page: Page, rig: Rig):
    page.goto(rig.base + "/ui/workers")
    expect(page).to_have_url(re.compile(r"/ui/login\?next=%2Fui%2Fworkers$"))
    page.fill("#token", "rota_000000000000_" + "x" * 43)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("alert")).to_have_text("not a valid token")
    producer, _ = rig.run(rig.coordinator.create_token("producer", "app", None))
    page.fill("#token", producer)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("alert")).to_contain_text("the dashboard needs an admin token")

    log_in(page, rig, "/ui/workers")  # back where it was going
    expect(page.locator("h1")).to_have_text("Workers")
    [cookie] = page.context.cookies()
    assert (cookie["name"], cookie["httpOnly"], cookie["sameSite"]) == (
        "rota_session", True, "Strict")
    assert cookie["value"] == rig.token and not cookie["secure"]  # plain http here
    assert page.evaluate("document.cookie") == ""  # no script can read it

    page.get_by_role("button", name="Log out").click()
    expect(page).to_have_url(re.compile(r"/ui/login$"))
    assert page.context.cookies() == []
    page.goto(rig.base + "/ui")
    expect(page).to_have_url(re.compile(r"/ui/login\?next="))


def gated(started: threading.Event, release: threading.Event):
    async def handler(ctx: JobContext) -> dict[str, Any]:
        started.set()
        await asyncio.to_thread(release.wait, 30)
        return {"echo": ctx.args["n"]}

    return handler


def test_watch_a_job_appear_and_finish(page: Page, rig: Rig):
    rig.spec("slow")
    enter(page, rig)
    available = page.locator('.figure[data-state="available"]')
    expect(available).to_have_text("0")
    job_id = rig.enqueue("slow", {"n": 7})
    expect(available).to_have_text("1", timeout=WAIT)  # the overview refreshed by itself

    page.goto(rig.base + "/ui/jobs")
    expect(page.locator("tr[data-job]")).to_have_count(1)
    second = rig.enqueue("slow", {"n": 8})
    expect(page.locator(f'tr[data-job="{second}"]')).to_be_visible(timeout=WAIT)  # appears
    page.locator(f'tr[data-job="{job_id}"] a').click()
    expect(page).to_have_url(re.compile(f"/ui/jobs/{job_id}$"))
    state = page.locator("#job-state")
    expect(state).to_have_text("available")
    expect(page.get_by_text("no connected worker serves queue 'default'")).to_be_visible()
    started, release = threading.Event(), threading.Event()
    rig.worker({"slow": gated(started, release)})
    expect(state).to_have_text("active", timeout=WAIT)
    release.set()
    expect(state).to_have_text("completed", timeout=WAIT)
    expect(page.locator("#result")).to_contain_text('"echo": 7')
    page.goto(rig.base + "/ui")  # the chart's hour: both enqueued, both completed
    expect(page.locator(".legend .key.enqueued strong")).to_have_text("2")
    expect(page.locator(".legend .key.completed strong")).to_have_text("2", timeout=WAIT)
    expect(page.locator("svg.chart polyline.completed")).to_have_count(1)


def test_the_limits_page_shows_each_limit_and_its_use(page: Page, rig: Rig):
    rig.spec("send_email")
    enter(page, rig)
    page.get_by_role("link", name="Limits").click()
    expect(page).to_have_url(re.compile(r"/ui/limits$"))
    expect(page.locator("#live")).to_contain_text(
        "No limits are set: every job runs as soon as a worker is free. Set one with"
        " rota limits set spec:NAME --concurrency N")
    rig.limits({("spec", "send_email"): LimitRule(concurrency=1, rate=Rate(100, 60.0))})
    started, release = threading.Event(), threading.Event()
    rig.worker({"send_email": gated(started, release)}, concurrency=4)
    waiting = [rig.enqueue("send_email", {"n": n}) for n in range(3)]
    try:
        rig.wait(started.is_set, "the first job starts")
        panel = page.locator('section.limit[id="l-spec:send_email"]')
        expect(panel.locator("h2")).to_have_text("spec:send_email")  # refreshed by itself
        expect(panel).to_contain_text("at most 1 running; 100/min starts (runtime, set ")
        expect(panel).to_contain_text(" by ui-test)")  # the token that set it
        expect(panel.locator("tbody tr td")).to_have_text(["all", "1 / 1", "1 started of 100/min"])
        page.goto(rig.base + f"/ui/jobs/{waiting[2]}")  # and a waiting job says why
        expect(page.get_by_text("concurrency limit 1 for spec send_email: 1 running")
               ).to_be_visible()
    finally:
        release.set()


def test_the_schedules_page_lists_each_schedule_and_its_jobs_link_back(page: Page, rig: Rig):
    rig.spec("tick")
    enter(page, rig)
    page.get_by_role("link", name="Schedules").click()
    expect(page).to_have_url(re.compile(r"/ui/schedules$"))
    expect(page.locator("#live")).to_contain_text("No cron schedule yet")
    rig.api("PUT", "/schedules/nightly", json={"spec": "tick", "cron": "30 2 * * *",
                                               "timezone": "Europe/Berlin"})
    rig.api("PUT", "/schedules/beat", json={"spec": "tick", "cron": "@every 1s"})
    rig.worker({"tick": lambda ctx: {"n": 1}})
    nightly = page.locator('tr[data-schedule="nightly"]')
    expect(nightly.locator("td")).to_have_count(6)  # refreshed by itself
    expect(nightly.locator("td.state")).to_have_text("active")
    expect(nightly.locator("td.last")).to_have_text("never")
    expect(nightly.locator("td.next span")).to_have_count(3)
    expect(nightly).to_contain_text("Europe/Berlin")
    beat = page.locator('tr[data-schedule="beat"]')
    expect(beat.locator("td.last a").first).to_have_text("completed", timeout=WAIT)
    rig.api("POST", "/schedules/beat/pause")
    expect(beat.locator("td.state")).to_have_text("paused")
    expect(beat.locator("td.last a").last).to_have_attribute("href", "/ui/jobs?schedule=beat")
    beat.locator("td.last a").first.click()
    expect(page).to_have_url(re.compile(r"/ui/jobs/cron-beat-\d{8}T\d{6}Z$"))
    page.locator("#job-schedule").click()
    expect(page).to_have_url(re.compile(r"/ui/schedules#c-beat$"))


def test_retry_a_discarded_job_from_its_page(page: Page, rig: Rig):
    rig.spec("flaky", extra="[retry]\nmax_attempts = 1\n")
    calls = []

    def flaky(ctx: JobContext) -> str:
        calls.append(ctx.id)
        if len(calls) == 1:
            raise ValueError("the first call always fails")
        return "fine"

    rig.worker({"flaky": flaky})
    job_id = rig.enqueue("flaky")
    rig.wait(lambda: len(calls) == 1, "the first attempt")
    enter(page, rig, f"/ui/jobs/{job_id}")
    state = page.locator("#job-state")
    expect(state).to_have_text("discarded", timeout=WAIT)
    # The attempt, its error and a traceback people can read (lines, not a JSON string).
    expect(page.locator(".attempt .message")).to_have_text("the first call always fails")
    traceback = page.locator("pre.traceback")
    expect(traceback).to_contain_text("Traceback (most recent call last)")
    expect(traceback).to_contain_text('raise ValueError("the first call always fails")')

    page.get_by_role("button", name="Retry").click()
    expect(page.get_by_role("status")).to_contain_text(f"job {job_id} will run again")
    expect(state).to_have_text("completed", timeout=WAIT)
    # Its fresh budget's attempt, and all of them (not "2 of 1": issue 22).
    expect(page.locator("dl.facts").first).to_contain_text("1 of 1 (2 in all)", timeout=WAIT)
    assert rig.job(job_id)["result"] == "fine"


def test_quiet_a_worker_and_it_gets_no_more_jobs(page: Page, rig: Rig):
    rig.spec("echo")
    done: list[str] = []

    async def echo(ctx: JobContext) -> str:
        done.append(ctx.worker_id)
        return "ok"

    first = rig.worker({"echo": echo}, labels=["blue"])
    enter(page, rig, "/ui/workers")
    row = page.locator(f'tr[data-worker="{first.worker_id}"]')
    expect(row.locator("[data-state]")).to_have_text("running")
    row.get_by_role("button", name="Quiet").click()
    expect(page.get_by_role("status")).to_contain_text("was told to go quiet")
    expect(row.locator("[data-state]")).to_have_text("quiet", timeout=WAIT)  # it obeyed
    expect(row.get_by_role("button", name="Quiet")).to_have_count(0)
    expect(row.get_by_role("button", name="Resume")).to_be_visible()

    job_id = rig.enqueue("echo")
    page.goto(rig.base + f"/ui/jobs/{job_id}")
    expect(page.get_by_text("the 1 capable worker is quiet or terminating")).to_be_visible()
    second = rig.worker({"echo": echo})
    expect(page.locator("#job-state")).to_have_text("completed", timeout=WAIT)
    assert rig.job(job_id)["worker_id"] == second.worker_id  # the quiet one took nothing
    assert done == [second.worker_id]

    page.goto(rig.base + "/ui/workers")  # and back to work
    row.get_by_role("button", name="Resume").click()
    expect(page.get_by_role("status")).to_contain_text("was told to resume")
    expect(row.locator("[data-state]")).to_have_text("running", timeout=WAIT)


def test_by_label_says_what_to_whom_and_keeps_its_label(page: Page, rig: Rig):
    rig.spec("echo")

    async def echo(ctx: JobContext) -> str:
        return "ok"

    rig.worker({"echo": echo}, labels=["blue", "eu"])
    rig.worker({"echo": echo}, labels=["eu"])
    enter(page, rig, "/ui/workers")
    expect(page.locator("tr[data-worker]")).to_have_count(2)
    form = page.locator('form[action="/ui/workers/state"]')
    label = form.locator('select[name="label"]')
    label.select_option("eu")  # not the first label: "blue"
    form.locator('select[name="state"]').select_option("quiet")
    asked: list[str] = []
    page.on("dialog", lambda dialog: asked.append(dialog.message))  # (fresh_page accepts)
    form.get_by_role("button", name="Send").click()
    expect(page.get_by_role("status")).to_contain_text(
        "2 worker(s) labelled 'eu' were told to go quiet")
    assert asked == ["Tell the 2 workers labelled \u201ceu\u201d to go quiet?"]
    expect(label).to_have_value("eu")  # after the form's answer
    label.select_option("blue")
    page.reload()
    expect(label).to_have_value("blue")  # and after a reload


def test_pause_a_queue_and_resume_it(page: Page, rig: Rig):
    rig.spec("echo")

    async def echo(ctx: JobContext) -> str:
        return "ok"

    rig.worker({"echo": echo})
    enter(page, rig, "/ui/queues")
    row = page.locator("#q-default")
    row.get_by_role("button", name="Pause").click()
    expect(page.get_by_role("status")).to_contain_text("queue default is paused")
    expect(row.locator(".pill")).to_have_text("paused")
    job_id = rig.enqueue("echo")
    page.goto(rig.base + f"/ui/jobs/{job_id}")
    expect(page.get_by_text("Waiting: queue paused")).to_be_visible(timeout=WAIT)
    page.goto(rig.base + "/ui/queues")
    row.get_by_role("button", name="Resume").click()
    expect(page.get_by_role("status")).to_contain_text("queue default is resumed")
    rig.wait(lambda: rig.job(job_id)["state"] == "completed", "the job to run")


def test_filter_the_jobs_and_retry_what_matches_after_a_count(page: Page, rig: Rig):
    rig.spec("flaky", extra="[retry]\nmax_attempts = 1\n")

    def flaky(ctx: JobContext) -> str:
        if ctx.attempt == 1:
            raise ValueError(f"first attempt of {ctx.args['n']}")
        return "fine"

    rig.worker({"flaky": flaky})
    ids = [rig.enqueue("flaky", {"n": n}) for n in range(3)]
    rig.wait(lambda: all(rig.job(i)["state"] == "discarded" for i in ids), "3 discarded")
    enter(page, rig, "/ui/jobs")
    page.get_by_label("discarded").check()
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"/ui/jobs\?state=discarded"))
    expect(page.locator(".summary")).to_contain_text("3 job(s) match")
    expect(page.locator("tr[data-job] .error-text").first).to_contain_text(
        "ValueError: first attempt of 2")  # newest first

    page.get_by_role("link", name="Retry all…").click()
    expect(page.locator("#bulk-count")).to_have_text("This will retry 3 job(s).")
    page.get_by_role("button", name="Retry 3 job(s)").click()
    expect(page.get_by_role("status")).to_contain_text("3 job(s) retried")
    expect(page.locator(".summary")).to_contain_text("0 job(s) match", timeout=WAIT)
    rig.wait(lambda: all(rig.job(i)["state"] == "completed" for i in ids), "3 completed")


def test_an_action_from_another_site_or_without_the_cookie_is_refused(
        browser: Browser, page: Page, rig: Rig):
    rig.spec("boom", extra="[retry]\nmax_attempts = 1\n")

    def boom(ctx: JobContext) -> None:
        raise RuntimeError("no")

    rig.worker({"boom": boom})
    job_id = rig.enqueue("boom")
    rig.wait(lambda: rig.job(job_id)["state"] == "discarded", "the job discarded")
    enter(page, rig)

    # A page on another site posts the retry form: the browser (logged in here) is
    # refused, and the job is still discarded.
    evil = f"""<form id="f" method="post" action="{rig.base}/ui/jobs/{job_id}/retry">
               <input name="back" value="/ui"></form>
               <script>document.getElementById("f").submit()</script>"""
    page.route("http://evil.example/**", lambda route: route.fulfill(
        status=200, content_type="text/html",
        body=evil if route.request.url.endswith("/form") else "<p>nothing here</p>"))
    with page.expect_response(f"{rig.base}/ui/jobs/{job_id}/retry") as answer:
        page.goto("http://evil.example/form")
    assert answer.value.status == 403
    assert answer.value.json()["error"]["code"] == "origin_not_allowed"
    # From a script on that site, the JSON API's retry too.
    page.goto("http://evil.example/blank")
    status = page.evaluate("""url => fetch(url, {method: "POST", credentials: "include"})
                              .then(r => r.status, () => "blocked")""",
                           f"{rig.base}/jobs/{job_id}/retry")
    assert status in (403, "blocked")  # refused, or its answer withheld: never done

    # A browser without the cookie, on this very origin: not logged in, refused.
    stranger = open_page(browser, rig)
    stranger.goto("/ui/login")
    answer = stranger.evaluate("""url => fetch(url, {method: "POST"})
                                  .then(r => r.json().then(b => [r.status, b.error.code]))""",
                               f"/ui/jobs/{job_id}/retry")
    assert answer == [401, "unauthorized"]
    stranger.context.close()
    assert rig.job(job_id)["state"] == "discarded"


def test_read_only_hides_and_refuses_every_action(shared: BrowserContext, tmp_path: Path):
    rig = Rig(tmp_path, ui_read_only=True)
    try:
        rig.spec("boom", extra="[retry]\nmax_attempts = 1\n")

        def boom(ctx: JobContext) -> None:
            raise RuntimeError("no")

        rig.worker({"boom": boom}, labels=["blue"])
        job_id = rig.enqueue("boom")
        rig.wait(lambda: rig.job(job_id)["state"] == "discarded", "the job discarded")
        page = fresh_page(shared, rig)
        log_in(page, rig, f"/ui/jobs/{job_id}")  # logging in is not an action
        expect(page.locator(".badge")).to_have_text("read-only")
        expect(page.locator("#job-state")).to_have_text("discarded")
        assert page.get_by_role("button", name="Retry").count() == 0
        page.goto(rig.base + "/ui/workers")
        expect(page.locator("tr[data-worker]")).to_have_count(1)
        assert page.locator("table.workers button, form[action='/ui/workers/state']").count() == 0

        for url in (f"/ui/jobs/{job_id}/retry", f"/jobs/{job_id}/retry"):  # form, JSON API
            answer = page.evaluate("""url => fetch(url, {method: "POST"})
                                      .then(r => r.json().then(b => [r.status, b.error.code]))""",
                                   url)
            assert answer == [403, "read_only"], url
        assert rig.job(job_id)["state"] == "discarded"
        page.close()
    finally:
        rig.close()


def test_the_pause_button_stops_the_refresh_until_it_is_pressed_again(page: Page, rig: Rig):
    rig.spec("echo")
    enter(page, rig)
    available = page.locator('.figure[data-state="available"]')
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url) if r.headers.get("x-rota-live") else None)
    expect(page.locator("#poll-state")).to_contain_text("live ·")  # it has refreshed
    page.get_by_role("button", name="Pause updates").click()
    expect(page.locator("#poll-state")).to_have_text("paused")
    rig.enqueue("echo")
    seen = len(polls)
    page.wait_for_timeout(4 * REFRESH_MS)  # noqa: sleep-ok (proving nothing happens)
    assert len(polls) == seen and available.inner_text() == "0"
    page.reload()  # the pause holds across pages
    expect(page.locator("#poll")).to_have_text("Resume updates")
    expect(available).to_have_text("1")  # a page load shows the moment
    rig.enqueue("echo")
    page.get_by_role("button", name="Resume updates").click()
    expect(available).to_have_text("2")


@pytest.mark.parametrize("answer", ["the page", "no answer"])
def test_a_refresh_already_asked_for_when_pause_is_pressed_changes_nothing(page: Page,
                                                                            rig: Rig,
                                                                            answer: str):
    """The answer to a refresh sent before the pause arrives after it (held here until
    then): the page stays as it was when the button was pressed, and an answer that
    fails raises no banner."""
    rig.spec("echo")
    enter(page, rig)
    available = page.locator('.figure[data-state="available"]')
    held: list[Route] = []
    page.route(rig.base + "/ui", lambda route: held.append(route)
               if route.request.headers.get("x-rota-live") else route.continue_())
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(20)  # noqa: sleep-ok (a poll step: Playwright calls the route)
    assert held, "no refresh was asked for"
    page.get_by_role("button", name="Pause updates").click()
    expect(page.locator("#poll-state")).to_have_text("paused")
    rig.enqueue("echo")
    if answer == "the page":
        with page.expect_response(lambda r: bool(r.request.headers.get("x-rota-live"))):
            held[0].continue_()  # the server answers now, with the job waiting
    else:
        with page.expect_event("requestfailed"):
            held[0].abort()  # as if the server had gone
    page.wait_for_timeout(4 * REFRESH_MS)  # noqa: sleep-ok (proving nothing happens)
    assert available.inner_text() == "0" and len(held) == 1
    expect(page.locator("#stale")).to_be_hidden()


@pytest.mark.soak  # every hostile id through every page: long
def test_a_job_id_never_leads_a_link_or_a_form_to_another_job(shared: BrowserContext,
                                                              tmp_path: Path):
    """Every id the API accepts, and an id holding "/" and ".." stored by an earlier
    version (which accepted it): each one's link opens its own page, and its Cancel
    cancels it, not the job "victim" that a resolved "a/../victim" would name."""
    awkward = [job_id for _, job_id, why in corpus.JOB_IDS if why is None]
    rig = Rig(tmp_path)
    try:
        if rig.live.settings.database_url:
            pytest.skip("an earlier version's row is written with sqlite3")
        rig.spec("parked", queue="nobody")
        for job_id in ["victim", "legacy", *awkward]:
            rig.enqueue("parked", id=job_id)
    finally:
        rig.close()
    token = rig.token
    legacy = "a/../victim"
    with contextlib.closing(sqlite3.connect(tmp_path / "rota.db")) as db, db:
        db.execute("UPDATE jobs SET id = ? WHERE id = 'legacy'", (legacy,))
    rig = Rig(tmp_path, open=True)  # open: no new token; the first one is still live
    rig.token = token
    page = fresh_page(shared, rig)
    asked: list[str] = []
    page.on("dialog", lambda dialog: asked.append(dialog.message))
    try:
        enter(page, rig, "/ui/jobs?state=available")
        # Where each row's link leads, as the browser resolves it: a click goes there. One
        # list load for all the links, not one a job.
        links = {job_id: page.locator(f'tr[data-job="{job_id}"] a').evaluate("a => a.href")
                 for job_id in [legacy, *awkward]}
        for job_id, link in links.items():
            page.goto(link)
            expect(page.locator("h1 code")).to_have_text(job_id)
            page.get_by_role("button", name="Cancel").click()
            expect(page.get_by_role("status")).to_have_text(f"job {job_id} is cancelled")
            assert asked[-1] == f"Cancel job {job_id}?"
            expect(page.locator("#job-state")).to_have_text("cancelled")  # back on its page
            row = rig.run(rig.coordinator.store.get_job(job_id))
            assert row["state"] == "cancelled", job_id
        assert rig.job("victim")["state"] == "available"
        page.goto(rig.base + "/ui/jobs?state=available")
        expect(page.locator("tr[data-job]")).to_have_count(1)
    finally:
        page.close()
        rig.close()
