"""The overlap ``enqueue`` on PostgreSQL, two servers at once: a fire that holds a tick and
the ending of the job it waits for (rota/store/settle.py's release_next), each in its own
transaction, take turns on the schedule's row, so neither misses the other's write and no
tick stays held for ever."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from test_ticks import T0, defined, first_of_enqueue, job, states

from rota.core.schedules import tick_id
from rota.store import pg, pg_connection, ticks

FIRST, SECOND = T0 + 60, T0 + 120


@pytest.fixture
def conns(pg_url: str) -> Iterator[list[Any]]:
    pg.migrate(pg_url)
    opened = [pg_connection.connect(pg_url) for _ in range(3)]
    try:
        yield opened
    finally:
        for conn in opened:
            conn.close()


def _setup(conn: Any) -> str:
    """An enqueue schedule whose first tick's job is running."""
    seen = first_of_enqueue(conn)
    conn.execute("UPDATE jobs SET state = 'active' WHERE id = ?", (tick_id("beat", FIRST),))
    return seen


def _ending(conn: Any) -> None:
    """The first job's ending, as the store writes it: the row, then settle's release."""
    conn.execute("UPDATE jobs SET state = 'completed' WHERE id = ?", (tick_id("beat", FIRST),))
    ticks.release_next(conn, "beat", SECOND + 1)


def _meanwhile(watch: Any, work: Callable[[], None]) -> threading.Thread:
    """``work`` in a thread, returned once it waits for a lock (or has finished)."""
    thread = threading.Thread(target=work)
    thread.start()
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        if watch.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                         ).fetchone() is not None:
            break
        time.sleep(0.01)  # noqa: sleep-ok (a poll step bounded by the deadline)
    return thread


def _race(watch: Any, first: tuple[Any, Callable[[], None]],
          second: tuple[Any, Callable[[], None]]) -> None:
    """``first``'s work runs in a transaction left open while ``second``'s runs in
    another (on a thread, until it waits on a lock or ends); then ``first`` commits and
    ``second`` must finish."""
    conn, work = first
    conn.execute("BEGIN")
    work()
    thread = _meanwhile(watch, _in_transaction(*second))
    conn.execute("COMMIT")
    thread.join(10)
    assert not thread.is_alive()


def _in_transaction(conn: Any, work: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        conn.execute("BEGIN")
        work()
        conn.execute("COMMIT")
    return run


@pytest.mark.parametrize("first", ["fire", "ending"])
def test_a_held_tick_and_the_ending_it_waits_for_on_two_servers(conns: list[Any], first: str):
    fire_conn, end_conn, watch = conns
    seen = _setup(fire_conn)
    second = {SECOND: job("beat", SECOND)}
    work = {"fire": (fire_conn, lambda: ticks.fire(fire_conn, "beat", seen, SECOND + 0.5,
                                                   second, None)),
            "ending": (end_conn, lambda: _ending(end_conn))}
    (early, early_work), (late, late_work) = (work.pop(first), *work.values())
    # the one that goes first stops before its COMMIT while the other runs
    _race(watch, (early, early_work), (late, late_work))
    # the second tick waits for a worker: released, or never held
    assert states(watch)[tick_id("beat", SECOND)] == "available"


def test_two_endings_of_one_schedule_on_two_servers_release_its_held_tick(conns: list[Any]):
    one, other, watch = conns
    ticks.upsert(one, defined(overlap="allow"), T0)
    seen = ticks.read_one(one, "beat")["definition"]
    for tick in (FIRST, SECOND):  # two running at once (overlap allow, then enqueue)
        ticks.fire(one, "beat", seen, tick + 0.5, {tick: job("beat", tick)}, None)
        one.execute("UPDATE jobs SET state = 'active' WHERE id = ?", (tick_id("beat", tick),))
    ticks.upsert(one, defined(overlap="enqueue"), T0 + 150)
    seen = ticks.read_one(one, "beat")["definition"]
    third = T0 + 180
    ticks.fire(one, "beat", seen, third + 0.5, {third: job("beat", third)}, None)
    assert states(watch)[tick_id("beat", third)] == "pending"

    def end(conn: Any, tick: float) -> None:
        conn.execute("UPDATE jobs SET state = 'completed' WHERE id = ?",
                     (tick_id("beat", tick),))
        ticks.release_next(conn, "beat", third + 1)

    _race(watch, (one, lambda: end(one, FIRST)), (other, lambda: end(other, SECOND)))
    assert states(watch)[tick_id("beat", third)] == "available"


def test_cancel_previous_never_waits_for_a_row_its_ending_holds(conns: list[Any]):
    # the ending holds the job's row and next waits for the schedule's (release_next):
    # a fire that waited for the job's row would make a deadlock of the two
    fire_conn, end_conn, watch = conns
    ticks.upsert(fire_conn, defined(overlap="cancel_previous"), T0)
    seen = ticks.read_one(fire_conn, "beat")["definition"]
    ticks.fire(fire_conn, "beat", seen, FIRST + 0.5, {FIRST: job("beat", FIRST)}, None)
    fire_conn.execute("UPDATE jobs SET state = 'active' WHERE id = ?", (tick_id("beat", FIRST),))
    fire_conn.execute("SET lock_timeout = '3s'")
    end_conn.execute("BEGIN")
    end_conn.execute("UPDATE jobs SET state = 'completed' WHERE id = ?",
                     (tick_id("beat", FIRST),))
    fire_conn.execute("BEGIN")
    fired = ticks.fire(fire_conn, "beat", seen, SECOND + 0.5, {SECOND: job("beat", SECOND)},
                       None)
    fire_conn.execute("COMMIT")
    assert fired.cancel == [tick_id("beat", FIRST)]  # (after the commit, the ordinary way)
    ticks.release_next(end_conn, "beat", SECOND + 1)
    end_conn.execute("COMMIT")
    assert states(watch) == {tick_id("beat", FIRST): "completed",
                             tick_id("beat", SECOND): "available"}
