"""The live commands: ``rota watch`` (one screen of the server, redrawn) and ``rota
tail`` (its events as they happen, one line each). Clients of ``GET /queues``,
``/workers``, ``/stats`` and the ``GET /events`` stream (rota/client/stream.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Any

import click

from rota.cli.base import URL_OPTION, fail, out, print_json, say, screen, servers, token
from rota.cli.ops import split
from rota.core.model import waiting_and_later
from rota.client.client import ApiError, Client
from rota.core.charts import start_index
from rota.core import display
from rota.core.display import duration
from rota.base.logs import printable
from rota.base.protocol import STATE_SAID
from rota.client.stream import EventStream

# -- watch -----------------------------------------------------------------------------------
BARS = " ▁▂▃▄▅▆▇█"
MINUTES = 60


def snapshot(client: Client, minutes: int = MINUTES) -> dict[str, Any]:
    """One look at the server: queues (depth, latency, paused), workers (state, load,
    heartbeat age), blocked specs (waiting jobs no worker may take, and why), the limits
    and their use, and the jobs a minute over the last ``minutes``."""
    queues = client.queues()
    queue_rows = queues["queues"]
    worker_rows = client.workers()["workers"]
    stats = client.stats(minutes)
    oldest = stats.get("oldest_available") or {}
    shaped_queues = [{
        "name": row["name"], "paused": bool(row.get("paused")),
        # due (available) apart from not yet due (scheduled, retryable)
        **dict(zip(("waiting", "later"), waiting_and_later(row["counts"]), strict=True)),
        # active jobs, running apart from prefetched (waiting in a worker's line)
        "active": row["counts"].get("active", 0), "prefetched": row.get("prefetched", 0),
        "counts": row["counts"],
        "oldest_available_age": row.get("oldest_available_age", oldest.get(row["name"])),
        "workers": row["workers"]} for row in queue_rows]
    blocked = [{"queue": row["name"], "spec": entry["spec"], "available": entry["available"],
                "reason": entry["reason"]}
               for row in queue_rows for entry in row["waiting"]
               if entry["reason"] and entry.get("blocked", True)]  # not a busy backlog
    blocked += [{"queue": row["name"], "spec": entry["spec"],
                 "available": entry["held"]["no_label"], "reason": display.no_labels(entry)}
                for row in queue_rows for entry in row["waiting"]
                if (entry.get("held") or {}).get("no_label")]  # nothing will take them
    # push endpoints have no process nor heartbeat: a table of their own, breaker and URL
    endpoints = client.endpoints()["endpoints"] \
        if any(w.get("kind") == "endpoint" for w in worker_rows) else []
    worker_rows = [w for w in worker_rows if w.get("kind") != "endpoint"]
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
            "blocked": blocked, "limits": queues.get("limits", []),
            "endpoints": [{key: e[key] for key in ("id", "state", "reason", "in_flight",
                                                    "accepted", "max_in_flight", "url")}
                          for e in endpoints],
            "throughput": {"minute_starts": stats["minute_starts"],
                       "started_at": stats.get("started_at"), **per_minute}}


def render(view: dict[str, Any], url: str, interval: float, width: int) -> list[str]:
    """The screen of ``rota watch``, as lines no wider than ``width``: its tables' columns
    two spaces apart, each as wide as its widest cell, the last one cut to fit."""
    at = view["at"]
    lines = [f"rota watch  {url}  {at[11:19]} UTC  (every {interval:g}s; Ctrl-C stops)"]
    if view.get("stale"):
        lines.append(f"STALE: {view['stale']}")
    lines.append("")
    lines += table(("QUEUE", "STATE", "WAITING", "LATER", "RUNNING", "PREFETCHED", "OLDEST",
                    "WORKERS"), [
        (q["name"], "paused" if q["paused"] else "running", f"{q['waiting']:,}",
         f"{q['later']:,}", f"{q['active'] - q['prefetched']:,}", f"{q['prefetched']:,}",
         duration(q["oldest_available_age"]), f"{q['workers']}")
        for q in view["queues"]], width, first=True) or ["(no queues yet)"]
    lines.append("")
    lines += table(("WORKER", "STATE", "LOAD", "BEAT", "HOST"), [
        (w["id"], STATE_SAID.get(w["state"], w["state"]), f"{w['active']}/{w['concurrency']}"
         + (f" +{w['prefetched']} prefetched" if w["prefetched"] else ""),
         duration(w["last_heartbeat_age"]), w["hostname"]) for w in view["workers"]],
        width) or ["(no workers connected)"]
    if view.get("endpoints"):
        lines += ["", *endpoint_lines(view["endpoints"], width)]
    lines += ["", "BLOCKED"]
    for b in view["blocked"]:
        lines.append(f"{b['queue']}/{b['spec']}: {b['available']} waiting: {b['reason']}")
    if not view["blocked"]:
        lines.append("(nothing blocked)")
    lines += ["", "LIMITS", *limit_lines(view.get("limits", []))]
    lines += ["", *throughput_lines(view["throughput"], width)]
    # printable: a worker's hostname is its own text, and must not drive the terminal
    return [printable(line, max(20, width - 1)) for line in lines]


def endpoint_lines(endpoints: list[dict[str, Any]], width: int) -> list[str]:
    """The push endpoints: each one's breaker (paused: why, and until when), deliveries
    in flight of its most, jobs it answered 202 for, and its URL."""
    return table(("ENDPOINT", "BREAKER", "IN FLIGHT", "ACCEPTED", "URL"), [
        (e["id"], "paused" if e["state"] == "open" else e["state"].replace("_", "-"),
         f"{e['in_flight']}/{e['max_in_flight']}", f"{e['accepted']}",
         e["url"] if not e["reason"] else f"{e['reason']}  {e['url']}") for e in endpoints],
        width)


def limit_lines(uses: list[dict[str, Any]]) -> list[str]:
    """One line per limit in use (jobs counted against it, or starts in its window):
    ``spec:send_email  3/3 running  key acme``, its name in a column as wide as the widest."""
    used = [u for u in uses if u.get("running") or u.get("starts") or u.get("next_start")]
    if not used:  # (a limit of per-key rules only lists no use while no key has any)
        return ["(no limit in use)"]
    width = max(len(u["name"]) for u in used)
    return ["  ".join([use["name"].ljust(width), *display.limit_use(use)]
                      + ([] if use.get("key") is None else [f"key {use['key']}"]))
            for use in used]


FIGURES = ("THIS MIN", "PREV MIN", "HOUR")  # the minute under way, the last whole one


def throughput_lines(throughput: dict[str, Any], width: int) -> list[str]:
    """Jobs a minute as sparklines, as many minutes as fit beside the figures (the whole
    hour at 102 columns), each line with the minute under way so far (a burst shows at
    once), the last whole minute and the hour; and where the server started, if shown."""
    starts = throughput["minute_starts"]
    shown = max(10, min(len(starts), width - 1 - 11 - 10 * len(FIGURES)))
    lines = [f"THROUGHPUT  jobs a minute, the last {shown} minutes (THIS MIN: so far)",
             " " * (11 + shown) + "".join(f"  {name:>8}" for name in FIGURES)]
    for kind in ("enqueued", "completed", "failed", "discarded"):
        counts = throughput[kind]
        figures = (counts[-1] if counts else 0, counts[-2] if len(counts) > 1 else 0,
                   sum(counts))
        lines.append(f"{kind:<10} {_spark(counts[-shown:]).ljust(shown)}"
                     + "".join(f"  {n:>8,}" for n in figures))
    start = start_index(starts[-shown:], throughput.get("started_at"))
    if start is not None:  # counts before it are the last run's, kept in the store
        text = f"server started {throughput['started_at'][11:16]}"
        column = 11 + start
        lines.append(" " * column + f"↑ {text}" if column + len(text) + 2 < width
                     else " " * (column - len(text) - 1) + f"{text} ↑")
    return lines


def table(header: tuple[str, ...], rows: list[tuple[str, ...]], width: int, *,
          first: bool = False) -> list[str]:
    """``rows`` under ``header`` (none: no lines), in columns two spaces apart, numbers
    (every column but the first and the state) to the right. To fit ``width``, the last
    column is cut, or the first (``first``: the last holds figures)."""
    rows = [tuple(printable(cell, UNCUT_CELL) for cell in row) for row in rows]
    if not rows:
        return []
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    over = sum(widths) + 2 * (len(widths) - 1) - (width - 1)
    cut = 0 if first else len(widths) - 1
    if over > 0:
        widths[cut] = max(len(header[cut]), widths[cut] - over)
    left = {0, 1} | (set() if first else {len(widths) - 1})

    def line(cells: tuple[str, ...]) -> str:
        out = []
        for i, (cell, w) in enumerate(zip(cells, widths, strict=True)):
            if len(cell) > w:
                cell = cell[:w - 1] + "…"
            out.append(cell.ljust(w) if i in left else cell.rjust(w))
        return "  ".join(out).rstrip()

    return [line(header), *(line(row) for row in rows)]


UNCUT_CELL = 500  # a cell's characters before the table cuts it to the width


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
    the oldest one's age, paused), workers (state, load, heartbeat age), push endpoints
    (their circuit breaker, in flight), blocked specs, the limits in use and jobs a minute
    over the last hour."""
    client = Client(servers(url), token=token())
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
            frame = render(view, url, interval, width)
            # Home and clear on a terminal; elsewhere (a pipe, a file) one frame after another.
            screen(frame, clear=tty)
            time.sleep(interval)  # noqa: sleep-ok (the refresh period the user asked for)
            try:
                view = snapshot(client)
            except ApiError as exc:  # a restart, a blip: say so and keep looking
                view = {**view, "stale": say(url, exc)}
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
    if len(servers(url)) > 1:  # each server streams its own events: which to follow?
        fail("rota tail follows one server's events: give it one --url, not several")
    params = {"spec": spec, "queue": queue, "worker": worker, "event": ",".join(split(kinds))}
    def say_err(message: str) -> None:  # stderr: stdout is the events, for a pipe
        out(f"rota tail: {message}", err=True)

    stream: EventStream | None = None
    try:
        stream = EventStream(url, token=token(), params={k: v for k, v in params.items() if v},
                             on_open=say_err, on_retry=say_err)
        for event in stream:
            if as_json:
                print_json({"id": event.id, **event.data}, compact=True)
            else:
                out(event_line(event.id, event.data))
    except ApiError as exc:
        fail(say(url, exc))
    except KeyboardInterrupt:
        pass
    finally:
        if stream is not None:
            stream.close()

