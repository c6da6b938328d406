"""The conformance report of a run, as the reference runner makes it: the results by
level, and the level reached (the highest whose tests, and those of every level below it,
all passed). Beside that strict level, the level reached when the excused tests
(tests/ojs/excused.toml: a test no implementation can pass, and why) count as passed."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ojs_driver import CaseResult
from ojs_suites import LEVEL_NAMES, LEVELS

SUITE_VERSION = "1.0"


def _climb(results: list[CaseResult], passed: Callable[[CaseResult], bool]) -> int:
    """The highest level whose tests, and those of every level below it, all ``passed``
    (-1: none). A level that was not run ends the climb, where the reference skips it (so
    that a run of level 2 alone says nothing about level 2's conformance)."""
    reached = -1
    for number in LEVELS:
        mine = [result for result in results if result.level == number]
        if not mine or not all(passed(result) for result in mine):
            break
        reached = number
    return reached


def build(results: list[CaseResult], target: str, levels: list[int], run_at: str,
          duration_ms: int, excused: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The report's v1.0 fields (results, conformant, conformant_level, failures), and
    ours: ``excused`` (the excused tests that did not pass, each with its reason),
    ``conformant_level_excused`` and ``conformant_excused`` (as if they had passed)."""
    excused = excused or {}
    by_level: dict[int, dict[str, Any]] = {}
    totals = {"total": len(results), "passed": 0, "failed": 0, "skipped": 0, "errored": 0}
    word = {"pass": "passed", "fail": "failed", "skip": "skipped", "error": "errored"}
    for result in results:
        level = by_level.setdefault(result.level, {"total": 0, "passed": 0, "failed": 0,
                                                   "skipped": 0, "errored": 0})
        level["total"] += 1
        level[word[result.status]] += 1
        totals[word[result.status]] += 1
    for number in sorted(by_level):
        summary = by_level[number]
        summary["all_pass"] = summary["failed"] == 0 and summary["errored"] == 0

    def strict(result: CaseResult) -> bool:
        return result.status not in ("fail", "error")

    def lenient(result: CaseResult) -> bool:
        return strict(result) or result.test_id in excused

    return {
        "test_suite_version": SUITE_VERSION,
        "target": target,
        "run_at": run_at,
        "duration_ms": duration_ms,
        "requested_level": levels[0] if len(levels) == 1 else -1,
        "requested_levels": levels,
        "results": {**totals, "by_level": {str(n): by_level[n] for n in sorted(by_level)}},
        "conformant": bool(results) and totals["failed"] == 0 and totals["errored"] == 0,
        "conformant_level": _climb(results, strict),
        "failures": [dataclasses.asdict(r) for r in results if r.status in ("fail", "error")],
        "excused": [{"test_id": r.test_id, "file": r.file, "status": r.status,
                     "reason": excused[r.test_id]}
                    for r in results if not strict(r) and r.test_id in excused],
        "conformant_excused": bool(results) and all(lenient(r) for r in results),
        "conformant_level_excused": _climb(results, lenient),
    }


def table(report: dict[str, Any], results: list[CaseResult]) -> str:
    """The report for a reader: a line per test (with its failures), then the levels."""
    lines = [f"OJS conformance: {report['target']} (suite v{report['test_suite_version']},"
             f" {report['run_at']}, {report['duration_ms']} ms)", ""]
    for result in results:
        name = result.name if len(result.name) <= 40 else result.name[:37] + "..."
        excuse = " (excused)" if any(e["file"] == result.file for e in report["excused"]) else ""
        lines.append(f"  {result.test_id:<14} {name:<40} {result.status.upper():<5}"
                     f" {result.duration_ms} ms{excuse}")
        for failure in result.failures:
            lines.append(f"    -> [{failure.step}] {failure.message}")
    lines += ["", f"  {'LEVEL':<6} {'NAME':<14} {'TOTAL':>5} {'PASS':>5} {'FAIL':>5}"
              f" {'ERROR':>5}  STATUS"]
    by_level = report["results"]["by_level"]
    for number in report["requested_levels"]:
        summary = by_level.get(str(number))
        if summary is None:
            lines.append(f"  {number:<6} {LEVEL_NAMES[number]:<14} no tests run")
            continue
        lines.append(f"  {number:<6} {LEVEL_NAMES[number]:<14} {summary['total']:>5}"
                     f" {summary['passed']:>5} {summary['failed']:>5} {summary['errored']:>5}"
                     f"  {'PASS' if summary['all_pass'] else 'FAIL'}")
    totals = report["results"]
    lines += ["", f"  Total: {totals['total']} | Passed: {totals['passed']} | Failed:"
              f" {totals['failed']} | Errored: {totals['errored']}"]
    lines.append("  Result: " + _verdict(report["conformant_level"], report["conformant"]))
    if report["excused"]:
        lines.append("  With excused tests: " + _verdict(report["conformant_level_excused"],
                                                         report["conformant_excused"]))
        for excuse in report["excused"]:
            lines.append(f"    excused {excuse['test_id']} ({excuse['status']}):"
                         f" {excuse['reason']}")
    return "\n".join(lines)


def _verdict(level: int, conformant: bool) -> str:
    if level < 0:
        return "NOT CONFORMANT"
    kind = "CONFORMANT" if conformant else "PARTIAL CONFORMANCE"
    return f"{kind} (Level {level} - {LEVEL_NAMES[level]})"
