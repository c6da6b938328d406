"""The push execution calls of ``Client`` (admin): the endpoint signing secrets (set or rotate one, or have the server generate it; list them, never a value; delete one) and the endpoints with their circuit breakers."""

from __future__ import annotations

from typing import Any

from rota.base.ids import path_segment


class SecretCalls:
    """Mixed into ``Client``: each is one request of the secrets API."""

    def _call(self, method: str, path: str, *, json: Any = None,
              params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        raise NotImplementedError  # (Client's)

    def set_secret(self, name: str, value: str | None = None, *,
                   window: float | None = None) -> dict[str, Any]:
        """``PUT /secrets/{name}``: store ``value`` (None: the server generates one, in the
        answer's "value" this once). A rotation keeps the value it replaces valid for
        ``window`` seconds (default a day): deliveries are signed with both meanwhile."""
        body: dict[str, Any] = {}
        if value is not None:
            body["value"] = value
        if window is not None:
            body["window"] = window
        return self._call("PUT", f"/secrets/{path_segment(name)}", json=body)

    def secrets(self) -> dict[str, Any]:
        """``GET /secrets``: each secret's name, dates and source, never its value."""
        return self._call("GET", "/secrets")

    def delete_secret(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/secrets/{path_segment(name)}")

    def endpoints(self) -> dict[str, Any]:
        """``GET /endpoints``: each push endpoint, its circuit breaker and deliveries."""
        return self._call("GET", "/endpoints")
