"""One worker connection on /work: decode frames, keep their order, send what is due.

The receive loop never waits on the disk: the coordinator sends each frame when the
engine releases it (an ack that answers results, after their COMMIT). A connection
over its rate limit is throttled: the loop stops reading it for a while, and TCP
pushes back on the worker; nothing it sent is refused and none of its jobs is touched.
Any bad frame ends the connection with an ``error`` frame and a close code; other
workers are untouched.

The other way round, a worker that does not read what it is sent would make the server
hold it all. Whenever a send has to wait (the socket's buffer is over the high-water
mark), the session tells the engine, which stops giving that worker jobs until the
backlog drains; one that leaves more than the limit unread for too long is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from rota.base import protocol as p
from rota.core.auth import Principal
from rota.core.heartbeats import plain
from rota.core.model import Instant
from rota.server.coordinator import Coordinator
from rota.server.gate import error_body, principal_of
from rota.base.logs import printable
from rota.core.policy import TokenBucket
from rota.server.safety import incident_id

log = logging.getLogger("rota.server")
WIRE = "rota.wire"  # the scope extension under which the connection offers a ``Wire``
PAUSE = "rota.pause"  # a message's throttle pause, spent when the callback read it
# How long a closing connection waits for its backlog to go, and then for its close frame:
# a worker that reads takes milliseconds; one that does not is dropped after this.
CLOSE_WAIT = 2.0


class Wire(Protocol):
    """What a session asks of the WebSocket connection under it (rota/server/edge.py
    LeanWebSocket): how much of what it sent the worker has not read."""

    def buffered(self) -> int: ...  # bytes written and not yet taken by the kernel

    def backed_up(self) -> bool: ...  # over the high-water mark: a send would wait

    async def drained(self) -> None: ...  # until it is under the low-water mark

    def drop(self) -> None: ...  # end the connection now, discarding what is buffered

    def write_text(self, text: str) -> bool: ...  # written now (False: use the ASGI send)

    on_text: Callable[[str], dict[str, object] | None] | None  # see Session.on_text
    on_control: Callable[[int], None] | None  # see Session.on_control


async def _finish_send(coro: Coroutine[Any, Any, None], waiting_on: Any) -> None:
    """Drive a send coroutine that was started by hand and suspended on ``waiting_on``
    (an asyncio future: the transport's buffer is full) to its end."""
    try:
        while True:
            if isinstance(waiting_on, asyncio.Future):
                await asyncio.wait([waiting_on])  # its outcome is the coroutine's to read
            else:  # a bare yield (asyncio.sleep(0)): let the loop turn once
                await asyncio.sleep(0)
            try:
                waiting_on = coro.send(None)
            except StopIteration:
                return
    except BaseException:
        coro.close()
        raise


class _Goodbye(Exception):
    """The worker deregistered: end the connection cleanly once its ack is sent."""


class Session:
    def __init__(self, websocket: WebSocket, coordinator: Coordinator,
                 principal: Principal) -> None:
        self.ws = websocket
        self.coordinator = coordinator
        self.principal = principal
        settings = coordinator.settings
        self._frames = TokenBucket(settings.rate_limit, settings.rate_burst)
        self._bytes = TokenBucket(settings.rate_bytes, settings.rate_bytes_burst)
        self._throttled_since: float | None = None
        self._shared = False  # using the worker's own buckets (once it has registered)
        self.worker_id: str | None = None
        self.last_seq = -1
        self.conn = coordinator.attach(self)
        self._receiver: asyncio.Task[str] | None = None
        self._failure: p.FrameError | None = None
        self._open = False  # accepted, and no send has failed
        # Only while a send waits on the socket: the frames behind it, in order (a
        # stalled send first, as its coroutine and what it waits on), and the task that
        # sends them. Most connections never need either: an idle worker's connection
        # holds no queue and no task for sending (10,000 of them saved ~45 MiB).
        self._backlog: list[str | tuple[Coroutine[Any, Any, None], Any, int]] = []
        self._sender: asyncio.Task[None] | None = None
        # What the worker has not read: the backlog's characters (counted only while
        # there is one) and, from the wire, the socket's buffer. What the engine was last
        # told of it: full (a send waits), over (past outbox_limit).
        self._wire: Wire | None = (websocket.scope.get("extensions") or {}).get(WIRE)
        self._queued = 0
        self._full = False
        self._over = False
        # True while the receive loop waits for its next message with nothing in hand:
        # only then may a frame be handled in the protocol's callback (``on_text``)
        # without overtaking one the loop holds.
        self._idle = False
        # The last heartbeat handled in full, but for its seq (``p.split_seq``): a frame
        # the same but for a higher seq is a repeat (``Heartbeats.repeat``).
        self._rest: str | None = None

    # -- Outbox (what the coordinator calls) ------------------------------------------
    def send(self, frame: str) -> None:
        """Write the frame now if nothing is ahead of it, else queue it behind the rest.

        Writing at once saves a task switch per frame (an ack, an assign) and lets an
        assign leave before whatever the event loop runs next, such as the HTTP answer
        to the enqueue that caused it. A send only waits when the socket's buffer is
        full (the peer is not reading); then the half-done send is finished by the send
        loop and every later frame queues behind it, so order is kept.
        """
        if not self._open:
            return  # not accepted yet, or the socket is gone: nobody to send to
        if self._sender is not None:
            self._backlog.append(frame)
            self._queued += len(frame)
            if not self._over:
                self._watch()
            return
        if self._wire is not None and self._wire.write_text(frame):
            return  # written by the protocol itself: no ASGI message, no coroutine
        coro = self.ws.send_text(frame)
        try:
            waiting_on = coro.send(None)
        except StopIteration:
            return
        except Exception:  # the socket is gone: the receive side will find out
            self._open = False
            return
        self._backlog.append((coro, waiting_on, len(frame)))
        self._queued += len(frame)
        self._sender = asyncio.create_task(self._send_loop(), name="rota-session-send")
        self._watch()  # the socket's buffer is over the high-water mark: the outbox is full

    def abort(self, code: str, message: str, close_code: int) -> None:
        if self._failure is None:
            self._failure = p.FrameError(code, message, close_code)
        if self._receiver is not None:
            self._receiver.cancel()

    # -- the connection -------------------------------------------------------------
    async def run(self) -> None:
        await self.ws.accept()
        self._open = True
        if self._wire is not None:
            self._wire.on_text, self._wire.on_control = self.on_text, self.on_control
        self._receiver = asyncio.create_task(self._receive_loop(), name="rota-session-recv")
        reason = "connection_lost"
        try:
            reason = await self._receiver
        except p.FrameError as exc:
            self._failure = exc
        except asyncio.CancelledError:
            if self._failure is None:  # cancelled from outside, not by abort()
                raise
        except WebSocketDisconnect:
            pass
        except _Goodbye:
            reason = "goodbye"
            await self.coordinator.settled(self.conn)  # its last results are answered first
        except Exception as exc:  # a bug: say so, keep its jobs for the reconnect grace
            self._failure = self._internal(exc)
        finally:
            if self._wire is not None:
                self._wire.on_text = self._wire.on_control = None
            if self._failure is not None:
                reason = self._failure.code
                self.send(p.encode(p.Error(code=self._failure.code, message=self._failure.message)))
            if self.worker_id is not None:
                self.coordinator.disconnect(self.conn, self.worker_id, reason)
            try:
                await self._finish(goodbye=reason == "goodbye")
            finally:
                self.coordinator.detach(self.conn)

    def _internal(self, exc: Exception) -> p.FrameError:
        incident = incident_id()
        log.error("internal error id=%s handling a frame from worker=%s: %s", incident,
                  self.worker_id, type(exc).__name__, exc_info=exc)
        return p.FrameError("internal_error", "the server failed to handle a frame (logged"
                            f" as {incident}); reconnect", p.CLOSE_INTERNAL)

    async def _finish(self, *, goodbye: bool = False) -> None:
        sender = self._sender
        if sender is not None:  # every frame queued so far goes before the close
            try:
                await asyncio.wait_for(asyncio.shield(sender), timeout=CLOSE_WAIT)
            except (TimeoutError, Exception):
                sender.cancel()
        self._open = False  # nothing more is sent on this connection
        if goodbye:
            await self._close(1000, "goodbye")
        if self._failure is not None:
            # The token too: a refused registration has no worker id yet, and the token
            # is what an operator revokes.
            # (before registration: the worker_id the refused frame gave, if any)
            who = self.worker_id or printable(self._failure.worker_id or "None", 128)
            log.warning("protocol error worker=%s token=%s code=%s message=%s", who,
                        self.principal.token_id, self._failure.code,
                        printable(self._failure.message))
            await self._close(self._failure.close_code, self._failure.code)

    async def _close(self, code: int, reason: str) -> None:
        """Send a close frame; to a worker that does not read, it would wait behind the
        unread bytes for ever (and keep them in memory): that connection is dropped."""
        try:
            await asyncio.wait_for(self.ws.close(code=code, reason=reason), CLOSE_WAIT)
        except TimeoutError:
            if self._wire is not None:
                self._wire.drop()
        except Exception:  # the peer may have closed first, or be gone already
            pass

    async def _receive_loop(self) -> str:
        """Handle frames until the connection ends; return how it ended."""
        while True:
            message = await self._next_message()
            if message["type"] == "websocket.disconnect":
                # No close frame (the server sees 1005 or 1006): the connection was lost.
                # A close frame, whatever its code, means the peer chose to end it.
                code = message.get("code")
                return "connection_lost" if code in (1005, 1006, None) else "closed"
            text = message.get("text")
            if text is None:
                raise p.FrameError("binary_not_supported", "send JSON text frames, not binary",
                                   p.CLOSE_UNSUPPORTED)
            pause = message.get(PAUSE)  # (the fast path spent the tokens already)
            if pause is None:
                if self._over:  # the worker may have read some, with nothing sent to show it
                    self._watch()
                pause = self._spend(len(text))
            if pause > 0.0:
                await asyncio.sleep(pause)  # the throttle itself: the socket is not read meanwhile
            hb = p.decode_heartbeat(text)
            if self.worker_id is None and hb.registration is not None:
                # It may come from another server sharing the database, holding jobs
                # reserved through that one: this server takes them over first, so that
                # the registration reclaims them as after a restart (rota/server/cluster.py).
                await self.coordinator.take_over(hb, self.principal)
            self._handle(hb, text)

    async def _next_message(self) -> dict[str, object]:
        if self.worker_id is not None:
            self._idle = True
            try:
                return await self.ws.receive()
            finally:
                self._idle = False
        # Until it registers, a socket holds a slot for nothing: it gets a deadline.
        timeout = self.coordinator.settings.registration_timeout
        try:
            return await asyncio.wait_for(self.ws.receive(), timeout)
        except TimeoutError:
            raise p.FrameError("registration_timeout", f"no registration within {timeout:g}s",
                               p.CLOSE_POLICY) from None

    def on_text(self, text: str) -> dict[str, object] | None:
        """A text message, handled in the protocol's callback as it is parsed: no task
        wakes and no ASGI message is made for it, which is most of what a heartbeat cost.
        Returns None when it is handled (or dropped after a failure), else the message
        for the receive loop: before registration, a goodbye (it awaits its commit), a
        throttled sender (its pause, already spent, rides along) or while the loop is
        busy with an earlier frame, so that order holds."""
        if self._failure is not None:
            return None  # the connection is ending: what follows the bad frame is dropped
        if not self._idle or self.worker_id is None:
            self._idle = False
            return {"type": "websocket.receive", "text": text}
        try:
            if self._over:
                self._watch()
            now = self.coordinator.clock()  # (read once: an idle fleet's beats add up)
            pause = self._spend(len(text), now.mono)
            if pause <= 0.0:
                if self._rest is not None and self._repeated(text, now):
                    return None
                hb = p.decode_heartbeat(text)
                if not hb.goodbye:
                    self._handle(hb, text)
                    return None
        except p.FrameError as exc:
            self.abort(exc.code, exc.message, exc.close_code)
            return None
        except Exception as exc:  # a bug: as in run()
            failure = self._internal(exc)
            self.abort(failure.code, failure.message, failure.close_code)
            return None
        self._idle = False
        return {"type": "websocket.receive", "text": text, PAUSE: pause}  # (spent here)

    def on_control(self, size: int) -> None:
        """A ping, counted against the rate limits as a frame of ``size`` bytes. It is
        not paused for (it asks only a pong, sent to a reader alone: rota/server/edge.py);
        a peer over the limits for ``throttle_close_after`` is closed as ever."""
        if self._failure is None:
            try:
                self._spend(size)
            except p.FrameError as exc:
                self.abort(exc.code, exc.message, exc.close_code)
            except Exception as exc:  # a bug: as in run(), never into the protocol's callback
                failure = self._internal(exc)
                self.abort(failure.code, failure.message, failure.close_code)

    def _spend(self, size: int, now: float | None = None) -> float:
        """Hold a sender to the rate limits by not reading it for a while: the seconds to
        pause (spent now). Only one that stays over them for ``throttle_close_after`` is
        closed, and its jobs then get the reconnect grace that a lost connection gets."""
        if now is None:
            now = self.coordinator.clock().mono
        if self.worker_id is not None and not self._shared:
            # The worker's own buckets, kept across its connections: reconnecting does not
            # start a throttled worker afresh.
            self._frames, self._bytes = self.coordinator.buckets_for(self.worker_id)
            self._shared = True
        frames, size_wait = self._frames.wait(now), self._bytes.wait(now, size)
        pause = max(frames, size_wait)
        if pause <= 0.0:
            self._throttled_since = None
            return 0.0
        settings = self.coordinator.settings
        limit = (f"{settings.rate_limit:g} frames a second (burst {settings.rate_burst})"
                 if frames >= size_wait else f"{settings.rate_bytes} bytes a second")
        if self._throttled_since is None:
            self._throttled_since = now
            log.info("throttled worker=%s: over %s", self.worker_id, limit)
        elif now - self._throttled_since > settings.throttle_close_after:
            raise p.FrameError("rate_limited", f"over {limit} for"
                               f" {settings.throttle_close_after:g}s", p.CLOSE_POLICY)
        return pause

    def _repeated(self, text: str, now: Instant) -> bool:
        """Whether ``text`` was answered as a repeat of the last full heartbeat."""
        split = p.split_seq(text)
        if split is None or split[1] != self._rest or split[0] <= self.last_seq:
            return False  # (a seq not above the last is refused on the full path)
        assert self.worker_id is not None
        if not self.coordinator.repeat(self.conn, self.worker_id, split[0], now):
            return False
        self.last_seq = split[0]
        return True

    def _handle(self, hb: p.Heartbeat, text: str) -> None:
        self._rest = None
        if hb.seq <= self.last_seq:
            raise p.FrameError("seq_not_increasing",
                               f"seq {hb.seq} after {self.last_seq}", p.CLOSE_POLICY)
        self.last_seq = hb.seq
        if self.worker_id is None:
            if hb.registration is None:
                raise p.FrameError("registration_required",
                                   "the first heartbeat must carry a registration", p.CLOSE_POLICY)
            self.coordinator.receive(self.conn, hb, self.principal, first=True)
            self.worker_id = hb.worker_id
        elif hb.worker_id != self.worker_id:
            raise p.FrameError("worker_id_mismatch",
                               f"this connection is worker {self.worker_id}", p.CLOSE_POLICY)
        elif hb.registration is not None:
            raise p.FrameError("already_registered",
                               "registration is sent once, in the first heartbeat", p.CLOSE_POLICY)
        else:
            self.coordinator.receive(self.conn, hb, self.principal)
        if hb.goodbye:
            raise _Goodbye
        if plain(hb):  # (only such a beat may repeat: no other frame is kept)
            split = p.split_seq(text)
            if split is not None and split[0] == hb.seq:
                self._rest = split[1]

    async def _send_loop(self) -> None:
        """Send the backlog in order, then end once the socket's buffer is under its
        low-water mark: the next frame is written at once again, and the outbox is no
        longer full."""
        try:
            while True:
                while self._backlog:
                    item = self._backlog.pop(0)
                    if isinstance(item, tuple):
                        await _finish_send(item[0], item[1])
                        self._queued -= item[2]
                    else:
                        await self.ws.send_text(item)
                        self._queued -= len(item)
                    if self._over:
                        self._watch()
                if self._wire is None or not self._wire.backed_up():
                    break
                await self._wire.drained()  # the last frames filled the buffer again
        except asyncio.CancelledError:
            self._drop_backlog()
            raise
        except Exception:  # the socket is gone: the receive side will find out
            self._drop_backlog()
        finally:
            self._sender = None
        if self._open:
            self._watch()  # flowing again

    def _drop_backlog(self) -> None:
        self._open = False  # what is left, and anything sent later, is dropped
        for item in self._backlog:
            if isinstance(item, tuple):
                item[0].close()
        self._backlog.clear()
        self._queued = 0

    def _watch(self) -> None:
        """Tell the engine when the outbox becomes full or flows again, or crosses the
        limit. Called only while a send waits, or as that ends: never on the path of a
        frame written at once."""
        full = self._sender is not None
        unread = self._queued + (self._wire.buffered() if self._wire is not None else 0)
        over = unread > self.coordinator.settings.outbox_limit
        if (full, over) == (self._full, self._over):
            return
        self._full, self._over = full, over
        if self.worker_id is not None:  # before it registers, the engine knows no worker
            self.coordinator.outbox(self.conn, self.worker_id, full, over)


async def work_endpoint(websocket: WebSocket) -> None:
    coordinator: Coordinator = websocket.app.state.coordinator
    principal = principal_of(websocket.scope)
    if not principal.may("worker"):
        await deny(websocket, 403, "forbidden", f"a {principal.scope} token may not connect"
                   " to /work: it takes a worker or admin token")
        return
    sockets = coordinator.sockets
    cap = coordinator.settings.max_worker_connections_per_token
    if sockets[principal.token_id] >= cap:
        await deny(websocket, 429, "too_many_connections",
                   f"this token has {cap} open /work connections already")
        return
    sockets[principal.token_id] += 1
    try:
        await Session(websocket, coordinator, principal).run()
    finally:
        sockets[principal.token_id] -= 1


async def deny(websocket: WebSocket, status: int, code: str, message: str) -> None:
    """Refuse the handshake with an HTTP answer: the socket is never accepted."""
    await websocket.send_denial_response(
        Response(error_body(code, message), status_code=status, media_type="application/json"))
