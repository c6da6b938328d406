"""``--log-format json`` against real processes: ``rota serve`` writes one JSON object a
line, with the fields of its enqueue, assign, result and register lines (a result's
``duration_ms`` from its assignment), and ``rota worker`` does the same for its own."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec
from conftest import write_spec
from helpers import RawWorker, clean_env, free_port, spawn_serve, wait_until
from test_cli import WORKER_MODULE

from rota.base.specs import checksum


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a log, each of which must be one JSON object."""
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert lines and all(isinstance(line, dict) for line in lines)
    for line in lines:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
    return lines


def the(lines: list[dict[str, Any]], event: str, **match: Any) -> dict[str, Any]:
    found = [line for line in lines if line.get("event") == event
             and all(line.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (event, match, found)
    return found[0]


async def test_serve_logs_json_lines_with_job_fields_and_durations(tmp_path: Path):
    port, log = free_port(), tmp_path / "serve.log"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        proc = await spawn_serve(http, ["--port", str(port), "--db", str(tmp_path / "r.db")],
                                 log, env={"ROTA_LOG_FORMAT": "json"})
        try:
            echo = write_spec(tmp_path / "specs", "echo", queue="mail")
            assert (await http.put("/specs", json={"specs": [msgspec.to_builtins(echo)]})
                    ).status_code == 200
            worker = await RawWorker.open(f"ws://127.0.0.1:{port}/work", "w-json")
            await worker.register([echo], queues=["mail"])
            ok = (await http.post("/jobs", json={"spec": "echo", "id": "ok-1"})).json()["job"]
            [copy] = await worker.jobs(1)
            await asyncio.sleep(0.2)  # noqa: sleep-ok (the job's own running time)
            await worker.complete(copy, result=1)
            await http.post("/jobs", json={"spec": "echo", "id": "bad-1", "max_attempts": 1})
            [copy] = await worker.jobs(1)
            await worker.beat(results=[{"job_id": copy["id"], "attempt": 1, "outcome": "failed",
                                        "error": {"type": "ValueError", "message": "no"}}])
            await worker.expect("ack")
            await worker.ws.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0
    lines = json_lines(log.read_text())
    common = {"job": ok["id"], "spec": "echo", "queue": "mail"}
    enqueue = the(lines, "enqueue", **common)
    assert enqueue["state"] == "available" and enqueue["logger"] == "rota.server"
    assign = the(lines, "assign", **common, worker="w-json", attempt=1)
    assert assign["checksum"] == checksum(echo)[:15]  # as the text line shows it
    result = the(lines, "result", **common, worker="w-json", attempt=1)
    assert result["outcome"] == "completed" and result["level"] == "INFO"
    assert isinstance(result["duration_ms"], int) and result["duration_ms"] >= 200
    failed = the(lines, "attempt ended", job="bad-1", ending="failed", next="discarded")
    assert isinstance(failed["duration_ms"], int) and failed["duration_ms"] >= 0
    register = the(lines, "register", worker="w-json")
    assert register["queues"] == "mail" and register["concurrency"] == 10


async def test_worker_logs_json_lines(tmp_path: Path):
    port, log = free_port(), tmp_path / "serve.log"
    (tmp_path / "demo_worker.py").write_text(WORKER_MODULE)
    write_spec(tmp_path / "specs", "echo")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        server = await spawn_serve(http, ["--port", str(port), "--db", str(tmp_path / "r.db")], log)
        try:
            await http.put("/specs", json={"specs": [{"name": "echo", "version": "1"}]})
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "rota", "worker", "demo_worker:worker", "--url",
                f"http://127.0.0.1:{port}", "--log-format", "json", "--log-level", "debug",
                cwd=tmp_path,
                env=clean_env(), stderr=asyncio.subprocess.PIPE)

            async def connected() -> bool:
                return bool((await http.get("/workers")).json()["workers"])

            await wait_until(connected, timeout=15, what="the worker to connect")
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 15)
            assert proc.returncode == 0, err.decode()
        finally:
            server.send_signal(signal.SIGTERM)
            await asyncio.wait_for(server.wait(), 15)
    lines = json_lines(err.decode())
    hello = the(lines, "connected")
    assert hello["logger"] == "rota.worker" and hello["queues"] == "default"
    assert the(lines, "deregistered")["worker"] == hello["worker"]
    assert not any(line["level"] in ("ERROR", "CRITICAL") for line in lines)
    # Rota's debug is Rota's: no line of each WebSocket frame (two a second when idle),
    # which buried a job's "job ended" line.
    assert {line["logger"] for line in lines} == {"rota.worker"}, \
        sorted({line["logger"] for line in lines})
    # The server, left at the default, still writes text.
    assert not log.read_text().lstrip().startswith("{")
