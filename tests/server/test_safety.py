"""The safety net at both doors, tested by injecting a fault into a live server: an
exception nobody expected becomes a JSON 500 (HTTP) or a 1011 close (/work), logged
once with an incident id, and nothing is lost or run twice."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import websockets
from conftest import Live, write_spec
from helpers import wait_until
from helpers import closed_with


class Injected(RuntimeError):
    """The fault: a name no answer may show."""


def fail(*args: Any, **kwargs: Any) -> Any:
    raise Injected("secret internals /etc/rota")


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_an_unexpected_exception_in_a_route_is_a_json_500_logged_once(
        live: Live, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(type(live.coordinator.store), "get_job", fail)
    caplog.set_level(logging.INFO)
    answer = await live.http.get("/jobs/some-job")
    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == "internal" and len(error["id"]) == 12
    assert error["id"] in error["message"]
    assert "secret" not in answer.text and "Injected" not in answer.text  # no internals
    [record] = errors_logged(caplog)  # once: not again by uvicorn or Starlette
    assert error["id"] in record.getMessage() and record.exc_info is not None
    assert record.exc_info[0] is Injected
    monkeypatch.undo()
    assert (await live.http.get("/jobs/some-job")).status_code == 404  # serving on
    assert (await live.http.get("/healthz")).status_code == 200


async def test_a_fault_in_a_handshake_is_a_json_500(live: Live, caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(live.coordinator, "attach", fail)
    with pytest.raises(websockets.InvalidStatus) as refused:
        await websockets.connect(live.ws)
    response = refused.value.response
    assert response.status_code == 500
    assert b'"code":"internal"' in response.body and b"secret" not in response.body
    assert len(errors_logged(caplog)) == 1


async def test_a_fault_on_work_closes_1011_and_the_jobs_wait_for_the_worker(
        live: Live, connect, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    first = await connect("w1")
    await first.register([echo], concurrency=1, started_at="2026-11-25T09:00:00.000Z")
    job = await live.enqueue("echo")
    [copy] = await first.jobs(1)

    monkeypatch.setattr(live.coordinator, "receive", fail)
    await first.beat(status={"state": "running", "active_job_ids": [job["id"]]})
    error = await first.expect("error")
    assert error["code"] == "internal_error" and "secret" not in error["message"]
    assert await closed_with(first) == 1011
    [record] = errors_logged(caplog)
    assert record.exc_info is not None and record.exc_info[0] is Injected
    monkeypatch.undo()

    # The job is still the worker's: kept for the reconnect grace, not handed to another.
    await wait_until(lambda: "w1" not in live.coordinator.connections, what="the close")
    held = await live.job(job["id"])
    assert (held["state"], held["worker_id"], held["attempt"]) == ("active", "w1", 1)
    other = await connect("w2")
    await other.register([echo])
    again = await connect("w1")
    await again.register([echo], concurrency=1, capacity=0, started_at="2026-11-25T09:00:00.000Z",
                         status={"state": "running", "active_job_ids": [job["id"]]})
    ack = await again.complete(copy, result="once")
    assert ack["accepted"] == [job["id"]]
    done = await live.job(job["id"])
    assert (done["state"], done["attempt"], done["result"]) == ("completed", 1, "once")
    await other.assert_no_assign(0.1)  # it ran once, on w1
