"""A hypothesis rule-based state machine drives raw protocol clients, valid and hostile,
against a real server, and checks after every step: no job is held by two live workers,
no job is lost, the server logged no unhandled error, and it still answers others.

The server runs in a thread with its own event loop so that hypothesis, which is
synchronous, can drive blocking ``websockets.sync`` clients against it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import corpus
import httpx
import pytest
from conftest import ThreadedServer, write_spec
from helpers import SyncRawWorker, completed, registration
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from websockets.sync.client import connect

from rota.base.specs import JobSpec

WORKER_IDS = ["w1", "w2", "w3"]
QUIET = logging.getLogger("rota.tests.model-client")
QUIET.setLevel(logging.CRITICAL)
GARBAGE: dict[str, tuple[str | bytes, set[str]]] = {
    "not json": ("{nope", {"malformed_json"}),
    "binary": (b"\x00\x01", {"binary_not_supported"}),
    "server message": ('{"type": "ack", "seq": 1, "state": "running", "server_time": "x"}',
                       {"unknown_type"}),
    "no type": ('{"seq": 99}', {"unknown_type"}),
    "huge seq": ('{"type": "heartbeat", "seq": 1e300, "worker_id": "w1"}',
                 {"invalid_message"}),
    "negative capacity": ('{"type": "heartbeat", "seq": 10000, "worker_id": "W", "capacity": -1}',
                          {"invalid_message"}),
    "wrong types": ('{"type": "heartbeat", "seq": 10000, "worker_id": "W",'
                    ' "results": [{"job_id": 5, "attempt": "1", "outcome": "done"}]}',
                    {"invalid_message"}),
    "seq going back": ('{"type": "heartbeat", "seq": 0, "worker_id": "W"}',
                       {"seq_not_increasing"}),
    "other worker id": ('{"type": "heartbeat", "seq": 10000, "worker_id": "intruder"}',
                        {"worker_id_mismatch"}),
}
# Every value of the hostile corpus that no field may take, in a result's value: the
# frame is refused with the code for it, and the sender's jobs go back like any other's.
REFUSED_CODES = {"malformed_json", "invalid_message", "too_deep", "invalid_unicode"}
for _name, _fragment, _refused in corpus.VALUES:
    if _refused and _fragment.isascii():  # a str frame: invalid UTF-8 cannot be written
        GARBAGE[f"result {_name}"] = (
            '{"type": "heartbeat", "seq": 10000, "worker_id": "W", "results": [{"job_id":'
            ' "job-1", "attempt": 1, "outcome": "completed", "result": '
            + _fragment.decode() + "}]}", REFUSED_CODES)
# Priorities at the edges of the documented range (32 bits) and past it.
PRIORITIES = [None, 0, 2**31 - 1, -(2**31 - 1), 2**31, -(2**31), 2**63, -(2**63) - 1, 10**30]


class ErrorLog(logging.Handler):
    """Collects ERROR records: an unhandled exception anywhere in the server lands here."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        # A job whose workers keep closing on it is discarded as poison, by design, at
        # ERROR: that is the server doing its job, not failing at it.
        if not record.getMessage().startswith("poison "):
            self.records.append(self.format(record))


class Client:
    """One raw worker connection, with the jobs it has been given and not reported."""

    def __init__(self, url: str, worker_id: str, spec: JobSpec, concurrency: int):
        self.id = worker_id
        self._exit = contextlib.ExitStack()
        # Its own quiet logger: an abrupt close makes the client library log its EOF.
        self.raw = SyncRawWorker(self._exit.enter_context(connect(url, logger=QUIET)), worker_id)
        self.held: dict[str, int] = {}
        self.concurrency = concurrency
        self.registration = registration([spec], concurrency=concurrency)

    def beat(self, **sections: Any) -> dict[str, Any]:
        """Send a heartbeat; return its ack (assigns and cancels on the way are applied)."""
        seq = self.raw.beat(**sections)
        while True:
            frame = self.next_frame()
            if frame["type"] == "ack" and frame["seq"] == seq:
                return frame
            assert frame["type"] in ("welcome", "ack", "assign", "cancel"), frame

    def next_frame(self, timeout: float = 5.0) -> dict[str, Any]:
        frame = self.raw.recv(timeout)
        if frame["type"] == "assign":
            for copy in frame["jobs"]:
                self.held[copy["id"]] = copy["attempt"]
            assert len(self.held) <= self.concurrency, (self.id, self.held)
        elif frame["type"] == "cancel":
            for job_id in frame["job_ids"]:
                self.held.pop(job_id, None)
        elif frame["type"] == "error":
            raise AssertionError(f"unexpected error frame: {frame}")
        return frame

    def settle(self) -> None:
        """Take in every frame already on its way (a quiet beat flushes them)."""
        self.beat(status={"state": "running", "active_job_ids": sorted(self.held)},
                  capacity=self.concurrency - len(self.held))

    def close(self, abrupt: bool = False) -> None:
        if abrupt:  # no close frame: the server sees the connection lost
            self.raw.ws.socket.shutdown(socket.SHUT_RDWR)
        self._exit.close()


class ProtocolModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="rota-model-"))
        self.errors = ErrorLog()
        for name in ("rota", "uvicorn"):
            logging.getLogger(name).addHandler(self.errors)
        self.server = ThreadedServer(self.tmp, reconnect_grace=0.3, heartbeat_timeout=30.0)
        self.live = self.server.live
        self.http = httpx.Client(base_url=self.live.base, timeout=10)
        self.spec = write_spec(self.tmp / "specs", "echo")
        reply = self.http.put("/specs", json={"specs": [{"name": "echo", "version": "1"}]})
        assert reply.status_code == 200, reply.text
        self.clients: dict[str, Client] = {}
        self.enqueued: set[str] = set()
        self.completed: set[str] = set()
        self.count = 0

    def teardown(self) -> None:
        for client in self.clients.values():
            client.close()
        self.http.close()
        self.server.close()
        for name in ("rota", "uvicorn"):
            logging.getLogger(name).removeHandler(self.errors)
        shutil.rmtree(self.tmp, ignore_errors=True)  # one per example: do not pile up

    # -- rules ------------------------------------------------------------------------
    @rule(n=st.integers(1, 3), priority=st.sampled_from(PRIORITIES))
    def enqueue(self, n: int, priority: int | None) -> None:
        in_range = priority is None or abs(priority) <= 2**31 - 1
        for _ in range(n):
            self.count += 1
            job_id = f"job-{self.count}"
            body: dict[str, Any] = {"spec": "echo", "id": job_id}
            if priority is not None:
                body["priority"] = priority
            reply = self.http.post("/jobs", json=body)
            if not in_range:
                assert (reply.status_code, reply.json()["error"]["code"]) == (
                    422, "invalid_request"), reply.text
                continue
            assert reply.status_code == 201, reply.text
            self.enqueued.add(job_id)

    @precondition(lambda self: len(self.clients) < len(WORKER_IDS))
    @rule(which=st.sampled_from(WORKER_IDS), concurrency=st.integers(1, 3))
    def connect(self, which: str, concurrency: int) -> None:
        if which in self.clients:
            twin = Client(self.live.ws, which, self.spec, concurrency)
            twin.raw.beat(registration=twin.registration)
            self.expect_error(twin, {"worker_id_in_use"})
            return
        client = Client(self.live.ws, which, self.spec, concurrency)
        client.beat(registration=client.registration, capacity=concurrency)
        self.clients[which] = client

    # What a worker holds depends on the server's timing, so choices among held jobs are
    # drawn as plain numbers up front: hypothesis must draw the same way on every replay.
    def pick_client(self, pick: int) -> Client:
        return sorted(self.clients.values(), key=lambda c: c.id)[pick % len(self.clients)]

    @precondition(lambda self: self.clients)
    @rule(who=st.integers(0, 99), pick=st.integers(0, 99))
    def report(self, who: int, pick: int) -> None:
        client = self.pick_client(who)
        client.settle()
        if not client.held:
            return
        job_id = sorted(client.held)[pick % len(client.held)]
        attempt = client.held.pop(job_id)
        ack = client.beat(results=[completed({"id": job_id, "attempt": attempt}, client.id)],
                          capacity=client.concurrency - len(client.held))
        assert ack.get("accepted") == [job_id], ack
        self.completed.add(job_id)

    @precondition(lambda self: len(self.clients) >= 2)
    @rule(who=st.integers(0, 99), shift=st.integers(1, 2))
    def report_for_another(self, who: int, shift: int) -> None:
        """A result for a job another worker holds must be refused."""
        thief = self.pick_client(who)
        owner = self.pick_client(who + max(1, shift % len(self.clients)))
        owner.settle()
        if not owner.held:
            return
        job_id, attempt = sorted(owner.held.items())[0]
        ack = thief.beat(results=[completed({"id": job_id, "attempt": attempt}, "stolen")])
        assert "accepted" not in ack and ack["rejected"][0]["job_id"] == job_id

    @precondition(lambda self: self.clients)
    @rule(who=st.integers(0, 99), kind=st.sampled_from(sorted(GARBAGE)))
    def send_garbage(self, who: int, kind: str) -> None:
        client = self.clients.pop(self.pick_client(who).id)
        frame, codes = GARBAGE[kind]
        if isinstance(frame, str):
            frame = frame.replace('"W"', f'"{client.id}"')
        client.raw.send(frame)
        self.expect_error(client, codes)

    @precondition(lambda self: self.clients)
    @rule(who=st.integers(0, 99), abrupt=st.booleans())
    def disconnect(self, who: int, abrupt: bool) -> None:
        self.clients.pop(self.pick_client(who).id).close(abrupt)

    def expect_error(self, client: Client, codes: set[str]) -> None:
        try:
            while True:
                frame = client.raw.recv(timeout=5)
                if frame["type"] == "error":
                    assert frame["code"] in codes, (frame, codes)
                    break
        finally:
            client.close()

    # -- invariants ---------------------------------------------------------------------
    @invariant()
    def server_answers(self) -> None:
        assert self.http.get("/healthz").status_code == 200
        assert not self.errors.records, self.errors.records

    @invariant()
    def no_job_held_twice_or_lost(self) -> None:
        holders: dict[str, str] = {}
        for client in self.clients.values():
            client.settle()
            for job_id in client.held:
                assert job_id not in holders, f"{job_id} held by {holders[job_id]} and {client.id}"
                holders[job_id] = client.id
        with contextlib.closing(sqlite3.connect(self.live.settings.db)) as conn:
            rows = dict(conn.execute("SELECT id, state FROM jobs").fetchall())
            owners = dict(conn.execute("SELECT id, worker_id FROM jobs WHERE state = 'active'"))
        assert set(rows) == self.enqueued  # none lost, none made up
        for job_id in self.completed:
            assert rows[job_id] == "completed"
        for job_id, worker_id in holders.items():
            assert owners.get(job_id) == worker_id, (job_id, worker_id, owners.get(job_id))


ProtocolModel.TestCase.settings = settings(
    max_examples=8, stateful_step_count=15, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.timeout(120)
def test_protocol_model() -> None:
    ProtocolModel.TestCase().runTest()
