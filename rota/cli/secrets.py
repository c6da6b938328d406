"""``rota secrets``: the endpoint signing secrets a spec's ``[execute]`` table names: set or rotate one (``--value -`` reads it from stdin; ``--generate`` has the server make one), list them (never a value), delete one. Over the server's API, with an admin token."""

from __future__ import annotations

import sys
from typing import Any

import click

from rota.cli.base import URL_OPTION, api, fail, out, print_json
from rota.core.retention import format_duration, parse_duration
from rota.core.secrets import DEFAULT_WINDOW, env_name, name_problem, value_problem

JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")


def _name(name: str) -> str:
    if (problem := name_problem(name)) is not None:
        fail(problem)
    return name


def _value(given: str) -> str:
    """--value's text, or stdin's for "-" (one line ending taken off)."""
    if given != "-":
        return given
    try:
        text = sys.stdin.buffer.read(64 * 1024).decode()
    except UnicodeDecodeError:
        fail("the secret read from stdin is not UTF-8 text")
    return text.removesuffix("\n").removesuffix("\r")


def _window(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        fail(f"--previous-for: {exc}")
    if seconds is None:
        fail("--previous-for: a previous value is valid for 30d at most, not never")
    return seconds


def _source(view: dict[str, Any]) -> str:
    if view["source"] == "env":
        return f"environment ({view['env']})"
    if view["source"] == "db":
        return "database"
    return f"MISSING (set it with 'rota secrets set {view['name']}' or {view['env']})"


@click.group()
def secrets() -> None:
    """Signing secrets of push execution: a spec's [execute] secret names one, whose value
    comes from the server's environment (ROTA_SECRET_<NAME>: upper-cased, every character
    but letters and digits as '_') or else its database (set here). The environment's
    wins."""


@secrets.command("set")
@click.argument("name")
@click.option("--value", help="The secret (16 to 4096 bytes of printable text); '-' reads"
              " it from stdin, which keeps it out of the shell's history.")
@click.option("--generate", is_flag=True, help="Have the server generate one, printed this"
              " once.")
@click.option("--previous-for", "previous_for", metavar="DURATION",
              help="How long the value this one replaces stays valid (deliveries are signed"
              f" with both meanwhile): 1h, 2d, 0 (default {format_duration(DEFAULT_WINDOW)}).")
@JSON_OPTION
@URL_OPTION
def secrets_set(name: str, value: str | None, generate: bool, previous_for: str | None,
                as_json: bool, url: str) -> None:
    """Set secret NAME, or rotate it: the value it replaces stays valid for a while, so
    that receivers can switch over."""
    _name(name)
    if (value is None) == (not generate):
        fail("give --value VALUE (or --value - to read it from stdin), or --generate")
    if value is not None:
        value = _value(value)
        if (problem := value_problem(value)) is not None:
            fail(problem)
    reply = api(url, "set_secret", name, value, window=_window(previous_for))
    if as_json:
        print_json(reply)
        return
    view = reply["secret"]
    if reply.get("value") is not None:
        out(reply["value"])
        out(f"secret {name} generated; copy it now, it is not shown again", err=True)
    else:
        until = view["previous_valid_until"]
        out(f"secret {name} {reply['change']}"
            + (f" (the previous value stays valid until {until})" if until else ""))
    if view["source"] == "env":
        out(f"note: this server signs with {view['env']} from its environment, which"
            " overrides the database's", err=True)


@secrets.command("list")
@JSON_OPTION
@URL_OPTION
def secrets_list(as_json: bool, url: str) -> None:
    """The secrets in the database or named by a spec: where each comes from, when it was
    set or rotated, the specs that use it (never a value)."""
    reply = api(url, "secrets")
    if as_json:
        print_json(reply)
        return
    if not reply["secrets"]:
        out("no secrets: set one with 'rota secrets set NAME --generate' or a server's"
            " ROTA_SECRET_<NAME>", err=True)
    for view in reply["secrets"]:
        line = f"{view['name']}  {_source(view)}"
        if view["updated_at"]:
            line += f"  updated={view['updated_at']}"
        if view["previous_valid_until"]:
            line += f"  previous valid until {view['previous_valid_until']}"
        if view.get("specs"):
            line += f"  specs={','.join(view['specs'])}"
        out(line)


@secrets.command("delete")
@click.argument("name")
@JSON_OPTION
@URL_OPTION
def secrets_delete(name: str, as_json: bool, url: str) -> None:
    """Delete secret NAME from the database (a server's ROTA_SECRET_<NAME> stays)."""
    reply = api(url, "delete_secret", _name(name))
    if as_json:
        print_json(reply)
        return
    out(f"deleted secret {name}")
    deleted = reply["deleted"]
    if deleted["source"] == "env":
        out(f"note: this server still signs with {env_name(name)} from its environment",
            err=True)
    elif deleted.get("specs"):
        out(f"warning: spec(s) {', '.join(deleted['specs'])} name it: their deliveries cannot"
            f" be signed until it is set again ('rota secrets set {name}')", err=True)
