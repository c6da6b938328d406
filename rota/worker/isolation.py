"""Process isolation: handlers registered with ``isolation="process"`` run in child processes,
so that a cancel, a lapsed lease or a shutdown really stops their work.

A thread cannot be interrupted (rota/worker/execution.py abandons it); a process can. A
run given up is stopped with SIGTERM (raised in the handler as an exception that is a
BaseException, so its ``finally`` blocks run), then SIGKILL after ``grace`` seconds, and
its run ends only once the child is gone: a job reported stopped is stopped. The children
are a pool, kept across jobs (a job costs two pipe messages, not a process start); a
child stopped or dead is not reused, and the next job starts a new one.

Children start from multiprocessing's ``forkserver`` (``spawn`` where there is none), never
by forking the worker itself, whose threads and event loops a fork would copy half-way. A
child imports its handler by name, so the handler must be a function defined at the top
level of a module, and a script that starts a worker must do so under
``if __name__ == "__main__":``. What a handler says through its context (heartbeats,
progress, log lines, alerts) and what it logs with ``logging`` go to the worker over the
pipe, as they would from a thread; its result is encoded to JSON in the child, and an
exception comes back with its type, message, ``retryable`` and the child's traceback. A
child that dies (killed by the OS, ``os._exit``) fails its job with ``child_died``, which
is retried as any failure; the worker runs on. A child heeds only its worker's SIGTERM
and dies with its worker.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rota.base import protocol as p
from rota.base.errors import RotaError
from rota.base.specs import SpecError
from rota.worker.context import JobContext, check_level

log = logging.getLogger("rota.worker")
MODES = ("thread", "process")
CHILD_NAME = "rota-child"
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL for a child whose run is given up
Handler = Callable[[JobContext], Any]
# The JobContext fields a child gets; the rest (callbacks) it makes itself.
FIELDS = ("id", "spec", "queue", "attempt", "args", "priority", "checksum", "enqueued_at",
          "worker_id", "visibility_timeout", "capture_logs")


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise ValueError(f"isolation must be 'thread' or 'process', not {mode!r}")
    return str(mode)


def check_importable(spec: str, fn: Handler) -> None:
    """At registration: what makes a handler impossible to find by name in a child."""
    name = getattr(fn, "__qualname__", None)
    module = getattr(fn, "__module__", None)
    why = None
    if name is None or module is None:
        return  # not a plain function (a bound method, a partial): judged at start
    if "<lambda>" in name:
        why = f"{name} is a lambda"
    elif "<locals>" in name:
        why = f"{name} is defined inside a function"
    elif module == "__main__" and not getattr(sys.modules.get("__main__"), "__file__", None):
        why = f"{name} is defined in an interactive session or `python -c`"
    if why is not None:
        raise SpecError(f"the handler of spec {spec!r} cannot run in a child process: {why};"
                        " a child imports its handler by name, so it must be a function"
                        " defined at the top level of a module")


class ChildDied(RotaError):
    """The child process running a job exited or was killed before it answered."""

    retryable = True
    error_type = "child_died"

    def __init__(self, message: str) -> None:
        super().__init__(self.error_type, message)


class _RemoteError(Exception):
    """What a handler raised in its child: the same type name, message, ``retryable`` and
    ``error_type``, with the child's traceback as ``remote_traceback``."""

    error_type: str
    retryable: bool
    remote_traceback: str


class _RemoteExit(BaseException):
    """A SystemExit, KeyboardInterrupt (or other BaseException) from a handler in its child,
    carried as a _RemoteError is."""


_classes: dict[tuple[str, str, bool], type[BaseException]] = {}


def remote_error(info: dict[str, Any]) -> BaseException:
    """The exception to raise in the worker for what a handler raised in its child: a class
    of the same name and module, so that logs and error records read as from a thread."""
    key = (info["module"], info["qualname"], info["fatal"])
    kind = _classes.get(key)
    if kind is None:
        base = _RemoteExit if info["fatal"] else _RemoteError
        kind = _classes[key] = type(info["qualname"].rpartition(".")[2], (base,),
                                    {"__module__": info["module"],
                                     "__qualname__": info["qualname"]})
    error = kind(info["message"])
    error.error_type = info["error_type"]  # type: ignore[attr-defined]
    error.retryable = info["retryable"]  # type: ignore[attr-defined]
    error.remote_traceback = info["traceback"]  # type: ignore[attr-defined]
    return error


