"""The shell of push execution (rota/core/endpoints.py decides): at a start, the callback
key and the versions of push-executed specs from the store; each ``Deliver`` effect run on
its own task by the deliverer (rota/server/deliverer.py), its answer handed back to the
engine. The callback routes an endpoint uses after a 202 are rota/server/callbacks.py.
"""

from __future__ import annotations

import asyncio
import logging
import secrets as random
from collections.abc import Callable
from typing import Any

from rota.base import protocol as p
from rota.base.push import Delivered, Delivery
from rota.core.engine import Engine
from rota.core.model import Instant
from rota.core.settings import ServerSettings
from rota.store.store import Store

log = logging.getLogger("rota.server")


class Pusher:
    """Runs the engine's deliveries and hands their answers back."""

    def __init__(self, settings: ServerSettings, store: Store, engine: Engine,
                 apply: Callable[..., None], clock: Callable[[], Instant],
                 secrets: Callable[[str], list[bytes] | None]) -> None:
        self.settings, self.store, self.engine = settings, store, engine
        self.apply, self.clock, self.secrets = apply, clock, secrets
        self.tasks: set[asyncio.Task[None]] = set()
        self.deliverer: Any = None  # made at start (its HTTP pool lives on the loop)

    async def start(self) -> None:
        """The callback key and the pinned versions, then the deliverer."""
        from rota.server.deliverer import Deliverer, callback_base  # (httpx: a server's)
        self.engine.callback_key = await self.store.callback_key(random.token_hex(32))
        await self.reread()
        self.deliverer = Deliverer(
            allow_private=bool(getattr(self.settings, "allow_private_endpoints", False)),
            secrets=self.secrets, callback_base=callback_base(self.settings, self.settings.port))

    async def reread(self) -> None:
        """The versions of push-executed specs as stored (at a start, and after another
        server's push)."""
        windows = await self.store.spec_windows()
        self.apply(self.engine.load_pins(windows, self.clock()))

    def deliver(self, delivery: Delivery) -> None:
        task = asyncio.get_running_loop().create_task(self._run(delivery))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, delivery: Delivery) -> None:
        try:
            delivered: Delivered = await self.deliverer.deliver(delivery)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a defect of the deliverer: the attempt fails, retryable
            log.error("delivery failed job=%s attempt=%d: %s: %s", delivery.job_id,
                      delivery.attempt, type(exc).__name__, exc)
            delivered = Delivered(job_id=delivery.job_id, attempt=delivery.attempt,
                                  delivery_id=delivery.delivery_id, kind="failed",
                                  error=p.ErrorInfo(type="internal", message=str(exc)))
        self.apply(self.engine.endpoint_result(delivered, self.clock()), linger=True)

    async def stop(self) -> None:
        """At a stop: deliveries in flight are dropped (their jobs' leases bring them back
        after the restart), the pool closed."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.deliverer is not None:
            await self.deliverer.aclose()
