"""Push execution through a kill -9: a real `rota serve` delivers jobs of seven endpoint
classes (tests/endpoint_rig.py, a subprocess: succeeds, fails with 500, hangs past its
timeout, resets, redirects to another host, answers 429 with Retry-After, answers 202 and
calls back later), is killed with -9 midway and restarted on the same SQLite file and
port. Every job ends as its class dictates, none is lost, none is completed twice, and
the receiver saw each delivery id at most once and one delivery id per (job, attempt).

The failing classes run one attempt each, all in flight at once: an endpoint that keeps
failing is paused by its circuit breaker (5 faults in 30 s), after which its retries go
one per pause (5 s, 10 s, 20 s...), so a class of hundreds of retrying jobs would take
hours. Retries with Retry-After are tests/server/test_push.py's. An attempt cut by the
kill ends as the restart finds it (``released``, not counted, or ``visibility_timeout`` for a
202 whose callback never came) and, where attempts remain, runs again.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import free_port, spawn_serve, wait_until
from test_deliverer import SECRET, Rig, running_rig

# class -> (rig path, [execute] and [retry] of its spec, final state, error types)
CUT = {"released", "visibility_timeout"}  # an attempt the kill cut (released: not counted)
# On a loaded machine (2 cores, shared) the rig may answer after the 5 s deadline: that
# attempt fails and the next completes (a longer timeout would stretch each cut attempt's
# recovery after the restart by as much).
LATE = {"timeout"}
CLASSES: dict[str, tuple[str, dict[str, Any], str, set[str]]] = {
    "ok": ("/ok", {"max_attempts": 3}, "completed", LATE),
    "later": ("/accept?ms=300", {"max_attempts": 3}, "completed", LATE),
    "fail": ("/fail", {"max_attempts": 1}, "discarded", {"http_500"}),
    "hang": ("/hang", {"max_attempts": 1, "timeout": 2}, "discarded", {"timeout"}),
    "reset": ("/reset", {"max_attempts": 1}, "discarded", {"connect"}),
    "moved": ("/redirect", {"max_attempts": 1}, "discarded", {"redirect"}),
    "busy": ("/429", {"max_attempts": 1}, "discarded", {"http_429"}),
}
# Run before the others, one after the other (the rest, and hang's 2 s timeout, run
# through the kill), each in one wave (in flight all at once: the breaker would pause
# its retries, and a class's later jobs, for minutes).
WAVES = ("fail", "reset", "moved", "busy")
COMPLETION = re.compile(r"(?:delivered|callback) job=(\S+) .*?attempt=(\d+)\b.*?"
                        r"outcome=completed")


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    with running_rig(tmp_path / "rig.log") as rig:
        yield rig


def spec(name: str, url: str, max_attempts: int, timeout: float = 5,
         in_flight: int = 50) -> dict[str, Any]:
    return {"name": name, "version": "1", "queue": name, "visibility_timeout": 5,
            "retry": {"max_attempts": max_attempts, "backoff_base": 0.1, "backoff_max": 0.2},
            "execute": {"url": url, "secret": "main", "timeout": timeout,
                        "max_in_flight": in_flight}}


def finished(db: Path, names: Iterable[str]) -> int:
    """Jobs of these specs completed or discarded."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return sum(n for spec, n in conn.execute(
            "SELECT spec, count(*) FROM jobs WHERE state IN ('completed', 'discarded')"
            " GROUP BY spec") if spec in set(names))
    finally:
        conn.close()


def rows(db: Path) -> dict[str, tuple[str, str, int, Any, list[dict[str, Any]]]]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {i: (s, st, a, json.loads(r) if r else None, json.loads(e or "[]"))
                for i, s, st, a, r, e in
                conn.execute("SELECT id, spec, state, attempt, result, errors FROM jobs")}
    finally:
        conn.close()


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


