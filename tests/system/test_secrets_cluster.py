"""Signing secrets on several servers sharing PostgreSQL: one set, rotated or deleted
through one server is what the others sign with once they hear its notice
(``rota_secrets``), with no read of the store per delivery."""

from __future__ import annotations

from pathlib import Path

from conftest import start_server, stop_server
from helpers import wait_until


async def test_a_secret_set_rotated_and_deleted_through_one_server_holds_on_another(
        tmp_path: Path, pg_url: str):
    a = await start_server(tmp_path / "a", database_url=pg_url, server_id="a")
    b = await start_server(tmp_path / "b", database_url=pg_url, server_id="b")
    try:
        book = b.coordinator.secrets
        old, new = "first-value-0123456789", "second-value-0123456789"
        for body, values in [({"value": old}, [old.encode()]),
                             ({"value": new}, [new.encode(), old.encode()])]:
            assert (await a.http.put("/secrets/hook", json=body)).status_code in (200, 201)
            await wait_until(lambda values=values: book.secret_values("hook") == values,
                             what=f"B to sign with {values}")
        assert (await b.http.delete("/secrets/hook")).status_code == 200
        await wait_until(lambda: a.coordinator.secrets.secret_values("hook") is None,
                         what="A to hear of the delete through B")
    finally:
        await stop_server(b)
        await stop_server(a)
