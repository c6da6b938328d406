"""How often PostgreSQL's fast shutdown ends a session between a commit and its answer,
and what asking for the transaction's id with BEGIN costs (docs/scaling.md, "A commit
whose answer was lost"; rota/store/writer.py ``Doubt``).

- **Doubts:** a session commits one-row transactions in a tight loop; the cluster is
  stopped (``pg_ctl stop -m fast``) under it and started again, ``--rounds`` times. A
  commit whose COMMIT raised and whose row is there all the same is a commit in doubt.
- **BEGIN's cost:** one-row transactions as the writer runs them, with ``BEGIN`` alone
  and with ``BEGIN; SELECT txid_current()`` in its round trip; microseconds a transaction,
  median of 5 runs of ``--transactions``.

    python bench/commit_doubt.py [--rounds 30] [--transactions 2000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pgserver import Cluster  # noqa: E402  (the suite's throwaway PostgreSQL)

from rota.store.pg_connection import connect  # noqa: E402


def doubts(cluster: Cluster, url: str, rounds: int) -> int:
    """Rounds in which the commit that failed at the shutdown had taken effect."""
    found = 0
    for n in range(rounds):
        failed: list[int] = []
        stop = threading.Event()

        def commit_in_a_loop(first: int = n * 10_000_000) -> None:
            conn = psycopg.connect(url)
            i = first
            while not stop.is_set():
                i += 1
                try:
                    conn.execute("INSERT INTO t VALUES (%s)", (i,))
                    conn.execute("COMMIT")
                except psycopg.Error:
                    failed.append(i)
                    return

        thread = threading.Thread(target=commit_in_a_loop)
        thread.start()
        time.sleep(0.2)  # noqa: sleep-ok (commits run for a while before the shutdown)
        cluster.stop()
        stop.set()
        thread.join()
        cluster.start()
        with psycopg.connect(url, autocommit=True) as admin:
            found += sum(1 for i in failed
                         if admin.execute("SELECT 1 FROM t WHERE i = %s", (i,)).fetchone())
    return found


def begin_cost(url: str, transactions: int) -> tuple[float, float]:
    """µs a one-row transaction takes with BEGIN alone, and with the id asked for."""
    conn = connect(url)

    def plain() -> None:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO u VALUES (1) ON CONFLICT (i) DO UPDATE SET n = u.n + 1")
        conn.execute("COMMIT")

    def with_id() -> None:
        cursor = conn.raw.execute("BEGIN; SELECT txid_current()", prepare=False)
        cursor.nextset()
        cursor.fetchone()
        conn.execute("INSERT INTO u VALUES (1) ON CONFLICT (i) DO UPDATE SET n = u.n + 1")
        conn.execute("COMMIT")

    def timed(one: object) -> float:
        began = time.perf_counter()
        for _ in range(transactions):
            one()  # type: ignore[operator]
        return (time.perf_counter() - began) / transactions * 1e6

    runs = [(timed(plain), timed(with_id)) for _ in range(5)]
    conn.close()
    return (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--transactions", type=int, default=2000)
    args = parser.parse_args()
    cluster = Cluster()
    cluster.start()
    try:
        url = cluster.create_database()
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("CREATE TABLE t (i bigint PRIMARY KEY)")
            admin.execute("CREATE TABLE u (i int PRIMARY KEY, n int NOT NULL DEFAULT 0)")
        plain, with_id = begin_cost(url, args.transactions)
        print(f"one-row transaction: BEGIN alone {plain:.1f} µs, with txid_current()"
              f" {with_id:.1f} µs")
        found = doubts(cluster, url, args.rounds)
        print(f"commits in doubt: {found} of {args.rounds} fast shutdowns")
    finally:
        cluster.destroy()


if __name__ == "__main__":
    main()
