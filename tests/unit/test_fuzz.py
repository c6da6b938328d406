"""Fuzzing the frame decoder: whatever bytes arrive, decoding gives a Heartbeat or a
FrameError with a documented code and close code, never another exception. Bounded in
examples: 40 a property in the default run, 150 in the soak run (pytest -m soak), or
ROTA_FUZZ_EXAMPLES there."""

from __future__ import annotations

import json
import os
from typing import Any

import corpus
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rota.base import protocol as p

# Each property runs twice over: a few examples by default, today's full count in the soak.
SIZES = [pytest.param(40, id="quick"),
         pytest.param(int(os.environ.get("ROTA_FUZZ_EXAMPLES", "150")), id="soak",
                      marks=pytest.mark.soak)]
CODES = {"malformed_json": p.CLOSE_INVALID_PAYLOAD, "invalid_message": p.CLOSE_INVALID_PAYLOAD,
         "unknown_type": p.CLOSE_UNSUPPORTED, "too_deep": p.CLOSE_INVALID_PAYLOAD,
         "invalid_utf8": p.CLOSE_INVALID_PAYLOAD, "invalid_unicode": p.CLOSE_INVALID_PAYLOAD}


def fuzz(examples: int, *strategies: st.SearchStrategy[Any]) -> Any:
    """Decorate a property: hypothesis runs it on ``examples`` draws of ``strategies``."""
    return lambda prop: settings(max_examples=examples, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])(
        given(*strategies)(prop))

# The corpus's extremes (tests/corpus.py) are drawn too, not only what hypothesis makes up:
# integers at and past 32 and 64 bits, huge and tiny doubles, hostile text.
MARK = "\u0001FRAGMENT\u0001"
EXTREME_INTS = [2**31 - 1, 2**31, -(2**31), 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**400]
extremes = (st.sampled_from(EXTREME_INTS) | st.sampled_from([1e308, 5e-324, -0.0])
            | st.sampled_from(["\u202e", "a\u0000b", "\ufeff", "x\nERROR forged", "\U0001f600"]))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=20) | extremes | st.just(MARK),
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


# Frames of every kind: any bytes, any text, any JSON, and heartbeat-shaped objects.
FRAMES = {"bytes": st.binary(max_size=300), "text": st.text(max_size=300),
          "json": json_values.map(json.dumps), "heartbeat_shaped": shaped.map(json.dumps)}


@pytest.mark.parametrize("examples", SIZES)
@pytest.mark.parametrize("kind", FRAMES)
def test_any_frame(kind: str, examples: int) -> None:
    @fuzz(examples, FRAMES[kind])
    def prop(frame: str | bytes) -> None:
        decode(frame)

    prop()


# The small fragments (the big ones, depth and length, have tests of their own); drawn by
# index, so that a failing example's report stays readable.
FRAGMENTS = [value for value in corpus.VALUES if len(value[1]) <= 200]


@pytest.mark.parametrize("examples", SIZES)
def test_heartbeat_shaped_objects_carrying_corpus_fragments(examples: int) -> None:
    @fuzz(examples, shaped, st.integers(0, len(FRAGMENTS) - 1))
    def prop(value: dict[str, Any], index: int) -> None:
        """Raw JSON no encoder writes (NaN, 1e309, lone surrogates, invalid UTF-8) put
        wherever the strategy left a mark."""
        fragment = FRAGMENTS[index]
        text = json.dumps(value).encode().replace(json.dumps(MARK).encode(), fragment[1])
        decode(text)
        if fragment[2] and text != json.dumps(value).encode():
            try:  # a fragment no field may take spoils whatever frame carries it
                p.decode_heartbeat(text)
            except p.FrameError:
                pass
            else:
                raise AssertionError(f"{fragment[0]} accepted in {text[:200]!r}")

    prop()


@pytest.mark.parametrize("examples", SIZES)
def test_any_depth_of_result(examples: int) -> None:
    @fuzz(examples, st.integers(0, 3000), st.sampled_from(["[", '{"a":']))
    def prop(depth: int, opener: str) -> None:
        closer = "]" if opener == "[" else "}"
        result = opener * depth + "1" + closer * depth
        frame = ('{"type": "heartbeat", "seq": 1, "worker_id": "w", "results": [{"job_id": "j",'
                 f' "attempt": 1, "outcome": "completed", "result": {result}}}]}}')
        try:
            p.decode_heartbeat(frame)
        except p.FrameError as exc:
            assert exc.code == "too_deep" and depth + 3 > 64, (depth, exc.code)
        else:
            assert depth + 3 <= 64


    prop()