"""Handlers for the process-isolation tests (tests/server/test_isolation.py): defined at the
top level of a module, so that a child process imports them by name, and importing only
what they use, so that it does so quickly."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from rota import JobContext

log = logging.getLogger("tests.isolated")


def report(ctx: JobContext) -> dict[str, Any]:
    """Progress, a captured line, an alert, a line of its own logging, and a result."""
    ctx.progress(50, "half way")
    ctx.log("working", "warning")
    ctx.alert("disk almost full", "error")
    log.warning("logged with logging by job %s", ctx.id)
    return {"pid": os.getpid(), "args": ctx.args}


def boom(ctx: JobContext) -> None:
    raise ValueError(f"no luck {ctx.args['n']}")


def leave(ctx: JobContext) -> None:
    raise SystemExit(3)


def grind(ctx: JobContext) -> int:
    """0.6 s of blocking work, twice its lease, kept by heartbeats."""
    for _ in range(6):
        time.sleep(0.1)  # noqa: sleep-ok (the job's own blocking work)
        ctx.heartbeat()
    return 6


def charge(ctx: JobContext) -> str:
    """Says it started (its pid), waits, then has its side effect: a cancel in between
    must stop it before the card is charged."""
    Path(ctx.args["pid"]).write_text(str(os.getpid()))
    time.sleep(ctx.args["wait"])  # noqa: sleep-ok (the job's own slow work)
    Path(ctx.args["effect"]).write_text("charged")
    return "charged"


def stubborn(ctx: JobContext) -> None:
    """Ignores SIGTERM and never returns: only SIGKILL stops it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(ctx.args["pid"]).write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)  # noqa: sleep-ok (a hung call)


def crash(ctx: JobContext) -> None:
    """Killed by the OS in the middle of its work (as the OOM killer would)."""
    os.kill(os.getpid(), signal.SIGKILL)


def polite(ctx: JobContext) -> None:
    """A plain function on a thread that stops when told to (cooperative cancellation)."""
    Path(ctx.args["pid"]).write_text(str(os.getpid()))
    deadline = time.monotonic() + 5
    while not ctx.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)  # noqa: sleep-ok (a step of its work)
    Path(ctx.args["effect"]).write_text("stopped" if ctx.cancelled else "never told")
