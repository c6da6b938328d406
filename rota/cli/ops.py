"""The operator's commands: find jobs and retry or cancel them in bulk, see queues and
pause them, see workers and quiet, resume or terminate them (``rota.cli.live`` has
``rota watch`` and ``rota tail``).

``rota.cli.app`` registers them beside the others. Everything here is a client of the admin
API (docs/protocol.md): ``GET /jobs``, ``POST /jobs/retry|cancel``, ``/queues``, ``/workers``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from rota.cli.base import URL_OPTION, api, fail, out, print_json, say, servers, token
from rota.client.client import ApiError, Client
from rota.core.display import duration, held_parts
from rota.core.model import waiting_and_later
from rota.base.logs import printable
from rota.base.protocol import STATE_SAID

PAGE = 500  # jobs a page when --all follows the cursor (the server's most)


def split(values: tuple[str, ...]) -> list[str]:
    """Repeated options, each also comma-separated: --state failed,discarded --state x."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def filter_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The filter of ``GET /jobs``, shared by ``jobs list``, ``retry`` and ``cancel``."""
    options = [
        click.option("--state", "states", multiple=True,
                     help="Jobs in this state (repeat, or a,b): scheduled, available, active,"
                     " retryable, completed, discarded, cancelled, pending."),
        click.option("--spec", help="Jobs of this spec."),
        click.option("--queue", help="Jobs in this queue."),
        click.option("--worker", help="Jobs last held by this worker."),
        click.option("--schedule", help="Jobs a cron schedule made (`rota schedules`)."),
        click.option("--q", "q", help="An id prefix, or text found in the jobs' errors."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _filter(states: tuple[str, ...], spec: str | None, queue: str | None,
            worker: str | None, schedule: str | None, q: str | None) -> dict[str, Any]:
    """The filter given, refusing an empty field: ``--queue "$QUEUE"`` with QUEUE unset
    must not widen a bulk cancel to every queue."""
    given = {"state": split(states), "spec": spec, "queue": queue, "worker": worker,
             "schedule": schedule, "q": q}
    for key, value in given.items():
        if (bool(states) if key == "state" else value is not None) and not value:
            fail(f"--{key} is empty (an unset variable?): give a value, or leave it out")
    return {key: value for key, value in given.items() if value}


# -- jobs list -----------------------------------------------------------------------------
@click.command("list")
@filter_options
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True,
              help="Jobs to show (newest first).")
@click.option("--all", "every", is_flag=True, help="Every matching job, a page at a time.")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"jobs": [...], "next_cursor"} as JSON.')
@URL_OPTION
def jobs_list(states: tuple[str, ...], spec: str | None, queue: str | None,
              worker: str | None, schedule: str | None, q: str | None, limit: int,
              every: bool, as_json: bool, url: str) -> None:
    """Find jobs, newest first: by state, spec, queue, worker, schedule, or id prefix /
    error text."""
    flt = _filter(states, spec, queue, worker, schedule, q)
    found: list[dict[str, Any]] = []  # kept for --json; printed page by page otherwise
    shown, cursor = 0, None
    try:
        with Client(servers(url), token=token()) as client:
            while True:
                page = client.list_jobs(states=flt.get("state", ()), spec=spec, queue=queue,
                                        worker=worker, schedule=schedule, q=q,
                                        cursor=cursor,
                                        limit=PAGE if every else limit)
                cursor = page["next_cursor"]
                if as_json:
                    found += page["jobs"]
                else:  # as they come: a long listing starts at once
                    _job_lines(page["jobs"], header=not shown)
                shown += len(page["jobs"])
                if not every or cursor is None:
                    break
    except ApiError as exc:
        fail(say(url, exc))
    if as_json:
        print_json({"jobs": found, "next_cursor": cursor})
    elif not shown:
        out("no job matches", err=True)
    elif cursor is not None:
        out(f"(the newest {shown}; more match: --limit up to 500, or --all)", err=True)


