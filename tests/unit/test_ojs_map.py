"""The OJS mapping (rota/core/ojs_map.py): a PUSH body to an enqueue request, a row to the
OJS job view, times, durations and the args bijection."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from rota.base.ojs import encode_extras
from rota.core.ojs_map import (OjsRefusal, error_view, job_view, ojs_args_to_rota,
                               ojs_duration, ojs_moment, ojs_time, ojs_to_request,
                               rota_args_to_ojs)

NOW = 1_800_000_000.0
ID = "019461a8-1a2b-7c3d-8e4f-5a6b7c8d9e0f"


def push(body: dict[str, Any]) -> Any:
    return ojs_to_request(json.dumps(body).encode(), NOW)


@pytest.mark.parametrize("args", [[], [1, "a"], [{"a": 1}], [{"a": 1}, 2], [None],
                                  [{"_ojs_args": [1]}], [[1]], [{}]])
def test_args_round_trip_without_loss(args: list[Any]) -> None:
    rota = ojs_args_to_rota(args)
    assert isinstance(rota, dict)
    assert rota_args_to_ojs(json.loads(json.dumps(rota))) == args


def test_one_plain_object_is_the_rota_args() -> None:
    assert ojs_args_to_rota([{"to": "x"}]) == {"to": "x"}
    assert rota_args_to_ojs({"to": "x"}) == [{"to": "x"}]


@pytest.mark.parametrize("text,seconds", [("PT1S", 1), ("PT5M", 300), ("PT1H", 3600),
                                          ("P1D", 86400), ("P1DT2H", 93600), ("PT0.5S", 0.5),
                                          ("P1W", 604800)])
def test_durations(text: str, seconds: float) -> None:
    assert ojs_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "P", "PT", "1S", "PT1", "pt1s", "PT-1S"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError):
        ojs_duration(text)


def test_moments_absolute_relative_and_too_far() -> None:
    assert ojs_moment("+PT5S", NOW) == NOW + 5
    assert ojs_moment("2099-12-31T23:59:59Z", NOW) == 4102444799.0
    with pytest.raises(ValueError):
        ojs_moment("2199-01-01T00:00:00Z", NOW)
    with pytest.raises(ValueError):
        ojs_moment("2099-12-31T23:59:59", NOW)  # no offset


def test_time_drops_zero_milliseconds() -> None:
    assert ojs_time(4102444799.0) == "2099-12-31T23:59:59Z"
    assert ojs_time(4102444799.25) == "2099-12-31T23:59:59.250Z"


@pytest.mark.parametrize("body,status,code", [
    ({"args": []}, 400, "invalid_request"),
    ({"type": "Email.Send", "args": []}, 400, "invalid_request"),
    ({"type": "1email", "args": []}, 400, "invalid_request"),
    ({"type": "email.send"}, 400, "invalid_request"),
    ({"type": "email.send", "args": {"a": 1}}, 400, "invalid_request"),
    ({"type": "email.send", "args": [], "id": "550e8400-e29b-41d4-a716-446655440000"},
     400, "invalid_request"),
    ({"type": "email.send", "args": [], "id": ID.upper()}, 400, "invalid_request"),
    ({"type": "email.send", "args": [], "options": {"queue": "Default"}}, 400,
     "invalid_request"),
    ({"type": "email.send", "args": [], "options": {"priority": 101}}, 400, "invalid_request"),
    ({"type": "email.send", "args": [], "options": {"retry": {"max_attempts": -1}}}, 422,
     "invalid_retry_policy"),
    ({"type": "email.send", "args": [],
      "options": {"retry": {"backoff_coefficient": 0.5}}}, 422, "invalid_retry_policy"),
    ({"type": "email.send", "args": [], "options": {"delay_until": "tomorrow"}}, 400,
     "invalid_request"),
])
def test_refusals(body: dict[str, Any], status: int, code: str) -> None:
    with pytest.raises(OjsRefusal) as caught:
        push(body)
    assert (caught.value.status, caught.value.code) == (status, code)


def test_not_json_is_invalid_payload() -> None:
    with pytest.raises(OjsRefusal) as caught:
        ojs_to_request(b"{ invalid json }", NOW)
    assert (caught.value.status, caught.value.code) == (400, "invalid_payload")


def test_a_full_push_maps_every_option() -> None:
    request = push({
        "type": "report.generate", "args": [42, "q"], "id": ID, "meta": {"trace_id": "t"},
        "x_custom": {"n": 1},
        "options": {"queue": "reports", "priority": 10, "timeout_ms": 300000,
                    "delay_until": "2099-01-01T00:00:00Z", "expires_at": "+PT2S",
                    "visibility_timeout_ms": 30000, "tags": ["a"],
                    "retry": {"max_attempts": 5, "initial_interval": "PT2S",
                              "backoff_coefficient": 3, "max_interval": "PT5M",
                              "jitter": False, "backoff_strategy": "linear",
                              "non_retryable_errors": ["Auth.*"],
                              "on_exhaustion": "dead_letter"},
                    "unique": {"keys": ["type", "args"], "period": "PT1H",
                               "on_conflict": "ignore", "states": ["available"]}}})
    assert (request.spec, request.id, request.queue, request.priority) == (
        "report.generate", ID, "reports", 10)
    assert request.args == {"_ojs_args": [42, "q"]}
    assert request.run_at == "2099-01-01T00:00:00.000Z" and request.max_attempts == 5
    assert request.expires_at is not None and request.visibility_timeout == 30
    assert request.unique is not None and request.unique.keys == ["spec", "args"]
    assert (request.unique.states, request.unique.on_conflict, request.unique.period) == (
        "waiting", "existing", 3600)
    extras = request.ojs
    assert extras is not None and extras.ext == {"x_custom": {"n": 1}}
    assert extras.meta == {"trace_id": "t"} and extras.timeout_ms == 300000
    assert extras.policy is not None
    assert (extras.policy.backoff_base, extras.policy.backoff_max, extras.policy.coefficient,
            extras.policy.linear, extras.policy.jitter, extras.policy.non_retryable,
            extras.policy.dead_letter) == (2, 300, 3, True, "none", ("Auth.*",), True)


def test_json_format_top_level_options_are_taken_too() -> None:
    request = push({"type": "a", "args": [], "queue": "q", "priority": 3, "timeout": 30,
                    "visibility_timeout": 60, "tags": ["t"], "retry": {"max_attempts": 2},
                    "scheduled_at": "2099-01-01T00:00:00Z"})
    assert (request.queue, request.priority, request.max_attempts, request.visibility_timeout,
            request.run_at) == ("q", 3, 2, 60, "2099-01-01T00:00:00.000Z")
    assert request.ojs is not None
    assert (request.ojs.timeout_ms, request.ojs.visibility_timeout_ms, request.ojs.tags) == (
        30000, 60000, ["t"])
    with pytest.raises(OjsRefusal):
        push({"type": "a", "args": [], "timeout": -1})


def test_types_are_lowercase_dotted_names_hyphens_allowed() -> None:
    assert push({"type": "retry.test.max-attempts", "args": []}).spec == "retry.test.max-attempts"


def test_a_past_moment_means_now() -> None:
    assert push({"type": "a", "args": [], "options": {"delay_until": "2020-01-01T00:00:00Z"}
                 }).run_at is None


def row(**over: Any) -> dict[str, Any]:
    request = push({"type": "email.send", "args": ["x"], "meta": {"k": 1}, "x_ext": True})
    base = {"id": ID, "spec": "email.send", "queue": "default",
            "args": msgspec.json.encode(request.args).decode(), "priority": 0,
            "state": "available", "attempt": 0, "budget_start": 0, "max_attempts": 3,
            "enqueued_at": NOW, "run_at": None, "expires_at": None, "reserved_at": None,
            "finished_at": None, "result": None, "errors": "[]", "parent_results": None,
            "workflow_id": None, "created_by": None, "cancel_requested": 0,
            "ojs": encode_extras(request.ojs)}
    return base | over


def test_a_new_job_omits_what_it_does_not_have() -> None:
    view = job_view(row(), NOW)
    assert view["args"] == ["x"] and view["meta"] == {"k": 1} and view["x_ext"] is True
    assert view["created_at"] == view["enqueued_at"] == ojs_time(NOW)
    for absent in ("started_at", "completed_at", "error", "errors", "result", "scheduled_at"):
        assert absent not in view
    assert None not in view.values()


def test_due_later_states_show_available() -> None:
    assert job_view(row(state="scheduled", run_at=NOW + 1), NOW)["state"] == "scheduled"
    assert job_view(row(state="scheduled", run_at=NOW - 1), NOW)["state"] == "available"
    assert job_view(row(state="retryable", run_at=NOW), NOW)["state"] == "available"


def test_completed_at_rules() -> None:
    done = dict(attempt=1, reserved_at=NOW, finished_at=NOW + 1, result='{"ok":1}')
    completed = job_view(row(state="completed", **done), NOW)
    assert completed["completed_at"] == ojs_time(NOW + 1) and completed["result"] == {"ok": 1}
    expired = job_view(row(state="discarded", finished_at=NOW + 1), NOW)
    assert "completed_at" not in expired and expired["discarded_at"] == ojs_time(NOW + 1)
    nacked = job_view(row(state="discarded", attempt=1, reserved_at=NOW, finished_at=NOW), NOW)
    assert nacked["completed_at"] == nacked["discarded_at"]
    cancelled = job_view(row(state="cancelled", finished_at=NOW + 2), NOW)
    assert "completed_at" not in cancelled and cancelled["cancelled_at"] == ojs_time(NOW + 2)


def test_errors_and_attempt_after_a_manual_retry() -> None:
    record = {"type": "Timeout", "code": "handler_error", "message": "m", "retryable": True,
              "details": None, "attempt": 1, "worker_id": "w", "at": "2027-01-01T00:00:00Z",
              "retry_in": 1.5}
    view = job_view(row(state="retryable", attempt=3, budget_start=2, run_at=NOW + 9,
                        errors=json.dumps([record])), NOW)
    assert view["attempt"] == 1
    assert view["error"] == error_view(record) == {
        "code": "handler_error", "type": "Timeout", "message": "m", "retryable": True,
        "attempt": 1, "occurred_at": "2027-01-01T00:00:00Z", "retry_delay_ms": 1500}
    assert view["retry_delay_ms"] == 1500
    assert "error" not in job_view(row(state="completed", errors=json.dumps([record])), NOW)


def test_a_producer_token_s_id_is_shown_as_given() -> None:
    assert job_view(row(id=f"tok1:{ID}", created_by="tok1"), NOW)["id"] == ID
