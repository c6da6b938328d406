"""JSON screened before decoding (rota/base/inputs.py): depth measured without recursion, and
the words for why a document failed to decode. Pure: no server."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rota.base.inputs import MAX_DEPTH, BadJson, explain, screen, too_deep


def nested(depth: int, *, obj: bool = False) -> bytes:
    if obj:
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b"[" * depth + b"]" * depth


def true_depth(value: object) -> int:
    """Depth of a decoded value, the slow and obvious way (iterative)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            level += 1
            deepest = max(deepest, level)
            stack.extend((child, level) for child in
                         (item.values() if isinstance(item, dict) else item))
    return deepest


@pytest.mark.parametrize("obj", [False, True])
def test_the_limit_is_exact(obj: bool):
    assert not too_deep(nested(MAX_DEPTH, obj=obj))
    assert too_deep(nested(MAX_DEPTH + 1, obj=obj))
    assert screen(nested(MAX_DEPTH, obj=obj))
    with pytest.raises(BadJson) as refused:
        screen(nested(MAX_DEPTH + 1, obj=obj))
    assert refused.value.code == "too_deep" and "64" in refused.value.message


def test_brackets_inside_strings_do_not_count():
    text = json.dumps({"a": "[" * 500, "b": ["]" * 500, '\\"[[[', "\\"]}).encode()
    assert not too_deep(text)
    assert too_deep(json.dumps(["\\\"", nested(MAX_DEPTH).decode()]).encode()) is False
    assert too_deep(b'["\\\\",' + nested(MAX_DEPTH) + b"]")  # an escaped backslash ends no string


def test_a_huge_body_of_brackets_is_measured_without_recursion():
    assert too_deep(nested(500_000))  # 1 MB: msgspec itself would raise RecursionError
    assert too_deep(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    wide = b"[" + b"[[[[[[[[[[]]]]]]]]]]," * 40_000 + b"1]"  # 400,000 brackets, 11 deep
    assert not too_deep(wide)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab,:'),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(alphabet='[]{}"\\ab'), children, max_size=4),
    max_leaves=200)


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(min_value=1, max_value=80))
def test_too_deep_agrees_with_the_decoded_depth(value: object, wrap: int):
    document = json.dumps(value)
    for _ in range(wrap):  # pushes some examples over the limit
        document = f"[{document}]"
    data = document.encode()
    assert too_deep(data) == (true_depth(json.loads(data)) > MAX_DEPTH)


@pytest.mark.parametrize(("data", "code", "says"), [
    (b'"\\ud800"', "invalid_unicode", "\\ud800"),
    (b'{"a": "x\\udc00"}', "invalid_unicode", "\\udc00"),
    (b'["ok \\ud83d\\ude00", "\\udbff"]', "invalid_unicode", "\\udbff"),
    (b'{"a": "\xff\xfe"}', "invalid_utf8", "0xff at offset 7"),
    (b'"\xc0\xaf"', "invalid_utf8", "0xc0"),  # an overlong "/"
    (b'"\xed\xa0\x80"', "invalid_utf8", "0xed"),  # a surrogate encoded as UTF-8
    (b"", "malformed_json", "empty"),
    (b" \n", "malformed_json", "empty"),
    (b'\xef\xbb\xbf{"a": 1}', "malformed_json", "byte order mark"),
    (b'{"a": 1} x', "malformed_json", "trailing"),
    (b"NaN", "malformed_json", "malformed"),
])
def test_why_a_document_failed_is_said_precisely(data: bytes, code: str, says: str):
    with pytest.raises((msgspec.DecodeError, UnicodeDecodeError)) as failed:
        msgspec.json.decode(data)
    bad = explain(data, failed.value)
    assert bad.code == code and says in bad.message


def test_an_escaped_backslash_before_u_is_no_surrogate():
    assert msgspec.json.decode(b'"a\\\\ud800"') == "a\\ud800"  # decodes: nothing to explain


@pytest.mark.parametrize("error", [
    msgspec.DecodeError("Invalid UTF-8 encoded string"),  # msgspec 0.23
    UnicodeDecodeError("utf-8", b"\xc0\xaf", 0, 1, "invalid start byte"),  # up to 0.22
], ids=["DecodeError", "UnicodeDecodeError"])
def test_a_document_not_utf8_is_said_so_whichever_error_the_decoder_raised(
        error: Exception) -> None:
    bad = explain(b'{"a": "\xc0\xaf"}', error)
    assert bad.code == "invalid_utf8" and "byte 0xc0 at offset 7" in bad.message, bad
