"""One webhook POST and its signed headers, through the server's egress
(rota/server/outbound.py: the receiver's addresses checked, same-host redirects only,
the answer capped), and its answer classified (rota/core/webhooks.py ``answered``)."""

from __future__ import annotations

import importlib.metadata
import time

from rota.base.signing import DELIVERY, sign
from rota.core.webhooks import Outcome, Subscription, answered, retry_after
from rota.server.outbound import Egress

SHOWN = 2048  # bytes of the answer read and kept in the delivery log
EVENT = "X-Rota-Event"
SUBSCRIPTION = "X-Rota-Subscription-Id"
VERSION = importlib.metadata.version("rota")


def signed_headers(sub: Subscription, delivery_id: str, kind: str, body: bytes,
            now: float) -> dict[str, str]:
    """A delivery's headers, signed with the subscription's secrets of the moment."""
    return {**sign(list(sub.secrets(now)), int(now), body), DELIVERY: delivery_id,
            EVENT: kind, SUBSCRIPTION: sub.id, "Content-Type": "application/json",
            "User-Agent": f"rota/{VERSION}"}


async def post(egress: Egress, url: str, body: bytes, headers: dict[str, str],
               timeout: float) -> Outcome:
    answer = await egress.post(url, body, headers, timeout=timeout, max_body=SHOWN)
    ms = round(answer.ms, 1)
    if answer.status is None:  # no answer: a timeout or a connection failure is retried
        return Outcome(None, f"{answer.error}: {answer.message}",
                       answer.error != "address_refused", ms=ms)
    return answered(answer.status, retry_after(answer.headers.get("retry-after"), time.time()),
                    ms, answer.body.decode(errors="replace"))
