"""Lean acks (docs/protocol.md §4.2), on a fake clock: a worker that registers
``lean_acks`` gets no ack for an idle heartbeat while the server acked it within a
quarter of its heartbeat timeout; anything the worker must hear is still acked."""

from __future__ import annotations

from typing import Any

from rota.base import protocol as p
from rota.core.auth import OPEN
from rota.core.effects import Save
from rota.core.engine import Engine

from test_engine import FakeClock, assign, connect, done, enqueue, hb, of, sent
from test_engine import clock, engine  # noqa: F401  (fixtures)


def lean(engine: Engine, clock: FakeClock, worker: str = "w1", conn: int = 1
         ) -> list[dict[str, Any]]:
    first = hb(worker, 0, register=True, capacity=4)
    assert first.registration is not None
    first.registration.lean_acks = True
    return sent(engine.register(conn, first, OPEN, clock())
                + engine.heartbeat(conn, worker, first, clock()), conn)


def beat(engine: Engine, clock: FakeClock, seq: int, worker: str = "w1", **extra: object
         ) -> list[dict[str, Any]]:
    return sent(engine.heartbeat(1, worker, hb(worker, seq, **extra), clock()), 1)  # type: ignore[arg-type]


def one_result(engine: Engine, clock: FakeClock) -> tuple[dict[str, Any], Save]:
    """A lean worker runs one job and reports it (seq 1): the copy, and its commit."""
    lean(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    clock.advance(0.1)
    [save] = of(Save, engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock()))
    return copy, save


def test_idle_beats_are_acked_once_a_quarter_of_the_timeout(engine, clock):
    frames = lean(engine, clock)
    assert [f["type"] for f in frames] == ["welcome", "ack"]  # the registration, always
    acked = []
    for seq in range(1, 21):  # 20 s of beats, once a second; timeout 5: ack every 1.25 s
        clock.advance(1.0)
        acked += [f["seq"] for f in beat(engine, clock, seq, capacity=4)]
    assert acked == list(range(2, 21, 2))  # every other beat: half the writes
    connection = engine.registry.get("w1", 1)
    assert connection is not None and connection.quiet_acks == 10


def test_a_beat_faster_than_the_window_still_hears_from_the_server_in_time(engine, clock):
    lean(engine, clock)
    last = clock.mono
    for seq in range(1, 101):
        clock.advance(0.1)
        if beat(engine, clock, seq):
            assert clock.mono - last <= 5.0 / 4 + 0.1 + 1e-9  # the window and one beat
            last = clock.mono
    assert clock.mono - last <= 5.0 / 4 + 0.1


def test_results_are_always_acked(engine, clock):
    copy, save = one_result(engine, clock)
    [ack] = sent(engine.committed(save.ticket, None, clock()), 1)
    assert ack["seq"] == 1 and ack["accepted"] == [copy["id"]]
    clock.advance(0.1)
    assert beat(engine, clock, 2) == []  # idle again, within the window


def test_a_rejected_result_is_acked(engine, clock):
    lean(engine, clock)
    clock.advance(0.1)
    ghost = p.Result(job_id="ghost", attempt=1, outcome="completed", result=None)
    [ack] = beat(engine, clock, 1, results=[ghost])
    assert ack["rejected"][0]["job_id"] == "ghost"


def test_a_directive_is_acked_until_the_worker_takes_it(engine, clock):
    lean(engine, clock)
    assert engine.registry.direct(["w1"], "quiet") == ["w1"]
    clock.advance(0.1)
    [ack] = beat(engine, clock, 1)
    assert ack["state"] == "quiet"
    clock.advance(0.1)
    [ack] = beat(engine, clock, 2)  # still running by its word: told again
    assert ack["state"] == "quiet"
    clock.advance(0.1)
    assert beat(engine, clock, 3, state="quiet") == []  # it took it: nothing left to say
    assert engine.registry.get("w1", 1).directive is None  # type: ignore[union-attr]


def test_an_acks_order_holds_when_a_quiet_beat_follows_a_commit(engine, clock):
    _, save = one_result(engine, clock)
    assert beat(engine, clock, 2) == []  # behind a pending ack: acked after it, in order
    assert [a["seq"] for a in sent(engine.committed(save.ticket, None, clock()), 1)] == [1, 2]


def test_a_worker_without_the_flag_gets_every_ack(engine, clock):
    connect(engine, clock)
    for seq in range(1, 6):
        clock.advance(0.2)
        [ack] = beat(engine, clock, seq)
        assert ack["seq"] == seq


