"""The worker's sans-I/O core (rota/worker/link.py), driven with plain numbers for a clock."""

from __future__ import annotations

import pytest

from rota.base import protocol as p
from rota.worker.link import (SMOOTHING, Link, LinkState, Servers, ids_size, line_pace,
                             prefetch_line)

WELCOME = p.Welcome(worker_id="w", server_time="2026-01-01T00:00:00Z", heartbeat_interval=1.0,
                    heartbeat_timeout=8.0, visibility_timeout=60.0,
                    specs=p.SpecVerdict(accepted=[], rejected=[]))


def result(job_id: str) -> p.Result:
    return p.Result(job_id=job_id, attempt=1, outcome="completed", result=None)


def ack(beat: p.Heartbeat, state: str = "running", **extra: object) -> p.Ack:
    return p.Ack(seq=beat.seq, state=state, server_time="2026-01-01T00:00:00Z",  # type: ignore[arg-type]
                 **extra)  # type: ignore[arg-type]


def connected(now: float = 0.0) -> tuple[Link, p.Heartbeat]:
    link = Link("w")
    link.opened()
    first = link.heartbeat(now, state="running", active=[], capacity=4)
    link.on_welcome(WELCOME)
    link.on_ack(ack(first))
    return link, first


def beat(link: Link, now: float, capacity: int = 4) -> p.Heartbeat:
    return link.heartbeat(now, state="running", active=[], capacity=capacity)


def test_a_lone_result_is_due_at_once():
    link, _ = connected()
    assert not link.due(0.1)
    link.add_result(result("a"), 0.1)
    assert link.due(0.1)
    sent = beat(link, 0.1)
    assert [r.job_id for r in sent.results] == ["a"] and list(link.flush_delays) == [0.0]


def test_results_wait_for_the_ack_in_flight_then_go_together():
    link, _ = connected()
    link.add_result(result("a"), 0.1)
    first = beat(link, 0.1)
    for job_id in "bcd":
        link.add_result(result(job_id), 0.2)
    assert not link.due(0.3)  # held back: "a" is not acked yet
    assert not link.due(0.3, capacity=4)  # freed slots ride the next batch too
    link.on_ack(ack(first, accepted=["a"]))
    assert link.due(0.3)
    assert [r.job_id for r in beat(link, 0.3).results] == ["b", "c", "d"]


def test_the_periodic_beat_and_urgent_news_are_never_held_back():
    link, _ = connected()
    link.add_result(result("a"), 0.1)
    beat(link, 0.1)
    link.add_result(result("b"), 0.2)
    assert not link.due(0.5)
    assert link.due(1.1)  # the interval passed since the last beat
    link.urge()
    assert link.due(0.5)
    assert link.due(0.5, stopping=True)


def test_slots_freed_with_nothing_to_report_are_due_when_nothing_is_in_flight():
    link, _ = connected()
    beat(link, 0.1, capacity=2)
    assert not link.due(0.2, capacity=2)
    assert link.due(0.2, capacity=3)


def test_a_new_connection_resends_unacked_results_first_and_restarts_seq():
    link, _ = connected()
    link.add_result(result("a"), 0.1)
    beat(link, 0.1)
    link.add_result(result("b"), 0.2)
    link.lost()
    link.opened()
    assert link.state == LinkState.REGISTERING
    again = beat(link, 0.3)
    assert again.seq == 0 and [r.job_id for r in again.results] == ["a", "b"]


def test_an_ack_directs_only_when_stricter_than_what_its_heartbeat_said():
    link, _ = connected()
    said_quiet = link.heartbeat(0.1, state="quiet", active=[], capacity=0)
    assert link.on_ack(ack(said_quiet, state="quiet")).directive is None
    said_running = beat(link, 0.2)
    assert link.on_ack(ack(said_running, state="terminate")).directive == "terminate"


def test_an_ack_saying_running_to_a_quiet_heartbeat_resumes_the_worker():
    link, _ = connected()
    said_quiet = link.heartbeat(0.1, state="quiet", active=[], capacity=0)
    assert link.on_ack(ack(said_quiet, state="running")).directive == "running"
    said_terminate = link.heartbeat(0.2, state="terminate", active=[], capacity=0)
    assert link.on_ack(ack(said_terminate, state="running")).directive is None  # final


def test_a_result_the_server_could_not_store_goes_again():
    link, _ = connected()
    link.add_result(result("a"), 0.1)
    sent = beat(link, 0.1)
    rejection = p.ResultRejection(job_id="a", attempt=1, reason="could not be stored (disk"
                                  " full); report it again")
    outcome = link.on_ack(ack(sent, rejected=[rejection]))
    # Not at once: with the periodic beat (against a failing disk, at once made a storm).
    assert outcome.resend == 1 and link.pending() and not link.due(0.2)
    assert link.due(0.1 + link.interval)
    assert [r.job_id for r in beat(link, 0.1 + link.interval).results] == ["a"]


