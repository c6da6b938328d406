"""The SDK's prefetch line (rota/worker/execution.py Runner), on an event loop with no server:
jobs beyond concurrency wait in assignment order and start the moment a slot frees;
capacity counts them; quiet, shutdown and cancels give waiting jobs back unstarted."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from helpers import wait_until

from rota.base import protocol as p
from rota.worker.context import StatusBuffer
from rota.worker.execution import Runner
from rota.worker.worker import Worker


def copy(job_id: str, attempt: int = 1, visibility_timeout: float = 60.0,
         spec: str = "slow") -> p.JobCopy:
    return p.JobCopy(id=job_id, spec=spec, checksum="c", queue="default", args={},
                     attempt=attempt, priority=0, visibility_timeout=visibility_timeout,
                     enqueued_at="2026-11-25T00:00:00.000Z")


class Line:
    """A runner of concurrency 2 and prefetch 2 whose handler waits for its job's gate."""

    def __init__(self, prefetch: int = 2) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.results: list[p.Result | None] = []
        self.runner = Runner(worker_id="w", handlers={"slow": self.slow, "new": self.slow},
                             concurrency=2,
                             status=StatusBuffer(wake=lambda: None), report=self.results.append,
                             max_abandoned=4, on_wedged=lambda: None, prefetch=prefetch)
        self.runner.run_times["slow"] = 0.0001  # short runs seen: the whole prefetch is wanted

    def capacity(self, state: str = "running") -> int:
        return self.runner.capacity(state, round_trip=0.002)

    async def slow(self, ctx) -> str:  # type: ignore[no-untyped-def]
        self.started.append(ctx.id)
        await self.gates.setdefault(ctx.id, asyncio.Event()).wait()
        return ctx.id

    def finish(self, job_id: str) -> None:
        self.gates.setdefault(job_id, asyncio.Event()).set()

    def errors(self) -> list[tuple[str, str]]:
        return [(r.job_id, r.error.type) for r in self.results
                if r is not None and r.error is not None]

    def take(self, *job_ids: str) -> None:
        for job_id in job_ids:
            self.runner.take(copy(job_id))


async def test_jobs_beyond_concurrency_wait_in_order_and_start_as_slots_free():
    line = Line()
    line.take("a", "b", "c", "d")
    await wait_until(lambda: line.started == ["a", "b"], what="two runs")
    assert line.runner.prefetched() == ["c", "d"]
    assert line.capacity() == 0
    line.finish("b")
    await wait_until(lambda: line.started == ["a", "b", "c"], what="c to start")
    assert line.runner.prefetched() == ["d"] and len(line.runner.running) == 2
    # The line's size follows the measured run time: pinned, so that a loaded machine
    # (b took long) does not shrink it under the assertion.
    line.runner.run_times["slow"] = 0.0001  # as Line starts it
    assert line.capacity() == 1  # one slot of the line is free
    for job_id in "acd":
        line.finish(job_id)
    await wait_until(lambda: len(line.results) == 4, what="four results")
    assert [r.outcome for r in line.results if r is not None] == ["completed"] * 4


async def test_the_whole_line_is_asked_for_only_once_runs_are_known_to_be_short():
    line = Line()
    line.runner.run_times.clear()  # nothing ended yet: runs taken for a second each
    assert line.capacity() == 2 + 1  # the free slots, and one job waiting
    line.take("a", "b")
    line.finish("a")
    await wait_until(lambda: len(line.results) == 1, what="a to end")
    assert line.runner.run_times["slow"] < 1.0
    assert line.capacity() == 1 + 2  # a's slot, and the whole line
    line.runner.run_times["slow"] = 3600.0  # jobs of an hour: one waits, no more
    assert line.capacity() == 1 + 1
    line.finish("b")


async def test_without_prefetch_capacity_is_concurrency_less_running():
    line = Line(prefetch=0)
    line.take("a")
    assert line.capacity() == 1 and line.capacity("quiet") == 0


