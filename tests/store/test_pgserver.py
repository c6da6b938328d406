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


def test_a_database_given_back_is_handed_out_again_as_new(pg_cluster: Cluster) -> None:
    url = pg_cluster.create_database(migrated=True)
    with psycopg.connect(url) as conn:
        new = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
               for t in ("meta", "rota_migrations")}
        conn.execute("INSERT INTO meta (key, value) VALUES ('left', 'by a test')")
        conn.execute("DELETE FROM rota_migrations WHERE name = (SELECT min(name)"
                     " FROM rota_migrations)")
    pg_cluster.give_back(url)
    again = pg_cluster.create_database(migrated=True)
    assert again == url
    with psycopg.connect(again) as conn:
        assert {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
                for t in ("meta", "rota_migrations")} == new
    pg_cluster.give_back(again)


def test_a_database_still_in_use_or_changed_is_not_handed_out_again(pg_cluster: Cluster
                                                                     ) -> None:
    changed, in_use = pg_cluster.create_database(), pg_cluster.create_database()
    with psycopg.connect(changed) as conn:
        conn.execute("CREATE TABLE mine (x int)")
    pg_cluster.give_back(changed)
    with psycopg.connect(in_use) as held:
        pg_cluster.give_back(in_use)
        assert held.execute("SELECT 1").fetchone() == (1,)
    handed = {pg_cluster.create_database() for _ in range(2)}
    assert not handed & {changed, in_use}
