"""``rota worker`` (the rota.Worker at MODULE:ATTR, against one server or several) and
``rota demo`` (a server, a worker and a stream of jobs in one process)."""

from __future__ import annotations

import asyncio
import importlib
import importlib.resources
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from rota.cli import logsetup
from rota.cli.base import TOKEN_OPTION as _TOKEN
from rota.cli.base import fail as _fail
from rota.cli.base import servers as _servers
from rota.cli.base import token as _token
from rota.cli.logsetup import LEVELS
from rota.cli.logsetup import LOG_FORMAT as _LOG_FORMAT
from rota.base.errors import RegistrationRefused
from rota.base.protocol import MAX_PREFETCH
from rota.base.specs import SpecError, load_dir
from rota.base.wording import names


# A worker's --url, unlike the other commands', takes several servers (servers that
# share one database): ROTA_URL can then name them all, for workers and commands alike.
_WORKER_URLS = click.option(
    "--url", "urls", envvar="ROTA_URL", show_envvar=True, multiple=True,
    default=["http://127.0.0.1:8000"], show_default=True,
    help="Base URL of a Rota server (repeatable; ROTA_URL takes several, separated by"
         " commas). When the connection fails or is lost, the worker moves to the next.")


def _split_urls(values: tuple[str, ...]) -> list[str]:
    """--url A --url B, --url A,B and ROTA_URL=A,B all name A then B."""
    return [url for value in values for url in _servers(value)]


def _checked_labels(_ctx: click.Context, _param: click.Parameter,
                    value: tuple[str, ...]) -> tuple[str, ...]:
    """A label the server would refuse is a usage error, said before connecting (the
    server would refuse the registration)."""
    try:
        names("labels", list(value))
    except ValueError as exc:
        raise click.BadParameter(f"{exc}: one label per --label; ROTA_LABELS takes several,"
                                 " separated by spaces") from None
    return value


LOOPS = ("auto", "asyncio", "uvloop")


@click.command()
@click.argument("target")
@_WORKER_URLS
@_TOKEN
@click.option("--log-level", envvar="ROTA_LOG_LEVEL", default="info", show_default=True,
              show_envvar=True, type=LEVELS,
              help="The least severe lines the worker logs (trace: debug, and the libraries'"
              " own debug lines too, such as each WebSocket frame).")
@_LOG_FORMAT
@click.option("--concurrency", envvar="ROTA_CONCURRENCY", show_envvar=True,
              type=click.IntRange(1, 2**31 - 1), default=None,
              help="Jobs run at once (default: the Worker's own).")
@click.option("--queues", envvar="ROTA_QUEUES", show_envvar=True, default=None,
              help="Comma-separated queues to take jobs from (default: the Worker's own).")
@click.option("--label", "labels", envvar="ROTA_LABELS", show_envvar=True, multiple=True,
              callback=_checked_labels,
              help="A label for this worker (repeatable; ROTA_LABELS takes several, separated"
              " by spaces), added to the Worker's own: 'rota workers quiet --label X'.")
@click.option("--specs-dir", envvar="ROTA_SPECS_DIR", show_envvar=True, default=None,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Where the worker's spec files are (default: the Worker's own).")
@click.option("--prefetch", envvar="ROTA_PREFETCH", show_envvar=True,
              type=click.IntRange(0, MAX_PREFETCH), default=None,
              help="The most jobs to hold beyond the worker's concurrency, waiting to"
              " start (default: the Worker's own, 32 x its concurrency unless set; 0: none).")
@click.option("--loop", "loop_name", envvar="ROTA_WORKER_LOOP", show_envvar=True,
              type=click.Choice(LOOPS), default="auto", show_default=True,
              help="The handlers' event loop. auto: uvloop where it is installed (a job"
              " starts about 40 us sooner), else asyncio's own; asyncio: for handlers that"
              " need the standard loop.")