def child_traceback(info: p.ErrorInfo, exc: BaseException) -> p.ErrorInfo:
    """``info`` with the traceback from the child, for what a handler raised there (the
    worker's own frames would say only where the pipe was read)."""
    text = getattr(exc, "remote_traceback", None)
    if text is not None:
        info.details = {**(info.details or {}), "traceback": text[-4000:]}
    return info


class Children:
    """The handlers that run in child processes, and the pool of children that runs them
    (on the handlers' loop). At most one child per running job is alive, so never more
    than ``concurrency`` of them, besides children still dying after a SIGTERM."""

    def __init__(self, default: str = "thread", grace: float = STOP_GRACE) -> None:
        self.default = check_mode(default)
        self.grace = grace
        self.handlers: dict[str, Handler] = {}  # spec -> handler, for those run in a child
        self.idle: list[Child] = []
        self.live: set[Child] = set()

    def __contains__(self, spec: str) -> bool:
        return spec in self.handlers

    def register(self, spec: str, fn: Handler, isolation: str | None = None) -> None:
        if check_mode(self.default if isolation is None else isolation) == "process":
            check_importable(spec, fn)
            self.handlers[spec] = fn
        else:
            self.handlers.pop(spec, None)

    def check(self) -> None:
        """At start: every isolated handler can be found by name, as its children will;
        and this is not a child importing a script that starts its worker unguarded."""
        process = sys.modules.get("multiprocessing")
        if process is not None and process.current_process().name == CHILD_NAME:
            raise SpecError("a worker was started in a child process, by a script that a"
                            " child imports to find its handler: start the worker under"
                            " `if __name__ == \"__main__\":`")
        for spec, fn in self.handlers.items():
            try:
                pickle.dumps(fn)
            except Exception as exc:  # noqa: BLE001 (pickle raises several kinds)
                raise SpecError(f"the handler of spec {spec!r} cannot run in a child process:"
                                f" {exc}; it must be a function defined at the top level of a"
                                " module, under its own name") from None

    async def run(self, handler: Handler, ctx: JobContext) -> msgspec.Raw:
        """Run ``handler`` for ``ctx`` in a child: its JSON-encoded result, or what it raised
        (a _RemoteError), or ChildDied. Cancelled, it stops the child before it ends."""
        job = pickle.dumps((handler, {name: getattr(ctx, name) for name in FIELDS},
                            logging.getLogger().getEffectiveLevel()))
        while True:
            child = self.idle.pop() if self.idle else await self._started(ctx)
            child.ctx, child.outcome = ctx, asyncio.get_running_loop().create_future()
            try:
                child.conn.send_bytes(job)
                break
            except OSError:  # it died idle, and its exit is not read yet: take another
                if child.fresh:
                    break  # (it never read a job: its exit says why, below)
                child.ctx = child.outcome = None
        ctx.heartbeat()  # its lease runs from now: a child's start is not the handler's time
        child.fresh = False
        try:
            return await child.outcome
        except asyncio.CancelledError:
            await self.stop(child)
            raise
        finally:
            child.ctx = child.outcome = None
            if not child.stopping and not child.gone.done():
                self.idle.append(child)

    async def _started(self, ctx: JobContext) -> Child:
        """A new child, for ``ctx``'s job. Its start is the worker's time, not the handler's:
        the job's lease is renewed meanwhile (a fork server's first start may take longer
        than a short lease). A run given up meanwhile leaves the child idle, for the next."""
        start = asyncio.ensure_future(self._start())
        try:
            while True:
                done, _ = await asyncio.wait({start}, timeout=ctx.visibility_timeout / 4)
                if done:
                    return start.result()
                ctx.heartbeat()
        except asyncio.CancelledError:
            start.add_done_callback(self._keep)
            raise

    def _keep(self, start: asyncio.Future[Child]) -> None:
        if not start.cancelled() and start.exception() is None and not start.result().gone.done():
            self.idle.append(start.result())

    async def _start(self) -> Child:
        import multiprocessing  # only for workers that isolate a handler

        method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() \
            else "spawn"
        context = multiprocessing.get_context(method)
        if method == "forkserver":  # what every child needs, imported once, in the server
            context.set_forkserver_preload(["rota.worker.isolation"])
        ours, theirs = context.Pipe()
        told, tell = context.Pipe(duplex=False)  # "the worker stops you": see serve()
        process = context.Process(target=serve, args=(theirs, told),
                                  name=CHILD_NAME, daemon=True)
        # Off the loop: the first start also starts the fork server (a Python start).
        await asyncio.to_thread(process.start)
        theirs.close()  # the child's end: once it exits, ours reads EOF
        told.close()
        child = Child(process, ours, asyncio.get_running_loop(), self._gone)
        child.tell = tell
        self.live.add(child)
        log.debug("started child pid=%s method=%s", process.pid, method)
        return child

    async def stop(self, child: Child) -> None:
        """SIGTERM now, SIGKILL after ``grace`` (on the loop's clock, so even if whoever
        waits for it is cancelled again), and wait until the child is gone."""
        child.stopping = True
        try:
            child.tell.send_bytes(b"stop")  # a SIGTERM it heeds, unlike one sent to a group
        except OSError:
            pass  # gone already
        child.signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        loop.call_later(self.grace, child.signal, signal.SIGKILL)
        try:
            await asyncio.shield(child.gone)
        except asyncio.CancelledError:
            child.signal(signal.SIGKILL)  # no time left to wait for it: make sure
            raise

    def _gone(self, child: Child) -> None:
        self.live.discard(child)
        if child in self.idle:
            self.idle.remove(child)

    def close(self) -> None:
        """The worker is leaving: idle children are told to exit (their pipe closes); a
        running one is stopped by its run's cancel."""
        for child in list(self.idle):
            child.close()
        self.idle.clear()


