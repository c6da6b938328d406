"""Rota's errors, in one place: every exception a user of Rota can catch is a RotaError.

    RotaError            code + message, what the other side is told
    ├── DomainError      the core refuses an operation; the API layer picks the HTTP status
    │   ├── NotFound     no such job, spec or worker
    │   │   └── NoSuchJob    the job named does not exist (a 404 may then hint at its kept id)
    │   ├── Conflict     it exists, but its state does not allow this
    │   │   └── UniqueConflict  a unique job's key is held: ``details`` name the holder
    │   ├── Invalid      the request does not make sense (bad option, unknown spec)
    │   ├── Forbidden    the caller's token does not allow it
    │   └── TooLarge     over a size limit
    ├── RequestError     an HTTP request refused: answered with ``status`` and a JSON body
    │   └── OjsRefusal   an /ojs/v1 request refused, with OJS's error ``type``
    │                    (rota/core/ojs_map.py; answered by rota/server/ojs_base.py)
    ├── FrameError       a /work frame refused: an ``error`` frame, then ``close_code``
    ├── BadJson          a body or frame refused while it is decoded (rota/base/inputs.py);
    │                    also a ValueError; each door turns it into one of the two above
    ├── RegistrationRefused  the worker: the server refused its registration for good
    │                    (``invalid_message``); run() raises it rather than reconnect
    ├── StorageError     the database cannot do its part now (full, read-only, failing):
    │                    503 with ``Retry-After`` on HTTP; a result is rejected on /work
    ├── DatabaseInUse    another server holds the database file: this one must not start
    ├── DatabaseLinked   the database file has more than one name (hard links)
    ├── NewerDatabase    the database was migrated by a newer Rota (rota/store/sqlite.py)
    ├── Refused          `rota serve` cannot start; the message says why (rota/server/startup.py)
    ├── InvalidTransition a job asked for a move its lifecycle forbids: a bug (rota/core/model.py)
    ├── SpecError        a spec file or a job's arguments do not fit (rota/base/specs.py); also
    │                    a ValueError
    ├── ApiError         the producer clients: the server refused a request, or could not
    │                    be reached (``from rota import ApiError``)
    ├── JobError         the producer clients: the job ended without a result
    ├── ResultTimeout    the producer clients: no result within the timeout; also a
    │                    TimeoutError
    ├── WorkflowError    the producer clients: the workflow failed or was cancelled
    ├── JobFailed        raised by a worker's handler: the job failed (``ctx.fail``)
    ├── ResultTooLarge   the worker: a handler's result too large to send; the job fails
    │                    with it, not retried (rota/worker/execution.py)
    ├── ResultTooDeep    the worker: a handler's result nested too deep to send, likewise
    └── ChildDied        the worker: the child process running an isolated handler died;
                         the job fails with it, retried (rota/worker/isolation.py)

"""
from __future__ import annotations

from typing import Any


class RotaError(Exception):
    """Something Rota refuses, with a machine-readable ``code`` and a sentence."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class DomainError(RotaError):
    """The core refuses an operation; what it means for HTTP is the API layer's business."""


class NotFound(DomainError):
    """No such thing."""


class NoSuchJob(NotFound):
    """The job named does not exist (not its spec, not a worker)."""

    def __init__(self, job_id: str) -> None:
        super().__init__("not_found", f"no job {job_id}")


class Conflict(DomainError):
    """It exists, but its state does not allow this."""


class UniqueConflict(Conflict):
    """409 ``unique_conflict``: a unique job's key is held (rota/core/unique.py);
    ``details`` name the job that holds it, its state and the key."""

    def __init__(self, message: str, details: dict[str, Any]) -> None:
        super().__init__("unique_conflict", message)
        self.details = details


class Invalid(DomainError):
    """The request does not make sense."""


class Forbidden(DomainError):
    """The caller's token does not allow this."""


class TooLarge(DomainError):
    """Over a size limit."""


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
        # The worker_id the refused frame gave, if it gave a string: for the log line
        # of a registration refused before the connection has a worker.
        self.worker_id: str | None = None


class RegistrationRefused(RotaError):
    """The server refused a worker's registration for a reason a retry would not change
    (``invalid_message``): ``Worker.run()`` raises it instead of reconnecting for ever."""


class StorageError(RotaError):
    """The database cannot do its part now: its disk is full, its file is read-only or
    locked elsewhere, the disk fails reads or writes, or the file is damaged. Nothing of
    the refused operation was stored; the same request may succeed ``retry_after``
    seconds later. rota/store/sqlite.py makes these from SQLite's errors and keeps the original
    as ``__cause__``."""

    def __init__(self, code: str, message: str, retry_after: int) -> None:
        super().__init__(code, message)
        self.retry_after = retry_after


