"""Push endpoints on the dashboard, in a real browser against a real server and the
endpoint rig (tests/endpoint_rig.py, a subprocess): the workers page shows an endpoint its
circuit breaker paused, and why; a job's page shows each attempt's delivery (status,
duration, body, delivery id) and a waiting job says it waits on its endpoint."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, expect
from test_ui_workflows import browser, watched_page  # noqa: F401 (a fixture)
from uirig import Rig

pytestmark = pytest.mark.xdist_group("browser")  # one xdist worker runs them: one browser
expect.set_options(timeout=10_000)
RIG = Path(__file__).resolve().parents[1] / "endpoint_rig.py"


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[str]:
    """The rig's base URL."""
    log = tmp_path / "rig.log"
    proc = subprocess.Popen([sys.executable, str(RIG), "--port", "0", "--log", str(log)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_a_paused_endpoint_and_its_deliveries_on_the_dashboard(browser: Browser,
                                                               endpoint: str, tmp_path: Path):
    with Rig(tmp_path, allow_private_endpoints=True) as rig:
        rig.api("PUT", "/secrets/main", json={"value": "a-secret-of-16-bytes-at-least"})
        rig.api("PUT", "/specs", json={"specs": [{
            "name": "down", "version": "1", "retry": {"max_attempts": 1},
            "execute": {"url": f"{endpoint}/fail", "secret": "main", "timeout": 2}}]})
        failed = [rig.enqueue("down", {"i": i}) for i in range(5)]
        rig.wait(lambda: rig.api("GET", "/endpoints")["endpoints"][0]["opened"], "a pause")
        waiting = [rig.enqueue("down", {"i": i}) for i in range(5, 15)]  # trials take some

        problems: list[str] = []
        page = watched_page(browser, rig, problems)
        page.goto("/ui/workers")
        row = page.locator("tr[data-endpoint^='http:down@']")
        expect(row.locator("[data-breaker]")).to_have_text(re.compile("paused|trying"))
        expect(row.locator("[data-reason]")).to_contain_text("endpoint failing:")
        expect(row).to_contain_text(f"{endpoint}/fail")
        expect(page.locator("table.workers tbody tr")).to_have_count(0)  # not a worker

        page.goto("/ui")  # the overview counts it apart from the workers, and says it paused
        expect(page.locator("#endpoints")).to_contain_text(re.compile(r"1\s+1 paused"))
        expect(page.locator("main")).to_contain_text("endpoint failing:")

        page.goto(f"/ui/jobs/{failed[0]}")
        expect(page.locator("#job-state")).to_have_text("discarded")
        delivery = page.locator(".attempt .delivery")
        expect(delivery).to_contain_text(re.compile(r"HTTP 500 in \d+ ms · delivery \S+"))
        expect(page.locator(".attempt pre.delivery-body")).to_contain_text("failing on purpose")

        page.goto(f"/ui/jobs/{waiting[-1]}")
        expect(page.locator("p.warn")).to_contain_text("Waiting: endpoint failing:")
        assert problems == []
        page.context.close()
