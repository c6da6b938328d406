"""Endpoint signing secrets, the rules: the environment variable a secret's name maps to, what a value may be, which values are in force during a rotation, and the push's refusal of a spec whose secret is set nowhere.

A spec's ``[execute]`` table names its secret (``JobSpec.execute.secret``); the value
comes from the server's environment (``ROTA_SECRET_<NAME>``) or its database
(``rota secrets set``), never from the spec file. Pure: the shell is
rota/server/secretbook.py.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rota.base.egress import literal_refused
from rota.base.errors import Invalid
from rota.base.protocol import NAME_PATTERN
from rota.base.specs import JobSpec
from rota.base.wording import NAME_RULE

ENV_PREFIX = "ROTA_SECRET_"
MIN_BYTES, MAX_BYTES = 16, 4096  # a value's length in UTF-8
DAY = 86_400.0
DEFAULT_WINDOW = DAY  # seconds the value a rotation replaced stays valid
MAX_WINDOW = 30 * DAY
_NOT_ALNUM = re.compile(r"[^A-Z0-9]")
_NAME = re.compile(NAME_PATTERN)


def name_problem(name: str) -> str | None:
    """Why ``name`` is no secret's name (the rule of a spec's ``[execute].secret``)."""
    if _NAME.match(name):
        return None
    said = repr(name) if len(name) <= 60 else f"a name of {len(name)} characters"
    return f"a secret's name is {NAME_RULE}, not {said}"


@functools.lru_cache(maxsize=1024)  # (asked once per delivery: the same few names)
def env_name(name: str) -> str:
    """The environment variable that holds secret ``name``: ROTA_SECRET_ and the name
    upper-cased, each character that is not a letter or digit made "_" (``stripe.live``:
    ROTA_SECRET_STRIPE_LIVE). Names that differ only there share one variable."""
    return ENV_PREFIX + _NOT_ALNUM.sub("_", name.upper())


def value_problem(value: str) -> str | None:
    """Why ``value`` cannot be a secret (None: it can): 16 to 4096 bytes of printable
    text, not starting or ending with a space (a pasted or read line's edge, surely)."""
    size = len(value.encode("utf-8", "surrogatepass"))
    if size < MIN_BYTES:
        return f"a secret is {MIN_BYTES} bytes at least (this one is {size})"
    if size > MAX_BYTES:
        return f"a secret is {MAX_BYTES} bytes at most (this one is {size})"
    bad = next((c for c in value if not c.isprintable()), None)
    if bad is not None:
        return f"a secret is printable text: this one holds {bad!r}"
    if value != value.strip():
        return "a secret may not begin or end with a space"
    return None


def window_problem(seconds: float) -> str | None:
    if not 0 <= seconds <= MAX_WINDOW:
        return f"the previous value's window is 0 to {MAX_WINDOW:.0f} seconds (30 days)"
    return None


def in_force(row: Mapping[str, Any], now: float) -> list[str]:
    """A stored secret's values valid at ``now``: its value, then the one it replaced
    while that one's window lasts (deliveries are signed with both meanwhile)."""
    values = [row["value"]]
    previous, until = row.get("previous"), row.get("previous_until")
    if previous is not None and until is not None and now < until:
        values.append(previous)
    return values


def unknown_secrets(specs: Iterable[JobSpec], known: Callable[[str], bool]) -> Invalid | None:
    """The push's refusal (422 ``unknown_secret``) of specs whose ``[execute]`` secret is
    set neither in the server's environment nor in its database; None if there is none."""
    missing = [(s.name, s.execute.secret) for s in specs
               if s.execute is not None and not known(s.execute.secret)]
    if not missing:
        return None
    said = "; ".join(
        f"spec {spec}: its [execute] secret {secret!r} is not set (set it with 'rota"
        f" secrets set {secret}', or the server's environment variable {env_name(secret)})"
        for spec, secret in missing)
    return Invalid("unknown_secret", said)


def private_endpoints(specs: Iterable[JobSpec], allowed: bool) -> Invalid | None:
    """The push's refusal (422 ``private_endpoint``) of an ``[execute]`` URL that names a
    loopback or private address literally on a server that refuses them: each of its
    jobs would fail at once. (A name that resolves to one is refused at delivery.)"""
    if allowed:
        return None
    refused = [(s.name, why) for s in specs if s.execute is not None
               and (why := literal_refused(s.execute.url)) is not None]
    if not refused:
        return None
    return Invalid("private_endpoint", "; ".join(f"spec {spec}: [execute] url: {why}"
                                                  for spec, why in refused))
