"""Log lines, as the library writes them: pure, no threads, no I/O.

Library modules log through the documented names, ``logging.getLogger("rota.server")``
and ``("rota.worker")`` (not ``__name__``: a module's place is not a name users filter on);
how lines are formatted and written (a thread of their own, text or JSON) is the command line's (rota/cli/logsetup.py).

A hot path that logs one line per job of a batch (each job of an ``assign``, each result
of a heartbeat) logs one record whose message is ``Lines``: the caller pays for one
record, and the command line's writer writes one line per job, each with the usual prefix.
And what a client sends that ends up in a line goes through ``printable`` first.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

# What a client sends that ends up in a line (a path, a hostname, a decoder's message
# quoting a value) is cut to this many characters.
PRINTABLE_LIMIT = 200


def printable(text: str, limit: int = PRINTABLE_LIMIT) -> str:
    """``text`` made safe for one log line: cut to ``limit`` characters, and every
    character that is not printable (newlines, escape sequences, bidirectional overrides)
    written as its Python escape. No client can then forge a line, or colour a terminal."""
    if len(text) > limit:
        text = text[:limit] + "…"
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class Lines:
    """Several log lines of one format in one record: ``fmt % row`` for each row. Shown
    as one line per row by the CLI's writer (rota/cli/logsetup.py); elsewhere (a handler
    of the caller's own, pytest's caplog) as one message of several lines."""

    __slots__ = ("fmt", "rows")

    def __init__(self, fmt: str, rows: Sequence[tuple[Any, ...]]) -> None:
        self.fmt = fmt
        self.rows = rows

    def __str__(self) -> str:
        return "\n".join(self.fmt % row for row in self.rows)


def log_lines(logger: logging.Logger, level: int, fmt: str,
              rows: Sequence[tuple[Any, ...]]) -> None:
    """``logger.log(level, fmt, *row)`` for each row, for the price of one record."""
    if rows and logger.isEnabledFor(level):
        logger.log(level, Lines(fmt, rows))
