"""The workflow pages in a real browser, against a real server and a real SDK worker: the
list, a workflow's tree of steps with their states, each job linking to its page and
each job's page linking back, Cancel, and not one console error on the way."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect
from uirig import Rig, chromium

from rota.server import flowpages
from rota.worker.worker import JobContext

pytestmark = pytest.mark.xdist_group("browser")  # one xdist worker runs them: one browser
expect.set_options(timeout=10_000)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as browser:
        yield browser


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with Rig(tmp_path) as rig:
        yield rig


def watched_page(browser: Browser, rig: Rig, problems: list[str]) -> Page:
    """A page logged in (the dashboard's cookie), whose console errors and uncaught
    exceptions land in ``problems``."""
    context = browser.new_context(base_url=rig.base)
    context.add_init_script("window.ROTA_REFRESH_MS = 250")
    assert rig.token is not None
    context.add_cookies([{"name": "rota_session", "value": rig.token, "url": rig.base,
                          "httpOnly": True, "sameSite": "Strict"}])
    page = context.new_page()

    def console(message: ConsoleMessage) -> None:
        if message.type == "error":
            problems.append(f"console: {message.text}")

    page.on("console", console)
    page.on("pageerror", lambda exc: problems.append(f"pageerror: {exc}"))
    page.on("dialog", lambda dialog: dialog.accept())  # data-confirm: the operator agrees
    return page


def test_a_workflows_tree_links_each_job_and_each_job_links_back(browser: Browser, rig: Rig,
                                                                  monkeypatch):
    rig.spec("echo")
    rig.spec("explode", extra="[retry]\nmax_attempts = 1\n")
    rig.spec("hold")

    async def echo(ctx: JobContext) -> str:
        return str(ctx.args.get("message"))

    async def explode(ctx: JobContext) -> None:
        raise ValueError("the widget melted")

    async def hold(ctx: JobContext) -> None:
        await asyncio.sleep(60)  # noqa: sleep-ok (the job holds on until cancelled)

    rig.worker({"echo": echo, "explode": explode, "hold": hold}, concurrency=4)
    rig.api("POST", "/workflows", json={
        "type": "chain", "name": "pipeline", "id": "wf-ui", "steps": [
            {"spec": "echo", "args": {"message": "first"}},
            {"type": "group", "jobs": [{"spec": "echo", "args": {"message": "a"}},
                                       {"spec": "explode"}]},
            {"spec": "echo", "args": {"message": "never"}}]})
    rig.wait(lambda: rig.api("GET", "/workflows/wf-ui")["state"] == "failed", "the chain fails")
    tree = rig.api("GET", "/workflows/wf-ui")["root"]
    first_job = tree["children"][0]["job_id"]
    problems: list[str] = []
    page = watched_page(browser, rig, problems)

    page.goto("/ui/workflows")
    expect(page.get_by_role("link", name="Workflows")).to_have_class("here")
    row = page.locator("tr[data-workflow='wf-ui']")
    expect(row).to_contain_text("failed")
    expect(row).to_contain_text("pipeline")
    row.get_by_role("link").click()
    expect(page).to_have_url(re.compile(r"/ui/workflows/wf-ui$"))
    expect(page.locator("#workflow-state")).to_have_text("failed")
    # The tree: a chain of a job, a group of two, a job; each node its state.
    states = page.locator("#tree li").evaluate_all(
        "nodes => nodes.map(n => [n.id, n.classList[1], n.dataset.state])")
    assert states == [["n-0", "kind-chain", "failed"], ["n-1", "kind-job", "completed"],
                      ["n-2", "kind-group", "failed"], ["n-3", "kind-job", "completed"],
                      ["n-4", "kind-job", "failed"], ["n-5", "kind-job", "cancelled"]]
    expect(page.locator("#n-4 > .step .pill")).to_have_class(re.compile(r"\bdiscarded\b"))
    expect(page.locator(".failures")).to_contain_text("the widget melted")

    page.locator("#n-1 > .step a.job-link").click()  # to the job's page ...
    expect(page).to_have_url(re.compile(f"/ui/jobs/{first_job}$"))
    expect(page.locator("h1")).to_contain_text(first_job)
    page.locator("#workflow-link").click()  # ... and back, to its node
    expect(page).to_have_url(re.compile(r"/ui/workflows/wf-ui#n-1$"))
    expect(page.locator("#tree")).to_be_visible()
    page.set_viewport_size({"width": 360, "height": 740})  # a phone: nothing scrolls sideways
    for path in ("/ui/workflows/wf-ui", "/ui/workflows"):
        page.goto(path)
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), path
    page.set_viewport_size({"width": 1280, "height": 800})

    rig.api("POST", "/workflows", json={"type": "group", "id": "wf-stuck",
                                        "jobs": [{"spec": "hold"}, {"spec": "hold"}]})
    page.goto("/ui/workflows/wf-stuck")
    expect(page.locator("#workflow-state")).to_have_text(re.compile("running|pending"))
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator(".flash")).to_have_text("workflow wf-stuck is cancelled")
    expect(page.locator("#workflow-state")).to_have_text("cancelled")
    expect(page.get_by_role("button", name="Cancel")).to_have_count(0)

    monkeypatch.setattr(flowpages, "PAGE", 1)  # a page each: the newest, then the older
    page.goto("/ui/workflows")
    expect(page.locator("tr[data-workflow]")).to_have_attribute("data-workflow", "wf-stuck")
    page.get_by_role("link", name="Older ›").click()
    expect(page.locator("tr[data-workflow]")).to_have_attribute("data-workflow", "wf-ui")
    expect(page.get_by_role("link", name="« First")).to_have_attribute("href", "/ui/workflows")

    page.goto("/ui/workflows/no-such")
    expect(page.locator("h1")).to_have_text("Not found")
    page.goto("/ui/workflows?state=bogus")
    expect(page.get_by_role("alert")).to_contain_text("state must be one of pending, running")
    page.context.close()
    # The 404 and 400 above are the console errors those pages make (their status), no more.
    assert [p for p in problems if "404" not in p and "400" not in p] == [], problems
