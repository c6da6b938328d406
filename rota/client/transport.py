"""The sync client's one HTTP/1.1 connection to a server: a request written in one send,
an answer read with no more parsing than the API's answers need.

The standard library's http.client cost about 150 µs of CPU a call here, most of it in
parsing the answer's headers through the email package; h11 (httpx's parser) cost
more, 167 µs; reading the status line, ``Content-Length``, ``Transfer-Encoding`` and
``Connection`` by hand costs about 50 µs (docs/performance.md, "The producer path").
For a producer that enqueues one job at a time the client is on every round trip.

Errors keep http.client's kinds, which the caller already knows: ``RemoteDisconnected``
for a kept-alive connection the server had closed before answering, ``BadStatusLine``,
``IncompleteRead`` and ``HTTPException`` for an answer that is not HTTP/1.x, or is
cut short; ``OSError`` (``TimeoutError`` among them) from the socket.
"""

from __future__ import annotations

import http.client
import select
import socket
import time
import urllib.parse
from typing import Any

from rota.base.errors import ApiError
from rota.base.tls import system_trust

# A kept-alive connection idle longer than this is not reused: the server closes idle
# ones after 5 s, and a request sent as it does so would be lost in the race.
IDLE_REUSE = 2.0
IDEMPOTENT = frozenset({"GET", "PUT", "DELETE", "HEAD"})
MAX_HEAD = 64 * 1024  # bytes of status line and headers: past this, it is not our server
READ = 65536


