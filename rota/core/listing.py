"""Which jobs an operator asked for: the filter of ``GET /jobs`` and the bulk actions,
and the opaque cursor that pages through them. Pure: no I/O, no clock.

A listing is newest first by enqueue order (the row id). Ids are not a usable order: a
producer may name its jobs ``order-17``. The cursor is the row id of the last job of a
page, so a page never repeats or skips a job that was there when the first page was read,
whatever is enqueued meanwhile.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from rota.base.errors import RequestError
from rota.core.model import JOB_STATES

FIELDS = ("state", "spec", "queue", "worker", "schedule", "q")
# Names as the wire takes them (rota/base/protocol.py NAME_PATTERN, JOB_REF_PATTERN); q is
# free text, bounded so that it cannot make a LIKE pattern of any size.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
MAX_Q = 200
_CURSOR = re.compile(r"c[0-9]{1,19}")


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Jobs that match every field given (None or empty: any)."""

    states: tuple[str, ...] = ()
    spec: str | None = None
    queue: str | None = None
    worker: str | None = None
    q: str | None = None  # an id prefix, or text found in the job's errors
    schedule: str | None = None  # the cron schedule that made the jobs


def _invalid(message: str) -> RequestError:
    return RequestError(400, "invalid_filter", message)


def _values(params: Mapping[str, str | list[str]], key: str) -> list[str]:
    raw = params.get(key)
    if raw is None:
        return []
    return [raw] if isinstance(raw, str) else list(raw)


def _one(params: Mapping[str, str | list[str]], key: str) -> str | None:
    values = _values(params, key)
    if len(values) > 1:
        raise _invalid(f"{key} may be given once")
    if not values or values[0] == "":
        return None
    return values[0]


def parse_filter(params: Mapping[str, str | list[str]]) -> JobFilter:
    """A filter from query parameters or a JSON body's ``filter``: ``state`` repeated or
    comma-separated; every other field once. Raises RequestError (400 invalid_filter)."""
    states: list[str] = []
    for value in _values(params, "state"):
        for state in value.split(","):
            state = state.strip()
            if state not in JOB_STATES:
                raise _invalid(f"unknown state {state[:40]!r}: one of {', '.join(JOB_STATES)}")
            if state not in states:
                states.append(state)
    names = {}
    for key in ("spec", "queue", "worker", "schedule"):
        value = _one(params, key)
        if value is not None and not NAME.fullmatch(value):
            raise _invalid(f"{key} is not a name (letters, digits and _.:- up to 128)")
        names[key] = value
    q = _one(params, "q")
    if q is not None:
        q = q.strip()
        if len(q) > MAX_Q or any(ord(c) < 32 or ord(c) == 127 for c in q):
            raise _invalid(f"q must be printable text of at most {MAX_Q} characters")
    return JobFilter(tuple(states), names["spec"], names["queue"], names["worker"], q or None,
                     names["schedule"])


def filter_params(flt: JobFilter) -> dict[str, str | list[str]]:
    """The filter as query parameters again (what a UI link or the CLI sends)."""
    params: dict[str, str | list[str]] = {}
    if flt.states:
        params["state"] = list(flt.states)
    for key, value in (("spec", flt.spec), ("queue", flt.queue), ("worker", flt.worker),
                       ("schedule", flt.schedule), ("q", flt.q)):
        if value is not None:
            params[key] = value
    return params


