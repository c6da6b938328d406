"""``rota webhooks``: subscriptions to the server's events (add, list, show, delete), a
subscription's delivery log, a test delivery and a secret's rotation."""

from __future__ import annotations

from typing import Any

import click

from rota.cli.base import URL_OPTION, api, fail, out, print_json

JSON_HELP = "Print the answer as JSON (as the API gives it)."


def _filter(spec: str | None, queue: str | None, worker: str | None) -> dict[str, str]:
    return {k: v for k, v in (("spec", spec), ("queue", queue), ("worker", worker)) if v}


def _said_filter(shown: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in shown["filter"].items()) or "-"


def _print(shown: dict[str, Any]) -> None:
    for key, value in (("webhook", shown["id"]), ("url", shown["url"]),
                       ("kinds", ",".join(shown["kinds"])), ("filter", _said_filter(shown)),
                       ("enabled", "yes" if shown["enabled"] else "no"),
                       ("created", shown["created_at"]),
                       ("rotated", shown["rotated_at"] or "-")):
        out(f"{key + ':':<10}{value}")
    if "secret" in shown:
        out(f"{'secret:':<10}{shown['secret']}")
        out("(the secret is shown this once: the receiver verifies X-Rota-Signature with it)",
            err=True)


def _answer(shown: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(shown)
    else:
        _print(shown)


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@URL_OPTION
@click.pass_context
def webhooks(ctx: click.Context, as_json: bool, url: str) -> None:
    """Webhook subscriptions: each sends the server's events of its kinds, signed, to a
    URL (docs/webhooks.md)."""
    if ctx.invoked_subcommand is not None:
        return
    answer = api(url, "webhooks")
    if as_json:
        print_json(answer)
        return
    if not answer["webhooks"]:
        out("no webhooks; add one with `rota webhooks add URL --kind KIND`", err=True)
        return
    for shown in answer["webhooks"]:
        out(f"{shown['id']}  {'enabled ' if shown['enabled'] else 'disabled'}  "
            f"{','.join(shown['kinds'])}  {_said_filter(shown)}  {shown['url']}")


@webhooks.command("add")
@click.argument("receiver")
@click.option("--kind", "kinds", multiple=True, help="An event kind to send (repeat; * for"
              " all): enqueue, assign, result, retry, discard, cancel, worker_connect,"
              " worker_disconnect, worker_state, state_change, alert, cron_fire, ...")
@click.option("--spec", help="Only the events of this spec.")
@click.option("--queue", help="Only the events of this queue.")
@click.option("--worker", help="Only the events of this worker.")
@click.option("--disabled", is_flag=True, help="Add it disabled (nothing is sent).")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@URL_OPTION
def add(receiver: str, kinds: tuple[str, ...], spec: str | None, queue: str | None,
        worker: str | None, disabled: bool, as_json: bool, url: str) -> None:
    """Subscribe RECEIVER (an http(s) URL) to events; prints the signing secret once."""
    if not kinds:
        fail("name the events to send with --kind (repeat it; --kind '*' for all)")
    _answer(api(url, "add_webhook", receiver, list(kinds), _filter(spec, queue, worker),
                enabled=not disabled), as_json)


@webhooks.command("show")
@click.argument("webhook_id")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@URL_OPTION
def show(webhook_id: str, as_json: bool, url: str) -> None:
    """Show subscription WEBHOOK_ID (never its secret)."""
    _answer(api(url, "webhook", webhook_id), as_json)


@webhooks.command("deliveries")
@click.argument("webhook_id")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--state", type=click.Choice(["pending", "delivered", "dead"]))
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@URL_OPTION
def deliveries(webhook_id: str, limit: int, state: str | None, as_json: bool,
               url: str) -> None:
    """The latest deliveries of WEBHOOK_ID, newest first: state, attempts, last answer."""
    answer = api(url, "webhook_deliveries", webhook_id, limit=limit, state=state)
    if as_json:
        print_json(answer)
        return
    if not answer["deliveries"]:
        out("no deliveries yet", err=True)
        return
    for d in answer["deliveries"]:
        said = d["error"] or (f"HTTP {d['status']}" if d["status"] else "")
        out(f"{d['created_at']}  {d['id']}  {d['kind']:<17} {d['state']:<9}"
            f" attempts={d['attempts']}  {said}".rstrip())


@webhooks.command("test")
@click.argument("webhook_id")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@URL_OPTION
def test(webhook_id: str, as_json: bool, url: str) -> None:
    """Send a test delivery (kind "test") to WEBHOOK_ID now; exit 1 unless it got a 2xx."""
    answer = api(url, "test_webhook", webhook_id)
    if as_json:
        print_json(answer)
    elif answer["ok"]:
        out(f"delivered: HTTP {answer['status']} in {answer['ms']:g} ms"
            f" (delivery {answer['delivery_id']})")
    if not answer["ok"]:
        fail(f"test delivery failed: {answer['error']}")


@webhooks.command("rotate-secret")
@click.argument("webhook_id")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@URL_OPTION
def rotate_secret(webhook_id: str, as_json: bool, url: str) -> None:
    """A new signing secret for WEBHOOK_ID, printed once; the old one signs too for 24 h."""
    _answer(api(url, "rotate_webhook_secret", webhook_id), as_json)


@webhooks.command("delete")
@click.argument("webhook_id")
@URL_OPTION
def delete(webhook_id: str, url: str) -> None:
    """Delete WEBHOOK_ID and its deliveries (the pending ones are not sent)."""
    api(url, "delete_webhook", webhook_id)
    out(f"deleted webhook {webhook_id}")
