"""The server's own outgoing POSTs (endpoint deliveries, webhooks), as their users hold
them: an ``Egress`` whose connection pool (rota/server/egress_http.py, on httpx) is made
at its first POST. Importing httpx (and the command-line extras it brings) was a third
of a server's start (0.13 of 0.43 s of CPU, docs/performance.md), and a server with no
endpoint and no webhook never sends anything."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rota.base.egress import MAX_BODY, Answer

if TYPE_CHECKING:
    from rota.server.egress_http import HttpPool

log = logging.getLogger("rota.server")


class Egress:
    """One pool of outgoing connections and its ``post``, for the server's life (one per
    user: the deliverer, the webhooks); ``aclose`` at shutdown. ``allow_private`` (rota
    serve --allow-private-endpoints) lifts the address check; ``ssl_context``: the
    certificates trusted (default: certifi's CAs), a context given must verify too;
    ``pools`` and ``max_keepalive``: see ``HttpPool``."""

    def __init__(self, *, allow_private: bool, pools: int = 16, max_keepalive: int = 32,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._allow_private, self._pools = allow_private, pools
        self._max_keepalive, self._ssl_context = max_keepalive, ssl_context
        self._pool: HttpPool | None = None
        self._broken = False  # the pool could not be made (said once in the log)

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *,
                   timeout: float, max_body: int = MAX_BODY) -> Answer:
        """POST ``body`` to ``url``: the answer, or why there is none (``HttpPool.post``);
        never raises for what the network or the other side does, nor for a pool that
        cannot be made (a broken TLS setup: each POST is a connect error saying so)."""
        if self._pool is None:
            try:
                from rota.server.egress_http import HttpPool  # (the first POST pays)
                self._pool = HttpPool(allow_private=self._allow_private, pools=self._pools,
                                      max_keepalive=self._max_keepalive,
                                      ssl_context=self._ssl_context)
            except Exception as exc:  # noqa: BLE001 (any: the callers' tasks must go on)
                if not self._broken:
                    log.error("the server cannot send requests of its own: %s", exc)
                    self._broken = True
                return Answer(error="connect", message=f"the server cannot send: {exc}",
                              url=url)
        return await self._pool.post(url, body, headers, timeout=timeout, max_body=max_body)

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.aclose()
