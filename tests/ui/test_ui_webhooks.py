"""The webhooks page in a real browser, against a real server, a real SDK worker and a
receiver: each subscription with its latest deliveries, and "Send test", which the
receiver gets and the page then lists; not one console error on the way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hookrig import Receiver
from playwright.sync_api import Browser, Page, expect
from test_ui_workflows import browser, watched_page
from uirig import Rig

from rota.worker.worker import JobContext

pytestmark = pytest.mark.xdist_group("browser")  # one xdist worker runs them: one browser
assert browser  # the workflow pages' browser fixture, and its expect timeout


def test_the_webhooks_page_lists_deliveries_and_sends_a_test(browser: Browser, tmp_path: Path):
    with Rig(tmp_path, webhook_backoff_scale=0.01, allow_private_endpoints=True) as rig:
        receiver = rig.run(Receiver().start())
        try:
            rig.spec("echo")

            async def echo(ctx: JobContext) -> str:
                return "ok"

            rig.worker({"echo": echo})
            sub = rig.api("POST", "/webhooks", json={"url": receiver.url,
                                                     "kinds": ["result"]})
            job = rig.enqueue("echo")
            rig.wait(lambda: len(receiver.got) == 1, "the result delivered")
            assert receiver.got[0].json["data"]["job"] == job
            problems: list[str] = []
            page: Page = watched_page(browser, rig, problems)
            page.goto(rig.base + "/ui/webhooks")
            section = page.locator(f"[data-webhook='{sub['id']}']")
            expect(section).to_contain_text(receiver.url)
            expect(section).to_contain_text("kinds result")
            expect(section.locator("tr[data-delivery]")).to_have_count(1)
            expect(section.locator("tr[data-delivery] .state")).to_have_text("delivered")
            section.get_by_role("button", name="Send test").click()
            expect(page.get_by_role("status")).to_have_text(
                re.compile(rf"test delivery to {sub['id']}: HTTP 200 in [0-9.]+ ms"))
            assert receiver.got[-1].json["kind"] == "test"
            expect(page.locator(f"[data-webhook='{sub['id']}'] tr[data-delivery]")
                   ).to_have_count(2)
            assert problems == []
        finally:
            rig.run(receiver.close())
