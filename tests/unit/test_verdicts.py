"""The rules of an operator's actions (rota/core/verdicts.py), on plain rows: no store, no
server, no clock."""

from __future__ import annotations

import pytest

from rota.core import verdicts as v
from rota.base.errors import Conflict, Invalid, NotFound

pytestmark = pytest.mark.sqlite_only("pure functions: no store")


def row(state: str) -> dict[str, str]:
    return {"id": "j", "state": state}


# -- cancel ---------------------------------------------------------------------------
def test_a_cancel_of_a_job_not_held_goes_by_its_row() -> None:
    unheld = v.cancel_unheld
    assert isinstance(unheld("j", None, shared=False, last_look=False).error, NotFound)
    assert unheld("j", row("available"), shared=False, last_look=True).step == "cancel_waiting"
    assert unheld("j", row("active"), shared=True, last_look=False).step == "ask_owner"
    refused = unheld("j", row("completed"), shared=False, last_look=False)
    assert refused.step == "refuse" and isinstance(refused.error, Conflict)
    assert refused.error.message == "job j is completed"
    # Reserved here since the engine looked: once the writes settle, look once more.
    assert unheld("j", row("active"), shared=False, last_look=False).step == "look_again"
    assert unheld("j", row("active"), shared=False, last_look=True).step == "refuse"


def test_a_held_step_is_refused_at_once_naming_what_to_cancel_instead() -> None:
    """Issue 24: a workflow's step not released yet (pending) is its workflow's to cancel;
    a schedule's held tick, its schedule's."""
    step = {**row("pending"), "workflow_id": "wf-1"}
    refused = v.cancel_unheld("j", step, shared=False, last_look=False)
    assert refused.step == "refuse" and isinstance(refused.error, Conflict)
    assert "rota workflows cancel wf-1" in refused.error.message
    tick = {**row("pending"), "schedule": "nightly"}
    said = v.cancel_unheld("j", tick, shared=True, last_look=False).error
    assert said is not None and "schedule nightly" in said.message


def test_a_workflow_step_is_retried_through_its_workflow_only() -> None:
    """A step retried on its own would run out of its turn, without its inputs, and its
    workflow would not hear of its ending: its workflow's retry is the way."""
    refused = v.may_retry("j", {**row("discarded"), "workflow_id": "wf-1"}, live=False)
    assert isinstance(refused, Conflict) and refused.code == "not_retryable"
    assert "POST /workflows/wf-1/retry" in refused.message
    assert v.may_retry("j", row("discarded"), live=False) is None


def test_an_active_job_no_other_server_holds_is_judged_as_on_one_server() -> None:
    declined = v.cancel_unheld("j", row("active"), shared=True, last_look=False,
                               owner_declined=True)
    assert declined.step == "look_again"
    declined = v.cancel_unheld("j", row("active"), shared=True, last_look=True,
                               owner_declined=True)
    assert declined.step == "refuse"


def test_a_cancel_the_row_refused_follows_the_job() -> None:
    moved = v.cancel_moved_on
    assert moved("j", row("active"), shared=True).step == "ask_owner"
    assert moved("j", row("active"), shared=True, owner_declined=True) == v.Verdict("answer")
    assert moved("j", row("cancelled"), shared=False) == v.Verdict("answer", done=True)
    assert isinstance(moved("j", row("discarded"), shared=False).error, Conflict)
    assert moved("j", row("retryable"), shared=False) == v.Verdict("answer", done=False)


def test_a_written_cancel_is_done_only_once_its_row_says_cancelled() -> None:
    assert v.cancel_written(row("cancelled"), "cancelled").done
    assert not v.cancel_written(row("active"), "requested").done  # its worker stops it
    assert v.cancel_written(row("cancelled"), "withdrawing").done
    # Reserved before the withdrawal was written: cancel it where it runs now, once.
    assert v.cancel_written(row("active"), "withdrawing").step == "cancel_again"
    again = v.cancel_written(row("active"), "withdrawing", again=True)
    assert again == v.Verdict("answer", done=False)
    assert isinstance(v.cancel_again("j", row("completed"), "not_live"), Conflict)
    assert v.cancel_again("j", row("active"), "requested") is None


# -- retry ----------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["discarded", "cancelled"])
def test_a_finished_job_that_did_not_complete_may_be_retried(state: str) -> None:
    assert v.may_retry("j", row(state), live=False) is None
    assert isinstance(v.may_retry("j", row(state), live=True), Conflict)  # put back already


