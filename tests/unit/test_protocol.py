"""Unit tests for the /work wire protocol codecs in rota.base.protocol (no server)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from helpers import heartbeat, registration

from rota.base.protocol import (
    CLOSE_INVALID_PAYLOAD,
    CLOSE_UNSUPPORTED,
    Ack,
    Assign,
    Error,
    FrameError,
    Heartbeat,
    JobCopy,
    ResultRejection,
    SpecRejection,
    SpecVerdict,
    Welcome,
    decode_heartbeat,
    decode_server_message,
    encode,
    rfc3339,
)


def beat(**fields: Any) -> str:
    """A heartbeat frame as JSON text: the minimal valid one, plus/overridden by ``fields``."""
    return json.dumps(heartbeat(**fields))


def frame_error(frame: str | bytes) -> FrameError:
    with pytest.raises(FrameError) as info:
        decode_heartbeat(frame)
    return info.value


# -- decode_heartbeat: the happy path -------------------------------------------------
def test_minimal_heartbeat_decodes() -> None:
    message = decode_heartbeat(beat(seq=7, capacity=3))
    assert isinstance(message, Heartbeat)
    assert (message.seq, message.worker_id, message.capacity) == (7, "w1", 3)
    assert message.registration is None and message.results == []


def test_heartbeat_accepts_bytes_and_nested_sections() -> None:
    frame = beat(
        registration=registration(specs=[{"name": "echo", "checksum": "sha256:ab"}]),
        status={"state": "quiet", "active_job_ids": ["j1"]},
        results=[{"job_id": "j1", "attempt": 1, "outcome": "failed",
                  "error": {"type": "Boom", "message": "bad", "retryable": False}}],
    ).encode()
    message = decode_heartbeat(frame)
    assert message.registration is not None
    assert message.registration.specs[0].name == "echo"
    assert message.registration.specs[0].checksum == "sha256:ab"
    assert message.status is not None and message.status.state == "quiet"
    assert message.results[0].error is not None
    assert message.results[0].error.retryable is False


def test_unknown_fields_are_ignored_at_every_level() -> None:
    frame = beat(
        future_top_level={"anything": [1, 2]},
        registration=registration(gpu="a100"),
        status={"state": "running", "temperature": 71.5},
        results=[{"job_id": "j1", "attempt": 2, "outcome": "completed", "result": 5,
                  "duration_ms": 12}],
    )
    message = decode_heartbeat(frame)
    assert message.registration is not None and message.registration.queues == ["default"]
    assert message.status is not None and message.status.state == "running"
    assert message.results[0].result == 5
    assert message.results[0].attempt == 2


# -- decode_heartbeat: every failure is a FrameError with the right codes ------------
@pytest.mark.parametrize("frame", ["{", "not json", '{"type": "heartbeat", "seq": 0,', ""])
def test_malformed_json(frame: str) -> None:
    error = frame_error(frame)
    assert error.code == "malformed_json"
    assert error.close_code == CLOSE_INVALID_PAYLOAD == 1007


@pytest.mark.parametrize("kind", ["welcome", "hello", "Heartbeat", "assign"])
def test_unknown_message_type(kind: str) -> None:
    error = frame_error(beat(type=kind))
    assert error.code == "unknown_type"
    assert error.close_code == CLOSE_UNSUPPORTED == 1003
    assert "heartbeat" in error.message


def test_wrong_field_type_names_the_json_path() -> None:
    error = frame_error(beat(seq="1"))
    assert error.code == "invalid_message"
    assert error.close_code == 1007
    assert "$.seq" in error.message
    assert str(error) == error.message


def test_negative_capacity_rejected() -> None:
    error = frame_error(beat(capacity=-1))
    assert (error.code, error.close_code) == ("invalid_message", 1007)
    assert "$.capacity" in error.message


def test_negative_seq_rejected() -> None:
    error = frame_error(beat(seq=-1))
    assert (error.code, error.close_code) == ("invalid_message", 1007)
    assert "$.seq" in error.message


def test_registration_with_no_queues_rejected() -> None:
    error = frame_error(beat(registration=registration(queues=[])))
    assert (error.code, error.close_code) == ("invalid_message", 1007)
    assert "$.registration.queues" in error.message


def test_registration_with_zero_concurrency_rejected() -> None:
    error = frame_error(beat(registration=registration(concurrency=0)))
    assert (error.code, error.close_code) == ("invalid_message", 1007)
    assert "$.registration.concurrency" in error.message


def test_empty_worker_id_rejected() -> None:
    error = frame_error(beat(worker_id=""))
    assert (error.code, error.close_code) == ("invalid_message", 1007)
    assert "$.worker_id" in error.message


@pytest.mark.parametrize("frame", ["[]", '[{"type": "heartbeat", "seq": 0, "worker_id": "w"}]'])
def test_array_instead_of_object_rejected(frame: str) -> None:
    error = frame_error(frame)
    assert (error.code, error.close_code) == ("invalid_message", 1007)


def test_nested_field_named_type_is_not_an_unknown_message_type() -> None:
    # ErrorInfo has its own required ``type`` field; leaving it out is an invalid
    # message (1007), not an unknown top-level message type (1003).
    frame = beat(results=[{"job_id": "j1", "attempt": 1, "outcome": "failed",
                           "error": {"message": "no type here"}}])
    error = frame_error(frame)
    assert (error.code, error.close_code) == ("invalid_message", 1007)
    assert "$.results[0].error" in error.message


# -- server messages: encode/decode round trip ---------------------------------------
WELCOME = Welcome(
    worker_id="w1", server_time="2024-01-02T03:04:05.678Z", heartbeat_interval=5.0,
    heartbeat_timeout=30.0, visibility_timeout=300.0,
    specs=SpecVerdict(accepted=["echo"], rejected=[SpecRejection(
        name="resize", checksum="sha256:aa", expected="sha256:bb", reason="checksum differs")]),
)
ACK = Ack(seq=12, state="quiet", server_time="2024-01-02T03:04:05.678Z", accepted=["j1"],
          rejected=[ResultRejection(job_id="j2", attempt=1, reason="stale attempt")])
ERROR = Error(code="invalid_message", message="Expected `int`, got `str` - at `$.seq`")


@pytest.mark.parametrize(("message", "tag"), [(WELCOME, "welcome"), (ACK, "ack"), (ERROR, "error")])
def test_server_message_round_trip(message: msgspec.Struct, tag: str) -> None:
    text = encode(message)
    assert isinstance(text, str)
    assert json.loads(text)["type"] == tag
    decoded = decode_server_message(text)
    assert type(decoded) is type(message)
    assert decoded == message


def test_ack_with_defaults_round_trips_and_omits_empty_lists() -> None:
    ack = Ack(seq=0, state="running", server_time="1970-01-01T00:00:00.000Z")
    text = encode(ack)
    body = json.loads(text)
    assert body == {"type": "ack", "seq": 0, "state": "running",
                    "server_time": "1970-01-01T00:00:00.000Z"}
    assert decode_server_message(text) == ack


def test_assign_round_trip_with_raw_args() -> None:
    raw = b'{"url":"http://x/y.png","width":640,"nested":{"ok":true}}'
    copy = JobCopy(id="job-1", spec="resize_image", checksum="sha256:" + "0" * 64,
                   queue="media", args=msgspec.Raw(raw), attempt=3, priority=-2,
                   visibility_timeout=120.0, enqueued_at="2024-01-02T03:04:05.678Z")
    text = encode(Assign(jobs=[copy]))
    body = json.loads(text)
    assert body["type"] == "assign"
    # The raw args bytes are spliced into the frame verbatim.
    assert raw.decode() in text
    decoded = decode_server_message(text)
    assert isinstance(decoded, Assign)
    [job] = decoded.jobs
    assert job.args == {"url": "http://x/y.png", "width": 640, "nested": {"ok": True}}
    assert (job.id, job.spec, job.queue, job.attempt, job.priority) == (
        "job-1", "resize_image", "media", 3, -2)
    assert job.visibility_timeout == 120.0
    assert job.enqueued_at == "2024-01-02T03:04:05.678Z"


def test_heartbeat_encodes_with_type_tag() -> None:
    text = encode(Heartbeat(seq=3, worker_id="w9", capacity=2))
    assert json.loads(text) == {"type": "heartbeat", "seq": 3, "worker_id": "w9", "capacity": 2}
    assert decode_heartbeat(text) == Heartbeat(seq=3, worker_id="w9", capacity=2)


def test_decode_server_message_rejects_unknown_type() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_server_message('{"type": "heartbeat", "seq": 0, "worker_id": "w"}')


# -- rfc3339 ---------------------------------------------------------------------------
@pytest.mark.parametrize(("ts", "expected"), [
    (0, "1970-01-01T00:00:00.000Z"),
    (0.0, "1970-01-01T00:00:00.000Z"),
    (1.5, "1970-01-01T00:00:01.500Z"),
    (1_700_000_000.123, "2023-11-14T22:13:20.123Z"),
    (951_782_400.25, "2000-02-29T00:00:00.250Z"),
])
def test_rfc3339(ts: float, expected: str) -> None:
    assert rfc3339(ts) == expected


def test_rfc3339_formats_exactly_as_datetime_does() -> None:
    """The fast path (date part cached per second) must not drift from isoformat."""
    import datetime as dt
    import random

    from rota.base.protocol import rfc3339

    rng = random.Random(7)
    moments = [rng.uniform(0, 4e9) for _ in range(20_000)]
    moments += [1_800_000_000 + k / 1000 + d for k in range(1000) for d in (0.0, 4.999e-4, 9.995e-4)]
    for ts in moments:
        expected = dt.datetime.fromtimestamp(ts, tz=dt.UTC).isoformat(timespec="milliseconds")
        assert rfc3339(ts) == expected.replace("+00:00", "Z"), ts