@pytest.mark.parametrize("why", ["the worker is quiet", "the worker is terminating"])
async def test_quiet_or_stop_releases_what_waits_and_holds_nothing_more(why):
    line = Line()
    line.take("a", "b", "c", "d")
    line.runner.release_waiting(why)
    assert line.errors() == [("c", "released"), ("d", "released")]
    assert line.runner.prefetched() == []
    line.take("e")  # an assign that was on its way: both slots busy, so it goes back too
    assert line.errors()[-1] == ("e", "released")
    line.finish("a")
    await wait_until(lambda: len(line.results) == 4, what="a's result")
    assert line.started == ["a", "b"]  # nothing waiting started
    line.runner.holding = True  # resumed (SIGCONT): it holds jobs again
    line.take("f", "g")
    await wait_until(lambda: "f" in line.started, what="f to start in a's slot")
    assert line.runner.prefetched() == ["g"]
    for job_id in "bfg":
        line.finish(job_id)


@pytest.mark.parametrize("state, said", [("quiet", "quiet"), ("terminate", "terminating")])
async def test_a_state_change_says_why_it_releases_in_words(state, said, tmp_path, caplog):
    """SIGTERM logged "released job=c: the worker is terminate"."""
    worker, line = Worker(specs_dir=tmp_path), Line()
    worker.runner = line.runner
    line.take("a", "b", "c")
    with caplog.at_level(logging.INFO, logger="rota.worker"):
        worker._set_state(state)
    assert f"released job=c: the worker is {said}" in caplog.messages
    assert line.results[-1].error.message == f"given back unstarted: the worker is {said}"
    line.finish("a"), line.finish("b")


async def test_a_cancel_drops_a_waiting_job_and_reports_it_without_running_it():
    line = Line()
    line.take("a", "b", "c", "d")
    await wait_until(lambda: line.started == ["a", "b"], what="two runs")
    line.runner.cancel("c", "cancelled")
    line.runner.cancel("d", "reservation_lost")  # no longer ours: nothing to report
    assert line.errors() == [("c", "cancelled")] and line.results[-1] is None
    line.take("e", "f")
    line.runner.cancel_all("shutdown")  # stop_now: the waiting ones never started
    assert line.errors()[-2:] == [("e", "released"), ("f", "released")]
    await wait_until(lambda: not line.runner.running, what="the runs to stop")
    assert line.started == ["a", "b"]
    assert line.errors()[-2:] == [("a", "shutdown"), ("b", "shutdown")]


async def test_stop_all_starts_nothing_from_the_line():
    line = Line()
    line.take("a", "b", "c")
    await wait_until(lambda: len(line.started) == 2, what="two runs")
    line.runner.stop_all()
    await wait_until(lambda: not line.runner.running, what="the runs to stop")
    assert line.started == ["a", "b"] and line.runner.prefetched() == []


async def test_a_job_that_waits_past_its_lease_is_no_longer_named_and_goes_back():
    line = Line()
    line.take("a", "b")
    line.runner.take(copy("c", visibility_timeout=0.05))
    assert line.runner.prefetched(time.monotonic()) == ["c"]
    assert line.runner.prefetched(time.monotonic() + 1.0) == []  # a blocked loop stops renewing it

    def given_back() -> bool:
        line.runner.give_up_lapsed()  # what the worker's tick does every 0.1 s
        return not line.runner.waiting

    await wait_until(given_back, what="c to go back")
    assert line.errors() == [("c", "released")] and line.started == ["a", "b"]
    for job_id in "ab":
        line.finish(job_id)


async def test_a_line_filled_while_runs_were_quick_is_trimmed_when_they_slow_down():
    """A line never holds more than LINE_SECONDS of work at the runs' present pace: when
    a slow run ends after quick ones, the newest waiting jobs go back (released,
    unstarted) for an idle worker, and the oldest keep their turn."""
    from rota.worker.execution import LINE_SECONDS

    line = Line(prefetch=50)
    line.take(*[f"j{i}" for i in range(12)])
    await wait_until(lambda: line.started == ["j0", "j1"], what="two runs")
    assert len(line.runner.prefetched()) == 10  # past 2 x keep + concurrency = 4 below
    line.runner.run_times["slow"] = 4.0 * LINE_SECONDS  # as if runs had become slow
    line.finish("j0")
    await wait_until(lambda: "j2" in line.started, what="the next run")
    # keep = ceil(LINE_SECONDS * 2 / run_time) = 1 (the average moved little toward j0's
    # short run): j2 stays and takes the free slot; j3..j11 went back, unstarted.
    assert line.runner.prefetched() == []
    released = [job_id for job_id, kind in line.errors() if kind == "released"]
    assert sorted(released) == sorted(f"j{i}" for i in range(3, 12))
    assert line.capacity() == 1  # it asks again only for a line of one


