"""GET /events, /stats and /metrics against a real server: SSE read with httpx streaming,
resume with Last-Event-ID, the gap, keep-alives, scopes, and metrics after real jobs."""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Live, start_server, stop_server, write_spec
from helpers import RawWorker, wait_until
from helpers import bearer, make_tokens, rota
from test_observe import T0, ended, error_record, job
from test_storage import QUOTA, batch

from rota import JobContext, Worker
from rota.server.feeds import ENCODED_KEPT, encode, encoding, gap
from rota.core.observe import Observer


# -- the wire format, without a server ------------------------------------------------
def parse(frame: bytes) -> tuple[int, str, dict[str, Any]]:
    lines = frame.decode().split("\n")
    assert frame.endswith(b"\n\n")
    fields = dict(line.split(": ", 1) for line in lines if line)
    return int(fields["id"]), fields["event"], json.loads(fields["data"])


def test_an_event_goes_out_as_a_server_sent_event_with_its_id_and_kind():
    obs = Observer(first_id=7)
    obs.ended([ended("retryable", "failed", job_id="f", attempt=2, reserved_at=T0 + 1,
                     error=error_record("it broke"))], T0 + 1.5, worker="w", reported=True)
    obs.event(T0, "alert", job=None, worker="w", message=("warning", "disk low"))
    (i1, result), _, (i3, alert) = obs.after(6, 10)[1]
    event_id, kind, data = parse(encode(i1, result))
    assert (event_id, kind, data["kind"], data["message"]) == (7, "result", "result", "it broke")
    assert parse(encode(i3, alert)) == (9, "alert", {
        "at": "2027-01-15T08:00:00.000Z", "kind": "alert", "worker": "w",
        "level": "warning", "message": "disk low"})


def test_a_gap_names_the_ids_missed_and_has_the_last_one_s_id():
    assert parse(gap(3, 7, T0)) == (7, "gap", {"at": "2027-01-15T08:00:00.000Z",
                                               "kind": "gap", "missed_from": 3,
                                               "missed_to": 7})


def test_events_are_encoded_once_for_every_subscriber_and_the_cache_is_bounded():
    obs = Observer(buffer=ENCODED_KEPT * 2, first_id=1)
    obs.enqueued([job(f"j{i}") for i in range(ENCODED_KEPT + 10)], T0)
    _, events = obs.after(0, ENCODED_KEPT + 10)
    first = [encoding(obs, i, e) for i, e in events[:3]]
    assert first == [encode(i, e) for i, e in events[:3]]
    assert all(encoding(obs, i, e) is made for (i, e), made in zip(events, first))
    for i, e in events:
        encoding(obs, i, e)
    assert len(obs.encoded) == ENCODED_KEPT and 1 not in obs.encoded


@pytest.fixture
async def watched(tmp_path: Path) -> AsyncIterator[Live]:
    server = await start_server(tmp_path, events_keepalive=0.2, events_buffer=50)
    try:
        yield server
    finally:
        await stop_server(server)