def _job_lines(jobs: list[dict[str, Any]], *, header: bool) -> None:
    if header and jobs:
        out(f"{'ID':<36}  {'STATE':<9}  {'SPEC':<16}  {'QUEUE':<12}  {'TRY':>3}"
            f"  {'WHEN':<20}  {'WORKER':<36}  LAST ERROR")
    for job in jobs:
        when = job["finished_at"] or job["reserved_at"] or job["enqueued_at"] or ""
        errors = job.get("errors") or []
        last = (f"{errors[-1].get('type')}: {errors[-1].get('message')}" if errors else "")
        out(f"{job['id']:<36}  {job['state']:<9}  {job['spec']:<16}  {job['queue']:<12}"
            f"  {job['attempt']:>3}  {when[:19]:<20}  {job['worker_id'] or '-':<36}"
            f"  {printable(last, 80)}")


# -- jobs retry | cancel -------------------------------------------------------------------
WORDS = {"retry": ("retried", "retry"), "cancel": ("cancelled", "cancel")}


def _bulk_command(action: str, single: Callable[[str, str], None], summary: str
                  ) -> click.Command:
    done, verb = WORDS[action]

    @click.argument("job_ids", metavar="[ID]...", nargs=-1)
    @filter_options
    @click.option("--dry-run", is_flag=True, help=f"Say what would be {done}; change nothing.")
    @click.option("--limit", type=click.IntRange(1, 10_000), default=None,
                  help=f"The most jobs to {verb} in one call (by default every ID given, or 1000"
                  " of a filter's matches).")
    @click.option("--yes", "-y", is_flag=True,
                  help="Do not ask first (a filter, on a terminal, asks with the count).")
    @click.option("--json", "as_json", is_flag=True, help="Print the server's answer as JSON.")
    @URL_OPTION
    def command(job_ids: tuple[str, ...], states: tuple[str, ...], spec: str | None,
                queue: str | None, worker: str | None, schedule: str | None, q: str | None,
                dry_run: bool, limit: int | None, yes: bool, as_json: bool, url: str) -> None:
        flt = _filter(states, spec, queue, worker, schedule, q)
        if job_ids and flt:
            fail("give job IDs or a filter (--state, --spec, --queue, --worker, --schedule,"
                 " --q), not both")
        if not job_ids and not flt:
            fail(f"name the jobs to {verb}: job IDs, or a filter such as --state discarded"
                 " --spec NAME")
        if len(job_ids) == 1 and not (dry_run or limit or as_json):
            single(job_ids[0], url)  # the one-job form, as it always was
            return
        target: dict[str, Any] = {"ids": list(job_ids)} if job_ids else {"filter": flt}
        if flt and not (yes or dry_run) and sys.stdin.isatty():
            trial = api(url, "bulk", action, dry_run=True, limit=limit, **target)
            if not trial["touched"]:
                _report(trial, done, verb)
                return
            click.confirm(f"{verb} {trial['touched']} job(s)"
                          f"{' (and more past --limit)' if trial['truncated'] else ''}?",
                          abort=True, err=True)
        reply = api(url, "bulk", action, dry_run=dry_run, limit=limit, **target)
        if as_json:
            print_json(reply)
        else:
            _report(reply, done, verb)

    command.__doc__ = summary
    return click.command(action)(command)


def _report(reply: dict[str, Any], done: str, verb: str) -> None:
    dry = reply["dry_run"]
    groups = skip_groups(reply["skipped"], reply["action"])
    if not reply["touched"] and groups:  # a state it cannot act on: no run to report
        n = reply["matched"]
        who = "the 1 job matched was" if n == 1 else f"all {n} jobs matched were"
        more = " (and more past --limit)" if reply["truncated"] else ""
        why = "; ".join((f"{len(ids)} " if len(groups) > 1 else "") + said + examples(ids, ": ")
                        for said, ids in groups)
        fail(f"nothing {'would be ' if dry else ''}{done}: {who} skipped{more}, as {why}")
    out(f"{reply['matched']} matched; {'would be ' if dry else ''}{done}:"
        f" {reply['touched']}" + ("  (dry run: nothing was changed)" if dry else ""))
    for job_id in reply["ids"]:
        out(f"{'would ' + verb if dry else done} {job_id}")
    if reply["touched"] > len(reply["ids"]):
        out(f"... and {reply['touched'] - len(reply['ids'])} more")
    for said, ids in groups:
        out(f"skipped {ids[0]}: {said}" if len(ids) == 1
            else f"skipped {len(ids)}: {said}{examples(ids, '')}")
    if reply["truncated"]:
        out(f"more jobs match than --limit: run it again to {verb} the rest", err=True)


