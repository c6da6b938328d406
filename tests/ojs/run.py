"""The OJS conformance runner: the public suites of the Open Job Spec (levels 0 to 4)
against a server's HTTP binding, with a report per level and the conformance level reached.

    python tests/ojs/run.py --url http://127.0.0.1:8000 --levels 0-4 [--json]
    python tests/ojs/run.py --url http://a:8000,http://b:8000 --reset-url /ojs/v1/admin/reset \
        --excused tests/ojs/excused.toml --min-level 4

Several URLs (a comma-separated list, or --url repeated; else $OJS_TEST_URL) are the
servers of one cluster: each step's request goes to the next one, round robin, and the
--reset-url path is posted to every one before each test. --token sends
``Authorization: Bearer TOKEN``; tests/ojs/serve.py starts the servers and sets the
variables.

The suites are read from ../shared/ojs/conformance/suites beside the clone (as .ci/run has
them), or from --suites DIR or $ROTA_OJS_SUITES. The report gives the strict level (the
reference runner's rule: the highest level whose tests and those of every level below
passed) and, with --excused FILE, the level reached when the tests that file lists count
as passed, naming each excuse. Exit status: with --min-level N, 0 when the level with
excused tests is at least N, else 1; without it, 0 when every test run passed or was
excused, 1 when one failed; 2 when the suites or the arguments are wrong.

Each assertion is judged as the reference runner's lib/assertions.go does (ojs_judge.py,
ojs_verdict.py say where this runner is stricter).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import tomllib
from datetime import datetime, timezone

import httpx
import ojs_report
from ojs_driver import Spread, run_cases
from ojs_suites import SuiteError, load, parse_levels, suites_dir


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tests/ojs/run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append",
                        help="a server's base URL, or several (comma-separated or repeated:"
                        " one cluster, requests spread round robin; default: $OJS_TEST_URL)")
    parser.add_argument("--token", default=os.environ.get("OJS_TEST_TOKEN"),
                        help="sent as Authorization: Bearer (default: $OJS_TEST_TOKEN)")
    parser.add_argument("--excused", help="a TOML file of tests excused, each with its reason"
                        " (tests/ojs/excused.toml)")
    parser.add_argument("--min-level", type=int, choices=range(-1, 5), metavar="N",
                        help="exit 1 unless the level with excused tests is at least N")
    parser.add_argument("--levels", default="0-4", help='"0-4", "0,1" or "2" (default 0-4)')
    parser.add_argument("--suites", help="the suites folder (default: beside the clone)")
    parser.add_argument("--test", help="run only this test id (L0-OPS-001)")
    parser.add_argument("--reset-url", help="a path POSTed to every server before each test"
                        " (a state reset)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def read_excused(path: str | None) -> dict[str, str]:
    """The excused tests, test id -> reason: ``[[excused]]`` tables with ``test_id`` and
    ``reason`` (both text, the reason not empty). ValueError says what is wrong."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"{path}: {error}") from None
    excused: dict[str, str] = {}
    for entry in data.get("excused", []):
        test_id, reason = entry.get("test_id"), entry.get("reason")
        if not (isinstance(test_id, str) and isinstance(reason, str) and reason.strip()):
            raise ValueError(f"{path}: each [[excused]] needs test_id and a reason, got {entry}")
        excused[test_id] = " ".join(reason.split())
    return excused


def urls_of(given: list[str] | None) -> list[str]:
    """The servers' URLs: each --url, split at commas, else $OJS_TEST_URL so split."""
    texts = given or [os.environ.get("OJS_TEST_URL") or ""]
    return [url.strip().rstrip("/") for text in texts for url in text.split(",") if url.strip()]


async def main(argv: list[str] | None = None,
               transport: httpx.AsyncBaseTransport | None = None) -> int:
    args = arguments(argv)
    urls = urls_of(args.url)
    if not urls:
        print("run.py: give the server's --url (or set OJS_TEST_URL)", file=sys.stderr)
        return 2
    try:
        levels = parse_levels(args.levels)
        cases = load(levels, suites_dir(args.suites))
        excused = read_excused(args.excused)
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
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    clients = [httpx.AsyncClient(base_url=url, timeout=args.timeout, transport=transport,
                                 headers=headers) for url in urls]
    try:
        results = await run_cases(clients[0] if len(clients) == 1 else Spread(clients), cases,
                                  reset=args.reset_url)
    finally:
        for client in clients:
            await client.aclose()
    report = ojs_report.build(results, ",".join(urls), levels, run_at,
                              int((time.perf_counter() - started) * 1000), excused)
    print(json.dumps(report, indent=2) if args.json else ojs_report.table(report, results))
    if args.min_level is not None:
        reached = report["conformant_level_excused"]
        if reached < args.min_level:
            print(f"run.py: level {reached} (with excused tests) is below --min-level"
                  f" {args.min_level}", file=sys.stderr)
            return 1
        return 0
    return 0 if report["conformant_excused"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
