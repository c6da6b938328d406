"""The dashboard with the longest texts each field allows, in Chromium at desktop width
(and at a phone's, for the widest tables): a 255-character hostname, OS and SDK,
128-character names (spec, queue, labels, worker, job id), 8,192-character messages,
progress, logs, alerts, args, results, errors and a spec description, all unbroken. No
page may scroll sideways, and each worker's buttons stay on screen. A right-to-left
override (U+202E) in worker or job text is shown, not obeyed: it reorders nothing around
it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import BrowserContext, Page, expect
from test_ui import browser, enter, fresh_page, shared  # noqa: F401 (browser, shared: fixtures)
from uirig import Rig, filled

from rota.base import protocol as p
from rota.worker.worker import JobContext, Worker

pytestmark = pytest.mark.xdist_group("browser-b")
WIDTH = 1280
LONG = 8192  # the longest message, progress, log line or alert the server keeps (MAX_TEXT)
SPEC = "s" * 128
QUEUE = "q" * 128
RLO = "\u202e"
# Text after an override: a page that obeys it shows "live" as "evil", and reverses
# whatever follows it on the same line too.
SPOOF = f"{RLO}live"


class LongWorker(Worker):
    """An SDK worker that describes itself with the longest texts a registration allows."""

    def registration(self) -> p.Registration:
        registration = super().registration()
        registration.hostname = "h" * 254 + RLO
        registration.os = "o" * 255
        registration.sdk = "k" * 255
        return registration

    def metrics(self) -> tuple[float, int]:
        return 409_600.0, 2**62  # 4,096 cores, all busy, and 4 EiB of memory


def long_jobs(rig: Rig) -> dict[str, str]:
    description = "d" * 9_000
    rig.spec(SPEC, queue=QUEUE, version="v" * 64,
             extra=f'description = "{description}"\n[retry]\nmax_attempts = 1\n')

    def handler(ctx: JobContext) -> Any:
        ctx.progress(50, "p" * (LONG - len(SPOOF)) + SPOOF)
        ctx.log("l" * (LONG - len(SPOOF)) + SPOOF)
        ctx.alert("a" * (LONG - len(SPOOF)) + SPOOF)
        if ctx.args.get("fail"):
            # An exception type named with the override: the jobs list shows "type: message"
            raise type(f"Spoof{RLO}Error", (ValueError,), {})("e" * LONG + SPOOF)
        return {"r" * 100: "r" * LONG + SPOOF}

    labels = [c * 128 for c in "abcdef"]
    queues = [QUEUE, *(c * 128 for c in "tuvwx")]
    rig.worker({SPEC: handler}, labels=labels, queues=queues, worker_id="w" * 128,
               cls=LongWorker)
    ids = {"done": "i" * 127 + "1", "failed": "i" * 127 + "2"}
    rig.enqueue(SPEC, {"x" * 100: "x" * LONG + SPOOF}, id=ids["done"], capture_logs=True)
    rig.enqueue(SPEC, {"fail": True}, id=ids["failed"], capture_logs=True)
    for state, job_id in (("completed", ids["done"]), ("discarded", ids["failed"])):
        rig.wait(lambda job_id=job_id, state=state: rig.job(job_id)["state"] == state, state)
    return ids


# One server for the module: both tests only read what long_jobs put there.
@pytest.fixture(scope="module")
def long_rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Rig, dict[str, str]]]:
    with filled(tmp_path_factory.mktemp("long"), long_jobs) as rig_ids:
        yield rig_ids


def wide(page: Page) -> dict[str, int]:
    return page.evaluate("""() => ({scroll: document.documentElement.scrollWidth,
                                    inner: window.innerWidth})""")


def desktop(shared: BrowserContext, rig: Rig) -> Page:
    page = fresh_page(shared, rig)
    page.set_viewport_size({"width": WIDTH, "height": 900})
    enter(page, rig)
    return page


def test_no_page_scrolls_sideways_and_every_button_is_on_screen(
        shared: BrowserContext, long_rig: tuple[Rig, dict[str, str]]):
    rig, ids = long_rig
    page = desktop(shared, rig)
    try:
        pages = ["/ui", "/ui/queues", "/ui/specs", "/ui/workers", "/ui/jobs",
                 f"/ui/jobs?queue={QUEUE}&state=discarded", f"/ui/jobs/{ids['done']}",
                 f"/ui/jobs/{ids['failed']}", f"/ui/bulk?action=retry&queue={QUEUE}",
                 "/ui/jobs/" + "m" * 128, "/ui/jobs?worker=" + "w" * 300]
        too_wide = {}
        for path in pages:
            page.goto(rig.base + path)
            page.locator("#live").wait_for(state="attached")
            width = wide(page)
            if width["scroll"] > width["inner"]:
                too_wide[path if len(path) < 50 else f"{path[:30]}…{path[-4:]}"] = width["scroll"]
        assert not too_wide, "; ".join(f"{k}: {v}px" for k, v in too_wide.items())
        page.goto(rig.base + "/ui/workers")
        expect(page.locator("table.workers button")).to_have_count(2)  # Quiet, Terminate
        # Read at once: the live region is swapped several times a second.
        boxes = page.evaluate("""() => [...document.querySelectorAll('table.workers button')]
                                 .map(b => b.getBoundingClientRect())
                                 .map(r => ({left: r.left, right: r.right}))""")
        assert len(boxes) == 2 and all(0 <= b["left"] and b["right"] <= WIDTH for b in boxes), boxes
        # At a phone's width the widest tables scroll in their box, the page never does;
        # a 255-character hostname breaks within its column rather than widen it for ever.
        page.set_viewport_size({"width": 390, "height": 800})
        for path in ("/ui/workers", f"/ui/jobs?queue={QUEUE}&state=discarded"):
            page.goto(rig.base + path)
            page.locator("#live").wait_for(state="attached")
            assert wide(page)["scroll"] <= 390, path
            inner = page.evaluate("document.querySelector('#live .scroll').scrollWidth")
            assert inner < 2500, (path, inner)
    finally:
        page.close()


def test_a_right_to_left_override_is_shown_and_reorders_nothing(
        shared: BrowserContext, long_rig: tuple[Rig, dict[str, str]]):
    rig, ids = long_rig
    page = desktop(shared, rig)
    try:
        for path in ("/ui/workers", f"/ui/jobs/{ids['done']}", f"/ui/jobs/{ids['failed']}",
                     f"/ui/jobs?queue={QUEUE}"):
            page.goto(rig.base + path)
            page.locator("#live").wait_for(state="attached")
            text = page.evaluate("document.body.innerText")
            assert RLO not in text, path  # the control itself is never obeyed
            assert "\\u202e" in text, path  # but shown, as the CLI shows it
        page.goto(rig.base + f"/ui/jobs/{ids['done']}")
        line = page.locator("p.progress-line")
        expect(line.locator("bdi")).to_contain_text("\\u202elive")
        # The age, after the message, stays after its last line.
        last, age = page.evaluate("""() => {
            const rects = [...document.querySelector('p.progress-line bdi').getClientRects()];
            const age = document.querySelector('p.progress-line span.muted');
            return [rects[rects.length - 1], age.getClientRects()[0]]
                .map(r => ({left: r.left, right: r.right, top: r.top}));
        }""")
        assert age["top"] > last["top"] + 1 or last["right"] <= age["left"] + 1, (last, age)
        page.goto(rig.base + f"/ui/jobs?queue={QUEUE}&state=discarded")
        expect(page.locator("td.error-text bdi").first).to_have_text("Spoof\\u202eError")
        # The message starts after the type: on its line, or on a line below it.
        kind, text = page.evaluate("""() => [...document.querySelectorAll('td.error-text bdi')]
                                      .map(b => b.getClientRects()[0])
                                      .map(r => ({left: r.left, right: r.right, top: r.top}))""")
        assert text["top"] > kind["top"] + 1 or kind["right"] <= text["left"] + 1, (kind, text)
    finally:
        page.close()
