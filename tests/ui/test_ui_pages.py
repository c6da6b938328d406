"""Every dashboard page rendered against a server with something on it: workers (one of
them on another version of a spec), finished, failed and waiting jobs, captured logs,
progress and alerts, a spec pushed twice. Checks what each page must show, over HTTP;
tests/ui/test_ui.py clicks through them in a browser."""

from __future__ import annotations

import asyncio
import contextlib
import html
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import Live, start_server, stop_server, write_spec
from helpers import silent_worker, stop_silent, wait_until

from rota.server import dashboard
from rota.worker.worker import JobContext, Worker

SAME = {"Sec-Fetch-Site": "same-origin"}


@contextlib.asynccontextmanager
async def busy_server(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    live = await start_server(tmp_path)
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "report", version="1", queue="reports"))
    await live.push(write_spec(specs, "report", version="2", queue="reports",
                               extra='description = "the monthly report"\n'))
    await live.push(write_spec(specs, "mail", queue="emails",
                               extra="[retry]\nmax_attempts = 1\n"))
    worker = Worker(url=live.ws, specs_dir=specs, queues=["emails", "reports"],
                    labels=["blue", "eu"], handle_signals=False)

    @worker.handler("report")
    async def report(ctx: JobContext) -> dict[str, Any]:
        ctx.progress(40, "rendering page 4 of 10")
        ctx.log("fetched 120 rows")
        ctx.alert("the source database is slow")
        await ctx.heartbeat()
        return {"pages": 10, "title": "<b>not markup</b>"}

    @worker.handler("mail")
    def mail(ctx: JobContext) -> None:
        raise ConnectionRefusedError("smtp.example.com refused")

    task = asyncio.create_task(worker.run())
    await wait_until(lambda: worker.connected.is_set(), what="worker")
    done = await live.enqueue("report", capture_logs=True)
    failed = await live.enqueue("mail")
    await live.wait_state(done["id"], "completed")
    await live.wait_state(failed["id"], "discarded")
    # One that waits: its queue has no worker.
    await live.push(write_spec(specs, "audit", queue="audits"))
    waiting = await live.enqueue("audit", {"who": "x"})
    # A worker that declares another version of "report".
    old = write_spec(tmp_path / "old", "report", version="1", queue="reports")
    stale = await silent_worker(live.ws, "w-stale", [old], concurrency=1)
    try:
        yield {"live": live, "worker": worker, "done": done["id"], "failed": failed["id"],
               "waiting": waiting["id"]}
    finally:
        await stop_silent(*stale)
        worker.stop()
        await asyncio.wait_for(task, 10)
        await stop_server(live)


