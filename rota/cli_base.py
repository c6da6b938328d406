"""What every ``rota`` command that talks to a server shares: ``--url`` and ``--token``
(ROTA_URL, ROTA_TOKEN), an API call whose refusal is one line on stderr and exit 1, and
JSON on stdout. ``rota.cli``, ``rota.cli_ops`` and ``rota.cli_live`` build on it."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click

from rota.client import ApiError, Client

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
        ctx.meta["rota.token"] = value


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


def fail(message: str) -> NoReturn:
    click.secho(f"error: {message}", fg="red", err=True)
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
    if exc.code == "unauthorized":
        return ("the server wants a token: set ROTA_TOKEN or pass --token (one from 'rota"
                " tokens create', of a scope that may do this)")
    if exc.code == "bad_url":
        return f"{url!r} is not a server URL: {base}"
    if exc.code == "not_found" and exc.message.startswith("no route "):
        return f"{url} answers 404 for this command's route: {base}"
    return f"{exc.message} ({exc.code})"


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))
