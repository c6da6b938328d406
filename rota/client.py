"""A small synchronous HTTP client for the Rota API, used by the CLI and by producers."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from rota.specs import JobSpec


class ApiError(Exception):
    """The server refused a request, or could not be reached."""

    def __init__(self, status: int | None, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def ws_url(url: str) -> str:
    """The /work endpoint for a server base URL (http -> ws, https -> wss)."""
    base = url.rstrip("/")
    if base.startswith("http"):
        base = "ws" + base[4:]
    return base if base.endswith("/work") else base + "/work"


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8000", *, token: str | None = None,
                 timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ApiError(None, "unreachable", f"cannot reach Rota at {self.url}: {exc}") from exc
        body = response.json() if response.content else {}
        if response.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise ApiError(response.status_code, err.get("code", "http_error"),
                           err.get("message", response.text))
        return body

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
