"""Waiting jobs kept as keys only (rota/core/ready.py), end to end: a real server, a real
SQLite file, raw workers. What a key does not hold is read from the row when the job is
reserved, cancelled or shown, and a restart reads keys for plain waiting jobs and whole
rows for the rest."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from conftest import Live, RawWorker, open_store, start_server, stop_server, write_spec
from helpers import completed, wait_until

# The server's scenarios run on SQLite; what they rely on the store for runs on both
# backends in tests/store/test_store_contract.py, and the store's claim below (rota/store/rows.py,
# called straight) on both here.


async def test_a_restart_keeps_every_job_in_priority_order(tmp_path: Path):
    spec = write_spec(tmp_path / "specs", "echo")
    live = await start_server(tmp_path)
    try:
        await live.push(spec)
        holder = await RawWorker.open(live.ws, "holder")
        await holder.register([spec], concurrency=1)
        running = await live.enqueue("echo", {"n": "running"}, priority=100)
        [held] = await holder.jobs(1)
        assert held["id"] == running["id"]
        # Waiting, in the order a worker must get them: priority, then enqueue order.
        low = await live.enqueue("echo", {"n": "low"})
        high = await live.enqueue("echo", {"n": "high"}, priority=5)
        mine = await live.enqueue("echo", {"n": "mine"}, id="producer-chosen")  # its own id
        ttl = await live.enqueue("echo", {"n": "ttl"}, priority=1, ttl=3600)  # kept whole
        later = await live.enqueue("echo", {"n": "later"}, delay=3600)  # scheduled
        assert live.coordinator.scheduler.ready.keys == 3
    finally:
        await stop_server(live)  # the holder's job stays reserved for it to reclaim
    await holder.ws.close()

    live = await start_server(tmp_path, port=live.port)
    try:
        health = (await live.http.get("/healthz")).json()
        assert health["live_jobs"] == 6
        assert live.coordinator.scheduler.ready.keys == 3  # low, high, mine: keys only
        assert (await live.job(later["id"]))["state"] == "scheduled"
        assert (await live.job(running["id"]))["state"] == "active"
        holder = await RawWorker.open(live.ws, "holder")  # reclaims what it ran, takes no more
        await holder.register([spec], concurrency=1, capacity=0, status={
            "state": "running", "active_job_ids": [running["id"]]})
        await holder.complete(held)
        await live.wait_state(running["id"], "completed")
        worker = await RawWorker.open(live.ws, "w2")
        await worker.register([spec], concurrency=1)
        order = []
        for _ in range(4):
            [copy] = await worker.jobs(1)
            order.append(copy["id"])
            assert copy["args"]["n"] in ("high", "ttl", "low", "mine") and copy["attempt"] == 1
            await worker.complete(copy, capacity=1)
        assert order == [high["id"], ttl["id"], low["id"], mine["id"]]
        assert live.coordinator.scheduler.live() == 1  # the scheduled one
        await worker.ws.close()
        await holder.ws.close()
    finally:
        await stop_server(live)


async def test_a_waiting_job_is_shown_cancelled_and_retried_from_its_row(
        live: Live, connect, tmp_path: Path):
    spec = write_spec(tmp_path, "echo")
    await live.push(spec)
    job = await live.enqueue("echo", {"a": 1})
    other = await live.enqueue("echo", {"a": 2})
    scheduler = live.coordinator.scheduler
    await wait_until(lambda: scheduler.ready.keys == 2, what="both kept as keys")
    shown = await live.job(job["id"])
    assert shown["state"] == "available" and shown["args"] == {"a": 1}
    assert "no connected worker" in shown["waiting_reason"]

    response = await live.http.delete(f"/jobs/{job['id']}")
    assert response.status_code == 200, response.text
    assert response.json()["state"] == "cancelled"
    assert scheduler.ready_counts() == {("default", "echo"): 1}
    again = await live.http.delete(f"/jobs/{job['id']}")
    assert again.status_code == 409

    worker = await connect()
    await worker.register([spec], concurrency=5)
    [copy] = await worker.jobs(1)
    assert copy["id"] == other["id"]  # never the cancelled one
    await worker.complete(copy)
    await worker.assert_no_assign(0.2)

    retried = await live.http.post(f"/jobs/{job['id']}/retry")
    assert retried.status_code == 200, retried.text
    [copy] = await worker.jobs(1)
    assert (copy["id"], copy["args"], copy["attempt"]) == (job["id"], {"a": 1}, 1)
    await worker.complete(copy)
    await live.wait_state(job["id"], "completed")
    assert scheduler.live() == 0


async def test_a_cancel_of_a_job_being_reserved_reaches_its_worker(
        live: Live, connect, tmp_path: Path):
    """The cancel finds the job only in its row, which says available, but a reservation
    of it is already queued: the row decides, and the cancel goes to the worker."""
    spec = write_spec(tmp_path, "echo")
    await live.push(spec)
    job = await live.enqueue("echo")
    scheduler = live.coordinator.scheduler
    await wait_until(lambda: scheduler.ready.keys == 1, what="kept as a key")
    row = await live.coordinator.store.get_job(job["id"])
    worker = await connect()
    await worker.register([spec], concurrency=1)
    [copy] = await worker.jobs(1)
    # As if the cancel had read the row just before the reservation was written:
    outcome, effects = live.coordinator.engine.cancel_waiting(row, live.coordinator.clock())
    assert outcome == "requested"  # the engine holds it whole now: it asks its worker
    await live.coordinator.run(effects)
    cancel = await worker.expect("cancel")
    assert cancel["job_ids"] == [copy["id"]]


async def test_a_cancel_racing_the_reservation_of_its_key_reaches_the_worker(
        live: Live, connect, tmp_path: Path):
    """The key is claimed and its reservation queued, not yet committed, when the cancel
    comes: whatever the cancel reads, it ends as a request to the worker that got it."""
    spec = write_spec(tmp_path, "echo")
    await live.push(spec)
    worker = await connect()
    await worker.register([spec], concurrency=1, capacity=0)
    job = await live.enqueue("echo")
    coordinator = live.coordinator
    await wait_until(lambda: coordinator.scheduler.ready.keys == 1, what="kept as a key")
    coordinator.scheduler.workers["w1"].capacity = 1  # what its next heartbeat would say
    coordinator.apply(coordinator.engine.dispatch(coordinator.clock()))  # claimed: queued
    assert coordinator.scheduler.claims == 1
    response = await live.http.delete(f"/jobs/{job['id']}")
    assert response.status_code == 202, response.text
    assert response.json()["state"] == "active" and response.json()["cancel_requested"]
    [copy] = await worker.jobs(1)
    cancel = await worker.expect("cancel")
    assert cancel["job_ids"] == [copy["id"]] == [job["id"]]


@pytest.mark.both_backends
def test_the_store_reserves_a_claimed_row_only_while_it_is_available(tmp_path: Path):
    """The store's side, straight on the database: a withdrawn row cannot be claimed."""
    from rota.store.rows import claim_rows

    with contextlib.closing(open_store(tmp_path)) as conn:
        conn.execute("INSERT INTO jobs (id, spec, queue, args, priority, state, attempt,"
                     " enqueued_at) VALUES ('j', 'echo', 'default', '{}', 0, 'cancelled', 0, 0)")
        seq = conn.execute("SELECT rowid FROM jobs WHERE id = 'j'").fetchone()[0]
        assert claim_rows(conn, "w1", "c", 1.0, 30.0, 0.0, [seq]) == []
        conn.execute("UPDATE jobs SET state = 'available'")
        [row] = claim_rows(conn, "w1", "c", 1.0, 30.0, 0.0, [seq, seq + 1])  # no row seq + 1
        assert row[1] == "j" and row[13:15] == ("active", 1) and row[19] == 31.0
        assert claim_rows(conn, "w1", "c", 1.0, 30.0, 0.0, [seq]) == []  # active now
        # A row's own visibility_timeout, but never below the shortest lease.
        conn.execute("UPDATE jobs SET state = 'available', visibility_timeout = 1e-9")
        [row] = claim_rows(conn, "w1", "c", 1.0, 30.0, 2.0, [seq])
        assert row[19] == 3.0


