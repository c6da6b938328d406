"""Webhooks out on a real server, to a receiver in the test: a subscription gets the
events of its kinds and filter, signed, each with one event id and one delivery id on
every attempt; a receiver that is down gets every event once it is back, while jobs
flow on; the API's answers and refusals; the delivery log, a test delivery, a secret's
rotation."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from typing import Any

import pytest
from conftest import Live, start_server, stop_server, write_spec
from helpers import wait_until
from hookrig import Receiver

from rota.base.signing import verify
from rota.core import webhooks as wh
from rota.server import hooks
from rota.store import hooks as sql

pytestmark = pytest.mark.both_backends
# The receiver is on loopback: rota serve --allow-private-endpoints.
FAST = {"webhook_backoff_scale": 0.01, "webhook_timeout": 2.0,
        "allow_private_endpoints": True}


async def subscribe(live: Live, receiver: Receiver, **body) -> dict:
    answer = await live.http.post("/webhooks", json={"url": receiver.url, **body})
    assert answer.status_code == 201, answer.text
    return answer.json()


@pytest.mark.parametrize("live", [FAST], indirect=True)
async def test_a_subscription_gets_its_events_signed_and_the_log_keeps_them(live: Live,
                                                                           tmp_path):
    receiver = await Receiver().start()
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"),
                        write_spec(tmp_path / "specs", "other"))
        sub = await subscribe(live, receiver, kinds=["enqueue", "cancel"],
                              filter={"spec": "mail"})
        assert sub["secret"].startswith("whsec_") and sub["kinds"] == ["enqueue", "cancel"]
        job = await live.enqueue("mail", {"to": "a"})
        await live.enqueue("other", {})  # not the filter's spec
        await live.http.delete(f"/jobs/{job['id']}")
        await wait_until(lambda: len(receiver.got) >= 2, what="two deliveries")
        kinds = [r.json["kind"] for r in receiver.got]
        assert sorted(kinds) == ["cancel", "enqueue"]
        for got in receiver.got:
            assert verify(sub["secret"], got.headers, got.body, time.time())
            assert got.headers["x-rota-event"] == got.json["kind"]
            assert got.headers["x-rota-subscription-id"] == sub["id"]
            assert got.headers["x-rota-delivery-id"].startswith("dlv_")
            assert got.json["id"].startswith("evt_")
            assert got.json["data"]["job"] == job["id"]
            assert got.json["data"]["spec"] == "mail"
        shown = (await live.http.get(f"/webhooks/{sub['id']}")).json()
        assert "secret" not in shown and shown["filter"] == {"spec": "mail"}

        async def delivered() -> bool:
            log = (await live.http.get(f"/webhooks/{sub['id']}/deliveries")).json()
            return [d["state"] for d in log["deliveries"]] == ["delivered", "delivered"]
        await wait_until(delivered, what="the log says delivered")

        test = (await live.http.post(f"/webhooks/{sub['id']}/test")).json()
        assert test["ok"] and test["status"] == 200
        assert receiver.got[-1].json["kind"] == "test"

        rotated = (await live.http.post(f"/webhooks/{sub['id']}/rotate-secret")).json()
        assert rotated["secret"] != sub["secret"]
        await live.http.post(f"/webhooks/{sub['id']}/test")
        last = receiver.got[-1]
        assert verify(rotated["secret"], last.headers, last.body, time.time())
        assert verify(sub["secret"], last.headers, last.body, time.time())  # the window
        assert (await live.http.delete(f"/webhooks/{sub['id']}")).status_code == 200
        assert (await live.http.get(f"/webhooks/{sub['id']}")).status_code == 404
    finally:
        await receiver.close()


@pytest.mark.parametrize("live", [{**FAST, "webhook_backoff_scale": 0.002}], indirect=True)
async def test_a_receiver_down_gets_every_event_after_with_the_same_ids(live: Live, tmp_path):
    """The done-when line, fast: the receiver refuses connections for ~2 s while jobs
    are enqueued; after, it has every event, each delivery id always with one event."""
    receiver = await Receiver().start()
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        sub = await subscribe(live, receiver, kinds=["enqueue"])
        await receiver.down()
        ids = [(await live.enqueue("mail", {"n": n}))["id"] for n in range(20)]

        async def retried() -> bool:
            log = (await live.http.get(f"/webhooks/{sub['id']}/deliveries",
                                       params={"limit": 100})).json()["deliveries"]
            return len(log) == 20 and any(d["attempts"] >= 2 for d in log)
        await wait_until(retried, timeout=10.0, what="retries while down")
        await receiver.start()
        await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == set(ids),
                         timeout=15.0, what="every event after the receiver is back")
        pairs = {(r.headers["x-rota-delivery-id"], r.json["id"]) for r in receiver.got}
        assert len({d for d, _ in pairs}) == len(pairs) == 20  # one event id per delivery id
    finally:
        await receiver.close()


@pytest.mark.parametrize("live", [FAST], indirect=True)
async def test_bad_subscriptions_are_refused_precisely(live: Live):
    cases = [
        ({"url": "ftp://x/y", "kinds": ["enqueue"]}, 422,
         "url must be http or https, not 'ftp'"),
        ({"url": "https://x/y", "kinds": []}, 422, "kinds must be a non-empty list of event"
         " kinds: * or any of enqueue, assign, result, retry, discard, cancel, worker_connect,"
         " worker_disconnect, worker_state, state_change, alert, cron_fire, cron_skip,"
         " cron_miss"),
        ({"url": "https://x/y", "kinds": ["job.done"]}, 422, "unknown event kind(s)"
         " 'job.done'; the kinds are * (all) or enqueue, assign, result, retry, discard,"
         " cancel, worker_connect, worker_disconnect, worker_state, state_change, alert,"
         " cron_fire, cron_skip, cron_miss"),
        ({"url": "https://x/y", "kinds": ["*"], "filter": {"host": "a"}}, 422,
         "unknown filter key 'host': the keys are spec, queue, worker"),
        ({"url": "https://x/y", "kinds": ["*"], "filter": {"spec": "a b"}}, 422,
         "filter.spec is not a name (letters, digits and _.:- up to 128)"),
        ({"url": "https://u:p@x/y", "kinds": ["*"]}, 422,
         "url may not carry a user or password (use headers and a secret)"),
    ]
    for body, status, message in cases:
        answer = await live.http.post("/webhooks", json=body)
        assert (answer.status_code, answer.json()["error"]["message"]) == (status, message)
    assert (await live.http.get("/webhooks")).json() == {"webhooks": []}
    missing = await live.http.get("/webhooks/wh_nothing/deliveries")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "webhook_not_found"
    bad = await live.http.get("/webhooks/wh_nothing/deliveries", params={"limit": "0"})
    assert (bad.status_code, bad.json()["error"]["code"]) == (400, "invalid_limit")


async def test_a_private_receiver_is_refused_without_the_server_option(live: Live):
    receiver = await Receiver().start()
    try:
        answer = await live.http.post("/webhooks", json={"url": receiver.url, "kinds": ["*"]})
        sub = answer.json()
        test = (await live.http.post(f"/webhooks/{sub['id']}/test")).json()
        assert not test["ok"] and test["status"] is None
        assert test["error"].startswith("address_refused: 127.0.0.1 is a loopback address")
        assert receiver.got == []
    finally:
        await receiver.close()


async def test_pending_deliveries_survive_a_restart(tmp_path):
    """Events waiting for a receiver that is down are delivered by the next run."""
    receiver = await Receiver().start()
    live = await start_server(tmp_path, **FAST)
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        sub = await subscribe(live, receiver, kinds=["enqueue"])
        await receiver.down()
        ids = [(await live.enqueue("mail", {"n": n}))["id"] for n in range(5)]

        async def pending() -> bool:
            log = (await live.http.get(f"/webhooks/{sub['id']}/deliveries")).json()
            return len(log["deliveries"]) == 5
        await wait_until(pending, what="the outbox holds them")
    finally:
        await stop_server(live)
    await receiver.start()
    live = await start_server(tmp_path, **FAST)
    try:
        await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == set(ids),
                         timeout=15.0, what="delivered by the next run")
    finally:
        await stop_server(live)
        await receiver.close()


async def pump_stopped(tmp_path, receiver: Receiver, kinds: list[str], *,
                       cancel: bool = False) -> tuple[str, list[str]]:
    """A server's first job event pumped, then its pump stopped, as if killed before it
    wrote the rest: three more enqueued (the first of them cancelled, if ``cancel``), and
    the server stopped. The first job's id, and the three's."""
    live = await start_server(tmp_path, **FAST)
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        await subscribe(live, receiver, kinds=kinds)
        first = (await live.enqueue("mail", {"n": 0}))["id"]
        await wait_until(lambda: len(receiver.got) == 1, what="the first, pumped")
        for task in live.coordinator._tasks:
            if task.get_name() == "rota-webhooks":
                task.cancel()
        ids = [(await live.enqueue("mail", {"n": n}))["id"] for n in range(1, 4)]
        if cancel:
            await live.http.delete(f"/jobs/{ids[0]}")
    finally:
        await stop_server(live)
    assert [r.json["data"]["job"] for r in receiver.got] == [first]
    return first, ids


async def test_events_the_pump_had_not_written_are_found_again_after_a_restart(tmp_path):
    """A kill -9 between an event and the pump's write loses it from memory: the next run
    finds the job events in the jobs' rows, and sends each once (the same event id)."""
    receiver = await Receiver().start()
    first, ids = await pump_stopped(tmp_path, receiver, ["enqueue", "cancel"], cancel=True)
    live = await start_server(tmp_path, **FAST)
    try:
        want = {(first, "enqueue"), *((i, "enqueue") for i in ids), (ids[0], "cancel")}
        await wait_until(lambda: {(r.json["data"]["job"], r.json["kind"])
                                  for r in receiver.got} == want,
                         timeout=15.0, what="the missed events, from the rows")
        assert len(receiver.got) == len(want)  # the first is not sent again
    finally:
        await stop_server(live)
        await receiver.close()


