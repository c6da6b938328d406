"""Webhooks out, the shell: the subscriptions (the API's and the CLI's operations), the
pump that turns the events the observer recorded into pending deliveries in the store
(the outbox), and one delivery task per subscription that sends them, signed, and
records each attempt. Nothing here is awaited by the engine: the pump reads the
observer's ring as a GET /events subscriber does, and a receiver that is slow or down
holds only its own subscription's task (docs/webhooks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, TypeVar

from rota.base.errors import RequestError
from rota.base.ids import uuid7
from rota.base.protocol import rfc3339
from rota.core import webhooks as wh
from rota.core.observe import Observer
from rota.core.settings import ServerSettings
from rota.server.outbound import Egress
from rota.server.hookpost import post, signed_headers
from rota.store import hooks as sql
from rota.store.store import Store

log = logging.getLogger("rota.webhooks")
BATCH = 16  # deliveries a subscription sends at once
CHUNK = 2048  # events the pump takes from the ring per turn
IDLE = 1.0  # seconds the pump waits for events before it looks again
MARK_EVERY = 5.0  # seconds between writes of the pump's mark when no delivery is written
RECOVER_LIMIT = 100_000  # job rows a restart reads back, of each kind
REREAD = 10.0  # seconds between reads of the subscriptions (another server's changes)
CHECK_EVERY = 1.0  # seconds between counts of a subscription's waiting deliveries


def _subscription(row: dict[str, Any]) -> wh.Subscription:
    return wh.Subscription(row["id"], row["url"], tuple(row["kinds"]),
                           wh.as_filter(row["filter"]), row["secret"], row["previous_secret"],
                           row["rotated_at"], bool(row["enabled"]), row["created_at"])


def _not_found(sub_id: str) -> RequestError:
    return RequestError(404, "webhook_not_found", f"no webhook subscription {sub_id[:80]!r}")


class Webhooks:
    def __init__(self, settings: ServerSettings, store: Store, observer: Observer,
                 subscribe: Callable[[], None],
                 events_pulse: Callable[[], asyncio.Future[None]]) -> None:
        self.settings, self.store, self.observer = settings, store, observer
        self._subscribe, self._pulse = subscribe, events_pulse
        self.subs: dict[str, wh.Subscription] = {}
        self._wakes: dict[str, asyncio.Event] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._listening = False
        self._mark_key = self._read_key = self._known_key = ""
        # When the subscriptions were last read (wall time, about): one made through
        # another server after it is not yet followed here. Kept beside the pump's mark.
        self._read_wall = 0.0
        self.started = asyncio.Event()  # set once the subscriptions were read at the start
        # Its own pool (not the endpoint deliveries'): receivers never wait on endpoints.
        self._egress = Egress(allow_private=settings.allow_private_endpoints)
        # When each subscription's waiting deliveries were last counted (and its log
        # pruned), and those found with MAX_PENDING waiting.
        self._checked: dict[str, float] = {}
        self._full: set[str] = set()
        self._dropped: dict[str, int] = {}  # events those did not take, to log
        # The ring's id from which each subscription is followed: its events from there on
        # are its own by their order, not their wall time (a step may put it before its
        # creation); those before, and those found in the rows, by their time. ``_steps``:
        # wall-clock steps seen (each ends the receivers' pauses, reckoned across it).
        self._live_from: dict[str, int] = {}
        self._steps = 0

    # -- lifecycle -------------------------------------------------------------------------
    async def run(self) -> None:
        """The server's webhooks loop (rota/server/upkeep.py): the subscriptions' delivery
        tasks, and the pump, until cancelled at the stop; then the tasks end too."""
        # From this moment the ring has every event (read before any await: a request
        # may record one meanwhile); what came before is looked for in the rows.
        last, started = self.observer.next_id - 1, time.time()
        # Servers sharing PostgreSQL each keep their own; on SQLite there is one server,
        # whatever its address (a restart on another port owes the same events).
        server = (self.store.server_id or "") if self.store.shared else ""
        self._mark_key, self._read_key = f"webhooks_pumped:{server}", f"webhooks_read:{server}"
        self._known_key = f"webhooks_known:{server}"
        try:
            for row in await _until_done("reading the subscriptions", lambda: (
                    self.store.readers.run(sql.subscriptions))):
                self._track(_subscription(row))
            self._read_wall = started
            self.started.set()
            await _until_done("looking for the job events of before the start",
                              lambda: self._after_restart(started))
            await self._pumping(last, started)
        finally:
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._egress.aclose()

    def _track(self, sub: wh.Subscription) -> None:
        """Follow a subscription (new, or changed): its own delivery task."""
        self.subs[sub.id] = sub
        self._live_from.setdefault(sub.id, self.observer.next_id)
        if not self._listening:  # the observer wakes the pump from now on
            self._listening = True
            self._subscribe()
        wake = self._wakes.setdefault(sub.id, asyncio.Event())
        wake.set()
        if sub.id not in self._tasks:
            self._tasks[sub.id] = asyncio.create_task(self._delivering(sub.id),
                                                      name=f"rota-webhook-{sub.id}")

    def _forget(self, sub_id: str) -> None:
        self.subs.pop(sub_id, None)
        self._live_from.pop(sub_id, None)
        self._wakes.pop(sub_id, None)
        task = self._tasks.pop(sub_id, None)
        if task is not None:
            task.cancel()

    # -- the pump: recorded events -> the outbox --------------------------------------------
    async def _pumping(self, last: int, started: float) -> None:
        observer = self.observer
        marked = read = time.monotonic()
        # The wall time of the last event pumped: the ring has every event from ``started``
        # on, so a gap in it is looked for in the rows from there.
        last_wall = started
        while True:
            if time.monotonic() - read > REREAD:
                now = time.time()
                if await self._reread(self._read_wall, last_wall, last):
                    self._read_wall = now  # (after a failure, the next read looks from before)
                read = time.monotonic()
            if not self.subs:
                # No subscription takes anything: the events are passed over unread.
                # (Read, they cost the loop 5 % of a busy server's time, and under load
                # the pump fell behind the ring and warned of a gap nobody was owed.)
                if observer.next_id - 1 > last:
                    # The mark stays in the events' own time, as when they are read: the
                    # clock's would be ahead of an event whose commit is still on its way,
                    # and a restart would recover from past it.
                    last, last_wall = observer.next_id - 1, observer.ring[-1][0]
                    if time.monotonic() - marked > MARK_EVERY:
                        await self._add([], last_wall)
                        marked = time.monotonic()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._pulse()), IDLE)
                continue
            missed, events = observer.after(last, CHUNK)
            if missed:  # (the writer stalled): the job events are found in the rows
                log.warning("webhooks missed events %d..%d: the event ring moved past the"
                            " pump; the job events among them are looked for in the jobs'"
                            " rows", missed, events[0][0] - 1 if events else last)
            if not events:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._pulse()), IDLE)
                continue
            last = events[-1][0]
            rows = self._rows([event for _, event in events], ids=[i for i, _ in events])
            if rows or missed or time.monotonic() - marked > MARK_EVERY:
                await self._add(rows, events[-1][1][0])
                marked = time.monotonic()
            if missed:
                await self._recover(last_wall - wh.MARGIN, events[0][1][0], "after a gap")
            last_wall = events[-1][1][0]

    async def _after_restart(self, started: float) -> None:
        """The job events of before ``started`` that the pump had not written at the last
        stop (a kill -9 between an event and the pump's write): those since its mark,
        less MARGIN. And for a subscription it did not follow then (made through another
        server after its last read of them), those since that read: the pump passed them
        over unmatched, and its mark went past them. With no mark of its own (its first
        start, or a server that took another's place under a new name), from the oldest
        subscription on: a mark is written at once, so only a first start looks so far."""
        # (an earlier version kept a SQLite server's mark under its address)
        earlier = f"webhooks_pumped:{self.store.server_id or ''}"
        mark, read, known, before = await self.store.readers.run(lambda conn: [
            sql.read_meta(conn, key) for key in (self._mark_key, self._read_key,
                                                 self._known_key, earlier)])
        mark = mark or before
        if mark is None:
            if self.subs:
                await self._recover(min(s.created_at for s in self.subs.values()), started,
                                    "after the start")
            await self._add([], started)
            return
        await self._recover(float(mark) - wh.MARGIN, started, "after the restart")
        # (a mark an earlier version kept has neither: its pump read them at most REREAD
        # before it, and followed those made before that)
        since = float(mark) - REREAD if read is None else float(read)
        followed = None if known is None else set(json.loads(known))
        late = [s for s in self.subs.values() if (s.created_at > since - wh.MARGIN
                                                   if followed is None else s.id not in followed)]
        if late:
            await self._recover(min(since, *(s.created_at for s in late)) - wh.MARGIN, started,
                                "for a subscription made through another server before"
                                " the restart", late)

    async def _reread(self, last_read: float, pumped: float, last: int) -> bool:
        """Follow the subscriptions as stored: those another server sharing the
        database made, changed or deleted since ``last_read`` (wall time); whether they
        were read. The events up to ``pumped`` (wall time) and ``last`` (the ring's id)
        went through the pump; the ring still holds those after."""
        try:
            rows = await self.store.readers.run(sql.subscriptions)
        except Exception as exc:
            log.warning("webhooks: reading the subscriptions failed (%s)", exc)
            return False
        stored = {row["id"]: _subscription(row) for row in rows}
        for sub_id in [s for s in self.subs if s not in stored]:
            self._forget(sub_id)
        # Made through another server since the last read: the job events pumped here
        # since went by unmatched for them, and are found in the jobs' rows (those still
        # in the ring, the pump brings them). Not followed until that is done: a read
        # that fails leaves them new to the next.
        owed = [sub for sub_id, sub in stored.items()
                if sub.enabled and sub_id not in self.subs]
        recovered = True
        if owed:
            _, unpumped = self.observer.after(last, len(self.observer.ring))
            try:
                await self._recover(last_read - wh.MARGIN, pumped, "for a subscription"
                                    " made through another server", owed,
                                    skip={wh.event_id(event) for _, event in unpumped})
            except Exception as exc:
                log.warning("webhooks: looking for the job events owed to subscription=%s"
                            " failed (%s); again at the next read",
                            ",".join(sub.id for sub in owed), exc)
                stored = {k: v for k, v in stored.items() if v not in owed}
                recovered = False
        for sub_id, sub in stored.items():
            if self.subs.get(sub_id) != sub:
                self._track(sub)
        return recovered

    def _rows(self, events: list[Any], only: list[wh.Subscription] | None = None,
              ids: list[int] | None = None) -> list[tuple[str, str, str, str, bytes]]:
        """A pending delivery per event and subscription (of ``only``, if given) that
        takes it. ``ids``: the events' ids in the ring (the pump's; none from the rows)."""
        rows: list[tuple[str, str, str, str, bytes]] = []
        among = list(self.subs.values()) if only is None else only
        # A subscription found full at its last check takes none until the next.
        subs = [s for s in among if s.enabled and s.id not in self._full]
        for sub in [s for s in among if s.id in self._full]:
            lost = sum(1 for event in events if sub.takes(event))
            if lost:
                self._dropped[sub.id] = self._dropped.get(sub.id, 0) + lost
        live = self._live_from
        for n, event in enumerate(events):
            takers = [s.id for s in subs if s.takes(
                event, ids is not None and ids[n] >= live.get(s.id, ids[n] + 1))]
            if takers:
                event_id = wh.event_id(event)
                body = wh.body(event_id, event)
                rows += [("dlv_" + uuid7(), sub_id, event_id, event[1], body)
                         for sub_id in takers]
        return rows

    async def _recover(self, since: float, until: float, why: str,
                       only: list[wh.Subscription] | None = None,
                       skip: Collection[str] = ()) -> None:
        """Job events the pump did not see, from the jobs' rows from ``since`` to ``until``
        (after it the ring has them), for every subscription or ``only`` these: those of
        the moments before the last stop (a kill -9 between an event and the pump's
        write), of a gap in the ring, or before a subscription made through another
        server was known here. Each is left out if its delivery exists (the same id);
        another server's of the same moments may be written by both (at least once: the
        same ids). ``skip``: the ids of events the pump has yet to bring."""
        subs = [s for s in (list(self.subs.values()) if only is None else only) if s.enabled
                and any(k in (wh.ALL, *wh.FACTS) for k in s.kinds)]
        if not subs:
            return
        jobs = await self.store.readers.run(
            lambda conn: sql.recent_jobs(conn, since, RECOVER_LIMIT))
        rows = self._rows([e for e in wh.facts(jobs, since)
                           if e[0] <= until and (not skip or wh.event_id(e) not in skip)], only)
        if rows:
            await self._add(rows, None, recovered=True)
            log.info("webhooks: %d delivery(ies) of job events since %s looked for again %s",
                     len(rows), rfc3339(since), why)

    async def _add(self, rows: list[tuple[str, str, str, str, bytes]], wall: float | None,
                   *, recovered: bool = False) -> None:
        """Write the pending deliveries (and the pump's mark: events up to ``wall`` are
        in), again until the store takes them."""
        # With the mark: when the subscriptions were last read, and which were followed.
        marks = () if wall is None else (
            (self._mark_key, repr(wall)), (self._read_key, repr(self._read_wall)),
            (self._known_key, json.dumps(sorted(self.subs))))
        now = time.monotonic()
        checked = [s for s in self.subs if now - self._checked.get(s, 0.0) >= CHECK_EVERY]
        # (a storage failure: the rows wait in memory)
        dropped, waiting = await _until_done(f"storing deliveries={len(rows)}", lambda: (
            self.store.writer.submit(lambda conn: sql.add_deliveries(
                conn, rows, time.time(), marks, recovered=recovered, checked=checked))))
        for sub_id in checked:
            self._checked[sub_id] = now
        self._full = {s for s in self._full if s not in waiting} | {
            s for s, n in waiting.items() if n >= wh.MAX_PENDING}
        self._dropped, dropped_before = {}, self._dropped
        for sub_id, n in [*dropped.items(), *dropped_before.items()]:
            log.warning("webhook subscription=%s dropped %d event(s): %d deliveries already"
                        " wait for its receiver", sub_id, n, wh.MAX_PENDING)
        for sub_id in {r[1] for r in rows}:
            wake = self._wakes.get(sub_id)
            if wake is not None:
                wake.set()

    # -- one subscription's deliveries ------------------------------------------------------
    async def _delivering(self, sub_id: str) -> None:
        wake = self._wakes[sub_id]
        hold = self.settings.webhook_timeout + 5.0  # a claim outlives its attempt
        streak = 0  # batches in a row that all failed: the receiver's own backoff
        while sub_id in self.subs:
            sub = self.subs[sub_id]
            wake.clear()
            if not sub.enabled:
                await wake.wait()
                continue
            try:
                batch = await self.store.writer.submit(
                    lambda conn: sql.claim(conn, sub_id, time.time(), hold, BATCH))
                due = None if batch else await self.store.readers.run(
                    lambda conn: sql.next_due(conn, sub_id))
            except Exception as exc:
                log.warning("webhook subscription=%s: reading its deliveries failed (%s)",
                            sub_id, exc)
                await asyncio.sleep(1.0)
                continue
            if not batch:
                left = None if due is None else max(0.01, due - time.time())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), left)
                continue
            outcomes = await asyncio.gather(*(self._attempt(sub, d) for d in batch))
            delivered = any(o[1] == "delivered" for o in outcomes)
            try:
                await self.store.writer.submit(lambda conn: sql.record(
                    conn, outcomes, sub_id, time.time(), delivered))
            except Exception as exc:  # the claims lapse: sent again, at least once
                log.warning("webhook subscription=%s: recording %d attempt(s) failed (%s)",
                            sub_id, len(outcomes), exc)
            retried = [o[3] for o in outcomes if o[1] == "pending"]
            streak = 0 if delivered or not retried else streak + 1
            if streak:  # the receiver fails: it is left alone for a growing while
                pause = wh.pause(streak, min(retried) - time.time(),
                                 self.settings.webhook_backoff_scale)
                log.info("webhook subscription=%s receiver failing: next try in %.1fs",
                         sub_id, pause)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed(sub_id, sub), pause)

    def stepped(self) -> None:
        """The wall clock stepped and the deliveries' next tries were moved with it
        (rota/server/upkeep.py): each subscription's loop looks at them again, its
        sleep and its receiver's pause having been reckoned on the clock before."""
        self._steps += 1
        for wake in self._wakes.values():
            wake.set()

    async def _changed(self, sub_id: str, sub: wh.Subscription) -> None:
        """Until the subscription is changed or deleted, or the clock steps (a pause
        ends early then)."""
        wake, steps = self._wakes.get(sub_id), self._steps
        while wake is not None and self.subs.get(sub_id) is sub and self._steps == steps:
            wake.clear()
            await wake.wait()

    async def _attempt(self, sub: wh.Subscription, d: dict[str, Any]) -> tuple[Any, ...]:
        now = time.time()
        body = d["body"].encode()
        outcome = await post(self._egress, sub.url, body,
                             signed_headers(sub, d["id"], d["kind"], body, now),
                             self.settings.webhook_timeout)
        attempts = d["attempts"] + 1
        state, next_at = wh.next_step(outcome, attempts, time.time(),
                                      self.settings.webhook_backoff_scale)
        if state == "dead":
            log.warning("webhook dead subscription=%s delivery=%s event=%s kind=%s attempt=%d:"
                        " %s", sub.id, d["id"], d["event_id"], d["kind"], attempts,
                        outcome.error)
        elif state == "pending":
            log.info("webhook retry subscription=%s delivery=%s event=%s attempt=%d in %.1fs:"
                     " %s", sub.id, d["id"], d["event_id"], attempts, next_at - now,
                     outcome.error)
        return (d["id"], state, attempts, next_at, outcome.status, outcome.ms,
                outcome.error or None, outcome.response)

    # -- what the API and the dashboard ask ------------------------------------------------------
    async def create(self, url: str, kinds: list[str], filter_: dict[str, str],
                     enabled: bool) -> dict[str, Any]:
        row = {"id": "wh_" + uuid7(), "url": url, "kinds": kinds, "filter": filter_,
               "secret": "whsec_" + secrets.token_hex(24), "enabled": enabled,
               "created_at": time.time()}
        stored = await self.store.writer.submit(lambda conn: sql.insert_subscription(conn, row))
        self._track(_subscription(stored))
        log.info("webhook subscription=%s created url=%s kinds=%s", row["id"], url,
                 ",".join(kinds))
        return wh.subscription_view(stored, secret=True)

    async def list(self) -> list[dict[str, Any]]:
        return [wh.subscription_view(r) for r in await self.store.readers.run(sql.subscriptions)]

    async def _row(self, sub_id: str) -> dict[str, Any]:
        row = await self.store.readers.run(lambda conn: sql.subscription(conn, sub_id))
        if row is None:
            raise _not_found(sub_id)
        return row

    async def get(self, sub_id: str) -> dict[str, Any]:
        return wh.subscription_view(await self._row(sub_id))

    async def update(self, sub_id: str, changes: dict[str, Any]) -> dict[str, Any]:
        row = await self.store.writer.submit(
            lambda conn: sql.update_subscription(conn, sub_id, changes))
        if row is None:
            raise _not_found(sub_id)
        self._track(_subscription(row))
        return wh.subscription_view(row)

    async def rotate(self, sub_id: str) -> dict[str, Any]:
        secret = "whsec_" + secrets.token_hex(24)
        row = await self.store.writer.submit(
            lambda conn: sql.rotate_secret(conn, sub_id, secret, time.time()))
        if row is None:
            raise _not_found(sub_id)
        self._track(_subscription(row))
        log.info("webhook subscription=%s secret rotated: both sign for %ds", sub_id,
                 wh.ROTATION_WINDOW)
        return wh.subscription_view(row, secret=True)

    async def delete(self, sub_id: str) -> dict[str, Any]:
        row = await self.store.writer.submit(lambda conn: sql.delete_subscription(conn, sub_id))
        if row is None:
            raise _not_found(sub_id)
        self._forget(sub_id)
        log.info("webhook subscription=%s deleted", sub_id)
        return wh.subscription_view(row)

    async def deliveries(self, sub_id: str, limit: int, state: str | None
                         ) -> list[dict[str, Any]]:
        await self._row(sub_id)
        rows = await self.store.readers.run(
            lambda conn: sql.deliveries(conn, sub_id, limit, state))
        for row in rows:
            for key in ("created_at", "next_at", "last_at"):
                row[key] = rfc3339(row[key]) if row[key] else None
            if row["state"] != "pending":
                row["next_at"] = None
        return rows

    async def test(self, sub_id: str) -> dict[str, Any]:
        """Send a test delivery now (not through the outbox), and log it."""
        sub = _subscription(await self._row(sub_id))
        now = time.time()
        delivery_id, event_id = "dlv_" + uuid7(), "evt_" + uuid7()
        body = wh.test_body(event_id, sub_id, rfc3339(now))
        outcome = await post(self._egress, sub.url, body,
                             signed_headers(sub, delivery_id, wh.TEST, body, now),
                             self.settings.webhook_timeout)
        state = "dead" if outcome.error else "delivered"
        await self.store.writer.submit(lambda conn: sql.add_finished(conn, (
            delivery_id, sub_id, event_id, wh.TEST, body, state, now, outcome.status,
            outcome.ms, outcome.error or None, outcome.response)))
        log.info("webhook test subscription=%s delivery=%s status=%s %s", sub_id, delivery_id,
                 outcome.status, outcome.error or "ok")
        if not outcome.error and sub_id in self.subs:
            self._track(sub)  # the receiver answers: a pause for its failures ends now
        return {"ok": not outcome.error, "delivery_id": delivery_id, "event_id": event_id,
                "status": outcome.status, "ms": outcome.ms, "error": outcome.error or None,
                "response": outcome.response}


T = TypeVar("T")


async def _until_done(what: str, step: Callable[[], Awaitable[T]]) -> T:
    """``step()`` again, with a growing pause, until it succeeds: a storage failure must
    neither end the server's webhooks nor lose what waits to be written."""
    delay = 0.1
    while True:
        try:
            return await step()
        except Exception as exc:
            log.warning("webhooks: %s failed (%s): trying again", what, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
