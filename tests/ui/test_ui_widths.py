"""The dashboard at a phone's width (390 px) and a desktop's (1280 px), in Chromium, on one
server with a little of everything (workers, a finished, a failed and a blocked job,
limits):
no page scrolls sideways, the header's links are on screen and readable (a contrast
of at least 4.5:1, WCAG AA, against what is behind them), and no name (a spec, queue or
host) in a table breaks over two lines. At the phone's width the tables read without
scrolling their box: the Workers' state and load, the Blocked reason, a queue's waiting
reason, a job's log line and a limit's use whole (broken only between words), and jobs rows of even height. Also what a page shows while its server does not
answer: its content dimmed under a banner that says how old it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import BrowserContext, Page, expect
from test_ui import browser, enter, fresh_page, shared  # noqa: F401 (browser, shared: fixtures)
from uirig import Rig, filled

from rota.core.limits import LimitRule, Rate
from rota.worker.worker import JobContext

pytestmark = pytest.mark.xdist_group("browser-b")  # a second browser, beside test_ui.py's

# The relative luminance of a CSS colour and the contrast of two, as WCAG 2 defines them;
# a link's background is the first opaque one among it and its ancestors.
HEADER = """() => {
  const rgb = c => c.match(/[\\d.]+/g).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map(v => v / 255)
      .map(v => v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4)
      .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const behind = el => {
    for (; el; el = el.parentElement) {
      const c = rgb(getComputedStyle(el).backgroundColor);
      if (c.length < 4 || c[3] > 0) return c;
    }
    return [255, 255, 255];
  };
  return [...document.querySelectorAll('header.top a, header.top button')].map(el => {
    const r = el.getBoundingClientRect();
    const [a, b] = [lum(rgb(getComputedStyle(el).color)), lum(behind(el))];
    return {text: el.textContent.trim(), left: r.left, right: r.right, top: r.top,
            bottom: r.bottom, contrast: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05)};
  });
}"""

# The cells of the columns that hold a name (a spec, a queue, a host) whose text takes
# more than one line: the tops of its pieces of text lie a line (8 px or more) apart.
NAMES = """() => {
  const broken = [];
  for (const table of document.querySelectorAll('#live table')) {
    const heads = [...table.querySelectorAll('thead th')]
        .map(th => th.textContent.trim().toLowerCase());
    for (const row of table.querySelectorAll('tbody tr')) {
      if (row.cells.length !== heads.length) continue;  // a row under a row (colspan)
      heads.forEach((head, i) => {
        if (!['spec', 'queue', 'host'].includes(head)) return;
        const tops = [];
        const walk = document.createTreeWalker(row.cells[i], NodeFilter.SHOW_TEXT);
        for (let node; (node = walk.nextNode());) {
          if (!node.textContent.trim()) continue;
          const range = document.createRange();
          range.selectNodeContents(node);
          for (const rect of range.getClientRects()) {
            if (rect.width > 0) tops.push(rect.top);
          }
        }
        if (Math.max(...tops) - Math.min(...tops) >= 8) broken.push(`${head} ${row.cells[i].textContent.trim()}`);
      });
    }
  }
  return broken;
}"""

# The width of the last element that matches a selector, and its words that are split:
# over two lines, or cut by the edge of the box that scrolls them (what shows without
# scrolling). In one call: the live region is swapped several times a second.
SPLIT = """css => {
  const el = [...document.querySelectorAll(css)].pop();
  const box = el.closest('.scroll').getBoundingClientRect();
  const split = [];
  const walk = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
  for (let node; (node = walk.nextNode());) {
    for (const word of node.textContent.matchAll(/\\S+/g)) {
      const range = document.createRange();
      range.setStart(node, word.index);
      range.setEnd(node, word.index + word[0].length);
      const rects = [...range.getClientRects()].filter(r => r.width > 0);
      if (rects.length !== 1 || rects[0].left < box.left || rects[0].right > box.right)
        split.push(word[0]);
    }
  }
  return {width: el.getBoundingClientRect().width, split};
}"""


def fill(rig: Rig) -> dict[str, str]:
    rig.spec("mail", queue="emails", extra="[retry]\nmax_attempts = 1\n")
    rig.spec("export_monthly_customer_report", queue="reports_without_any_worker")

    def mail(ctx: JobContext) -> str:
        if ctx.args.get("fail"):
            raise ConnectionRefusedError("smtp.example.com:587 refused the connection")
        ctx.log(f"sending the welcome mail to {ctx.args['to']} through smtp.example.com:587")
        return "sent"

    rig.limits({("spec", "mail"): LimitRule(concurrency=5, rate=Rate(100, 60.0)),
                ("queue", "reports_without_any_worker"): LimitRule(concurrency=1)})
    rig.worker({"mail": mail}, labels=["web", "eu-west"], queues=["emails"])
    ids = {"done": rig.enqueue("mail", {"to": "a@example.com"}, capture_logs=True),
           "failed": rig.enqueue("mail", {"fail": True})}
    for key, state in (("done", "completed"), ("failed", "discarded")):
        rig.wait(lambda job_id=ids[key], state=state: rig.job(job_id)["state"] == state, state)
    rig.wait(lambda: rig.job(ids["done"])["logs"], "the mail job's log line")
    rig.enqueue("export_monthly_customer_report", {"customer": "ACME"})  # blocked
    rig.api("PUT", "/schedules/monthly_customer_report_for_every_region_of_the_company",
            json={"spec": "export_monthly_customer_report", "cron": "0 6 L * *",
                  "timezone": "America/Argentina/ComodRivadavia", "overlap": "cancel_previous",
                  "description": "the report each region's manager reads on the first day"})
    return ids


@pytest.fixture(scope="module")
def some(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Rig, dict[str, str]]]:
    with filled(tmp_path_factory.mktemp("widths"), fill) as rig_ids:
        yield rig_ids


def check_pages(page: Page, rig: Rig, ids: dict[str, str], width: int) -> dict[str, Any]:
    """Every page at ``width``: what is wrong with each, by path."""
    page.set_viewport_size({"width": width, "height": 800})
    page.goto(rig.base + "/ui/login")
    wrong = {"/ui/login": faults(page, width)}
    enter(page, rig)
    for path in ("/ui", "/ui/queues", "/ui/specs", "/ui/limits", "/ui/schedules", "/ui/workers",
                 "/ui/jobs", "/ui/webhooks",
                 "/ui/jobs?state=discarded", f"/ui/jobs/{ids['done']}",
                 f"/ui/jobs/{ids['failed']}", "/ui/bulk?action=retry&state=discarded"):
        page.goto(rig.base + path)
        page.locator("#live").wait_for(state="attached")
        wrong[path] = faults(page, width)
    return {path: why for path, why in wrong.items() if why}


def faults(page: Page, width: int) -> list[str]:
    found = []
    scroll, client = page.evaluate("""() => [document.documentElement.scrollWidth,
                                             document.documentElement.clientWidth]""")
    if scroll > client:
        found.append(f"scrolls sideways: {scroll} px in {client}")
    links = page.evaluate(HEADER)
    assert links, "no link in the header"
    for link in links:
        if link["left"] < 0 or link["right"] > width or link["top"] < 0:
            found.append(f"{link['text']!r} off screen ({link['left']:.0f}-{link['right']:.0f})")
        if link["contrast"] < 4.5:
            found.append(f"{link['text']!r} contrast {link['contrast']:.2f}")
    found += [f"broken name: {cell}" for cell in page.evaluate(NAMES)]
    return found


# The phone's width in the default run; the desktop's in the soak run (-m soak, .ci/run),
# beside tests/ui/test_ui_text.py, which checks every page for sideways scrolling at the
# browser's default width in the default run too.
@pytest.mark.parametrize("width", [390, pytest.param(1280, marks=pytest.mark.soak)])
def test_every_page_fits_the_width_and_its_header_reads(
        shared: BrowserContext, some: tuple[Rig, dict[str, str]], width: int):
    rig, ids = some
    page = fresh_page(shared, rig)
    try:
        assert check_pages(page, rig, ids, width) == {}
        if width == 390:  # the overview's cards wrap, and the chart's text stays legible
            page.goto(rig.base + "/ui")
            cards = page.evaluate("""() => [...document.querySelectorAll('.card')]
                                     .map(c => c.getBoundingClientRect().top)""")
            assert len(set(cards)) > 1, cards
            sizes = page.evaluate("""() => [...document.querySelectorAll('svg.chart text')]
                                     .map(t => t.getBoundingClientRect().height)""")
            assert sizes and min(sizes) >= 9, sizes  # pixels on screen, not in the viewBox
            # The Blocked reason, a queue's waiting reason, a job's log line and a limit's
            # use, on a line
            # of their own as wide as the box: not one word a line, every word whole and
            # on screen (the queues' table scrolls 860 px wide: not its reason).
            for path, css in (("/ui", ".blocked td"), ("/ui/queues", "ul.waiting .warn"),
                              (f"/ui/jobs/{ids['done']}", ".logs td"),
                              ("/ui/limits", ".limits td.full")):
                page.goto(rig.base + path)
                text = page.evaluate(SPLIT, css)
                assert text["width"] >= 250 and text["split"] == [], (path, text)
            # The workers' state and load without scrolling their box (at its start).
            page.goto(rig.base + "/ui/workers")
            offscreen = page.evaluate("""() => {
                const table = document.querySelector('table.workers');
                const edge = table.closest('.scroll').getBoundingClientRect().right;
                return [...table.querySelectorAll('th')]
                    .filter(th => th.getBoundingClientRect().right > edge)
                    .map(th => th.textContent.trim().toLowerCase());
            }""")
            assert "state" not in offscreen and "running" not in offscreen, offscreen
            # Rows of jobs of an even height: a failed one's error no taller than a line.
            page.goto(rig.base + "/ui/jobs")
            heights = page.evaluate("""() => [...document.querySelectorAll('table.jobs tbody tr')]
                                       .map(tr => tr.getBoundingClientRect().height)""")
            assert len(heights) >= 3 and max(heights) <= 1.2 * min(heights), heights
    finally:
        page.close()


def test_a_page_whose_server_stops_dims_its_content_under_a_banner(
        shared: BrowserContext, tmp_path: Path):
    rig = Rig(tmp_path)
    stopped = False
    page = fresh_page(shared, rig)
    try:
        enter(page, rig, "/ui/jobs?state=bogus")  # a 400 page: the server answers, no banner
        banner, live = page.locator("#stale"), page.locator("#live")
        expect(page.locator("#poll-state")).to_have_text("error 400")
        expect(banner).to_be_hidden()
        page.goto(rig.base + "/ui/workers")
        # A server that does not answer for a while, then does again.
        page.route("**/ui/workers", lambda route: route.abort())
        expect(banner).to_be_visible()
        expect(banner).to_contain_text(re.compile(r"server unreachable — showing data from"
                                                  r" \d+ s ago"))
        expect(live).to_have_class(re.compile(r"\bstale\b"))
        assert float(live.evaluate("el => getComputedStyle(el).opacity")) < 0.7
        page.unroute("**/ui/workers")
        expect(banner).to_be_hidden()
        expect(live).not_to_have_class(re.compile(r"\bstale\b"))
        rig.close()  # and one that stopped
        stopped = True
        expect(banner).to_be_visible()
        expect(live).to_have_class(re.compile(r"\bstale\b"))
        expect(banner).to_contain_text(re.compile(r"showing data from [1-9]\d* s ago"))
    finally:
        page.close()
        if not stopped:
            rig.close()
