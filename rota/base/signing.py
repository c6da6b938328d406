"""Signing of what the server sends out (endpoint deliveries and webhooks) and its check
on the receiver's side: HMAC-SHA256 over ``<timestamp>.<body>``, as ojs-webhooks §8 does.

The signature header holds ``sha256=<hex>``; during a secret's rotation it holds two,
comma-separated, and a receiver accepts either. A receiver refuses a timestamp more than
``TOLERANCE`` seconds from its own clock, so a captured request cannot be replayed later
(and keeps the delivery ids it has seen for that long, to refuse one replayed sooner).
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE = "X-Rota-Signature"
TIMESTAMP = "X-Rota-Timestamp"
DELIVERY = "X-Rota-Delivery-Id"
TOLERANCE = 300  # seconds a receiver accepts between the timestamp and its clock


def signature(secret: str | bytes, timestamp: int, body: bytes) -> str:
    """``sha256=<hex>`` of HMAC-SHA256(secret, ``<timestamp>.`` + body)."""
    key = secret.encode() if isinstance(secret, str) else secret
    digest = hmac.new(key, str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return "sha256=" + digest


def sign(secrets: list[str | bytes], timestamp: int, body: bytes) -> dict[str, str]:
    """The headers that sign ``body``: one signature per secret (two while rotating)."""
    return {TIMESTAMP: str(timestamp),
            SIGNATURE: ",".join(signature(s, timestamp, body) for s in secrets)}


def verify(secret: str | bytes, headers: dict[str, str], body: bytes, now: float,
           tolerance: float = TOLERANCE) -> bool:
    """The receiver's check: a fresh timestamp and one matching signature, compared in
    constant time. ``headers`` by lower-case name or as sent."""
    lowered = {k.lower(): v for k, v in headers.items()}
    stamp = lowered.get(TIMESTAMP.lower(), "")
    if not stamp.isdigit() or abs(now - int(stamp)) > tolerance:
        return False
    expected = signature(secret, int(stamp), body)
    given = [part.strip() for part in lowered.get(SIGNATURE.lower(), "").split(",")]
    return any(hmac.compare_digest(expected, part) for part in given)
