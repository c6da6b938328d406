"""Job specs: TOML files in a specs directory, their validation and their checksum.

``checksum()`` is the one function that turns a spec into ``sha256:<hex>``; the CLI,
the server and the worker SDK all call it, so one file always gives one checksum.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from rota.base.egress import url_problem  # one rule for every URL Rota calls
from rota.base.errors import RotaError
from rota.base.flow import MAX_LABELS, WrittenRule
from rota.base.protocol import NAME_PATTERN as NAME_PATTERN  # one pattern for every name
from rota.base.protocol import MAX_COUNT, Name, Priority
from rota.base.unique import UniqueOptions, options_problem
from rota.base.wording import (GOT, HEADER_NAME_PATTERN, HEADER_VALUE_PATTERN, KINDS,
                               VERSION_PATTERN, kind_of, plainly)
MAX_VISIBILITY = 7 * 24 * 3600.0  # a week; longer leases should extend by heartbeat instead
ArgType = Literal["string", "integer", "number", "boolean", "object", "array", "any"]


class SpecError(RotaError, ValueError):
    """A spec file or a job's arguments do not fit what the spec says. (A ValueError too,
    as it was before it joined the tree.)"""

    def __init__(self, message: str) -> None:
        super().__init__("invalid_spec", message)


Description = Annotated[str, msgspec.Meta(max_length=10_000)]


class ArgSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: ArgType = "any"
    description: Description = ""
    required: bool = True


Limit = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
# A retry's wait is capped at a year (the longest any wait in Rota may be).
Backoff = Annotated[float, msgspec.Meta(gt=0, le=366 * 24 * 3600.0)]


class RetryPolicy(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_attempts: Limit = 25
    max_fails: Limit | None = None
    backoff_base: Backoff = 1.0
    backoff_max: Backoff = 3600.0
    # Attempts in a row whose worker died (crash, OOM kill, lost for good) before the job
    # is discarded as poison instead of being handed to the next worker.
    max_worker_deaths: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3


HeaderName = Annotated[str, msgspec.Meta(pattern=HEADER_NAME_PATTERN)]
HeaderValue = Annotated[str, msgspec.Meta(pattern=HEADER_VALUE_PATTERN)]
# Headers a spec may not set: the server's own (signature, delivery id) and the transport's.
RESERVED_HEADERS = ("content-type", "content-length", "host", "transfer-encoding",
                    "connection", "user-agent")
MAX_EXECUTE_TIMEOUT = 900.0  # seconds a delivery may wait for its answer


class Execute(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``[execute]``: the spec's jobs run on an HTTP endpoint, not on a worker (README,
    Push execution). Part of the spec, so of its checksum: a new URL is a new version."""

    url: Annotated[str, msgspec.Meta(max_length=2048)]
    secret: Name  # the NAME of the signing secret (ROTA_SECRET_<NAME> or `rota secrets`)
    timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_EXECUTE_TIMEOUT)] = 30.0
    max_in_flight: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 10
    headers: Annotated[dict[HeaderName, HeaderValue], msgspec.Meta(max_length=32)] = {}

    def __post_init__(self) -> None:
        problem = url_problem(self.url)
        if problem is not None:
            raise ValueError(f"url {problem}")
        reserved = sorted(h for h in self.headers
                          if h.lower() in RESERVED_HEADERS or h.lower().startswith("x-rota-"))
        if reserved:
            raise ValueError(f"headers may not set {', '.join(reserved)} (the server sets"
                             " them)")


Version = Annotated[str, msgspec.Meta(pattern=VERSION_PATTERN)]
# The version and the checksum of an unversioned OJS type: one no spec describes. A /work
# worker declares such a type with this checksum (docs/ojs.md).
UNVERSIONED = "unversioned"


class JobSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One version of a job spec. Fields left at their default do not enter the checksum."""

    name: Name
    version: Version
    description: Description = ""
    queue: Name = "default"
    priority: Priority = 0
    visibility_timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_VISIBILITY)] | None = None
    retry: RetryPolicy = msgspec.field(default_factory=RetryPolicy)
    args: dict[Name, ArgSpec] = {}
    unique: UniqueOptions | None = None  # every job's, unless its enqueue gives its own
    # Flow control (README, Flow control): worker labels every job of the spec requires,
    # and the spec's default limits (``rota limits set`` overrides them until cleared).
    labels: Annotated[list[Name], msgspec.Meta(max_length=MAX_LABELS)] = []
    limits: WrittenRule | None = None
    execute: Execute | None = None  # run on an HTTP endpoint (push execution)

    @classmethod
    def unversioned(cls, name: str) -> JobSpec:
        """An OJS job type no spec was pushed for (docs/ojs.md): OJS's default retry
        policy (3 attempts, 1 s doubling to 300 s), no args schema."""
        return cls(name=name, version=UNVERSIONED,
                   retry=RetryPolicy(max_attempts=3, backoff_base=1.0, backoff_max=300.0))

    def __post_init__(self) -> None:
        if self.limits == WrittenRule():  # an empty [limits] is none: the same checksum
            self.limits = None
        if self.unique is None:
            return
        problem = options_problem(self.unique)
        named = set(self.unique.args_keys or ()) - set(self.args)
        if problem is None and self.args and named:
            problem = (f"unique.args_keys names {', '.join(sorted(named))}, which spec"
                       f" {self.name!r} does not declare in [args]")
        if problem is not None:
            raise ValueError(problem)


def canonical_bytes(spec: JobSpec) -> bytes:
    """UTF-8 JSON, keys sorted, no whitespace, default-valued fields omitted."""
    return msgspec.json.encode(_without_defaults(spec), order="sorted")


def _without_defaults(obj: Any) -> Any:
    # Written out by hand: msgspec's omit_defaults compares some decoded values by
    # identity, so "queue = 'default'" in a file would otherwise change the checksum.
    if isinstance(obj, msgspec.Struct):
        kept = {}
        for name, default in _defaults(type(obj)):
            value = getattr(obj, name)
            if default is not msgspec.NODEFAULT and value == default:
                continue
            kept[name] = _without_defaults(value)
        return kept
    if isinstance(obj, dict):
        return {key: _without_defaults(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_without_defaults(value) for value in obj]
    return obj


@functools.cache
def _defaults(kind: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """Each field's name and default value (NODEFAULT if it has none), once per type: a
    spec with 15,000 arguments took 0.4 s to checksum when asked for every instance."""
    return tuple((f.name, f.default if f.default_factory is msgspec.NODEFAULT
                  else f.default_factory()) for f in msgspec.structs.fields(kind))


def checksum(spec: JobSpec) -> str:
    return "sha256:" + hashlib.sha256(canonical_bytes(spec)).hexdigest()


def parse_spec(data: bytes | str, *, source: str = "<spec>") -> JobSpec:
    spec, _ = parse_file(data, source=source)
    if spec is None:
        raise SpecError(f"{source}: holds only [[schedule]] tables, no spec")
    return spec


def parse_file(data: bytes | str, *, source: str = "<spec>"
               ) -> tuple[JobSpec | None, list[dict[str, Any]]]:
    """A spec file: its spec (None: a schedule file, only ``[[schedule]]`` tables) and
    its schedules, as written, each with its ``spec`` defaulting to the file's. The
    schedules are not part of the spec, nor of its checksum."""
    try:
        raw = msgspec.toml.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{source}: {exc}") from exc
    tables = raw.pop("schedule", None) if isinstance(raw, dict) else None
    if tables is None:
        return _typed(data, source), []
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise SpecError(f"{source}: schedule must be [[schedule]] tables")
    spec = _converted(raw, source) if raw else None
    if spec is not None:
        tables = [{"spec": spec.name, **table} for table in tables]
    return spec, tables


def _converted(raw: dict[str, Any], source: str) -> JobSpec:
    """The spec of a file that also holds schedules, from its decoded TOML."""
    try:
        return msgspec.convert(raw, type=JobSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(f"{source}: {plainly(str(exc), JobSpec, lambda: raw)}") from exc


def _typed(data: bytes | str, source: str) -> JobSpec:
    try:
        return msgspec.toml.decode(data, type=JobSpec)
    except msgspec.ValidationError as exc:
        said = plainly(str(exc), JobSpec, lambda: msgspec.toml.decode(data))
        raise SpecError(f"{source}: {said}") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise SpecError(f"{source}: {exc}") from exc


def load_spec(path: Path) -> JobSpec:
    """A spec file, or a SpecError of one line: a file that cannot be read (a dangling
    symlink, no permission, a directory) or is not UTF-8 is a mistake like any other."""
    return parse_spec(_read(path), source=str(path))


def _read(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        if path.is_symlink() and not path.exists():  # a folder of links copied elsewhere
            raise SpecError(f"{path}: cannot be read: it is a symlink to {path.readlink()},"
                            " which does not exist (copy the files, not the links:"
                            " cp -L)") from exc
        raise SpecError(f"{path}: cannot be read: {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib's own error is a traceback
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start} is"
                        f" {data[exc.start]:#04x}): save it as UTF-8") from exc


def load_dir(directory: Path | str) -> list[JobSpec]:
    """Every ``*.toml`` in the directory, sorted by name; two files naming one spec is an error."""
    return load_deploy(directory)[0]


def load_deploy(directory: Path | str) -> tuple[list[JobSpec], list[dict[str, Any]]]:
    """``load_dir``, and the directory's schedules (``[[schedule]]`` tables, as written,
    each with ``source``: its file), in file order."""
    folder = Path(directory)
    if not folder.is_dir():
        raise SpecError(f"{folder}: not a directory")
    specs: dict[str, JobSpec] = {}
    schedules: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.toml")):
        spec, tables = parse_file(_read(path), source=str(path))
        schedules += [{**table, "source": str(path)} for table in tables]
        if spec is None:
            continue
        if spec.name in specs:
            raise SpecError(f"{path}: spec {spec.name!r} is defined twice in {folder}")
        specs[spec.name] = spec
    if not specs and not schedules:
        raise SpecError(f"{folder}: no *.toml spec files")
    return [specs[name] for name in sorted(specs)], schedules


def spec_from_builtins(data: Any) -> JobSpec:
    """A spec sent as JSON (PUT /specs) or read back from the store."""
    try:
        return msgspec.convert(data, type=JobSpec)
    except msgspec.ValidationError as exc:
        raise SpecError(plainly(str(exc), JobSpec, lambda: data)) from exc


# An argument's type (ArgType) as the JSON kind msgspec names it (rota/base/wording.py).
_KIND = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
         "object": "object", "array": "array"}
_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def validate_args(spec: JobSpec, args: dict[str, Any]) -> None:
    """Check a job's arguments against the spec; a spec that declares none accepts any."""
    if not spec.args:
        return
    unknown = sorted(set(args) - set(spec.args))
    if unknown:
        raise SpecError(f"spec {spec.name!r} has no argument(s) {', '.join(unknown)}")
    for name, arg in spec.args.items():
        if name not in args:
            if arg.required:
                raise SpecError(f"spec {spec.name!r} requires argument {name!r}")
            continue
        _check_type(spec.name, name, arg.type, args[name])


def _check_type(spec: str, name: str, expected: str, value: Any) -> None:
    if expected == "any":
        return
    allowed = _PYTHON_TYPES[expected]
    # bool is an int in Python, but not an integer or number in JSON
    is_bool = isinstance(value, bool)
    if (is_bool and bool not in allowed) or not isinstance(value, allowed):
        raise SpecError(f"args.{name} must be {KINDS[_KIND[expected]]}, got"
                        f" {GOT[kind_of(value)]} (spec {spec!r})")
