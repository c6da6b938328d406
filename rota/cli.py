"""The ``rota`` command: serve, run workers, push specs during deploys, enqueue, inspect.

The environment is read here and nowhere else: every ``rota serve`` option has a
``ROTA_<OPTION>`` variable, and commands that talk to a server read ``ROTA_URL``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import importlib.resources
import json
import re
import signal
import socket
import sqlite3
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import click

from rota import cli_live, cli_logging, cli_ops
from rota.cli_base import TOKEN_OPTION as _TOKEN
from rota.cli_base import URL_OPTION
from rota.cli_base import api as _api
from rota.cli_base import error as _error
from rota.cli_base import fail as _fail
from rota.cli_base import out as _out
from rota.cli_base import out_lines as _out_lines
from rota.cli_base import print_json as _print_json
from rota.cli_base import servers as _servers
from rota.cli_base import token as _token
from rota.protocol import MAX_PREFETCH
from rota.retention import parse_duration, parse_rule
from rota.specs import SpecError, checksum, load_dir

from rota.cli_logging import LEVELS
from rota.cli_logging import LOG_FORMAT as _LOG_FORMAT
SERVER_SWITCH_INTERVAL = 0.0005  # seconds: see serve()


class _Duration(click.ParamType):
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> float | None:
        if value is None or isinstance(value, float):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class _RetainRule(click.ParamType):
    name = "rule"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> tuple[str, dict[str, float | None]]:
        if isinstance(value, tuple):
            return value
        try:
            return parse_rule(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


_DURATION, _RETAIN_RULE = _Duration(), _RetainRule()


def _print_job(data: dict[str, Any]) -> None:
    """A job (or a result) as JSON on stdout, for scripts, with each error's traceback
    taken out and written to stderr as it was raised: lines, not one string of \\n,
    under a line naming its attempt and indented by 4 (the worker's text, which may hold
    a line that looks like that one)."""
    errors = [e for e in [*data.get("errors", []), data.get("error")] if isinstance(e, dict)]
    tracebacks = []
    for error in errors:
        details = error.get("details")
        if isinstance(details, dict) and isinstance(details.get("traceback"), str):
            tracebacks.append((error, details["traceback"]))
            details["traceback"] = "(on stderr)"
    _print_json(data)
    for error, text in tracebacks:  # the worker's own lines, each escaped
        _out(f"--- attempt {error.get('attempt', '?')} on {error.get('worker_id') or '?'}:"
             f" {error.get('type')}: {error.get('message')}", err=True)
        _out_lines(text, indent="    ", err=True)


class OneLineErrors(click.Group):
    """click, but a mistake on the command line is one line, like every other expected
    failure of ``rota``: "error: <what is wrong> (see 'rota x --help')", exit 2."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `rota`, `rota specs`: help
            _out_lines(exc.ctx.get_help() if exc.ctx else exc.format_message())
            sys.exit(0)
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            _error(f"{exc.format_message()}{hint}")
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            _error(exc.format_message())
            sys.exit(exc.exit_code)
        except click.Abort:
            _out("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rota")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Rota: a job coordinator. Workers hold one WebSocket; the server pushes them jobs."""
    if ctx.invoked_subcommand in SERVER_COMMANDS:
        _need_server(ctx.invoked_subcommand)


# Commands that run the server's code (or open its database), and the packages only they
# need: a worker's or producer's install ('pip install rota') leaves those out.
# (`rota tokens` needs them only on the file: over the API, with --url, it is a client.)
class DatabaseParam(click.ParamType):
    """--db: an SQLite file (a Path), or a PostgreSQL database's URL (postgresql:// or
    postgres://, kept as text)."""

    name = "FILE|URL"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Path | str:
        if isinstance(value, Path):
            return value
        text = str(value)
        if text.startswith(("postgresql://", "postgres://")):
            return text
        if "://" in text:  # a server's URL, or a misspelt scheme: not a file name
            self.fail(f"{text!r} is neither a database file nor a postgresql:// URL (a"
                      " server's own URL goes in --url)", param, ctx)
        if text.endswith("/") or Path(text).is_dir():
            self.fail(f"{text!r} is a directory: give a database file, or a postgresql://"
                      " URL", param, ctx)
        return Path(text)


DATABASE = DatabaseParam()


def _database_failure(db: Path | str, exc: BaseException) -> str | None:
    """One line for a database that cannot be used (an SQLite error, a PostgreSQL server
    that is down or refuses us, a malformed URL); None if ``exc`` is none of these."""
    from rota.db import storage_error

    where = db if isinstance(db, Path) else _redacted(db)
    if isinstance(exc, sqlite3.Error):
        storage = storage_error(exc)
        return f"cannot open the database {where}: " + (
            f"{storage.message} [{storage.code}]" if storage is not None else str(exc))
    try:
        import psycopg
    except ImportError:
        return None
    if not isinstance(exc, psycopg.Error):
        return None
    from rota import pg

    storage = pg.storage_error(exc)
    if storage is not None:
        return f"cannot open the database {where}: {storage.message} [{storage.code}]"
    # A malformed URL, a refused login, a missing database: what PostgreSQL said, on one
    # line (libpq's messages run over several).
    said = " ".join(str(exc).split()) or type(exc).__name__
    return f"cannot open the database {where}: {said}"


