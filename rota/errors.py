"""Errors the server answers with. Frame errors on /work are protocol.FrameError."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