class Child:
    """One child process and the worker's end of its pipe, read on the handlers' loop."""

    def __init__(self, process: Any, conn: Any, loop: asyncio.AbstractEventLoop,
                 on_gone: Callable[[Child], None]) -> None:
        self.process = process
        self.conn = conn
        self.loop = loop
        self.on_gone = on_gone
        self.ctx: JobContext | None = None
        self.outcome: asyncio.Future[msgspec.Raw] | None = None
        self.stopping = False
        self.tell: Any = None  # the pipe that says a SIGTERM is the worker's
        self.fresh = True  # it has not been given a job yet
        self.gone: asyncio.Future[int | None] = loop.create_future()
        self._fd = conn.fileno()
        self._sentinel = process.sentinel
        loop.add_reader(self._fd, self._read)
        loop.add_reader(self._sentinel, self._exited)

    def signal(self, sig: int) -> None:
        if not self.gone.done() and self.process.exitcode is None:
            try:
                os.kill(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.stopping = True
        self.loop.remove_reader(self._fd)
        self.conn.close()
        if self.tell is not None:
            self.tell.close()

    def _read(self) -> None:
        try:
            while self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):  # its end is closed: it is exiting (its sentinel says)
            self.loop.remove_reader(self._fd)

    def _exited(self) -> None:
        self.loop.remove_reader(self._sentinel)
        if not self.conn.closed:
            self._read()  # what it said before it went
            self.close()
        code = self.process.exitcode
        if self.outcome is not None and not self.outcome.done():
            self.outcome.set_exception(ChildDied(died(code, self.process.pid)))
        if not self.gone.done():
            self.gone.set_result(code)
        self.on_gone(self)

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "record":  # a line the handler logged: the worker's logging writes it
            record = logging.makeLogRecord(message[1])
            logger = logging.getLogger(record.name)
            if logger.isEnabledFor(record.levelno):  # (as the worker's logging is set)
                logger.handle(record)
            return
        ctx, outcome = self.ctx, self.outcome
        if ctx is None or outcome is None or outcome.done():
            return  # from a run given up already
        if kind == "done":
            outcome.set_result(msgspec.Raw(message[1]))
        elif kind == "failed":
            outcome.set_exception(remote_error(message[1]))
        elif kind == "beat":
            ctx.heartbeat()
        elif kind == "progress":
            ctx.progress(message[1], message[2])
        elif kind == "log":
            ctx.log(message[1], message[2])
        elif kind == "alert":
            ctx.alert(message[1], message[2])


def died(code: int | None, pid: int | None) -> str:
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
        if code == -signal.SIGKILL:
            how += " (out of memory?)"
    else:
        how = f"exited with code {code}"
    return (f"the child process (pid {pid}) running the job {how} before it answered (the"
            " worker's stderr may say why)")


