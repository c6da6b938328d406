"""The rules behind an operator's actions, as verdicts: cancel, retry, bulk, retire, and
directives to workers.

Each function takes what the shell read (a job's row, whether the engine holds the job,
whether servers share the database) and says what to do next, with the answer or the
refusal to give. None does I/O or reads a clock: the shell (rota/server/steering.py) reads the
rows, asks, and carries the verdict out; the tests ask on plain dicts.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rota.base.errors import Conflict, DomainError, Invalid, NoSuchJob, NotFound
from rota.core.model import TERMINAL_STATES
from rota.base.protocol import STATE_SAID, rfc3339

Row = Mapping[str, Any]
MAX_BULK = 10_000  # jobs one bulk action may touch (its ``limit``)
SHOWN = 100  # ids and skipped jobs a bulk action's answer lists
BULK_OK = {"retry": frozenset({"discarded", "cancelled"}),
           "cancel": frozenset({"scheduled", "available", "retryable", "active"})}

# What the shell does next with a cancel:
Step = Literal[
    "answer",          # answer with the row as it stands; ``done``: the job is cancelled
    "refuse",          # raise ``error``
    "ask_owner",       # store the cancel for the server whose worker runs the job
    "cancel_waiting",  # cancel it from its row: it waits, held here as a key only
    "look_again",      # let queued writes settle (a barrier), then ask the engine again
    "cancel_again",    # the job was reserved before the cancel was written: cancel it there
]


@dataclass(frozen=True, slots=True)
class Verdict:
    step: Step
    done: bool = False  # with "answer": whether the job is cancelled already
    error: DomainError | None = None  # with "refuse"


def _answer(done: bool) -> Verdict:
    return Verdict("answer", done=done)


def _not_cancellable(job_id: str, state: str) -> Verdict:
    return Verdict("refuse", error=Conflict("not_cancellable", f"job {job_id} is {state}"))


def held_by(job_id: str, row: Row) -> str:
    """Why a pending job is not a job's own to cancel, and what to cancel instead."""
    if row.get("workflow_id"):
        flow = row["workflow_id"]
        return (f"job {job_id} is pending: a step of workflow {flow} not released yet;"
                f" cancel the workflow instead (DELETE /workflows/{flow},"
                f" rota workflows cancel {flow})")
    return (f"job {job_id} is pending: schedule {row.get('schedule')}'s tick, held until"
            " its previous run ends; pause or delete the schedule instead")


# -- cancel -------------------------------------------------------------------------
def cancel_unheld(job_id: str, row: Row | None, *, shared: bool, last_look: bool,
                  owner_declined: bool = False) -> Verdict:
    """A cancel of a job this server's engine does not hold live, by its row.
    ``owner_declined``: asked already, no other server held it (the row moved on)."""
    if row is None:
        return Verdict("refuse", error=NoSuchJob(job_id))
    state = row["state"]
    if state == "available":  # kept as a key only: its row decides
        return Verdict("cancel_waiting")
    if state == "pending":  # held by its workflow or its schedule, which decide
        return Verdict("refuse", error=Conflict("not_cancellable", held_by(job_id, row)))
    if shared and state == "active" and not owner_declined:
        return Verdict("ask_owner")  # its worker may be another server's
    if state in TERMINAL_STATES or last_look:
        return _not_cancellable(job_id, state)
    # Held as a key while its row still says otherwise, or reserved from its key since
    # the engine looked: once the writes queued before now are committed and reported,
    # memory and row agree.
    return Verdict("look_again")


def cancel_moved_on(job_id: str, row: Row, *, shared: bool,
                    owner_declined: bool = False) -> Verdict:
    """A cancel the job's row refused: another server reserved or finished the job first
    (or the row was written directly). The cancel goes where the job runs now, as for any
    job another server's worker holds; a finished one is not cancellable."""
    state = row["state"]
    if shared and state == "active" and not owner_declined:
        return Verdict("ask_owner")
    if state == "cancelled":
        return _answer(True)
    if state in TERMINAL_STATES:
        return _not_cancellable(job_id, state)
    return _answer(False)


def cancel_written(row: Row, outcome: str, *, again: bool = False) -> Verdict:
    """The engine's cancel (``outcome``) is written; ``row`` is the job's row now.
    ``again``: the second cancel, of a job reserved before the first was written."""
    if outcome == "withdrawing" and not again:
        return _answer(True) if row["state"] == "cancelled" else Verdict("cancel_again")
    return _answer(outcome == "cancelled" and row["state"] == "cancelled")


def cancel_again(job_id: str, row: Row, outcome: str) -> DomainError | None:
    """Whether the engine's second cancel (``outcome``) of a job reserved meanwhile, to
    cancel it where it runs now, is refused: it is no longer live here."""
    return _not_cancellable(job_id, row["state"]).error if outcome == "not_live" else None


# -- retry --------------------------------------------------------------------------
def retry_busy(job_id: str) -> Conflict:
    """A second retry of a job whose retry is being written: until its row is, the second
    may have read the row as it was and must not put the job back twice."""
    return Conflict("not_retryable", f"job {job_id} is being retried already")


