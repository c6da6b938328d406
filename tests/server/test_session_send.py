"""Session.send writes a frame at once when nothing is ahead of it, and when the socket
makes a send wait (its buffer is full), finishes that send on the send loop with every
later frame behind it: order is kept whatever the socket does."""

from __future__ import annotations

import asyncio
from typing import Any

from rota.core.auth import OPEN
from rota.server.sessions import WIRE, Session, _finish_send
from rota.core.settings import ServerSettings


class FakeSocket:
    """A WebSocket whose sends complete at once, except while ``drained`` is clear."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.drained = asyncio.Event()
        self.drained.set()
        self.scope: dict[str, Any] = {"extensions": {}}

    async def send_text(self, frame: str) -> None:
        await self.drained.wait()  # no suspension while drained, as uvicorn's writable
        self.sent.append(frame)


class FakeWire:
    """The connection under a FakeSocket: ``unread`` bytes in its buffer, backed up
    while the socket's sends wait."""

    def __init__(self, ws: FakeSocket) -> None:
        self.ws = ws
        self.unread = 0
        self.dropped = False
        ws.scope["extensions"][WIRE] = self

    def buffered(self) -> int:
        return self.unread

    def backed_up(self) -> bool:
        return not self.ws.drained.is_set()

    async def drained(self) -> None:
        await self.ws.drained.wait()

    def drop(self) -> None:
        self.dropped = True

    on_text = None

    def write_text(self, text: str) -> bool:
        return False  # every send goes through the socket's own send, which these tests drive


class FakeCoordinator:
    settings = ServerSettings(outbox_limit=10)

    def __init__(self) -> None:
        self.told: list[tuple[bool, bool]] = []  # (full, over), as the engine heard them

    def attach(self, outbox: Any) -> int:
        return 1

    def outbox(self, conn: int, worker_id: str, full: bool, over: bool) -> None:
        self.told.append((full, over))


def session(ws: FakeSocket) -> Session:
    s = Session(ws, FakeCoordinator(), OPEN)  # type: ignore[arg-type]
    s._open = True  # accepted
    return s


async def test_a_frame_is_written_before_send_returns_when_nothing_is_ahead():
    ws = FakeSocket()
    s = session(ws)
    s.send("a")
    s.send("b")
    assert ws.sent == ["a", "b"]  # no task switch needed


async def test_a_send_the_socket_holds_up_is_finished_in_order_by_the_send_loop():
    ws = FakeSocket()
    s = session(ws)
    s.send("a")
    assert s._sender is None  # nothing waited: no task was needed
    ws.drained.clear()  # the peer stops reading
    s.send("b")  # starts, then waits on the socket
    s.send("c")  # queued behind it
    s.send("d")
    assert ws.sent == ["a"] and s._sender is not None
    ws.drained.set()
    for _ in range(100):  # loop turns, not time
        if len(ws.sent) == 4 and s._sender is None:
            break
        await asyncio.sleep(0)  # noqa: sleep-ok (one loop turn)
    assert ws.sent == ["a", "b", "c", "d"] and s._backlog == [] and s._sender is None
    s.send("e")  # all caught up: written at once again, and the send task is gone
    assert ws.sent[-1] == "e"


async def test_a_socket_that_fails_while_frames_wait_drops_them_and_closes_the_path():
    class Failing(FakeSocket):
        async def send_text(self, frame: str) -> None:
            await self.drained.wait()
            if frame != "a":
                raise RuntimeError("the peer is gone")
            self.sent.append(frame)

    ws = Failing()
    s = session(ws)
    ws.drained.clear()
    s.send("a")  # waits on the socket
    s.send("b")
    sender = s._sender
    assert sender is not None
    ws.drained.set()
    await asyncio.wait_for(sender, 5)  # ends without an exception left unread
    assert ws.sent == ["a"] and s._open is False and s._backlog == []
    s.send("c")  # dropped: the socket is gone
    assert ws.sent == ["a"] and s._sender is None


async def test_a_send_that_fails_at_once_closes_the_direct_path():
    class Broken(FakeSocket):
        async def send_text(self, frame: str) -> None:
            raise RuntimeError("Cannot call send once a close message has been sent")

    s = session(Broken())
    s.send("a")  # no exception reaches the caller (the engine's effects)
    assert s._open is False and s._sender is None and s._backlog == []


async def test_finish_send_drives_a_coroutine_through_futures_and_bare_yields():
    loop = asyncio.get_running_loop()
    gate: asyncio.Future[None] = loop.create_future()
    steps: list[str] = []

    async def sending() -> None:
        steps.append("start")
        await gate
        steps.append("gate passed")
        await asyncio.sleep(0)  # noqa: sleep-ok (one loop turn)
        steps.append("done")

    coro = sending()
    waiting_on = coro.send(None)
    assert waiting_on is gate and steps == ["start"]
    finisher = asyncio.create_task(_finish_send(coro, waiting_on))
    await asyncio.sleep(0)  # noqa: sleep-ok (one loop turn)
    assert steps == ["start"]
    gate.set_result(None)
    await finisher
    assert steps == ["start", "gate passed", "done"]


async def test_the_engine_hears_when_sends_wait_when_the_limit_is_passed_and_when_they_flow():
    ws = FakeSocket()
    wire = FakeWire(ws)
    s = session(ws)
    coordinator = s.coordinator
    s.worker_id = "w1"
    s.send("a")
    assert coordinator.told == []  # a frame written at once costs no look at the buffer
    ws.drained.clear()  # the worker stops reading: its buffer is over the high-water mark
    wire.unread = 8
    s.send("b")
    assert coordinator.told == [(True, False)]  # full: no new jobs
    s.send("cdef")  # 8 in the socket's buffer and 5 behind it: over the limit of 10
    assert coordinator.told == [(True, False), (True, True)]
    wire.unread = 0
    ws.drained.set()  # it reads again
    sender = s._sender
    assert sender is not None
    await asyncio.wait_for(sender, 5)
    assert coordinator.told[-1] == (False, False) and ws.sent == ["a", "b", "cdef"]
    assert s._queued == 0


async def test_a_close_that_the_worker_never_reads_drops_the_connection(monkeypatch):
    monkeypatch.setattr("rota.server.sessions.CLOSE_WAIT", 0.01)

    class Unread(FakeSocket):
        async def close(self, code: int, reason: str) -> None:
            await self.drained.wait()

    ws = Unread()
    wire = FakeWire(ws)
    ws.drained.clear()
    await session(ws)._close(1008, "slow_consumer")
    assert wire.dropped