async def test_a_start_whose_look_in_the_rows_fails_then_lags_loses_no_event(
        tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """At the restart, the look in the jobs' rows for what the pump had not written fails
    once (tried again, the webhooks go on), then lags while 20 jobs are enqueued on a
    ring of 5 events: the gap the ring left is looked for from the start. Each event is
    sent once."""
    receiver = await Receiver().start()
    first, unpumped = await pump_stopped(tmp_path, receiver, ["enqueue"])
    release, looks = threading.Event(), []
    real = sql.recent_jobs

    def flaky(conn: Any, since: float, limit: int) -> Any:
        looks.append(since)
        if len(looks) == 1:
            raise sqlite3.OperationalError("disk I/O error")
        release.wait(20)  # (a reader's thread)
        return real(conn, since, limit)
    monkeypatch.setattr(sql, "recent_jobs", flaky)
    live = await start_server(tmp_path, events_buffer=5, **FAST)
    try:
        await wait_until(lambda: len(looks) == 2, what="the look in the rows, again")
        later = [(await live.enqueue("mail", {"n": n}))["id"] for n in range(4, 24)]
        # Past the margin a gap is looked for from, counted from the moment it is found.
        went = time.time()
        await wait_until(lambda: time.time() > went + wh.MARGIN + 0.5, what="the margin")
        release.set()
        want = {first, *unpumped, *later}
        await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == want,
                         timeout=20.0, what="every event, from the rows and the ring")
        assert len(receiver.got) == len(want)
        assert any("trying again" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
        await stop_server(live)
        await receiver.close()


@pytest.mark.parametrize("live", [{**FAST, "webhook_timeout": 30.0}], indirect=True)
async def test_a_hanging_receiver_holds_neither_jobs_nor_another_subscription(live: Live,
                                                                             tmp_path):
    hanging = await Receiver(delay=60.0).start()
    healthy = await Receiver().start()
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        await subscribe(live, hanging, kinds=["enqueue"])
        await subscribe(live, healthy, kinds=["enqueue"])
        ids = {(await live.enqueue("mail", {"n": n}))["id"] for n in range(5)}
        # Each answer within 30 s is awaited by its own subscription only: the other
        # gets every event at once, and the jobs were taken in meanwhile.
        await wait_until(lambda: {r.json["data"]["job"] for r in healthy.got} == ids,
                         timeout=10.0, what="the healthy receiver, not held")
        assert len(hanging.got) >= 1  # (it holds its deliveries, unanswered)
    finally:
        await hanging.close()
        await healthy.close()


@pytest.mark.parametrize("live", [{**FAST, "events_buffer": 5}], indirect=True)
async def test_job_events_the_ring_lost_before_the_pump_read_them_are_found(live: Live,
                                                                          tmp_path):
    """A batch of 30 jobs in a ring of 5 events: the pump sees the last 5, and finds the
    others' enqueues in the jobs' rows; each is sent once."""
    receiver = await Receiver().start()
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        await subscribe(live, receiver, kinds=["enqueue"])
        answer = await live.http.post("/jobs/batch", json={
            "jobs": [{"spec": "mail", "args": {"n": n}} for n in range(30)]})
        ids = {r["job"]["id"] for r in answer.json()["results"]}
        assert len(ids) == 30
        await wait_until(lambda: {r.json["data"]["job"] for r in receiver.got} == ids,
                         timeout=10.0, what="all 30 enqueues")
        assert len(receiver.got) == 30
    finally:
        await receiver.close()


@pytest.mark.parametrize("live", [FAST], indirect=True)
async def test_a_429_is_retried_after_its_retry_after_and_a_404_is_dead(live: Live, tmp_path):
    receiver = await Receiver(status=429, retry_after="1").start()
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        sub = await subscribe(live, receiver, kinds=["enqueue"])
        await live.enqueue("mail", {})
        await wait_until(lambda: len(receiver.got) == 1, what="the first attempt")
        receiver.status, receiver.retry_after = 200, None
        await wait_until(lambda: len(receiver.got) == 2, what="the retry")
        first, second = receiver.got
        waited = int(second.headers["x-rota-timestamp"]) - int(first.headers["x-rota-timestamp"])
        assert waited >= 1  # Retry-After: 1, not the schedule's 0.3 s (scaled)
        assert second.headers["x-rota-delivery-id"] == first.headers["x-rota-delivery-id"]
        assert second.json["id"] == first.json["id"]
        receiver.status = 404
        await live.enqueue("mail", {})
        await wait_until(lambda: len(receiver.got) == 3, what="the 404")

        async def logged() -> bool:
            log = (await live.http.get(f"/webhooks/{sub['id']}/deliveries")).json()
            return [(d["state"], d["attempts"], d["error"]) for d in log["deliveries"]] == [
                ("dead", 1, "http_404"), ("delivered", 2, None)]
        await wait_until(logged, what="one dead, one delivered on its second attempt")
    finally:
        await receiver.close()


@pytest.mark.parametrize("live", [{**FAST, "webhook_backoff_scale": 1.0}], indirect=True)
async def test_a_step_of_the_clock_ends_a_receivers_pause_and_a_wait_reckoned_before_it(
        live: Live, tmp_path):
    """A receiver failed: its subscription's loop pauses 30 s, reckoned on the clock as it
    was. The wall clock steps and the deliveries' next tries are moved (here: made due
    now, as a step back of that much would): told of the step, the loop looks again at
    once rather than at the end of a pause or a sleep reckoned across the step."""
    receiver = await Receiver(status=500).start()
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        sub = await subscribe(live, receiver, kinds=["enqueue"])
        await live.enqueue("mail", {})
        await wait_until(lambda: len(receiver.got) == 1, what="the first attempt")
        receiver.status = 200
        await live.coordinator.store.writer.submit(lambda conn: conn.execute(
            "UPDATE webhook_deliveries SET next_at = ? WHERE subscription_id = ?",
            (time.time(), sub["id"])))
        live.coordinator.webhooks.stepped()
        await wait_until(lambda: len(receiver.got) == 2, timeout=5.0,
                         what="the retry, at once (its pause was 30 s)")
    finally:
        await receiver.close()


async def test_with_no_subscription_the_pump_passes_events_over_and_warns_of_no_gap(
        tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    """With nobody subscribed, the pump does not read the events at all: a burst larger
    than the ring is no gap to warn of (it was, under load, with no webhook anywhere)."""
    monkeypatch.setattr(hooks, "IDLE", 0.02)  # the pump's turns, when nothing wakes it
    live = await start_server(tmp_path, events_buffer=20)
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        webhooks = live.coordinator.webhooks
        turns = counting_turns(webhooks)
        caplog.set_level(logging.INFO, logger="rota")
        answer = await live.http.post("/jobs/batch", json={"jobs": [{"spec": "mail"}] * 200})
        assert answer.status_code == 200
        seen = turns[0]
        await wait_until(lambda: turns[0] >= seen + 3, what="three turns of the pump")
        assert not [r.getMessage() for r in caplog.records if "webhooks" in r.getMessage()]
    finally:
        await stop_server(live)


async def test_with_no_subscription_the_pumps_mark_stays_in_the_events_own_time(
        tmp_path, monkeypatch: pytest.MonkeyPatch):
    """The mark a restart recovers from is the time of the last event passed over, not
    the clock's: the clock would be ahead of an event whose commit is still on its way,
    and a subscription made meanwhile would never get it. Without events, it stays."""
    monkeypatch.setattr(hooks, "IDLE", 0.02)
    monkeypatch.setattr(hooks, "MARK_EVERY", 0.0)  # a mark at every turn that has events
    live = await start_server(tmp_path)
    try:
        await live.push(write_spec(tmp_path / "specs", "mail"))
        webhooks = live.coordinator.webhooks
        turns = counting_turns(webhooks)

        async def mark() -> float | None:
            return await webhooks.store.readers.run(
                lambda conn: sql.read_mark(conn, webhooks._mark_key))

        await live.enqueue("mail")
        last = webhooks.observer.ring[-1][0]
        await wait_until(lambda: _is(mark(), last), what="the mark at the last event")
        seen = turns[0]
        await wait_until(lambda: turns[0] >= seen + 3, what="three turns of the pump")
        assert await mark() == last
    finally:
        await stop_server(live)


async def _is(value: Any, expected: Any) -> bool:
    return await value == expected


def counting_turns(webhooks: Any) -> list[int]:
    """A counter of the pump's turns (each waits on its pulse once), in a list."""
    turns, pulse = [0], webhooks._pulse

    def counted() -> Any:
        turns[0] += 1
        return pulse()

    webhooks._pulse = counted
    return turns
