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
from rota.core.display import duration
from rota.base.logs import printable
from rota.client.stream import EventStream

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
        # due (available) apart from not yet due (scheduled, retryable)
        **dict(zip(("waiting", "later"), waiting_and_later(row["counts"]), strict=True)),
        "active": row["counts"].get("active", 0), "counts": row["counts"],
        "oldest_available_age": row.get("oldest_available_age", oldest.get(row["name"])),
        "workers": row["workers"]} for row in queue_rows]
    blocked = [{"queue": row["name"], "spec": entry["spec"], "available": entry["available"],
                "reason": entry["reason"]}
               for row in queue_rows for entry in row["waiting"]
               if entry["reason"] and entry.get("blocked", True)]  # not a busy backlog
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
    lines.append(f"{'QUEUE':<20} {'STATE':<8} {'WAITING':>8} {'LATER':>6} {'ACTIVE':>7}"
                 f" {'OLDEST':>10} {'WORKERS':>8}")
    for q in view["queues"]:
        lines.append(f"{q['name']:<20} {'paused' if q['paused'] else 'running':<8}"
                     f" {q['waiting']:>8} {q['later']:>6} {q['active']:>7}"
                     f" {duration(q['oldest_available_age']):>10}"
                     f" {q['workers']:>8}")
    if not view["queues"]:
        lines.append("(no queues yet)")
    lines += ["", f"{'WORKER':<36} {'STATE':<10} {'LOAD':>9} {'BEAT':>9}  HOST"]
    for w in view["workers"]:
        load = f"{w['active']}/{w['concurrency']}" + (
            f"+{w['prefetched']}" if w["prefetched"] else "")
        lines.append(f"{w['id']:<36} {w['state']:<10} {load:>9}"
                     f" {duration(w['last_heartbeat_age']):>9}  {w['hostname']}")
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

