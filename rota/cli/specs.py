"""``rota specs``: push the specs of a deploy, list them, see their history, retire one,
and print checksums (which needs no server)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import click

from rota.cli.base import URL_OPTION
from rota.cli.base import api as _api
from rota.cli.base import fail as _fail
from rota.cli.base import out as _out
from rota.base.errors import Invalid
from rota.base.specs import SpecError, checksum, load_deploy, load_dir
from rota.core.schedules import check


@click.group()
def specs() -> None:
    """Register job specs (the status quo) and inspect them."""


@specs.command("push")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@URL_OPTION
@click.option("--dry-run", is_flag=True, help="Show what would change; change nothing.")
def specs_push(directory: Path, url: str, dry_run: bool) -> None:
    """Make the specs in DIRECTORY the status quo (run this during a deploy).

    Prints, per spec, whether it is new, changed or unchanged, and for changed specs how
    many connected workers no longer match; then the same for the [[schedule]] tables of
    the directory (a push adds and changes schedules, never deletes or un-pauses one),
    and each stored schedule whose args a pushed spec would refuse (pushed anyway: it
    waits until its args or its spec fit again).
    """
    try:
        loaded, tables = load_deploy(directory)
        for table in tables:  # checked here first, to name the file
            check({k: v for k, v in table.items() if k != "source"}, where=table["source"])
    except SpecError as exc:
        _fail(str(exc))
    except Invalid as exc:
        _fail(f"{exc.message} ({exc.code})")
    sent = [{k: v for k, v in table.items() if k != "source"} for table in tables]
    report = (_api(url, "push_deploy", loaded, sent, dry_run=dry_run) if sent
              else _api(url, "push_specs", loaded, dry_run=dry_run))
    wide = _widest(item["name"] for item in report["specs"])
    for item in report["specs"]:
        line = f"{item['change']:<9} {item['name']:<{wide}}  {item['checksum'][:19]}"
        if item["change"] == "changed":
            line += f"  (was {item['previous'][:19]}; {item['mismatched_workers']} connected worker(s) no longer match)"
        _out(line)
    for item in report.get("schedules", []):
        _out(f"{item['change']:<9} schedule {item['name']}")
    for item in report.get("args_refused", []):
        _out(f"schedule {item['name']}: its args " + (
            f"would be refused: {item['message']}" if dry_run else
            f"are refused: {item['message']} (it waits until its args or its spec fit)"))
    if dry_run:
        _out("dry run: nothing was changed")


@specs.command("list")
@URL_OPTION
def specs_list(url: str) -> None:
    """List the status-quo specs with their versions and checksums."""
    listed = _api(url, "specs")["specs"]
    if not listed:  # (on stderr: stdout stays the list, empty, for a script)
        _out("no specs registered; push some with `rota specs push DIR`", err=True)
    wide = _widest(spec["name"] for spec in listed)
    for spec in listed:
        retired = f"  retired {spec['retired_at']}" if spec.get("retired_at") else ""
        _out(f"{spec['name']:<{wide}}  {spec['version']:<10} {spec['checksum'][:19]}"
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
        loaded = load_dir(directory)
    except SpecError as exc:
        _fail(str(exc))
    wide = _widest(spec.name for spec in loaded)
    for spec in loaded:
        _out(f"{spec.name:<{wide}}  {checksum(spec)}")


def _widest(names: Iterable[str]) -> int:
    """The width of a column of names: the longest (names run to 128 characters, so a
    fixed width would either waste the line or break the columns)."""
    return max(map(len, names), default=0)