async def test_cancels_racing_a_draining_worker_lose_no_job_and_run_none_twice(
        live: Live, connect, tmp_path: Path):
    """300 waiting jobs (keys), a worker draining them two at a time, and 100 cancels
    coming in meanwhile: every job ends once, a cancelled one never ran, and nothing is
    left in memory."""
    spec = write_spec(tmp_path, "echo")
    await live.push(spec)
    response = await live.http.post("/jobs/batch", json={"jobs": [
        {"spec": "echo", "args": {"n": n}} for n in range(300)]})
    ids = [item["job"]["id"] for item in response.json()["results"]]
    scheduler = live.coordinator.scheduler
    await wait_until(lambda: scheduler.ready.keys == 300, what="all kept as keys")
    worker = await connect()
    await worker.register([spec], concurrency=2)
    assigned: list[str] = []
    cancel_frames: set[str] = set()

    async def drain() -> None:
        while len(assigned) < 300:
            frame = await worker.recv(timeout=10.0)
            if frame["type"] == "assign":
                assigned.extend(job["id"] for job in frame["jobs"])
                await worker.beat(results=[completed(job) for job in frame["jobs"]],
                                  capacity=len(frame["jobs"]))
            elif frame["type"] == "cancel":
                cancel_frames.update(frame["job_ids"])

    draining = asyncio.create_task(drain())
    answers = {}
    for job_id in ids[::-3]:  # from the back: the first find their jobs waiting, the last
        answers[job_id] = (await live.http.delete(f"/jobs/{job_id}")).status_code  # meet the drain
    rows = {}

    async def settled() -> bool:
        rows.update({i: await live.coordinator.store.get_job(i) for i in ids})
        return all(row["state"] in ("completed", "cancelled") for row in rows.values())

    await wait_until(settled, timeout=20.0, what="every job completed or cancelled")
    draining.cancel()
    assert len(assigned) == len(set(assigned))  # nothing ran twice
    for job_id, row in rows.items():
        if row["state"] == "cancelled":
            assert job_id not in assigned and answers.get(job_id) == 200
        else:
            assert job_id in assigned and row["attempt"] == 1
    for job_id, status in answers.items():
        # 200: cancelled while waiting; 202: it ran, the worker was told; 409: finished
        assert status in (200, 202, 409), (job_id, status)
        assert (status == 202) == (job_id in cancel_frames)
    assert sum(1 for s in answers.values() if s == 200) > 0
    assert scheduler.live() == 0 and scheduler.ready.keys == 0 and scheduler.claims == 0
    assert scheduler.ready_counts() == {}
