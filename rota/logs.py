"""Logging for the command line; library modules only call logging.getLogger(__name__)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)-7s %(name)s %(message)s"


def configure(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT, force=True)
    # uvicorn's per-connection chatter says nothing Rota's own lines don't.
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.getLogger("httpx").setLevel(logging.WARNING)