async def test_the_first_jobs_of_a_spec_never_timed_do_not_fill_a_line_sized_for_others():
    """A line sized for quick runs of one spec took 32 jobs of 2 s of another: of a spec
    none of whose runs has been timed, one job per slot waits; the others go back at once."""
    line = Line(prefetch=32)
    line.take("a", "b")  # quick jobs (of "slow", timed at 0.1 ms) in both slots
    assert line.capacity() == 32
    for n in range(32):
        line.runner.take(copy(f"n{n}", spec="new"))
    assert line.runner.prefetched() == ["n0", "n1"]
    assert sorted(job_id for job_id, kind in line.errors() if kind == "released") == sorted(
        f"n{n}" for n in range(2, 32))
    assert line.capacity() == 0  # a job of unknown length is held: a line of one, full
    for job_id in ("a", "b", "n0", "n1"):
        line.finish(job_id)
    await wait_until(lambda: len(line.results) == 34, what="the four runs")
    assert line.runner.run_times.keys() == {"slow", "new"} and not line.runner.held


async def test_an_idle_worker_asks_for_a_line_sized_by_the_slowest_spec_it_timed():
    """Quick jobs drain a line between two assignments: asking then for the free slots
    alone cost a round trip per batch (the no-op benchmark halved). Idle, the slowest
    spec timed here sizes the line."""
    line = Line(prefetch=8)
    assert not line.runner.held
    assert line.capacity() == 2 + 8  # only quick runs timed: the whole line
    line.runner.run_times["new"] = 3600.0  # one spec of an hour timed too: one waits
    assert line.capacity() == 2 + 1
    line.runner.run_times.clear()  # nothing timed yet: runs taken for a second each
    assert line.capacity() == 2 + 1


async def test_starts_are_noted_and_a_take_back_gives_only_waiting_jobs_back():
    """What the next heartbeat names (status.started, status.given_back): a start is
    noted as the run begins (Runner.start, before a task, a thread or a child runs the
    handler); a job taken back leaves the line unstarted and unreported as a result;
    one started already runs on."""
    line = Line()
    line.take("a", "b", "c", "d")
    await wait_until(lambda: line.started == ["a", "b"], what="two runs")
    assert list(line.runner.starts) == ["a", "b"]
    line.runner.take_back(["b", "d", "zz"])  # b runs; zz is not held
    assert list(line.runner.given) == ["d"] and line.runner.prefetched() == ["c"]
    assert line.results == []  # no result: given_back says it
    line.finish("a")
    await wait_until(lambda: line.started == ["a", "b", "c"], what="c to start")
    assert list(line.runner.starts) == ["a", "b", "c"]
    for job_id in "bc":
        line.finish(job_id)
    await wait_until(lambda: len(line.results) == 3, what="three results")
    assert "d" not in line.started


async def test_a_worker_new_to_a_spec_holds_one_job_waiting_behind_its_runs():
    """A fresh worker of concurrency 1 running a job of 10-20 s held nothing in its line
    ("load=1/1 +0/32") until it had timed a run: an untimed run counts as a second of
    work, so one job waits (README, prefetch), and another worker may take it back."""
    results: list[p.Result | None] = []
    gate = asyncio.Event()

    async def long(ctx) -> None:  # type: ignore[no-untyped-def]
        await gate.wait()

    runner = Runner(worker_id="w", handlers={"long": long}, concurrency=1,
                    status=StatusBuffer(wake=lambda: None), report=results.append,
                    max_abandoned=2, on_wedged=lambda: None, prefetch=32)
    assert runner.capacity("running", round_trip=0.002) == 1 + 1  # registering: nothing yet
    runner.take(copy("a", spec="long"))
    assert runner.capacity("running", round_trip=0.002) == 1  # a runs: one more may wait
    runner.take(copy("b", spec="long"))
    assert runner.prefetched() == ["b"] and runner.capacity("running", round_trip=0.002) == 0
    gate.set()
    await wait_until(lambda: len(results) == 2, what="both runs")
