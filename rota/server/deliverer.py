"""Push execution's shell: a ``Delivery`` POSTed, signed, to its endpoint, and the answer
classified into a ``Delivered`` (``classify``, pure) for the engine to decide on."""

from __future__ import annotations

import email.utils
import importlib.metadata
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import msgspec

from rota.base.egress import MAX_BODY, MAX_REDIRECTS, Answer
from rota.base.protocol import ErrorInfo
from rota.base.push import MAX_SHOWN_BODY, Delivered, Delivery
from rota.base.signing import DELIVERY, sign
from rota.core.settings import ServerSettings
from rota.server.outbound import Egress

MAX_RETRY_AFTER = 3600.0  # seconds: an endpoint's Retry-After is honoured up to this
# Headers the deliverer sets itself; a spec's [execute].headers cannot replace them.
OURS = {"content-type", "user-agent", "x-rota-timestamp", "x-rota-signature",
        DELIVERY.lower(), "x-rota-job-id", "x-rota-attempt", "host", "content-length",
        "transfer-encoding", "connection"}


def _version() -> str:
    try:
        return importlib.metadata.version("rota")
    except importlib.metadata.PackageNotFoundError:  # (a source tree)
        return "unknown"


USER_AGENT = f"rota/{_version()}"


class Deliverer:
    """Delivers for the server's life: ``allow_private`` lifts the address check (rota
    serve --allow-private-endpoints); ``secrets`` gives a secret name's values (two
    while one rotates; None or none: missing); ``callback_base`` is the server's URL as
    the endpoint reaches it (--public-url); ``max_body`` caps an answer read."""

    def __init__(self, allow_private: bool, secrets: Callable[[str], list[bytes] | None],
                 callback_base: str, max_body: int = MAX_BODY,
                 clock: Callable[[], float] = time.time) -> None:
        self._egress = Egress(allow_private=allow_private)
        self._secrets = secrets
        self._callback_base = callback_base.rstrip("/")
        self._max_body = max_body
        self._clock = clock

    async def deliver(self, d: Delivery) -> Delivered:
        """POST ``d`` and classify the answer; never raises for what the endpoint does."""
        secrets = self._secrets(d.secret)
        if not secrets:
            return failed(d, "secret_missing", f"no value for the secret {d.secret!r}"
                          " (rota secrets set, or its environment variable)",
                          retryable=False, fault=True)
        body = self.body(d)
        answer = await self._egress.post(d.url, body, self.headers(d, secrets, body),
                                         timeout=d.timeout, max_body=self._max_body)
        return classify(d, answer, self._max_body, self._clock())

    def body(self, d: Delivery) -> bytes:
        """The JSON the endpoint gets (the contract's, documented in docs/push.md)."""
        return msgspec.json.encode({
            "job": {"id": d.job_id, "spec": d.spec, "checksum": d.checksum, "queue": d.queue,
                    "attempt": d.attempt, "args": d.args, "priority": d.priority},
            "delivery_id": d.delivery_id, "deadline": d.deadline,
            "callback": {"url": f"{self._callback_base}/jobs/{quote(d.job_id, safe='')}"
                                "/callback", "token": d.callback_token}})

    def headers(self, d: Delivery, secrets: list[bytes], body: bytes) -> dict[str, str]:
        """The spec's headers, then the signed ones, which win."""
        headers = {k: v for k, v in d.headers.items() if k.lower() not in OURS}
        headers.update({"Content-Type": "application/json", "User-Agent": USER_AGENT,
                        DELIVERY: d.delivery_id, "X-Rota-Job-Id": d.job_id,
                        "X-Rota-Attempt": str(d.attempt)})
        headers.update(sign(list(secrets), int(self._clock()), body))
        return headers

    async def aclose(self) -> None:
        await self._egress.aclose()


def callback_base(settings: ServerSettings, port: int) -> str:
    """The base of the callback URL: --public-url, else the address the server listens
    on (``port``: the one bound; a wildcard host as its loopback, reachable only from
    this machine: an endpoint elsewhere needs --public-url)."""
    if settings.public_url:
        return settings.public_url.rstrip("/")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(settings.host,
                                                                       settings.host)
    scheme = "https" if settings.ssl_certfile else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


