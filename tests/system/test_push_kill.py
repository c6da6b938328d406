"""Push execution through a kill -9: a real `rota serve` delivers jobs of seven endpoint
classes (tests/endpoint_rig.py, a subprocess: succeeds after 500 ms, fails with 500, hangs
past its timeout, resets, redirects to another host, answers 429 with Retry-After,
answers 202 and calls back later), is killed with -9 while every class has jobs done and
jobs not done, and is restarted on the same SQLite file and port. Every job ends as its
class dictates, none is lost, none is completed twice, and the receiver saw each delivery
id at most once and one delivery id per (job, attempt).

Where the kill lands, class by class:
- ``ok`` runs ``max_in_flight`` at a time, each answer after 500 ms, so it lasts 15 s at
  least, however fast the machine: at the kill a share is done, some are in flight (cut:
  ``released`` at the restart, not counted, and sent again) and the rest wait.
- ``later``'s 202s call back after 0.3 to 9.3 s: some before the kill, any that fall in
  its downtime into the dead server (that attempt is released at the restart and sent
  again), the rest to the restarted one (which reclaims the job by the callback).
- The failing classes lean on the circuit breaker (rota/core/breaker.py), one per spec
  version (rota/core/endpoints.py: ``http:<spec>@<checksum>``) and in memory, so a restart
  closes it: 5 faults in 30 s pause an endpoint for 5 s, then it tries one delivery, and
  each failed trial doubles the pause. The four that retry (500, hang, reset, 429) have two
  attempts and ``max_in_flight`` as large as the class: their first attempts all go at
  once and fail, the breaker holds every retry, and its first trial (after 5 s) is a
  second attempt, the class's first discarded job. The kill then cuts the retries of all
  the others: the restarted server sends them all at once (its breaker closed) and
  discards them. ``moved`` (a redirect: no retry) sends half its jobs, then the breaker
  holds the rest (one trial per pause: rota/core/endpoints.py counts a trial still being
  reserved, else rounds run meanwhile sent one each) until the restart sends them all.
  More attempts, or a smaller ``max_in_flight``, would leave retries to the breaker's
  pauses (5 s, 10 s, 20 s...) for minutes.

The kill comes once each retrying class's breaker has tried (and discarded) one job, and
a quarter of ok and of later are done (ok and later start after those trials, so that
neither is over first on a loaded machine). The test reads the store right after the
kill and checks that every class had jobs final and jobs not final then, that ok and
later had jobs in flight, that the restarted server settled jobs of each class and
delivered jobs of each class but hang and later (see ``check_cut``), and that the
classes that retry had retries cross it.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from helpers import free_port, spawn_serve, wait_until
from test_deliverer import SECRET, Rig, running_rig

CUT = {"released", "visibility_timeout"}  # an attempt the kill cut (released: not counted)
# On a loaded machine (2 cores, shared) the rig may answer after the deadline (a soak run
# at a load of 13 saw the restarted server stall 11 s in its first burst): that attempt
# fails and a next one completes. A longer timeout would stretch the recovery of each
# attempt the kill cut by as much (its timeout after the restart); the failing classes,
# whose jobs wait on their breakers at the kill, take 30 s: an attempt of theirs timed
# out would be retried, a wave too many for the breaker.
LATE = {"timeout"}
FINAL = ("completed", "discarded")


class Kind(NamedTuple):
    path: str  # the rig's
    options: dict[str, Any]  # spec()'s: max_attempts, and timeout and visibility_timeout
    state: str  # every job's, at the end
    types: set[str]  # the error types its attempts may end with (besides CUT)


CLASSES: dict[str, Kind] = {
    "ok": Kind("/slow?ms=500", {"max_attempts": 5, "timeout": 10}, "completed", LATE),
    # (its visibility timeout outlasts the longest wait for a callback)
    "later": Kind("/accept?ms=300&jitter=9000",
                  {"max_attempts": 5, "timeout": 5, "visibility_timeout": 15},
                  "completed", LATE),
    "fail": Kind("/fail", {"max_attempts": 2}, "discarded", {"http_500"}),
    "reset": Kind("/reset", {"max_attempts": 2}, "discarded", {"connect"}),
    "busy": Kind("/429", {"max_attempts": 2}, "discarded", {"http_429"}),
    "moved": Kind("/redirect", {"max_attempts": 2}, "discarded", {"redirect"}),
    "hang": Kind("/hang", {"max_attempts": 2, "timeout": 1}, "discarded", {"timeout"}),
}
RETRYING = ("fail", "reset", "busy", "hang")  # (each retry crosses the restart)
WAVES = (*RETRYING[:3], "moved", "hang")  # first waves, one class after the other
COMPLETION = re.compile(r"(?:delivered|callback) job=(\S+) .*?attempt=(\d+)\b.*?"
                        r"outcome=completed")
SETTLED = re.compile(r"(?:delivered|callback) job=\S+ spec=(\w+)@")  # (its class)
Row = tuple[str, str, int, Any, list[dict[str, Any]]]  # spec, state, attempt, result, errors


def in_flight(name: str, count: int) -> int:
    """A class's ``max_in_flight``: ok about 15 s long; a retrying class all at once;
    moved half at a time (the restart sends the rest at once)."""
    return {"ok": max(2, count // 30), "later": 50, "moved": count // 2 + 1}.get(name, count)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with running_rig(tmp_path / "rig.log") as rig:
        yield rig


def spec(name: str, url: str, max_attempts: int, in_flight: int, timeout: float = 30,
         visibility_timeout: float = 5) -> dict[str, Any]:
    return {"name": name, "version": "1", "queue": name,
            "visibility_timeout": visibility_timeout,
            "retry": {"max_attempts": max_attempts, "backoff_base": 0.1, "backoff_max": 0.2},
            "execute": {"url": url, "secret": "main", "timeout": timeout,
                        "max_in_flight": in_flight}}


def rows(db: Path) -> dict[str, Row]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {i: (s, st, a, json.loads(r) if r else None, json.loads(e or "[]"))
                for i, s, st, a, r, e in
                conn.execute("SELECT id, spec, state, attempt, result, errors FROM jobs")}
    finally:
        conn.close()


def tally(found: dict[str, Row]) -> dict[str, Counter[str]]:
    """Per class: its jobs ``final``, ``open`` (not final), ``active`` (in flight, or
    accepted by a 202) and ``tried`` (not final, an attempt failed: a retry waits)."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for name, state, _, _, errors in found.values():
        counts[name]["final" if state in FINAL else "open"] += 1
        counts[name]["active"] += state == "active"
        counts[name]["tried"] += state not in FINAL and bool(errors)
    return counts


