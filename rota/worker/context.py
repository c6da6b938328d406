"""What a job handler works with: ``JobContext`` (identity, arguments, lease, live
status, and in manual mode its outcome) and the buffer that carries its status to the
next heartbeat; and the errors that fail a job whose result cannot be sent. Imports only
``rota.base``: a worker needs none of the server.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rota.base import protocol as p
from rota.base.errors import JobFailed, RotaError  # JobFailed: public here too
from rota.base.inputs import MAX_DEPTH

log = logging.getLogger("rota.worker")
MAX_HELD_LINES = 1000  # log lines held for the server (while away, too); the oldest go first
MAX_LINES_PER_BEAT = 200
MAX_ALERTS_PER_BEAT = 20
STATUS_BYTES_PER_BEAT = 192 * 1024  # what status may add to a frame (the server takes 1 MiB)
ENTRY_OVERHEAD = 128  # bytes an entry adds around its message once encoded, at most
MAX_HELD_ALERTS = 100
LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(slots=True)
class JobContext:
    """What a handler gets: the job's identity, attempt and arguments."""

    id: str
    spec: str
    queue: str
    attempt: int
    args: Any
    priority: int
    checksum: str
    enqueued_at: str
    worker_id: str
    visibility_timeout: float
    capture_logs: bool = False
    # A workflow's step: its workflow's id, and the results of the steps it follows, by
    # step index as text ({"0": ..., "1": ...}; README, Workflows). {} for other jobs.
    workflow_id: str | None = None
    parent_results: dict[str, Any] = field(default_factory=dict)
    _extend: Callable[[], None] = field(repr=False, default=lambda: None)
    _status: StatusBuffer | None = field(repr=False, default=None)
    _outcome: asyncio.Future[Any] | None = field(repr=False, default=None)  # manual mode
    _stopped: Callable[[], bool] = field(repr=False, default=lambda: False)  # handler mode

    def heartbeat(self) -> Awaitable[None]:
        """Say the job is alive: its lease starts again from now. Call it more often than
        ``visibility_timeout`` in long jobs: ``await ctx.heartbeat()`` in async handlers,
        plain ``ctx.heartbeat()`` in sync ones (it is safe from any thread)."""
        self._extend()
        return _DONE

    def progress(self, percent: float, message: str | None = None) -> None:
        """How far the job is (0-100), with an optional message; the latest figure goes to
        the server with the next heartbeat and shows in ``GET /jobs/{id}``."""
        if self._status is not None:
            self._status.progress(self.id, percent, message)

    def log(self, message: str, level: str = "info") -> None:
        """A log line for this job. It always goes to the worker's own log; it is kept
        with the job on the server only if the job was enqueued with ``capture_logs``."""
        check_level(level)
        log.log(logging.getLevelName(level.upper()), "job=%s %s", self.id, message)
        if self.capture_logs and self._status is not None:
            self._status.log(self.id, message, level)

    def alert(self, message: str, level: str = "warning") -> None:
        """Something an operator should see now: sent at once, logged by the server, kept
        with the job and shown with the worker in ``GET /workers``."""
        check_level(level)
        if self._status is not None:
            self._status.alert(message, level, self.id)

    @property
    def cancelled(self) -> bool:
        """True once the worker stopped this job (a ``cancel`` from the server, a lapsed
        lease, a shutdown past its grace): stop working on it; its outcome is reported.
        A plain function on a thread cannot be interrupted: it should look at this between
        steps of a long job (an async handler is cancelled at its next ``await``)."""
        return self._stopped() or (self._outcome is not None and self._outcome.cancelled())

    # -- manual mode (worker.listen()): the caller reports the outcome -----------------
    def complete(self, result: Any = None) -> bool:
        """Manual mode: the job succeeded with ``result`` (any JSON value). Returns False
        if the job had been stopped meanwhile (then nothing is reported for it again)."""
        return self._settle(result, None)

    def fail(self, error: BaseException | str, *, retryable: bool = True) -> bool:
        """Manual mode: the job failed, with an exception or a message. Returns False if
        the job had been stopped meanwhile."""
        exc = error if isinstance(error, BaseException) else JobFailed(error, retryable=retryable)
        return self._settle(None, exc)

    def _settle(self, result: Any, error: BaseException | None) -> bool:
        if self._outcome is None:
            raise RuntimeError("complete() and fail() are for jobs taken with worker.listen();"
                               " a handler returns its result or raises")
        if self._outcome.done():
            return False
        if error is not None:
            self._outcome.set_exception(error)
        else:
            self._outcome.set_result(result)
        return True