def did_you_mean(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` is most likely a slip for: the same but for case, one close
    by spelling, or one that holds it or that it holds (``resize`` for ``resize_image``:
    too short a match for spelling alone). None if none is."""
    by_lower = {k.lower(): k for k in known}
    typed = name.lower()
    if typed in by_lower:
        return by_lower[typed]
    close = difflib.get_close_matches(typed, list(by_lower), n=1, cutoff=0.7)
    if close:
        return by_lower[close[0]]
    parts = [k for k in by_lower if min(len(k), len(typed)) >= 3 and (typed in k or k in typed)]
    return by_lower[min(parts, key=lambda k: (abs(len(k) - len(typed)), k))] if parts else None


def _edits(a: str, b: str) -> int:
    """How many letters put in, taken out, changed or swapped with a neighbour make
    ``a`` into ``b`` (optimal string alignment distance)."""
    before: list[int] | None = None
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        new = [i] + [0] * len(b)
        for j, y in enumerate(b, 1):
            new[j] = min(row[j] + 1, new[j - 1] + 1, row[j - 1] + (x != y))
            if before is not None and i > 1 and j > 1 and x == b[j - 2] and a[i - 2] == y:
                new[j] = min(new[j], before[j - 2] + 1)
        before, row = row, new
    return row[-1]


def slip_for(name: str, known: Iterable[str]) -> str | None:
    """The known name a new ``name`` is a slip of the keyboard for: the same but for
    case, or at most one edit away (two for names of six letters or more, none under
    four). Names that differ only in their digits are a series (``shard1``, ``shard2``),
    not a slip; nor is a name that holds another (``emails_bulk`` beside ``emails``)."""
    typed = name.lower()
    letters = typed.translate(NO_DIGITS)
    best: tuple[int, str] | None = None
    for other in known:  # cheapest tests first: an enqueue may ask this of many names
        longest = max(len(other), len(typed))
        allowed = 0 if longest < 4 else 1 if longest < 6 else 2
        if abs(len(other) - len(typed)) > allowed:
            continue
        lower = other.lower()
        if lower != typed and lower.translate(NO_DIGITS) == letters:
            continue
        if (n := _edits(typed, lower)) <= allowed:
            best = min(best or (n, other), (n, other))
    return None if best is None else best[1]


NO_DIGITS = str.maketrans("", "", "0123456789")
# Past this many known queues an enqueue's queue is not checked for a slip: the check
# walks them all (about 0.15 ms at 200, on the event loop), and so many queues are
# made on the fly, where a new name is the rule.
SLIP_CHECK_MOST = 200


def new_queue_problem(name: str, known: Collection[str], *, resuming: bool = False
                      ) -> str | None:
    """Why a queue name that would make something new (a pause, a job's queue) is
    refused, or None to take it. A name nothing knows is a new queue, legitimately,
    unless it is spelt like a known one: then it is a slip, and the real queue would
    go on running, or the job wait forever (issue 22). Only spelling counts here, not a
    name that holds another (``emails_bulk`` beside ``emails`` is a fair new queue).
    ``resuming``: the name would resume a queue, and one nothing knows was never
    paused, whatever it is close to. ``known``: every queue known, paused ones too."""
    if name in known:
        return None
    if resuming:
        guess = did_you_mean(name, known)
        return (f"queue {name!r} was not paused: no queue of that name is known"
                + (f"; did you mean {guess}?" if guess else "."))
    if len(known) > SLIP_CHECK_MOST:
        return None  # queues by the thousand (one per tenant): a new one is the rule
    guess = slip_for(name, known)
    if guess is None:
        return None
    return (f"queue {name!r} is unknown; did you mean {guess}? (a queue new to this server"
            " is taken when it is not this close to a known one)")


def listed(names: Iterable[str], most: int = 20) -> str:
    """Names for a message: sorted, the first ``most`` of them, and how many more."""
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most
                                      else "")


# What an unknown name in a filter is not, said in its refusal.
UNKNOWN = {"spec": "never pushed, so no job has it",
           "queue": "no job is in it, and no spec, worker, pause or retention rule names it"}


def unknown_name(flt: JobFilter, specs: Collection[str], queues: Collection[str]
                 ) -> RequestError | None:
    """The refusal of a filter that names a spec or a queue nothing knows (422
    ``unknown_spec``, ``unknown_queue``), with the likely name; None if it names none.
    A misspelt name would match nothing, and a bulk action that touched nothing would
    look done (issue 22). A known name that matches no job is no error: 0 is then true.
    ``specs`` and ``queues``: every name known, the shell's to find."""
    for kind, name, known in (("spec", flt.spec, specs), ("queue", flt.queue, queues)):
        if name is None or name in known:
            continue
        guess = did_you_mean(name, known)
        return RequestError(422, f"unknown_{kind}", f"{kind} {name!r} is unknown ({UNKNOWN[kind]})"
                            + (f"; did you mean {guess}?" if guess else ".")
                            + (f" Known {kind}s: {listed(known)}." if known else ""))
    return None


def encode_cursor(rowid: int) -> str:
    """The cursor after the job with row id ``rowid``: opaque to clients."""
    return base64.urlsafe_b64encode(f"c{rowid}".encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> int:
    """The row id a cursor stands for; RequestError (400 invalid_cursor) if it is not one
    this server made."""
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        text = ""
    if len(cursor) > 40 or not _CURSOR.fullmatch(text) or int(text[1:]) > 2**63 - 1:
        raise RequestError(400, "invalid_cursor", "cursor is not one this server gave")
    return int(text[1:])


def merge_newest(pages: Sequence[Sequence[tuple[int, dict]]], limit: int
                 ) -> list[tuple[int, dict]]:
    """The ``limit`` newest of several pages, each already newest first, with no job twice
    (one query per state, merged: see Store.list_jobs)."""
    seen: set[int] = set()
    merged = []
    for rowid, row in sorted((item for page in pages for item in page), key=lambda i: -i[0]):
        if rowid not in seen:
            seen.add(rowid)
            merged.append((rowid, row))
    return merged[:limit]
