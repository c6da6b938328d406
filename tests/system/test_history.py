"""The throughput history across restarts, with a real ``rota serve`` on SQLite: the
per-minute counts (GET /stats, the dashboard's chart and its hour, ``rota watch``) are
kept in the store every ``--counts-every`` seconds (a hidden test switch; 15 s by
default) and at a stop, and a start loads them back and marks itself on the chart. A
kill -9 loses what was counted since the last write. The store's side, on both
backends, is tests/store/test_store_contract.py's."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from conftest import start_server, stop_server, write_spec
from helpers import RawWorker, completed, wait_until
from test_crash import ServerProcess

EVERY = ("--counts-every", "0.2")


async def hour(server: ServerProcess) -> tuple[dict[str, int], dict[str, Any]]:
    """GET /stats's sums over the hour, and its body."""
    body = (await server.http.get("/stats")).json()
    return {kind: sum(sum(row[kind]) for row in body["series"])
            for kind in ("enqueued", "completed")}, body


def stored(db: Path) -> tuple[int, int]:
    """The jobs enqueued and completed that the store's per-minute counts hold."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT coalesce(sum(enqueued), 0), coalesce(sum(completed), 0)"
                            " FROM throughput").fetchone()
    finally:
        conn.close()


async def test_the_last_hour_survives_a_kill_9_and_a_restart(tmp_path: Path):
    server = ServerProcess(tmp_path)
    echo = write_spec(tmp_path / "specs", "echo")
    try:
        await server.start(extra=EVERY)
        await server.push(echo)
        response = await server.http.post("/jobs/batch", json={"jobs": [
            {"spec": "echo", "args": {"n": n}} for n in range(30)]})
        assert response.status_code in (200, 201), response.text
        worker = await RawWorker.open(server.ws, "w1")
        await worker.register([echo], concurrency=20)
        await worker.beat(results=[completed(job) for job in await worker.jobs(20)])
        await worker.expect("ack")
        await worker.ws.close()
        async def counted() -> dict[str, Any] | None:
            counts, body = await hour(server)
            return body if counts == {"enqueued": 30, "completed": 20} else None

        before = await wait_until(counted, what="the counts")
        # kill -9 loses what was counted since the last write: wait for the write.
        await wait_until(lambda: stored(tmp_path / "rota.db") == (30, 20),
                         what="the counts written")
        await server.kill()
        await server.restart_here()  # the same store and port, in this process
        counts, body = await hour(server)
        assert counts == {"enqueued": 30, "completed": 20}
        assert body["started_at"] > before["started_at"]

        await server.http.post("/jobs/batch", json={"jobs": [
            {"spec": "echo", "args": {"n": n}} for n in range(5)]})
        assert server.live is not None
        live, server.live = server.live, None
        await stop_server(live)  # a graceful stop writes what is left
        server.live = await start_server(tmp_path, port=server.port)
        server.http = server.live.http
        assert (await hour(server))[0] == {"enqueued": 35, "completed": 20}
        overview = (await server.http.get("/ui")).text  # the chart marks the start
        assert 'class="marker"' in overview and "server started" in overview
        assert "enqueued <strong>35</strong>" in overview
    finally:
        await server.close()
