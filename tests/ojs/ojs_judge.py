"""The OJS conformance suites' assertions, judged with no I/O: the matchers, the JSONPath
subset, the ``{{steps.<id>.response.body.<path>}}`` templates and a step's verdict.

The semantics are those of the reference runner (lib/assertions.go and runner/http in
../shared/ojs/conformance), written again here; where they differ it is said on the spot.
A matcher answers None when it holds, else a sentence saying why not."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

APPROX_TOLERANCE_PCT = 50  # "~N" matchers and timing_ms.approximate
MIN_TIMING_TOLERANCE_MS = 100

# re.ASCII and fullmatch: Go's \d is ASCII and its $ is the end of the text, not a newline
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.ASCII)
UUID_V7 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                     re.ASCII)
DATETIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})", re.ASCII)
NUMBER_RANGE = re.compile(r"number:range\((-?\d+(?:\.\d+)?),\s*(-?\d+(?:\.\d+)?)\)", re.ASCII)
LENGTH_PAREN = re.compile(r"array:length\((\d+)\)", re.ASCII)
APPROX = re.compile(r"~(\d+(?:\.\d+)?)", re.ASCII)
INTEGER = re.compile(r"[+-]?\d+", re.ASCII)
TEMPLATE = re.compile(r"\{\{steps\.([^.]+)\.response\.body(?:\.([^}]+))?\}\}")


class PathError(Exception):
    """A JSONPath that cannot be followed in this document (not a missing field: that is
    None, as in the reference)."""


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if is_number(value):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def go_text(value: Any) -> str:
    """A scalar as Go's %v prints it: contains:/not_contains: and filters compare these."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "<nil>"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return str(value)


