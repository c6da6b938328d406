"""Running assigned jobs, on the handlers' event loop: async handlers as tasks, plain
functions each on a thread of its own, handlers registered with ``isolation="process"`` in
child processes (rota/worker/isolation.py, which can really stop them).

At most ``concurrency`` jobs run at once. Up to ``prefetch`` more wait in a line, in the
order they were assigned, and the next one starts the moment a run ends, on this loop,
without waiting for the server: that is what a prefetch buys (docs/protocol.md §3.5). A
job that will not start here (the worker goes quiet or stops, a cancel names it) is
given back at once as ``released``, which costs it no attempt. Every start is noted
(``starts``) for the next heartbeat to name, whatever runs the job (a task, a thread, a
child process), and a job the server takes back (``take_back``: another worker is idle)
leaves the line unstarted and is noted in ``given``.

A run holds a slot until it ends. A plain function cannot be interrupted: when its run
is given up (its lease lapsed, a cancel, a shutdown) the run is reported at once and
its thread is *abandoned*: it runs on, but it is no longer the slot's. Every run of a
plain function starts on a new thread, so a slot given back is one the worker can
really use: a job it accepts starts at once, however many threads hang. Each abandoned
thread is alerted and counted; at ``max_abandoned`` of them the worker drains and exits
(``EXIT_WEDGED``), for its supervisor to restart it. A run in a child process is never
abandoned: its child is stopped. No exception from a handler,
``SystemExit`` and ``KeyboardInterrupt`` included, escapes its run: it fails that job.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import msgspec

from rota.base import protocol as p
from rota.worker.context import (RESULT_DEPTH, JobContext, ResultTooDeep, ResultTooLarge,
                                 StatusBuffer)
from rota.worker.isolation import Children, child_traceback
from rota.base.inputs import too_deep
from rota.worker.link import RESULT_BYTES_PER_BEAT, SMOOTHING, line_pace, prefetch_line

log = logging.getLogger("rota.worker")
# The most work a worker's line holds, in seconds of its runs at their present pace: the
# line is there to cover a round trip to the server, not to hoard (see Runner._trim).
LINE_SECONDS = 1.0
Handler = Callable[[JobContext], Any]


@dataclass(slots=True)
class Run:
    copy: p.JobCopy
    deadline: float  # monotonic: past it, without a ctx.heartbeat(), the run is given up
    began: float  # monotonic: when the handler was first stepped (times the run)
    task: asyncio.Task[p.Result] | None = None
    cancel_reason: str | None = None  # why we cancelled it: "cancelled", "visibility_timeout"
    thread: threading.Thread | None = None  # a plain function's thread


class Runner:
    def __init__(self, *, worker_id: str, handlers: dict[str, Handler], concurrency: int,
                 status: StatusBuffer, report: Callable[[p.Result | None], None],
                 max_abandoned: int, on_wedged: Callable[[], None], prefetch: int = 0,
                 isolation: str = "thread") -> None:
        self.worker_id = worker_id
        self.handlers = handlers
        self.concurrency = concurrency
        self.prefetch = prefetch  # jobs held beyond concurrency, waiting in ``waiting``
        # (job, until): a waiting job is vouched for until its visibility timeout has
        # passed since it was assigned, as a run would be; so a line stuck behind a
        # blocked loop is not renewed for ever, and the server's lease takes it back.
        self.waiting: collections.deque[tuple[p.JobCopy, float]] = collections.deque()
        self.holding = True  # False while quiet or stopping: no job waits, it goes back
        # Per spec: its runs that ended on their own, averaged (s); and its jobs held here
        # (running or waiting), whose slowest spec sizes the line (link.line_pace).
        self.run_times: dict[str, float] = {}
        self.held: collections.Counter[str] = collections.Counter()
        self.status = status
        self.report = report  # a run's result (None: a slot came free with nothing to say)
        self.max_abandoned = max_abandoned
        self.on_wedged = on_wedged  # too many abandoned threads: drain and exit
        self.running: dict[str, Run] = {}
        self.abandoned: set[threading.Thread] = set()
        self._wedged = False  # told the worker to drain and exit already
        self._loop: asyncio.AbstractEventLoop | None = None
        self.children = Children(isolation)  # handlers that run in child processes
        # For the next heartbeat (read on the connection's thread: deques, which append
        # and pop atomically): jobs started, and jobs taken back from the line unstarted.
        self.starts: collections.deque[str] = collections.deque()
        self.given: collections.deque[str] = collections.deque()

    # -- what the connection reads (from its own thread) ----------------------------------
    def capacity(self, state: str, round_trip: float = 0.0) -> int:
        """Jobs to ask the server for: free slots, and room in the line (as long as the
        line should be for runs this long and this server round trip)."""
        if state != "running":
            return 0
        pace = self.pace()
        if pace is None and not self.held and self.run_times:
            # Idle: nothing held says what comes next. A worker that drained its line
            # must not fall back to a round trip per batch of free slots (quick jobs
            # drain it between two assignments): the slowest spec timed here sizes the
            # line, which the first jobs held then grow or shrink.
            pace = max(self.run_times.values())
        if pace is None:  # a held spec none of whose runs is timed here, or nothing timed
            # yet: each such run counts as LINE_SECONDS of work (as in _untimed_waits), so
            # a worker new to a spec holds a line as for runs of a second: one job waits.
            pace = max([LINE_SECONDS, *(self.run_times.get(spec, 0.0)
                                        for spec in list(self.held))])
        line = min(prefetch_line(self.prefetch, self.concurrency, pace, round_trip),
                   self._keep(pace))
        return max(0, self.concurrency + line - len(self.running) - len(self.waiting))

    def pace(self) -> float | None:
        """How long the runs of the jobs held now take (None: not known)."""
        return line_pace(self.run_times, list(self.held))  # (a copy: read off the loop)

    def _keep(self, pace: float | None) -> int:
        """The longest line LINE_SECONDS of work makes at the runs' present pace."""
        if pace is None:
            return 0
        return max(1, math.ceil(LINE_SECONDS * self.concurrency / max(pace, 1e-6)))

    def prefetched(self, now: float | None = None) -> list[str]:
        """The jobs waiting in line, not started (a copy: the line moves on its loop);
        with ``now``, only those it still vouches for."""
        return [copy.id for copy, until in list(self.waiting) if now is None or until > now]

    def vouched(self, now: float) -> list[str]:
        """The runs whose leases this worker still vouches for."""
        return [job_id for job_id, run in list(self.running.items()) if run.deadline > now]

    # -- on the handlers' loop -----------------------------------------------------------
    def take(self, copy: p.JobCopy) -> None:
        """An assigned job: run it now if a slot is free, else keep it in line (or give
        it back, when this worker no longer holds jobs)."""
        if copy.id in self.running:  # a new attempt of a job it runs: start it over
            self.start(copy)
        elif self._untimed_waits(copy):  # sent for a line sized for other specs' runs
            log.info("released job=%s: no run of spec=%s is timed here yet", copy.id, copy.spec)
            self.report(released(copy, f"no run of {copy.spec} is timed here yet"))
        elif self.holding or len(self.running) < self.concurrency:
            self.held[copy.spec] += 1
            self.waiting.append((copy, time.monotonic() + copy.visibility_timeout))
            self._next()  # in line behind whatever waits already
        else:
            self.report(released(copy, "the worker is not taking jobs"))

    def _untimed_waits(self, copy: p.JobCopy) -> bool:
        """Whether a job of a spec none of whose runs has been timed here would wait
        behind ``concurrency`` such jobs: each counts as LINE_SECONDS of work."""
        return (copy.spec not in self.run_times and self.holding
                and len(self.running) + len(self.waiting) >= self.concurrency
                and sum(c.spec not in self.run_times for c, _ in self.waiting)
                >= math.ceil(LINE_SECONDS * self.concurrency))

    def _let_go(self, copy: p.JobCopy) -> None:
        """A held job left: it ended, or went back unstarted."""
        self.held[copy.spec] -= 1
        if self.held[copy.spec] <= 0:
            del self.held[copy.spec]

    def release_waiting(self, why: str) -> None:
        """Give every waiting job back to the server, unstarted; hold none from now on
        (until ``holding`` is set again)."""
        self.holding = False
        while self.waiting:
            copy, _ = self.waiting.popleft()
            self._let_go(copy)
            log.info("released job=%s: %s", copy.id, why)
            self.report(released(copy, why))

    def _next(self) -> None:
        """Start waiting jobs while slots are free: a run just ended."""
        while self.waiting and len(self.running) < self.concurrency:
            self.start(self.waiting.popleft()[0])

    def start(self, copy: p.JobCopy) -> None:
        self._loop = asyncio.get_running_loop()
        if copy.id in self.running:  # a stale run of an earlier attempt: stop it
            self.cancel(copy.id, "cancelled")
        began = time.monotonic()
        run = Run(copy, deadline=began + copy.visibility_timeout, began=began)
        self.running[copy.id] = run
        self.starts.append(copy.id)
        run.task = asyncio.create_task(self._execute(run), name=f"rota-job-{copy.id}")
        # Whatever ends the task, even a cancel before its first step, ends the run here.
        run.task.add_done_callback(lambda task: self._ended(run, task))

    def cancel(self, job_id: str, reason: str = "cancelled") -> None:
        """Stop a running job; it is reported as failed with error type ``reason``. A job
        still waiting leaves the line and is reported the same way without running (as
        ``released`` when the worker is shutting down: it never started)."""
        run = self.running.get(job_id)
        if run is None:
            self._drop_waiting(job_id, reason)
            return
        if run.task is None or run.cancel_reason is not None:
            return
        log.info("cancelling job=%s reason=%s", job_id, reason)
        run.cancel_reason = reason
        run.task.cancel()

    def cancel_all(self, reason: str) -> None:
        # The line first: a cancelled run that ends would start the next in line.
        for job_id in self.prefetched():
            self._drop_waiting(job_id, reason)
        for job_id in list(self.running):
            self.cancel(job_id, reason)

    def take_back(self, job_ids: list[str]) -> None:
        """The server asks for these jobs if they still wait (another worker is idle):
        those that do leave the line unstarted; one started already runs on here."""
        for job_id in job_ids:
            if self._unline(job_id) is not None:
                log.info("given back job=%s: taken back for an idle worker", job_id)
                self.given.append(job_id)

    def _unline(self, job_id: str) -> p.JobCopy | None:
        """Take a job out of the line, if it waits there."""
        entry = next((e for e in self.waiting if e[0].id == job_id), None)
        if entry is None:
            return None
        self.waiting.remove(entry)
        self._let_go(entry[0])
        return entry[0]

    def _drop_waiting(self, job_id: str, reason: str) -> None:
        copy = self._unline(job_id)
        if copy is None:
            return
        log.info("dropped waiting job=%s reason=%s", job_id, reason)
        if reason == "reservation_lost":  # no longer ours to report
            self.report(None)
        elif reason == "shutdown":
            self.report(released(copy, "the worker is shutting down"))
        elif reason == "waited":
            self.report(released(copy, "it waited in line past its visibility timeout"))
        else:
            self.report(p.Result(job_id=copy.id, attempt=copy.attempt, outcome="failed",
                                 error=p.ErrorInfo(type=reason, message="dropped unstarted by"
                                                   f" the worker: {reason}")))

    def give_up_lapsed(self) -> None:
        """A run silent past its lease is stopped and reported, so that the retry the
        server will schedule never races a stale copy of it."""
        now = time.monotonic()
        for job_id, run in list(self.running.items()):
            if run.deadline <= now:
                self.cancel(job_id, "visibility_timeout")
        for copy, until in list(self.waiting):  # waited a whole lease: let another run it
            if until <= now:
                self._drop_waiting(copy.id, "waited")

    def stop_all(self) -> None:
        """The worker is failing: nobody to report to; the server recovers the jobs."""
        self.holding = False
        for copy, _ in self.waiting:
            self._let_go(copy)
        self.waiting.clear()  # (before the cancels: an ended run starts the next in line)
        for run in list(self.running.values()):
            if run.task is not None:
                run.task.cancel()
        self.children.close()

    async def _execute(self, run: Run) -> p.Result:
        copy = run.copy
        loop = asyncio.get_running_loop()
        # The run's own time starts now, not when its task was made: runs started
        # together wait for each other's first steps, which is not what they take.
        run.began = time.monotonic()

        def extend_now() -> None:
            run.deadline = time.monotonic() + copy.visibility_timeout

        # (ctx.heartbeat may be called from a plain function's thread)
        extend: Callable[[], object] = lambda: loop.call_soon_threadsafe(extend_now)
        ctx = JobContext(id=copy.id, spec=copy.spec, queue=copy.queue, attempt=copy.attempt,
                         args=copy.args, priority=copy.priority, checksum=copy.checksum,
                         enqueued_at=copy.enqueued_at, worker_id=self.worker_id,
                         visibility_timeout=copy.visibility_timeout,
                         capture_logs=copy.capture_logs, workflow_id=copy.workflow_id,
                         parent_results=copy.parent_results or {}, _extend=extend,
                         _status=self.status,
                         _stopped=lambda: run.cancel_reason is not None)
        return await self._call(ctx, run)

    def _ended(self, run: Run, task: asyncio.Task[p.Result]) -> None:
        copy = run.copy
        result: p.Result | None = None
        took = time.monotonic() - run.began
        if not task.cancelled():
            average = self.run_times.get(copy.spec)
            self.run_times[copy.spec] = took if average is None else \
                average + SMOOTHING * (took - average)
            error = task.exception()  # (_call turns what a handler raises into a result)
            result = task.result() if error is None else p.Result(
                job_id=copy.id, attempt=copy.attempt, outcome="failed", error=error_info(error))
        elif run.cancel_reason == "reservation_lost":  # no longer ours to report
            log.info("stopped job=%s: its reservation was lost while disconnected", copy.id)
        elif run.cancel_reason is not None:
            result = p.Result(job_id=copy.id, attempt=copy.attempt, outcome="failed",
                              error=p.ErrorInfo(type=run.cancel_reason, message="stopped by"
                                                f" the worker: {run.cancel_reason}"))
        # (cancelled by nobody's reason: the worker itself is going down; the server
        # recovers the job)
        _log_end(copy, result, took, run.cancel_reason)
        if task.cancelled():
            self._abandon(run)
        # Handed over before the slot is freed: whoever sees the slot free and nothing
        # running can count on the result being on its way already.
        self.report(result)
        self._trim()
        self._forget(run)

    def _trim(self) -> None:
        """Give back what waits beyond LINE_SECONDS of work at the runs' present pace (once
        the line is well past it). A
        line filled while runs were quick would otherwise keep slow jobs from an idle
        worker, and an urgent job behind it, until it drained by running (seen: 56 jobs
        of a second each, held for 29 s while a second worker sat idle). The newest go
        back; the oldest keep their turn."""
        pace = self.pace()
        if pace is None or len(self.waiting) <= 1:
            return
        keep = self._keep(pace)
        # Some slack before anything goes back: one slow run among quick ones must not
        # send jobs back and forth (each release is a lease and a record).
        if len(self.waiting) <= 2 * keep + self.concurrency:
            return
        given = 0
        while len(self.waiting) > keep:
            copy, _ = self.waiting.pop()
            self._let_go(copy)
            self.report(released(copy, "the line held more than this worker's runs need"))
            given += 1
        log.info("released %d waiting job(s): runs take %.3fs now, the line keeps %d",
                 given, pace, keep)

    def _forget(self, run: Run) -> None:
        if self.running.get(run.copy.id) is run:  # a newer attempt may have its slot
            del self.running[run.copy.id]
            self._let_go(run.copy)
        if self.waiting:
            self._next()

    async def _call(self, ctx: JobContext, run: Run) -> p.Result:
        handler = self.handlers.get(ctx.spec)
        try:
            if handler is None:
                raise LookupError(f"this worker has no handler for spec {ctx.spec!r}")
            if ctx.spec in self.children:  # stopped for real when its run is given up
                value = await self.children.run(handler, ctx)
            elif inspect.iscoroutinefunction(handler):
                value = await handler(ctx)
            else:
                value = await self._in_thread(handler, ctx, run)
            # Encoded once, here: a value that cannot be sent fails the job, not the
            # heartbeat, and the heartbeat carries the bytes as they are.
            encoded = msgspec.json.encode(value)
            if len(encoded) > RESULT_BYTES_PER_BEAT:
                raise ResultTooLarge(f"the result is {len(encoded)} bytes as JSON; a worker"
                                     f" sends at most {RESULT_BYTES_PER_BEAT}")
            if too_deep(encoded, RESULT_DEPTH):
                raise ResultTooDeep(f"the result nests more than {RESULT_DEPTH} arrays or"
                                    " objects deep; the server refuses deeper frames")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("job failed job=%s spec=%s attempt=%d error=%s: %s", ctx.id, ctx.spec,
                     ctx.attempt, type(exc).__name__, exc)
            return p.Result(job_id=ctx.id, attempt=ctx.attempt, outcome="failed",
                            error=child_traceback(error_info(exc), exc))
        except BaseException as exc:  # noqa: BLE001 (SystemExit, KeyboardInterrupt, ...)
            # A handler cannot stop its worker: only signals and the server do that.
            # Its job fails, for good, since running it again would do the same.
            log.warning("job failed job=%s spec=%s attempt=%d: the handler raised %s; the"
                        " worker runs on", ctx.id, ctx.spec, ctx.attempt, type(exc).__name__)
            info = child_traceback(error_info(exc), exc)
            info.retryable = False
            info.message = (f"the handler raised {type(exc).__name__}({exc}); a handler"
                            " cannot stop its worker")
            return p.Result(job_id=ctx.id, attempt=ctx.attempt, outcome="failed", error=info)
        return p.Result(job_id=ctx.id, attempt=ctx.attempt, outcome="completed",
                        result=msgspec.Raw(encoded))

    async def _in_thread(self, handler: Handler, ctx: JobContext, run: Run) -> Any:
        """Run a plain function on a thread of its own: a thread that never returns holds
        its own slot, never the next job's."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if not done.done():
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result(value)

        def target() -> None:
            try:
                value, error = handler(ctx), None
            except BaseException as exc:  # noqa: BLE001 (handed to the run, whatever it is)
                value, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, value, error)
                loop.call_soon_threadsafe(self._thread_ended, threading.current_thread())
            except RuntimeError:  # the loop is closed: the worker is gone already
                pass

        thread = threading.Thread(target=target, name=f"rota-job-{ctx.id}", daemon=True)
        run.thread = thread
        thread.start()
        return await done

    def _abandon(self, run: Run, now: bool = False) -> None:
        """A run given up whose thread runs on: abandoned THREAD_GRACE later, unless it
        returned (as a handler that checks ``ctx.cancelled`` does: the advice below)."""
        thread = run.thread
        if thread is None or not thread.is_alive() or thread in self.abandoned:
            return
        if not now:
            asyncio.get_running_loop().call_later(THREAD_GRACE, self._abandon, run, True)
            return
        self.abandoned.add(thread)
        message = (f"job {run.copy.id} ({run.copy.spec}) was given up ({run.cancel_reason}) but"
                   f" its thread still runs: abandoned thread {len(self.abandoned)}"
                   f" (the worker restarts at {self.max_abandoned}); its slot runs new jobs on"
                   f" new threads; {WAY_OUT}")
        # (the way out as an argument: a literal key="value" would be a JSON line's field)
        log.warning("abandoned thread job=%s spec=%s reason=%s abandoned=%d: %s", run.copy.id,
                    run.copy.spec, run.cancel_reason, len(self.abandoned), WAY_OUT)
        self.status.alert(message, "warning", run.copy.id)
        if len(self.abandoned) >= self.max_abandoned and not self._wedged:
            self._wedged = True
            log.error("%d abandoned threads (max_abandoned_threads): draining, then exiting"
                      " with code 75 for a restart; %s", len(self.abandoned), WAY_OUT)
            self.status.alert(f"{len(self.abandoned)} abandoned threads: the worker drains"
                              f" and exits to be restarted; {WAY_OUT}", "error", None)
            self.on_wedged()

    def _thread_ended(self, thread: threading.Thread) -> None:
        if thread in self.abandoned:
            self.abandoned.discard(thread)
            log.info("an abandoned thread returned: %d left", len(self.abandoned))


THREAD_GRACE = 1.0  # s a given-up run's thread has to return before it counts as abandoned
# What an abandoned thread's lines say to do (a plain function cannot be stopped).
WAY_OUT = ('use isolation="process" for handlers that must stop on a cancel,'
           " or check ctx.cancelled")

def _log_end(copy: p.JobCopy, result: p.Result | None, took: float, reason: str | None) -> None:
    """One DEBUG line for every run, however it ended, with its duration (a failure has
    its INFO line too, with the error's message)."""
    if not log.isEnabledFor(logging.DEBUG):  # per job: nothing built for a line not kept
        return
    if result is not None and result.error is None:
        said = f"outcome={result.outcome}"
    else:  # (no result: its reservation was lost, or the worker is going down unreported)
        outcome, error = ("failed", result.error.type) if result is not None and \
            result.error else ("unreported", reason or "worker_stopping")
        said = "outcome=cancelled" if error == "cancelled" else f"outcome={outcome} error={error}"
    log.debug("job ended job=%s spec=%s queue=%s attempt=%d %s duration_ms=%d",
              copy.id, copy.spec, copy.queue, copy.attempt, said, round(took * 1000))


def released(copy: p.JobCopy, why: str) -> p.Result:
    """The result that gives a job back unstarted: not a failure, and no attempt used."""
    return p.Result(job_id=copy.id, attempt=copy.attempt, outcome="failed",
                    error=p.ErrorInfo(type="released", message=f"given back unstarted: {why}"))


def error_info(exc: BaseException) -> p.ErrorInfo:
    lines = traceback.format_exception(type(exc), exc, _from_handler(exc.__traceback__))
    return p.ErrorInfo(
        type=getattr(exc, "error_type", type(exc).__name__), message=p.cut_text(str(exc)),
        retryable=bool(getattr(exc, "retryable", True)),
        details={"traceback": "".join(lines)[-4000:]},
    )


SDK_FILES = os.path.dirname(os.path.abspath(__file__)) + os.sep  # rota/worker/


def _from_handler(tb: TracebackType | None) -> TracebackType | None:
    """A handler's traceback from its first frame that is not the SDK's: the frames that
    called it (three for a plain function: the run, its thread, the call) say nothing
    to whoever reads it. One raised by the SDK itself is kept whole."""
    first = tb
    while first is not None and first.tb_frame.f_code.co_filename.startswith(SDK_FILES):
        first = first.tb_next
    return first or tb