def test_a_result_to_send_again_rides_along_with_a_fresh_one():
    link, _ = connected()
    link.add_result(result("a"), 0.1)
    rejection = p.ResultRejection(job_id="a", attempt=1, reason="could not be stored"
                                  " (storage_full: full); report it again")
    link.on_ack(ack(beat(link, 0.1), rejected=[rejection]))
    link.add_result(result("b"), 0.2)
    assert link.due(0.2)  # b is news
    assert [r.job_id for r in beat(link, 0.2).results] == ["a", "b"]


def test_an_overdue_ack_is_worth_a_ping():
    link, _ = connected()
    beat(link, 1.0)  # never acked
    assert link.ping_patience(3.9) is None  # within max(timeout / 4, 2 intervals) + 1
    assert link.ping_patience(4.1) == 2.0  # 8.0 / 4


def test_idle_beats_the_server_leaves_unanswered_are_answered_by_the_next_ack():
    """Lean acks (docs/protocol.md §4.2): the server answers an idle beat only when it
    sent no ack for a quarter of its timeout, so acks skip seqs; a later ack answers the
    skipped beats too, and a worker beating steadily never finds an ack overdue."""
    link, _ = connected()  # timeout 8: the server acks an idle beat every 2 s at most
    last_ack = 0.0
    for tick in range(1, 40):
        now = tick * 0.5 * link.interval  # beating faster than the server acks
        assert link.ping_patience(now) is None, now
        sent = beat(link, now)
        if now - last_ack >= 8.0 / 4:  # the server's rule
            link.heard(now)
            assert link.on_ack(ack(sent)).directive is None
            last_ack = now
            assert link.oldest_unanswered(now) == 0.0  # the skipped ones went with it
    assert link.oldest_unanswered(now) < 2.0


def test_a_server_silent_past_its_lean_ack_window_gets_a_ping():
    link, _ = connected()
    link.heard(1.0)
    link.on_ack(ack(beat(link, 1.0)))
    for now in (2.0, 3.0, 4.0, 5.0):
        beat(link, now)  # none answered: after the window, the server is in doubt
    assert link.ping_patience(5.0) is None  # (2.0 unanswered since 2.0: within 3 s)
    assert link.ping_patience(5.1) == 2.0


def test_reconnect_delays_grow_jittered_and_stay_under_half_the_timeout():
    low = Link("w", reconnect_max_delay=30.0, rand=lambda: 0.0)
    high = Link("w", reconnect_max_delay=30.0, rand=lambda: 1.0)
    for link in (low, high):
        link.on_welcome(WELCOME)
    lows = [low.reconnect_delay() for _ in range(8)]
    highs = [high.reconnect_delay() for _ in range(8)]
    assert highs[:3] == [0.1, 0.2, 0.4] and lows[0] == 0.05
    assert max(highs) == 4.0  # heartbeat_timeout / 2
    low.on_welcome(WELCOME)  # a welcome resets the count
    assert low.reconnect_delay() == 0.05


def test_with_several_servers_the_delay_grows_once_per_full_round():
    link = Link("w", reconnect_max_delay=30.0, rand=lambda: 1.0)
    link.on_welcome(WELCOME)
    # Three servers: each is tried at the first step's pace before the next step.
    assert [link.reconnect_delay(3) for _ in range(7)] == [0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.4]
    link.on_welcome(WELCOME)  # connected somewhere: the count starts again
    assert link.reconnect_delay(3) == 0.1


def test_servers_go_round_in_the_order_given():
    servers = Servers(["ws://a/work", "ws://b/work", "ws://c/work"])
    assert servers.current == "ws://a/work" and len(servers) == 3
    assert [servers.advance() for _ in range(4)] == ["ws://b/work", "ws://c/work",
                                                     "ws://a/work", "ws://b/work"]
    alone = Servers(["ws://a/work"])
    assert alone.advance() == alone.current == "ws://a/work"
    with pytest.raises(ValueError, match="at least one server"):
        Servers([])


def test_drained_means_nothing_runs_nothing_waits_and_on_the_slow_path_all_is_acked():
    link, _ = connected()
    assert link.drained(running=0, fast=False)
    assert not link.drained(running=1, fast=False)
    link.add_result(result("a"), 0.1)
    assert not link.drained(running=0, fast=True)
    beat(link, 0.1)
    assert not link.drained(running=0, fast=False) and link.drained(running=0, fast=True)


