"""Repeated heartbeats (rota/core/heartbeats.py ``repeat``), on a fake clock: a beat the
same as the last but for its seq is answered without decoding it again, and must do
exactly what the full path would; anything that the full path would settle (a held job,
a directive, an ack behind a commit, jobs kept for reclaim) sends it down that path."""

from __future__ import annotations

from typing import Any

import pytest

from rota.base import protocol as p
from rota.core.auth import OPEN
from rota.core.effects import Effect, Save, Wake
from rota.core.engine import Engine
from rota.core.heartbeats import plain


from test_engine import FakeClock, assign, done, enqueue, hb, make_engine, of, sent
from test_engine import clock, engine  # noqa: F401  (fixtures)


def register(engine: Engine, clock: FakeClock, *, capacity: int = 4, sparse: bool = True
             ) -> None:
    first = hb("w1", 0, register=True, capacity=capacity)
    assert first.registration is not None
    first.registration.lean_acks = sparse
    first.registration.idle_ack_interval = 10.0 if sparse else None
    engine.register(1, first, OPEN, clock())
    engine.heartbeat(1, "w1", first, clock())


def kinds(effects: list[Effect]) -> list[Any]:
    return [type(e).__name__ for e in effects] + sent(effects)


# -- the frame: what is split, and what is not --------------------------------------------
def test_a_frame_as_encode_writes_it_splits_into_seq_and_rest():
    frame = p.encode(hb("w1", 42, capacity=3))
    seq, rest = p.split_seq(frame)  # type: ignore[misc]
    assert seq == 42 and rest.startswith(',"worker_id":"w1"')
    assert p.split_seq(p.encode(hb("w1", 43, capacity=3))) == (43, rest)


@pytest.mark.parametrize("frame", [
    '{"seq":1,"type":"heartbeat","worker_id":"w1"}',  # another order: decoded in full
    '{"type":"heartbeat","seq":01,"worker_id":"w1"}',  # not JSON: the full path refuses it
    '{"type":"heartbeat","seq":-1,"worker_id":"w1"}',
    '{"type":"heartbeat","seq":1.0,"worker_id":"w1"}',
    '{"type":"heartbeat","seq":\u0661,"worker_id":"w1"}',  # an Arabic-Indic one
    '{"type":"heartbeat","seq":1234567890123456789012,"worker_id":"w1"}',
    '{"type":"heartbeat","seq":1}',
    '{"type":"heartbeat","seq":,"worker_id":"w1"}',
    '{"type":"heartbeat","seq":1,"worker_id":"w1","seq":9}',  # JSON's last would win
    '{"type":"heartbeat","seq":1,"worker_id":"w1","s\\u0065q":9}',  # and spelt so too
    ' {"type":"heartbeat","seq":1,"worker_id":"w1"}',
])
def test_anything_else_is_not_split(frame: str):
    assert p.split_seq(frame) is None


# -- which beats are plain ----------------------------------------------------------------
def test_only_a_beat_with_no_news_is_plain():
    assert plain(hb("w1", 1, capacity=4))
    assert not plain(hb("w1", 1, register=True))
    assert not plain(hb("w1", 1, active=["j1"]))
    ghost = p.Result(job_id="j", attempt=1, outcome="completed", result=None)
    assert not plain(hb("w1", 1, results=[ghost]))
    figures = hb("w1", 1)
    assert figures.status is not None
    figures.status.cpu_percent = 3.0  # the same figures again are no news
    assert plain(figures)
    figures.status.given_back = ["j1"]
    assert not plain(figures)
    assert not plain(p.Heartbeat(seq=1, worker_id="w1", goodbye=True))
    assert not plain(p.Heartbeat(seq=1, worker_id="w1"))  # no status: never checked


# -- a repeat does what the full path does ------------------------------------------------
@pytest.mark.parametrize("sparse", [True, False])
@pytest.mark.parametrize("capacity", [0, 4])
def test_a_repeat_does_what_the_full_beat_would(clock, sparse: bool, capacity: int):
    """Two engines, one fed every beat in full, one fed repeats: the same effects, the
    same acks (or none), the same connection, beat by beat, for a minute."""
    full, fast = make_engine(clock), make_engine(clock)
    for each in (full, fast):
        register(each, clock, capacity=capacity, sparse=sparse)
    clock.advance(0.5)
    for each in (full, fast):
        each.heartbeat(1, "w1", hb("w1", 1, capacity=capacity), clock())
    for seq in range(2, 122):
        clock.advance(0.5)
        expected = full.heartbeat(1, "w1", hb("w1", seq, capacity=capacity), clock())
        got = fast.repeat(1, "w1", seq, clock())
        assert got is not None and kinds(got) == kinds(expected), seq
        a, b = full.registry.get("w1", 1), fast.registry.get("w1", 1)
        assert a is not None and b is not None
        assert (a.last_seen, a.frames, a.last_ack, a.quiet_acks) == (
            b.last_seen, b.frames, b.last_ack, b.quiet_acks)
    assert (capacity > 0) == bool(of(Wake, got))  # a free worker wakes a round, as ever