def _redacted(url: str) -> str:
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


SERVER_COMMANDS = frozenset({"serve", "demo"})
SERVER_PACKAGES = frozenset({"starlette", "uvicorn", "sqlite_utils", "psycopg", "httptools",
                             "prometheus_client"})


def _need_server(command: str) -> None:
    """One line saying what to install, rather than an ImportError's traceback."""
    try:
        import rota.server  # noqa: F401
        import rota.store  # noqa: F401
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in SERVER_PACKAGES:
            raise  # not a missing server package: a real bug, shown whole
        _fail(f"'rota {command}' needs the server's packages ({exc.name} is not installed):"
              " pip install 'rota[server]'")


@main.command()
@click.option("--host", envvar="ROTA_HOST", default="127.0.0.1", show_default=True, show_envvar=True,
              help="Address to listen on.")
@click.option("--port", envvar="ROTA_PORT", default=8000, show_default=True, show_envvar=True, help="Port to listen on.")
@click.option("--db", envvar="ROTA_DB", default="rota.db", show_default=True, show_envvar=True,
              type=DATABASE, help="SQLite database file, or a PostgreSQL database's URL"
              " (postgresql://user@host:5432/rota), which several servers may share.")
@click.option("--db-pool", envvar="ROTA_DB_POOL", default=2, show_default=True, show_envvar=True,
              type=click.IntRange(min=1), help="Reader connections to the database (reads"
              " for the API and the dashboard; writes have one connection of their own).")
@click.option("--server-id", envvar="ROTA_SERVER_ID", default=None, show_envvar=True,
              help="This server's name among those sharing a PostgreSQL database"
              " (default: host:port). A restart under the same name takes back its workers'"
              " reservations.")
@click.option("--server-lease", envvar="ROTA_SERVER_LEASE", default=10.0, show_default=True,
              show_envvar=True, type=click.FloatRange(min=0.2),
              help="Seconds a server's lease lasts (renewed 4 times per lease, on the"
              " database's clock). Servers sharing a database recover a dead one's"
              " reservations after its lease and the reconnect grace; a quarter of it (0.5 s"
              " at least) bounds how long one stalled in a transaction holds the others.")
@click.option("--log-level", envvar="ROTA_LOG_LEVEL", default="info", show_default=True, show_envvar=True, type=LEVELS)
@_LOG_FORMAT
@click.option("--heartbeat-interval", envvar="ROTA_HEARTBEAT_INTERVAL", default=1.0, show_default=True, show_envvar=True,
              help="Seconds between worker heartbeats (told to workers in the welcome).")
@click.option("--heartbeat-timeout", envvar="ROTA_HEARTBEAT_TIMEOUT", default=5.0, show_default=True, show_envvar=True,
              help="Seconds of silence after which a worker is dropped and its jobs requeued.")
@click.option("--reconnect-grace", envvar="ROTA_RECONNECT_GRACE", default=5.0, show_default=True, show_envvar=True,
              help="Seconds a lost connection's jobs stay reserved for its worker to reconnect.")
@click.option("--visibility-timeout", envvar="ROTA_VISIBILITY_TIMEOUT", default=1800.0, show_default=True, show_envvar=True,
              help="Default seconds a job stays reserved for its worker.")
@click.option("--max-args-bytes", envvar="ROTA_MAX_ARGS_BYTES", default=256 * 1024, show_default=True, show_envvar=True,
              help="Largest job args, as JSON (413 args_too_large above).")
@click.option("--max-result-bytes", envvar="ROTA_MAX_RESULT_BYTES", default=1 << 20, show_default=True, show_envvar=True,
              help="Largest job result, as JSON (the job fails with result_too_large above).")
@click.option("--max-body-bytes", envvar="ROTA_MAX_BODY_BYTES", default=1 << 20, show_default=True, show_envvar=True,
              help="Largest HTTP request body (413 body_too_large above).")
@click.option("--durability", envvar="ROTA_DURABILITY", type=click.Choice(["full", "process"]),
              default="full", show_default=True, show_envvar=True,
              help="What an acknowledged write survives. full: power loss (every commit is"
                   " fsynced). process: a crash of Rota, not of the machine (faster; the last"
                   " commits before an OS crash or power cut may be lost).")
@click.option("--max-db-size", envvar="ROTA_MAX_DB_SIZE", type=click.IntRange(min=1),
              default=None, show_envvar=True,
              help="Bytes the database file may take (default: no limit). New jobs get 503"
                   " storage_full once the room left is what the unfinished jobs need.")
