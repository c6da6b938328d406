"""What Rota accepts as JSON from outside, checked before it is decoded.

msgspec decodes JSON nested a few hundred levels deep by recursing, and fails with a
RecursionError somewhere below a thousand: a request of a few kilobytes could then
cost a traceback, and a document just under that depth would be stored and later
crash whatever recursed through it again (a worker decoding its args, a view). So
every request body and every /work frame is first measured here, without recursing
and without decoding: at most ``MAX_DEPTH`` arrays and objects deep.

The other checks that decoding alone gets wrong are made only once decoding has
failed (``explain``), so a good document pays nothing for them: invalid UTF-8,
a lone UTF-16 surrogate escape (msgspec reports it as "Input data was truncated"),
a byte order mark and an empty body each get a message that says what is wrong.

Duplicate keys in one object are accepted, and the last one wins, as in JSON.parse,
Python's json and msgspec; Rota stores and forwards what it decoded, so the args a
worker gets, and every view, hold each key once (docs/operations.md, Limits).
"""

from __future__ import annotations

import re
from itertools import accumulate

from rota.base.errors import RotaError


# Arrays and objects, the outermost one included: a POST /jobs body is one level, so
# its args may nest 63 deep, and a heartbeat's results hold a result 61 deep.
MAX_DEPTH = 64

# A JSON string, escapes included, matched without backtracking (the unrolled loop).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Only what decides depth is kept: brackets, and what delimits the strings around them.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"\\')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_PARENS = bytes.maketrans(b"[{]}", b"(())")
_STEP = [0] * 256
_STEP[ord("(")], _STEP[ord(")")] = 1, -1
_PEELED = 8  # innermost levels taken off by string replaces before counting the rest
# A high surrogate escape not followed by a low one, or a low one on its own; the
# escape's backslash must not itself be escaped (an even run of backslashes before it).
_LONE_SURROGATE = re.compile(
    rb'(?:^|[^\\])(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})'
    rb'|(?:^|[^\\])(?:\\\\)*(?<!\\u[dD][89abAB][0-9a-fA-F]{2})(\\u[dD][c-fC-F][0-9a-fA-F]{2})')
_BOM = b"\xef\xbb\xbf"


class BadJson(RotaError, ValueError):
    """A body or frame refused before, or while, it is decoded: ``code`` names why. Each
    door turns it into its own refusal (a ``RequestError`` or a ``FrameError``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)


def too_deep(data: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep in ``data``, decided
    without recursion; brackets inside strings do not count. Malformed input may get
    either answer: the decoder, which runs next, is the one to refuse it.

    Each step is a bytes method, run in C: a heartbeat carrying 1,000 results costs
    about a third of its decoding, and a 1 MiB body of brackets a few milliseconds."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # too few brackets to be too deep: most bodies and frames
    structure = data.translate(None, _NOT_STRUCTURE)
    if b"\\" not in structure:
        structure = structure.replace(b'""', b"")  # strings holding no brackets
    if b'"' in structure:
        structure = _STRING.sub(b"", structure)
    parens = structure.translate(_AS_PARENS, _NOT_BRACKETS)
    # The innermost pairs, "()", are peeled a level at a time: shallow documents (every
    # frame and batch) end here. What is left is counted, unless a run of openers
    # already proves it too deep.
    for level in range(_PEELED):
        peeled = parens.replace(b"()", b"")
        if len(peeled) == len(parens):
            return level > limit
        parens = peeled
    if b"(" * (limit - _PEELED + 1) in parens:
        return True
    return _PEELED + max(accumulate(map(_STEP.__getitem__, parens)), default=0) > limit


def screen(data: bytes | str) -> bytes:
    """``data`` as bytes, refused with BadJson if it is not UTF-8 ("invalid_utf8") or
    nests past MAX_DEPTH ("too_deep")."""
    if isinstance(data, str):  # already text (the WebSocket layer checked it): no 2nd check
        raw = data.encode("utf-8", "surrogatepass")
    elif not (raw := data).isascii():
        # Checked whole, up front: the decoder checks only the strings it decodes, and a
        # part kept raw (a batch's requests) would fail later, somewhere less prepared.
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise explain(raw, exc) from None
    if too_deep(raw):
        raise BadJson("too_deep", f"JSON nested more than {MAX_DEPTH} arrays or objects deep"
                      " (MAX_DEPTH)")
    return raw


def explain(data: bytes, exc: Exception) -> BadJson:
    """Why ``data`` failed to decode, in words a client can act on. ``exc`` is what the
    decoder raised (msgspec.DecodeError, UnicodeDecodeError or RecursionError)."""
    if isinstance(exc, UnicodeDecodeError) or not data.isascii():
        # The byte is found in the whole: msgspec up to 0.22 raised UnicodeDecodeError
        # with offsets within one string, and 0.23 raises its DecodeError ("Invalid UTF-8
        # encoded string") without any.
        wrong = exc if isinstance(exc, UnicodeDecodeError) else None
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as whole:
            wrong = whole
        if wrong is not None:
            return BadJson("invalid_utf8", f"the JSON is not valid UTF-8: byte"
                           f" 0x{data[wrong.start]:02x} at offset {wrong.start}"
                           f" ({wrong.reason})")
    if isinstance(exc, RecursionError):
        return BadJson("too_deep", "JSON nested too deep to decode")
    if not data.strip():
        return BadJson("malformed_json", "the body is empty: send a JSON object")
    if data.startswith(_BOM):
        return BadJson("malformed_json", "the JSON starts with a byte order mark: send UTF-8"
                       " without one")
    lone = _LONE_SURROGATE.search(data)
    if lone is not None:
        escape = (lone.group(1) or lone.group(2)).decode()
        return BadJson("invalid_unicode", f"a lone UTF-16 surrogate {escape} at byte"
                       f" {lone.start(1) if lone.group(1) else lone.start(2)}: JSON strings"
                       " must be valid Unicode (surrogates come in high-low pairs)")
    return BadJson("malformed_json", str(exc))
