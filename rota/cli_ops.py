"""The operator's commands: find jobs and retry or cancel them in bulk, pause queues,
watch the server live (``rota watch``) and follow its events (``rota tail``).

``rota.cli`` registers them beside its own. Everything here is a client of the admin API
(docs/protocol.md): ``GET /jobs``, ``POST /jobs/retry|cancel``, ``/queues``, ``/workers``,
``/stats`` and the ``/events`` stream.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from rota.cli_base import URL_OPTION, api, fail, print_json, say, token
from rota.client import ApiError, Client
from rota.logs import printable
from rota.stream import EventStream

PAGE = 500  # jobs a page when --all follows the cursor (the server's most)


def _split(values: tuple[str, ...]) -> list[str]:
    """Repeated options, each also comma-separated: --state failed,discarded --state x."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def filter_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The filter of ``GET /jobs``, shared by ``jobs list``, ``retry`` and ``cancel``."""
    options = [
        click.option("--state", "states", multiple=True,
                     help="Jobs in this state (repeat, or a,b): scheduled, available, active,"
                     " retryable, completed, discarded, cancelled."),
        click.option("--spec", help="Jobs of this spec."),
        click.option("--queue", help="Jobs in this queue."),
        click.option("--worker", help="Jobs last held by this worker."),
        click.option("--q", "q", help="An id prefix, or text found in the jobs' errors."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _filter(states: tuple[str, ...], spec: str | None, queue: str | None,
            worker: str | None, q: str | None) -> dict[str, Any]:
    given = {"state": _split(states), "spec": spec, "queue": queue, "worker": worker, "q": q}
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
              worker: str | None, q: str | None, limit: int, every: bool, as_json: bool,
              url: str) -> None:
    """Find jobs, newest first: by state, spec, queue, worker, or id prefix / error text."""
    flt = _filter(states, spec, queue, worker, q)
    found: list[dict[str, Any]] = []  # kept for --json; printed page by page otherwise
    shown, cursor = 0, None
    try:
        with Client(url, token=token()) as client:
            while True:
                page = client.list_jobs(states=flt.get("state", ()), spec=spec, queue=queue,
                                        worker=worker, q=q, cursor=cursor,
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
        click.echo("no job matches", err=True)
    elif cursor is not None:
        click.echo(f"(the newest {shown}; more match: --limit up to 500, or --all)", err=True)


def _job_lines(jobs: list[dict[str, Any]], *, header: bool) -> None:
    if header and jobs:
        click.echo(f"{'ID':<36}  {'STATE':<9}  {'SPEC':<16}  {'QUEUE':<12}  {'TRY':>3}"
                   f"  {'WHEN':<20}  {'WORKER':<36}  LAST ERROR")
    for job in jobs:
        when = job["finished_at"] or job["reserved_at"] or job["enqueued_at"] or ""
        errors = job.get("errors") or []
        last = (f"{errors[-1].get('type')}: {errors[-1].get('message')}" if errors else "")
        click.echo(f"{job['id']:<36}  {job['state']:<9}  {job['spec']:<16}  {job['queue']:<12}"
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
                  help=f"The most jobs to {verb} in one call (the server's default: 1000).")
    @click.option("--yes", "-y", is_flag=True,
                  help="Do not ask first (a filter, on a terminal, asks with the count).")
    @click.option("--json", "as_json", is_flag=True, help="Print the server's answer as JSON.")
    @URL_OPTION
    def command(job_ids: tuple[str, ...], states: tuple[str, ...], spec: str | None,
                queue: str | None, worker: str | None, q: str | None, dry_run: bool,
                limit: int | None, yes: bool, as_json: bool, url: str) -> None:
        flt = _filter(states, spec, queue, worker, q)
        if job_ids and flt:
            fail("give job IDs or a filter (--state, --spec, --queue, --worker, --q), not both")
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
    click.echo(f"{reply['matched']} matched; {'would be ' if dry else ''}{done}:"
               f" {reply['touched']}" + ("  (dry run: nothing was changed)" if dry else ""))
    for job_id in reply["ids"]:
        click.echo(f"{'would ' + verb if dry else done} {job_id}")
    if reply["touched"] > len(reply["ids"]):
        click.echo(f"... and {reply['touched'] - len(reply['ids'])} more")
    for skipped in reply["skipped"]:
        click.echo(f"skipped {skipped['id']}: {skipped['reason']}")
    if reply["truncated"]:
        click.echo(f"more jobs match than --limit: run it again to {verb} the rest", err=True)


def _retry_one(job_id: str, url: str) -> None:
    job = api(url, "retry", job_id)
    click.echo(f"{job_id} is {job['state']} again (attempts so far: {job['attempt']})")


def _cancel_one(job_id: str, url: str) -> None:
    job = api(url, "cancel", job_id)
    if job["state"] == "cancelled":
        click.echo(f"cancelled {job_id}")
    else:
        click.echo(f"cancel requested: {job_id} is running on worker {job['worker_id']}")


jobs_retry = _bulk_command("retry", _retry_one, """Put discarded or cancelled jobs back in
    their queue with a fresh attempt budget: one job ID, several, or every job a filter
    matches (rota jobs retry --state discarded --spec resize). --dry-run says which.""")
jobs_cancel = _bulk_command("cancel", _cancel_one, """Cancel jobs: one job ID, several, or
    every job a filter matches (rota jobs cancel --state available --queue emails). A
    waiting job is cancelled at once; a running one is stopped on its worker.""")
JOB_COMMANDS = (jobs_list, jobs_retry, jobs_cancel)


# -- queues ----------------------------------------------------------------------------------
WAITING_STATES = ("available", "scheduled", "retryable")


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print the queues as JSON.")
@URL_OPTION
@click.pass_context
def queues(ctx: click.Context, as_json: bool, url: str) -> None:
    """Each queue's jobs by state, its oldest available job, workers and why jobs wait;
    'rota queues pause|resume NAME'."""
    if ctx.invoked_subcommand is not None:
        return
    rows = api(url, "queues")["queues"]
    if as_json:
        print_json({"queues": rows})
        return
    if not rows:
        click.echo("no queues: no job was enqueued and no worker is connected")
    for row in rows:
        counts = row["counts"]
        states = " ".join(f"{state}={counts[state]}" for state in counts if counts[state])
        click.echo(f"{row['name']:<16} {'paused ' if row.get('paused') else 'running'}"
                   f"  waiting={sum(counts.get(s, 0) for s in WAITING_STATES)}"
                   f"  oldest={_age(row.get('oldest_available_age'))}"
                   f"  workers={row['workers']}  {states or 'no jobs'}")
        for entry in row["waiting"]:
            if entry["reason"]:
                click.echo(f"  {entry['spec']}: {entry['available']} waiting: {entry['reason']}")


def _pause_command(paused: bool) -> click.Command:
    @click.argument("name")
    @URL_OPTION
    def command(name: str, url: str) -> None:
        reply = api(url, "pause_queue", name, paused=paused)
        click.echo(f"{reply['queue']}: {'paused' if reply['paused'] else 'running'}")

    command.__doc__ = ("Pause queue NAME: it keeps its jobs and assigns none until resumed"
                       " (running jobs finish)." if paused else
                       "Resume queue NAME: its jobs are assigned again.")
    return click.command("pause" if paused else "resume")(command)


queues.add_command(_pause_command(True))
queues.add_command(_pause_command(False))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"


# -- watch -----------------------------------------------------------------------------------
BARS = " ▁▂▃▄▅▆▇█"
MINUTES = 60


def snapshot(client: Client, minutes: int = MINUTES) -> dict[str, Any]:
    """One look at the server: queues (depth, latency, paused), workers (state, load,
    heartbeat age), blocked specs (waiting jobs no worker may take, and why) and the
    jobs a minute over the last ``minutes``."""
    queue_rows = client.queues()["queues"]
    worker_rows = client.workers()["workers"]
    stats = client.stats(minutes)
    oldest = stats.get("oldest_available") or {}
    shaped_queues = [{
        "name": row["name"], "paused": bool(row.get("paused")),
        "waiting": sum(row["counts"].get(s, 0) for s in WAITING_STATES),
        "active": row["counts"].get("active", 0), "counts": row["counts"],
        "oldest_available_age": row.get("oldest_available_age", oldest.get(row["name"])),
        "workers": row["workers"]} for row in queue_rows]
    blocked = [{"queue": row["name"], "spec": entry["spec"], "available": entry["available"],
                "reason": entry["reason"]}
               for row in queue_rows for entry in row["waiting"] if entry["reason"]]
    shaped_workers = [{
        "id": w["id"], "state": w["state"], "active": w["active"],
        "concurrency": w["concurrency"], "prefetched": w["prefetched"],
        "last_heartbeat_age": w["last_heartbeat_age"], "hostname": w["hostname"],
        "labels": w["labels"], "cpu_percent": w["cpu_percent"],
        "memory_rss": w["memory_rss"]} for w in worker_rows]
    per_minute = {kind: [0] * len(stats["minute_starts"])
                  for kind in ("enqueued", "completed", "failed", "discarded")}
    for series in stats["series"]:
        for kind, counts in per_minute.items():
            for i, n in enumerate(series.get(kind, [])[:len(counts)]):
                counts[i] += n
    return {"at": stats["now"], "queues": shaped_queues, "workers": shaped_workers,
            "blocked": blocked,
            "throughput": {"minute_starts": stats["minute_starts"], **per_minute}}


def render(view: dict[str, Any], url: str, interval: float, width: int) -> list[str]:
    """The screen of ``rota watch``, as lines no wider than ``width``."""
    lines = [f"rota watch  {url}  {view['at']}  (every {interval:g}s; Ctrl-C stops)", ""]
    lines.append(f"{'QUEUE':<20} {'STATE':<8} {'WAITING':>8} {'ACTIVE':>7} {'OLDEST':>8}"
                 f" {'WORKERS':>8}")
    for q in view["queues"]:
        lines.append(f"{q['name']:<20} {'paused' if q['paused'] else 'running':<8}"
                     f" {q['waiting']:>8} {q['active']:>7} {_age(q['oldest_available_age']):>8}"
                     f" {q['workers']:>8}")
    if not view["queues"]:
        lines.append("(no queues yet)")
    lines += ["", f"{'WORKER':<36} {'STATE':<10} {'LOAD':>9} {'BEAT':>7}  HOST"]
    for w in view["workers"]:
        load = f"{w['active']}/{w['concurrency']}" + (
            f"+{w['prefetched']}" if w["prefetched"] else "")
        lines.append(f"{w['id']:<36} {w['state']:<10} {load:>9}"
                     f" {_age(w['last_heartbeat_age']):>7}  {w['hostname']}")
    if not view["workers"]:
        lines.append("(no workers connected)")
    lines += ["", "BLOCKED"]
    for b in view["blocked"]:
        lines.append(f"{b['queue']}/{b['spec']}: {b['available']} waiting: {b['reason']}")
    if not view["blocked"]:
        lines.append("(nothing blocked)")
    # As many minutes as the terminal has room for beside the figures (the whole hour
    # at 110 columns).
    shown = max(10, min(len(view["throughput"]["minute_starts"]), width - 50))
    lines += ["", f"THROUGHPUT  jobs a minute, the last {shown} minutes (the last so far)"]
    for kind in ("enqueued", "completed", "failed", "discarded"):
        counts = view["throughput"][kind]
        last = counts[-2] if len(counts) > 1 else (counts[-1] if counts else 0)
        lines.append(f"{kind:<10} {_spark(counts[-shown:])}  last minute {last}"
                     f" ({last / 60:.1f}/s), in the hour {sum(counts)}")
    # printable: a worker's hostname is its own text, and must not drive the terminal
    return [printable(line, max(20, width - 1)) for line in lines]


def _spark(counts: list[int]) -> str:
    top = max(counts, default=0)
    if not top:
        return " " * len(counts)
    return "".join(BARS[0 if not n else max(1, round(n / top * (len(BARS) - 1)))]
                   for n in counts)


@click.command()
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between looks.")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@URL_OPTION
def watch(interval: float, as_json: bool, url: str) -> None:
    """A live view of the server, redrawn every --interval seconds: queues (waiting jobs,
    the oldest one's age, paused), workers (state, load, heartbeat age), blocked specs and
    jobs a minute over the last hour."""
    client = Client(url, token=token())
    try:
        view = snapshot(client)  # the first look fails in one line: a wrong URL or token
    except ApiError as exc:
        client.close()
        fail(say(url, exc))
    if as_json:
        client.close()
        print_json(view)
        return
    tty = sys.stdout.isatty()
    try:
        while True:
            width = shutil.get_terminal_size().columns if tty else 10_000
            screen = render(view, url, interval, width)
            # Home and clear on a terminal; elsewhere (a pipe, a file) one frame after another.
            click.echo(("\x1b[H\x1b[J" if tty else "") + "\n".join(screen) + ("" if tty else "\n"))
            time.sleep(interval)  # noqa: sleep-ok (the refresh period the user asked for)
            try:
                view = snapshot(client)
            except ApiError as exc:  # a restart, a blip: say so and keep looking
                view = {**view, "at": f"{view['at']}  (stale: {say(url, exc)})"}
    except KeyboardInterrupt:
        pass
    finally:
        client.close()


# -- tail ------------------------------------------------------------------------------------
FIELDS = ("job", "spec", "checksum", "queue", "worker", "attempt", "state", "duration_ms",
          "message")


def event_line(event_id: int | None, data: dict[str, Any]) -> str:
    """An event as one line: its time, kind, then its fields as key=value."""
    rest = [key for key in data if key not in ("at", "kind", *FIELDS)]
    parts = [f"{key}={_value(key, data[key])}" for key in (*FIELDS, *rest)
             if key in data and data[key] is not None]
    return printable(f"{data.get('at', '-')} {data.get('kind', '?'):<17} {' '.join(parts)}",
                     2000)


def _value(key: str, value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if key == "checksum":
        text = text[:19]  # sha256: and 12 digits, as 'rota specs list' shows it
    return json.dumps(text) if (not text or any(c in text for c in ' "=')) else text


@click.command()
@click.option("--spec", help="Only events of this spec.")
@click.option("--queue", help="Only events of this queue.")
@click.option("--worker", help="Only events of this worker.")
@click.option("--event", "kinds", multiple=True,
              help="Only these kinds (repeat, or a,b): enqueue, assign, result, retry, discard,"
              " cancel, worker_connect, worker_disconnect, worker_state, state_change, alert.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line (NDJSON).")
@URL_OPTION
def tail(spec: str | None, queue: str | None, worker: str | None, kinds: tuple[str, ...],
         as_json: bool, url: str) -> None:
    """Follow the server's events as they happen, one line each (GET /events). It
    reconnects by itself and resumes where it stopped; Ctrl-C stops it."""
    params = {"spec": spec, "queue": queue, "worker": worker, "event": ",".join(_split(kinds))}
    def say_err(message: str) -> None:  # stderr: stdout is the events, for a pipe
        click.echo(f"rota tail: {message}", err=True)

    stream: EventStream | None = None
    try:
        stream = EventStream(url, token=token(), params={k: v for k, v in params.items() if v},
                             on_open=say_err, on_retry=say_err)
        for event in stream:
            click.echo(json.dumps({"id": event.id, **event.data}, separators=(",", ":"))
                       if as_json else event_line(event.id, event.data))
    except ApiError as exc:
        fail(say(url, exc))
    except KeyboardInterrupt:
        pass
    finally:
        if stream is not None:
            stream.close()

