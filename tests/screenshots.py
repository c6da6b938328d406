"""Screenshots of every dashboard page at a desktop's width (1280 px), and of the overview
and the jobs list at a phone's (390 px), for README.md: a demo server with specs, workers
and a few minutes of jobs (some failing, one running with progress and logs, a queue no
worker serves, a worker on an old spec version), photographed with the same chromium the
browser tests drive.

    .venv/bin/python tests/screenshots.py               # writes docs/screenshots/*.png
    .venv/bin/python tests/screenshots.py --minutes 0   # no traffic history: quicker

The throughput chart needs traffic over some minutes to show more than a point, so the
script runs a producer for ``--minutes`` (default 3) before it takes the pictures.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from playwright.sync_api import sync_playwright
from uirig import CHROMIUM, Rig

from rota.worker.worker import JobContext

OUT = Path(__file__).resolve().parent.parent / "docs" / "screenshots"
VIEWPORT = {"width": 1280, "height": 820}
PHONE = {"width": 390, "height": 844}


class SmtpRefused(ConnectionRefusedError):
    """What the demo's mail job raises now and then."""


def build(rig: Rig, release: threading.Event) -> dict[str, str]:
    """Specs, workers and a first set of jobs; returns ids worth a picture."""
    rig.spec("send_email", queue="emails", extra='description = "Send one transactional email"\n'
             "[retry]\nmax_attempts = 2\nbackoff_base = 0.1\nbackoff_max = 0.2\n")
    rig.spec("resize_image", queue="media", version="1")
    rig.spec("resize_image", queue="media", version="2",
             extra='description = "Resize an uploaded image to the given widths"\n')
    rig.spec("monthly_report", queue="reports", extra='description = "Build a customer report"\n')
    rig.spec("export_csv", queue="exports", extra='description = "Export a table as CSV"\n')

    def send_email(ctx: JobContext) -> dict[str, Any]:
        if random.random() < 0.3:
            raise SmtpRefused(f"smtp.example.com:587 refused the connection for {ctx.args['to']}")
        return {"message_id": f"<{ctx.id[:8]}@example.com>"}

    async def resize_image(ctx: JobContext) -> dict[str, Any]:
        await asyncio.sleep(random.uniform(0.05, 0.3))  # noqa: sleep-ok (stands in for a handler's work)
        return {"widths": ctx.args["widths"]}

    async def monthly_report(ctx: JobContext) -> dict[str, Any]:
        for step, what in enumerate(("loading invoices", "joining payments", "rendering PDF")):
            ctx.log(f"{what} for {ctx.args['customer']}")
            ctx.progress(20 + 30 * step, what)
            if step == 2:
                ctx.alert("the invoices replica lags 40 s behind", level="warning")
                await asyncio.to_thread(release.wait, 600)
        return {"pages": 12}

    rig.worker({"send_email": send_email, "resize_image": resize_image}, concurrency=8,
               labels=["web", "eu-west"], queues=["emails", "media"])
    rig.worker({"send_email": send_email}, concurrency=4, labels=["web", "eu-central"],
               queues=["emails"])
    reporter = rig.worker({"monthly_report": monthly_report}, concurrency=2, labels=["batch"],
                          queues=["reports"])
    # A worker still on version 1 of resize_image: the specs page shows it apart.
    old = rig.tmp / "old-specs"
    old.mkdir()
    (old / "resize_image.toml").write_text('name = "resize_image"\nversion = "1"\n'
                                           'queue = "media"\n')
    stale = rig.worker({"resize_image": resize_image}, specs_dir=old, labels=["canary"],
                       queues=["media"], concurrency=2)
    rig.api("POST", f"/workers/{stale.worker_id}/state", json={"state": "quiet"})
    report = rig.enqueue("monthly_report", {"customer": "ACME Corp", "month": "2026-10"},
                         capture_logs=True)
    rig.wait(lambda: rig.job(report)["progress"] is not None
             and rig.job(report)["progress"]["percent"] >= 80, "the report running")
    rig.api("POST", "/queues/reports/pause")  # the running report goes on
    for n in range(3):
        rig.enqueue("export_csv", {"table": f"orders_{n}"})  # no worker serves "exports"
    # A workflow under way: its logo resized, its welcome mails sent (then a callback),
    # its export waiting for a worker of "exports", which none serves.
    mail = {"spec": "send_email", "args": {"template": "welcome"}}
    rig.api("POST", "/workflows", json={"type": "chain", "name": "onboard", "id": "onboard-acme",
                                        "steps": [
        {"spec": "resize_image", "args": {"key": "uploads/acme.png", "widths": [64, 128]}},
        {"type": "batch", "jobs": [{**mail, "args": {**mail["args"], "to": f"{who}@acme.test"}}
                                   for who in ("ada", "bo", "cy")],
         "callbacks": {"on_complete": {"spec": "send_email", "args": {
             "to": "ops@example.com", "template": "onboarded"}}}},
        {"spec": "export_csv", "args": {"table": "acme_users"}}]})
    return {"report": report, "reporter": reporter.worker_id, "workflow": "onboard-acme"}


