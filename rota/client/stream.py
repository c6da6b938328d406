"""The client side of ``GET /events``: a server-sent event stream, read a line at a time,
that resumes where it stopped after a lost connection.

Each event arrives as ``id: N``, ``event: KIND`` and ``data: {json}`` lines ended by a
blank one; a line starting with ``:`` is a keep-alive (the server sends one at least every
15 s). The stream reconnects by itself after a transport failure or a silence longer than
``silence`` seconds, sending ``Last-Event-ID`` so the server replays what it missed from
its buffer (or says, with a ``gap`` event, what it could not). A refusal (a bad filter, a
missing token), or a server not reached on the first try, is not retried: it raises
``ApiError`` as ``Client`` does.
"""

from __future__ import annotations

import http.client
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from rota.client.client import ApiError
from rota.client.failures import dashboard_url, refusal, transport_error
from rota.base.tls import system_trust

SILENCE = 45.0  # seconds without a byte (three keep-alives missed): the connection is dead
BACKOFF = (0.2, 0.5, 1.0, 2.0, 5.0)  # seconds before each reconnection in a row
MAX_LINE = 1 << 20  # bytes: an event line longer than this is a broken stream


@dataclass(frozen=True, slots=True)
class Event:
    id: int | None
    kind: str
    data: dict[str, Any]


class EventStream:
    """``for event in EventStream(url, token=..., params={"event": "result"})``: every
    event from now on (or after ``last_event_id``), reconnecting as needed, until
    ``close()``. ``on_open(message)`` hears of each stream opened (the server sends
    every event from then on), ``on_retry(message)`` of each connection lost."""

    def __init__(self, url: str, *, token: str | None = None,
                 params: dict[str, str] | None = None, last_event_id: int | None = None,
                 silence: float = SILENCE, on_open: Callable[[str], None] | None = None,
                 on_retry: Callable[[str], None] | None = None) -> None:
        parts = urllib.parse.urlsplit(url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ApiError(None, "bad_url", f"not an http(s) URL: {url!r} (give the server's"
                           " base URL, such as http://127.0.0.1:8000)")
        if (error := dashboard_url(url)) is not None:
            raise error
        self.url = url.rstrip("/")
        self._parts = parts
        self._target = parts.path + "/events" + (
            "?" + urllib.parse.urlencode(params) if params else "")
        self._token = token
        self.last_event_id = last_event_id
        self.silence = silence
        self.on_open = on_open
        self.on_retry = on_retry
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False
        self._opened = False  # a stream was open once: failures from now on are retried
        self._connected = False  # the last attempt got as far as a connection

    def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()

    def __iter__(self) -> Iterator[Event]:
        failures = 0
        while not self._closed:
            try:
                response = self._open()
                if self.on_open is not None:
                    self.on_open(f"resumed after event {self.last_event_id}" if self._opened
                                 and self.last_event_id is not None
                                 else f"following the events of {self.url}")
                failures, self._opened = 0, True  # the next failure starts the backoff over
                yield from self._events(response)
                why = "the server ended the stream"
            except (OSError, http.client.HTTPException) as exc:
                if self._closed:
                    return
                connected = self._connected
                error = transport_error(self.url, exc, connected=connected, method="GET")
                if not self._opened:  # never reached: a wrong URL, not a blip
                    raise error from exc
                why = error.message
            finally:
                if self._conn is not None:
                    self._conn.close()
            if self._closed:
                return
            wait = BACKOFF[min(failures, len(BACKOFF) - 1)]
            failures += 1
            if self.on_retry is not None:
                self.on_retry(f"{why}; reconnecting in {wait:g}s"
                              + (f" from event {self.last_event_id}"
                                 if self.last_event_id is not None else ""))
            time.sleep(wait)  # noqa: sleep-ok (the pause before reconnecting)

    def _open(self) -> http.client.HTTPResponse:
        parts = self._parts
        self._connected = False  # (a failure before this is "unreachable", after it not)
        if parts.scheme == "https":
            self._conn = http.client.HTTPSConnection(
                parts.hostname or "", parts.port or 443, timeout=self.silence,
                context=system_trust())
        else:
            self._conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80,
                                                    timeout=self.silence)
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        if self.last_event_id is not None:
            headers["Last-Event-ID"] = str(self.last_event_id)
        self._conn.connect()
        self._connected = True
        self._conn.request("GET", self._target, headers=headers)
        response = self._conn.getresponse()
        if response.status >= 500 and self._opened:  # a server restarting: try again
            raise http.client.HTTPException(f"it answered HTTP {response.status}")
        if response.status != 200:
            content = response.read()
            try:
                answer = msgspec.json.decode(content) if content else None
            except msgspec.DecodeError:
                answer = None
            self._closed = True
            raise refusal(response.status, answer, content, token=bool(self._token),
                          url=self.url)
        if self._conn.sock is not None:
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return response

    def _events(self, response: http.client.HTTPResponse) -> Iterator[Event]:
        """Events as their blank lines end them (the format of the SSE specification)."""
        event_id: int | None = None
        kind, data = "message", []
        while not self._closed:
            raw = response.readline(MAX_LINE + 1)
            if not raw:
                return  # the end of the stream
            if len(raw) > MAX_LINE:
                raise http.client.HTTPException("an event line over 1 MiB")
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if not line:
                if data:
                    if event_id is not None:
                        self.last_event_id = event_id
                    yield Event(event_id, kind, _decode("\n".join(data), kind))
                event_id, kind, data = None, "message", []
                continue
            if line.startswith(":"):
                continue  # a keep-alive comment
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            elif name == "event":
                kind = value
            elif name == "id" and value.isdigit():
                event_id = int(value)


def _decode(text: str, kind: str) -> dict[str, Any]:
    """An event's data: a JSON object (with ``kind``), or the text as ``message``."""
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        value = None
    if not isinstance(value, dict):
        value = {"message": text}
    value.setdefault("kind", kind)
    return value