class Stream:
    """An open GET /events, read one server-sent event (or comment) at a time."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.lines = response.aiter_lines()

    async def next(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next event as {"id", "event", "data"}, or {"comment": text}."""
        async def read() -> dict[str, Any]:
            fields: dict[str, Any] = {}
            async for line in self.lines:
                if line == "":
                    if fields:
                        return fields
                    continue
                name, _, value = line.partition(":")
                if name == "":
                    return {"comment": value.strip()}
                fields[name] = json.loads(value) if name == "data" else value.strip()
            raise AssertionError("the stream ended")

        return await asyncio.wait_for(read(), timeout)

    async def events(self, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        while len(got) < count:
            item = await self.next(timeout)
            if "comment" not in item:
                got.append(item)
        return got


async def open_stream(live: Live, client: httpx.AsyncClient, query: str = "",
                      headers: dict[str, str] | None = None
                      ) -> tuple[Stream, Any]:
    manager = client.stream("GET", f"/events{query}", headers=headers or {}, timeout=10)
    response = await manager.__aenter__()
    assert response.status_code == 200, await response.aread()
    assert response.headers["content-type"].startswith("text/event-stream")
    # Subscribed once the server counts it: events recorded from then on reach it.
    await wait_until(lambda: live.coordinator.watching.subscribers > 0, what="the subscription")
    return Stream(response), manager


async def test_a_job_streams_as_events_and_a_keep_alive_fills_silence(watched: Live,
                                                                      tmp_path: Path):
    spec = write_spec(tmp_path / "specs", "ping")
    await watched.push(spec)
    async with httpx.AsyncClient(base_url=watched.base) as client:
        stream, manager = await open_stream(watched, client)
        try:
            assert await stream.next() == {"comment": "keep-alive"}  # nothing happened yet
            worker = await RawWorker.open(watched.ws, "w1")
            await worker.register([spec])
            job = await watched.enqueue("ping", {"n": 1})
            [copy] = await worker.jobs(1)
            await worker.complete(copy, "pong")
            got = await stream.events(4)
            assert [e["event"] for e in got] == ["worker_connect", "enqueue", "assign", "result"]
            ids = [int(e["id"]) for e in got]
            assert ids == sorted(ids) and len(set(ids)) == 4
            enqueue, assign, result = (e["data"] for e in got[1:])
            assert enqueue["kind"] == "enqueue" and enqueue["job"] == job["id"]
            assert enqueue["spec"] == "ping" and enqueue["queue"] == "default"
            assert enqueue["at"].endswith("Z") and enqueue["state"] == "available"
            assert assign["worker"] == "w1" and assign["attempt"] == 1 and assign["checksum"]
            assert result["state"] == "completed" and result["duration_ms"] >= 0
            await worker.ws.close()
            gone = await stream.events(1)
            assert gone[0]["event"] == "worker_disconnect" and gone[0]["data"]["worker"] == "w1"
        finally:
            await manager.__aexit__(None, None, None)
    await wait_until(lambda: watched.coordinator.watching.subscribers == 0, what="unsubscribed")
    assert watched.coordinator.engine.observe.listener is None


async def test_resume_after_last_event_id_and_a_gap_when_too_far_behind(watched: Live,
                                                                       tmp_path: Path):
    await watched.push(write_spec(tmp_path / "specs", "bulk"))
    observer = watched.coordinator.engine.observe
    start = observer.next_id
    first = [await watched.enqueue("bulk", {"n": i}) for i in range(3)]
    async with httpx.AsyncClient(base_url=watched.base) as client:
        # Resume after the first enqueue (header): the next two come, from the buffer.
        stream, manager = await open_stream(watched, client,
                                            headers={"Last-Event-ID": str(start)})
        try:
            got = await stream.events(2)
            assert [e["data"]["job"] for e in got] == [j["id"] for j in first[1:]]
            assert [int(e["id"]) for e in got] == [start + 1, start + 2]
        finally:
            await manager.__aexit__(None, None, None)
        # The same by the query parameter.
        stream, manager = await open_stream(watched, client, f"?last_event_id={start + 1}")
        try:
            [only] = await stream.events(1)
            assert only["data"]["job"] == first[2]["id"]
        finally:
            await manager.__aexit__(None, None, None)
        # 60 more: the buffer (50) no longer holds the first ones.
        response = await watched.http.post("/jobs/batch", json={"jobs": [
            {"spec": "bulk", "args": {"n": i}} for i in range(60)]})
        assert response.status_code == 200
        newest = observer.next_id - 1
        stream, manager = await open_stream(watched, client, f"?last_event_id={start}")
        try:
            lost, *rest = await stream.events(50)
            assert lost["event"] == "gap"
            oldest = newest - 49
            assert lost["data"]["missed_from"] == start + 1
            assert lost["data"]["missed_to"] == oldest - 1 == int(lost["id"])
            assert [int(e["id"]) for e in rest] == list(range(oldest, oldest + 49))
        finally:
            await manager.__aexit__(None, None, None)


async def test_server_side_filters(watched: Live, tmp_path: Path):
    one = write_spec(tmp_path / "specs", "one")
    two = write_spec(tmp_path / "specs", "two", queue="other")
    await watched.push(one, two)
    async with httpx.AsyncClient(base_url=watched.base) as client:
        stream, manager = await open_stream(watched, client, "?event=enqueue,cancel&queue=other")
        try:
            await watched.enqueue("one")
            job = await watched.enqueue("two")
            assert (await watched.http.delete(f"/jobs/{job['id']}")).status_code == 200
            got = await stream.events(2)
            assert [(e["event"], e["data"]["job"]) for e in got] == [
                ("enqueue", job["id"]), ("cancel", job["id"])]
            assert got[1]["data"]["state"] == "cancelled"
        finally:
            await manager.__aexit__(None, None, None)


@pytest.mark.parametrize(("query", "headers", "code"), [
    ("?event=enqueue,nonsense", {}, "invalid_filter"),
    ("?event=", {}, "invalid_filter"),
    ("", {"Last-Event-ID": "12a"}, "invalid_last_event_id"),
    ("?last_event_id=-3", {}, "invalid_last_event_id"),
    ("?kind=discard", {}, "invalid_filter"),  # a misspelt parameter widens nothing
    ("?spec=a&spec=b", {}, "invalid_filter"),
    ("?spec=bad%20name", {}, "invalid_filter"),
])
async def test_bad_event_requests_are_refused(live: Live, query: str, headers: dict[str, str],
                                              code: str):
    response = await live.http.get(f"/events{query}", headers=headers)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


async def test_scopes(live: Live):
    admin, scraper, producer = await make_tokens(live, ("admin", None), ("metrics", None),
                                                 ("producer", None))
    assert (await live.http.get("/metrics")).status_code == 401
    assert (await live.http.get("/stats")).status_code == 401
    for path in ("/events", "/stats"):
        for secret in (scraper, producer):
            refused = await live.http.get(path, headers=bearer(secret))
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
    assert (await live.http.get("/metrics", headers=bearer(producer))).status_code == 403
    for secret in (scraper, admin):
        scraped = await live.http.get("/metrics", headers=bearer(secret))
        assert scraped.status_code == 200 and scraped.headers["content-type"].startswith(
            "text/plain")
    # A metrics token reads nothing else, and cannot connect as a worker.
    assert (await live.http.get("/queues", headers=bearer(scraper))).status_code == 403
    assert (await live.http.post("/jobs", json={"spec": "x"},
                                 headers=bearer(scraper))).status_code == 403
    created = await live.http.post("/tokens", json={"scope": "metrics"}, headers=bearer(admin))
    assert created.status_code == 201 and created.json()["scope"] == "metrics"


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from the text format (its labels in any order)."""
    for line in text.splitlines():
        sample = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if sample and sample[1] == name and dict(
                re.findall(r'(\w+)="([^"]*)"', sample[2] or "")) == labels:
            return float(sample[3])
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


async def test_metrics_and_stats_after_real_jobs(live: Live, sdk_worker, tmp_path: Path):
    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "good"),
                    write_spec(specs, "bad", extra="[retry]\nmax_attempts = 2\n"),
                    write_spec(specs, "stuck", queue="nobody"))
    worker = Worker(specs_dir=specs, heartbeat_interval=0.1)

    @worker.handler("good")
    async def good(ctx: JobContext) -> str:
        return "ok"

    @worker.handler("bad")
    async def bad(ctx: JobContext) -> None:
        raise ValueError("always")

    await sdk_worker(worker)
    done = [await live.enqueue("good") for _ in range(3)]
    failed = await live.enqueue("bad")
    waiting = await live.enqueue("stuck")
    for job in done:
        await live.wait_state(job["id"], "completed")
    await live.wait_state(failed["id"], "discarded")
    scraped = await live.http.get("/metrics")
    assert scraped.status_code == 200
    text = scraped.text
    good_labels = {"queue": "default", "spec": "good"}
    bad_labels = {"queue": "default", "spec": "bad"}
    assert metric(text, "rota_jobs_enqueued_total", **good_labels) == 3
    assert metric(text, "rota_jobs_completed_total", **good_labels) == 3
    assert metric(text, "rota_jobs_failed_total", **bad_labels) == 2
    assert metric(text, "rota_jobs_retried_total", **bad_labels) == 1
    assert metric(text, "rota_jobs_discarded_total", **bad_labels) == 1
    assert metric(text, "rota_jobs_cancelled_total", **bad_labels) == 0
    assert metric(text, "rota_job_duration_seconds_count", **good_labels) == 3
    assert metric(text, "rota_job_queue_wait_seconds_count", **good_labels) == 3
    assert metric(text, "rota_job_duration_seconds_bucket", le="+Inf", **good_labels) == 3
    assert metric(text, "rota_workers", state="running") == 1
    assert metric(text, "rota_workers", state="quiet") == 0
    assert metric(text, "rota_queue_jobs", queue="default", state="completed") == 3
    assert metric(text, "rota_queue_jobs", queue="nobody", state="available") == 1
    assert metric(text, "rota_queue_oldest_available_seconds", queue="nobody") >= 0
    assert metric(text, "rota_jobs_blocked", spec="stuck", reason="no_worker") == 1
    assert worker.worker_id not in text and done[0]["id"] not in text  # no ids as labels

    stats = await live.http.get("/stats?minutes=5")
    assert stats.status_code == 200
    body = stats.json()
    assert len(body["minute_starts"]) == 5 and body["now"].endswith("Z")
    series = {(s["queue"], s["spec"]): s for s in body["series"]}
    assert sum(series["default", "good"]["completed"]) == 3
    assert sum(series["default", "bad"]["failed"]) == 2
    assert sum(series["default", "bad"]["discarded"]) == 1
    assert sum(series["nobody", "stuck"]["enqueued"]) == 1
    assert body["oldest_available"]["nobody"] >= 0
    assert body["oldest_available"]["default"] is None
    assert waiting["state"] == "available"
    assert len((await live.http.get("/stats")).json()["minute_starts"]) == 60


@pytest.mark.parametrize("minutes", ["0", "61", "x", "1.5", ""])
async def test_bad_minutes_are_refused(live: Live, minutes: str):
    response = await live.http.get(f"/stats?minutes={minutes}")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_minutes"


@pytest.mark.parametrize("query", ["?foo=1", "?minutes=1&minutes=2"])
async def test_unknown_or_repeated_stats_parameters_are_refused(live: Live, query: str):
    response = await live.http.get(f"/stats{query}")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_filter"


async def test_a_filtered_stream_reads_past_events_it_does_not_want(tmp_path: Path):
    """Thousands of events the filter drops, then one it wants: it comes at once, not
    at the next keep-alive (set far away here)."""
    server = await start_server(tmp_path, events_keepalive=60.0)
    try:
        other = write_spec(tmp_path / "specs", "other", queue="other")
        await server.push(other)
        await server.http.post("/queues/default/pause")
        async with httpx.AsyncClient(base_url=server.base) as client:
            stream, manager = await open_stream(server, client, "?queue=other&event=enqueue")
            try:
                for _ in range(3):
                    body = {"jobs": [{"spec": "echo", "args": {}} for _ in range(3_000)]}
                    response = await server.http.post("/jobs/batch", json=body, timeout=30)
                    assert response.status_code == 200
                job = await server.enqueue("other")
                [event] = await stream.events(1, timeout=5.0)
                assert (event["event"], event["data"]["job"]) == ("enqueue", job["id"])
            finally:
                await manager.__aexit__(None, None, None)
    finally:
        await stop_server(server)


async def test_a_client_that_does_not_read_holds_nothing_and_gets_a_gap(tmp_path: Path):
    live = await start_server(tmp_path, events_buffer=100, events_keepalive=60.0)
    try:
        await live.push(write_spec(tmp_path / "specs", "flood"))
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", live.port))
        await loop.sock_sendall(sock, b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await wait_until(lambda: live.coordinator.watching.subscribers == 1, what="the subscription")
        # Far more than the socket buffers hold: the stream's send waits, nothing else.
        for _ in range(6):
            response = await live.http.post("/jobs/batch", json={"jobs": [
                {"spec": "flood", "args": {"pad": "x" * 200}} for _ in range(1000)]})
            assert response.status_code == 200
            assert (await live.http.get("/healthz")).status_code == 200
        received = b""
        while b"event: gap" not in received:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            assert chunk, "the stream ended"
            received += chunk
        gap = received[received.index(b"event: gap"):].split(b"\n\n")[0]
        data = json.loads(gap.split(b"data: ", 1)[1])
        assert data["kind"] == "gap" and data["missed_to"] >= data["missed_from"]
        sock.close()
        await wait_until(lambda: live.coordinator.watching.subscribers == 0, what="unsubscribed")
    finally:
        await stop_server(live)


async def test_rota_tokens_create_makes_a_metrics_token_that_scrapes(live: Live):
    code, out, err = await rota("tokens", "create", "--scope", "metrics", "--name", "prom",
                                "--db", str(live.settings.db))
    assert code == 0 and out.startswith("rota_"), err
    secret = out.split()[0]
    await wait_until(lambda: live.coordinator.tokens.required, what="auth on")
    scraped = await live.http.get("/metrics", headers=bearer(secret))
    assert scraped.status_code == 200 and "rota_workers" in scraped.text
    assert (await live.http.get("/events", headers=bearer(secret))).status_code == 403


async def test_a_stream_ends_when_the_server_stops(tmp_path: Path):
    live = await start_server(tmp_path, events_keepalive=60.0)
    async with httpx.AsyncClient(base_url=live.base) as client:
        stream, manager = await open_stream(live, client)
        try:
            stopping = asyncio.create_task(stop_server(live))
            with pytest.raises(AssertionError, match="the stream ended"):
                await stream.next(timeout=5)  # ended, not cut off after the keep-alive
            await asyncio.wait_for(stopping, 10)
        finally:
            await manager.__aexit__(None, None, None)


async def test_a_full_disk_is_a_state_change_event(tmp_path: Path):
    live = await start_server(tmp_path, max_db_size=QUOTA)
    try:
        await live.push(write_spec(tmp_path / "specs", "echo"))
        since = live.coordinator.engine.observe.next_id - 1  # after the push's own event

        async def refused() -> bool:
            response = await live.http.post("/jobs/batch", json=batch(20))
            return response.status_code == 503

        await wait_until(refused, timeout=30, what="a full quota")
        async with httpx.AsyncClient(base_url=live.base) as client:
            stream, manager = await open_stream(
                live, client, f"?event=state_change&last_event_id={since}")
            try:
                [full] = await stream.events(1)
            finally:
                await manager.__aexit__(None, None, None)
        assert full["data"]["state"] == "storage_degraded"
        assert full["data"]["message"].startswith("storage_full: ")
    finally:
        await stop_server(live)


async def test_directives_and_alerts_are_events(watched: Live, tmp_path: Path):
    spec = write_spec(tmp_path / "specs", "ping")
    await watched.push(spec)
    async with httpx.AsyncClient(base_url=watched.base) as client:
        stream, manager = await open_stream(watched, client, "?event=worker_state,alert")
        try:
            worker = await RawWorker.open(watched.ws, "w1")
            await worker.register([spec])
            quiet = await watched.http.post("/workers/w1/state", json={"state": "quiet"})
            assert quiet.status_code == 200
            await worker.beat(status={"state": "quiet", "active_job_ids": [], "alerts": [
                {"level": "error", "message": "disk almost full"}]})
            directed, alert = await stream.events(2)
            assert directed["event"] == "worker_state"
            assert (directed["data"]["worker"], directed["data"]["state"]) == ("w1", "quiet")
            assert alert["event"] == "alert" and alert["data"]["level"] == "error"
            assert alert["data"]["message"] == "disk almost full"
            await worker.ws.close()
        finally:
            await manager.__aexit__(None, None, None)
