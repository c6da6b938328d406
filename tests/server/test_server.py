"""The running server over its real protocol: registration, push, matching, limits, results."""

from __future__ import annotations

import asyncio
from pathlib import Path

from conftest import Live, start_server, stop_server, write_spec
from helpers import RawWorker, wait_until

from rota.base.specs import checksum

# The server's scenarios run on SQLite; what they rely on the store for runs on both
# backends in tests/store/test_store_contract.py.


async def test_registration_gets_welcome_with_spec_verdicts(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path / "specs", "echo")
    old = write_spec(tmp_path / "old", "resize", version="1")
    await live.push(echo, write_spec(tmp_path / "specs", "resize", version="2"))
    worker = await connect("w-reg")
    welcome = await worker.register([echo, old],
                                    declared={"unknown_spec": "sha256:" + "0" * 64})
    assert welcome["worker_id"] == "w-reg"
    assert welcome["heartbeat_interval"] == live.settings.heartbeat_interval
    assert welcome["heartbeat_timeout"] == live.settings.heartbeat_timeout
    assert welcome["visibility_timeout"] == 1800.0
    assert welcome["specs"]["accepted"] == ["echo"]
    rejected = {r["name"]: r for r in welcome["specs"]["rejected"]}
    assert rejected["resize"]["expected"] == live.coordinator.scheduler.status_quo["resize"]
    assert rejected["resize"]["checksum"] == checksum(old)
    assert rejected["unknown_spec"]["expected"] is None
    assert "no status quo" in rejected["unknown_spec"]["reason"]
    workers = (await live.http.get("/workers")).json()["workers"]
    assert [(w["id"], w["specs_matching"], w["specs_mismatching"]) for w in workers] == [
        ("w-reg", ["echo"], ["resize", "unknown_spec"])]


