"""Logging for the command line: how lines are formatted and written. Library modules log
through ``logging.getLogger("rota.server")`` or ``("rota.worker")``, and rota/base/logs.py
(pure) gives them ``Lines`` and ``printable``.

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

``--log-format json`` swaps only the formatter (``JsonFormatter``): one JSON object a
line. The callers keep logging ``"assign job=%s spec=%s@%s ..."`` as before; the fields
are read off the format string (once per format, cached) and paired with the record's
arguments on the background thread, so JSON costs the event loop nothing more.
"""

from __future__ import annotations

import atexit
import collections
import copy
import logging
import operator
import re
import sys
import threading
import time
from typing import Any, TextIO

import click
import msgspec

from rota.base.logs import Lines

FORMAT = "%(asctime)s %(levelname)-7s %(name)s %(message)s"
FLUSH_EVERY = 0.05  # seconds: the longest an INFO line waits when the thread is not woken
WAKE_AT = 4096  # queued lines that wake the thread before its next look


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

    def head(self, record: logging.LogRecord) -> str | None:
        """What ``format`` writes before the message, if this is Rota's own format and
        the record carries no traceback (None: each line is formatted whole). A batch's
        rows share it (``BackgroundHandler``): a sixth of the cost of a line each."""
        if type(self) is not Formatter or self._fmt != FORMAT or record.exc_info \
                or record.stack_info:
            return None
        return f"{self.formatTime(record)} {record.levelname:<7} {record.name} "


# One %-conversion of a format string, with the ``key=`` (or the ``@`` of spec@checksum)
# just before it; and a literal ``key=value`` (``outcome=completed``, ``by=server``).
_CONVERSION = re.compile(r"(?:(\w+)=|(@))?%(?:\((\w+)\))?[-#0 +]*\d*(?:\.\d+)?[a-zA-Z%]")
_LITERAL = re.compile(r"(?<![\w%])(\w+)=([^\s%=]+)(?=\s|$)")
FORMATS_KEPT = 1000  # formats whose plan is cached; a message built per call (an f-string)
# must not grow the cache without bound


class _Plan:
    """What a format string says about its arguments: which argument is which field
    (``names`` and ``pick``, an itemgetter of those arguments: by position, or by key
    for a %(key)s format), and what is the same on every line of it (``static``: the
    literal fields, and ``event``, the words before the first field: "assign",
    "attempt ended")."""

    __slots__ = ("names", "pick", "static")

    def __init__(self, fmt: str) -> None:
        fields: list[tuple[int | str, str]] = []
        self.static: dict[str, str] = {}
        index, last, first = 0, "", None
        for match in _CONVERSION.finditer(fmt):
            name, at, key = match.group(1), match.group(2), match.group(3)
            if match.group(0).endswith("%") and not key:
                continue  # "%%": no argument
            label = name or ("checksum" if at and last == "spec" else None)
            if label is not None and label not in _BASE:
                fields.append((key or index, label))
            if label is not None:
                first = match.start() if first is None else first
            last = label or ""
            index += 1
        for match in _LITERAL.finditer(fmt):
            if match.group(1) not in _BASE:
                self.static[match.group(1)] = match.group(2).rstrip(":,;")
            first = match.start() if first is None else min(first, match.start())
        words = fmt[:first].strip().rstrip(":") if first else ""
        if words and "%" not in words:
            self.static = {"event": words, **self.static}
        self.names = tuple(name for _, name in fields)
        self.pick = operator.itemgetter(*(where for where, _ in fields)) if fields else None

    def into(self, line: dict[str, Any], args: Any) -> None:
        line.update(self.static)
        if self.pick is None or not args:
            return
        try:
            values = self.pick(args)
        except (IndexError, KeyError, TypeError):
            return  # a format and arguments that disagree: getMessage has said so
        if len(self.names) == 1:
            line[self.names[0]] = values
        else:
            line.update(zip(self.names, values))