# -- sparse acks: a worker that holds no job asks to hear from the server less often ------
def sparse(engine: Engine, clock: FakeClock, interval: float, worker: str = "w1",
           conn: int = 1) -> dict[str, Any]:
    first = hb(worker, 0, register=True, capacity=4)
    assert first.registration is not None
    first.registration.lean_acks = True
    first.registration.idle_ack_interval = interval
    welcome, first_ack = sent(engine.register(conn, first, OPEN, clock())
                              + engine.heartbeat(conn, worker, first, clock()), conn)
    assert first_ack["type"] == "ack"
    return welcome


def idle_for(engine: Engine, clock: FakeClock, seconds: int, first_seq: int = 1,
             **extra: object) -> list[int]:
    """Beat once a second for ``seconds``: the seqs acked."""
    acked = []
    for seq in range(first_seq, first_seq + seconds):
        clock.advance(1.0)
        acked += [f["seq"] for f in beat(engine, clock, seq, capacity=4, **extra)]
    return acked


def test_an_idle_worker_that_asks_for_sparse_acks_hears_once_per_interval(engine, clock):
    welcome = sparse(engine, clock, 10.0)
    assert welcome["idle_ack_interval"] == 10.0  # what the server applies, said back
    assert idle_for(engine, clock, 40) == [10, 20, 30, 40]  # 4 writes, not 20 or 40


def test_the_idle_ack_interval_is_kept_between_a_quarter_of_the_timeout_and_a_minute(
        engine, clock):
    assert sparse(engine, clock, 0.01, "w1", 1)["idle_ack_interval"] == 5.0 / 4
    assert sparse(engine, clock, 3600.0, "w2", 2)["idle_ack_interval"] == 60.0


def test_without_lean_acks_the_interval_is_ignored_and_every_beat_is_acked(engine, clock):
    first = hb("w1", 0, register=True, capacity=4)
    assert first.registration is not None
    first.registration.idle_ack_interval = 10.0  # lean_acks left false
    welcome, _ = sent(engine.register(1, first, OPEN, clock())
                      + engine.heartbeat(1, "w1", first, clock()), 1)
    assert "idle_ack_interval" not in welcome
    assert idle_for(engine, clock, 5) == [1, 2, 3, 4, 5]


def test_an_older_worker_sees_no_new_field_in_its_welcome(engine, clock):
    assert [f["type"] for f in lean(engine, clock)] == ["welcome", "ack"]
    assert "idle_ack_interval" not in lean(engine, clock, "w2", 2)[0]


def test_a_worker_that_holds_a_job_is_acked_a_quarter_of_the_timeout_apart(engine, clock):
    sparse(engine, clock, 10.0)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    # Held by the server's word (assigned, not yet reported): the short window at once.
    assert idle_for(engine, clock, 4) == [2, 4]
    # Reported running: the same; the worker must learn of a dead connection before the
    # server gives its job to another.
    assert idle_for(engine, clock, 4, 5, active=[copy["id"]]) == [6, 8]
    [save] = of(Save, engine.heartbeat(1, "w1", hb("w1", 9, results=[done(copy)]), clock()))
    assert [a["seq"] for a in sent(engine.committed(save.ticket, None, clock()), 1)] == [9]
    # Done, and it says it holds nothing: sparse again, counted from that ack.
    assert idle_for(engine, clock, 20, 10) == [19, 29]


def test_a_directive_reaches_a_sparse_worker_at_its_next_beat(engine, clock):
    sparse(engine, clock, 10.0)
    assert idle_for(engine, clock, 3) == []
    engine.registry.direct(["w1"], "quiet")
    clock.advance(1.0)
    [ack] = beat(engine, clock, 4)
    assert ack["state"] == "quiet"


def test_a_registration_naming_a_run_it_lost_hears_welcome_cancel_then_ack(engine, clock):
    # docs/protocol.md §2 step 2: the one frame that may come between welcome and the
    # first ack, with sparse acks as without.
    first = hb("w1", 0, register=True, capacity=4, active=["gone-1"])
    assert first.registration is not None
    first.registration.lean_acks = True
    first.registration.idle_ack_interval = 10.0
    frames = sent(engine.register(1, first, OPEN, clock())
                  + engine.heartbeat(1, "w1", first, clock()), 1)
    assert [f["type"] for f in frames] == ["welcome", "cancel", "ack"]
    assert frames[1] == {"type": "cancel", "job_ids": ["gone-1"], "reason": "reservation_lost"}
