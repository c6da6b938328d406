"""The webhook calls of ``Client`` (admin): add, list, show, change and delete
subscriptions, read a subscription's deliveries, send a test delivery, rotate a secret."""

from __future__ import annotations

from typing import Any

from rota.base.ids import path_segment


class WebhookCalls:
    """Mixed into ``Client``: each is one request of the webhooks API."""

    def _call(self, method: str, path: str, *, json: Any = None,
              params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        raise NotImplementedError  # (Client's)

    def add_webhook(self, url: str, kinds: list[str], filter: dict[str, str] | None = None,
                    *, enabled: bool = True) -> dict[str, Any]:
        """``POST /webhooks``: the subscription, with its secret (shown this once)."""
        return self._call("POST", "/webhooks", json={"url": url, "kinds": kinds,
                                                     "filter": filter or {}, "enabled": enabled})

    def webhooks(self) -> dict[str, Any]:
        return self._call("GET", "/webhooks")

    def webhook(self, webhook_id: str) -> dict[str, Any]:
        return self._call("GET", f"/webhooks/{path_segment(webhook_id)}")

    def change_webhook(self, webhook_id: str, **changes: Any) -> dict[str, Any]:
        return self._call("PATCH", f"/webhooks/{path_segment(webhook_id)}", json=changes)

    def delete_webhook(self, webhook_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/webhooks/{path_segment(webhook_id)}")

    def webhook_deliveries(self, webhook_id: str, *, limit: int = 50,
                           state: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit, **({"state": state} if state else {})}
        return self._call("GET", f"/webhooks/{path_segment(webhook_id)}/deliveries",
                          params=params)

    def test_webhook(self, webhook_id: str) -> dict[str, Any]:
        """``POST /webhooks/{id}/test``: what the receiver answered a test delivery."""
        return self._call("POST", f"/webhooks/{path_segment(webhook_id)}/test", timeout=90.0)

    def rotate_webhook_secret(self, webhook_id: str) -> dict[str, Any]:
        return self._call("POST", f"/webhooks/{path_segment(webhook_id)}/rotate-secret")