def may_retry(job_id: str, row: Row | None, *, live: bool) -> DomainError | None:
    """Whether a job may be put back, with a fresh attempt budget (None: yes)."""
    if row is None:
        return NoSuchJob(job_id)
    if row.get("workflow_id"):  # its workflow decides when it runs, and with what inputs
        flow = row["workflow_id"]
        return Conflict("not_retryable", f"job {job_id} is a step of workflow {flow}: retry"
                        f" the workflow instead (POST /workflows/{flow}/retry, rota workflows"
                        f" retry {flow}), which runs it again in its turn")
    if row["state"] not in ("discarded", "cancelled") or live:
        # A second retry of one job finds it waiting: said so, not as a bare state
        waiting = " already, waiting to run" if row["state"] in (
            "available", "scheduled", "retryable") else ""
        return Conflict("not_retryable", f"job {job_id} is {row['state']}{waiting}; only"
                        " discarded or cancelled jobs can be retried")
    return None


def retry_moved_on(job_id: str) -> Conflict:
    """The row moved on since it was read (another server retried it first)."""
    return Conflict("not_retryable", f"job {job_id} changed while it was being retried;"
                    " read it again")


# -- bulk actions -------------------------------------------------------------------
def bulk_refusal(action: str, *, ids: bool, flt: bool, limit: int) -> Invalid | None:
    """Why a bulk action's request is refused as it stands (None: it is not)."""
    if action not in BULK_OK:
        return Invalid("invalid_request", f"unknown bulk action {action!r}")
    if ids == flt:
        return Invalid("invalid_request", "give either ids or filter")
    if not 1 <= limit <= MAX_BULK:
        return Invalid("invalid_request", f"limit must be between 1 and {MAX_BULK}")
    return None


def bulk_ids(ids: list[str], limit: int) -> tuple[list[str], bool, int]:
    """The ids a bulk action by id looks at: (chosen, truncated, matched)."""
    unique = list(dict.fromkeys(ids))
    return unique[:limit], len(unique) > limit, len(unique)


def bulk_sort(action: str, found: Iterable[tuple[str, str | None]]
              ) -> tuple[list[str], list[dict[str, str]]]:
    """(the jobs the action applies to, the skipped ones with why), from (id, state) pairs
    (state None: no such job)."""
    eligible: list[str] = []
    skipped: list[dict[str, str]] = []
    for job_id, state in found:
        if state in BULK_OK[action]:
            eligible.append(job_id)
        else:
            skipped.append({"id": job_id, "reason": "no such job" if state is None
                            else f"job is {state}"})
    return eligible, skipped


def bulk_answer(action: str, *, dry_run: bool, matched: int, touched: list[str],
                skipped: list[dict[str, str]], truncated: bool) -> dict[str, Any]:
    return {"action": action, "dry_run": dry_run, "matched": matched,
            "touched": len(touched), "ids": touched[:SHOWN], "skipped": skipped[:SHOWN],
            "truncated": truncated}


# -- specs --------------------------------------------------------------------------
def duplicate_specs(names: list[str]) -> Invalid | None:
    """A push that names a spec twice is refused whole."""
    if len(set(names)) != len(names):
        return Invalid("duplicate_spec", "a spec name appears twice in the push")
    return None


# -- retiring a spec ------------------------------------------------------------------
def no_status_quo(name: str) -> NotFound:
    """A spec that cannot be retired: no status quo names it."""
    return NotFound("not_found", f"spec {name!r} has no status quo")


def retire_answer(name: str, retired: tuple[str, float, bool], *, jobs: dict[str, int],
                  cancelled: int, matching: list[str]) -> dict[str, Any]:
    """What ``POST /specs/{name}/retire`` answers; ``retired``: the store's (checksum,
    retired at, retired already)."""
    checksum, at, already = retired
    return {"name": name, "checksum": checksum, "retired_at": rfc3339(at),
            "already_retired": already, "jobs": jobs, "cancelled": cancelled,
            "matching_workers": matching}


# -- directives to workers ------------------------------------------------------------
def directive_target(*, worker_id: str | None = None, label: str | None = None) -> str:
    """How a directive names its workers to the other servers on the database: by id,
    by label, or (neither) all."""
    if worker_id is not None:
        return f"id={urllib.parse.quote(worker_id)}"
    if label is not None:
        return f"label={urllib.parse.quote(label)}"
    return "all"


def parse_target(target: str) -> tuple[str, str]:
    """``directive_target``'s words back: (kind, name), kind "id", "label" or "all"."""
    kind, _, name = target.partition("=")
    return kind, urllib.parse.unquote(name)


def directive_refusal(worker_id: str, state: str, current: str | None, directed: bool
                      ) -> DomainError | None:
    """Why a directive to one connected worker (in ``current`` state, None: not connected
    here) is refused, once the registry said whether it was ``directed``: a worker never
    goes back from terminate, but asking for the state it is in is no error."""
    if current is None:
        return NotFound("not_found", f"no connected worker {worker_id}")
    if not directed and current != state:
        return Conflict("invalid_transition", f"worker {worker_id} is"
                        f" {STATE_SAID.get(current, current)}; it cannot go back to {state}")
    return None
