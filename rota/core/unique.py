"""Unique jobs, decided: a job's unique key, which states of the job holding a key keep
another out, and what an enqueue whose key is held gets. Pure: the store runs these in
its enqueue transaction (rota/store/uniques.py), so the database decides a race."""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Any, Literal, NamedTuple

import msgspec

from rota.base.errors import Invalid, UniqueConflict
from rota.base.unique import UniqueOptions, options_problem

WAITING = frozenset({"scheduled", "available", "retryable"})
# The states of the holder that keep a key, per ``states``: "waiting"; "active" also
# while it runs (the default); "finished" also once it ended (within ``period``).
# A held step of a workflow or a held cron tick (pending) waits too, and keeps its key;
# but only what truly waits may be replaced (its workflow or schedule holds the rest).
HELD = WAITING | {"pending"}
COVERED: dict[str, frozenset[str]] = {
    "waiting": HELD,
    "active": HELD | {"active"},
    "finished": HELD | {"active", "completed", "discarded", "cancelled"},
}
Verdict = Literal["take", "existing", "reject", "replace", "running", "held"]


class UniqueClaim(NamedTuple):
    """What an enqueue claims: its key, and what the new job will keep it for."""

    key: str  # sha256, lowercase hex
    covers: str  # "waiting" | "active" | "finished"
    until: float | None  # wall: the key is free after this whatever the state (period)
    on_conflict: str  # "existing" | "reject" | "replace"


def claim(options: UniqueOptions, *, spec: str, queue: str, args: dict[str, Any],
          now: float, token: str | None = None) -> UniqueClaim:
    """The claim of a job enqueued with ``options``; Invalid (``invalid_unique``) for
    options that contradict themselves or name an argument the job does not have.
    ``token``: a producer token's id, whose keys are its own as its ids are."""
    problem = options_problem(options)
    if problem is not None:
        raise Invalid("invalid_unique", problem)
    missing = [name for name in options.args_keys or [] if name not in args]
    if missing:
        raise Invalid("invalid_unique", f"unique.args_keys names {', '.join(map(repr, missing))},"
                      f" which the job's args do not have (it has: {', '.join(sorted(args)) or 'none'})")
    until = None if options.period is None else now + options.period
    return UniqueClaim(unique_key(options, spec=spec, queue=queue, args=args, token=token),
                       options.states, until, options.on_conflict)


def unique_key(options: UniqueOptions, *, spec: str, queue: str, args: dict[str, Any],
               token: str | None = None) -> str:
    """sha256 of the canonical JSON (keys sorted at every level, strings NFC, no
    whitespace) of the dimensions chosen: the spec always, and the explicit key or the
    queue and the args (all, or the ``args_keys`` named) as ``keys`` says."""
    material: dict[str, Any] = {"spec": spec}
    if options.key is not None:
        material["key"] = options.key
    keys = options.keys or []
    if "queue" in keys:
        material["queue"] = queue
    if "args" in keys:
        picked = options.args_keys
        material["args"] = args if picked is None else {name: args[name] for name in picked}
    if token is not None:
        material["token"] = token
    canonical = msgspec.json.encode(_nfc(material), order="sorted")
    return hashlib.sha256(canonical).hexdigest()


def _nfc(value: Any) -> Any:
    """Every string in ``value`` (keys too) in Unicode's NFC form: one text, one key."""
    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, dict):
        return {_nfc(k): _nfc(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nfc(v) for v in value]
    return value


def holds(state: str | None, covers: str, until: float | None, now: float) -> bool:
    """Whether a holder in ``state`` (None: its row is gone) still keeps its key: a state
    its ``covers`` names, before ``until`` (its enqueue plus the period). A finished job
    covers only under "finished", and only within the period (options_problem: that
    needs one)."""
    if state is None or state not in COVERED.get(covers, COVERED["active"]):
        return False
    return until is None or now < until


def decide(new: UniqueClaim, holder_state: str | None, holder_covers: str,
           holder_until: float | None, now: float) -> Verdict:
    """What an enqueue claiming ``new.key`` gets, the key held by a job in
    ``holder_state`` (kept for ``holder_covers`` until ``holder_until``): "take" the key
    (the holder no longer covers), the "existing" job, "reject" (409), "replace" a
    waiting holder (cancel it, take the key), or "running": a replace refused, the
    holder runs (409)."""
    if not holds(holder_state, holder_covers, holder_until, now):
        return "take"
    if new.on_conflict == "existing":
        return "existing"
    if new.on_conflict == "reject":
        return "reject"
    return "replace" if holder_state in WAITING else "running"


def conflict_message(verdict: Verdict, job_id: str, state: str) -> str:
    """The 409's sentence, naming the job that holds the key."""
    if verdict == "running":
        return (f"job {job_id} holds this unique key and is {state}: on_conflict \"replace\""
                " replaces a waiting job only")
    if verdict == "held":
        return (f"job {job_id} holds this unique key and is a workflow's step or a cron"
                " schedule's tick: on_conflict \"replace\" leaves it to its workflow or"
                " schedule (cancel that instead)")
    return f"job {job_id} holds this unique key ({state}); on_conflict is \"reject\""



def conflict(verdict: Verdict, holder: dict[str, Any]) -> UniqueConflict:
    """The 409 of a key held by the job whose row is ``holder``."""
    return UniqueConflict(conflict_message(verdict, holder["id"], holder["state"]),
                          {"job_id": holder["id"], "state": holder["state"],
                           "unique_key": holder.get("unique_key")})