@click.option("--retain-completed", envvar="ROTA_RETAIN_COMPLETED", type=_DURATION, default="7d",
              show_default=True, show_envvar=True,
              help="How long a completed job is kept, then deleted (30s, 12h, 7d; never).")
@click.option("--retain-discarded", envvar="ROTA_RETAIN_DISCARDED", type=_DURATION, default="30d",
              show_default=True, show_envvar=True, help="How long a discarded job is kept.")
@click.option("--retain-cancelled", envvar="ROTA_RETAIN_CANCELLED", type=_DURATION, default="7d",
              show_default=True, show_envvar=True, help="How long a cancelled job is kept.")
@click.option("--retain", "retain_queues", envvar="ROTA_RETAIN", show_envvar=True, multiple=True,
              type=_RETAIN_RULE, callback=lambda ctx, param, rules: tuple(
                  (queue, state, seconds) for queue, durations in rules
                  for state, seconds in durations.items()),
              help="A queue's own retention, e.g. queue=emails:completed=1d:discarded=90d"
                   " (repeat).")
@click.option("--max-connections", envvar="ROTA_MAX_CONNECTIONS", default=1000, show_default=True, show_envvar=True,
              help="Open connections of any kind; new ones get 503 above.")
@click.option("--max-worker-connections-per-token", envvar="ROTA_MAX_WORKER_CONNECTIONS_PER_TOKEN", default=200,
              show_default=True, show_envvar=True, help="Open /work connections per token (429 above).")
@click.option("--max-waits-per-token", envvar="ROTA_MAX_WAITS_PER_TOKEN", default=100,
              show_default=True, show_envvar=True, type=click.IntRange(min=1),
              help="HTTP requests that stay open (GET /events, result ?wait=) per token at once"
              " (429 too_many_waits above).")
@click.option("--rate-limit", envvar="ROTA_RATE_LIMIT", default=20_000.0, show_default=True, show_envvar=True,
              help="Frames a second one /work connection may send on average; above it, it is throttled.")
@click.option("--rate-burst", envvar="ROTA_RATE_BURST", default=20_000, show_default=True, show_envvar=True,
              help="Frames one /work connection may send in a burst.")
@click.option("--rate-bytes", envvar="ROTA_RATE_BYTES", default=64 << 20, show_default=True, show_envvar=True,
              help="Bytes a second one /work connection may send on average; above it, it is throttled.")
@click.option("--throttle-close-after", envvar="ROTA_THROTTLE_CLOSE_AFTER", default=60.0, show_default=True,
              show_envvar=True, help="Seconds a /work connection may stay throttled before it is closed"
              " (its jobs then get the reconnect grace).")
@click.option("--outbox-high-water", envvar="ROTA_OUTBOX_HIGH_WATER", default=1 << 20, show_default=True,
              show_envvar=True, help="Bytes sent to one /work connection and not yet read by its worker"
              " above which it gets no new jobs, until they drain below a quarter of it.")
@click.option("--outbox-limit", envvar="ROTA_OUTBOX_LIMIT", default=8 << 20, show_default=True,
              show_envvar=True, help="Bytes sent to one /work connection and not read, above which"
              " it is closed if it stays there --outbox-close-after seconds.")
@click.option("--outbox-close-after", envvar="ROTA_OUTBOX_CLOSE_AFTER", default=30.0, show_default=True,
              show_envvar=True, help="Seconds a /work connection may stay over --outbox-limit before"
              " it is closed (slow_consumer; its jobs then get the reconnect grace).")
@click.option("--registration-timeout", envvar="ROTA_REGISTRATION_TIMEOUT", default=5.0, show_default=True,
              show_envvar=True, help="Seconds a new /work socket has to register.")
@click.option("--header-timeout", envvar="ROTA_HEADER_TIMEOUT", default=10.0, show_default=True, show_envvar=True,
              help="Seconds a client has to send a request's headers.")
@click.option("--body-timeout", envvar="ROTA_BODY_TIMEOUT", default=30.0, show_default=True, show_envvar=True,
              help="Seconds a client has to send a request's body, once its headers are in.")
@click.option("--events-buffer", envvar="ROTA_EVENTS_BUFFER", default=10_000, show_default=True,
              show_envvar=True, type=click.IntRange(min=1),
              help="Events kept for GET /events clients that resume (Last-Event-ID); one"
              " further behind gets a gap event.")
@click.option("--events-keepalive", envvar="ROTA_EVENTS_KEEPALIVE", default=15.0, show_default=True,
              show_envvar=True, type=click.FloatRange(min=0.01),
              help="Most seconds GET /events stays silent: a keep-alive comment then.")