async def test_enqueue_is_pushed_to_a_waiting_worker(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    worker = await connect()
    await worker.register([echo])
    job = await live.enqueue("echo", {"message": "hi"})
    [copy] = await worker.jobs(1)
    assert copy["id"] == job["id"]
    assert copy["args"] == {"message": "hi"}
    assert copy["attempt"] == 1
    assert copy["checksum"] == checksum(echo)
    stored = await live.job(job["id"])
    assert stored["state"] == "active" and stored["worker_id"] == "w1"
    assert stored["checksum"] == checksum(echo)


async def test_mismatching_checksum_gets_nothing_matching_worker_gets_job(
        live: Live, connect, tmp_path: Path):
    current = write_spec(tmp_path / "new", "echo", version="2")
    stale = write_spec(tmp_path / "old", "echo", version="1")
    await live.push(current)
    old_worker = await connect("old")
    await old_worker.register([stale])
    job = await live.enqueue("echo")
    reason = (await live.job(job["id"]))["waiting_reason"]
    assert "declare another checksum" in reason
    await old_worker.assert_no_assign()
    new_worker = await connect("new")
    await new_worker.register([current])
    [copy] = await new_worker.jobs(1)
    assert copy["id"] == job["id"]
    await old_worker.assert_no_assign(within=0.1)


async def test_partial_match_gets_only_matching_specs(live: Live, connect, tmp_path: Path):
    a = write_spec(tmp_path / "now", "alpha")
    b = write_spec(tmp_path / "now", "beta", version="2")
    b_old = write_spec(tmp_path / "old", "beta", version="1")
    await live.push(a, b)
    worker = await connect()
    welcome = await worker.register([a, b_old])
    assert welcome["specs"]["accepted"] == ["alpha"]
    beta_job = await live.enqueue("beta")
    alpha_job = await live.enqueue("alpha")
    [copy] = await worker.jobs(1)
    assert copy["id"] == alpha_job["id"]
    await worker.assert_no_assign()
    assert (await live.job(beta_job["id"]))["state"] == "available"


async def test_status_quo_change_reroutes_queued_jobs(live: Live, connect, tmp_path: Path):
    v1 = write_spec(tmp_path / "v1", "echo", version="1")
    v2 = write_spec(tmp_path / "v2", "echo", version="2")
    await live.push(v1)
    old = await connect("old")
    await old.register([v1], capacity=0)  # busy: takes nothing for now
    new = await connect("new")
    await new.register([v2])
    jobs = [await live.enqueue("echo") for _ in range(3)]
    await new.assert_no_assign(within=0.2)
    report = await live.push(v2)
    assert report["specs"][0]["change"] == "changed"
    assert report["specs"][0]["mismatched_workers"] == 1
    assert report["specs"][0]["matching_workers"] == 1
    copies = await new.jobs(3)
    assert sorted(c["id"] for c in copies) == sorted(j["id"] for j in jobs)
    assert {c["checksum"] for c in copies} == {checksum(v2)}
    await old.beat(capacity=5)
    await old.expect("ack")
    await old.assert_no_assign(within=0.2)


async def test_concurrency_caps_claimed_capacity(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    for _ in range(5):
        await live.enqueue("echo")
    worker = await connect()
    await worker.register([echo], concurrency=2, capacity=100)
    first = await worker.jobs(2)
    await worker.beat(capacity=100)  # claiming more changes nothing while it holds 2
    await worker.expect("ack")
    await worker.assert_no_assign()
    ack = await worker.complete(first[0], capacity=100)
    assert ack["accepted"] == [first[0]["id"]]
    [third] = await worker.jobs(1)
    assert third["id"] not in {c["id"] for c in first}
    await worker.assert_no_assign(within=0.2)
    assert len(live.coordinator.scheduler.workers["w1"].active) == 2


async def test_queue_order_then_priority_order(live: Live, connect, tmp_path: Path):
    low = write_spec(tmp_path, "bulk_job", queue="bulk")
    high = write_spec(tmp_path, "urgent_job", queue="urgent")
    await live.push(low, high)
    bulk = [await live.enqueue("bulk_job", priority=100)]
    urgent = [await live.enqueue("urgent_job", priority=p) for p in (0, 5, 0, 9)]
    worker = await connect()
    await worker.register([low, high], queues=["urgent", "bulk"], concurrency=1)
    order = []
    for _ in range(5):
        [copy] = await worker.jobs(1)
        order.append(copy["id"])
        await worker.complete(copy, capacity=1)
    expected = [urgent[3]["id"], urgent[1]["id"], urgent[0]["id"], urgent[2]["id"], bulk[0]["id"]]
    assert order == expected


async def test_results_are_stored_and_readable(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    worker = await connect()
    await worker.register([echo])
    ok, bad = await live.enqueue("echo"), await live.enqueue("echo")
    copies = {c["id"]: c for c in await worker.jobs(2)}
    await worker.beat(results=[
        {"job_id": ok["id"], "attempt": 1, "outcome": "completed", "result": {"n": 42}},
        {"job_id": bad["id"], "attempt": copies[bad["id"]]["attempt"], "outcome": "failed",
         "error": {"type": "ValueError", "message": "bad input", "retryable": False,
                   "details": {"line": 3}}},
    ])
    ack = await worker.expect("ack")
    assert sorted(ack["accepted"]) == sorted([ok["id"], bad["id"]])
    result = (await live.http.get(f"/jobs/{ok['id']}/result")).json()
    assert result == {"id": ok["id"], "state": "completed", "done": True,
                      "result": {"n": 42}, "error": None}
    failed = await live.job(bad["id"])
    assert failed["state"] == "discarded"  # retryable: false
    [error] = failed["errors"]
    assert (error["type"], error["message"], error["retryable"]) == ("ValueError", "bad input", False)
    assert error["details"] == {"line": 3} and error["worker_id"] == "w1" and error["attempt"] == 1


async def test_result_long_poll_returns_when_the_job_finishes(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    job = await live.enqueue("echo")
    pending = await live.http.get(f"/jobs/{job['id']}/result", params={"wait": 0})
    assert pending.status_code == 202 and pending.json()["done"] is False
    poll = asyncio.create_task(live.http.get(f"/jobs/{job['id']}/result", params={"wait": 10}))
    worker = await connect()
    await worker.register([echo])
    [copy] = await worker.jobs(1)
    await worker.complete(copy, result="done")
    response = await asyncio.wait_for(poll, timeout=5)
    assert response.status_code == 200 and response.json()["result"] == "done"


async def test_results_from_the_wrong_worker_or_attempt_are_rejected(
        live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    owner, other = await connect("owner"), await connect("other")
    await owner.register([echo], concurrency=1)
    job = await live.enqueue("echo")
    [copy] = await owner.jobs(1)
    await other.register([echo], capacity=0)
    ack = await other.complete(copy, result="stolen")
    assert ack["rejected"] == [{"job_id": copy["id"], "attempt": 1,
                                "reason": "job is not reserved by this worker"}]
    await owner.beat(results=[{"job_id": copy["id"], "attempt": 7, "outcome": "completed"}])
    ack = await owner.expect("ack")
    assert "not the current attempt" in ack["rejected"][0]["reason"]
    await owner.beat(results=[{"job_id": "no-such-job", "attempt": 1, "outcome": "completed"}])
    assert "unknown job" in (await owner.expect("ack"))["rejected"][0]["reason"]
    assert (await live.job(job["id"]))["state"] == "active"
    ack = await owner.complete(copy, result="mine")
    assert ack["accepted"] == [job["id"]]
    assert (await live.job(job["id"]))["result"] == "mine"


async def test_disconnected_workers_jobs_go_to_another_worker(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    first = await connect("first")
    await first.register([echo])
    job = await live.enqueue("echo")
    await first.jobs(1)
    second = await connect("second")
    await second.register([echo])
    await first.ws.close()
    [copy] = await second.jobs(1)
    assert copy["id"] == job["id"] and copy["attempt"] == 2
    stored = await live.job(job["id"])
    assert stored["worker_id"] == "second" and stored["attempt"] == 2


async def test_silent_worker_is_dropped_and_its_jobs_requeued(tmp_path: Path):
    live = await start_server(tmp_path, heartbeat_timeout=0.5)
    try:
        echo = write_spec(tmp_path / "specs", "echo")
        await live.push(echo)
        stalled = await RawWorker.open(live.ws, "stalled")
        await stalled.register([echo])
        job = await live.enqueue("echo")
        await stalled.jobs(1)
        error = await stalled.expect("error", timeout=3)  # it never beats again
        assert error["code"] == "heartbeat_timeout"
        await live.wait_state(job["id"], "available")
        assert live.coordinator.scheduler.workers == {}
        await stalled.ws.close()
    finally:
        await stop_server(live)


async def test_jobs_survive_a_restart(tmp_path: Path):
    echo = write_spec(tmp_path / "specs", "echo")
    live = await start_server(tmp_path)
    await live.push(echo)
    queued = await live.enqueue("echo", {"n": 1})
    await stop_server(live)
    live = await start_server(tmp_path)
    try:
        assert (await live.job(queued["id"]))["state"] == "available"
        assert (await live.http.get("/specs")).json()["specs"][0]["checksum"] == checksum(echo)
        worker = await RawWorker.open(live.ws, "after-restart")
        await worker.register([echo])
        [copy] = await worker.jobs(1)
        assert copy["id"] == queued["id"] and copy["args"] == {"n": 1}
        await worker.ws.close()
    finally:
        await stop_server(live)


async def test_queues_endpoint_explains_waiting_work(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path / "a", "echo")
    media = write_spec(tmp_path / "a", "resize", queue="media")
    await live.push(echo, media)
    await live.enqueue("echo")
    await live.enqueue("resize")
    worker = await connect()
    await worker.register([echo], concurrency=1, capacity=0)
    queues = {q["name"]: q for q in (await live.http.get("/queues")).json()["queues"]}
    assert queues["media"]["waiting"][0]["reason"] == "no connected worker serves queue 'media'"
    assert queues["media"]["waiting"][0]["blocked"] is True
    assert queues["default"]["workers"] == 1
    # A backlog behind a busy worker: said, but no incident (issue 22).
    busy = queues["default"]["waiting"][0]
    assert "the 1 running capable worker is full" in busy["reason"] and busy["blocked"] is False
    assert queues["default"]["counts"]["available"] == 1
    blocked = (await live.http.get("/ui")).text.split("<h2>Blocked</h2>")[1]
    assert "no connected worker serves queue" in blocked and "are full" not in blocked
    metrics = (await live.http.get("/metrics")).text
    assert 'rota_jobs_blocked{reason="no_worker",spec="resize"} 1.0' in metrics
    assert "workers_busy" not in metrics
    await worker.beat(capacity=1)
    await worker.jobs(1)
    await wait_until(lambda: live.coordinator.scheduler.ready_counts().get(("default", "echo")) is None)
    queues = {q["name"]: q for q in (await live.http.get("/queues")).json()["queues"]}
    assert queues["default"]["waiting"] == []
    assert queues["default"]["counts"]["active"] == 1


async def test_held_headers_keep_answers_whole_and_in_order(live: Live):
    """Headers wait for their body (rota.server.httpedge.Corked; that it saves a write per answer
    was measured with strace, not here): answers stay whole, and pipelined requests get
    theirs in order."""
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
        first = await asyncio.wait_for(reader.read(65536), 5)
        head, _, body = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and body.startswith(b"{"), first
        assert body.endswith(b"}"), f"the body did not come with the headers: {first!r}"
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
                     b"GET /nope HTTP/1.1\r\nHost: localhost\r\n\r\n")
        seen = b""
        while seen.count(b"HTTP/1.1 ") < 2:
            seen += await asyncio.wait_for(reader.read(65536), 5)
        assert seen.index(b"HTTP/1.1 200") < seen.index(b"HTTP/1.1 404")
    finally:
        writer.close()


async def test_corked_transport_holds_headers_only_until_the_turn_ends():
    from rota.server.httpedge import Corked

    class Transport:
        def __init__(self) -> None:
            self.writes: list[bytes] = []
            self.closed = False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def close(self) -> None:
            self.closed = True

        def is_closing(self) -> bool:
            return self.closed

        def get_extra_info(self, name: str) -> str:
            return name

    loop = asyncio.get_running_loop()
    raw = Transport()
    corked = Corked(raw, loop)  # type: ignore[arg-type]
    corked.write(b"head")
    corked.write(b"body")
    assert raw.writes == [b"headbody"]
    corked.write(b"alone")  # a stream's next part, say: it waits at most one turn
    assert raw.writes == [b"headbody"]
    await asyncio.sleep(0)  # one turn of the loop, not a wait for time  # noqa: sleep-ok
    assert raw.writes == [b"headbody", b"alone"]
    corked.write(b"last")
    corked.close()  # closing sends what is held first
    assert raw.writes[-1] == b"last" and raw.closed and corked.is_closing()
    assert corked.get_extra_info("peername") == "peername"


async def test_a_long_poll_does_not_hold_a_graceful_stop(tmp_path: Path):
    """uvicorn waits for requests in flight before it stops: a result long poll is answered
    at once (202, the job as it stands) when shutdown begins, not when its wait runs out."""
    live = await start_server(tmp_path)
    stopped = False
    try:
        await live.push(write_spec(tmp_path, "echo"))
        job = await live.enqueue("echo", delay=3600)
        poll = asyncio.create_task(live.http.get(f"/jobs/{job['id']}/result?wait=60",
                                                 timeout=90))
        await wait_until(lambda: job["id"] in live.coordinator.watching.waiters, what="the long poll")
        started = asyncio.get_running_loop().time()
        live.server.request_exit()
        answer = await asyncio.wait_for(poll, 10)
        await asyncio.wait_for(live.server.test_task, 10)  # type: ignore[attr-defined]
        stopped = True
        assert answer.status_code == 202 and answer.json()["done"] is False
        assert asyncio.get_running_loop().time() - started < 5
    finally:
        if not stopped:
            await stop_server(live)
        else:
            await live.http.aclose()


async def test_lean_queue_and_event_behave_as_asyncio_s():
    from rota.server.edge import LeanEvent, LeanQueue

    queue = LeanQueue()
    assert queue.empty() and queue.qsize() == 0
    getter = asyncio.create_task(queue.get())
    await asyncio.sleep(0)  # one turn: it now waits  # noqa: sleep-ok
    queue.put_nowait("a")
    queue.put_nowait("b")
    assert await asyncio.wait_for(getter, 5) == "a"
    assert queue.qsize() == 1 and await queue.get() == "b" and queue.empty()
    cancelled = asyncio.create_task(queue.get())
    await asyncio.sleep(0)  # noqa: sleep-ok (one loop turn)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    queue.put_nowait("c")  # nobody waits now: it stays for the next get
    assert await queue.get() == "c"

    event = LeanEvent()
    waiters = [asyncio.create_task(event.wait()) for _ in range(3)]
    await asyncio.sleep(0)  # noqa: sleep-ok (one loop turn)
    assert not any(w.done() for w in waiters)
    event.set()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5) == [True, True, True]
    event.clear()
    assert not event.is_set()
    event.set()
    assert await event.wait() is True  # set: no wait