# Why a bulk action passes over a job in a state, beside the server's "job is <state>".
SKIP_WHY = {("cancel", state): "a finished job cannot be cancelled"
            for state in ("completed", "discarded", "cancelled")} | {
    ("retry", state): "only a discarded or cancelled job is retried"
    for state in ("scheduled", "available", "retryable", "active", "completed")}
EXAMPLES = 3  # ids shown for a reason that many jobs share


def skip_groups(skipped: list[dict[str, str]], action: str) -> list[tuple[str, list[str]]]:
    """A bulk answer's skipped jobs by reason, most first: (the reason, with why the
    action passes over that state, and their ids); the answer lists the first 100."""
    by_reason: dict[str, list[str]] = {}
    for skip in skipped:
        by_reason.setdefault(skip["reason"], []).append(skip["id"])
    groups = []
    for reason, ids in sorted(by_reason.items(), key=lambda item: -len(item[1])):
        why = SKIP_WHY.get((action, reason.removeprefix("job is ")))
        groups.append((f"{reason} ({why})" if why and reason.startswith("job is ") else reason,
                       ids))
    return groups


def examples(ids: list[str], one: str) -> str:
    """A few of many ids (", e.g. a, b, c, ..."), or the one after ``one``."""
    if len(ids) == 1:
        return one + ids[0] if one else ""
    return ", e.g. " + ", ".join(ids[:EXAMPLES]) + (", ..." if len(ids) > EXAMPLES else "")


def _retry_one(job_id: str, url: str) -> None:
    out(retried(job_id, api(url, "retry", job_id)))


def retried(job_id: str, job: dict[str, Any]) -> str:
    """What a retry did. The answer is the row read after it: a free worker may have taken
    the job (and failed it) by then, which is said as such, not as what the retry did."""
    budget = (f"a fresh budget of {job['max_attempts']} attempt(s) ({job['attempt']} so far"
              " in all)")
    if job["state"] == "available":
        return f"{job_id} is available again, with {budget}"
    return (f"{job_id} was put back with {budget}; a worker took it at once: it is"
            f" {job['state']} now")


def _cancel_one(job_id: str, url: str) -> None:
    job = api(url, "cancel", job_id)
    if job["state"] == "cancelled":
        out(f"cancelled {job_id}")
    else:
        out(f"cancel requested: {job_id} is running on worker {job['worker_id']}")


jobs_retry = _bulk_command("retry", _retry_one, """Put discarded or cancelled jobs back in
    their queue with a fresh attempt budget: one job ID, several, or every job a filter
    matches (rota jobs retry --state discarded --spec resize_image). --dry-run says which.""")
jobs_cancel = _bulk_command("cancel", _cancel_one, """Cancel jobs: one job ID, several, or
    every job a filter matches (rota jobs cancel --state available --queue emails). A
    waiting job is cancelled at once; a running one is stopped on its worker.""")
JOB_COMMANDS = (jobs_list, jobs_retry, jobs_cancel)