# One busy server for the module (so one event loop for its tests), for the tests that
# only read it; a test that changes it (quiets its worker, cancels or adds jobs, pauses a
# queue) gets one of its own (own_busy), so that no test depends on which ran before it.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def busy(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    async with busy_server(tmp_path_factory.mktemp("busy")) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="module")
async def own_busy(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    async with busy_server(tmp_path) as server:
        yield server


async def page(live: Live, path: str) -> str:
    answer = await live.http.get(path)
    assert answer.status_code == 200, (path, answer.text[-2000:])
    assert answer.headers["content-type"].startswith("text/html")
    live_region = await live.http.get(path, headers={"X-Rota-Live": "1"})
    assert live_region.status_code == 200
    return answer.text


async def test_overview(busy):
    # The finished jobs are counted in the background: a small store's within the page.
    text = await wait_until(lambda: _counted(busy["live"]), what="the finished jobs counted")
    assert '<span class="figure" data-state="completed">1</span>' in text
    assert '<span class="figure" data-state="discarded">1</span>' in text
    assert '<span class="figure" data-state="available">1</span>' in text
    assert "no connected worker serves queue &#39;audits&#39;" in text  # blocked, and why


async def _counted(live: Live) -> str | None:
    text = await page(live, "/ui")
    return text if "Still counting" not in text else None


async def test_queues(busy):
    text = await page(busy["live"], "/ui/queues")
    for name in ("emails", "reports", "audits"):
        assert f'id="q-{name}"' in text
    assert "waiting: no connected worker serves queue" in text


async def test_specs(busy):
    text = await page(busy["live"], "/ui/specs")
    assert 'id="s-report"' in text and "version 2" in text and "the monthly report" in text
    assert "w-stale" in text  # declares another checksum
    assert busy["worker"].worker_id[:12] in text  # matches
    assert "History (2)" in text
    assert "1 blocked" in text  # the audit job


async def test_workers(busy):
    text = await page(busy["live"], "/ui/workers")
    worker = busy["worker"]
    assert f'data-worker="{worker.worker_id}"' in text and 'data-worker="w-stale"' in text
    assert '<span class="tag" title="blue">blue</span>' in text and "<option>eu</option>" in text
    assert "the source database is slow" in text  # its latest alert
    assert "1 spec(s) off the status quo" in text  # the stale one


async def test_a_finished_job_with_logs_progress_and_result(busy):
    text = await page(busy["live"], f"/ui/jobs/{busy['done']}")
    assert 'id="job-state">completed<' in text
    assert "fetched 120 rows" in text and "the source database is slow" in text
    assert "rendering page 4 of 10" in text
    assert "&lt;b&gt;not markup&lt;/b&gt;" in text  # escaped, never HTML
    assert "Retry</button>" not in text and "Cancel</button>" not in text


async def test_a_failed_job_with_its_traceback(busy):
    text = await page(busy["live"], f"/ui/jobs/{busy['failed']}")
    assert "ConnectionRefusedError" in text and "smtp.example.com refused" in text
    assert '<pre class="traceback">Traceback (most recent call last):' in text
    assert "Retry</button>" in text


async def test_a_waiting_job_says_why(busy):
    text = await page(busy["live"], f"/ui/jobs/{busy['waiting']}")
    assert "Waiting: no connected worker serves queue &#39;audits&#39;" in text
    assert "Cancel</button>" in text


async def test_finding_a_job_by_its_id(busy):
    answer = await busy["live"].http.get("/ui/jobs", params={"q": busy["done"]})
    assert answer.status_code == 303 and answer.headers["location"] == f"/ui/jobs/{busy['done']}"


async def test_quiet_then_terminate_by_label(own_busy):
    live, worker = own_busy["live"], own_busy["worker"]
    answer = await live.http.post("/ui/workers/state", headers=SAME,
                                  data={"label": "eu", "state": "quiet", "back": "/ui/workers"})
    assert answer.status_code == 303
    assert "1 worker(s) labelled &#39;eu&#39; were told to go quiet" in await page(live, "/ui/workers")
    await wait_until(lambda: live.coordinator.connections[worker.worker_id].worker.state
                     == "quiet", what="the worker quiet")


async def test_an_empty_server_renders_every_page(tmp_path):
    live = await start_server(tmp_path)
    try:
        assert "No worker is connected" in await page(live, "/ui/workers")
        assert "No spec was pushed yet" in await page(live, "/ui/specs")
        assert "No cron schedule yet" in await page(live, "/ui/schedules")
        assert "No webhook subscription yet" in await page(live, "/ui/webhooks")
        assert "No queue has jobs or workers yet" in await page(live, "/ui/queues")
        assert "Nothing waits for lack of a worker" in await page(live, "/ui")
    finally:
        await stop_server(live)


async def test_a_cancelled_attempt_is_listed_as_cancelled_not_failed(tmp_path):
    live = await start_server(tmp_path)
    await live.push(write_spec(tmp_path / "specs", "slow"))
    worker = Worker(url=live.ws, specs_dir=tmp_path / "specs", handle_signals=False)
    started = asyncio.Event()

    @worker.handler("slow")
    async def slow(ctx: JobContext) -> None:
        started.set()
        await asyncio.sleep(60)  # noqa: sleep-ok (work that the cancel stops)

    task = asyncio.create_task(worker.run())
    try:
        job = await live.enqueue("slow")
        await asyncio.wait_for(started.wait(), 10)
        assert (await live.http.delete(f"/jobs/{job['id']}")).status_code < 300
        await live.wait_state(job["id"], "cancelled")
        text = await wait_until(lambda: _attempt_listed(live, job["id"]), what="the attempt")
        assert "Attempts cancelled (1)" in text and "Attempts that failed" not in text
        assert '<span class="pill cancelled">cancelled</span>' in text
    finally:
        worker.stop_now()
        await asyncio.wait_for(task, 10)
        await stop_server(live)


async def _attempt_listed(live: Live, job_id: str) -> str | None:
    text = await page(live, f"/ui/jobs/{job_id}")
    return text if '<article class="attempt">' in text else None


async def test_the_jobs_list_filters_and_pages(busy):
    live = busy["live"]
    text = await page(live, "/ui/jobs?state=discarded")
    assert "<strong>1</strong> job(s) match" in text and busy["failed"] in text
    assert busy["done"] not in text
    assert 'href="/ui/bulk?action=retry&amp;state=discarded"' in text
    everything = await page(live, "/ui/jobs")
    assert all(busy[k] in everything for k in ("done", "failed", "waiting"))
    assert "Retry all" not in everything  # no bulk action without a filter
    first = await page(live, "/ui/jobs?queue=emails&state=discarded&state=completed")
    assert "<strong>1</strong> job(s) match" in first
    # Only what the filtered states allow: completed jobs can be neither retried nor
    # cancelled, discarded ones only retried.
    completed = await page(live, "/ui/jobs?state=completed")
    assert "Retry all" not in completed and "Cancel all" not in completed
    assert "Cancel all" not in text and "Retry all" in text  # (state=discarded, above)


async def test_the_jobs_list_pages_older_newer_and_first(busy, monkeypatch):
    monkeypatch.setattr(dashboard, "PAGE", 1)  # a page a job: the busy server's 3 are 3 pages
    live = busy["live"]

    async def visit(path: str) -> tuple[str, dict[str, str]]:
        text = await page(live, path)
        pager = text[text.index('<nav class="pager"'):]
        pager = pager[:pager.index("</nav>")]
        links = {rel: html.unescape(href) for href, rel
                 in re.findall(r'<a href="([^"]*)" rel="(\w+)"', pager)}
        return re.findall(r'<tr data-job="([^"]+)"', text)[0], links

    newest, links = await visit("/ui/jobs")
    assert newest == busy["waiting"] and set(links) == {"next"}  # no First, no Newer
    second, links2 = await visit(links["next"])
    assert second == busy["failed"] and set(links2) == {"first", "prev", "next"}
    third, links3 = await visit(links2["next"])
    assert third == busy["done"] and set(links3) == {"first", "prev"}  # the oldest
    assert (await visit(links3["prev"]))[0] == busy["failed"]  # Newer: the page before
    assert (await visit(links3["first"]))[0] == busy["waiting"]
    # A filter rides along: with it, only the two finished jobs, newest first.
    done_first, filtered = await visit("/ui/jobs?state=completed&state=discarded")
    older, back = await visit(filtered["next"])
    assert (done_first, older) == (busy["failed"], busy["done"])
    assert "state=completed&state=discarded" in back["prev"]


@pytest.mark.parametrize(("path", "status", "text"), [
    ("/ui/jobs?state=bogus", 400, "unknown state &#39;bogus&#39;"),
    ("/ui/jobs?spec=a%20b", 400, "spec is not a name"),
    ("/ui/jobs?cursor=garbage", 400, "cursor is not one this server gave"),
    # a misspelt name would match nothing, and look like an empty list (issue 22)
    ("/ui/jobs?state=discarded&spec=reprot", 422, "spec &#39;reprot&#39; is unknown"),
    ("/ui/jobs?queue=emial", 422, "did you mean emails?"),
    ("/ui/jobs/", 404, "There is no job without an id"),
])
async def test_a_bad_filter_says_why_on_the_page(busy, path, status, text):
    answer = await busy["live"].http.get(path)
    assert answer.status_code == status and text in answer.text
    assert answer.headers["content-type"].startswith("text/html")  # a page, not JSON


async def test_a_bulk_action_is_counted_before_it_is_done(own_busy):
    live = own_busy["live"]
    text = await page(live, "/ui/bulk?action=cancel&queue=audits")
    assert 'id="bulk-count">This will cancel <strong>1</strong> job(s).' in text
    nothing = await page(live, "/ui/bulk?action=retry&queue=audits")
    assert "No job that matches can be retried." in nothing and "1 of those are left" in nothing
    done = await live.http.post("/ui/bulk", headers=SAME, data={
        "action": "cancel", "queue": "audits", "limit": "1", "back": "/ui/jobs?queue=audits"})
    assert done.status_code == 303 and done.headers["location"] == "/ui/jobs?queue=audits"
    assert "1 job(s) cancelled" in await page(live, done.headers["location"])
    assert (await live.job(own_busy["waiting"]))["state"] == "cancelled"


async def test_a_bulk_count_past_one_action_is_exact(busy, monkeypatch):
    monkeypatch.setattr(dashboard, "BULK_LIMIT", 1)  # 2 finished jobs: more than one action takes
    text = await page(busy["live"], "/ui/bulk?action=retry&state=completed&state=discarded")
    assert "<li>2 job(s) match" in text and "one action takes the newest 1 of them" in text


@pytest.mark.parametrize(("method", "path", "form", "status", "code"), [
    ("get", "/ui/bulk?action=delete&state=discarded", None, 400, "invalid_request"),
    ("get", "/ui/bulk?action=retry", None, 400, "invalid_filter"),
    ("post", "/ui/bulk", {"action": "retry", "state": "discarded", "limit": "0"}, 422,
     "invalid_request"),
    ("post", "/ui/bulk", {"action": "retry", "limit": "5"}, 400, "invalid_filter"),
    ("post", "/ui/bulk", {"action": "retry", "state": "nope", "limit": "5"}, 400,
     "invalid_filter"),
    ("post", "/ui/queues/a%20b/pause", {}, 400, "invalid_queue"),
])
async def test_bad_bulk_and_queue_requests_are_precise_4xx(busy, method, path, form, status,
                                                          code):
    live = busy["live"]
    if method == "get":
        answer = await live.http.get(path)
    else:
        answer = await live.http.post(path, data=form, headers=SAME)
    assert answer.status_code == status and answer.json()["error"]["code"] == code


async def test_a_job_id_goes_into_links_and_forms_percent_encoded(own_busy):
    # (A "/" is refused at enqueue, tests/server/test_ids.py; one stored by an earlier version
    # is clicked through in tests/ui/test_ui.py.)
    live = own_busy["live"]
    await live.enqueue("audit", id="order:17@shop+eu")
    listed = await page(live, "/ui/jobs?queue=audits")
    assert 'href="/ui/jobs/order%3A17%40shop%2Beu"' in listed
    text = await page(live, "/ui/jobs/order%3A17%40shop%2Beu")
    assert 'action="/ui/jobs/order%3A17%40shop%2Beu/cancel"' in text
    assert 'name="back" value="/ui/jobs/order%3A17%40shop%2Beu"' in text
    done = await live.http.post("/ui/jobs/order%3A17%40shop%2Beu/cancel", headers=SAME,
                                data={"back": "/ui/jobs/order%3A17%40shop%2Beu"})
    assert done.status_code == 303
    assert "is cancelled" in await page(live, "/ui/jobs/order:17@shop+eu")


async def test_pause_and_resume_a_queue_from_its_page(own_busy):
    live = own_busy["live"]
    paused = await live.http.post("/ui/queues/audits/pause", headers=SAME,
                                  data={"back": "/ui/queues"})
    assert paused.status_code == 303
    text = await page(live, "/ui/queues")
    assert "queue audits is paused" in text and ">Resume</button>" in text
    assert live.coordinator.scheduler.paused == {"audits"}
    await live.http.post("/ui/queues/audits/resume", headers=SAME, data={})
    assert live.coordinator.scheduler.paused == set()


async def test_pages_render_while_a_delayed_job_waits(own_busy):
    """A job enqueued with a delay is held in memory as scheduled: the counts taken from
    memory (overview, queues) must take it as it was built, not only as a restart loads it."""
    live = own_busy["live"]
    job = await live.enqueue("audit", {"who": "later"}, delay=3600)
    assert job["state"] == "scheduled"
    for path in ("/ui", "/ui/queues"):
        await page(live, path)
    text = await page(live, "/ui/queues")
    assert 'data-state="scheduled"' in text or "scheduled" in text


async def test_a_queue_given_only_at_enqueue_stays_selected_in_the_filter(own_busy):
    """No spec names queue 'parked' and no worker serves it: the form must still offer it
    and keep it chosen, or the next Filter (and a bulk action) would take every queue."""
    live = own_busy["live"]
    await live.enqueue("audit", {"who": "x"}, queue="parked")
    text = await page(live, "/ui/jobs?queue=parked")
    assert "<option selected>parked</option>" in text
    # asked for, though nothing is there: said so, and still chosen
    answer = await live.http.get("/ui/jobs?queue=nowhere")
    assert answer.status_code == 422 and "queue &#39;nowhere&#39; is unknown" in answer.text
    assert "<option selected>nowhere</option>" in answer.text
