"""Logging for the command line; library modules only call logging.getLogger(__name__).

The server logs a line per enqueue, assignment and result, so at full speed it writes
thousands of lines a second. Done the usual way, each line costs its caller a stack walk
(to find the calling function, which the format never shows), a thread-name lookup, the
formatting and a write system call, all on the event loop. Here a record is only built
(cheaply, see ``configure``) and queued; a background thread formats whatever has queued
up and writes it in one call. Warnings and worse are written at once, after everything
queued before them, so that a line that matters is never held back, even by a crash.

A hot path that logs one line per job of a batch (each job of an ``assign``, each result
of a heartbeat) logs one record whose message is ``Lines``: the caller pays for one
record, and the background thread writes one line per job, each with the usual prefix.
"""

from __future__ import annotations

import atexit
import collections
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

FORMAT = "%(asctime)s %(levelname)-7s %(name)s %(message)s"
FLUSH_EVERY = 0.05  # seconds: the longest an INFO line waits when the thread is not woken


class Lines:
    """Several log lines of one format in one record: ``fmt % row`` for each row. Shown
    as one line per row by ``BackgroundHandler``; elsewhere (a handler of the caller's
    own, pytest's caplog) as one message of several lines."""

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


class Formatter(logging.Formatter):
    """The standard format, with the date part of a timestamp made once a second rather
    than once a line (strftime was a tenth of the logging thread's time at full speed)."""

    _second = -1
    _prefix = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%d %H:%M:%S", self.converter(second))
        return f"{self._prefix},{int(record.msecs):03d}"


class BackgroundHandler(logging.Handler):
    """Formats and writes records on a thread of its own, many lines per write."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__()
        self.stream = stream if stream is not None else sys.stderr
        self._queue: collections.deque[logging.LogRecord] = collections.deque()
        self._ready = threading.Event()
        self._write_lock = threading.Lock()  # one writer at a time, in queue order
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="rota-log", daemon=True)
        self._thread.start()
        atexit.register(self.flush)

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or self._closed:
            self._queue.append(record)
            self.flush()
            return
        self._queue.append(record)
        if len(self._queue) == 1:  # the thread may be asleep: one wake-up per burst
            self._ready.set()

    def flush(self) -> None:
        with self._write_lock:
            lines: list[str] = []
            while self._queue:
                record = self._queue.popleft()
                try:
                    self._format_into(lines, record)
                except Exception:  # a bad format string must not take the logger down
                    self.handleError(record)
            if lines:
                try:
                    self.stream.write("\n".join(lines) + "\n")
                    self.stream.flush()
                except (OSError, ValueError):  # a closed or broken stream: nothing to do
                    pass

    def _format_into(self, lines: list[str], record: logging.LogRecord) -> None:
        message = record.msg
        if not isinstance(message, Lines):
            lines.append(self.format(record))
            return
        for row in message.rows:  # one line each, as if each had been logged alone
            record.msg, record.args = message.fmt, row
            lines.append(self.format(record))
        record.msg, record.args = message, ()

    def close(self) -> None:
        self._closed = True
        self.flush()
        super().close()

    def _run(self) -> None:
        while not self._closed:
            self._ready.wait(FLUSH_EVERY)
            self._ready.clear()
            self.flush()


def configure(level: str = "info") -> None:
    # What a record would otherwise gather and the format never shows; these switches
    # are the ones the logging documentation names for this.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = BackgroundHandler()
    handler.setFormatter(Formatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # uvicorn's per-connection chatter says nothing Rota's own lines don't.
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.getLogger("httpx").setLevel(logging.WARNING)
