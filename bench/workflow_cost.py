"""What a job in a workflow costs beside a plain job (issue 24), for bench/compare.py.

The same no-op jobs run twice on a fresh ``rota serve`` each (default settings, one
worker at concurrency 10): once enqueued as plain batches (``POST /jobs/batch`` of 1,000)
and once as groups of 1,000 (``POST /workflows``), each timed from the first request to
the last job's end. A group's job pays for its node row, its ending's settle (the group's
counter, in the same transaction) and its workflow's row lock; the difference per job is
that cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

import throughput as tp

CHUNK = 1000


def run(jobs: int, how: str, rota_server: Callable[[], Any]) -> float:
    """Jobs per second end to end, enqueued ``how`` ("batch" or "group"), on a server
    ``rota_server()`` starts (bench/compare.py's)."""
    with rota_server() as (setup, children):
        tp.start_workers(setup, 1, children)
        body = [{"spec": tp.SPEC_NAME, "args": {}} for _ in range(CHUNK)]
        started = time.time()
        with httpx.Client(base_url=setup.base_url, timeout=120) as http:
            for _ in range(jobs // CHUNK):
                if how == "batch":
                    http.post("/jobs/batch", json={"jobs": body}).raise_for_status()
                else:
                    http.post("/workflows", json={"type": "group", "jobs": body}
                              ).raise_for_status()
        ended = tp.wait_for_completion(setup.db, jobs, 300.0, children, setup.base_url)
    if ended is None:
        raise SystemExit(f"{how}: the jobs did not all end in 300 s")
    return jobs / (ended - started)


def group(quick: bool, rota_server: Callable[[], Any], reference: Callable[[], Any],
          ratio: Callable[[float | None, float | None], float | None]) -> dict[str, Any]:
    """bench/compare.py's ``group`` scenario: plain and grouped, beside huey's e2e."""
    jobs = 2_000 if quick else 10_000
    plain, grouped = run(jobs, "batch", rota_server), run(jobs, "group", rota_server)
    rota = {"jobs": jobs, "plain_per_s": round(plain), "group_per_s": round(grouped),
            "group_job_overhead_us": round((1 / grouped - 1 / plain) * 1e6, 1)}
    ref = reference()
    huey = ref.huey_e2e(jobs=jobs, concurrency=10) if ref else None
    return {"rota": rota, "reference": huey, "ratio": {
        "group_end_to_end": ratio(rota["group_per_s"], huey and huey.get("end_to_end_per_s")),
        "plain_end_to_end": ratio(rota["plain_per_s"], huey and huey.get("end_to_end_per_s"))}}
