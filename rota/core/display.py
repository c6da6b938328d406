"""How the dashboard writes numbers, times and JSON for people: pure functions, used as
Jinja filters (rota/server/dashboard.py), so the templates stay free of arithmetic."""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import msgspec

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def size(value: int | None) -> str:
    """Bytes as a short figure: 1536 -> "1.5 KiB"."""
    if value is None:
        return "–"
    amount = float(value)
    for unit in _UNITS:
        if amount < 1024 or unit == _UNITS[-1]:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def duration(seconds: float | None) -> str:
    """Seconds as the two largest units: 0.25 -> "250 ms", 3725 -> "1 h 2 min"."""
    if seconds is None:
        return "–"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    for unit, span, smaller, small_span in (("d", 86400, "h", 3600), ("h", 3600, "min", 60),
                                            ("min", 60, "s", 1)):
        if whole >= span:
            rest = (whole % span) // small_span
            return f"{whole // span} {unit}" + (f" {rest} {smaller}" if rest else "")
    raise AssertionError("unreachable")


def since(moment: str | None, now: float) -> str:
    """A moment that was (an enqueue, a start, a finish) as "12 s ago": never "in …",
    which the wall clock stepped back after the moment was stored would make it say;
    such a moment reads "just now"."""
    if not moment:
        return "–"
    delta = now - datetime.fromisoformat(moment).timestamp()
    return f"{duration(delta)} ago" if delta >= 0 else "just now"


def ago(moment: str | None, now: float) -> str:
    """An RFC 3339 moment as "12 s ago" (or "in 5 s") against the Unix time ``now``."""
    if not moment:
        return "–"
    delta = now - datetime.fromisoformat(moment).timestamp()
    return f"{duration(delta)} ago" if delta >= 0 else f"in {duration(-delta)}"


def pretty(value: Any) -> str:
    """Any JSON value (stored JSON kept raw included), indented for a <pre>."""
    if isinstance(value, msgspec.Raw):
        value = msgspec.json.decode(value)
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False)


def short(text: str | None, keep: int = 12) -> str:
    """A long id or checksum cut for a table cell (the full one goes in a title). A
    UUID keeps both ends: UUIDv7s made in the same second share their first digits."""
    if text is None:
        return "–"
    if len(text) == 36 and text.count("-") == 4:
        return f"{text[:8]}…{text[-6:]}"
    return text if len(text) <= keep else text[:keep] + "…"


# Characters that change the direction of the text around them: the marks, embeddings,
# overrides and isolates of Unicode's bidirectional algorithm. A worker or a producer could
# use them to show "exe.png" for "gnp.exe", or to reverse what a page says after them.
_BIDI = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def visible(value: Any) -> Any:
    """Every value a page shows (the templates' ``finalize``): text with its direction
    controls written as escapes (U+202E as ``\u202e``, as the CLI prints it), which then
    reorder nothing; markup the page made itself, and anything not text, as it is."""
    if type(value) is not str or not _BIDI.search(value):  # Markup is a str subclass: kept
        return value
    return _BIDI.sub(lambda match: f"\\u{ord(match.group()):04x}", value)


def attempts(attempt: int, used: int, max_attempts: int | None, unstarted: int = 0) -> str:
    """A job's attempts: those its budget counts (since enqueue or the last manual retry,
    less any given back unstarted), of how many, and all of them when the two differ:
    "3 of 3 (9 in all)" after two retries, where "9 of 3" would look like a broken limit;
    "1 of 3 (2 in all, 1 given back unstarted)" after a take-back from a prefetch line."""
    counted = f"{used} of {max_attempts}" if max_attempts else str(used)
    if used == attempt:
        return counted
    return f"{counted} ({attempt} in all{f', {unstarted} given back unstarted' if unstarted else ''})"