@click.option("--max-series", envvar="ROTA_MAX_SERIES", default=1000, show_default=True,
              show_envvar=True, type=click.IntRange(min=1),
              help="(queue, spec) pairs, and queues, that GET /metrics, GET /stats and the"
              " dashboard name one by one; the rest are counted under queue \"(other)\".")
@click.option("--ssl-certfile", envvar="ROTA_SSL_CERTFILE", show_envvar=True,
              type=click.Path(exists=True, dir_okay=False), help="Serve HTTPS/wss with this certificate (PEM).")
@click.option("--ssl-keyfile", envvar="ROTA_SSL_KEYFILE", show_envvar=True,
              type=click.Path(exists=True, dir_okay=False), help="The certificate's private key (PEM).")
@click.option("--allowed-origin", "allowed_origins", envvar="ROTA_ALLOWED_ORIGINS", show_envvar=True,
              multiple=True, help="A browser Origin allowed on /work (repeat; none by default).")
@click.option("--insecure", is_flag=True, envvar="ROTA_INSECURE", show_envvar=True,
              help="Allow a non-loopback --host with no tokens (anyone may take jobs).")
@click.option("--ui-read-only", is_flag=True, envvar="ROTA_UI_READ_ONLY", show_envvar=True,
              help="The dashboard (/ui) shows everything and changes nothing.")
@click.option("--crash-at", envvar="ROTA_CRASH_AT", hidden=True,
              type=click.Choice(["enqueue-before-commit", "enqueue-after-commit",
                                 "reserve-after-commit", "result-after-commit"]),
              help="Test switch: exit abruptly at this point (crash-safety tests).")
@click.option("--hold-reserve", envvar="ROTA_HOLD_RESERVE", hidden=True, default=0.0,
              type=click.FloatRange(min=0.0),
              help="Test switch: seconds each reservation's transaction stays open (stall"
              " tests).")
def serve(db: Path | str, log_level: str, log_format: str, insecure: bool,
          allowed_origins: tuple[str, ...], **options: Any) -> None:
    """Run the Rota server: /work for workers, the HTTP API for everyone else, and the
    dashboard at /ui.

    With no token created ('rota tokens create') it runs open, and then only on a loopback
    address unless --insecure is given. The limits are in docs/operations.md.
    """
    from rota.db import NewerDatabase
    from rota.server import serve as run_server
    from rota.settings import ServerSettings, loopback
    from rota.store import list_tokens, server_id_in_use

    cli_logging.configure(log_level, log_format)
    if isinstance(db, Path):  # (several servers share a PostgreSQL database: no lock)
        _hold_database(db)  # first: a second server must not even migrate the file
    sock = _listen(options["host"], options["port"])  # then: a busy port migrates nothing
    try:  # opens the database and applies any migration: the first write of a start
        tokens = list_tokens(db)
    except NewerDatabase as exc:
        _fail(exc.message)
    except Exception as exc:
        if (failure := _database_failure(db, exc)) is None:
            raise
        _fail(failure)
    if not isinstance(db, Path):  # two live servers under one name would share a lease
        server_id = options["server_id"] or f"{socket.gethostname()}:{options['port']}"
        try:
            in_use = server_id_in_use(db, server_id)
        except Exception as exc:
            if (failure := _database_failure(db, exc)) is None:
                raise
            _fail(failure)
        if in_use is not None:
            _fail(in_use)
    if not tokens and not loopback(options["host"]) and not insecure:
        _fail(f"refusing to serve on {options['host']} with no tokens: anyone who reaches it could"
              " take jobs and give orders. Create one with 'rota tokens create --scope admin',"
              " or pass --insecure")
    where = {"db": db} if isinstance(db, Path) else {"database_url": db}
    settings = ServerSettings(**where, allowed_origins=allowed_origins, **options)
    # The writer thread hands a commit back to a busy event loop only when the loop lets go
    # of the GIL; by default that can take 5 ms. 0.5 ms: 5-7% more jobs/s in a drain of
    # 10,000 no-op jobs (docs/performance.md), and a shorter worst case on the idle path.
    sys.setswitchinterval(SERVER_SWITCH_INTERVAL)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(run_server(settings, log_level=log_level, sock=sock))


def _listen(host: str, port: int) -> Any:
    """The server's listening socket, or one line saying why there is none."""
    from rota.server import listen_socket

    try:
        sock = listen_socket(host, port)
    except OSError as exc:
        reason = ("the port is in use (another rota serve? pick one with --port)"
                  if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc))
        _fail(f"cannot listen on {host}:{port}: {reason}")
    # Closed however the command ends: uvicorn closes it too when it serves.
    return click.get_current_context().with_resource(contextlib.closing(sock))