def answered(db: Path, name: str) -> int:
    """Jobs of a class final, or waiting after a failed attempt."""
    counts = tally(rows(db))[name]
    return counts["final"] + counts["tried"]


def completions_in(log: str) -> dict[str, list[int]]:
    """The attempts each job was logged completed at, in one server's log."""
    found: dict[str, list[int]] = defaultdict(list)
    for job_id, attempt in COMPLETION.findall(log):
        found[job_id].append(int(attempt))
    return found


class Serve:
    """`rota serve` on one port and SQLite file, killed with -9 and started again."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.port, self.db = tmp, free_port(), tmp / "rota.db"
        self.logs: list[Path] = []
        self.proc: asyncio.subprocess.Process | None = None
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    async def start(self) -> None:
        await self.http.aclose()  # no pooled connection to a dead process
        self.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=30)
        self.logs.append(self.tmp / f"serve-{len(self.logs) + 1}.log")
        self.proc = await spawn_serve(
            self.http, ["--port", str(self.port), "--db", str(self.db),
                        "--allow-private-endpoints", "--heartbeat-interval", "0.2",
                        "--heartbeat-timeout", "1", "--reconnect-grace", "1",
                        "--log-level", "info"], self.logs[-1],
            env={"ROTA_SECRET_MAIN": SECRET})

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()
        await self.http.aclose()

    async def resume(self, name: str) -> None:
        assert (await self.http.post(f"/queues/{name}/resume")).status_code == 200


class Run(NamedTuple):
    enqueued: dict[str, str]  # job id -> its class
    at_kill: dict[str, Row]  # the store right after the kill
    found: dict[str, Row]  # the store at the end
    logs: list[str]  # the two servers'
    seconds: tuple[float, float]  # from the first resume to the kill, and on to the end


async def enqueue(serve: Serve, rig: Rig, per_class: dict[str, int]) -> dict[str, str]:
    """The specs, their queues paused, and the jobs."""
    specs = [spec(name, rig.url(kind.path), in_flight=in_flight(name, per_class[name]),
                  **kind.options) for name, kind in CLASSES.items()]
    reply = await serve.http.put("/specs", json={"specs": specs})
    assert reply.status_code == 200, reply.text
    for name in per_class:
        assert (await serve.http.post(f"/queues/{name}/pause")).status_code == 200
    enqueued: dict[str, str] = {}
    batch = [{"spec": name, "args": {"n": n}} for name, count in per_class.items()
             for n in range(count)]
    for start in range(0, len(batch), 1000):
        part = batch[start:start + 1000]
        reply = await serve.http.post("/jobs/batch", json={"jobs": part})
        assert reply.status_code == 200, reply.text
        for said, asked in zip(reply.json()["results"], part, strict=True):
            assert said["status"] == 201, said
            enqueued[said["job"]["id"]] = asked["spec"]
    return enqueued


async def run(tmp: Path, rig: Rig, per_class: dict[str, int], timeout: float) -> Run:
    """Enqueue, send each failing class's first wave (one class after the other: ~2,000
    requests at once would overflow the rig's backlog); once each retrying class's
    breaker has tried one retry, send ok and later, and kill -9 once a quarter of each
    is done; restart; wait for every job."""
    serve = Serve(tmp)
    try:
        await serve.start()
        enqueued = await enqueue(serve, rig, per_class)
        began = time.monotonic()
        wave_done: dict[str, int] = {}  # jobs final after its first wave
        for name in WAVES:
            wave = per_class[name] if name in RETRYING else in_flight(name, per_class[name])
            await serve.resume(name)
            await wait_until(lambda name=name, wave=wave: answered(serve.db, name) >= wave,
                             timeout=timeout, what=f"{name}'s first wave to be answered",
                             step=0.05)
            wave_done[name] = tally(rows(serve.db))[name]["final"]
        await wait_until(lambda: all(tally(rows(serve.db))[name]["final"] > wave_done[name]
                                     for name in RETRYING), timeout=timeout,
                         what="the breakers' first trials", step=0.05)
        await serve.resume("ok")
        await serve.resume("later")
        await wait_until(lambda: all(tally(rows(serve.db))[name]["final"] >= per_class[name] / 4
                                     for name in ("ok", "later")), timeout=timeout,
                         what="a quarter of ok and later to complete", step=0.05)
        await serve.kill()
        killed = time.monotonic()
        at_kill = rows(serve.db)
        await serve.start()
        await wait_until(lambda: not any(c["open"] for c in tally(rows(serve.db)).values()),
                         timeout=timeout, what="every job to finish", step=0.2)
        ended = time.monotonic()
    finally:
        await serve.close()  # a graceful stop flushes the log's last burst
    return Run(enqueued, at_kill, rows(serve.db),
               [path.read_text() for path in serve.logs], (killed - began, ended - killed))


def check_ends(run: Run, per_class: dict[str, int]) -> None:
    """None lost, each ended as its class dictates."""
    assert set(run.found) == set(run.enqueued)
    by_class: Counter[tuple[str, str]] = Counter()
    for job_id, (name, state, attempt, result, errors) in run.found.items():
        kind = CLASSES[name]
        by_class[(name, state)] += 1
        assert state == kind.state, (job_id, name, state, errors)
        assert all(e["type"] in kind.types | CUT for e in errors), (job_id, name, errors)
        if kind.state == "completed":
            assert isinstance(result, dict) and result.get("echo") is not None, (job_id, result)
        else:
            assert errors and errors[-1]["type"] in kind.types, (job_id, errors)
            released = sum(e["type"] == "released" for e in errors)  # (not counted)
            assert attempt - released <= kind.options["max_attempts"], (job_id, errors)
    assert by_class == Counter({(n, CLASSES[n].state): c for n, c in per_class.items()})


def check_cut(run: Run, rig_lines: list[dict[str, Any]]) -> dict[str, Counter[str]]:
    """The kill cut every class: jobs done and not done at it, ok and later had jobs in
    flight, the retrying classes had retries waiting (each one's last failure is the
    restarted server's), and every class had deliveries after the restart."""
    at_kill = tally(run.at_kill)
    for name in CLASSES:
        assert at_kill[name]["final"] and at_kill[name]["open"], (name, at_kill[name])
    for name in ("ok", "later"):
        assert at_kill[name]["active"], (name, at_kill[name])
    for name in RETRYING:
        assert at_kill[name]["tried"], (name, at_kill[name])
        crossed = [j for j, row in run.at_kill.items() if row[0] == name
                   and row[1] not in FINAL and row[4]]
        assert all(len(run.found[j][4]) > len(run.at_kill[j][4]) for j in crossed), name
    # The restarted server answered deliveries of every class, and the rig heard them:
    # the first server committed each attempt before sending it, so one beyond the
    # store's at the kill is the restarted server's. (A hang's request may be given up
    # at its 1 s timeout before the rig reads it, on a loaded machine every one. Later's
    # jobs may all have been sent before the kill, a quarter of them done and the rest
    # waiting for their callbacks: then, if no callback fell into the dead server, the
    # restarted one settles each by its callback, which ``settled`` counts, and sends
    # none again. Seen once in a full suite run on 2 cores.)
    settled = Counter(SETTLED.findall(run.logs[1]))
    assert set(settled) == set(CLASSES), settled
    path = {CLASSES[name].path.partition("?")[0]: name for name in CLASSES}
    heard = Counter(path[line["path"]] for line in rig_lines
                    if int(line["attempt"]) > run.at_kill[line["job_id"]][2])
    assert set(heard) >= set(CLASSES) - {"hang", "later"}, heard
    return at_kill


def check_once(run: Run) -> None:
    """No job completed twice. The first server's log may lack its last lines (INFO lines
    are written in bursts, rota/cli/logsetup.py), so the store at the kill says which jobs
    it completed: the second server completes none of those again, and each of the rest
    once (ok's and later's among them); a completion the first server logged but the
    kill cut before its commit is followed by a later attempt's."""
    first, second = (completions_in(text) for text in run.logs)
    assert not {j: a for j, a in first.items() if len(a) != len(set(a))}
    done_at_kill = {j for j, row in run.at_kill.items() if row[1] == "completed"}
    assert not done_at_kill & set(second), sorted(done_at_kill & set(second))[:3]
    for job_id, (name, state, attempt, *_) in run.found.items():
        if state == "completed" and job_id not in done_at_kill:
            assert second.get(job_id) == [attempt], (job_id, second.get(job_id), attempt)
    assert {run.found[j][0] for j in second} == {"ok", "later"}
    cut = {j for j in first if j not in done_at_kill}
    assert all(run.found[j][2] > max(first[j]) for j in cut), cut


def check_receiver(run: Run, lines: list[dict[str, Any]]) -> int:
    """Each delivery id once, one delivery per (job, attempt), ours only. A request cut
    while it was being sent (by the kill, or a sender that gave up at its timeout) arrives
    short, and its signature fails, as it should; every whole one is signed, and only an
    attempt that ended cut or timed out was cut. Returns how many arrived short."""
    ids = Counter(line["delivery_id"] for line in lines)
    assert max(ids.values()) == 1, ids.most_common(3)
    per_attempt = Counter((line["job_id"], line["attempt"]) for line in lines)
    assert max(per_attempt.values()) == 1, per_attempt.most_common(3)
    assert {line["job_id"] for line in lines} <= set(run.enqueued)
    assert all(line["signed"] for line in lines if line["whole"])
    ended = {(j, str(e["attempt"])) for j, row in run.found.items() for e in row[4]
             if e["type"] in CUT | {"timeout"}}
    short = {(line["job_id"], line["attempt"]) for line in lines if not line["whole"]}
    assert short <= ended, short - ended
    return len(short)


async def chaos(tmp: Path, rig: Rig, per_class: dict[str, int], timeout: float) -> None:
    result = await run(tmp, rig, per_class, timeout)
    lines = [line for line in rig.lines() if line["path"] != "callback"]
    check_ends(result, per_class)
    at_kill = check_cut(result, lines)
    check_once(result)
    short = check_receiver(result, lines)
    cut = Counter(result.found[j][0] for j in result.found for e in result.found[j][4]
                  if e["type"] in CUT)
    print(f"\n{len(result.enqueued)} jobs; kill after {result.seconds[0]:.1f} s, all final"
          f" {result.seconds[1]:.1f} s later; deliveries {len(lines)} ({short} cut short);"
          f" at the kill (final/open/in flight/retry waiting): " + ", ".join(
              f"{n} {c['final']}/{c['open']}/{c['active']}/{c['tried']}"
              for n, c in at_kill.items()) + f"; attempts cut, by class: {dict(cut)}")


async def test_push_jobs_survive_a_kill_9(tmp_path: Path, rig: Rig) -> None:
    counts = {"ok": 120, "later": 60, "fail": 24, "hang": 24, "reset": 24, "moved": 24,
              "busy": 24}
    await chaos(tmp_path, rig, counts, timeout=40)


@pytest.mark.soak
@pytest.mark.timeout(600)
async def test_5000_push_jobs_survive_a_kill_9(tmp_path: Path, rig: Rig) -> None:
    counts = {"ok": 2000, "later": 1000, "fail": 400, "hang": 400, "reset": 400,
              "moved": 400, "busy": 400}
    await chaos(tmp_path, rig, counts, timeout=400)
