"""Rota's errors, in one place.

    RotaError            code + message, what the other side is told
    ├── RequestError     an HTTP request refused: answered with ``status`` and a JSON body
    └── FrameError       a /work frame refused: an ``error`` frame, then ``close_code``
"""

from __future__ import annotations


class RotaError(Exception):
    """Something Rota refuses, with a machine-readable ``code`` and a sentence."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class RequestError(RotaError):
    """A request the server refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(code, message)
        self.status = status


class FrameError(RotaError):
    """A frame the server cannot accept; ``close_code`` ends the connection."""

    def __init__(self, code: str, message: str, close_code: int) -> None:
        super().__init__(code, message)
        self.close_code = close_code
