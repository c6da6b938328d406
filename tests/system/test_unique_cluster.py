"""Unique jobs across three `rota serve` processes on one PostgreSQL: the database
decides, so 50 concurrent enqueues of one key through the three make one job; and a
job replaced through one server is never given out by another that held it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from conftest import write_spec
from helpers import RawWorker, end, free_port, spawn_serve, wait_until

BY_USER = {"keys": ["args"], "args_keys": ["user"]}


async def test_fifty_concurrent_unique_enqueues_through_three_servers_make_one_job(
        tmp_path: Path, pg_url: str):
    spec = write_spec(tmp_path / "specs", "mail")
    ports = [free_port() for _ in range(3)]
    clients = [httpx.AsyncClient(base_url=f"http://127.0.0.1:{p}", timeout=30) for p in ports]
    procs = []
    try:
        procs = list(await asyncio.gather(*(spawn_serve(clients[i], [
            "--db", pg_url, "--port", str(ports[i]), "--server-id", f"s{i}",
            "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"],
            tmp_path / f"s{i}.log") for i in range(3))))
        body = {"specs": [{"name": "mail", "version": "1"}]}
        assert (await clients[0].put("/specs", json=body)).status_code == 200
        answers = await asyncio.gather(*(clients[n % 3].post("/jobs", json={
            "spec": "mail", "args": {"user": 7, "n": n}, "unique": BY_USER})
            for n in range(50)))
        assert all(a.status_code in (200, 201) for a in answers), [a.text for a in answers]
        assert len({a.json()["job"]["id"] for a in answers}) == 1
        assert [a.json()["created"] for a in answers].count(True) == 1
        [held] = {a.json()["job"]["id"] for a in answers}
        # Every server held the job as waiting (it heard of it by a notice); one replaces
        # it, and a worker on another is given the replacement only.
        replace = {**BY_USER, "on_conflict": "replace"}
        new = await clients[1].post("/jobs", json={"spec": "mail", "args": {"user": 7},
                                                   "unique": replace})
        assert new.status_code == 201, new.text
        assert (await clients[2].get(f"/jobs/{held}")).json()["state"] == "cancelled"
        # A scheduled one too: the servers that held it do not bring it back when it
        # comes due (their copy's write finds the row cancelled).
        later = (await clients[0].post("/jobs", json={
            "spec": "mail", "args": {"user": 8}, "delay": 1.0, "unique": BY_USER})).json()["job"]
        # (not a synchronisation: a server that has not heard of it yet holds no copy)
        await asyncio.sleep(0.3)  # noqa: sleep-ok (time for the others to take a copy)
        newer = await clients[1].post("/jobs", json={"spec": "mail", "args": {"user": 8},
                                                     "unique": replace})
        assert newer.status_code == 201, newer.text
        await asyncio.sleep(1.5)  # noqa: sleep-ok (an absence: nothing may happen by then)
        for client in clients:
            assert (await client.get(f"/jobs/{later['id']}")).json()["state"] == "cancelled"
        worker = await RawWorker.open(f"ws://127.0.0.1:{ports[2]}/work", "w2")
        try:
            await worker.register([spec], concurrency=4)
            copies = await worker.jobs(2)
            assert {c["id"] for c in copies} == {new.json()["job"]["id"],
                                                 newer.json()["job"]["id"]}

            async def only_one() -> bool:
                listed = (await clients[0].get("/jobs", params={"state": "available"})).json()
                return listed["jobs"] == []
            await wait_until(only_one, what="no other job waiting")
        finally:
            await worker.ws.close()
    finally:
        await end(procs, clients)
