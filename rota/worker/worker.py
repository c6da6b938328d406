"""The worker SDK: register handlers by spec name, connect to /work, run what is assigned.

    worker = Worker(url="ws://127.0.0.1:8000/work", specs_dir="specs")

    @worker.handler("echo")
    async def echo(ctx: JobContext) -> dict:
        return {"message": ctx.args["message"]}

    asyncio.run(worker.run())

Async handlers run as tasks on the loop that called ``run()``, plain functions each on a
thread of their own (rota/worker/execution.py), or with ``isolation="process"`` in a child
process (rota/worker/isolation.py). The connection to the server runs on a thread and loop
of its own (rota/worker/connection.py), so no handler can silence it; its protocol
decisions are a sans-I/O core (rota/worker/link.py). Each handler's spec is read from
``specs_dir`` and declared with its checksum, so the server sends this worker only jobs
whose spec matches the status quo. Given several server URLs (servers sharing a database),
it moves to the next one whenever its connection fails or is lost. Only ``protocol``,
``specs``, ``ids`` and the SDK's own modules are imported: no server dependency.

Lifecycle: running -> quiet -> terminate, never back from terminate (SIGCONT or
``resume()`` takes a quiet worker back to running).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import platform
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from ssl import SSLContext
from typing import Any

import psutil
import websockets

from rota.base import protocol as p
from rota.worker.connection import ConnectionThread
from rota.worker.context import JobContext, StatusBuffer, check_level
from rota.worker.execution import Handler, ResultTooLarge, Runner
from rota.base.ids import uuid7
from rota.worker.link import IDLE_ACK_INTERVAL, RESULT_BYTES_PER_BEAT, Link, Servers, work_urls
from rota.worker.manual import Listener
from rota.base.specs import UNVERSIONED, JobSpec, SpecError, checksum, load_dir
from rota.base.wording import names

__all__ = ["Worker", "JobContext", "ResultTooLarge", "RESULT_BYTES_PER_BEAT", "EXIT_WEDGED"]
log = logging.getLogger("rota.worker")
SDK = "rota-python/0.1.0"
EXIT_WEDGED = 75  # run() ended because abandoned threads held too many slots (EX_TEMPFAIL)
# The default prefetch ceiling, per slot. Only very short jobs fill it: the deeper the
# line, the more results share a heartbeat and a commit; but the larger each round, the
# longer other requests wait behind it (docs/performance.md measures 4, 16, 32 and 64).
# Jobs of a millisecond or more hold far less (two round trips of runs), long ones one.
PREFETCH_PER_SLOT = 32


class Worker:
    def __init__(
        self,
        *,
        url: str | Sequence[str] = "ws://127.0.0.1:8000/work",
        specs_dir: str | Path = "specs",
        queues: list[str] | None = None,
        concurrency: int = 10,
        prefetch: int | None = None,
        labels: list[str] | None = None,
        worker_id: str | None = None,
        heartbeat_interval: float | None = None,
        grace_period: float = 25.0,
        reconnect: bool = True,
        reconnect_max_delay: float = 5.0,
        patience: float | None = None,
        token: str | None = None,
        ssl: SSLContext | None = None,
        handle_signals: bool = True,
        max_abandoned_threads: int | None = None,
        isolation: str = "thread",
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if prefetch is not None:
            _check_prefetch(prefetch)
        if max_abandoned_threads is not None and max_abandoned_threads < 1:
            raise ValueError("max_abandoned_threads must be at least 1 (None: 2 x concurrency)")
        self.url = url  # checked and made /work URLs by the setter
        self.specs_dir = Path(specs_dir)
        self.concurrency = concurrency
        self.labels = names("labels", labels)  # ValueError now, not a refused registration
        self.worker_id = worker_id or uuid7()
        self.grace_period = grace_period  # SIGTERM/terminate: how long running jobs may finish
        self.reconnect = reconnect
        self.reconnect_max_delay = reconnect_max_delay
        self.patience = patience  # None: keep reconnecting forever, as Sidekiq does
        self.token = token  # a worker-scope bearer token, when the server requires one
        self.ssl = ssl  # for wss:// with a private CA; None: the system's trust store
        # SIGTERM, SIGINT, SIGTSTP and SIGCONT, while run() runs in the main thread: the
        # same for `rota worker` and for a script that calls worker.run() itself.
        self.handle_signals = handle_signals
        # Threads of plain-function runs given up while still running (a hung call) are
        # abandoned and replaced; this many of them and the worker drains and exits
        # (EXIT_WEDGED) for its supervisor to restart it. (isolation="process": never.)
        self.max_abandoned_threads = max_abandoned_threads or 2 * concurrency
        self._defaults = (prefetch is None, max_abandoned_threads is None)  # see configure
        self.exit_code = 0  # what `rota worker` exits with after run() returns
        self.terminate_by: float | None = None  # monotonic; then running jobs are cancelled
        self._fast = False  # a second signal: cancel at once, do not wait for acks
        self._abandon = False  # a third SIGINT: stop reporting, return from run() now
        self._queues = names("queues", queues) or None
        self._interval = heartbeat_interval  # None: take the server's from its welcome
        self.handlers: dict[str, Handler] = {}
        self._specs: dict[str, JobSpec] = {}
        self._unversioned: set[str] = set()  # OJS types no spec file describes (docs/ojs.md)
        self._stop = threading.Event()
        self._state: p.WorkerState = "running"
        self._process = psutil.Process()
        # With hostname and pid, this tells the server a reconnect is this very process.
        self._started_at = p.rfc3339(time.time())
        self.status = StatusBuffer(wake=self._wake_urgently)
        self.link = Link(self.worker_id, interval=heartbeat_interval,
                         reconnect_max_delay=reconnect_max_delay)
        # Jobs held beyond concurrency, so that the next starts the moment a run ends
        # instead of a server round trip later (docs/protocol.md §3.5). A ceiling: the
        # runner holds only what covers a round trip at the runs' own pace.
        self.runner = Runner(worker_id=self.worker_id, handlers=self.handlers,
                             concurrency=concurrency, status=self.status, report=self._report,
                             max_abandoned=self.max_abandoned_threads, on_wedged=self._wedged,
                             prefetch=default_prefetch(concurrency) if prefetch is None
                             else prefetch, isolation=isolation)
        self._connection: ConnectionThread | None = None
        self._outgoing: list[p.Result | None] = []  # run ends not yet handed over
        self._flush_due = False
        self._task: asyncio.Task[Any] | None = None
        self.welcome: p.Welcome | None = None
        self.connected = asyncio.Event()

    # -- configuration ----------------------------------------------------------------
    @property
    def url(self) -> str:
        """The /work URL in use or being tried now; set one server's URL or a list, before run()."""
        return self.servers.current

    @url.setter
    def url(self, value: str | Sequence[str]) -> None:
        self.servers = Servers(work_urls(value))

    @property
    def urls(self) -> list[str]:
        """Every server URL this worker may use, in the order it tries them."""
        return list(self.servers.urls)

    @property
    def server_url(self) -> str:
        """The /work URL of the server this worker is connected to (or trying now)."""
        return self.servers.current

    def configure(self, *, concurrency: int | None = None, prefetch: int | None = None,
                  queues: list[str] | None = None, labels: list[str] | None = None,
                  specs_dir: str | Path | None = None) -> None:
        """Change what the code set, before run(): how `rota worker` applies its options
        (and ROTA_* variables), so that a deploy need not edit the worker's code. None
        leaves a setting as it is; labels are added to the worker's own."""
        if concurrency is not None:
            if concurrency < 1:
                raise ValueError("concurrency must be at least 1")
            default_prefetch_, default_abandoned = self._defaults
            self.concurrency = self.runner.concurrency = concurrency
            if default_abandoned:
                self.max_abandoned_threads = self.runner.max_abandoned = 2 * concurrency
            if default_prefetch_ and prefetch is None:
                self.runner.prefetch = default_prefetch(concurrency)
        if prefetch is not None:
            self.prefetch = prefetch
        if queues is not None:
            if not queues:
                raise ValueError("queues must name at least one queue")
            self._queues = names("queues", queues)
        for label in names("labels", labels):
            if label not in self.labels:
                self.labels.append(label)
        if specs_dir is not None:
            self.specs_dir = Path(specs_dir)

    def handler(self, spec: str, isolation: str | None = None, *, unversioned: bool = False
                ) -> Callable[[Handler], Handler]:
        """Decorator: ``fn`` runs ``spec``'s jobs; ``isolation``: the Worker's, or one's own;
        ``unversioned``: ``spec`` is an OJS type no spec file describes (docs/ojs.md)."""

        def register(fn: Handler) -> Handler:
            if spec in self.handlers:
                raise ValueError(f"spec {spec!r} already has a handler")
            self.runner.children.register(spec, fn, isolation)
            self.handlers[spec] = fn
            if unversioned:
                self._unversioned.add(spec)
            return fn

        return register

    @property
    def queues(self) -> list[str]:
        if self._queues:
            return self._queues
        ordered = dict.fromkeys(self._specs[name].queue if name in self._specs else "default"
                                for name in self.handlers)
        return list(ordered) or ["default"]

    def declared_specs(self) -> list[p.SpecRef]:
        if self._specs.keys() != self.handlers.keys() - self._unversioned:
            self._load_specs()
        return [p.SpecRef(name, UNVERSIONED if name in self._unversioned
                          else checksum(self._specs[name])) for name in sorted(self.handlers)]

    def _load_specs(self) -> None:
        if not self.handlers:
            raise SpecError("the worker has no handlers; register one with @worker.handler(name)")
        versioned = self.handlers.keys() - self._unversioned
        if versioned and not self.specs_dir.is_dir():  # (usually: started from elsewhere)
            raise SpecError(missing_specs_dir(self.specs_dir, "give Worker(specs_dir=...) a"
                                              " full path"))
        found = {spec.name: spec for spec in load_dir(self.specs_dir)} if versioned else {}
        missing = sorted(versioned - set(found))
        if missing:
            raise SpecError(f"{self.specs_dir} has no spec for handler(s): {', '.join(missing)}")
        self._specs = {name: found[name] for name in versioned}

    @property
    def prefetch(self) -> int:
        """Jobs this worker holds beyond ``concurrency``, waiting to start."""
        return self.runner.prefetch

    @prefetch.setter
    def prefetch(self, value: int) -> None:  # before run(): the registration carries it
        _check_prefetch(value)
        self.runner.prefetch = value

    # -- what the connection asks for (from its thread) --------------------------------
    def connect(self) -> websockets.connect:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        # close_timeout: leaving never waits long on a server that does not answer a close
        # ssl=None would be refused for a wss:// URL: left out, it is the system's trust
        tls = {} if self.ssl is None else {"ssl": self.ssl}
        return websockets.connect(self.server_url, max_size=None, compression=None, ping_interval=None,
                                  close_timeout=2.0, additional_headers=headers, **tls)

    def registration(self) -> p.Registration:
        return p.Registration(
            hostname=socket.gethostname(), os=f"{platform.system()} {platform.release()}",
            pid=os.getpid(), sdk=SDK, queues=self.queues, concurrency=self.concurrency,
            specs=self.declared_specs(), labels=self.labels, started_at=self._started_at,
            prefetch=self.prefetch, reports_starts=True, lean_acks=True,  # (§4.2)
            idle_ack_interval=IDLE_ACK_INTERVAL)

    def metrics(self) -> tuple[float, int]:
        # cpu_percent(None) measures since the previous call: no blocking sample here.
        # Bounded as the protocol bounds it (a machine of more than 4,096 cores).
        cpu = min(self._process.cpu_percent(interval=None), p.MAX_CPU_PERCENT)
        return cpu, self._process.memory_info().rss

    def welcomed(self, welcome: p.Welcome) -> None:
        self.welcome = welcome
        for rejected in welcome.specs.rejected:
            log.warning("spec rejected spec=%s checksum=%s status_quo=%s reason=%s",
                        rejected.name, rejected.checksum[:15], (rejected.expected or "none")[:15],
                        rejected.reason)
        log.info("connected worker=%s url=%s queues=%s specs_accepted=%s", self.worker_id,
                 self.server_url, ",".join(self.queues), ",".join(welcome.specs.accepted) or "-")

    # -- lifecycle: running -> quiet -> terminate, never back from terminate ------------
    @property
    def state(self) -> p.WorkerState:
        return self._state

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def stopping_now(self) -> bool:
        return self._fast

    @property
    def running_jobs(self) -> list[str]:
        """Ids of the jobs this worker is running now."""
        return list(self.runner.running)

    @property
    def prefetched_jobs(self) -> list[str]:
        """Ids of the jobs this worker holds and has not started, in the order they start."""
        return self.runner.prefetched()

    @property
    def flush_delays(self) -> collections.deque[float]:
        """Seconds each result waited between being ready and leaving in a heartbeat."""
        return self.link.flush_delays

    def quiet(self) -> None:
        """Take no new jobs; keep running the current ones (SIGTSTP, or the server)."""
        if self._state == "running":
            self._set_state("quiet")

    def resume(self) -> None:
        """Back to taking jobs after quiet (SIGCONT); a terminating worker stays so."""
        if self._state == "quiet":
            self._set_state("running")

    def terminate(self) -> None:
        """Take no new jobs, give running ones ``grace_period`` to finish, cancel the rest
        (reported as ``shutdown`` failures, so they are retried at once), deregister and
        return from run() (SIGTERM, or the server)."""
        if self._state != "terminate":
            self.terminate_by = time.monotonic() + self.grace_period
            self._set_state("terminate")
        self._stop.set()
        self._wake_urgently()

    stop = terminate

    def stop_now(self) -> None:
        """The fast path (a second SIGTERM or Ctrl-C): cancel running jobs at once, report
        them best-effort, deregister and leave."""
        self._fast = True
        self.terminate()
        self.terminate_by = time.monotonic()
        self.runner.cancel_all("shutdown")
        self._wake_urgently()

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        """Stop a running job; it is reported as failed with error type ``reason``."""
        self.runner.cancel(job_id, reason)

    def listen(self, *specs: str) -> Listener:
        """Manual mode: ``async with worker.listen("spec", ...) as jobs: async for job in
        jobs: ... job.complete(result)`` or ``job.fail(error)``. Runs the worker for as
        long as the block lasts; see rota.worker.manual."""
        return Listener(self, specs)

    def alert(self, message: str, level: str = "warning") -> None:
        """An alert about the worker itself (not one job): sent at once, logged by the
        server and shown with the worker in ``GET /workers``."""
        check_level(level)
        self.status.alert(message, level, None)

    def _set_state(self, state: p.WorkerState) -> None:
        log.info("state change worker=%s state=%s running_jobs=%d", self.worker_id, state,
                 len(self.runner.running))
        self._state = state
        if state == "running":
            self.runner.holding = True
        else:  # jobs that would wait here go back now, for another worker to run
            self.runner.release_waiting(f"the worker is {p.STATE_SAID[state]}")
        self._wake_urgently()  # tell the server at once

    def _wake_urgently(self) -> None:
        if self._connection is not None:
            self._connection.wake(urgent=True)

    def _report(self, result: p.Result | None) -> None:
        """A run ended. Results of one turn of the handlers' loop cross to the connection
        together, in one hand-off, so that they can leave in one heartbeat."""
        self._outgoing.append(result)
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._hand_over)

    def _hand_over(self) -> None:
        results, self._outgoing = self._outgoing, []
        if self._connection is not None:
            self._connection.add_results(results)
        # Cleared only now: whoever reads it False finds the results posted already.
        self._flush_due = False

    @property
    def handing_over(self) -> bool:
        """Runs have ended whose results are not yet handed to the connection."""
        return self._flush_due

    def _wedged(self) -> None:
        self.exit_code = EXIT_WEDGED
        self.terminate()

    def tick(self) -> None:
        """The handlers' side of the clock (asked for by the connection): give up runs
        past their lease, and cancel what is left when the grace period is over."""
        self.runner.give_up_lapsed()
        if self.terminate_by is not None and time.monotonic() >= self.terminate_by:
            self.runner.cancel_all("shutdown")

    # -- running ----------------------------------------------------------------------
    async def run(self) -> None:
        """Connect, run what is assigned, reconnect when the connection is lost, until
        terminated (by a signal, the server, or ``terminate()``)."""
        self._load_specs()
        self.runner.children.check()  # a handler a child cannot import: said now, not mid-job
        self._task = asyncio.current_task()
        signals = _Signals.join(self)
        self._connection = ConnectionThread(self, self.link)
        try:
            await self._connection.start()
        except asyncio.CancelledError:
            self._connection.abort()
            if not self._abandon:
                raise
            log.warning("stopped without reporting worker=%s", self.worker_id)
        finally:
            self.runner.stop_all()  # only left when run() fails: the server recovers them
            self.connected.clear()
            if signals is not None:
                signals.leave(self)

    def on_signal(self, sig: signal.Signals) -> None:
        """What a signal does to this worker. SIGTERM and a first SIGINT (Ctrl-C): no new
        jobs, running ones get ``grace_period``, then deregister and return. A second
        SIGTERM or SIGINT takes the fast path (running jobs cancelled and given back); a
        third SIGINT gives up reporting. SIGTSTP: quiet; SIGCONT: resume."""
        log.info("signal %s worker=%s", sig.name, self.worker_id)
        if sig in (signal.SIGTERM, signal.SIGINT):
            if not self.stopping:
                self.terminate()
                if sig == signal.SIGINT:
                    self._say_finishing()
            elif not self._fast:
                self.stop_now()
            elif sig == signal.SIGINT and self._task is not None:  # a third: leave now
                self._abandon = True
                self._task.cancel()
        elif sig == signal.SIGTSTP:
            self.quiet()
        elif sig == signal.SIGCONT:
            self.resume()

    def _say_finishing(self) -> None:
        # A warning, not info: the one line the person who pressed Ctrl-C must see,
        # whatever the log level (with no logging set up, Python shows warnings).
        running = len(self.runner.running)
        doing = f"finishing {running} running job(s) (grace {self.grace_period:g}s), taking" \
            " no new ones; Ctrl-C again to stop now" if running else "no job running, stopping"
        log.warning("Ctrl-C: %s worker=%s", doing, self.worker_id)


