"""The OJS conformance runner: the public suites of the Open Job Spec (levels 0 to 4)
against a server's HTTP binding, with a report per level and the conformance level reached.

    python tests/ojs/run.py --url http://127.0.0.1:8000 --levels 0-4 [--json]

The suites are read from ../shared/ojs/conformance/suites beside the clone (as .ci/run has
them), or from --suites DIR or $ROTA_OJS_SUITES. Exit status: 0 when every test run
passed, 1 when one failed, 2 when the suites or the arguments are wrong.

Each assertion is judged as the reference runner's lib/assertions.go does (ojs_judge.py,
ojs_verdict.py say where this runner is stricter). Rota does not serve /ojs/v1 yet:
running this against ``rota serve``, in .ci/run, is issue 25's next part.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime, timezone

import httpx
import ojs_report
from ojs_driver import run_cases
from ojs_suites import SuiteError, load, parse_levels, suites_dir


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tests/ojs/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("OJS_TEST_URL"),
                        help="the server's base URL (default: $OJS_TEST_URL)")
    parser.add_argument("--levels", default="0-4", help='"0-4", "0,1" or "2" (default 0-4)')
    parser.add_argument("--suites", help="the suites folder (default: beside the clone)")
    parser.add_argument("--test", help="run only this test id (L0-OPS-001)")
    parser.add_argument("--reset-url", help="a path POSTed before each test (a state reset)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


async def main(argv: list[str] | None = None,
               transport: httpx.AsyncBaseTransport | None = None) -> int:
    args = arguments(argv)
    if not args.url:
        print("run.py: give the server's --url (or set OJS_TEST_URL)", file=sys.stderr)
        return 2
    try:
        levels = parse_levels(args.levels)
        cases = load(levels, suites_dir(args.suites))
    except (ValueError, SuiteError, FileNotFoundError) as error:
        print(f"run.py: {error}", file=sys.stderr)
        return 2
    if args.test:
        cases = [case for case in cases if case.test_id == args.test]
        if not cases:
            print(f"run.py: no test {args.test} in levels {args.levels}", file=sys.stderr)
            return 2
    run_at = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=args.timeout,
                                 transport=transport) as client:
        results = await run_cases(client, cases, reset=args.reset_url)
    report = ojs_report.build(results, args.url, levels, run_at,
                              int((time.perf_counter() - started) * 1000))
    print(json.dumps(report, indent=2) if args.json else ojs_report.table(report, results))
    return 0 if report["conformant"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
