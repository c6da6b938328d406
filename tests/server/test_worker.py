"""The worker SDK against a real server: handlers, results, errors, concurrency, spec checks."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import Live, wait_until, write_spec

from rota import JobContext, Worker
from rota.base.errors import RegistrationRefused
from rota.base.specs import SpecError, checksum


class Flaky(Exception):
    retryable = False


def make_worker(specs_dir: Path, **options) -> Worker:
    return Worker(specs_dir=specs_dir, heartbeat_interval=0.2, **options)


async def test_async_and_sync_handlers_run_and_report(live: Live, sdk_worker, tmp_path: Path):
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "add"), write_spec(specs, "shout"),
                    write_spec(specs, "explode"))
    worker = make_worker(specs)
    threads: list[str] = []

    @worker.handler("add")
    async def add(ctx: JobContext) -> int:
        return ctx.args["a"] + ctx.args["b"]

    @worker.handler("shout")
    def shout(ctx: JobContext) -> str:
        threads.append(threading.current_thread().name)
        return f"{ctx.args['word'].upper()} (attempt {ctx.attempt}, job {ctx.id})"

    @worker.handler("explode")
    async def explode(ctx: JobContext) -> None:
        raise Flaky("the widget melted")

    added = await live.enqueue("add", {"a": 2, "b": 3})
    shouted = await live.enqueue("shout", {"word": "hi"})
    exploded = await live.enqueue("explode")
    await sdk_worker(worker)
    assert (await live.wait_state(added["id"], "completed"))["result"] == 5
    shout_job = await live.wait_state(shouted["id"], "completed")
    assert shout_job["result"] == f"HI (attempt 1, job {shouted['id']})"
    assert threads and threads[0].startswith("rota-job")  # sync handlers run off the loop
    [error] = (await live.wait_state(exploded["id"], "discarded"))["errors"]
    assert error["type"] == "Flaky" and error["message"] == "the widget melted"
    assert error["retryable"] is False
    assert "the widget melted" in error["details"]["traceback"]


async def test_unserializable_result_is_reported_as_failure(live: Live, sdk_worker,
                                                            tmp_path: Path):
    await live.push(write_spec(tmp_path, "odd", extra="[retry]\nmax_attempts = 1\n"))
    worker = make_worker(tmp_path)

    @worker.handler("odd")
    async def odd(ctx: JobContext) -> object:
        return object()

    job = await live.enqueue("odd")
    await sdk_worker(worker)
    [error] = (await live.wait_state(job["id"], "discarded"))["errors"]
    assert error["type"] == "TypeError"


async def test_sdk_never_runs_more_than_its_concurrency(live: Live, sdk_worker, tmp_path: Path):
    await live.push(write_spec(tmp_path, "slow"))
    worker = make_worker(tmp_path, concurrency=2, prefetch=0)  # as before prefetch
    release = asyncio.Event()
    running = 0
    peak = 0

    @worker.handler("slow")
    async def slow(ctx: JobContext) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await release.wait()
        running -= 1

    jobs = [await live.enqueue("slow") for _ in range(6)]
    await sdk_worker(worker)
    await wait_until(lambda: running == 2, what="two jobs running")
    queues = (await live.http.get("/queues")).json()["queues"]
    assert queues[0]["counts"]["active"] == 2 and queues[0]["counts"]["available"] == 4
    assert "full" in queues[0]["waiting"][0]["reason"]
    release.set()
    for job in jobs:
        await live.wait_state(job["id"], "completed")
    assert peak == 2


async def test_worker_declares_the_checksums_of_its_spec_files(live: Live, sdk_worker,
                                                              tmp_path: Path):
    current = write_spec(tmp_path / "deployed", "echo", version="2")
    stale = write_spec(tmp_path / "stale", "echo", version="1")
    await live.push(current)
    old = make_worker(tmp_path / "stale")
    new = make_worker(tmp_path / "deployed")
    for worker in (old, new):
        worker.handler("echo")(lambda ctx: "from " + ctx.worker_id)
    assert old.declared_specs()[0].checksum == checksum(stale)
    await sdk_worker(old)
    assert old.welcome is not None and old.welcome.specs.rejected[0].expected == checksum(current)
    job = await live.enqueue("echo")
    reason = (await live.job(job["id"]))["waiting_reason"]
    assert "another checksum" in reason
    await sdk_worker(new)
    done = await live.wait_state(job["id"], "completed")
    assert done["result"] == "from " + new.worker_id


async def test_a_handler_without_a_spec_file_is_refused(tmp_path: Path):
    write_spec(tmp_path, "echo")
    worker = make_worker(tmp_path)
    worker.handler("echo")(lambda ctx: None)
    worker.handler("ghost")(lambda ctx: None)
    with pytest.raises(SpecError, match="ghost"):
        await worker.run()
    with pytest.raises(ValueError, match="already has a handler"):
        worker.handler("echo")(lambda ctx: None)


async def test_a_result_too_large_to_send_fails_the_job_for_good(live, sdk_worker, tmp_path):
    await live.push(write_spec(tmp_path, "huge"))
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)
    worker.handler("huge")(lambda ctx: "x" * (1 << 20))  # over what one frame can carry
    await sdk_worker(worker)
    job = await live.enqueue("huge")
    done = await live.wait_state(job["id"], "discarded")
    [error] = done["errors"]
    assert (error["type"], error["retryable"]) == ("result_too_large", False)
    assert live.coordinator.connections  # the worker's connection was never at risk


async def test_a_result_too_deep_to_send_fails_the_job_for_good(live, sdk_worker, tmp_path):
    await live.push(write_spec(tmp_path, "deep"))
    worker = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)

    def nest(ctx: JobContext) -> Any:
        value: Any = 1
        for _ in range(ctx.args["depth"]):
            value = [value]
        return value

    worker.handler("deep")(nest)
    await sdk_worker(worker)
    fits = await live.enqueue("deep", {"depth": 61})  # the most a heartbeat can carry
    deep = await live.enqueue("deep", {"depth": 62})
    done = await live.wait_state(deep["id"], "discarded")
    [error] = done["errors"]
    assert (error["type"], error["retryable"]) == ("result_too_deep", False)
    assert (await live.wait_state(fits["id"], "completed"))["attempt"] == 1
    assert live.coordinator.connections  # the connection was never closed for it


@pytest.mark.parametrize(("option", "message"), [
    ({"concurrency": 0}, "concurrency must be at least 1"),
    ({"max_abandoned_threads": 0}, "max_abandoned_threads must be at least 1")])
def test_worker_options_out_of_range_are_refused(tmp_path: Path, option, message):
    with pytest.raises(ValueError, match=message):
        Worker(specs_dir=tmp_path, **option)


@pytest.mark.parametrize("bad", [-1, 1001, 2.5, True, "x"])
def test_a_prefetch_that_is_not_a_whole_number_in_range_is_refused_at_once(tmp_path, bad):
    with pytest.raises(ValueError, match="prefetch must be a whole number"):
        make_worker(tmp_path, prefetch=bad)
    worker = make_worker(tmp_path, prefetch=0)
    with pytest.raises(ValueError, match="prefetch must be a whole number"):
        worker.prefetch = bad


NAME_RULE = "must be a name of 1 to 128 letters, digits and '_.:-', starting with a letter or digit"


def test_labels_the_server_would_refuse_are_refused_when_the_worker_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"labels must be a list of names, not the string 'gpu'"):
        make_worker(tmp_path, labels="gpu")  # not ['g', 'p', 'u']
    with pytest.raises(ValueError, match=re.escape(f"labels[1] {NAME_RULE}, got 'gpu,eu'")):
        make_worker(tmp_path, labels=["ok", "gpu,eu"])
    with pytest.raises(ValueError, match=r"queues must be a list of names, not the string"):
        make_worker(tmp_path, queues="mail")  # not ['m', 'a', 'i', 'l']
    worker = make_worker(tmp_path, labels=["gpu"])
    with pytest.raises(ValueError, match=re.escape(f"labels[0] {NAME_RULE}, got 'a b'")):
        worker.configure(labels=["a b"])
    assert worker.labels == ["gpu"]


async def test_a_registration_refused_as_invalid_stops_the_worker(live: Live, tmp_path):
    """A retry would send the same registration: the worker stops, saying why, instead
    of reconnecting for ever."""
    await live.push(write_spec(tmp_path, "echo"))
    worker = make_worker(tmp_path, url=live.ws)
    worker.handler("echo")(lambda ctx: None)
    worker.labels = ["no spaces"]  # past the SDK's own check: as a newer rule would be
    with pytest.raises(RegistrationRefused) as refused:
        await asyncio.wait_for(worker.run(), 20)
    assert str(refused.value) == (f"{worker.server_url} refused this worker's registration:"
                                  f" registration.labels[0] {NAME_RULE}")


async def test_get_workers_shows_the_idle_beats_lean_acks_left_unanswered(
        live: Live, sdk_worker, tmp_path: Path):
    # The SDK registers lean acks; beating every 0.1 s against a 2 s timeout, most idle
    # beats fall within the 0.5 s window and get no ack (docs/protocol.md §4.2).
    await live.push(write_spec(tmp_path, "echo"))
    idle = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)
    idle.handler("echo")(lambda ctx: None)
    worker = await sdk_worker(idle)

    async def shown() -> dict[str, Any]:
        return next(w for w in (await live.http.get("/workers")).json()["workers"]
                    if w["id"] == worker.worker_id)

    async def skipped() -> bool:
        return (await shown())["acks_skipped"] >= 5

    await wait_until(skipped, what="five idle beats left unanswered")
    view = await shown()
    assert view["lean_acks"] is True and view["acks_skipped"] < view["heartbeats"]


async def test_an_idle_sdk_worker_gets_one_ack_per_idle_ack_interval(live: Live, sdk_worker,
                                                                    tmp_path: Path):
    # Sparse acks (docs/protocol.md §4.2): the SDK asks for 10 s while it holds no job, so
    # after its registration's ack 30 beats 0.1 s apart get none, and the worker, which
    # judges the server by that interval, neither pings nor reconnects meanwhile; a job
    # still runs at once and is acked at once.
    await live.push(write_spec(tmp_path, "echo"))
    idle = Worker(specs_dir=tmp_path, heartbeat_interval=0.1)
    idle.handler("echo")(lambda ctx: ctx.args)
    worker = await sdk_worker(idle)
    assert worker.link.welcome is not None and worker.link.welcome.idle_ack_interval == 10.0

    async def shown() -> dict[str, Any]:
        return next(w for w in (await live.http.get("/workers")).json()["workers"]
                    if w["id"] == worker.worker_id)

    async def beaten() -> bool:
        return (await shown())["heartbeats"] >= 30

    first = (await shown())["connected_at"]
    await wait_until(beaten, what="30 heartbeats")
    view = await shown()
    assert view["acks_skipped"] == view["heartbeats"] - 1  # all but the registration's
    assert view["idle_ack_interval"] == 10.0
    assert view["connected_at"] == first  # the same connection throughout
    job = await live.enqueue("echo", {"message": "hi"})
    done = await live.wait_state(job["id"], "completed", timeout=10)
    assert done["result"] == {"message": "hi"}