_PLANS: dict[str, _Plan] = {}
_BASE = frozenset({"time", "level", "logger", "message", "exc_info", "stack_info"})


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (RFC 3339, UTC), ``level``, ``logger``,
    ``message`` (the text line's message), and for a line with ``key=value`` parts its
    ``event`` and each field with its value as logged (a number stays a number)."""

    _second = -1
    _prefix = ""
    _encode = msgspec.json.Encoder(enc_hook=str).encode

    def format(self, record: logging.LogRecord) -> str:
        line = self._head(record)
        line["message"] = record.getMessage()
        if type(record.msg) is str:
            self._plan(record.msg).into(line, record.args)
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack_info"] = record.stack_info
        return self._encode(line).decode()

    def format_lines(self, lines: list[str], record: logging.LogRecord, batch: Lines) -> None:
        """A batch's lines: what they share (time, level, logger, the plan) made once,
        not once a row as ``format`` would (the hot path: a line per job)."""
        head, plan, fmt, encode = self._head(record), self._plan(batch.fmt), batch.fmt, self._encode
        for row in batch.rows:
            line = head.copy()
            line["message"] = fmt % row
            plan.into(line, row)
            lines.append(encode(line).decode())

    def _head(self, record: logging.LogRecord) -> dict[str, Any]:
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return {"time": f"{self._prefix}.{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name}

    @staticmethod
    def _plan(fmt: str) -> _Plan:
        plan = _PLANS.get(fmt)
        if plan is None:
            if len(_PLANS) >= FORMATS_KEPT:
                _PLANS.clear()
            plan = _PLANS[fmt] = _Plan(fmt)
        return plan


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
        if isinstance(self.formatter, JsonFormatter):
            self.formatter.format_lines(lines, record, message)  # (it changes no record)
            return
        if isinstance(self.formatter, Formatter) and \
                (head := self.formatter.head(record)) is not None:
            fmt = message.fmt  # (as getMessage: a row with no arguments is fmt as it is)
            lines.extend([head + (fmt % row if row else fmt) for row in message.rows])
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


FORMATS = ("text", "json")


# The libraries whose DEBUG lines are theirs, not Rota's: every frame of a worker's
# WebSocket (two heartbeats a second when idle), every HTTP request, the event loop's and
# the process pool's chatter. ``debug`` keeps them at INFO, so that Rota's own lines (a
# worker's "job ended" per job) stand out; ``trace`` lets them through as well.
LIBRARIES = ("websockets", "httpx", "httpcore", "asyncio", "uvicorn", "multiprocessing",
             "psycopg")


def configure(level: str = "info", fmt: str = "text") -> None:
    # What a record would otherwise gather and the format never shows; these switches
    # are the ones the logging documentation names for this.
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.setLogRecordFactory(LeanRecord)
    handler = BackgroundHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else Formatter(FORMAT))
    trace = level == "trace"
    logging.basicConfig(level="DEBUG" if trace else level.upper(), handlers=[handler],
                        force=True)
    root = logging.getLogger().level
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(logging.NOTSET if trace else max(logging.INFO, root))
    if not trace:
        # uvicorn's per-connection chatter says nothing Rota's own lines don't, nor does
        # httpx's line per request (at INFO).
        logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING, root))
        logging.getLogger("httpx").setLevel(max(logging.WARNING, root))


# The options of the commands that log (rota serve, rota worker).
# (trace: debug, and the libraries' own debug lines too; see LIBRARIES)
LEVELS = click.Choice(["trace", "debug", "info", "warning", "error"])
LOG_FORMAT = click.option(
    "--log-format", envvar="ROTA_LOG_FORMAT", show_envvar=True, default="text",
    show_default=True, type=click.Choice(FORMATS),
    help="text: one readable line a record; json: one JSON object a line (time, level,"
         " logger, message, and fields such as job, spec, queue, worker, duration_ms).")
