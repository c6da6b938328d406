"""The suite's own PostgreSQL (tests/pgserver.py): it starts, gives each test a database
of its own, and comes back after a stop on the same port."""

from __future__ import annotations

import psycopg
from pgserver import Cluster


def test_each_test_has_a_fresh_database(pg_cluster: Cluster, pg_url: str) -> None:
    with psycopg.connect(pg_url) as conn:
        conn.execute("CREATE TABLE t (x int)")
    other = pg_cluster.create_database()
    assert other != pg_url
    with psycopg.connect(other) as conn:
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE tablename = 't'"
                            ).fetchone() == (0,)
