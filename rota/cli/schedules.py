"""``rota schedules``: the cron schedules with their last run and next fire, one shown whole, and adding (from flags or a TOML file), pausing, resuming and deleting one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import msgspec

from rota.base.errors import Invalid
from rota.base.specs import SpecError, parse_file
from rota.cli.base import URL_OPTION, api, fail, out, print_json, say, servers, token
from rota.client.client import ApiError, Client
from rota.core.listing import did_you_mean
from rota.core.schedules import check

COLUMNS = ("NAME", "EXPRESSION", "ZONE", "STATE", "LAST RUN", "NEXT FIRE")


def last_run(shown: dict[str, Any]) -> str:
    """When it last ticked and how that went: '2026-11-27T02:30:00.000Z completed'."""
    if shown["last_tick"] is None:
        return "never"
    return f"{shown['last_tick']} {shown['last_outcome'] or '-'}"


def state_said(shown: dict[str, Any]) -> str:
    """``active``, ``paused`` or ``waiting (its reason)``."""
    reason = shown["waiting_reason"]
    return shown["state"] + (f" ({reason})" if shown["state"] == "waiting" and reason else "")


def when_next(shown: dict[str, Any]) -> str:
    """Its next fire time, or why it has none: a paused or waiting schedule's would-be
    times will not happen (and an @every counts again from its resume)."""
    if shown["state"] == "paused":
        return "(paused)"
    if shown["state"] == "waiting":
        return f"(waiting: {shown['waiting_reason']})"
    fires = shown["next_fires"]
    return fires[0] if fires else "-"


def row(shown: dict[str, Any]) -> tuple[str, ...]:
    fires = shown["next_fires"]
    return (shown["name"], shown["cron"], shown["timezone"], state_said(shown),
            last_run(shown), fires[0] if fires and shown["state"] == "active" else "-")


def table(rows: list[tuple[str, ...]]) -> list[str]:
    """Aligned columns, the last one left ragged."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip()
            for r in rows]


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True,
              help='Print {"schedules": [...]} as JSON (as GET /schedules).')
@URL_OPTION
@click.pass_context
def schedules(ctx: click.Context, as_json: bool, url: str) -> None:
    """Cron schedules: each with its expression, time zone, state, last run and its
    outcome, and next fire time."""
    if ctx.invoked_subcommand is not None:
        return
    answer = api(url, "schedules")
    if as_json:  # as GET /schedules gives it: {"schedules": [...]}
        print_json(answer)
        return
    listed = answer["schedules"]
    if not listed:
        out("no schedules; add one with `rota schedules add` or a [[schedule]] table in a"
            " spec file (`rota specs push`)", err=True)
        return
    for line in table([COLUMNS, *map(row, listed)]):
        out(line)


@schedules.command("show")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print the schedule as JSON.")
@URL_OPTION
def show(name: str, as_json: bool, url: str) -> None:
    """Show schedule NAME whole, with its next five fire times."""
    shown = api(url, "schedule", name)
    if as_json:
        print_json(shown)
        return
    print_view(shown)


def print_view(shown: dict[str, Any]) -> None:
    """Every field of the definition, its state and record, and its next fire times
    (or why there are none: paused, or waiting and its reason)."""
    spec_s = "(the spec's)"
    lines = [("schedule", shown["name"]), ("description", shown["description"] or "-"),
             ("spec", shown["spec"]), ("args", json.dumps(shown["args"])),
             ("cron", shown["cron"]), ("timezone", shown["timezone"]),
             ("state", state_said(shown)), ("overlap", shown["overlap"]),
             ("misfire", shown["misfire"] + (f" (at most {shown['catch_up']})"
                                             if shown["misfire"] == "catch_up" else "")),
             ("jitter", f"{shown['jitter']:g}s"), ("queue", shown["queue"] or spec_s),
             ("priority", spec_s if shown["priority"] is None else str(shown["priority"])),
             ("max attempts", spec_s if shown["max_attempts"] is None
              else str(shown["max_attempts"])),
             ("created", shown["created_at"] or "-"), ("last run", last_run(shown)),
             ("last job", shown["last_job_id"] or "-"), ("runs", str(shown["run_count"]))]
    for key, value in lines:
        out(f"{key + ':':<14}{value}")
    fires = shown["next_fires"] if shown["state"] == "active" else [when_next(shown)]
    for n, fire in enumerate(fires or ["-"]):
        out(f"{'next fires:' if n == 0 else '':<14}{fire}")


DEFINITION_FLAGS = ("spec", "expression", "timezone", "args_json", "overlap", "misfire",
                    "catch_up", "jitter", "queue", "priority", "max_attempts", "description")


