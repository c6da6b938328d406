"""The webhook outbox's SQL (rota/store/hooks.py) on a migrated SQLite file: a checked
subscription takes no more than MAX_PENDING waiting deliveries, its log keeps the KEEP
latest finished, a recovered event already written is not written again, and a claim
takes only deliveries still due."""

from __future__ import annotations

from pathlib import Path

import pytest

from rota.store import hooks, migrations
from rota.store.sqlite import connect


def test_the_outbox_bounds_prunes_dedupes_and_claims(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(hooks, "MAX_PENDING", 3)
    monkeypatch.setattr(hooks, "KEEP", 2)
    migrations.migrate(tmp_path / "rota.db")
    conn = connect(tmp_path / "rota.db")
    hooks.insert_subscription(conn, {"id": "wh_1", "url": "https://x/h", "kinds": ["*"],
                                     "filter": {}, "secret": "s", "enabled": True,
                                     "created_at": 1.0})

    def rows(*events: str) -> list[tuple[str, str, str, str, bytes]]:
        return [(f"dlv_{e}", "wh_1", f"evt_{e}", "enqueue", b"{}") for e in events]

    dropped, waiting = hooks.add_deliveries(conn, rows("a", "b"), 10.0, checked=["wh_1"])
    assert (dropped, waiting) == ({}, {"wh_1": 2})
    dropped, waiting = hooks.add_deliveries(conn, rows("c", "d"), 11.0, checked=["wh_1"])
    assert (dropped, waiting) == ({"wh_1": 1}, {"wh_1": 3})  # "d" is past MAX_PENDING
    assert hooks.add_deliveries(conn, rows("b", "e"), 12.0, recovered=True) == ({}, {})
    events = [d["event_id"] for d in hooks.deliveries(conn, "wh_1", 10, None)]
    assert sorted(events) == ["evt_a", "evt_b", "evt_c", "evt_e"]  # "b" once

    claimed = hooks.claim(conn, "wh_1", 20.0, 5.0, 2)
    assert [d["id"] for d in claimed] == ["dlv_a", "dlv_b"]
    assert [d["id"] for d in hooks.claim(conn, "wh_1", 20.0, 5.0, 9)] == ["dlv_c", "dlv_e"]
    assert hooks.claim(conn, "wh_1", 21.0, 5.0, 9) == []  # all held
    hooks.record(conn, [(d, "delivered", 1, None, 200, 1.0, None, "ok")
                        for d in ("dlv_a", "dlv_b", "dlv_c")], "wh_1", 22.0, True)
    hooks.add_deliveries(conn, rows("f"), 23.0, checked=["wh_1"])
    kept = {d["id"]: d["state"] for d in hooks.deliveries(conn, "wh_1", 10, None)}
    # KEEP finished at most: the oldest two (one moment) went; pending ones are never pruned
    assert kept == {"dlv_c": "delivered", "dlv_e": "pending", "dlv_f": "pending"}
    conn.close()