def check_level(level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}, not {level!r}")


class StatusBuffer:
    """Progress, log lines and alerts from handlers, held for the next heartbeat.

    Handlers in threads call it too, hence the lock. It is bounded: the latest progress
    per job, at most MAX_HELD_LINES lines (the oldest are dropped, and a line says how
    many) and MAX_HELD_ALERTS alerts. Alerts wake the heartbeat at once."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._lock = threading.Lock()
        self._progress: dict[str, p.Progress] = {}
        self._lines: collections.deque[p.LogLine] = collections.deque()
        self._dropped: collections.Counter[str] = collections.Counter()
        self._alerts: collections.deque[p.Alert] = collections.deque(maxlen=MAX_HELD_ALERTS)

    def progress(self, job_id: str, percent: float, message: str | None) -> None:
        figure = p.Progress(job_id=job_id, percent=min(100.0, max(0.0, float(percent))),
                            message=None if message is None else p.cut_text(str(message)))
        with self._lock:
            self._progress[job_id] = figure

    def log(self, job_id: str, message: str, level: str) -> None:
        line = p.LogLine(job_id=job_id, message=p.cut_text(str(message)), level=level,  # type: ignore[arg-type]
                         time=p.rfc3339(time.time()))
        with self._lock:
            if len(self._lines) >= MAX_HELD_LINES:
                self._dropped[self._lines.popleft().job_id] += 1
            self._lines.append(line)

    def alert(self, message: str, level: str, job_id: str | None) -> None:
        with self._lock:
            self._alerts.append(p.Alert(message=p.cut_text(str(message)), level=level,  # type: ignore[arg-type]
                                        job_id=job_id))
        self._wake()

    def fill(self, status: p.Status, budget: int = STATUS_BYTES_PER_BEAT) -> None:
        """Move what is held into ``status``, within ``budget`` encoded bytes: alerts
        first, then progress, then log lines; what does not fit waits for the next beat."""
        def fits(message: str | None) -> bool:
            nonlocal budget
            size = ENTRY_OVERHEAD + (len(message.encode()) if message else 0)
            budget -= size
            return budget >= 0

        with self._lock:
            while self._alerts and len(status.alerts) < MAX_ALERTS_PER_BEAT \
                    and fits(self._alerts[0].message):
                status.alerts.append(self._alerts.popleft())
            for job_id in list(self._progress):
                if not fits(self._progress[job_id].message):
                    break
                status.progress.append(self._progress.pop(job_id))
            for job_id in list(self._dropped):
                note = f"{self._dropped[job_id]} earlier log line(s) dropped: buffer full"
                if not fits(note):
                    break
                del self._dropped[job_id]
                status.logs.append(p.LogLine(job_id=job_id, level="warning", message=note))
            while self._lines and len(status.logs) < MAX_LINES_PER_BEAT \
                    and fits(self._lines[0].message):
                status.logs.append(self._lines.popleft())


class _Done:
    """An awaitable that is already finished: lets heartbeat() serve sync code too."""

    def __await__(self) -> Iterator[None]:
        return iter(())


_DONE = _Done()


# A heartbeat's object, its results and the result's own object come first (protocol §7).
RESULT_DEPTH = MAX_DEPTH - 3


class ResultTooLarge(RotaError):
    """A result too large to send: running the job again would not make it smaller."""

    retryable = False
    error_type = "result_too_large"  # the name the server gives the same failure

    def __init__(self, message: str) -> None:
        super().__init__(self.error_type, message)


class ResultTooDeep(RotaError):
    """A result nested deeper than a frame may carry (protocol §7, ``too_deep``): sent,
    it would end the connection, and be sent again on the next one."""

    retryable = False
    error_type = "result_too_deep"

    def __init__(self, message: str) -> None:
        super().__init__(self.error_type, message)