def ended_heading(fails: int, cancels: int, unstarted: int) -> str:
    """The heading of a job's ended attempts, each kind counted apart: a cancel and a job
    given back unstarted from a prefetch line (``released``) are no failures."""
    alone = {"failed": "Attempts that failed", "were cancelled": "Attempts cancelled",
             "were given back unstarted": "Attempts given back unstarted"}
    said = [(kind, f" ({n}{', not counted' if kind.endswith('unstarted') else ''})")
            for kind, n in (("failed", fails), ("were cancelled", cancels),
                            ("were given back unstarted", unstarted))
            if n or (kind == "failed" and not (cancels or unstarted))]
    if len(said) == 1:
        return alone[said[0][0]] + said[0][1]
    parts = [kind + count for kind, count in said]
    return "Attempts that " + ", ".join(parts[:-1]) + " or " + parts[-1]


def failures(fails: int, failed: int, retried: bool) -> str:
    """A job's failures: those its max_fails counts (since enqueue or the last manual
    retry, the job's own errors only), and all the attempts that ended in an error when the
    two differ, so "2 failed" beside "Attempts that failed (6)" reads as no contradiction."""
    if fails == failed:
        return f"{fails} failed"
    if retried:
        return f"{fails} failed since the last retry, {failed} in all"
    return f"{fails} failed, {failed} in all with timeouts and worker deaths"


def count(value: int) -> str:
    """An integer with thin separators: 1234567 -> "1,234,567"."""
    return f"{value:,}"


def limit_source(entry: dict[str, Any]) -> str:
    """Where a limit in force comes from (an entry of GET /limits): "spec file", or
    "runtime, set <when> by <token name>"; for `rota limits` and the Limits page."""
    if entry["source"] == "spec_file":
        return "spec file"
    by = f" by {entry['updated_by']}" if entry.get("updated_by") else ""
    return f"runtime, set {entry['updated_at']}{by}"


# Jobs a concurrency key's limit or their labels hold, by wait kind (``held`` of GET /queues)
HELD_SAID = {"concurrency_limit": "held by their key's concurrency limit",
             "rate_limit": "held by their key's rate limit",
             "no_label": "need labels no connected worker has"}


def missing_said(waiting: dict[str, Any]) -> str:
    """The labels a GET /queues ``waiting`` entry names as missing: "gpu", "eu, gpu and 2
    more" ("" from a server that does not name them)."""
    names = ", ".join(waiting.get("missing_labels") or ())
    more = waiting.get("missing_labels_more") or 0
    return f"{names} and {more} more" if names and more else names


def no_labels(waiting: dict[str, Any]) -> str:
    """Why the jobs labels hold wait (BLOCKED in `rota watch`, the Overview): "no
    connected worker has label gpu", as a job's own reason says."""
    names = missing_said(waiting)
    if not names:
        return "no connected worker has the labels they need"
    plural = "s" if "," in names or " and " in names else ""
    return f"no connected worker has label{plural} {names}"


def held_parts(waiting: dict[str, Any]) -> list[str]:
    """The jobs of a GET /queues ``waiting`` entry that their key's limit or labels
    hold, in words: ["9 held by their key's concurrency limit", "3 need labels no
    connected worker has (gpu)"]."""
    parts = []
    for kind, n in (waiting.get("held") or {}).items():
        said = HELD_SAID.get(kind, kind)
        if kind == "no_label" and missing_said(waiting):
            said += f" ({missing_said(waiting)})"
        parts.append(f"{count(n)} {said}")
    return parts


def limit_use(use: dict[str, Any]) -> list[str]:
    """A limit's use (a LimitUse as JSON) as people read it, in parts: "3/3 running"
    (or "3 running" with no concurrency limit), "2 started of 100/min", "next start in
    0.4 s"; for `rota watch` and the dashboard's Limits page."""
    running, most = use.get("running", 0), use.get("concurrency")
    parts = [f"{running}/{most} running" if most is not None else f"{running} running"]
    if use.get("rate"):
        parts.append(f"{use.get('starts', 0)} started of {use['rate']}")
        if use.get("next_start"):
            parts.append(f"next start in {use['next_start']:.1f} s")
    return parts