class Connection:
    """A socket, and what was read from it past the last answer (nothing, normally)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def _more(self) -> bytes:
        data = self.sock.recv(READ)
        if not data:
            raise EOFError
        return data

    def answer(self, method: str) -> tuple[int, bytes, bool]:
        """(status, body, whether the server closes the connection after it)."""
        while True:
            status, version, headers = self._head()
            if not 100 <= status < 200 or status == 101:
                break  # (an interim 1xx answer, 100 Continue, is followed by the real one)
        close = headers.get("connection", "").lower()
        will_close = "close" in close or (version == "HTTP/1.0" and "keep-alive" not in close)
        if method == "HEAD" or status in (204, 304):
            return status, b"", will_close
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return status, self._chunked(), will_close
        length = headers.get("content-length")
        if length is None:  # the body runs to the end of the connection
            return status, self._to_end(), True
        if not length.isdigit():
            raise http.client.HTTPException(f"a bad Content-Length: {length[:40]!r}")
        return status, self._exactly(int(length)), will_close

    def dropped(self) -> bool:
        """Whether a kept-alive connection, between requests, has something to read: the
        server closed it (a restart, an idle timeout) or sent what nobody asked for.
        Either way a request must not go on it (as urllib3 judges a pooled connection)."""
        try:
            if hasattr(select, "poll"):
                poller = select.poll()  # (select() refuses a descriptor over 1023)
                poller.register(self.sock, select.POLLIN)
                return bool(poller.poll(0))
            return bool(select.select([self.sock], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def _head(self) -> tuple[int, str, dict[str, str]]:
        buf = self.buffer
        first = True
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > MAX_HEAD:
                raise http.client.HTTPException("an answer's headers over 64 KiB")
            # Not HTTP (a service that speaks first, and may then wait): said at once,
            # not after the whole timeout.
            if len(buf) >= 5 and not buf.startswith(b"HTTP/"):
                raise http.client.BadStatusLine(buf.split(b"\r\n", 1)[0][:100].decode("latin-1"))
            try:
                buf += self._more()
            except EOFError:
                if first and not buf:  # nothing at all: a kept-alive connection it closed
                    raise http.client.RemoteDisconnected(
                        "Remote end closed connection without response") from None
                raise http.client.IncompleteRead(buf) from None
            first = False
        lines = buf[:end].decode("latin-1").split("\r\n")
        self.buffer = buf[end + 4:]
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise http.client.BadStatusLine(lines[0][:100])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            # (a repeated header is joined, as http.client's getheader() would give it)
            headers[name] = f"{headers[name]}, {value.strip()}" if name in headers \
                else value.strip()
        return int(code), version, headers

    def _exactly(self, size: int) -> bytes:
        buf = self.buffer
        if len(buf) < size:
            parts = [buf]
            have = len(buf)
            while have < size:
                try:
                    data = self._more()
                except EOFError:
                    raise http.client.IncompleteRead(b"".join(parts), size - have) from None
                parts.append(data)
                have += len(data)
            buf = b"".join(parts)
        self.buffer = buf[size:]
        return buf[:size]

    def _line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > MAX_HEAD:
                raise http.client.HTTPException("a chunk line over 64 KiB")
            try:
                self.buffer += self._more()
            except EOFError:
                raise http.client.IncompleteRead(self.buffer) from None
        line, self.buffer = self.buffer[:end], self.buffer[end + 2:]
        return line

    def _chunked(self) -> bytes:
        parts = []
        while True:
            size_text = self._line().split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise http.client.HTTPException(f"a bad chunk size: {size_text[:40]!r}") from None
            if size == 0:
                while self._line():  # trailers, up to the blank line
                    pass
                return b"".join(parts)
            parts.append(self._exactly(size))
            if self._exactly(2) != b"\r\n":
                raise http.client.HTTPException("a chunk not ended by CRLF")

    def _to_end(self) -> bytes:
        parts = [self.buffer]
        self.buffer = b""
        while True:
            try:
                parts.append(self._more())
            except EOFError:
                return b"".join(parts)


class Transport:
    """One HTTP/1.1 connection to the server, opened on demand and kept alive."""

    def __init__(self, url: str, *, timeout: float, headers: dict[str, str]) -> None:
        self.url = url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ApiError(None, "bad_url", f"not an http(s) URL: {url!r} (give the server's"
                           " base URL, such as http://127.0.0.1:8000)")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        name = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.https else 80
        self.host_header = name if self.port == default else f"{name}:{self.port}"
        self.headers = {"Accept": "application/json", "Accept-Encoding": "identity",
                        **headers}
        lines = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        self._fixed = f"Host: {self.host_header}\r\n{lines}"
        self.token = "Authorization" in headers
        self._conn: Connection | None = None
        self._used_at = 0.0
        self.connected = False  # the last request got as far as a connection

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, method: str, path: str, *, body: bytes | None = None,
                params: dict[str, Any] | None = None, timeout: float | None = None
                ) -> tuple[int, bytes]:
        target = self.prefix + path
        if params:
            target += "?" + urllib.parse.urlencode(params)
        head = f"{method} {target} HTTP/1.1\r\n{self._fixed}"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        elif method in ("POST", "PUT", "PATCH"):
            head += "Content-Length: 0\r\n"
        message = (head + "\r\n").encode("latin-1") + (body or b"")
        if self._conn is not None and (time.monotonic() - self._used_at > IDLE_REUSE
                                       or self._conn.dropped()):
            self.close()
        reused = self._conn is not None
        try:
            return self._send(method, message, timeout)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.close()
            # A kept-alive connection the server had just closed: nothing was read, and a
            # request that means the same thing twice may go again on a new connection.
            if not (reused and method in IDEMPOTENT):
                raise
            return self._send(method, message, timeout)

    def _send(self, method: str, message: bytes, timeout: float | None) -> tuple[int, bytes]:
        self.connected = False
        conn = self._connection()
        self.connected = True  # from here on, the server may act on what it is sent
        conn.sock.settimeout(timeout or self.timeout)
        try:
            conn.sock.sendall(message)
            status, data, will_close = conn.answer(method)
        except BaseException:
            self.close()
            raise
        if will_close or conn.buffer:  # (bytes past the answer: nothing to trust on it)
            self.close()
        self._used_at = time.monotonic()
        return status, data

    def _connection(self) -> Connection:
        if self._conn is None:
            sock = socket.create_connection((self.host, self.port), self.timeout)
            try:
                # Small requests and answers: never wait for a delayed ACK (Nagle).
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self.https:
                    sock = system_trust().wrap_socket(sock, server_hostname=self.host)
            except BaseException:
                sock.close()
                raise
            self._conn = Connection(sock)
        return self._conn