# -- queues ----------------------------------------------------------------------------------
@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the queues as JSON.")
@URL_OPTION
@click.pass_context
def queues(ctx: click.Context, as_json: bool, url: str) -> None:
    """Each queue's jobs by state, its oldest available job, workers and why jobs wait;
    'rota queues pause|resume NAME'."""
    if ctx.invoked_subcommand is not None:
        return
    reply = api(url, "queues")
    rows, others = reply["queues"], reply.get("others")
    if as_json:
        print_json({"queues": rows, "others": others})
        return
    if not rows:
        out("no queues: no job was enqueued and no worker is connected")
    for row in rows:
        counts = row["counts"]
        states = " ".join(f"{state}={counts[state]}" for state in counts if counts[state])
        waiting, later = waiting_and_later(counts)
        out(f"{row['name']:<16} {'paused ' if row.get('paused') else 'running'}"
            f"  waiting={waiting}  later={later}"
            f"  oldest={duration(row.get('oldest_available_age'))}"
            f"  workers={row['workers']}  {states or 'no jobs'}")
        for entry in row["waiting"]:
            # the spec's reason, then those of its jobs a key's limit or labels hold
            said = "; ".join(filter(None, [entry["reason"], ", ".join(held_parts(entry))]))
            if said:
                out(f"  {entry['spec']}: {entry['available']} waiting: {said}")
    if others:  # past the server's --max-series
        counts = others["counts"]
        states = " ".join(f"{state}={counts[state]}" for state in counts if counts[state])
        out(f"and {others['queues']} more queues, not listed one by one:"
                   f" {states or 'no jobs'}")


def _pause_command(paused: bool) -> click.Command:
    @click.argument("name")
    @URL_OPTION
    def command(name: str, url: str) -> None:
        reply = api(url, "pause_queue", name, paused=paused)
        out(f"{reply['queue']}: {'paused' if reply['paused'] else 'running'}")

    command.__doc__ = ("Pause queue NAME: it keeps its jobs and assigns none until resumed"
                       " (running jobs finish)." if paused else
                       "Resume queue NAME: its jobs are assigned again.")
    return click.command("pause" if paused else "resume")(command)


queues.add_command(_pause_command(True))
queues.add_command(_pause_command(False))


@click.group()
def workers() -> None:
    """See connected workers; quiet, resume or terminate them (rolling deploys)."""


def _prefetched(worker: dict[str, Any]) -> str:
    """' +waiting/prefetch' after the load, for a worker that prefetches."""
    if not worker.get("prefetch"):
        return ""
    return f" +{worker['prefetched']}/{worker['prefetch']}"


def endpoint_line(worker: dict[str, Any], endpoint: dict[str, Any]) -> str:
    """A push endpoint as ``rota workers list`` shows it: its load, URL and breaker."""
    breaker = endpoint["state"].replace("_", "-")
    if endpoint["reason"]:
        breaker += f" ({endpoint['reason']})"
    return (f"{worker['id']}  endpoint    load={worker['active']}/{worker['concurrency']}"
            f"  queues={','.join(worker['queues'])}"
            f"  version={'current' if endpoint['status_quo'] else 'older'}"
            f"  url={endpoint['url']}  breaker={breaker}")


@workers.command("list")
@URL_OPTION
def workers_list(url: str) -> None:
    """Each worker's state, queues, labels, load, spec matches and last heartbeat age."""
    rows = api(url, "workers")["workers"]
    if not rows:
        out("no workers connected")
    # push endpoints are workers with no process: their URL and breaker instead
    endpoints = {e["id"]: e for e in api(url, "endpoints")["endpoints"]} \
        if any(w.get("kind") == "endpoint" for w in rows) else {}
    for w in rows:
        if w["id"] in endpoints:
            out(endpoint_line(w, endpoints[w["id"]]))
            continue
        out(f"{w['id']}  {STATE_SAID.get(w['state'], w['state']):<11} load={w['active']}/{w['concurrency']}"
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
            fail("name one worker ID, or --label LABEL, or --all")
        reply = api(url, "direct", state, worker_id=worker_id, label=label, every=every)
        for worker in reply["workers"]:
            out(f"{worker}: {state}")
        if not reply["workers"]:  # a typo in a label must not pass for success in a deploy
            fail(f"no connected worker{f' with label {label!r}' if label else ''} to {name}")

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
