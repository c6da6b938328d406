"""``rota webhooks`` as a user types it, against a real server and a receiver: add (the
secret printed once), list, show, test, deliveries, rotate-secret, delete, and the one
line a mistake gets."""

from __future__ import annotations

import json

import pytest
from conftest import Live
from helpers import rota
from hookrig import Receiver


@pytest.mark.parametrize("live", [{"allow_private_endpoints": True}], indirect=True)
async def test_the_webhooks_commands(live: Live):  # (the receiver is on loopback)
    receiver = await Receiver().start()
    base = ["--url", live.base]
    try:
        code, out, err = await rota("webhooks", "add", receiver.url, "--kind", "discard",
                                    "--kind", "worker_disconnect", "--spec", "mail", *base)
        assert code == 0, err
        said = dict(line.split(":", 1) for line in out.splitlines())
        sub_id, secret = said["webhook"].strip(), said["secret"].strip()
        assert secret.startswith("whsec_") and said["filter"].strip() == "spec=mail"
        assert "shown this once" in err
        code, out, _ = await rota("webhooks", *base)
        assert code == 0 and sub_id in out and "discard,worker_disconnect" in out
        code, out, _ = await rota("webhooks", "show", sub_id, "--json", *base)
        assert json.loads(out)["id"] == sub_id and "secret" not in json.loads(out)
        code, out, err = await rota("webhooks", "test", sub_id, *base)
        assert code == 0 and out.startswith("delivered: HTTP 200"), err
        code, out, _ = await rota("webhooks", "deliveries", sub_id, *base)
        assert code == 0 and "test" in out and "delivered" in out
        code, out, _ = await rota("webhooks", "rotate-secret", sub_id, *base)
        assert code == 0 and "whsec_" in out and secret not in out
        receiver.status = 410
        code, out, err = await rota("webhooks", "test", sub_id, *base)
        assert (code, err.strip()) == (1, "error: test delivery failed: http_410")
        code, out, _ = await rota("webhooks", "delete", sub_id, *base)
        assert (code, out.strip()) == (0, f"deleted webhook {sub_id}")
        code, _, err = await rota("webhooks", "show", sub_id, *base)
        assert (code, err.strip()) == (1, f"error: no webhook subscription {sub_id!r}"
                                                 " (webhook_not_found)")
        code, _, err = await rota("webhooks", "add", "ftp://x/y", "--kind", "enqueue", *base)
        assert (code, err.strip()) == (1, "error: url must be http or https, not 'ftp' (invalid_webhook)")
        code, _, err = await rota("webhooks", "add", receiver.url, *base)
        assert (code, err.strip()) == (1, "error: name the events to send with --kind (repeat it;"
                                                 " --kind '*' for all)")
    finally:
        await receiver.close()