def test_a_retry_is_refused_for_other_states_and_for_no_row() -> None:
    assert isinstance(v.may_retry("j", None, live=False), NotFound)
    refusal = v.may_retry("j", row("completed"), live=False)
    assert refusal is not None and refusal.code == "not_retryable"
    assert "being retried" in v.retry_busy("j").message
    assert "read it again" in v.retry_moved_on("j").message


# -- bulk actions -----------------------------------------------------------------------
def test_a_bulk_request_names_one_action_one_selection_and_a_bounded_limit() -> None:
    assert v.bulk_refusal("retry", ids=True, flt=False, limit=10) is None
    for refusal in (v.bulk_refusal("delete", ids=True, flt=False, limit=10),
                    v.bulk_refusal("retry", ids=True, flt=True, limit=10),
                    v.bulk_refusal("retry", ids=False, flt=False, limit=10),
                    v.bulk_refusal("cancel", ids=True, flt=False, limit=0),
                    v.bulk_refusal("cancel", ids=True, flt=False, limit=v.MAX_BULK + 1)):
        assert isinstance(refusal, Invalid)


def test_bulk_ids_are_taken_once_each_up_to_the_limit() -> None:
    assert v.bulk_ids(["a", "b", "a", "c"], 2) == (["a", "b"], True, 3)
    assert v.bulk_ids(["a", "a"], 5) == (["a"], False, 1)


def test_a_bulk_action_applies_to_the_states_its_single_route_accepts() -> None:
    found = [("a", "discarded"), ("b", "active"), ("c", None), ("d", "cancelled")]
    assert v.bulk_sort("retry", found) == (["a", "d"], [
        {"id": "b", "reason": "job is active"}, {"id": "c", "reason": "no such job"}])
    eligible, skipped = v.bulk_sort("cancel", found)
    assert eligible == ["b"] and [s["id"] for s in skipped] == ["a", "c", "d"]


def test_a_bulk_answer_counts_everything_and_lists_a_bounded_few() -> None:
    touched = [f"j{n}" for n in range(v.SHOWN + 5)]
    answer = v.bulk_answer("cancel", dry_run=False, matched=200, touched=touched,
                           skipped=[{"id": "x", "reason": "job is completed"}] * 150,
                           truncated=True)
    assert answer["touched"] == v.SHOWN + 5 and len(answer["ids"]) == v.SHOWN
    assert len(answer["skipped"]) == v.SHOWN and answer["matched"] == 200


# -- specs ----------------------------------------------------------------------------
def test_a_push_naming_a_spec_twice_is_refused() -> None:
    assert isinstance(v.duplicate_specs(["a", "b", "a"]), Invalid)
    assert v.duplicate_specs(["a", "b"]) is None


def test_a_retired_spec_answers_with_when_and_what_became_of_its_jobs() -> None:
    answer = v.retire_answer("echo", ("sha256:x", 0.0, False), jobs={"available": 2},
                             cancelled=1, matching=["w1"])
    assert answer == {"name": "echo", "checksum": "sha256:x",
                      "retired_at": "1970-01-01T00:00:00.000Z", "already_retired": False,
                      "jobs": {"available": 2}, "cancelled": 1, "matching_workers": ["w1"]}
    assert v.no_status_quo("echo").code == "not_found"


# -- directives -------------------------------------------------------------------------
@pytest.mark.parametrize("given, kind, name", [
    ({"worker_id": "w 1/a"}, "id", "w 1/a"), ({"label": "gpu=a b"}, "label", "gpu=a b"),
    ({}, "all", "")])
def test_a_directive_target_survives_the_trip_between_servers(
        given: dict[str, str], kind: str, name: str) -> None:
    target = v.directive_target(**given)
    assert " " not in target  # a notice's words are split on spaces
    assert v.parse_target(target) == (kind, name)


def test_a_directive_to_one_worker_is_refused_only_going_back() -> None:
    assert isinstance(v.directive_refusal("w", "quiet", None, False), NotFound)
    assert v.directive_refusal("w", "quiet", "running", True) is None
    assert v.directive_refusal("w", "quiet", "quiet", False) is None  # there already
    refusal = v.directive_refusal("w", "running", "terminate", False)
    assert refusal is not None and refusal.code == "invalid_transition"
    assert "terminating" in refusal.message
