"""``rota enqueue`` and ``rota run`` (a job of a spec, and its result), and ``rota jobs
show``; the ``jobs`` group's other commands (``list``, ``retry``, ``cancel``) are
rota/cli/ops.py's."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from rota.cli import ops
from rota.cli.base import URL_OPTION
from rota.cli.base import api as _api
from rota.cli.base import fail as _fail
from rota.cli.base import out as _out
from rota.cli.base import print_job as _print_job
from rota.cli.base import print_json as _print_json


def job_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The enqueue options shared by ``enqueue`` and ``run``."""
    options = [
        click.argument("spec"),
        click.option("--args", "args_json", default="{}", show_default=True,
                     help="Job arguments as a JSON object."),
        click.option("--id", "job_id", help="Job id; enqueuing the same id again returns the existing job."),
        click.option("--queue", help="Queue (default: the spec's)."),
        click.option("--new-queue", is_flag=True, default=None,
                     help="--queue is a new queue, even if spelt like a known one."),
        click.option("--priority", type=int, help="Priority, higher first (default: the spec's)."),
        click.option("--delay", type=float, help="Run no sooner than this many seconds from now."),
        click.option("--run-at", help="Run no sooner than this RFC 3339 time."),
        click.option("--ttl", type=float, help="Discard the job if not completed within this many seconds."),
        click.option("--visibility-timeout", type=float, help="Seconds a worker may hold it without a heartbeat."),
        click.option("--max-attempts", type=int, help="Attempts allowed, timeouts included (default: the spec's)."),
        click.option("--max-fails", type=int, help="Explicit failures allowed (default: the spec's)."),
        click.option("--capture-logs", is_flag=True, default=None,
                     help="Keep the lines the handler logs with ctx.log() (see 'rota jobs show')."),
        click.option("--unique-key", help="Unique key: while a job of this spec holds it"
                     " (waiting or running), enqueuing it again gets that job."),
        click.option("--unique-on", type=click.Choice(["existing", "reject", "replace"]),
                     help="With --unique-key, when the key is held: get the job holding it"
                     " (default), refuse, or replace it if it waits."),
        click.option("--concurrency-key",
                     help="The key per-key limits count the job under (a tenant, a user id)."),
        click.option("--label", "labels", multiple=True,
                     help="A worker label the job requires (repeat for several)."),
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
    key, on = options.pop("unique_key"), options.pop("unique_on")
    if on is not None and key is None:
        _fail("--unique-on needs --unique-key: the key that makes two jobs the same")
    if key is not None:
        options["unique"] = {"key": key, **({"on_conflict": on} if on else {})}
    options["labels"] = list(options.get("labels") or ()) or None
    return _api(url, "enqueue", spec, args, id=job_id, **options)


@click.command()
@job_options
def enqueue(url: str, spec: str, args_json: str, job_id: str | None, **options: Any) -> None:
    """Enqueue a job of SPEC and print it."""
    unique = options["unique_key"] is not None
    reply = _enqueue(url, spec, args_json, job_id, **options)
    if not reply["created"]:
        held = "unique key" if job_id is None else "id or unique key" if unique else "id"
        _out(f"a job with this {held} exists already:", err=True)
    _print_json(reply["job"])


@click.command()
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
        _out(f"job {job['id']} has not finished after {wait:g}s{_why(url, job['id'])}",
             err=True)
        sys.exit(2)
    sys.exit(0 if reply["state"] == "completed" else 1)


def _why(url: str, job_id: str) -> str:
    """What holds an unfinished job up: its last failed attempt, or why it waits (a job
    retried, for an endpoint refused, says its error here, not only in 'rota jobs show')."""
    view = _api(url, "job", job_id)
    if view.get("errors"):
        last = view["errors"][-1]
        return (f"; attempt {last.get('attempt')} failed: {last.get('type')}:"
                f" {last.get('message')} (see 'rota jobs show {job_id}')")
    if view.get("waiting_reason"):
        return f"; it waits: {view['waiting_reason']}"
    return ""


@click.group()
def jobs() -> None:
    """Find and inspect jobs; retry or cancel one, or every job a filter matches."""


@jobs.command("show")
@click.argument("job_id")
@URL_OPTION
def jobs_show(job_id: str, url: str) -> None:
    """Show job JOB_ID: state, attempt, worker, result, errors, and why it waits."""
    _print_job(_api(url, "job", job_id))


for _command in ops.JOB_COMMANDS:  # list, and retry and cancel of one job or many
    jobs.add_command(_command)