@schedules.command("add")
@click.argument("name", required=False)
@click.option("--file", "source", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A TOML file of [[schedule]] tables: each is added (or only NAME's).")
@click.option("--spec", help="The spec each tick enqueues.")
@click.option("--cron", "expression", help="The expression: 5 fields, 6 with seconds first,"
              " @daily and friends, or '@every 90s' (whole seconds, 1s to a year).")
@click.option("--timezone", default="UTC", show_default=True, help="An IANA time zone.")
@click.option("--args", "args_json", default="{}", help="The jobs' args, as a JSON object.")
@click.option("--overlap", type=click.Choice(["skip", "allow", "cancel_previous", "enqueue"]),
              default="skip", show_default=True, help="When the previous run is still live.")
@click.option("--misfire", type=click.Choice(["skip", "catch_up"]), default="catch_up",
              show_default=True, help="Ticks missed (downtime): fire none, or the latest N.")
@click.option("--catch-up", type=int, default=1, show_default=True,
              help="N: how many missed ticks a catch-up fires.")
@click.option("--jitter", type=float, default=0.0, help="Seconds each run may be delayed.")
@click.option("--queue", help="The jobs' queue (default: the spec's).")
@click.option("--priority", type=int, help="The jobs' priority (default: the spec's).")
@click.option("--max-attempts", type=int, help="The jobs' attempts (default: the spec's).")
@click.option("--description", default="")
@click.option("--paused/--active", default=None, help="Add it paused (or active). With"
              " --replace, left out: a paused schedule stays paused.")
@click.option("--replace", is_flag=True, help="Replace an existing schedule whole: options"
              " not given go back to their defaults.")
@URL_OPTION
@click.pass_context
def add(ctx: click.Context, name: str | None, source: Path | None, spec: str | None,
        expression: str | None, timezone: str, args_json: str, overlap: str, misfire: str,
        catch_up: int, jitter: float, queue: str | None, priority: int | None,
        max_attempts: int | None, description: str, paused: bool | None, replace: bool,
        url: str) -> None:
    """Add schedule NAME, from flags or from a TOML file (--file); an existing one only
    with --replace."""
    if source is not None:
        given = [f"--{p.replace('_json', '').replace('expression', 'cron').replace('_', '-')}"
                 for p in DEFINITION_FLAGS
                 if ctx.get_parameter_source(p) is not click.core.ParameterSource.DEFAULT]
        if given:
            fail(f"--file gives the whole definition: leave out {', '.join(given)}"
                 " (or leave out --file)")
        tables = _from_file(source, name)
    else:
        if name is None or spec is None or expression is None:
            fail("give NAME, --spec and --cron (or --file FILE.toml)")
        try:
            args = json.loads(args_json)
        except ValueError as exc:
            fail(f"--args is not JSON: {exc}")
        flags = {"name": name, "spec": spec, "cron": expression, "timezone": timezone,
                 "args": args, "overlap": overlap, "misfire": misfire, "catch_up": catch_up,
                 "jitter": jitter, "queue": queue, "priority": priority,
                 "max_attempts": max_attempts, "description": description}
        tables = [{k: v for k, v in flags.items() if v is not None}]
    for table in tables:
        if paused is not None:
            table["paused"] = paused
        try:
            definition = check(table, where=str(source) if source else "")
        except Invalid as exc:
            fail(f"{exc.message} ({exc.code})")
        _put(url, table, msgspec.to_builtins(definition), replace)


def _put(url: str, table: dict[str, Any], whole: dict[str, Any], replace: bool) -> None:
    """PUT one schedule; an existing one only with ``replace`` (or when ``whole``, its
    definition with the defaults, is the same), and then a paused one stays paused
    unless the definition says otherwise."""
    name = table["name"]
    try:
        with Client(servers(url), token=token()) as client:
            existing = client.schedule(name)
    except ApiError as exc:
        if exc.code != "no_such_schedule":
            fail(say(url, exc))
        existing = None
    same = existing is not None and all(
        existing.get(key) == value for key, value in whole.items() if key != "paused")
    if existing is not None and not replace and not same:
        fail(f"schedule {name} exists: give --replace to replace it whole (options not given"
             " go back to their defaults), or use pause/resume/delete")
    if existing is not None and "paused" not in table:
        table["paused"] = existing["paused"]
    reply = api(url, "put_schedule", name, table)
    shown = reply["schedule"]
    out(f"{reply['change']:<9} {shown['name']}  {shown['cron']} ({shown['timezone']})"
        f"  state={shown['state']}  next={when_next(shown)}")
    if shown["state"] != "active":  # accepted (declared before its spec is pushed), but said
        warning = spec_warning(shown["spec"], api(url, "specs")["specs"])
        if warning is not None:
            out(f"warning: {warning}", err=True)


def spec_warning(spec: str, listed: list[dict[str, Any]]) -> str | None:
    """Why a schedule of ``spec`` will wait for it (None: it will not): no status quo
    (with the likely slip, as the intake says it), or retired. ``listed``: GET /specs."""
    retired = {s["name"] for s in listed if s.get("retired_at")}
    if spec in retired:
        return f"spec {spec!r} was retired: the schedule waits until it is pushed again"
    if any(s["name"] == spec for s in listed):
        return None
    guess = did_you_mean(spec, [s["name"] for s in listed])
    return (f"spec {spec!r} has no status quo yet: the schedule waits until it is pushed"
            + (f" (did you mean {guess}?)" if guess else ""))


def _from_file(source: Path, name: str | None) -> list[dict[str, Any]]:
    try:
        _, tables = parse_file(source.read_text(encoding="utf-8"), source=str(source))
    except (SpecError, OSError, UnicodeDecodeError) as exc:
        fail(str(exc))
    if name is not None:
        tables = [t for t in tables if t.get("name") == name]
    if not tables:
        fail(f"{source}: no [[schedule]] table" + (f" named {name!r}" if name else ""))
    return tables


def _command(verb: str, doc: str) -> None:
    """``rota schedules pause|resume|delete NAME``: one request, one line said."""

    @schedules.command(verb, help=doc)
    @click.argument("name")
    @URL_OPTION
    def command(name: str, url: str) -> None:
        if verb == "delete":
            api(url, "delete_schedule", name)
            out(f"{name} is deleted (its jobs stay)")
            return
        shown = api(url, "pause_schedule", name, paused=verb == "pause")
        out(f"{name} is paused" if verb == "pause"
            else f"{name} is {shown['state']}; next fire {when_next(shown)}")


for _verb, _doc in (
        ("pause", "Pause schedule NAME: its ticks make no jobs until it is resumed."),
        ("resume", "Resume schedule NAME; the ticks of its pause are not caught up."),
        ("delete", "Delete schedule NAME (its jobs stay).")):
    _command(_verb, _doc)
