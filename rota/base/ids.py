"""Identifiers: UUIDv7 (RFC 9562), time-ordered so ids sort roughly by creation; the
rule for the job ids producers give; and how an id goes into a URL."""

from __future__ import annotations

import os
import time
import urllib.parse


def uuid7() -> str:
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (millis & ((1 << 48) - 1)) << 80
    value |= 0x7 << 76  # version
    value |= (rand >> 68) << 64 & (0xFFF << 64)  # rand_a, 12 bits
    value |= 0b10 << 62  # variant
    value |= rand & ((1 << 62) - 1)  # rand_b
    digits = f"{value:032x}"  # what str(uuid.UUID(int=value)) gives, in a third of the time
    return f"{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}"


# A job id a producer gives (POST /jobs "id"): 1-128 of these characters, starting with a
# letter or digit. No "/": an id is one segment of a URL (/jobs/{id}, /ui/jobs/{id}), and
# a slash, even percent-encoded, is one that proxies and browsers treat as a separator
# (a "a/../victim" link resolved to the job "victim"). No space or control character, so
# that no id can forge a line of a log. Jobs stored by earlier versions may hold a "/":
# JOB_REF_PATTERN (rota/base/protocol.py) still names them.
# A token's name: 1-100 characters, none a control (C0, DEL, C1), a text-direction or
# zero-width mark (a name shown in a list must read as what it is), nor "/", since a
# name is one segment of DELETE /tokens/{id or name}.
TOKEN_NAME_PATTERN = (r"^[^\x00-\x1f\x7f-\x9f/\u200b-\u200f\u2028-\u202e\u2060-\u206f"
                      r"\ufeff]{1,100}$")
TOKEN_NAME_RULE = ("a token name is 1 to 100 characters, with no '/', control character,"
                   " text-direction or zero-width mark")
MAX_JOB_ID = 128
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@+=-]{0,127}$"
_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_ALLOWED = _FIRST | frozenset("_.:@+=-")


def _named(char: str) -> str:
    """A character as an error names it: its code point, and itself if it is printable."""
    code = f"U+{ord(char):04X}"
    return f"{code} {char!r}" if char.isprintable() and not char.isspace() else code


def job_id_problem(job_id: str) -> str | None:
    """Why ``job_id`` is not a job id a producer may give (None if it is one), naming
    the first character refused and where it is; the id itself is not repeated, since it
    may hold what a terminal or a log must not print."""
    rule = (f"a job id is 1 to {MAX_JOB_ID} characters from A-Z a-z 0-9 _ . : @ + = -,"
            " starting with a letter or digit")
    if not job_id:
        return f"the job id is empty: {rule}"
    if len(job_id) > MAX_JOB_ID:
        return f"the job id is {len(job_id)} characters long: {rule}"
    if job_id[0] not in _FIRST:
        return f"the job id starts with {_named(job_id[0])}: {rule}"
    for index, char in enumerate(job_id):
        if char not in _ALLOWED:
            why = " (an id is one segment of a URL)" if char in "/\\" else ""
            return f"the job id holds {_named(char)} at character {index + 1}{why}: {rule}"
    return None


def path_segment(value: str) -> str:
    """``value`` as one segment of a URL path: every character but letters, digits and
    ``_.-~`` percent-encoded ("/" too), and "." or ".." encoded whole, so that no
    client or browser resolves it as a dot segment. Any id a route is given reaches that
    route, and only it."""
    quoted = urllib.parse.quote(value, safe="")
    return quoted.replace(".", "%2E") if quoted in (".", "..") else quoted

def dashboard_base(url: str) -> str | None:
    """The server's base URL if ``url`` is its dashboard's (``/ui`` or under it: not the
    API, nor /work), else None."""
    parts = urllib.parse.urlsplit(url)
    segments = parts.path.split("/")
    if "ui" not in segments:
        return None
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc,
                                    "/".join(segments[:segments.index("ui")]), "", ""))


def ws_url(url: str) -> str:
    """The /work endpoint for a server base URL (http -> ws, https -> wss)."""
    base = url.rstrip("/")
    if base.startswith("http"):
        base = "ws" + base[4:]
    return base if base.endswith("/work") else base + "/work"