def traffic(rig: Rig, seconds: float) -> None:
    """Jobs at a rate that changes, so that the chart has a shape."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        phase = (end - time.monotonic()) / max(seconds, 1)
        burst = 4 + int(8 * abs(0.5 - phase))
        for _ in range(burst):
            n += 1
            if n % 3:
                rig.enqueue("send_email", {"to": f"user{n}@example.com", "template": "welcome"})
            else:
                rig.enqueue("resize_image", {"key": f"uploads/{n}.png", "widths": [320, 640]})
        time.sleep(1)  # noqa: sleep-ok (a producer's pace, not a wait for a condition)


def failed_job(rig: Rig) -> str:
    """A discarded job, for the job page: a fresh one, so its errors read well."""
    while True:
        job_id = rig.enqueue("send_email", {"to": "ops@example.com", "template": "invoice"})
        job = rig.wait(lambda: (j := rig.job(job_id))["state"] in ("completed", "discarded") and j,
                       "the mail job to finish")
        if job["state"] == "discarded":
            return job_id


def shoot(rig: Rig, ids: dict[str, str]) -> list[Path]:
    OUT.mkdir(parents=True, exist_ok=True)
    shots = [("overview", "/ui"), ("queues", "/ui/queues"), ("specs", "/ui/specs"),
             ("workers", "/ui/workers"), ("jobs", "/ui/jobs?state=discarded"),
             ("job-failed", f"/ui/jobs/{ids['failed']}"),
             ("job-running", f"/ui/jobs/{ids['report']}"),
             ("workflow", f"/ui/workflows/{ids['workflow']}")]
    written = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        context = browser.new_context(base_url=rig.base, viewport=VIEWPORT,
                                      device_scale_factor=1)
        page = context.new_page()
        page.goto("/ui/login")
        page.screenshot(path=OUT / "login.png")
        written.append(OUT / "login.png")
        assert rig.token is not None
        page.fill("#token", rig.token)
        page.get_by_role("button", name="Log in").click()
        page.wait_for_url("**/ui")
        for name, path in shots:
            page.goto(path)
            page.locator("#poll").click()  # hold still for the picture
            page.evaluate("document.activeElement.blur()")
            # The whole page, but a long list only as far as the window shows it.
            page.screenshot(path=OUT / f"{name}.png", full_page=name != "jobs")
            written.append(OUT / f"{name}.png")
            page.locator("#poll").click()
        # And a phone's width (390 px): the header in two rows, wide tables scrolling in
        # their own box.
        page.set_viewport_size(PHONE)
        for name, path in (("overview-phone", "/ui"), ("jobs-phone", "/ui/jobs?state=discarded")):
            page.goto(path)
            page.locator("#poll").click()
            page.evaluate("document.activeElement.blur()")
            page.screenshot(path=OUT / f"{name}.png", full_page=name == "overview-phone")
            written.append(OUT / f"{name}.png")
            page.locator("#poll").click()
        browser.close()
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    opts = parser.parse_args()
    if not Path(CHROMIUM).exists():
        sys.exit(f"no {CHROMIUM}: apt-get install chromium")
    release = threading.Event()
    with tempfile.TemporaryDirectory(prefix="rota-shots-") as tmp:
        rig = Rig(Path(tmp), heartbeat_interval=1.0, heartbeat_timeout=5.0)
        try:
            ids = build(rig, release)
            traffic(rig, opts.minutes * 60)
            ids["failed"] = failed_job(rig)
            for path in shoot(rig, ids):
                print(path)
        finally:
            release.set()
            rig.close()


if __name__ == "__main__":
    main()
