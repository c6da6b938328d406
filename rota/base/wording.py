"""msgspec's validation errors in plain words that name the field ("delay must be a number
>= 0", "args.w.type must be one of ..."), for the 4xx answers of the API and for spec files;
and JSON's kinds of value."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import inspect as mi

from rota.base.ids import JOB_ID_PATTERN, TOKEN_NAME_PATTERN
from rota.base.protocol import JOB_REF_PATTERN, NAME_PATTERN
from rota.base.unique import KEY_PATTERN

# JSON's kinds, as msgspec names them in "Expected `int`, got `str`", in words.
KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
         "null": "null", "object": "an object", "array": "an array"}
GOT = {**KINDS, "bool": "a boolean"}  # what was sent: "got a boolean", not "got true or false"


# Fields a request type has that a Rota client never sets: EnqueueRequest.ojs (only the
# /ojs/v1 routes set it; POST /jobs refuses it).
UNSAID = frozenset({"ojs"})


def kind_of(value: Any) -> str:
    """The JSON kind of a decoded value, as msgspec names it (bool before int: a bool is
    an int in Python, not in JSON)."""
    for python, kind in ((bool, "bool"), (str, "str"), (int, "int"), (float, "float"),
                         (dict, "object"), (list, "array")):
        if isinstance(value, python):
            return kind
    return "null"

# A version is shown beside the spec's name (history, CLI): short, and no whitespace or
# control characters ("1", "2026-11-25.2", "v1.4.0+build.7"). (rota/base/specs.py's.)
VERSION_PATTERN = r"^[^\s\x00-\x1f\x7f]{1,64}$"
# An [execute] table's headers (rota/base/specs.py): an HTTP token, and printable ASCII.
HEADER_NAME_PATTERN = r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,100}$"
HEADER_VALUE_PATTERN = r"^[\x20-\x7e\t]{0,1000}$"

# The patterns Rota's names and ids follow, as a person would put them; msgspec quotes
# a pattern as Python writes it (repr), so that is how each is looked up.
NAME_RULE = "1 to 128 letters, digits and '_.:-', starting with a letter or digit"
PATTERNS = {repr(pattern)[1:-1]: words for pattern, words in {
    NAME_PATTERN: f"a name of {NAME_RULE}",
    JOB_ID_PATTERN: f"a job id of {NAME_RULE.replace(':-', ':@+=-')}",
    JOB_REF_PATTERN: f"a job id of {NAME_RULE.replace(':-', ':@/+=-')}",
    TOKEN_NAME_PATTERN: "a name of 1 to 100 characters, with no '/' and no control or"
                        " invisible character",
    VERSION_PATTERN: "a version of 1 to 64 characters, with no space or control character",
    KEY_PATTERN: "a key of 1 to 256 characters, with no control character",
    HEADER_NAME_PATTERN: "an HTTP header name of 1 to 100 letters, digits and"
                         " !#$%&'*+.^_`|~- (no space, colon or control character)",
    HEADER_VALUE_PATTERN: "a header value of at most 1000 printable ASCII characters (no"
                          " control character, such as a newline)",
}.items()}

_AT = re.compile(r"(?P<text>.*?)(?: - at `(?P<path>[^`]*)`)?", re.DOTALL)
_STEPS = re.compile(r"\.([^.\[]+)|\[([^\]]*)\]")


Untyped = Callable[[], Any]  # what was decoded, read again without a type (on an error only)


def plainly(message: str, kind: Any = None, data: Untyped | None = None) -> str:
    """A msgspec ValidationError's text in plain words; ``kind``, the type decoded, lets
    an unknown field or value name the ones allowed, and ``data``, what was decoded
    (untyped), the key of a mapping where msgspec says only ``[...]`` ("args.w.type", not
    "args[...].type"). Wording it does not know is kept."""
    if m := _IN_KEY.fullmatch(message):  # a mapping's key is wrong, not its value
        key = _failing_key(kind, data, _steps(m["path"]), m["text"], of_key=True)
        within = m["path"][2:] if m["path"].startswith("$.") else (m["path"][1:] or "the body")
        rule = plainly(f"{m['text']} - at `$.key`")[len("key "):]
        return f"{within}: the key {key!r} {rule}" if key is not None \
            else f"{within}: a key {rule}"
    said = _AT.fullmatch(message)
    assert said is not None  # (the pattern matches any text)
    text, path = said["text"], said["path"] or "$"
    field = _named(text, kind, data, path)
    field = field[2:] if field.startswith("$.") else field[1:]
    name = field or "the body"
    if m := re.fullmatch(r"Expected `([^`]*)`, got `([^`]*)`", text):
        return f"{name} must be {_kind(m[1])}, got {GOT.get(m[2], m[2])}"
    if m := re.fullmatch(r"Expected `([^`]*)` (>=|>|<=|<) (\S+)", text):
        bound = m[3][:-2] if m[3].endswith(".0") else m[3]
        return f"{name} must be {_kind(m[1])} {m[2]} {bound}"
    if m := re.fullmatch(r"Expected `([^`]*)` of length (>=|<=) (\d+)", text):
        unit = "character" if m[1] == "str" else "item"
        most = "at least" if m[2] == ">=" else "at most"
        return f"{name} must be {_kind(m[1])} of {most} {m[3]} {unit}{'' if m[3] == '1' else 's'}"
    # (msgspec quotes the pattern as repr() does: in double quotes if it holds a ')
    if m := re.fullmatch(r"Expected `str` matching regex (['\"])(.*)\1", text, re.DOTALL):
        return f"{name} must be {PATTERNS.get(m[2], f'a string matching {m[2]}')}"
    if text == "Number out of range":
        return (f"{name} holds a number out of range: an integer must fit in 64 bits, and"
                " a number be finite")
    if m := re.fullmatch(r"Object missing required field `([^`]*)`", text):
        return f"{_within(field, m[1])} is required"
    if m := re.fullmatch(r"Object contains unknown field `([^`]*)`", text):
        target = _resolve(kind, path)
        known = [f.encode_name for f in target.fields if f.encode_name not in UNSAID
                 ] if isinstance(target, mi.StructType) else []
        return (f"{_within(field, m[1])} is not a field Rota knows"
                + (f" (known: {', '.join(known)})" if known else ""))
    if m := re.fullmatch(r"Invalid enum value (.*)", text, re.DOTALL):
        target = _resolve(kind, path)
        allowed = [str(v) for v in target.values] if isinstance(target, mi.LiteralType) else []
        if allowed:
            return f"{name} must be one of {', '.join(allowed)}, not {m[1]}"
        return f"{name} cannot be {m[1]}"
    if m := re.fullmatch(r"(\.\w+ )?(must .*)", text, re.DOTALL):  # a __post_init__'s words
        where = (field + (m[1] or "").rstrip()).lstrip(".") or "the body"
        return f"{where} {m[2]}"
    if said["path"] and field:  # a check of our own (a __post_init__'s), deeper in the body
        return f"{field}: {text}"
    return message


_IN_KEY = re.compile(r"(?P<text>.*) - at `key` in `(?P<path>[^`]*)`", re.DOTALL)
Step = tuple[str, int | None]  # a key, or an index into a list ("", 0)


def _steps(path: str) -> list[Step] | None:
    """"$.specs[0].args" as steps, or None where it holds a ``[...]``."""
    steps: list[Step] = []
    for key, index in _STEPS.findall(path[1:]):
        if index == "...":
            return None
        steps.append((key, None) if key else ("", int(index)))
    return steps


def _named(text: str, kind: Any, data: Untyped | None, path: str) -> str:
    """``path`` with each ``[...]`` (a mapping's key, which msgspec does not say) made
    ``.key``: the key whose value fails as the whole did; kept where none is found."""
    if "[...]" not in path:
        return path
    shown, steps = "$", list[Step]()
    for step in _STEPS.finditer(path, 1):
        key, index = step.groups()
        if index == "...":  # its value alone fails with the same words, from there on
            rest = path[step.end():]
            key = _failing_key(kind, data, steps, f"{text} - at `${rest}`" if rest else text)
            if key is None:
                return path
            index = ""
        if index:
            shown += f"[{index}]"
            steps.append(("", int(index)))
        else:
            shown += f".{key}"
            steps.append((key, None))
    return shown


def _failing_key(kind: Any, data: Untyped | None, steps: list[Step] | None, said: str,
                 of_key: bool = False) -> str | None:
    """The key of the mapping at ``steps`` in ``data`` (decoded as ``kind``) whose value
    (or key, ``of_key``) alone fails to decode with the message ``said``: a decode per
    entry, on an error's path only."""
    if kind is None or data is None or steps is None:
        return None
    try:
        mapping, mapping_type = _at(data(), steps), _type_at(kind, steps)
    except Exception:  # noqa: BLE001 (no better words, but never a worse error)
        return None
    if not isinstance(mapping, dict) or typing.get_origin(mapping_type) is not dict:
        return None
    key_type, value_type = typing.get_args(mapping_type)
    for key, value in mapping.items():
        try:
            msgspec.convert(key, key_type) if of_key else msgspec.convert(value, value_type)
        except msgspec.ValidationError as exc:
            if str(exc) == said:
                return str(key)
        except Exception:  # noqa: BLE001 (a type convert cannot build, such as Raw)
            return None
    return None


def _at(data: Any, steps: list[Step]) -> Any:
    for key, index in steps:
        data = data[key] if index is None else data[index]
    return data


def _type_at(kind: Any, steps: list[Step]) -> Any:
    """The Python type at ``steps`` within ``kind`` (bare: see ``_plain``); LookupError
    where there is none."""
    here = _plain(kind)
    for key, index in steps:
        if index is None and isinstance(here, type) and issubclass(here, msgspec.Struct):
            here = next(f.type for f in msgspec.structs.fields(here) if f.encode_name == key)
        elif index is None and typing.get_origin(here) is dict:
            here = typing.get_args(here)[1]
        elif index is not None and typing.get_origin(here) in (list, tuple, set, frozenset):
            here = typing.get_args(here)[0]
        else:
            raise LookupError(key or index)
        here = _plain(here)
    return here


def _plain(kind: Any) -> Any:
    """``kind`` without its constraints (Annotated), and without None if it is optional."""
    while True:
        if typing.get_origin(kind) is typing.Annotated:
            kind = typing.get_args(kind)[0]
        elif typing.get_origin(kind) in (typing.Union, types.UnionType):
            rest = [t for t in typing.get_args(kind) if t is not type(None)]
            if len(rest) != 1:
                return kind
            kind = rest[0]
        else:
            return kind


def _kind(names: str) -> str:
    """"int | null" as "an integer": null is what an optional field is when left out."""
    kinds = [KINDS.get(n, n) for n in names.split(" | ") if n != "null"] or ["null"]
    return " or ".join(kinds)


def _within(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _resolve(kind: Any, path: str) -> mi.Type | None:
    """The type at ``path`` ("$.specs[0].retry") within ``kind``, or None."""
    if kind is None:
        return None
    info: mi.Type | None = _bare(mi.type_info(kind))
    for key, index in _STEPS.findall(path[1:]):
        if key and isinstance(info, mi.StructType):
            info = next((f.type for f in info.fields if f.encode_name == key), None)
        elif index and isinstance(info, mi.ListType | mi.SetType | mi.VarTupleType):
            info = info.item_type
        elif index and isinstance(info, mi.DictType):
            info = info.value_type
        else:
            return None
        info = _bare(info)
    return info


def _bare(info: mi.Type | None) -> mi.Type | None:
    """The type without its constraints, and without None if it is optional."""
    while True:
        if isinstance(info, mi.Metadata):
            info = info.type
        elif isinstance(info, mi.UnionType):
            rest = [t for t in info.types if not isinstance(t, mi.NoneType)]
            if len(rest) != 1:
                return info
            info = rest[0]
        else:
            return info



def names(field: str, given: object) -> list[str]:
    """``given`` (a worker's labels or queues) as a list of names, checked where given, in the
    words the API uses ("labels[0] must be a name of ..."): else the server refuses the
    registration, and a worker would learn it only from its log. A bare string is refused,
    not split into its letters."""
    if isinstance(given, str):
        raise ValueError(f"{field} must be a list of names, not the string {given!r}:"
                         f" pass [{given!r}]")
    listed = list(given or ())  # type: ignore[call-overload]  # (a TypeError says what it is)
    for index, name in enumerate(listed):
        if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
            raise ValueError(f"{field}[{index}] must be a name of {NAME_RULE}, got {name!r}")
    return listed
