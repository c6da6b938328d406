"""One webhook POST, classified (rota/core/webhooks.py ``answered``): the receiver's
address checked first (rota/base/egress.py: a private one is refused unless the server
allows private endpoints), no redirect followed, the answer read up to a cap.
"""

from __future__ import annotations

import asyncio
import socket
import time
from urllib.parse import urlsplit

import httpx

from rota.base.egress import address_refused
from rota.core.webhooks import Outcome, answered, retry_after

SHOWN = 2048  # bytes of the answer kept in the delivery log


async def refused_address(url: str) -> str | None:
    """Why ``url``'s host may not be sent to (None: every address it has is public);
    a name that does not resolve is a connection failure, retried."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for info in infos:
        why = address_refused(str(info[4][0]))
        if why is not None:
            return why
    return None


async def post(client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str],
               timeout: float, allow_private: bool) -> Outcome:
    start = time.perf_counter()

    def took() -> float:
        return round((time.perf_counter() - start) * 1000, 1)

    try:
        if not allow_private:
            why = await refused_address(url)
            if why is not None:
                return Outcome(None, f"address_refused: {why}", False, ms=took())
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, content=body, headers=headers) as answer:
                shown = b""
                async for chunk in answer.aiter_raw():
                    shown += chunk
                    if len(shown) >= SHOWN:
                        break
                text = shown[:SHOWN].decode(errors="replace")
                return answered(answer.status_code,
                                retry_after(answer.headers.get("retry-after"), time.time()),
                                took(), text)
    except TimeoutError:
        return Outcome(None, f"timeout: no answer within {timeout:g} s", True, ms=took())
    except socket.gaierror as exc:
        return Outcome(None, f"connect: the name does not resolve ({exc.strerror})", True,
                       ms=took())
    except httpx.ConnectError as exc:
        return Outcome(None, f"connect: {exc or 'connection refused'}", True, ms=took())
    except (httpx.HTTPError, OSError) as exc:
        return Outcome(None, f"connect: {type(exc).__name__}: {exc}"[:300], True, ms=took())