def _hold_database(db: Path) -> None:
    """Hold the database's one-server lock until this command ends, or fail in one line
    (docs/operations.md, One server per database). ``rota tokens`` takes no lock: it
    writes the file beside a running server, through SQLite's own locking."""
    from rota.dblock import hold_database
    from rota.errors import DatabaseInUse, DatabaseLinked

    try:
        click.get_current_context().with_resource(hold_database(db))
    except (DatabaseInUse, DatabaseLinked) as exc:
        _fail(exc.message)
    except OSError as exc:
        _fail(f"cannot open the database {db}: {exc.strerror} ({exc.filename})")



def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (it is a server dependency): a faster event loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


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


@main.command()
@click.argument("target")
@_WORKER_URLS
@_TOKEN
@click.option("--log-level", envvar="ROTA_LOG_LEVEL", default="info", show_default=True,
              show_envvar=True, type=LEVELS, help="The least severe lines the worker logs.")
@_LOG_FORMAT
@click.option("--concurrency", envvar="ROTA_CONCURRENCY", show_envvar=True,
              type=click.IntRange(1, 2**31 - 1), default=None,
              help="Jobs run at once (default: the Worker's own).")
@click.option("--queues", envvar="ROTA_QUEUES", show_envvar=True, default=None,
              help="Comma-separated queues to take jobs from (default: the Worker's own).")
@click.option("--label", "labels", envvar="ROTA_LABELS", show_envvar=True, multiple=True,
              help="A label for this worker (repeatable; ROTA_LABELS takes several, separated"
              " by spaces), added to the Worker's own: 'rota workers quiet --label X'.")
@click.option("--specs-dir", envvar="ROTA_SPECS_DIR", show_envvar=True, default=None,
              type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Where the worker's spec files are (default: the Worker's own).")
@click.option("--prefetch", envvar="ROTA_PREFETCH", show_envvar=True,
              type=click.IntRange(0, MAX_PREFETCH), default=None,
              help="The most jobs to hold beyond the worker's concurrency, waiting to"
              " start (default: the Worker's own, 32 x its concurrency unless set; 0: none).")
def worker(target: str, urls: tuple[str, ...], log_level: str, log_format: str, concurrency: int | None,
           queues: str | None, labels: tuple[str, ...], specs_dir: Path | None,
           prefetch: int | None) -> None:
    """Run the rota.Worker found at TARGET (MODULE:ATTR) against the server at --url
    (or the servers: the worker moves to the next when its connection fails or is lost).

    Signals: SIGTERM takes no new jobs, gives back the jobs waiting in its prefetch line,
    lets running ones finish within the worker's grace period (cancelling the rest, which
    go back to the queue at once), deregisters and exits 0. SIGINT (Ctrl-C) does the same
    without waiting. A second SIGTERM or SIGINT takes the fast path. SIGTSTP goes quiet
    (no new jobs; the line goes back); SIGCONT resumes.
    """
    cli_logging.configure(log_level, log_format)
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
    try:
        asyncio.run(_run_worker(instance))
    except SpecError as exc:
        _fail(str(exc))
    except PermissionError as exc:  # the handshake was refused: no token, or the wrong one
        _fail(f"{exc}: set ROTA_TOKEN (or --token) to a worker token ('rota tokens create"
              " --scope worker')")
    if instance.exit_code:
        sys.exit(instance.exit_code)


def _import_worker(target: str) -> Any:
    from rota.worker import Worker

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


@main.group()
def specs() -> None:
    """Register job specs (the status quo) and inspect them."""


@specs.command("push")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@URL_OPTION
@click.option("--dry-run", is_flag=True, help="Show what would change; change nothing.")
def specs_push(directory: Path, url: str, dry_run: bool) -> None:
    """Make the specs in DIRECTORY the status quo (run this during a deploy).

    Prints, per spec, whether it is new, changed or unchanged, and for changed specs how
    many connected workers no longer match.
    """
    try:
        loaded = load_dir(directory)
    except SpecError as exc:
        _fail(str(exc))
    report = _api(url, "push_specs", loaded, dry_run=dry_run)
    for item in report["specs"]:
        line = f"{item['change']:<9} {item['name']}  {item['checksum'][:19]}"
        if item["change"] == "changed":
            line += f"  (was {item['previous'][:19]}; {item['mismatched_workers']} connected worker(s) no longer match)"
        _out(line)
    if dry_run:
        _out("dry run: nothing was changed")


@specs.command("list")
@URL_OPTION
def specs_list(url: str) -> None:
    """List the status-quo specs with their versions and checksums."""
    for spec in _api(url, "specs")["specs"]:
        retired = f"  retired {spec['retired_at']}" if spec.get("retired_at") else ""
        _out(f"{spec['name']:<24} {spec['version']:<10} {spec['checksum'][:19]}"
             f"  queue={spec['queue']}{retired}")


@specs.command("history")
@click.argument("name")
@URL_OPTION
def specs_history(name: str, url: str) -> None:
    """Show every version of spec NAME that was made the status quo, oldest first."""
    for entry in _api(url, "spec_history", name)["history"]:
        retired = "  retired" if entry.get("event") == "retire" else ""
        _out(f"{entry['pushed_at']}  {entry['version']:<10} {entry['checksum'][:19]}{retired}")


