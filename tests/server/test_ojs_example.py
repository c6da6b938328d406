"""examples/ojs_worker.py, run unchanged as its own process, beside an SDK worker on /work:
both serve one queue of one versioned spec under load and every job runs exactly once; a
spec push gates both kinds until each is restarted declaring the new checksum."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, write_spec
from helpers import COSTLY_POLL, wait_until

from rota import Worker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ojs_worker.py"
QUEUE = "shared"


class Puller:
    """The example as a subprocess; what it prints goes to a file the test reads."""

    def __init__(self, live: Live, tmp: Path, name: str, checksum: str) -> None:
        self.name, self.out = name, tmp / f"{name}.out"
        env = {**os.environ, "OJS_URL": live.base, "OJS_QUEUES": QUEUE, "OJS_WORKER_ID": name,
               "OJS_SPECS": f"echo={checksum}", "OJS_COUNT": "10", "OJS_POLL": "0.05"}
        with self.out.open("w") as sink:
            self.proc = subprocess.Popen([sys.executable, str(EXAMPLE)], env=env,
                                         stdout=sink, stderr=subprocess.STDOUT)

    async def started(self, live: Live) -> None:
        """Once the server has seen its first FETCH (a SIGTERM before it has its signal
        handlers would just kill it)."""
        async def seen() -> bool:
            workers = (await live.http.get("/workers")).json()["workers"]
            return f"ojs:{self.name}" in {w["id"] for w in workers}

        await wait_until(seen, timeout=15, what=f"{self.name} fetching", step=COSTLY_POLL)

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def completed(self) -> list[str]:
        return [line.split()[1] for line in self.lines() if line.startswith("completed ")]

    def rejections(self) -> int:
        return sum(line.startswith("not the status quo") for line in self.lines())

    async def stop(self) -> None:
        """SIGTERM: the example finishes its job, gives back the rest and exits 0."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(self.proc.wait, 10) == 0, self.out.read_text()
        assert self.lines()[-1].endswith("stopped"), self.out.read_text()
        refused = [line for line in self.lines() if line.startswith("/workers/")]
        assert not refused, refused  # no ACK or heartbeat the server refused

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def pullers() -> Iterator[list[Puller]]:
    started: list[Puller] = []
    yield started
    for puller in started:
        puller.kill()


async def status_quo(live: Live) -> str:
    specs = (await live.http.get("/specs")).json()["specs"]
    return next(s["checksum"] for s in specs if s["name"] == "echo")


async def push_jobs(live: Live, count: int) -> list[str]:
    jobs = [{"type": "echo", "args": [{"n": n}], "options": {"queue": QUEUE}}
            for n in range(count)]
    reply = await live.http.post("/ojs/v1/jobs/batch", json={"jobs": jobs})
    assert reply.status_code == 201, reply.text
    return [job["id"] for job in reply.json()["jobs"]]


async def completed(live: Live) -> int:
    stats = (await live.http.get(f"/ojs/v1/queues/{QUEUE}/stats")).json()
    return stats["queue"]["completed"]


async def all_completed(live: Live, count: int, what: str) -> None:
    async def done() -> bool:
        return await completed(live) >= count

    await wait_until(done, timeout=30, what=what, step=COSTLY_POLL)


async def test_the_example_pull_worker_and_an_sdk_worker_share_a_queue_and_a_deploy(
        live: Live, tmp_path: Path, sdk_worker: Any, pullers: list[Puller]) -> None:
    await live.push(write_spec(tmp_path / "v1", "echo", queue=QUEUE))
    v1 = await status_quo(live)
    sdk_ran: list[str] = []

    def sdk(specs: Path) -> Worker:
        worker = Worker(specs_dir=specs, concurrency=10, heartbeat_interval=0.1)

        @worker.handler("echo")
        async def echo(ctx: Any) -> dict[str, Any]:
            sdk_ran.append(ctx.id)
            await asyncio.sleep(0.01)  # noqa: sleep-ok  (a handler's work, not a wait)
            return dict(ctx.args)

        return worker

    async def start(puller: Puller) -> None:
        pullers.append(puller)  # killed at the end whatever happens
        await puller.started(live)

    old_sdk = await sdk_worker(sdk(tmp_path / "v1"))
    await start(Puller(live, tmp_path, "puller-v1", v1))

    # Under load: a thousand jobs, each run exactly once, by one kind of worker or the other;
    # the pull worker stopped (SIGTERM) in the middle gives back what it has not started.
    load = await push_jobs(live, 1000)
    await wait_until(lambda: len(pullers[0].completed()) >= 20, timeout=30,
                     what="the pull worker's first 20 jobs")
    await pullers[0].stop()
    await all_completed(live, 1000, "the 1000 jobs completed")
    pulled = pullers[0].completed()
    assert sorted(sdk_ran + pulled) == sorted(load)  # none twice, none missing
    assert sdk_ran and pulled, (len(sdk_ran), len(pulled))

    # A deploy: echo v2 is the status quo; both workers still declare v1 and get none.
    await live.push(write_spec(tmp_path / "v2", "echo", version="2", queue=QUEUE))
    v2 = await status_quo(live)
    assert v2 != v1
    await start(Puller(live, tmp_path, "puller-still-v1", v1))
    gated = await push_jobs(live, 20)
    seen = pullers[1].rejections()
    await wait_until(lambda: pullers[1].rejections() >= seen + 2,  # a whole FETCH after the enqueue
                     what="two FETCHes refused echo's old checksum")
    workers = {w["id"]: w for w in (await live.http.get("/workers")).json()["workers"]}
    for worker_id in (old_sdk.worker_id, "ojs:puller-still-v1"):
        assert workers[worker_id]["specs_mismatching"] == ["echo"], workers[worker_id]
    waiting = (await live.http.get("/jobs", params={"queue": QUEUE, "state": "available"})
               ).json()["jobs"]
    assert sorted(job["id"] for job in waiting) == sorted(gated)
    assert pullers[1].completed() == [] and not set(gated) & set(sdk_ran)
    await pullers[1].stop()

    # The pull worker restarted with the new checksum runs them; the SDK worker, on v1 still,
    # runs none of them.
    await start(Puller(live, tmp_path, "puller-v2", v2))
    await all_completed(live, 1020, "the gated jobs run by the pull worker on v2")
    # (The example prints a job's line once its ACK is answered: after the server counts it.)
    await wait_until(lambda: len(pullers[2].completed()) >= len(gated),
                     what="the pull worker on v2 to print its last completions")
    assert sorted(pullers[2].completed()) == sorted(gated) and not set(gated) & set(sdk_ran)

    # The SDK worker restarted on the new spec file runs them too.
    old_sdk.stop()

    async def gone() -> bool:
        workers = (await live.http.get("/workers")).json()["workers"]
        return old_sdk.worker_id not in {w["id"] for w in workers}

    await wait_until(gone, what="the v1 SDK worker gone", step=COSTLY_POLL)
    before = len(sdk_ran)
    await sdk_worker(sdk(tmp_path / "v2"))
    later = await push_jobs(live, 200)
    await all_completed(live, 1220, "the jobs after the deploy")
    await pullers[2].stop()
    assert len(sdk_ran) > before
    everything = load + gated + later
    assert sorted(sdk_ran + pulled + pullers[2].completed()) == sorted(everything)
