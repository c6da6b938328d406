"""Fuzzing the frame decoder: whatever bytes arrive, decoding gives a Heartbeat or a
FrameError with a documented code and close code, never another exception. Bounded in
examples so it runs in CI; ROTA_FUZZ_EXAMPLES widens it."""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rota import protocol as p

EXAMPLES = int(os.environ.get("ROTA_FUZZ_EXAMPLES", "150"))
CODES = {"malformed_json": p.CLOSE_INVALID_PAYLOAD, "invalid_message": p.CLOSE_INVALID_PAYLOAD,
         "unknown_type": p.CLOSE_UNSUPPORTED}
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                 max_size=4),
    max_leaves=20)

# Heartbeat-shaped objects: the right keys with any values, so the fuzzer reaches past
# the first type check into every section.
KEYS = ["seq", "worker_id", "registration", "status", "results", "capacity", "goodbye"]
SECTION_KEYS = ["state", "active_job_ids", "progress", "logs", "alerts", "job_id", "attempt",
                "outcome", "error", "queues", "concurrency", "specs", "percent", "level"]
shaped = st.fixed_dictionaries(
    {"type": st.sampled_from(["heartbeat", "ack", "assign", "nope", 7])},
    optional={key: json_values | st.dictionaries(st.sampled_from(SECTION_KEYS), json_values,
                                                  max_size=5)
              | st.lists(st.dictionaries(st.sampled_from(SECTION_KEYS), json_values,
                                         max_size=5), max_size=3)
              for key in KEYS})


def decode(frame: str | bytes) -> None:
    try:
        message = p.decode_heartbeat(frame)
    except p.FrameError as exc:
        assert CODES[exc.code] == exc.close_code, exc.code
        assert exc.message
    else:
        assert isinstance(message, p.Heartbeat)
        p.encode(message)  # what was accepted can be written back out


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes(frame: bytes) -> None:
    decode(frame)


@FUZZ
@given(st.text(max_size=300))
def test_any_text(frame: str) -> None:
    decode(frame)


@FUZZ
@given(json_values)
def test_any_json(value: Any) -> None:
    decode(json.dumps(value))


@FUZZ
@given(shaped)
def test_heartbeat_shaped_objects(value: dict[str, Any]) -> None:
    decode(json.dumps(value))