# -- prefetch: how long a line to hold ---------------------------------------------------
def test_the_line_covers_a_round_trip_of_runs_and_no_more_than_prefetch():
    # Nothing known of run times yet: hold only what runs.
    assert prefetch_line(30, 10, None, 0.002) == 0
    # No-op jobs (0.1 ms) and a 2 ms round trip: the whole prefetch.
    assert prefetch_line(30, 10, 0.0001, 0.002) == 30
    # 10 ms jobs: ten slots finish 2 in a round trip; twice that is held.
    assert prefetch_line(30, 10, 0.010, 0.002) == 4
    # Long jobs: one waiting job at most, so that an idle worker gets the others.
    assert prefetch_line(30, 10, 60.0, 0.002) == 1
    assert prefetch_line(0, 10, 0.0001, 0.002) == 0  # prefetch 0: as before prefetch


def test_the_line_is_sized_by_the_slowest_timed_spec_held_and_only_once_all_are_timed():
    """The first 2 s jobs after quick ones took a line of 32: one spec's quick runs
    sized the line for another's."""
    timed = {"echo": 0.0001, "resize": 2.0}
    assert line_pace(timed, []) is None  # nothing held (idle): the free slots first
    assert line_pace(timed, ["echo", "echo"]) == 0.0001
    assert line_pace(timed, ["echo", "resize"]) == 2.0  # the slowest held sizes it
    assert line_pace(timed, ["echo", "import"]) is None  # a spec never timed here: no line
    assert prefetch_line(32, 1, line_pace(timed, ["echo", "import"]), 0.002) == 0


def test_the_round_trip_is_timed_on_acks_of_heartbeats_with_results():
    link, _ = connected()
    before = link.round_trip
    link.add_result(result("a"), 1.0)
    beat = link.heartbeat(1.0, state="running", active=[], capacity=4)
    link.on_ack(ack(beat, accepted=["a"]), now=1.010)  # 10 ms: a commit's wait
    timed = before + SMOOTHING * (0.010 - before)
    assert abs(link.round_trip - timed) < 1e-9
    idle = link.heartbeat(2.0, state="running", active=[], capacity=4)
    link.on_ack(ack(idle), now=2.0001)  # no results, no commit: not a round trip
    assert abs(link.round_trip - timed) < 1e-9


def test_the_ids_of_a_deep_line_leave_less_room_for_results():
    link, _ = connected()
    for n in range(2000):  # released jobs: short errors, no details
        link.add_result(p.Result(job_id=f"j{n}", attempt=1, outcome="failed",
                                 error=p.ErrorInfo(type="released", message="given back")), 0.0)
    roomy = link.heartbeat(0.0, state="quiet", active=[], capacity=0)
    ids = [f"{n:0128d}" for n in range(1000)]  # the longest line of the longest ids
    tight = link.heartbeat(0.0, state="quiet", active=[], capacity=0, reserve=ids_size(ids))
    assert len(roomy.results) > len(tight.results) > 0
    tight.status.prefetched_job_ids = ids  # type: ignore[union-attr]
    assert len(p.encode(tight)) < 1 << 20  # what the server takes


SPARSE = p.Welcome(worker_id="w", server_time="2026-01-01T00:00:00Z", heartbeat_interval=1.0,
                   heartbeat_timeout=8.0, visibility_timeout=60.0,
                   specs=p.SpecVerdict(accepted=[], rejected=[]), idle_ack_interval=10.0)


def test_an_idle_worker_with_sparse_acks_waits_the_interval_and_a_beat_before_a_ping():
    """Sparse acks (docs/protocol.md §4.2): the welcome's idle ack interval is how long an
    idle worker's beats may go unanswered; past it and a beat, a ping asks."""
    link, _ = connected()
    link.on_welcome(SPARSE)
    link.heard(1.0)
    link.on_ack(ack(beat(link, 1.0)))
    for now in range(2, 13):
        beat(link, float(now))
        assert link.ping_patience(float(now)) is None, now  # 2.0 unanswered: within 11 s
    assert link.ping_patience(13.1) == 2.0  # the ping's patience stays a quarter of 8


def test_a_beat_that_held_a_job_is_judged_by_the_short_window_even_with_sparse_acks():
    link, _ = connected()
    link.on_welcome(SPARSE)
    link.heard(1.0)
    link.on_ack(ack(beat(link, 1.0)))
    beat(link, 2.0)
    beat(link, 3.0)  # idle: within the idle interval
    link.heartbeat(4.0, state="running", active=["job-1"], capacity=3)
    assert link.ping_patience(7.0) is None  # within max(8 / 4, 2 intervals) + 1 of 4.0
    assert link.ping_patience(7.1) == 2.0  # it holds a job: the server should have said
    link.heard(7.1)  # an assign, say: the server is there
    assert link.ping_patience(10.0) is None