def show(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if value is not None else "null"


# -- matchers ------------------------------------------------------------------------

def match(matcher: Any, actual: Any) -> str | None:
    """Judge ``actual`` (None: null or missing, as the reference conflates them) by one
    matcher of a suite file."""
    if matcher is None:
        return None if actual is None else f"expected null, got {show(actual)}"
    if isinstance(matcher, str):
        return _match_string(matcher, actual)
    if isinstance(matcher, bool):  # before numbers: a bool is an int in Python
        if not isinstance(actual, bool):
            return f"expected boolean {show(matcher)}, got {show(actual)}"
        return None if actual == matcher else f"expected {show(matcher)}, got {show(actual)}"
    if is_number(matcher):
        return _match_number(matcher, actual)
    if isinstance(matcher, list):
        if not isinstance(actual, list):
            return f"expected array, got {show(actual)}"
        if len(actual) != len(matcher):
            return f"expected array of length {len(matcher)}, got length {len(actual)}"
        for index, (want, got) in enumerate(zip(matcher, actual)):
            if (why := match(want, got)) is not None:
                return f"[{index}]: {why}"
        return None
    if isinstance(matcher, dict):
        return _match_object(matcher, actual)
    return f"unknown matcher {matcher!r}"


def _match_number(expected: float, actual: Any) -> str | None:
    if not is_number(actual):
        return f"expected number {expected}, got {show(actual)}"
    if float(expected).is_integer() and float(actual).is_integer():
        same = int(expected) == int(actual)
    else:
        same = abs(expected - actual) <= 1e-9
    return None if same else f"expected {go_text(expected)}, got {go_text(actual)}"


def _array(actual: Any, wanted: str) -> tuple[list[Any] | None, str | None]:
    if isinstance(actual, list):
        return actual, None
    return None, f"expected {wanted}, got {show(actual)}"


def _count(matcher: str, prefix: str) -> int | None:
    text = matcher[len(prefix):]
    return int(text) if INTEGER.fullmatch(text) else None


def _match_string(matcher: str, actual: Any) -> str | None:
    text = actual if isinstance(actual, str) else None
    if matcher == "any":
        return None
    if matcher == "absent":
        return None if actual is None else f"expected absent, got {show(actual)}"
    if matcher == "exists":
        return None if actual is not None else "expected a value, it is missing"
    if matcher in ("string:nonempty", "string:non_empty"):
        return None if text else f"expected a non-empty string, got {show(actual)}"
    for name, pattern in (("string:uuid", UUID), ("string:uuidv7", UUID_V7),
                          ("string:datetime", DATETIME)):
        if matcher == name:
            ok = text is not None and pattern.fullmatch(text)
            return None if ok else f"expected {name[7:]}, got {show(actual)}"
    if matcher in ("number:positive", "number:non_negative"):
        if not is_number(actual):
            return f"expected a number, got {show(actual)}"
        ok = actual > 0 if matcher == "number:positive" else actual >= 0
        return None if ok else f"expected {matcher[7:]}, got {go_text(actual)}"
    if matcher in ("array:nonempty", "array:empty"):
        items, why = _array(actual, "an array")
        if items is None:
            return why
        ok = bool(items) == (matcher == "array:nonempty")
        return None if ok else f"expected {matcher[6:]} array, got {len(items)} elements"
    for prefix, at_least in (("array:min_length:", True), ("array:min:", True),
                             ("array:length:", False)):
        if matcher.startswith(prefix):
            return _match_length(matcher, _count(matcher, prefix), at_least, actual)
    for prefix, wanted in (("contains:", True), ("not_contains:", False)):
        if matcher.startswith(prefix):
            items, why = _array(actual, f"an array for {prefix}")
            if items is None:
                return why
            target = matcher[len(prefix):]
            found = any(go_text(item) == target for item in items)
            return None if found == wanted else f"{target!r} {'not ' * wanted}found in array"
    if matcher.startswith("string:contains:"):
        needle = matcher[len("string:contains:"):]
        ok = text is not None and needle in text
        return None if ok else f"expected a string containing {needle!r}, got {show(actual)}"
    if found := NUMBER_RANGE.fullmatch(matcher):
        low, high = float(found[1]), float(found[2])
        if not is_number(actual) or not low <= actual <= high:
            return f"expected a number in [{found[1]}, {found[2]}], got {show(actual)}"
        return None
    if found := LENGTH_PAREN.fullmatch(matcher):
        return _match_length(matcher, int(found[1]), False, actual)
    if found := APPROX.fullmatch(matcher):
        expected = float(found[1])
        if not is_number(actual):
            return f"expected a number near {found[1]}, got {show(actual)}"
        tolerance = expected * APPROX_TOLERANCE_PCT / 100
        ok = abs(actual - expected) <= tolerance
        return None if ok else f"expected ~{found[1]} (±{APPROX_TOLERANCE_PCT}%), got {actual}"
    if matcher.startswith("string:pattern(") and matcher.endswith(")"):
        return _match_regex(matcher[len("string:pattern("):-1], actual)
    if text is None:
        return f"expected string {matcher!r}, got {show(actual)}"
    return None if text == matcher else f"expected {matcher!r}, got {text!r}"


def _match_length(matcher: str, count: int | None, at_least: bool, actual: Any) -> str | None:
    if count is None:
        return f"invalid matcher {matcher!r}"
    items, why = _array(actual, f"an array ({matcher})")
    if items is None:
        return why
    ok = len(items) >= count if at_least else len(items) == count
    return None if ok else f"expected {matcher}, got length {len(items)}"


def _match_regex(pattern: str, actual: Any) -> str | None:
    if not isinstance(actual, str):
        return f"expected a string matching {pattern!r}, got {show(actual)}"
    try:
        found = re.search(pattern, actual)  # Go's MatchString: anywhere, unless anchored
    except re.error as error:
        return f"invalid pattern {pattern!r}: {error}"
    return None if found else f"expected a string matching {pattern!r}, got {actual!r}"


def _match_object(matcher: dict[str, Any], actual: Any) -> str | None:
    if "$exists" in matcher:
        wanted = matcher["$exists"]
        if not isinstance(wanted, bool):
            return f"invalid $exists {show(wanted)}"
        if wanted != (actual is not None):
            return f"expected {'a value' if wanted else 'nothing'}, got {show(actual)}"
        kind = matcher.get("$type")
        if isinstance(kind, str) and json_type(actual) != kind:
            return f"expected type {kind}, got {json_type(actual)}"
        return None
    if "$match" in matcher:
        if not isinstance(matcher["$match"], str):
            return f"invalid $match {show(matcher['$match'])}"
        return _match_regex(matcher["$match"], actual)
    for operator in ("$in", "$or"):
        if operator in matcher:
            options = matcher[operator]
            if not isinstance(options, list):
                return f"invalid {operator} {show(options)}"
            if any(match(option, actual) is None for option in options):
                return None
            return f"{show(actual)} matches none of {operator} {show(options)}"
    if "$size" in matcher:
        return _match_size(matcher["$size"], actual)
    if "$empty" in matcher:
        return None  # the reference lets it pass whatever the value (a step's body: judge_body)
    if "range" in matcher:
        bounds = matcher["range"]
        if not isinstance(bounds, dict):
            return f"invalid range {show(bounds)}"
        if not is_number(actual):
            return f"expected a number for range, got {show(actual)}"
        low, high = bounds.get("min"), bounds.get("max")
        if is_number(low) and actual < low:
            return f"expected >= {low}, got {actual}"
        if is_number(high) and actual > high:
            return f"expected <= {high}, got {actual}"
        return None
    if not isinstance(actual, dict):
        return f"expected object, got {show(actual)}"
    for key, want in matcher.items():
        if want == "absent":  # here the key itself must be missing, not only null
            if key in actual:
                return f"field {key!r}: expected absent, got {show(actual[key])}"
            continue
        if key not in actual:
            return f"field {key!r}: missing"
        if (why := match(want, actual[key])) is not None:
            return f"field {key!r}: {why}"
    return None


def _match_size(size: Any, actual: Any) -> str | None:
    if not isinstance(actual, list):
        return f"expected an array for $size, got {show(actual)}"
    if isinstance(size, int) and not isinstance(size, bool):
        return None if len(actual) == size else f"expected {size} elements, got {len(actual)}"
    least = size.get("$gte") if isinstance(size, dict) else None
    if isinstance(least, int) and not isinstance(least, bool):
        return None if len(actual) >= least else f"expected >= {least} elements, got {len(actual)}"
    return f"unsupported $size {show(size)}"


# -- JSONPath (the reference's subset) -------------------------------------------------

def split_path(path: str) -> list[str]:
    """Split at the dots outside brackets: ``jobs[?(@.a=='x')].id`` is two parts."""
    parts: list[str] = []
    current, depth = "", 0
    for char in path:
        if char == "." and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += (char == "[") - (char == "]")
        current += char
    if current:
        parts.append(current)
    return parts


def resolve_path(path: str, data: Any) -> Any:
    """The value at ``path`` ($.a.b[0], [*] wildcards, [?(@.key=='value')] filters); None
    when a field is missing; PathError when the document has another shape."""
    if path.startswith("$."):
        path = path[2:]
    parts = split_path(path)
    current = data
    for index, part in enumerate(parts):
        if not part:
            continue
        if "[" not in part:
            if not isinstance(current, dict):
                raise PathError(f"expected an object at {part!r}, got {json_type(current)}")
            if part not in current:
                return None
            current = current[part]
            continue
        name, rest = part[:part.index("[")], part[part.index("["):]
        if name:
            if not isinstance(current, dict):
                raise PathError(f"expected an object at {name!r}, got {json_type(current)}")
            current = current.get(name)
        if rest.startswith("[?(@."):
            current, rest = _filter(part, rest, current)
            if rest.startswith(".") and current is not None:
                return resolve_path(rest[1:], current)
            continue
        while rest:
            close = rest.find("]")
            if not rest.startswith("[") or close < 0:
                raise PathError(f"malformed brackets in {part!r}")
            key, rest = rest[1:close], rest[close + 1:]
            if not isinstance(current, list):
                raise PathError(f"expected an array at {part!r}, got {json_type(current)}")
            if key == "*":
                remaining = ".".join(([rest] if rest else []) + parts[index + 1:])
                return _gather(current, remaining.removeprefix("."))
            if not INTEGER.fullmatch(key):
                raise PathError(f"invalid index {key!r} in {part!r}")
            if not 0 <= int(key) < len(current):
                raise PathError(f"index {key} out of bounds (length {len(current)})")
            current = current[int(key)]
    return current


def _filter(part: str, rest: str, current: Any) -> tuple[Any, str]:
    close = rest.find(")]")
    if close < 0:
        raise PathError(f"unclosed filter in {part!r}")
    condition, rest = rest[5:close], rest[close + 2:]
    if "==" not in condition:
        raise PathError(f"unsupported filter in {part!r}")
    key, wanted = condition.split("==", 1)
    wanted = wanted.strip("'\"")
    if not isinstance(current, list):
        raise PathError(f"expected an array to filter at {part!r}, got {json_type(current)}")
    for item in current:
        if isinstance(item, dict) and key in item and go_text(item[key]) == wanted:
            return item, rest
    return None, rest


def _gather(items: list[Any], remaining: str) -> list[Any]:
    """What a [*] collects: each element, or what the rest of the path finds in it
    (elements where it finds nothing are left out)."""
    if not remaining:
        return list(items)
    found = []
    for item in items:
        try:
            value = resolve_path(remaining, item)
        except PathError:
            continue
        if value is not None:
            found.append(value)
    return found


# -- templates ------------------------------------------------------------------------

@dataclass
class Reply:
    """What a step's request got back: ``headers`` by lower-case name, the first value of
    each; ``body`` the JSON it parsed to (None if empty or not JSON)."""

    status: int
    headers: Mapping[str, str]
    text: str
    body: Any
    elapsed_ms: int


def _lookup(found: re.Match[str], replies: Mapping[str, Reply]) -> Any:
    reply = replies.get(found[1])
    if reply is None or reply.body is None:
        return None
    if found[2] is None:  # {{steps.X.response.body}}: the whole body (equality uses it)
        return reply.body
    try:
        return resolve_path(found[2], reply.body)
    except PathError:
        return None


def as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or is_number(value):
        return go_text(value)
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def render(text: str, replies: Mapping[str, Reply]) -> str:
    """Each template replaced by the text of the value it names; one that names nothing
    (no such step yet, no such field) stays as written, as in the reference."""
    def one(found: re.Match[str]) -> str:
        value = _lookup(found, replies)
        return found[0] if value is None else as_text(value)
    return TEMPLATE.sub(one, text)


def substitute(tree: Any, replies: Mapping[str, Reply]) -> Any:
    """A JSON value with the templates in its strings (and keys) rendered. Strings stay
    strings: the reference substitutes into the JSON text, inside its quotes."""
    if isinstance(tree, str):
        return render(tree, replies)
    if isinstance(tree, list):
        return [substitute(item, replies) for item in tree]
    if isinstance(tree, dict):
        return {render(key, replies): substitute(value, replies) for key, value in tree.items()}
    return tree


def value_of(tree: Any, replies: Mapping[str, Reply]) -> Any:
    """Like ``substitute``, but a string that is one whole template becomes the typed
    value it names (an array, an object): for the cross-step checks, which compare values."""
    if isinstance(tree, str) and (found := TEMPLATE.fullmatch(tree)):
        value = _lookup(found, replies)
        return tree if value is None else value
    if isinstance(tree, list):
        return [value_of(item, replies) for item in tree]
    if isinstance(tree, dict):
        return {render(key, replies): value_of(value, replies) for key, value in tree.items()}
    return substitute(tree, replies)
