"""The server's own outgoing POSTs (endpoint deliveries, webhooks): one keep-alive pool,
TLS verified, no proxy from the environment, each connection only to an address checked
against rota/base/egress.py, same-host redirects only, the answer's body capped. Made
through rota/server/outbound.py, at the first POST: this module imports httpx."""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import ssl
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpcore
import httpx

from rota.base.egress import MAX_BODY, MAX_REDIRECTS, Answer, ErrorKind, address_refused

try:
    import sniffio  # noqa: F401
except ImportError:
    # httpcore imports sniffio at each request's start and end when it can (anyio 4 no
    # longer brings it); a failed import is not remembered, so each searched sys.path
    # again (27 µs, several a request). None here makes it fail at once.
    sys.modules["sniffio"] = None  # type: ignore[assignment]


class _AddressRefused(Exception):
    """A host resolved to an address rota/base/egress.py refuses."""


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, resolving the host itself and connecting only to an
    address it checked: the name is resolved once, here, so a second lookup cannot
    answer otherwise (DNS rebinding). The URL keeps its host name, so the pool's keys,
    the Host header and TLS's server name (SNI, certificate check) are the name's."""

    def __init__(self, allow_private: bool) -> None:
        self.allow_private = allow_private
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[Any] | None = None
                          ) -> httpcore.AsyncNetworkStream:
        try:
            found = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as exc:
            raise httpcore.ConnectError(f"DNS failure for {host}: {exc}") from None
        addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
        self._check(addresses)  # any refused address refuses the name
        failure: Exception = httpcore.ConnectError(f"{host} has no address")
        for address in addresses:
            try:
                stream = await self._inner.connect_tcp(address, port, timeout, local_address,
                                                       socket_options)
            except httpcore.ConnectError as exc:
                failure = httpcore.ConnectError(f"{address} port {port}: {_cause(exc)}")
                continue
            peer = stream.get_extra_info("server_addr")  # (belt and braces: the peer's own)
            if peer:
                try:
                    self._check([str(peer[0])])
                except _AddressRefused:
                    await stream.aclose()
                    raise
            return stream
        raise failure

    def _check(self, addresses: list[str]) -> None:
        if self.allow_private:
            return
        for address in addresses:
            why = address_refused(address)
            if why is not None:
                raise _AddressRefused(why)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        raise _AddressRefused("unix sockets are not endpoints")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class HttpPool:
    """A pool of outgoing connections and its ``post``. One per user (the deliverer,
    the webhooks), for the server's life; ``aclose`` at shutdown. ``allow_private``
    (rota serve --allow-private-endpoints) lifts the address check."""

    def __init__(self, *, allow_private: bool, pools: int = 16, max_keepalive: int = 32,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context``: the certificates trusted (default: httpx's, certifi's CAs);
        a context given must verify too (the tests give one trusting their own CA).
        ``pools``: calls go round them, each keeping up to ``max_keepalive`` idle
        connections (httpcore's pool scans its connections for each request waiting, a
        cost in the square of those in flight: at 50 in flight to one local endpoint, one
        pool took 1.8 ms of CPU per POST, 436 POSTs/s; 16 pools 0.75 ms, 1300/s)."""
        context = ssl_context or httpx.create_ssl_context(verify=True, trust_env=False)
        backend = _CheckedBackend(allow_private)
        self._clients = [self._client(context, backend, max_keepalive) for _ in range(pools)]
        self._turn = itertools.cycle(self._clients)

    @staticmethod
    def _client(context: ssl.SSLContext, backend: _CheckedBackend,
                max_keepalive: int) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(verify=context, trust_env=False)
        # httpx takes no network backend of its own: its pool is replaced by one that
        # has ours (httpcore's public constructor), with the same TLS context.
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=context, max_connections=None,
            max_keepalive_connections=max_keepalive, keepalive_expiry=5.0,
            network_backend=backend)
        return httpx.AsyncClient(transport=transport, follow_redirects=False, trust_env=False)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   timeout: float, max_body: int = MAX_BODY) -> Answer:
        """POST ``body`` to ``url``; the answer within ``timeout`` seconds (connecting,
        redirects and reading the body included), never an exception for a network
        failure: ``Answer.error`` says which. A redirect to the same scheme, host and
        port is POSTed again (the same body and headers), up to MAX_REDIRECTS; another
        one is returned as the 3xx answer it is."""
        start = time.monotonic()
        redirects = 0
        # Ours wins: a cap on what is read, never inflated (a gzip bomb is a few KiB).
        sent = {**{k: v for k, v in headers.items() if k.lower() != "accept-encoding"},
                "Accept-Encoding": "identity"}
        try:
            async with asyncio.timeout(timeout):
                while True:
                    async with next(self._turn).stream("POST", url, content=body, headers=sent,
                                                   timeout=timeout) as response:
                        got, truncated = await _read(response, max_body)
                        target = _same_host_redirect(url, response)
                        if target is None or redirects >= MAX_REDIRECTS:
                            return Answer(status=response.status_code,
                                          headers={k.lower(): v for k, v in
                                                   response.headers.items()},
                                          body=got, truncated=truncated, url=url,
                                          ms=_ms(start), redirects=redirects)
                    url, redirects = target, redirects + 1
        except (TimeoutError, httpx.TimeoutException):
            return _failed("timeout", f"no answer within {timeout:g} s", url, start, redirects)
        except _AddressRefused as exc:
            return _failed("address_refused", str(exc), url, start, redirects)
        except httpx.ConnectError as exc:
            text = str(exc) or type(exc).__name__
            why = text if text.startswith("DNS") else f"cannot connect: {text}"
            return _failed("connect", why, url, start, redirects)
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
            return _failed("connect", f"connection reset or closed: {_cause(exc)}", url,
                           start, redirects)
        except httpx.InvalidURL as exc:  # (one url_problem lets by: an invalid IDNA name)
            return _failed("invalid_url", f"cannot be requested: {exc}", url, start,
                           redirects)
        except httpx.HTTPError as exc:  # (an unsupported URL, a protocol error of ours)
            return _failed("connect", f"{type(exc).__name__}: {exc}", url, start, redirects)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()


async def _read(response: httpx.Response, cap: int) -> tuple[bytes, bool]:
    """The body's first ``cap`` bytes as sent, and whether there was more (never read).
    Raw: an answer compressed against our Accept-Encoding is read as the bytes it is
    (not JSON: a bad response), never inflated past the cap."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], True
    return b"".join(chunks), False


def _same_host_redirect(url: str, response: httpx.Response) -> str | None:
    """Where a redirect leads if it stays on ``url``'s scheme, host and port."""
    location = response.headers.get("location")
    if not (300 <= response.status_code < 400) or not location:
        return None
    target = urljoin(url, location)
    return target if same_origin(url, target) else None


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs share scheme, host and port (the default port if none)."""
    try:
        x, y = urlsplit(a), urlsplit(b)
        defaults = {"http": 80, "https": 443}
        return (x.scheme, x.hostname, x.port or defaults.get(x.scheme)) == \
            (y.scheme, y.hostname, y.port or defaults.get(y.scheme))
    except ValueError:
        return False


def _cause(exc: BaseException) -> str:
    """The operating system's own words under a wrapped connect error ("Connection
    refused"), else the error's."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno)
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__


def _ms(start: float) -> float:
    return (time.monotonic() - start) * 1000


def _failed(kind: ErrorKind, message: str, url: str, start: float, redirects: int) -> Answer:
    return Answer(error=kind, message=message, url=url, ms=_ms(start), redirects=redirects)