# -- in the child -------------------------------------------------------------------------
class _Stopped(BaseException):
    """Raised in a handler when its worker stops its run (SIGTERM): a BaseException, so
    that ``except Exception`` in the handler does not swallow it; ``finally`` blocks run."""


_stopping = False


@dataclass(slots=True)
class ChildContext(JobContext):
    """A handler's context in a child: what it reports goes down the pipe to the worker,
    whose own context for the job logs it, keeps it and sends it on."""

    _send: Callable[[tuple[Any, ...]], None] = field(repr=False, default=lambda message: None)

    def heartbeat(self) -> Any:
        self._send(("beat",))
        return JobContext.heartbeat(self)  # (the done awaitable)

    def progress(self, percent: float, message: str | None = None) -> None:
        self._send(("progress", float(percent), None if message is None else str(message)))

    def log(self, message: str, level: str = "info") -> None:
        check_level(level)
        self._send(("log", str(message), level))

    def alert(self, message: str, level: str = "warning") -> None:
        check_level(level)
        self._send(("alert", str(message), level))

    @property
    def cancelled(self) -> bool:
        return _stopping


class PipeHandler(logging.Handler):
    """The child's logging: each record goes to the worker, which handles it as its own."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__()
        self.send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = dict(record.__dict__, msg=record.getMessage(), args=None, exc_info=None)
            if record.exc_info and not fields.get("exc_text"):
                fields["exc_text"] = logging.Formatter().formatException(record.exc_info)
            fields.pop("stack_info", None)
            self.send(("record", {k: v for k, v in fields.items()
                                  if isinstance(v, (str, int, float, type(None)))}))
        except _Stopped:
            raise
        except Exception:  # noqa: BLE001 (logging must not fail the handler)
            self.handleError(record)


_told: Any = None  # the pipe on which the worker says that it stops this child


def _on_sigterm(signum: int, frame: Any) -> None:
    """Stop, if the worker says so. A SIGTERM sent to the whole group or cgroup (systemd's
    default KillMode) reaches the children too: they leave it to the worker, which lets
    running jobs finish within its grace period, then stops them."""
    global _stopping
    if _told is not None and _told.poll():
        _stopping = True
        raise _Stopped("the worker stopped this run")


def _die_with_worker() -> None:
    """Kill this child the moment its worker is gone (killed with -9, say), so that no job
    runs on behind a worker that can no longer report it, or stop it."""
    import multiprocessing.connection

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])  # readable: the worker is gone
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rota-watch-worker", daemon=True).start()


def serve(conn: Any, told: Any) -> None:
    """A child's life: take a job, run it, answer; until the pipe closes or it is stopped."""
    global _told
    _told = told
    if hasattr(os, "setsid"):  # out of the terminal's group: Ctrl-C and Ctrl-Z are the worker's
        os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _die_with_worker()
    lock = threading.Lock()  # a handler's own threads may report too

    def send(message: tuple[Any, ...]) -> None:
        with lock:
            conn.send(message)

    root = logging.getLogger()
    root.handlers[:] = [PipeHandler(send)]
    try:
        while True:
            send(run_one(conn.recv_bytes(), send, root))
    except (_Stopped, EOFError, OSError):
        return  # stopped by the worker, or the worker has gone


def run_one(job: bytes, send: Callable[[tuple[Any, ...]], None],
            root: logging.Logger) -> tuple[Any, ...]:
    try:
        # (unpickling imports the handler's module: what fails there fails this job)
        handler, fields, level = pickle.loads(job)
        root.setLevel(level)
        ctx = ChildContext(**fields, _send=send)
        if inspect.iscoroutinefunction(handler):
            value = asyncio.run(handler(ctx))
        else:
            value = handler(ctx)
        return ("done", msgspec.json.encode(value))
    except _Stopped:
        raise
    except BaseException as exc:  # noqa: BLE001 (each is the job's failure, not the child's)
        kind = type(exc)
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # from the handler's own frame, as the worker shows a thread's
        return ("failed", {
            "module": kind.__module__, "qualname": kind.__qualname__,
            "fatal": not isinstance(exc, Exception), "message": str(exc),
            "error_type": getattr(exc, "error_type", kind.__name__),
            "retryable": bool(getattr(exc, "retryable", True)),
            "traceback": "".join(traceback.format_exception(kind, exc, tb))})