def worker(target: str, urls: tuple[str, ...], log_level: str, log_format: str,
           concurrency: int | None, queues: str | None, labels: tuple[str, ...],
           specs_dir: Path | None, prefetch: int | None, loop_name: str) -> None:
    """Run the rota.Worker found at TARGET (MODULE:ATTR) against the server at --url
    (or the servers: the worker moves to the next when its connection fails or is lost).

    Signals: SIGTERM takes no new jobs, gives back the jobs waiting in its prefetch line,
    lets running ones finish within the worker's grace period (cancelling the rest, which
    go back to the queue at once), deregisters and exits 0. SIGINT (Ctrl-C) does the same,
    and says so. A second SIGTERM or SIGINT takes the fast path: running jobs are cancelled
    and go back to the queue at once. SIGTSTP goes quiet (no new jobs; the line goes
    back); SIGCONT resumes.
    """
    logsetup.configure(log_level, log_format)
    loop_factory = _loop_factory(loop_name)
    instance = _import_worker(target)
    try:
        instance.url = _split_urls(urls)
    except ValueError as exc:  # every URL is checked before any is tried
        _fail(str(exc))
    instance.token = _token() or instance.token
    try:  # a deploy sets these from the environment, without editing the worker's code
        instance.configure(concurrency=concurrency, prefetch=prefetch, labels=list(labels),
                           specs_dir=specs_dir,
                           queues=None if queues is None else [q.strip() for q in
                                                               queues.split(",") if q.strip()])
    except ValueError as exc:
        _fail(str(exc))
    if not instance.specs_dir.is_dir():  # (the worker module is loaded: no import cost)
        from rota.worker.worker import missing_specs_dir

        _fail(missing_specs_dir(instance.specs_dir, "point it elsewhere with --specs-dir or"
                                " ROTA_SPECS_DIR"))
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_run_worker(instance))
    except (SpecError, RegistrationRefused) as exc:
        _fail(str(exc))
    except PermissionError as exc:  # the handshake was refused: no token, or the wrong one
        _fail(f"{exc}: " + ("check ROTA_TOKEN (or --token): it must be a live worker token"
                            " of this server ('rota tokens list' shows them)" if instance.token
                            else "set ROTA_TOKEN (or --token) to a worker token ('rota tokens"
                            " create --scope worker')"))
    if instance.exit_code:
        sys.exit(instance.exit_code)


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What makes the handlers' loop for ``--loop`` (None: asyncio's own)."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:  # Windows, or a Rota installed without it
        if name == "uvloop":
            _fail("--loop uvloop: uvloop is not installed here (pip install uvloop), or"
                  " run the handlers on asyncio's own loop: --loop asyncio")
        return None
    return uvloop.new_event_loop


def _import_worker(target: str) -> Any:
    from rota.worker.worker import Worker

    module_name, _, attr = target.partition(":")
    if not attr:
        _fail(f"TARGET must look like module:attribute, got {target!r}")
    sys.path.insert(0, str(Path.cwd()))
    try:
        instance = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        _fail(f"cannot load {target}: {exc}")
    if not isinstance(instance, Worker):
        _fail(f"{target} is a {type(instance).__name__}, not a rota.Worker")
    return instance


async def _run_worker(instance: Any) -> None:
    # Signals are the SDK's own (Worker.run): the same for a script that runs a worker.
    await instance.run()
    # The worker has deregistered and the process is leaving: a Ctrl-C that lands now
    # (a quick double press) must not turn a clean exit into death by signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


@click.command()
@click.option("--port", default=8000, show_default=True, help="Port for the demo server.")
@click.option("--db", default="rota-demo.db", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="SQLite file for the demo.")
@click.option("--specs", "specs_dir", default=None,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Spec files for the demo (default: those that ship with Rota).")
@click.option("--rate", default=5.0, show_default=True, help="Demo jobs enqueued per second.")
def demo(port: int, db: Path, specs_dir: Path | None, rate: float) -> None:
    """Run a server, push the demo specs, start a worker and enqueue a stream of jobs.

    Assignments and results show in the log. Stop with Ctrl-C.
    """
    from rota.server import startup
    from rota.cli.demo import run_demo

    logsetup.configure("info")
    try:  # (the lock and the socket are held until the command ends)
        sock = click.get_current_context().with_resource(startup.taken(db, "127.0.0.1", port))
    except startup.Refused as exc:
        _fail(exc.message)
    if specs_dir is None:
        specs_dir = Path(str(importlib.resources.files("rota") / "demo_specs"))
    try:  # a bad spec file is one line, before the server starts
        load_dir(specs_dir)
    except SpecError as exc:
        _fail(str(exc))
    asyncio.run(run_demo(port=port, db=db, specs_dir=specs_dir, rate=rate, sock=sock))