class DatabaseInUse(RotaError):
    """Another Rota server holds this database file (rota/store/dblock.py ``hold_database``).

    Two servers on one file would each keep their own view of the jobs in memory and
    give the same job to two workers; the second one refuses to start instead."""

    def __init__(self, path: str, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "its pid unknown"
        super().__init__("database_in_use",
                         f"{path} is in use by another rota serve ({holder}); stop it first"
                         " or use another --db")
        self.pid = pid


class DatabaseLinked(RotaError):
    """The SQLite database file has other names (hard links). SQLite keeps its write-ahead
    log beside the name it opened, so two names of one file are two logs: writes through
    one are not seen through the other, and the file can be damaged. Rota refuses to open
    such a file rather than split it."""

    def __init__(self, path: str, links: int) -> None:
        super().__init__("database_linked",
                         f"{path} has {links} hard links: SQLite keeps a write-ahead log"
                         " beside each name, so two names of one file split it; remove the"
                         f" other names (find them with: find / -xdev -samefile {path})")
        self.links = links


class ApiError(RotaError):
    """The server refused a request, or could not be reached. ``status`` is the HTTP
    status (None when no answer came), ``code`` the server's error code or one of the
    client's own: ``unreachable``, ``no_answer``, ``https_expected``, ``http_expected``,
    ``not_the_api``, ``client_closed``, ``client_error``."""

    def __init__(self, status: int | None, code: str, message: str) -> None:
        super().__init__(code, message)
        self.args = (f"{code}: {message}",)  # its text names the code too
        self.status = status


class JobError(RotaError):
    """The job ended without a result: ``state`` is ``discarded`` (its attempts ran out,
    or an error said not to retry) or ``cancelled``, and ``code`` is ``job_<state>``.
    ``error_type`` and ``error_message`` are the last error a worker reported (None for a
    job cancelled before it failed); ``error`` is that error whole, with its ``details``
    (the traceback, say)."""

    def __init__(self, job_id: str, state: str, error: dict[str, Any] | None) -> None:
        self.job_id = job_id
        self.state = state
        self.error = error
        self.error_type: str | None = error.get("type") if error else None
        self.error_message: str | None = error.get("message") if error else None
        why = f": {self.error_type}: {self.error_message}" if error else ""
        if state == "cancelled" and self.error_type == "cancelled":  # the cancel's own stop
            how = (self.error_message or "").removesuffix(": cancelled")
            why = f" ({how})" if how else ""
        super().__init__(f"job_{state}", f"job {job_id} was {state}{why}")


class ResultTimeout(RotaError, TimeoutError):
    """The job (or workflow: ``what``) had not finished within the timeout given to
    ``result()``; it goes on, and ``result()`` may be called again. ``state`` is the state
    it was last seen in; ``job_id`` is the workflow's id for a workflow."""

    def __init__(self, job_id: str, state: str, timeout: float, *, what: str = "job") -> None:
        super().__init__("result_timeout",
                         f"{what} {job_id} has not finished after {timeout:g}s (it is {state})")
        self.job_id = job_id
        self.state = state
        self.timeout = timeout


class WorkflowError(RotaError):
    """The workflow ended without a result: ``state`` is ``failed`` or ``cancelled``, and
    ``code`` is ``workflow_<state>``. ``error`` is its error record as ``GET
    /workflows/{id}`` shows it (``failed_job_ids``, and ``errors``: each failed job's
    ``job_id``, ``code``, ``message``, ``attempt``), None for a cancelled one."""

    def __init__(self, workflow_id: str, state: str, error: dict[str, Any] | None) -> None:
        self.workflow_id = workflow_id
        self.state = state
        self.error = error
        self.errors: list[dict[str, Any]] = list((error or {}).get("errors") or [])
        why = ""
        if self.errors:
            first = self.errors[0]
            more = f" (and {len(self.errors) - 1} more)" if len(self.errors) > 1 else ""
            why = f": job {first.get('job_id')}: {first.get('code')}: {first.get('message')}{more}"
        super().__init__(f"workflow_{state}", f"workflow {workflow_id} {state}{why}")


class JobFailed(RotaError):
    """A failure reported by ``ctx.fail(message)``, or raised by a handler that has no
    exception of its own to raise; ``retryable=False`` ends the job without retries."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__("job_failed", message)
        self.retryable = retryable


def failure_level(error: BaseException | None) -> int:
    """The level to log a failed write at. A StorageError is logged once, when the store
    becomes degraded (rota/store/health.py ``Health``): each write it then refuses is DEBUG,
    or a full disk would write a line per request."""
    import logging  # here: the bottom loads no logging (and with it no threading) on import

    return logging.DEBUG if isinstance(error, StorageError) else logging.ERROR