def _check_prefetch(value: object) -> None:
    # An int, not a bool or a float: the server would refuse the registration, and the
    # worker would reconnect for ever.
    if type(value) is not int or not 0 <= value <= p.MAX_PREFETCH:
        raise ValueError(f"prefetch must be a whole number from 0 to {p.MAX_PREFETCH}, not"
                         f" {value!r} (None: {PREFETCH_PER_SLOT} x concurrency)")


def missing_specs_dir(folder: Path, elsewhere: str) -> str:
    """The error for a specs folder that is not there: where the worker looked, and why."""
    if folder.is_absolute():
        return f"{folder}: not a directory"
    return (f"{folder}: not a directory: the worker looked for {folder.absolute()} (a relative"
            f" path is taken from the current folder); run it from the folder that holds"
            f" {folder}, or {elsewhere}")


def default_prefetch(concurrency: int) -> int:
    return min(p.MAX_PREFETCH, PREFETCH_PER_SLOT * concurrency)


class _Signals:
    """The signal handlers of one event loop, shared by every worker running on it: a
    signal goes to each of them, and the handlers go when the last one leaves."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGTSTP, signal.SIGCONT)
    _by_loop: dict[asyncio.AbstractEventLoop, _Signals] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.workers: list[Worker] = []
        for sig in self.SIGNALS:
            loop.add_signal_handler(sig, self._deliver, sig)

    @classmethod
    def join(cls, worker: Worker) -> _Signals | None:
        if not worker.handle_signals or threading.current_thread() is not threading.main_thread():
            return None
        loop = asyncio.get_running_loop()
        signals = cls._by_loop.get(loop) or cls._by_loop.setdefault(loop, cls(loop))
        signals.workers.append(worker)
        return signals

    def leave(self, worker: Worker) -> None:
        self.workers.remove(worker)
        if not self.workers:
            for sig in self.SIGNALS:
                self.loop.remove_signal_handler(sig)
            self._by_loop.pop(self.loop, None)

    def _deliver(self, sig: signal.Signals) -> None:
        for worker in list(self.workers):
            worker.on_signal(sig)
