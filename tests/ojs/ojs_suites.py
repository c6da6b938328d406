"""The OJS conformance suites read from disk: the test files of the levels asked for, each
checked against what the runner knows how to do (a file using a step field or assertion
kind it does not know is refused, not half run)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ojs_verdict import KINDS

REPO = Path(__file__).resolve().parents[2]
# Beside the clone, as .ci/run finds it; ROTA_OJS_SUITES names another place (a worktree).
DEFAULT_SUITES = REPO.parent / "shared" / "ojs" / "conformance" / "suites"
LEVELS = (0, 1, 2, 3, 4)
LEVEL_NAMES = {0: "Core", 1: "Reliable", 2: "Scheduled", 3: "Orchestration", 4: "Advanced"}
HTTP_ACTIONS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}
ACTIONS = HTTP_ACTIONS | {"WAIT", "ASSERT"}
# A step's fields; "intent", "description" and "captures" (named values no template of
# the suites reads) say things to the reader, not to the runner.
STEP_FIELDS = {"id", "action", "intent", "description", "path", "headers", "body", "raw_body",
               "delay_ms", "duration_ms", "assertions", "parallel_with", "captures"}


class SuiteError(Exception):
    """A suite file the runner cannot run as written."""


@dataclass
class Case:
    test_id: str
    level: int
    category: str
    name: str
    spec_ref: str
    file: Path
    steps: list[dict[str, Any]]
    setup: list[dict[str, Any]] = field(default_factory=list)
    teardown: list[dict[str, Any]] = field(default_factory=list)

    def all_steps(self) -> list[dict[str, Any]]:
        return self.setup + self.steps + self.teardown


def suites_dir(explicit: str | Path | None = None) -> Path:
    """Where the suites are: ``explicit``, else $ROTA_OJS_SUITES, else beside the clone."""
    return Path(explicit or os.environ.get("ROTA_OJS_SUITES") or DEFAULT_SUITES)


def parse_levels(text: str) -> list[int]:
    """"0-4", "0,2,3" or "1" as the levels they name; ValueError for anything else."""
    levels: set[int] = set()
    for piece in text.split(","):
        low, _, high = piece.strip().partition("-")
        first, last = int(low), int(high or low)
        if not (0 <= first <= last <= 4):
            raise ValueError(f"levels are 0 to 4: {piece.strip()!r}")
        levels.update(range(first, last + 1))
    return sorted(levels)


def _level(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("ext", "extension"):
        return 99
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise SuiteError(f"level {value!r} is not a number")


def check_step(step: Any) -> list[str]:
    """What is wrong with a step for this runner (nothing: an empty list)."""
    if not isinstance(step, dict):
        return [f"a step is not an object: {step!r}"]
    sid = step.get("id")
    problems = [f"step {sid}: unknown field {name!r}" for name in sorted(set(step) - STEP_FIELDS)]
    if not isinstance(sid, str) or not sid:
        problems.append(f"a step has no id: {step!r}")
    action = step.get("action")
    if action not in ACTIONS:
        problems.append(f"step {sid}: unknown action {action!r}")
    elif action in HTTP_ACTIONS and not isinstance(step.get("path"), str):
        problems.append(f"step {sid}: {action} with no path")
    assertions = step.get("assertions") or {}
    if not isinstance(assertions, dict):
        problems.append(f"step {sid}: assertions are not an object")
    else:
        problems += [f"step {sid}: unknown assertion kind {kind!r}"
                     for kind in sorted(set(assertions) - set(KINDS))]
    return problems


def load_file(path: Path) -> Case:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SuiteError(f"{path}: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise SuiteError(f"{path}: no steps")
    setup = (data.get("setup") or {}).get("steps") or []
    teardown = (data.get("teardown") or {}).get("steps") or []
    problems = [problem for step in setup + data["steps"] + teardown
                for problem in check_step(step)]
    if problems:
        raise SuiteError(f"{path}: " + "; ".join(problems))
    try:
        level = _level(data.get("level", 0))
    except SuiteError as error:
        raise SuiteError(f"{path}: {error}") from None
    return Case(str(data.get("test_id") or path.stem), level, str(data.get("category", "")),
                str(data.get("name", path.stem)), str(data.get("spec_ref", "")), path,
                data["steps"], setup, teardown)


def load(levels: list[int] | tuple[int, ...], root: Path | None = None) -> list[Case]:
    """Every test of the given levels (the level-N-* folders), ordered by test id as the
    reference runs them (some ids name two files). A file whose own level is another one
    is an error."""
    root = root if root is not None else suites_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"no OJS conformance suites at {root}")
    cases = []
    for level in levels:
        folders = sorted(root.glob(f"level-{level}-*"))
        if not folders:
            raise SuiteError(f"{root}: no level-{level}-* folder")
        for path in sorted(p for folder in folders for p in folder.rglob("*.json")):
            case = load_file(path)
            if case.level != level:
                raise SuiteError(f"{path}: level {case.level} in a level-{level} folder")
            cases.append(case)
    return sorted(cases, key=lambda case: (case.test_id, case.file))
