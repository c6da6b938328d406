"""A database as ``--db`` names it: a PostgreSQL URL or a SQLite file. Here, and not in
rota/store/pg.py, so that telling them apart loads no psycopg (50 ms of a SQLite
server's start)."""

from __future__ import annotations

import re

SCHEMES = ("postgresql://", "postgres://")


def is_url(text: str | object) -> bool:
    """Whether a --db value names a PostgreSQL database rather than an SQLite file."""
    return isinstance(text, str) and text.startswith(SCHEMES)


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)
