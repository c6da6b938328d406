"""The egress module's import leaves sniffio's absence remembered: httpcore imports it at
each request's start and end, and a failed import is not cached, so each searched
sys.path again."""

from __future__ import annotations

import sys

import rota.server.egress_http  # noqa: F401


def test_the_missing_sniffio_is_remembered() -> None:
    assert "sniffio" in sys.modules  # the module, or None: absent