async def chaos(tmp: Path, rig: Rig, per_class: dict[str, int], timeout: float) -> None:
    """Enqueue ``per_class`` jobs (each class in a queue of its own, paused), run each
    failing class of WAVES in one wave, then the rest; kill -9 the server once half of
    those are final, restart it, wait for every job, then check the store, the server's
    logs and the rig's log."""
    serve = Serve(tmp)
    try:
        await serve.start()
        specs = [spec(name, rig.url(path), in_flight=50 if name in ("ok", "later")
                      else max(1, per_class[name]), **options)
                 for name, (path, options, _, _) in CLASSES.items()]
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
        total = len(batch)
        for name in WAVES:  # one class at a time: each all in flight at once
            assert (await serve.http.post(f"/queues/{name}/resume")).status_code == 200
            await wait_until(lambda: finished(serve.db, [name]) >= per_class[name],
                             timeout=timeout, what=f"the {name} jobs to finish", step=0.05)
        rest = [name for name in per_class if name not in WAVES]
        for name in rest:
            assert (await serve.http.post(f"/queues/{name}/resume")).status_code == 200
        half = sum(per_class[name] for name in rest) // 2
        await wait_until(lambda: finished(serve.db, rest) >= half, timeout=timeout,
                         what="half the rest to finish", step=0.05)
        await serve.kill()
        at_kill = rows(serve.db)
        await serve.start()
        await wait_until(lambda: finished(serve.db, per_class) >= total,
                         timeout=timeout, what="every job to finish", step=0.2)
    finally:
        await serve.close()  # a graceful stop flushes the log's last burst
    logs = [path.read_text() for path in serve.logs]

    # None lost, each ended as its class dictates.
    found = rows(serve.db)
    assert set(found) == set(enqueued)
    by_class: Counter[tuple[str, str]] = Counter()
    for job_id, (name, state, attempt, result, errors) in found.items():
        _, options, want, types = CLASSES[name]
        by_class[(name, state)] += 1
        assert state == want, (job_id, name, state, errors)
        assert all(e["type"] in types | CUT for e in errors), (job_id, name, errors)
        if want == "completed":
            assert isinstance(result, dict) and "echo" in result, (job_id, result)
        else:
            assert errors and errors[-1]["type"] in types | CUT, (job_id, errors)
            released = sum(e["type"] == "released" for e in errors)  # (not counted)
            assert attempt - released <= options["max_attempts"] or errors[-1]["type"] in CUT
    assert by_class == Counter({(n, CLASSES[n][2]): c for n, c in per_class.items()})

    # No job completed twice. The first server's log may lack its last lines (INFO lines
    # are written in bursts, rota/cli/logsetup.py), so the store at the kill says which
    # jobs it completed: the second server completes none of those again, and each of the
    # rest once; a completion the first server logged but the kill cut before its commit
    # is followed by a later attempt's.
    first, second = (completions_in(text) for text in logs)
    assert not {j: a for j, a in first.items() if len(a) != len(set(a))}
    done_at_kill = {j for j, row in at_kill.items() if row[1] == "completed"}
    assert not done_at_kill & set(second), sorted(done_at_kill & set(second))[:3]
    for job_id, (name, state, attempt, *_) in found.items():
        if state == "completed" and job_id not in done_at_kill:
            assert second.get(job_id) == [attempt], (job_id, second.get(job_id), attempt)
    cut = {j for j in first if j not in done_at_kill}
    assert all(found[j][2] > max(first[j]) for j in cut), cut

    # The receiver: each delivery id once, one delivery per (job, attempt), ours only.
    lines = [line for line in rig.lines() if line["path"] != "callback"]
    ids = Counter(line["delivery_id"] for line in lines)
    assert max(ids.values()) == 1, ids.most_common(3)
    per_attempt = Counter((line["job_id"], line["attempt"]) for line in lines)
    assert max(per_attempt.values()) == 1, per_attempt.most_common(3)
    assert {line["job_id"] for line in lines} <= set(enqueued)
    # A request cut while it was being sent (by the kill, or a sender that gave up at its
    # timeout) arrives short, and its signature fails, as it should; every whole one is
    # signed, and only an attempt that ended cut or timed out was cut.
    assert all(line["signed"] for line in lines if line["whole"])
    ended = {(j, str(e["attempt"])) for j, row in found.items() for e in row[4]
             if e["type"] in CUT | {"timeout"}}
    short = {(line["job_id"], line["attempt"]) for line in lines if not line["whole"]}
    assert short <= ended, short - ended
    final = ("completed", "discarded")
    print(f"\n{total} jobs; final at the kill {sum(r[1] in final for r in at_kill.values())},"
          f" completed {len(done_at_kill)}; deliveries {len(lines)} ({len(short)} cut short);"
          f" completions logged"
          f" and cut by the kill: {len(cut)}; attempts cut, by class:"
          f" {dict(Counter(found[j][0] for j in found for e in found[j][4] if e['type'] in CUT))}")


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
