"""``rota limits``: the flow-control limits in force, and setting or clearing one at runtime (``rota limits set spec:send_email --concurrency 40``, ``rota limits clear spec:send_email``)."""

from __future__ import annotations

from typing import Any

import click

from rota.base.flow import rate_parts
from rota.cli.base import URL_OPTION, api, fail, out, print_json
from rota.core.display import limit_source

SCOPE_HELP = "queue:NAME or spec:NAME, as in spec:send_email"
PER = {1.0: "s", 60.0: "min", 3600.0: "h", 86400.0: "d"}  # a rate's period, as written


def _scope(text: str) -> tuple[str, str]:
    kind, _, name = text.partition(":")
    if kind not in ("queue", "spec") or not name:
        fail(f"{text!r} names no limit: give {SCOPE_HELP}")
    return kind, name


def _with_burst(field: str, rate: str | None, burst: int | None) -> dict[str, Any]:
    """A shorthand rate and a burst as the table the API takes."""
    flag = "--" + field.replace("_", "-")
    if rate is None:
        fail(f"{flag.replace('rate', 'burst')} needs {flag}")
    try:
        limit, period = rate_parts(rate)
    except ValueError as exc:
        fail(f"{flag} {exc}")
    return {"limit": limit, "period": period, "burst": burst}  # (burst None: as the rate)


def rule_words(rule: dict[str, Any]) -> str:
    """A rule as one line: ``concurrency=40 rate=5/1s key_concurrency=3``."""
    words = []
    for field in ("concurrency", "rate", "key_concurrency", "key_rate"):
        value = rule.get(field)
        if isinstance(value, dict):
            burst = f" burst={value['burst']}" if value.get("burst") else ""
            period = PER.get(value["period"], f"{value['period']:g}s")
            value = f"{value['limit']}/{period}{burst}"
        if value is not None:
            words.append(f"{field}={value}")
    return " ".join(words)


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the limits as JSON.")
@URL_OPTION
@click.pass_context
def limits(ctx: click.Context, as_json: bool, url: str) -> None:
    """Every limit in force and where it comes from (a spec file's [limits], or
    'rota limits set', which overrides it until 'rota limits clear')."""
    if ctx.invoked_subcommand is not None:
        return
    reply = api(url, "limits")
    if as_json:
        print_json(reply)
        return
    if not reply["limits"]:
        out("no limits: set one in a spec file's [limits] or with 'rota limits set'")
    for entry in reply["limits"]:
        out(f"{entry['limit']:<24} {rule_words(entry['rule'])}  ({limit_source(entry)})")


@limits.command("set")
@click.argument("scope")
@click.option("--concurrency", type=int, help="Jobs of the scope reserved at once, fleet-wide.")
@click.option("--rate", help="Starts of the scope per period: 100/min, 5/s, 1000/h, 10/30s"
              " (units: s, sec, second, m, min, minute, h, hour, d, day).")
@click.option("--key-concurrency", type=int, help="Jobs of one concurrency key at once.")
@click.option("--key-rate", help="Starts of one concurrency key per period, as --rate.")
@click.option("--burst", type=int, help="Starts of --rate that may come back to back (then"
              " spaced evenly); at most its limit.")
@click.option("--key-burst", type=int, help="The same for --key-rate.")
@click.option("--replace", is_flag=True, help="Replace SCOPE's whole runtime rule with the"
              " fields given (without it, the fields not given are kept).")
@URL_OPTION
def limits_set(scope: str, url: str, burst: int | None, key_burst: int | None,
               replace: bool, **rule: Any) -> None:
    """Set SCOPE's limits at runtime (queue:NAME or spec:NAME). Only the fields given
    change: the others set at runtime before are kept (--replace drops them). The
    runtime rule replaces its spec file's [limits], all of it, until 'rota limits
    clear SCOPE'. Prints the rule in force."""
    kind, name = _scope(scope)
    body = {field: value for field, value in rule.items() if value is not None}
    for field, given in (("rate", burst), ("key_rate", key_burst)):
        if field in body or given is not None:  # checked here, to name the flag at fault
            body[field] = _with_burst(field, body.get(field), given)
    if not body:
        fail("give --concurrency, --rate, --key-concurrency or --key-rate")
    before = _in_force(url, f"{kind}:{name}")
    kept = {} if replace or before is None or before["source"] != "runtime" else {
        field: value for field, value in before["rule"].items() if field not in body}
    entry = api(url, "set_limit", kind, name, {**kept, **body})
    out(f"{entry['limit']}: {rule_words(entry['rule'])} (until 'rota limits clear"
        f" {entry['limit']}')")
    if kept:
        out(f"  kept as set before: {', '.join(kept)} (--replace drops what is not given)")
    lost = {} if before is None or before["source"] != "spec_file" else {
        field: value for field, value in before["rule"].items() if field not in body}
    if lost:  # a runtime rule replaces the spec file's whole [limits]
        out(f"  its spec file's {rule_words(lost)} no longer applies until then (give it"
            " here to keep it)")


def _in_force(url: str, limit: str) -> dict[str, Any] | None:
    """The entry of GET /limits for ``limit`` (its rule and source), None if none."""
    return next((e for e in api(url, "limits")["limits"] if e["limit"] == limit), None)


@limits.command("clear")
@click.argument("scope")
@URL_OPTION
def limits_clear(scope: str, url: str) -> None:
    """Clear SCOPE's limits set at runtime: its spec file's, if any, apply again. A
    spec file's [limits] is not cleared here: it holds until a new version of the spec
    is pushed ('rota limits set' overrides it meanwhile)."""
    kind, name = _scope(scope)
    reply = api(url, "clear_limit", kind, name)
    now = reply.get("now")
    out(f"{reply['limit']}: cleared; " + (f"its spec file's apply: {rule_words(now['rule'])}"
                                          if now else "no limit applies"))
