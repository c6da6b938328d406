"""What every ``rota`` command that talks to a server shares: ``--url`` and ``--token``
(ROTA_URL, ROTA_TOKEN), an API call whose refusal is one line on stderr and exit 1, and
JSON on stdout, and ``--db`` (a file or a PostgreSQL URL). Every module of rota/cli/
builds on it.

And the one way ``rota`` prints: ``out`` (a line), ``out_lines`` (a text of several),
``screen`` (``rota watch``'s frame), ``fail`` and ``error`` (a line on stderr) and
``print_json``. What a server returns is partly workers' own text (a hostname, an error's
message and traceback, a result): a newline in it could forge a line of output, an escape
sequence retitle the terminal (OSC 0) or write its clipboard (OSC 52), a bidirectional
override reverse what follows. Each of these writes every character that is not printable
as its Python escape (``\x1b``, ``\u202e``), and JSON escapes them itself.
tests/system/test_cli_print.py checks that nothing in the CLI prints another way."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from rota.client.client import ApiError, Client
from rota.client.failures import URL_HINT
from rota.base.logs import printable

UNCUT = sys.maxsize  # the CLI escapes text but never cuts it (the log does)

_URL = click.option(
    "--url", envvar="ROTA_URL", show_envvar=True, default="http://127.0.0.1:8000",
    show_default=True, help="Base URL of the Rota server (or of several that share one"
    " database, separated by commas: the next is asked when one cannot be reached).",
)


def servers(url: str) -> list[str]:
    """--url or ROTA_URL as the servers it names: one, or several separated by commas.
    A deploy sets ROTA_URL once for `rota worker` (which goes round them) and for the
    commands beside it, which must not take the list for one malformed URL."""
    return [part.strip() for part in url.split(",") if part.strip()] or [url]


def _keep_token(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:
        refused = token_refusal(value)
        if refused:
            fail(refused)
        ctx.meta["rota.token"] = value


def token_refusal(value: str) -> str | None:
    """Why ``value`` cannot be sent as a bearer token (None: it can). A header holds one
    line of printable ASCII; every token does (``rota_<id>_<secret>``), so anything else
    is a slip of how it was read (a file's line ending, a paste), said before sending
    rather than as the HTTP library's traceback."""
    bad = next((c for c in value if not " " < c < "\x7f"), None)
    if bad is None:
        return None
    where = "the token given (--token or ROTA_TOKEN)"
    if bad in "\r\n":
        return (f"{where} holds a newline: a token is one line, as 'rota tokens create'"
                " printed it (was it read from a file with its line ending?)")
    return (f"{where} holds {bad!r}, which no token has: give it as 'rota tokens create'"
            " printed it")


TOKEN_OPTION = click.option(
    "--token", envvar="ROTA_TOKEN", show_envvar=True, expose_value=False, callback=_keep_token,
    help="Bearer token for the server (printed once by 'rota tokens create').",
)


def URL_OPTION(command: Callable[..., Any]) -> Callable[..., Any]:  # noqa: N802
    """--url and --token, for every command that talks to a server."""
    return _URL(TOKEN_OPTION(command))


def token() -> str | None:
    found: str | None = click.get_current_context().meta.get("rota.token")
    return found


def out(line: str = "", *, err: bool = False) -> None:
    """Print one line: a newline or any other control character in it is escaped."""
    click.echo(printable(line, UNCUT), err=err)


def out_lines(text: str, *, indent: str = "", err: bool = False) -> None:
    """Print a text of several lines (a traceback, a help page), each as ``out`` does,
    after ``indent``: a worker's text indented cannot pass for a line of rota's own."""
    for line in text.rstrip("\n").split("\n"):
        out(indent + line, err=err)


def screen(lines: list[str], *, clear: bool) -> None:
    """One frame of ``rota watch``: on a terminal (``clear``), home and clear first."""
    click.echo(("\x1b[H\x1b[J" if clear else "")  # the one escape sequence rota writes
               + "\n".join(printable(line, UNCUT) for line in lines) + ("" if clear else "\n"))


def error(message: str) -> None:
    """The one line on stderr of a command that fails (red on a terminal)."""
    click.secho(f"error: {printable(message, UNCUT)}", fg="red", err=True)


def fail(message: str) -> NoReturn:
    error(message)
    sys.exit(1)


def api(url: str, action: str, *args: Any, **kwargs: Any) -> Any:
    """``Client(url).action(*args, **kwargs)``, or the refusal in one line and exit 1."""
    try:
        with Client(servers(url), token=token()) as client:
            return getattr(client, action)(*args, **kwargs)
    except ApiError as exc:
        fail(say(url, exc))


def say(url: str, exc: ApiError) -> str:
    """An API error as one line a person can act on from the command line."""
    base = "--url is the server's base URL, such as http://127.0.0.1:8000 (not /work)"
    if exc.code == "unauthorized" and token():
        return ("the server refused the token given (--token or ROTA_TOKEN): it may have"
                " been revoked, be mistyped, or have been made by a server on another database"
                " ('rota tokens list' shows the live ones)")
    if exc.code == "unauthorized":
        return ("the server wants a token: set ROTA_TOKEN or pass --token (one from 'rota"
                " tokens create', of a scope that may do this)")
    if exc.code == "forbidden":  # the server's words name the scopes the route takes
        return f"{exc.message}: pass one with --token or ROTA_TOKEN (forbidden)"
    if exc.code == "unreachable":
        return exc.message.replace(URL_HINT, "(set --url or ROTA_URL)")
    if exc.code == "not_the_api":  # its advice, for --url: the base URL itself if it knows it
        head, _, advice = exc.message.partition(": use ")
        return f"{head}: " + (base if "such as" in advice else f"--url is {advice}")
    if exc.code == "bad_url":
        return f"{url!r} is not a server URL: {base}"
    if exc.code == "not_found" and exc.message.startswith("no route "):
        return f"{url} answers 404 for this command's route: {base}"
    return f"{exc.message} ({exc.code})"


def print_json(data: Any, *, compact: bool = False) -> None:
    """``data`` as JSON: indented, or ``compact`` on one line (NDJSON). json.dumps escapes
    every control character and everything past ASCII; DEL, the one it leaves, too."""
    text = (json.dumps(data, separators=(",", ":")) if compact
            else json.dumps(data, indent=2, sort_keys=False))
    click.echo(text.replace("\x7f", "\\u007f"))


def print_job(data: dict[str, Any]) -> None:
    """A job (or a result) as JSON on stdout, for scripts, with each error's traceback
    taken out and written to stderr as it was raised: lines, not one string of \\n,
    under a line naming its attempt and indented by 4 (the worker's text, which may hold
    a line that looks like that one)."""
    errors = [e for e in [*data.get("errors", []), data.get("error")] if isinstance(e, dict)]
    tracebacks = []
    for failure in errors:
        details = failure.get("details")
        if isinstance(details, dict) and isinstance(details.get("traceback"), str):
            tracebacks.append((failure, details["traceback"]))
            details["traceback"] = "(on stderr)"
    print_json(data)
    for failure, text in tracebacks:  # the worker's own lines, each escaped
        out(f"--- attempt {failure.get('attempt', '?')} on {failure.get('worker_id') or '?'}:"
            f" {failure.get('type')}: {failure.get('message')}", err=True)
        out_lines(text, indent="    ", err=True)


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

# The packages only the server's code needs (rota serve, rota demo, rota tokens on the
# database file): a worker's or producer's install ('pip install rota') leaves them out.
SERVER_PACKAGES = frozenset({"starlette", "uvicorn", "sqlite_utils", "psycopg", "httptools",
                             "prometheus_client"})


def need_server(command: str) -> None:
    """One line saying what to install, rather than an ImportError's traceback."""
    try:
        import rota.server.app  # noqa: F401
        import rota.store.store  # noqa: F401
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in SERVER_PACKAGES:
            raise  # not a missing server package: a real bug, shown whole
        fail(f"'rota {command}' needs the server's packages ({exc.name} is not installed):"
             " pip install 'rota[server]'")
