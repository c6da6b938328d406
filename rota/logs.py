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
import copy
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

FORMAT = "%(asctime)s %(levelname)-7s %(name)s %(message)s"
FLUSH_EVERY = 0.05  # seconds: the longest an INFO line waits when the thread is not woken
WAKE_AT = 4096  # queued lines that wake the thread before its next look


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


class LeanRecord(logging.LogRecord):
    """A log record built with only what a line can show. The standard one also derives
    a file and module name from a path that is never known here (``_srcfile`` is off),
    tests a lone argument against an abstract base class, and looks up thread and
    process. With the lock-free ``BackgroundHandler.handle``, an INFO line costs its
    caller 3.3 µs instead of 4.6 (measured, 100,000 lines)."""

    def __init__(self, name: str, level: int, pathname: str, lineno: int, msg: object,
                 args: Any, exc_info: Any, func: str | None = None, sinfo: str | None = None,
                 **kwargs: Any) -> None:
        now = time.time_ns()
        self.name = name
        self.msg = msg
        if args and len(args) == 1 and type(args[0]) is dict and args[0]:
            args = args[0]  # log.info("%(key)s", {...}), as the standard record allows
        self.args = args
        self.levelname = _LEVEL_NAMES.get(level) or logging.getLevelName(level)
        self.levelno = level
        self.pathname = self.filename = self.module = pathname
        self.exc_info = exc_info
        self.exc_text = None
        self.stack_info = sinfo
        self.lineno = lineno
        self.funcName = func
        self.created = now / 1e9
        self.msecs = float(now % 1_000_000_000 // 1_000_000)
        self.relativeCreated = (self.created - _STARTED) * 1000.0
        self.thread = self.threadName = self.processName = self.process = None
        self.taskName = None


_LEVEL_NAMES = {level: logging.getLevelName(level) for level in
                (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)}
_STARTED = time.time()


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

    def handle(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        # No handler lock: emit only appends to a deque (atomic), and flush has a lock
        # of its own. The lock cost as much as the append.
        if self.filters and not self.filter(record):
            return False
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or self._closed:
            self._queue.append(record)
            self.flush()
            return
        self._queue.append(record)
        # The thread is not woken for a line or a burst: it looks every FLUSH_EVERY. A
        # thread woken in the middle of a job's path takes the GIL from it (measured: an
        # idle-path enqueue's assign waited behind the log thread). Only a queue that
        # grows large wakes it early, to bound the memory it holds.
        if len(self._queue) == WAKE_AT:
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
        # One line each, as if each had been logged alone, from a copy: the record is
        # shared with every other handler (pytest's, an embedder's), which may be
        # formatting it on another thread at this moment.
        line = copy.copy(record)
        for row in message.rows:
            line.msg, line.args = message.fmt, row
            lines.append(self.format(line))

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
    logging.setLogRecordFactory(LeanRecord)
    handler = BackgroundHandler()
    handler.setFormatter(Formatter(FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # uvicorn's per-connection chatter says nothing Rota's own lines don't.
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.getLogger("httpx").setLevel(logging.WARNING)
