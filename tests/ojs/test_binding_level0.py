"""Rota's OJS HTTP binding in the default run: every level 0 file of the Open Job Spec
conformance suites that needs no delay, run by tests/ojs/run.py's driver against one
server on SQLite (a few seconds). .ci/run runs all five levels, on SQLite and on a
two-server PostgreSQL cluster (tests/ojs/serve.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import start_server, stop_server
from ojs_driver import run_cases
from ojs_suites import Case, load, suites_dir

from rota.core.settings import ServerSettings

RESET = "/ojs/v1/admin/reset"


def delayed(case: Case) -> bool:
    """Whether a step of the case waits (delay_ms, or a WAIT step)."""
    return any(step.get("delay_ms") or step["action"] == "WAIT" for step in case.all_steps())


async def test_level_0_without_delays_passes_against_one_sqlite_server(tmp_path: Path) -> None:
    root = suites_dir()
    if not root.is_dir():
        pytest.skip(f"no OJS conformance suites at {root} (clone them beside the repo as"
                    " ../shared, or set ROTA_OJS_SUITES)")
    cases = [case for case in load([0], root) if not delayed(case)]
    assert len(cases) >= 60  # (65 files, 3 of them with delays)
    # the test-only reset between tests, when this Rota has it (issue 25)
    testing = "unsafe_test_endpoints" in {f.name for f in dataclasses.fields(ServerSettings)}
    live = await start_server(tmp_path, **({"unsafe_test_endpoints": True} if testing else {}))
    try:
        manifest = await live.http.get("/ojs/manifest")
        fetch = await live.http.post("/ojs/v1/workers/fetch", json={"queues": ["probe"]})
        if manifest.status_code == 404 or fetch.status_code in (404, 405):
            pytest.skip("this Rota serves no /ojs/v1 routes yet (manifest"
                        f" {manifest.status_code}, FETCH {fetch.status_code})")
        results = await run_cases(live.http, cases, reset=RESET if testing else None)
    finally:
        await stop_server(live)
    failed = {f"{result.test_id} ({Path(result.file).name})":
              [f"[{failure.step}] {failure.message}" for failure in result.failures]
              for result in results if result.status != "pass"}
    assert not failed, failed
