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


ROWS = ("meta", "rota_migrations")
ROWIDS = "SELECT last_value FROM pg_sequences WHERE sequencename ="\
         " (SELECT split_part(pg_get_serial_sequence('jobs', 'rowid'), '.', 2))"


def databases(pg_cluster: Cluster) -> set[str]:
    with psycopg.connect(pg_cluster.url()) as conn:
        return {r[0] for r in conn.execute("SELECT datname FROM pg_database")}


def test_a_database_given_back_is_handed_out_again_as_new(pg_cluster: Cluster) -> None:
    url = pg_cluster.create_database(migrated=True)
    with psycopg.connect(url) as conn:
        new = {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in ROWS}
        first = conn.execute(ROWIDS).fetchone()
        conn.execute("INSERT INTO meta (key, value) VALUES ('left', 'by a test')")
        conn.execute("DELETE FROM rota_migrations WHERE name = (SELECT min(name)"
                     " FROM rota_migrations)")
        conn.execute("SELECT nextval(pg_get_serial_sequence('jobs', 'rowid'))")
    before = databases(pg_cluster)
    pg_cluster.give_back(url)
    pg_cluster.give_back(url)  # (twice: still handed out once)
    again = pg_cluster.create_database(migrated=True)
    assert len(databases(pg_cluster)) == len(before)  # the same one, under a new name
    assert url.rsplit("/", 1)[1] not in databases(pg_cluster)
    with psycopg.connect(again) as conn:
        assert {t: conn.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
                for t in ROWS} == new
        assert conn.execute(ROWIDS).fetchone() == first
    assert pg_cluster.create_database(migrated=True) not in (url, again)
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
