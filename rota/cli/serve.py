"""``rota serve``: its options made from ``ServerSettings``' fields (rota/core/settings.py),
so that a default, a help text and a ``ROTA_*`` variable live in one place; the
start-up checks are the server's (rota/server/startup.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from rota.base.egress import url_problem
from rota.cli import logsetup
from rota.cli.base import DATABASE
from rota.cli.base import fail as _fail
from rota.cli.logsetup import LEVELS
from rota.cli.logsetup import LOG_FORMAT as _LOG_FORMAT
from rota.core.retention import format_duration, parse_duration, parse_rule
from rota.core.settings import Option, ServerSettings


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


class _PublicUrl(click.ParamType):
    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> str | None:
        if value is None:
            return None
        problem = url_problem(str(value))
        if problem is None and ("?" in str(value)):
            problem = "may not have a ?query (the callback paths are added to it)"
        if problem is not None:
            self.fail(f"{value!r} {problem}", param, ctx)
        return str(value).rstrip("/")


def _flat_rules(ctx: click.Context, param: click.Parameter,
                rules: tuple[tuple[str, dict[str, float | None]], ...]
                ) -> tuple[tuple[str, str, float | None], ...]:
    """--retain's rules as ServerSettings.retain_queues holds them: (queue, state, seconds)."""
    return tuple((queue, state, seconds) for queue, durations in rules
                 for state, seconds in durations.items())


# The conversions an Option's ``kind`` names, and for some the default as an operator
# would write it ("7d"), which --help shows and the conversion turns back into the field's.
KINDS: dict[str, click.ParamType] = {
    "database": DATABASE, "duration": _Duration(), "retain": _RetainRule(),
    "file": click.Path(exists=True, dir_okay=False), "url": _PublicUrl()}
WRITTEN: dict[str, Callable[[Any], str]] = {"database": str, "duration": format_duration}
CALLBACKS: dict[str, Callable[..., Any]] = {"retain": _flat_rules}
HINTS = typing.get_type_hints(ServerSettings)


def settings_options() -> list[tuple[dataclasses.Field[Any], Option]]:
    """Every ServerSettings field that is an option, with its Option, in field order."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(ServerSettings)
            if "option" in f.metadata]


def _type(field: dataclasses.Field[Any], how: Option) -> click.ParamType | None:
    """What the option's text converts to: the kind's conversion, a choice, or the
    field's own number type (bounded by ``minimum``)."""
    if how.kind is not None:
        return KINDS[how.kind]
    if how.choices:
        return click.Choice(how.choices)
    hint = HINTS[field.name]  # int, int | None, tuple[str, ...], bool
    base = next((t for t in (int, float, str) if t in (typing.get_args(hint) or (hint,))),
                None)
    if how.minimum is not None and base is int:
        return click.IntRange(min=int(how.minimum))
    if how.minimum is not None and base is float:
        return click.FloatRange(min=how.minimum)
    return None if base is None else click.types.convert_type(base)


def settings_option(field: dataclasses.Field[Any], how: Option) -> Callable[..., Any]:
    """The click option of one settings field."""
    name = how.name or "--" + field.name.replace("_", "-")
    env = how.env or "ROTA_" + name.removeprefix("--").replace("-", "_").upper()
    default = WRITTEN.get(how.kind or "", _same)(field.default)
    return click.option(
        name, field.name, envvar=env, show_envvar=True, default=default,
        show_default=_shown(field.default) and not how.hidden,
        is_flag=HINTS[field.name] is bool, multiple=how.multiple, type=_type(field, how),
        callback=CALLBACKS.get(how.kind or ""), hidden=how.hidden, help=how.help)


def _shown(default: Any) -> bool:
    """Whether --help has a default to show: not for none, no values, or a flag off."""
    return default is not None and default != () and default is not False


def _same(value: Any) -> Any:
    return value


def _settings_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for field, how in reversed(settings_options()):
        command = settings_option(field, how)(command)
    return command


@click.command()
@_settings_options
@click.option("--log-level", envvar="ROTA_LOG_LEVEL", default="info", show_default=True,
              show_envvar=True, type=LEVELS,
              help="The least severe lines the server logs (trace: debug, and the libraries'"
              " own debug lines too, such as uvicorn's per connection).")
@_LOG_FORMAT
@click.option("--insecure", is_flag=True, envvar="ROTA_INSECURE", show_envvar=True,
              help="Allow a non-loopback --host with no tokens (anyone may take jobs).")
def serve(db: Path | str, log_level: str, log_format: str, insecure: bool,
          **options: Any) -> None:
    """Run the Rota server: /work for workers, the HTTP API for everyone else, and the
    dashboard at /ui.

    With no token created ('rota tokens create') it runs open, and then only on a loopback
    address unless --insecure is given. The limits are in docs/operations.md.
    """
    from rota.server import startup
    from rota.server.app import serve as run_server

    logsetup.configure(log_level, log_format)
    where = {"db": db} if isinstance(db, Path) else {"database_url": db}
    settings = ServerSettings(**where, **options)
    try:  # (the lock and the socket are held until the command ends)
        sock = click.get_current_context().with_resource(
            startup.started(settings, insecure=insecure))
    except startup.Refused as exc:
        _fail(exc.message)
    sys.setswitchinterval(startup.SWITCH_INTERVAL)  # (why: rota/server/startup.py)
    with asyncio.Runner(loop_factory=startup.loop_factory()) as runner:
        runner.run(run_server(settings, log_level=log_level, sock=sock))
