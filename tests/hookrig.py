"""A webhook receiver for the tests, in-process: a small HTTP/1.1 server on asyncio that
keeps every request it gets (headers by lower-case name, body), answers with the status
it is told (and a Retry-After if told), and can go down (its port refuses connections)
and come back on the same port."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    status: int = 200  # what it was answered

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Receiver:
    status: int = 200
    retry_after: str | None = None
    delay: float = 0.0  # seconds before answering
    got: list[Received] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None
    _open: set[asyncio.StreamWriter] = field(default_factory=set)
    # While down, the port is held by a socket bound but not listening: connections are
    # refused, and no other process (another suite's client) is given the port meanwhile.
    _hold: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> Receiver:
        if self._hold is not None:
            self._hold.close()
            self._hold = None
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def down(self) -> None:
        """Refuse connections (the port is closed) until ``start`` again."""
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):
            writer.close()
        await self._server.wait_closed()
        self._server = None
        self._hold = socket.socket()
        self._hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._hold.bind(("127.0.0.1", self.port))

    async def close(self) -> None:
        if self._server is not None:
            await self.down()
        if self._hold is not None:
            self._hold.close()
            self._hold = None

    def event_ids(self) -> list[str]:
        return [r.json["id"] for r in self.got]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.got.append(Received(headers, body, self.status))
                if self.delay:
                    await asyncio.sleep(self.delay)  # noqa: sleep-ok (a slow receiver, on purpose)
                extra = f"Retry-After: {self.retry_after}\r\n" if self.retry_after else ""
                writer.write(f"HTTP/1.1 {self.status} X\r\nContent-Length: 2\r\n{extra}"
                             "Content-Type: text/plain\r\n\r\nok".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self._open.discard(writer)
            writer.close()
