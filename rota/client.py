"""A small synchronous HTTP client for the Rota API, used by the CLI and by producers.

It speaks HTTP/1.1 over one kept-alive connection with the standard library's
http.client. A general-purpose client (httpx) cost 0.3 ms more per call here on an idle
loopback, as much as the server's commit: for a producer that enqueues one job at a
time, the client was a third of the round trip (docs/performance.md).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.parse
from typing import Any

import msgspec

from rota.specs import JobSpec


class ApiError(Exception):
    """The server refused a request, or could not be reached."""

    def __init__(self, status: int | None, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def transport_error(url: str, exc: BaseException, *, connected: bool) -> ApiError:
    """What a failed request means to its caller, in words it can act on. Before the
    connection is made nothing was sent ("unreachable"); after it, the server may have
    carried the request out and only its answer was lost ("no_answer"): an enqueue may be
    stored, and repeating it with the same job id is the safe way to find out."""
    detail = str(exc) or type(exc).__name__
    if not connected:
        return ApiError(None, "unreachable", f"cannot reach Rota at {url}: {detail}; is the"
                        " server running? (set --url or ROTA_URL)")
    what = "timed out" if isinstance(exc, TimeoutError) else detail
    return ApiError(None, "no_answer", f"no answer from Rota at {url} ({what}): the request"
                    " may have been carried out; repeat it with the same job id to be sure")


def ws_url(url: str) -> str:
    """The /work endpoint for a server base URL (http -> ws, https -> wss)."""
    base = url.rstrip("/")
    if base.startswith("http"):
        base = "ws" + base[4:]
    return base if base.endswith("/work") else base + "/work"


# A kept-alive connection idle longer than this is not reused: the server closes idle
# ones after 5 s, and a request sent as it does so would be lost in the race.
IDLE_REUSE = 2.0
IDEMPOTENT = frozenset({"GET", "PUT", "DELETE", "HEAD"})


class _Transport:
    """One HTTP/1.1 connection to the server, opened on demand and kept alive."""

    def __init__(self, url: str, *, timeout: float, headers: dict[str, str]) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ApiError(None, "bad_url", f"not an http(s) URL: {url!r} (give the server's"
                           " base URL, such as http://127.0.0.1:8000)")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.headers = {"Accept": "application/json", **headers}
        self._conn: http.client.HTTPConnection | None = None
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
        headers = dict(self.headers)
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self._conn is not None and time.monotonic() - self._used_at > IDLE_REUSE:
            self.close()
        reused = self._conn is not None
        try:
            return self._send(method, target, body, headers, timeout)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.close()
            # A kept-alive connection the server had just closed: nothing was read, and a
            # request that means the same thing twice may go again on a new connection.
            if not (reused and method in IDEMPOTENT):
                raise
            return self._send(method, target, body, headers, timeout)

    def _send(self, method: str, target: str, body: bytes | None, headers: dict[str, str],
              timeout: float | None) -> tuple[int, bytes]:
        self.connected = False
        conn = self._connection()
        self.connected = True  # from here on, the server may act on what it is sent
        conn.timeout = timeout or self.timeout
        if conn.sock is not None:
            conn.sock.settimeout(conn.timeout)
        try:
            conn.request(method, target, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except BaseException:
            self.close()
            raise
        if response.will_close:
            self.close()
        self._used_at = time.monotonic()
        return response.status, data

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.https:
                self._conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout,
                    context=ssl.create_default_context())
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port,
                                                        timeout=self.timeout)
            self._conn.connect()
            assert self._conn.sock is not None
            # Small requests and answers: never wait for a delayed ACK (Nagle).
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._conn


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8000", *, token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = _Transport(self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, *, json: Any = None,
              params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        body = None if json is None else msgspec.json.encode(json)
        try:
            status, content = self._http.request(method, path, body=body, params=params,
                                                 timeout=timeout)
        except (OSError, http.client.HTTPException) as exc:
            raise transport_error(self.url, exc, connected=self._http.connected) from exc
        try:
            answer = msgspec.json.decode(content) if content else {}
        except msgspec.DecodeError:
            answer = None  # not JSON: a proxy's page, or uvicorn's own 503
        if status >= 400:
            err = answer.get("error", {}) if isinstance(answer, dict) else {}
            err = err if isinstance(err, dict) else {}
            text = content.decode(errors="replace").strip() or f"HTTP {status}"
            raise ApiError(status, err.get("code", "http_error"), err.get("message", text))
        if answer is None:
            raise ApiError(status, "http_error", f"not a JSON answer: {content[:200]!r}")
        return answer

    def enqueue(self, spec: str, args: dict[str, Any] | None = None, **options: Any
                ) -> dict[str, Any]:
        """Options: id, queue, priority, run_at, delay, ttl, visibility_timeout,
        max_attempts, max_fails (None means the spec's default), capture_logs."""
        body: dict[str, Any] = {"spec": spec, "args": args or {}}
        body.update({key: value for key, value in options.items() if value is not None})
        return self._call("POST", "/jobs", json=body)

    def enqueue_batch(self, jobs: list[dict[str, Any]]) -> dict[str, Any]:
        return self._call("POST", "/jobs/batch", json={"jobs": jobs})

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/jobs/{job_id}")

    def retry(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/jobs/{job_id}/retry")

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}")

    def result(self, job_id: str, *, wait: float = 0) -> dict[str, Any]:
        return self._call("GET", f"/jobs/{job_id}/result", params={"wait": wait},
                          timeout=wait + 30)

    def push_specs(self, specs: list[JobSpec], *, dry_run: bool = False) -> dict[str, Any]:
        body = {"specs": [msgspec.to_builtins(s) for s in specs], "dry_run": dry_run}
        return self._call("PUT", "/specs", json=body)

    def specs(self) -> dict[str, Any]:
        return self._call("GET", "/specs")

    def retire_spec(self, name: str, *, cancel_waiting: bool = False) -> dict[str, Any]:
        return self._call("POST", f"/specs/{name}/retire",
                          json={"cancel_waiting": cancel_waiting})

    def spec_history(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/specs/{name}/history")

    def workers(self) -> dict[str, Any]:
        return self._call("GET", "/workers")

    def direct(self, state: str, *, worker_id: str | None = None, label: str | None = None,
               every: bool = False) -> dict[str, Any]:
        """Ask one worker (by id), every worker with a label, or all, to change state."""
        if worker_id is not None:
            return self._call("POST", f"/workers/{worker_id}/state", json={"state": state})
        body: dict[str, Any] = {"state": state, "all": every}
        if label is not None:
            body["label"] = label
        return self._call("POST", "/workers/state", json=body)

    def queues(self) -> dict[str, Any]:
        return self._call("GET", "/queues")

    def create_token(self, scope: str, *, name: str | None = None,
                     queues: list[str] | None = None) -> dict[str, Any]:
        """A new token (admin): ``token`` in the answer is its secret, shown this once."""
        body: dict[str, Any] = {"scope": scope, "name": name, "queues": queues}
        return self._call("POST", "/tokens",
                          json={key: value for key, value in body.items() if value is not None})

    def tokens(self) -> dict[str, Any]:
        return self._call("GET", "/tokens")

    def revoke_token(self, id_or_name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/tokens/{urllib.parse.quote(id_or_name, safe='')}")
