"""Frames the engine sends to pull workers (negative conns, no socket: rota/core/pulls.py),
delivered into the HTTP requests that wait for them (rota/server/pulling.py): an
``assign`` to the oldest FETCH waiting on its conn, an ``ack`` to the ACK or NACK waiting
for its seq. Any other frame (a cancel after a lapse) has nobody to hear it: dropped.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rota.base import protocol as p

log = logging.getLogger("rota.server")


class _Box:
    """A pull worker's conn as the Coordinator's outboxes look: ``send`` delivers."""

    __slots__ = ("conn", "mailbox")

    def __init__(self, mailbox: Mailbox, conn: int) -> None:
        self.mailbox, self.conn = mailbox, conn

    def send(self, frame: str) -> None:
        self.mailbox.deliver(self.conn, frame)

    def abort(self, code: str, message: str, close_code: int) -> None:
        pass  # (no socket: a request waiting on it times out)


class Outbox(Protocol):
    """What the shell needs of a worker's connection."""

    def send(self, frame: str) -> None: ...

    def abort(self, code: str, message: str, close_code: int) -> None: ...


class Mailbox:
    """Frames for pull workers (negative conns), into the requests that wait for them."""

    def __init__(self, unheard: Callable[[int, list[str]], None] | None = None) -> None:
        # An assign with jobs that nobody waits for: (conn, job ids), called soon after
        # (not inside the apply that delivers it), to give them back (Pulls.pull_unheard).
        self.unheard = unheard
        self._assigns: dict[int, collections.deque[asyncio.Future[p.Assign]]] = {}
        self._acks: dict[tuple[int, int], asyncio.Future[p.Ack]] = {}
        # Several servers on one database: what a FETCH awaits first, so that what the
        # others committed before it is seen (rota/server/cluster.py ``barrier``).
        self.barrier: Callable[[], Awaitable[None]] | None = None

    def box(self, conn: int) -> _Box | None:
        """The outbox of a pull worker's conn (None for a socket's)."""
        return _Box(self, conn) if conn < 0 else None

    def expect_assign(self, conn: int) -> asyncio.Future[p.Assign]:
        future: asyncio.Future[p.Assign] = asyncio.get_running_loop().create_future()
        self._assigns.setdefault(conn, collections.deque()).append(future)
        return future

    def expect_ack(self, conn: int, seq: int) -> asyncio.Future[p.Ack]:
        future: asyncio.Future[p.Ack] = asyncio.get_running_loop().create_future()
        self._acks[(conn, seq)] = future
        return future

    def forget(self, conn: int, future: asyncio.Future[Any]) -> None:
        """A request stopped waiting (answered, timed out, or gone)."""
        waiting = self._assigns.get(conn)
        if waiting is not None and future in waiting:
            waiting.remove(future)
            if not waiting:
                del self._assigns[conn]
        for key, found in list(self._acks.items()):
            if found is future:
                del self._acks[key]

    def deliver(self, conn: int, frame: str) -> None:
        message = p.decode_server_message(frame)
        future: asyncio.Future[Any] | None = None
        if isinstance(message, p.Assign):
            waiting = self._assigns.get(conn)
            while waiting and future is None:
                future = waiting.popleft()
                future = None if future.done() else future
            if waiting is not None and not waiting:
                del self._assigns[conn]
            if future is None and message.jobs:
                log.warning("pull assign unheard conn=%d jobs=%s: nobody waits; given back",
                            conn, ",".join(j.id for j in message.jobs))
                if self.unheard is not None:
                    asyncio.get_running_loop().call_soon(
                        self.unheard, conn, [j.id for j in message.jobs])
        elif isinstance(message, p.Ack):
            future = self._acks.pop((conn, message.seq), None)
        if future is not None and not future.done():
            future.set_result(message)
