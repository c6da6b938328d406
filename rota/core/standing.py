"""This server's standing among several on one database (docs/scaling.md, Server death):
whether it may hand out work, and whether it may judge another server's lease. Pure:
the times are the caller's monotonic seconds.

- **Its own lease.** A renewal begun at ``started`` that committed holds the lease until
  ``started + lease`` at least: leases run on the database's clock, from the moment the
  renewal's UPDATE runs, which is after ``started``.
- **Handing out work.** A server hands out work (a scheduling round's reservations) only
  while that lease has more than a quarter of it left (``MARGIN``). One that cannot renew
  stops before its lease can lapse, and resumes at its next renewal.
- **Judging the others.** A lapse of another server's lease is judged only from a
  vantage: this server has renewed its own lease in time (each renewal within half a
  lease of the one before) for a whole lease. A renewal that failed, one that came late,
  or a stall of this server (its tick came late) starts the vantage anew at the next
  renewal. So after a database outage, or a stall of the judge itself, every other server
  has had a full lease of the database, as the judge saw it answer, to renew in before it
  may be declared dead.
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.25  # of a lease: hand out no work when less than this is left of one's own
LATE = 0.5  # of a lease: a renewal this long after the one before breaks the vantage


@dataclass(slots=True)
class Standing:
    lease: float  # seconds (--server-lease)
    shared: bool = False  # one of several servers on a database: there is a lease at all
    held_until: float | None = None  # this server's lease holds at least until then
    last_renewed: float | None = None  # when the latest renewal committed
    sound_since: float | None = None  # renewed in time, without a break, since then
    handing_out: bool = True  # as last judged by ``may_hand_out`` (for its log lines)

    def renewed(self, started: float, now: float) -> bool:
        """A renewal begun at ``started`` committed at ``now``. True if it broke the
        vantage (a failure, a stall or a late renewal since the last one), which starts
        anew now; the first renewal starts one, and is no break."""
        first = self.last_renewed is None
        late = first or now - self.last_renewed > LATE * self.lease  # type: ignore[operator]
        broke = late or self.sound_since is None
        if broke:
            self.sound_since = now
        self.last_renewed = now
        self.held_until = max(self.held_until or started, started + self.lease)
        return broke and not first

    def failed(self) -> None:
        """A renewal failed (the database did not answer): no vantage until one works."""
        self.sound_since = None

    def stalled(self) -> None:
        """This server did not run for a while (its tick came late): what it last read
        of the others is stale, and they may have been blocked by it."""
        self.sound_since = None

    def may_hand_out(self, now: float) -> bool:
        if not self.shared:
            return True
        return self.held_until is not None and self.held_until - now > MARGIN * self.lease

    def left(self, now: float) -> float:
        """Seconds left of this server's own lease, as far as it knows (0: none)."""
        return 0.0 if self.held_until is None else max(0.0, self.held_until - now)

    def may_judge(self, now: float) -> bool:
        """Whether another server's lapsed lease may be judged now (and recovered)."""
        return (self.shared and self.sound_since is not None
                and now - self.sound_since >= self.lease)

