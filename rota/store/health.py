"""Whether the store can do its work: degraded while its storage fails, and when it
recovers. The writer, the readers and the checkpointer (rota/store/writer.py,
rota/store/readers.py, and rota/store/pg.py's) report to one ``Health``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rota.base.errors import StorageError

log = logging.getLogger("rota.server")

RECOVER_AFTER = 5.0  # seconds with no storage failure before a good write means recovery


@dataclass(frozen=True, slots=True)
class Degraded:
    code: str
    message: str
    since: float  # wall-clock time the store became degraded


class Health:
    """Whether the store can do its work, as its threads find out; thread-safe.

    The first storage failure makes it degraded (one ERROR line; another only if the
    cause changes). A successful write (a commit, or the writer's probe) ends it once
    ``hold`` seconds have passed without a failure (one WARNING line). The wait is
    there because a failing disk often fails only some writes (a small commit fits in
    the WAL's old space where a large one does not), and a state that flipped with every
    commit would tell an operator nothing.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, hold: float | None = None) -> None:
        self._clock = clock
        self._wall = wall
        self._hold = RECOVER_AFTER if hold is None else hold
        self._lock = threading.Lock()
        self.degraded: Degraded | None = None
        self._last_failure = 0.0
        self._failures = 0  # since it became degraded

    def failed(self, error: StorageError) -> StorageError:
        """Record a failure; returns ``error``, for ``raise health.failed(...)``."""
        with self._lock:
            self._last_failure = self._clock()
            self._failures += 1
            was = self.degraded
            if was is not None and was.code == error.code:
                return error
            self.degraded = Degraded(error.code, error.message,
                                     was.since if was is not None else self._wall())
        log.error("storage degraded code=%s: %s%s; refused with 503 until it recovers",
                  error.code, error.message, f" (was {was.code})" if was is not None else "")
        return error

    def succeeded(self) -> None:
        """A write went through."""
        if self.degraded is None:  # the common case, without the lock
            return
        with self._lock:
            was, failures = self.degraded, self._failures
            if was is None or self._clock() - self._last_failure < self._hold:
                return
            self.degraded, self._failures = None, 0
        log.warning("storage recovered code=%s after %.1fs failed_operations=%d", was.code,
                    self._wall() - was.since, failures)