@specs.command("retire")
@click.argument("name")
@URL_OPTION
@click.option("--cancel-waiting", is_flag=True,
              help="Also cancel its jobs that wait (scheduled, available, retryable).")
def specs_retire(name: str, url: str, cancel_waiting: bool) -> None:
    """Retire spec NAME: new jobs of it are refused (spec_retired) until it is pushed again.

    Its jobs that wait still run on workers that declare its last checksum, unless
    --cancel-waiting; running ones finish either way.
    """
    report = _api(url, "retire_spec", name, cancel_waiting=cancel_waiting)
    jobs = report["jobs"]
    waiting = jobs["scheduled"] + jobs["available"] + jobs["retryable"]
    _out(f"{name} {'was already' if report['already_retired'] else 'is now'} retired"
         f" (since {report['retired_at']}, checksum {report['checksum'][:19]}):"
         " new jobs are refused; push it again to use it")
    if cancel_waiting:
        _out(f"cancelled {report['cancelled']} waiting job(s)")
    _out(f"waiting: {waiting} (scheduled {jobs['scheduled']}, available"
         f" {jobs['available']}, retryable {jobs['retryable']}); running:"
         f" {jobs['active']}; matching workers: {report['matching_workers']}")
    if waiting:
        _out("the waiting jobs still run on workers that declare this checksum;"
             " rota specs retire --cancel-waiting cancels them")


@specs.command("checksum")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def specs_checksum(directory: Path) -> None:
    """Print the checksum of every spec in DIRECTORY (no server needed)."""
    try:
        for spec in load_dir(directory):
            _out(f"{spec.name:<24} {checksum(spec)}")
    except SpecError as exc:
        _fail(str(exc))


def job_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The enqueue options shared by ``enqueue`` and ``run``."""
    options = [
        click.argument("spec"),
        click.option("--args", "args_json", default="{}", show_default=True,
                     help="Job arguments as a JSON object."),
        click.option("--id", "job_id", help="Job id; enqueuing the same id again returns the existing job."),
        click.option("--queue", help="Queue (default: the spec's)."),
        click.option("--priority", type=int, help="Priority, higher first (default: the spec's)."),
        click.option("--delay", type=float, help="Run no sooner than this many seconds from now."),
        click.option("--run-at", help="Run no sooner than this RFC 3339 time."),
        click.option("--ttl", type=float, help="Discard the job if not completed within this many seconds."),
        click.option("--visibility-timeout", type=float, help="Seconds a worker may hold it without a heartbeat."),
        click.option("--max-attempts", type=int, help="Attempts allowed, timeouts included (default: the spec's)."),
        click.option("--max-fails", type=int, help="Explicit failures allowed (default: the spec's)."),
        click.option("--capture-logs", is_flag=True, default=None,
                     help="Keep the lines the handler logs with ctx.log() (see 'rota jobs show')."),
        URL_OPTION,
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _enqueue(url: str, spec: str, args_json: str, job_id: str | None, **options: Any
             ) -> dict[str, Any]:
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        _fail(f"--args is not valid JSON: {exc}")
    if not isinstance(args, dict):
        _fail("--args must be a JSON object")
    return _api(url, "enqueue", spec, args, id=job_id, **options)


@main.command()
@job_options
def enqueue(url: str, spec: str, args_json: str, job_id: str | None, **options: Any) -> None:
    """Enqueue a job of SPEC and print it."""
    reply = _enqueue(url, spec, args_json, job_id, **options)
    if not reply["created"]:
        _out("a job with this id exists already:", err=True)
    _print_json(reply["job"])


@main.command()
@job_options
@click.option("--wait", type=float, default=60.0, show_default=True,
              help="Seconds to wait for the result.")
def run(url: str, spec: str, args_json: str, job_id: str | None, wait: float,
        **options: Any) -> None:
    """Enqueue a job of SPEC, wait for it to finish and print its result.

    Exits 0 when it completed, 1 when it was discarded or cancelled, 2 when it had not
    finished within --wait seconds (it keeps running; see 'rota jobs show').
    """
    job = _enqueue(url, spec, args_json, job_id, **options)["job"]
    deadline = time.monotonic() + wait
    while True:
        step = max(0.0, min(300.0, deadline - time.monotonic()))
        reply = _api(url, "result", job["id"], wait=step)
        if reply["done"] or step == 0:
            break
    _print_job(reply)
    if not reply["done"]:
        _out(f"job {job['id']} has not finished after {wait:g}s", err=True)
        sys.exit(2)
    sys.exit(0 if reply["state"] == "completed" else 1)


@main.group()
def workers() -> None:
    """See connected workers; quiet, resume or terminate them (rolling deploys)."""


def _prefetched(worker: dict[str, Any]) -> str:
    """' +waiting/prefetch' after the load, for a worker that prefetches."""
    if not worker.get("prefetch"):
        return ""
    return f" +{worker['prefetched']}/{worker['prefetch']}"


@workers.command("list")
@URL_OPTION
def workers_list(url: str) -> None:
    """Each worker's state, queues, labels, load, spec matches and last heartbeat age."""
    rows = _api(url, "workers")["workers"]
    if not rows:
        _out("no workers connected")
    for w in rows:
        _out(f"{w['id']}  {w['state']:<9} load={w['active']}/{w['concurrency']}"
             f"{_prefetched(w)}"
             f"  queues={','.join(w['queues'])}  labels={','.join(w['labels']) or '-'}"
             f"  specs ok={','.join(w['specs_matching']) or '-'}"
             f" mismatched={','.join(w['specs_mismatching']) or '-'}"
             f"  host={w['hostname']} pid={w['pid']}{_usage(w)}"
             f"  beat={w['last_heartbeat_age']:.1f}s ago")