def test_a_repeat_is_refused_before_a_plain_beat_and_for_an_unknown_connection(engine, clock):
    register(engine, clock)
    assert engine.repeat(1, "w1", 1, clock()) is None  # the registration is not plain
    assert engine.repeat(2, "w1", 1, clock()) is None
    engine.heartbeat(1, "w1", hb("w1", 1, capacity=4), clock())
    assert engine.repeat(1, "w1", 2, clock()) is not None
    assert engine.repeat(1, "nobody", 2, clock()) is None


def test_a_worker_holding_a_job_takes_the_full_path(engine, clock):
    register(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    clock.advance(0.1)
    engine.heartbeat(1, "w1", hb("w1", 1, active=[copy["id"]]), clock())
    assert engine.repeat(1, "w1", 2, clock()) is None  # its lease is renewed in full


def test_a_directive_takes_the_full_path_until_the_worker_follows_it(engine, clock):
    register(engine, clock)
    engine.heartbeat(1, "w1", hb("w1", 1, capacity=4), clock())
    assert engine.registry.direct(["w1"], "quiet") == ["w1"]
    assert engine.repeat(1, "w1", 2, clock()) is None
    [ack] = sent(engine.heartbeat(1, "w1", hb("w1", 2, capacity=4), clock()), 1)
    assert ack["state"] == "quiet"
    quiet = hb("w1", 3, capacity=4, state="quiet")
    engine.heartbeat(1, "w1", quiet, clock())
    assert engine.repeat(1, "w1", 4, clock()) is not None  # followed: plain again


def test_an_ack_behind_a_commit_keeps_its_order(engine, clock):
    register(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    clock.advance(0.1)
    [save] = of(Save, engine.heartbeat(1, "w1", hb("w1", 1, results=[done(copy)]), clock()))
    # Not plain (a result); and were it, the ack waiting on the commit must go first.
    assert engine.repeat(1, "w1", 2, clock()) is None
    [ack] = sent(engine.committed(save.ticket, None, clock()), 1)
    assert ack["seq"] == 1


def test_jobs_kept_for_reclaim_take_the_full_path(engine, clock):
    register(engine, clock)
    enqueue(engine, clock)
    [copy] = assign(engine, clock)
    engine.heartbeat(1, "w1", hb("w1", 1, active=[copy["id"]]), clock())
    engine.disconnect(1, "w1", "connection_lost", clock())  # kept for the grace
    first = hb("w2", 0, register=True, capacity=4)
    engine.register(2, first, OPEN, clock())
    engine.heartbeat(2, "w2", first, clock())
    engine.heartbeat(2, "w2", hb("w2", 1, capacity=4), clock())
    assert engine.scheduler.has_orphans
    assert engine.repeat(2, "w2", 2, clock()) is None  # a full beat may name them


def test_a_repeat_sets_the_capacity_again_as_the_full_beat_would(clock):
    """An assign lowers the worker's capacity until a heartbeat sets it again; a repeat
    of a beat that gave one sets it again too (found by a helper's review: the fast
    path once kept the lowered value, and a second job waited)."""
    full, fast = make_engine(clock), make_engine(clock)
    for each in (full, fast):
        register(each, clock, capacity=0)
        each.heartbeat(1, "w1", hb("w1", 1, capacity=1), clock())
        enqueue(each, clock)
        assert len(assign(each, clock)) == 1  # the one free slot taken: capacity 0
    clock.advance(0.5)
    expected = full.heartbeat(1, "w1", hb("w1", 2, capacity=1), clock())
    got = fast.repeat(1, "w1", 2, clock())
    assert got is not None and kinds(got) == kinds(expected)
    assert full.scheduler.workers["w1"].capacity == fast.scheduler.workers["w1"].capacity == 1
    for each in (full, fast):
        enqueue(each, clock)
        assert len(assign(each, clock)) == 1  # the second job goes out on both