def classify(d: Delivery, answer: Answer, max_body: int = MAX_BODY,
             now: float = 0.0) -> Delivered:
    """What an answer means for the attempt (the classes in docs/push.md). Pure: ``now``
    (unix seconds) dates a Retry-After given as an HTTP date."""
    status = answer.status
    seen: dict[str, Any] = {"status": status, "ms": answer.ms,
                            "body": answer.body[:MAX_SHOWN_BODY].decode("utf-8", "replace")}
    if status is None:
        kind = answer.error or "connect"
        return failed(d, kind, answer.message, retryable=kind in ("timeout", "connect"),
                      fault=True, **seen)
    if status == 202:
        return Delivered(job_id=d.job_id, attempt=d.attempt, delivery_id=d.delivery_id,
                         kind="accepted", **seen)
    if 200 <= status < 300:
        return _success(d, answer, max_body, seen)
    if 300 <= status < 400:
        where = answer.headers.get("location")
        why = ("no Location" if not where else
               f"to {where}, not followed (another scheme, host or port)"
               if answer.redirects < MAX_REDIRECTS else
               f"to {where}, not followed (after {MAX_REDIRECTS} redirects)")
        return failed(d, "redirect", f"HTTP {status}: redirected {why}", retryable=False,
                      fault=True, **seen)
    said = f"HTTP {status}" + (f": {seen['body'][:200]}" if seen["body"].strip() else "")
    if status in (408, 409, 429) or 500 <= status < 600:
        return failed(d, f"http_{status}", said, retryable=True,
                      fault=status != 409,
                      retry_in=retry_after(answer.headers.get("retry-after"), now), **seen)
    if 400 <= status < 500:
        return failed(d, f"http_{status}", said, retryable=False,
                      fault=status in (401, 403, 404), **seen)
    return failed(d, "bad_response", f"HTTP {status} is no answer", retryable=True,
                  fault=True, **seen)


def _success(d: Delivery, answer: Answer, max_body: int, seen: dict[str, Any]) -> Delivered:
    """A 2xx: its JSON is the result, or an OJS ``{"status": "failed"}`` NACK."""
    def bad(why: str) -> Delivered:
        return failed(d, "bad_response", f"HTTP {answer.status}, but {why}", retryable=True,
                      fault=True, **seen)
    if answer.truncated:
        return bad(f"the answer is over {max_body} bytes")
    try:
        text = answer.body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return bad(f"the answer is not UTF-8 (byte {exc.start})")
    if not text.strip():  # a 204 (or any empty 2xx): done, with no result
        return Delivered(job_id=d.job_id, attempt=d.attempt, delivery_id=d.delivery_id,
                         kind="completed", result=None, **seen)
    try:
        body = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        return bad(f"the answer is not JSON ({exc})")
    except RecursionError:  # (msgspec's depth limit: not a DecodeError)
        return bad("the answer is nested too deeply")
    if isinstance(body, dict) and body.get("status") == "failed":  # OJS §2.3's NACK
        error = body.get("error")
        error = error if isinstance(error, dict) else {"message": str(error or "")}
        code = error.get("code")
        retryable = error.get("retryable", True)
        return failed(d, str(error.get("type") or code or "handler_error"),
                      str(error.get("message") or "the endpoint reported a failure"),
                      retryable=retryable if isinstance(retryable, bool) else True,
                      fault=False, code=code if isinstance(code, str) else None, **seen)
    if isinstance(body, dict) and body.get("status") == "completed":
        body = body.get("result")
    return Delivered(job_id=d.job_id, attempt=d.attempt, delivery_id=d.delivery_id,
                     kind="completed", result=body, **seen)


def failed(d: Delivery, type: str, message: str, *, retryable: bool, fault: bool,
           code: str | None = None, retry_in: float | None = None,
           status: int | None = None, ms: float = 0.0, body: str = "") -> Delivered:
    """A failed attempt; its error's details are the attempt's record."""
    done = Delivered(job_id=d.job_id, attempt=d.attempt, delivery_id=d.delivery_id,
                     kind="failed", status=status, ms=ms, body=body, retry_in=retry_in,
                     fault=fault)
    done.error = ErrorInfo(type=type, message=message, retryable=retryable,
                           details=done.record(), code=code)
    return done


def retry_after(value: str | None, now: float) -> float | None:
    """Seconds a Retry-After asks for (delta-seconds or an HTTP date), at most
    MAX_RETRY_AFTER; None if there is none or it is unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # (an HTTP date is GMT)
        return None
    return min(max(when.timestamp() - now, 0.0), MAX_RETRY_AFTER)