def _usage(worker: dict[str, Any]) -> str:
    if worker["memory_rss"] is None:
        return ""
    return f"  cpu={worker['cpu_percent'] or 0:.0f}% rss={worker['memory_rss'] / 2**20:.0f}MiB"


def _directive(name: str, state: str) -> Callable[..., None]:
    def command(worker_id: str | None, label: str | None, every: bool, url: str) -> None:
        if sum((worker_id is not None, label is not None, every)) != 1:
            _fail("name one worker ID, or --label LABEL, or --all")
        reply = _api(url, "direct", state, worker_id=worker_id, label=label, every=every)
        for worker in reply["workers"]:
            _out(f"{worker}: {state}")
        if not reply["workers"]:  # a typo in a label must not pass for success in a deploy
            _fail(f"no connected worker{f' with label {label!r}' if label else ''} to {name}")

    return command


for _name, _state, _help in (
        ("quiet", "quiet", "Stop sending jobs to workers; they finish what they run."),
        ("resume", "running", "Quiet workers take jobs again."),
        ("terminate", "terminate", "Workers finish their jobs within their grace period, then exit.")):
    workers.command(_name, help=_help)(
        click.argument("worker_id", required=False)(
            click.option("--label", help="Every worker with this label.")(
                click.option("--all", "every", is_flag=True, help="Every connected worker.")(
                    URL_OPTION(_directive(_name, _state))))))


DB_OPTION = click.option("--db", envvar="ROTA_DB", default="rota.db", show_default=True,
                         show_envvar=True, type=DATABASE,
                         help="The server's SQLite file or PostgreSQL URL (tokens are kept"
                         " there).")


def TOKENS_TARGET(command: Callable[..., Any]) -> Callable[..., Any]:  # noqa: N802
    """Where tokens are managed: the server's API (--url, with an admin --token), or
    its database file (--db)."""
    url = click.option("--url", envvar="ROTA_URL", show_envvar=True, default=None,
                       help="Manage the tokens of the server at this base URL, over its API"
                       " (with an admin token); without it, the --db file.")
    return url(_TOKEN(DB_OPTION(command)))


def _over_api(url: str | None) -> bool:
    """--url (or ROTA_URL) means the API, unless --db is given on the command line: an
    explicit file beats a URL left in the environment. Both given: refused."""
    explicit = click.core.ParameterSource.COMMANDLINE
    ctx = click.get_current_context()
    if url is None:
        return False
    if ctx.get_parameter_source("db") is explicit:
        if ctx.get_parameter_source("url") is explicit:
            _fail("give --url (the server's API) or --db (its file), not both")
        return False
    return True


def _token_file(db: Path | str, *, create: bool = False, offer_create: bool = False
                ) -> Path | str:
    """The database file, which must exist unless ``create``: a mistyped --db, or a run
    in another directory, would otherwise make a new database the server never reads.
    (A PostgreSQL URL names a database that exists, or connecting says it does not.)"""
    _need_server("tokens")
    if isinstance(db, Path) and not create and not db.exists():
        _fail(f"no database at {db.resolve()}: pass the server's file with --db, or use the"
              " server's API with --url and an admin --token"
              + ("; --create makes a new one, for the first token before any server ran"
                 if offer_create else ""))
    if isinstance(db, Path):
        from rota.dblock import refuse_linked
        from rota.errors import DatabaseLinked

        try:
            refuse_linked(db)
        except DatabaseLinked as exc:
            _fail(exc.message)
    return db


def _on_file(action: Callable[..., Any], db: Path | str, *args: Any, **kwargs: Any) -> Any:
    """Run a token ``action`` on the database; its refusals in one line."""
    from rota.db import NewerDatabase
    from rota.errors import Conflict

    try:
        return action(db, *args, **kwargs)
    except (Conflict, NewerDatabase) as exc:
        _fail(exc.message)
    except Exception as exc:
        if (failure := _database_failure(db, exc)) is None:
            raise
        _fail(failure)


