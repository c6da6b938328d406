"""The server's own outgoing POSTs (endpoint deliveries, webhooks), as their users hold
them: an ``Egress`` whose connection pool (rota/server/egress_http.py, on httpx) is made
at its first POST. Importing httpx costs every server's start about 45 ms of CPU (its
command-line extras come with it), and a server with no endpoint and no webhook never
sends anything."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rota.base.egress import MAX_BODY, Answer

if TYPE_CHECKING:
    from rota.server.egress_http import HttpPool


class Egress:
    """One pool of outgoing connections and its ``post``, for the server's life (one per
    user: the deliverer, the webhooks); ``aclose`` at shutdown. ``allow_private`` (rota
    serve --allow-private-endpoints) lifts the address check; ``ssl_context``: the
    certificates trusted (default: certifi's CAs), a context given must verify too;
    ``pools`` and ``max_keepalive``: see ``HttpPool``."""

    def __init__(self, *, allow_private: bool, pools: int = 16, max_keepalive: int = 32,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._options = {"allow_private": allow_private, "pools": pools,
                         "max_keepalive": max_keepalive, "ssl_context": ssl_context}
        self._pool: HttpPool | None = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   timeout: float, max_body: int = MAX_BODY) -> Answer:
        """POST ``body`` to ``url``: the answer, or why there is none (``HttpPool.post``);
        never raises for what the network or the other side does."""
        if self._pool is None:
            from rota.server.egress_http import HttpPool  # (the first POST pays the import)
            self._pool = HttpPool(**self._options)  # type: ignore[arg-type]
        return await self._pool.post(url, body, headers, timeout=timeout, max_body=max_body)

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