@main.group()
def tokens() -> None:
    """Create, list and revoke bearer tokens: over the server's API with --url (or
    ROTA_URL) and an admin --token, from anywhere; or on its database file (--db), so the
    first token needs no server (a running server sees changes within a second)."""


@tokens.command("create")
@click.option("--scope", required=True, type=click.Choice(["worker", "producer", "admin", "metrics"]),
              help="worker: /work; producer: enqueue, read specs, read and cancel its own jobs;"
              " metrics: GET /metrics only; admin: all.")
@click.option("--queues", help="Limit the token to these queues (comma-separated).")
@click.option("--name", help="A name to know it by (default: scope and id).")
@click.option("--create", "create_db", is_flag=True,
              help="Create the --db file if it does not exist (the first token, before any"
              " server ran; 'rota serve' creates it too).")
@TOKENS_TARGET
def tokens_create(scope: str, queues: str | None, name: str | None, create_db: bool,
                  db: Path | str, url: str | None) -> None:
    """Create a token and print it. It is shown only this once: the store keeps a hash."""
    from rota.ids import TOKEN_NAME_PATTERN, TOKEN_NAME_RULE
    from rota.logs import printable
    from rota.specs import NAME_PATTERN

    if name is not None and not re.match(TOKEN_NAME_PATTERN, name):
        _fail(f"{printable(name)!r} is not a token name: {TOKEN_NAME_RULE}")
    limited = [q.strip() for q in queues.split(",") if q.strip()] if queues else None
    for queue in limited or []:
        if not re.match(NAME_PATTERN, queue):
            _fail(f"{queue!r} is not a queue name")
    if _over_api(url):
        assert url is not None
        made = _api(url, "create_token", scope, name=name, queues=limited)
        token_id, secret = made["id"], made["token"]
    else:
        path = _token_file(db, create=create_db, offer_create=True)
        from rota.auth import new_token
        from rota.store import create_token

        token_id, secret, hashed = new_token()
        _on_file(create_token, path,
                 name=name or f"{scope}-{token_id}", scope=scope, queues=limited,
                 token_id=token_id, hashed=hashed)
    _out(secret)
    _out(f"token {token_id} ({scope}{', queues ' + ','.join(limited) if limited else ''})"
         " created; copy it now, it is not shown again", err=True)


@tokens.command("list")
@TOKENS_TARGET
def tokens_list(db: Path | str, url: str | None) -> None:
    """The live tokens: id, name, scope, queues, when created (never the secret)."""
    if _over_api(url):
        assert url is not None
        rows = _api(url, "tokens")["tokens"]
    else:
        path = _token_file(db)
        from rota.store import list_tokens, token_view

        rows = [token_view(row) for row in _on_file(list_tokens, path)]
    if not rows:
        _out("no tokens: the server runs open (loopback only)")
    for row in rows:
        queues = ",".join(row["queues"]) if row["queues"] else "*"
        _out(f"{row['id']}  {row['scope']:<8} queues={queues}  name={row['name']}"
             f"  created={row['created_at']}")


@tokens.command("revoke")
@click.argument("which", metavar="TOKEN")  # not "token": --token is the caller's own
@TOKENS_TARGET
def tokens_revoke(which: str, db: Path | str, url: str | None) -> None:
    """Revoke TOKEN (its id or name): its calls are refused and its workers disconnected."""
    if _over_api(url):
        assert url is not None
        _api(url, "revoke_token", which)
    else:
        path = _token_file(db)
        from rota.store import revoke_token

        if not _on_file(revoke_token, path, which):
            _fail(f"no live token with id or name {which!r}")
    _out(f"revoked {which}")


@main.group()
def jobs() -> None:
    """Find and inspect jobs; retry or cancel one, or every job a filter matches."""


@jobs.command("show")
@click.argument("job_id")
@URL_OPTION
def jobs_show(job_id: str, url: str) -> None:
    """Show job JOB_ID: state, attempt, worker, result, errors, and why it waits."""
    _print_job(_api(url, "job", job_id))


for _command in cli_ops.JOB_COMMANDS:  # list, and retry and cancel of one job or many
    jobs.add_command(_command)
for _command in (cli_ops.queues, cli_live.watch, cli_live.tail):
    main.add_command(_command)


@main.command()
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
    from rota.demo import run_demo

    cli_logging.configure("info")
    _hold_database(db)
    if specs_dir is None:
        specs_dir = Path(str(importlib.resources.files("rota") / "demo_specs"))
    sock = _listen("127.0.0.1", port)
    asyncio.run(run_demo(port=port, db=db, specs_dir=specs_dir, rate=rate, sock=sock))
