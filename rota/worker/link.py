"""The worker's side of the protocol, with no I/O: what to send, when, and what an answer
means. The connection thread (rota/worker/connection.py) reads the clock and the socket and
asks this core; tests drive it with a fake clock (tests/unit/test_link.py).

It keeps the heartbeat bookkeeping (``seq``, the state each heartbeat reported, the
results each one carried until its ack), batches results, decides when a heartbeat is
due, reads acks (directives, results to send again), and decides when an overdue ack is
worth a ping and how long to wait before reconnecting. ``Servers`` keeps the server URLs a
worker may use and which one is next.
"""

from __future__ import annotations

import collections
import enum
import math
import random
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from rota.base import protocol as p
from rota.base.errors import RegistrationRefused
from rota.base.ids import dashboard_base, ws_url
from rota.base.wording import plainly

# The server takes frames up to 1 MiB: results and status share this, and the rest of a
# heartbeat (ids, metrics, registration) fits in what is left.
FRAME_BUDGET = (1 << 20) - 64 * 1024
RESULT_BYTES_PER_BEAT = 768 * 1024
SMOOTHING = 0.2  # weight of a new sample in the running averages (round trip, run time)
# Holding no job, it asks for an ack this often (sparse acks, docs/protocol.md §4.2): so
# it finds a dead connection in ~12 s, not 3, with nothing waiting on it. One that holds
# a job is acked as often as ever. At 10,000 idle workers acks were a fifth of the server.
IDLE_ACK_INTERVAL = 10.0


def prefetch_line(prefetch: int, concurrency: int, run_time: float | None,
                  round_trip: float) -> int:
    """How many jobs to hold beyond those running, at most ``prefetch``.

    The line is there to keep the slots busy while results go to the server and the
    next jobs come back: one round trip, in which ``concurrency`` slots finish
    ``concurrency * round_trip / run_time`` jobs. It holds twice that (a margin for a
    slow commit), so short jobs get the whole ``prefetch`` and long ones one waiting job
    or none, which is what keeps a long job from waiting on a busy worker while another
    is idle. ``run_time`` None: no line (the Runner counts an untimed run as a second)."""
    if prefetch <= 0 or run_time is None:
        return 0
    wanted = 2 * concurrency * round_trip / max(run_time, 1e-6)
    return min(prefetch, math.ceil(wanted))


def line_pace(run_times: Mapping[str, float], held: Iterable[str]) -> float | None:
    """The run time that sizes the line: the slowest average among the specs of the jobs
    held now (running or waiting), each spec timed on its own, since one spec's quick runs
    say nothing of another's. None when nothing is held, or when a held job's spec has no
    run timed yet: the Runner then sizes the line itself (an idle worker's by the slowest
    spec timed; an untimed run as a second of work), so that the first jobs of a spec (of
    2 s each, after quick ones) do not fill a line sized for other work."""
    pace: float | None = None
    for spec in held:
        took = run_times.get(spec)
        if took is None:
            return None
        pace = took if pace is None else max(pace, took)
    return pace


class LinkState(enum.Enum):
    DISCONNECTED = "disconnected"
    REGISTERING = "registering"  # the registration is sent; no welcome yet
    READY = "ready"  # welcomed: jobs may come


@dataclass(slots=True)
class AckOutcome:
    directive: str | None = None  # a stricter state the server asks for: quiet, terminate
    resend: int = 0  # results the server could not store and asks for again
    rejected: list[p.ResultRejection] = field(default_factory=list)


class Link:
    """Heartbeat bookkeeping for one worker, across its connections."""

    def __init__(self, worker_id: str, *, interval: float | None = None,
                 reconnect_max_delay: float = 5.0,
                 rand: Callable[[], float] = random.random) -> None:
        self.worker_id = worker_id
        self.state = LinkState.DISCONNECTED
        self.welcome: p.Welcome | None = None
        self._interval = interval  # None: the server's, from its welcome
        self.reconnect_max_delay = reconnect_max_delay
        self.reconnects = 0
        self._rand = rand
        self._seq = 0
        # seq -> (state said, sent at, whether it held a job or carried a result)
        self._sent_state: dict[int, tuple[str, float, bool]] = {}
        self._unacked: dict[int, list[p.Result]] = {}  # seq -> results, until its ack
        self._results: list[p.Result] = []  # waiting to be sent
        # Results the server could not store (its disk failed): they ride the next
        # heartbeat that is sent anyway, never one of their own. Sent again at once, they
        # made ~3,500 heartbeats a second against a full disk.
        self._deferred: list[p.Result] = []
        self._ready_at: dict[str, float] = {}  # job id -> when its result was ready
        self._urgent = False  # a state change or an alert: beat now, whatever is in flight
        self._last_beat = 0.0
        self._last_capacity = 0
        self._heard = 0.0  # monotonic: the last frame read from the server
        # Heartbeat with results -> its ack: the server's commit round trip, averaged.
        self.round_trip = 0.002
        self.frames_sent = 0
        self.results_sent = 0
        self.flush_delays: collections.deque[float] = collections.deque(maxlen=100_000)

    @property
    def interval(self) -> float:
        return self._interval or 1.0

    # -- connections -------------------------------------------------------------------
    def opened(self) -> None:
        """A new connection: ``seq`` starts again, and results the last connection sent
        without an ack go again first (the server accepts them if it never stored them,
        and rejects them harmlessly if it did)."""
        self.state = LinkState.REGISTERING
        self._seq = 0
        self._sent_state.clear()
        resend = [result for seq in sorted(self._unacked) for result in self._unacked[seq]]
        self._unacked.clear()
        self._results = resend + self._deferred + self._results
        self._deferred = []

    def heard(self, now: float) -> None:
        """A frame came from the server (any: an assign says it is there as an ack does)."""
        self._heard = now

    def lost(self) -> None:
        self.state = LinkState.DISCONNECTED

    def on_welcome(self, welcome: p.Welcome) -> None:
        self.welcome = welcome
        self.state = LinkState.READY
        self.reconnects = 0
        if self._interval is None:
            self._interval = welcome.heartbeat_interval

    def reconnect_delay(self, servers: int = 1) -> float:
        """Exponential, jittered, capped; below half the server's heartbeat timeout, so
        that after a server restart this worker is back in time to reclaim its jobs.
        With several ``servers`` the delay grows once per full round of failed attempts,
        not per attempt: a dead server is no reason to wait longer for the next one."""
        cap = self.reconnect_max_delay
        if self.welcome is not None:
            cap = min(cap, self.welcome.heartbeat_timeout / 2)
        delay = min(cap, 0.1 * 2.0 ** (self.reconnects // max(1, servers)))
        self.reconnects += 1
        return delay * (0.5 + self._rand() / 2)

    # -- results and batching --------------------------------------------------------------
    def add_result(self, result: p.Result, now: float) -> None:
        self._results.append(result)
        self._ready_at[result.job_id] = now

    def urge(self) -> None:
        """Something the server should hear at once (a state change, an alert)."""
        self._urgent = True

    def pending(self) -> bool:
        """Results are waiting to be sent, or sent and not yet acked."""
        return bool(self._results or self._unacked or self._deferred)

    def due(self, now: float, *, capacity: int = 0, stopping: bool = False) -> bool:
        """Whether to beat now. Results go in batches, one heartbeat of them at a time,
        as Nagle's algorithm does with small TCP segments: while a heartbeat with results
        waits for its ack, more results wait for it too, unless something is urgent or
        the periodic beat is due. At low load nothing is in flight and a result leaves
        at once; under load the frames follow the server's round trip, not the job rate."""
        if self._urgent or stopping or now - self._last_beat >= self.interval:
            return True
        if self._unacked:
            return False
        # Results, or slots freed with nothing to report (a lost run, a thread back).
        return bool(self._results) or capacity > self._last_capacity

    def next_beat_in(self, now: float) -> float:
        """Seconds until the periodic beat is due."""
        return max(0.0, self._last_beat + self.interval - now)

    def heartbeat(self, now: float, *, state: str, active: list[str], capacity: int,
                  status: p.Status | None = None, registration: p.Registration | None = None,
                  goodbye: bool = False, reserve: int = 0) -> p.Heartbeat:
        """The next heartbeat, recorded as sent. ``status`` (if given) brings its own
        extras (progress, logs, metrics); ``state`` and ``active`` are set here.
        ``reserve``: bytes of the frame the job ids take, which results leave free."""
        self._urgent = False  # (taking results may set it again: more are waiting)
        results = self._take_results(reserve)
        if status is None:
            status = p.Status(state=state)  # type: ignore[arg-type]
        status.state = state  # type: ignore[assignment]
        status.active_job_ids = active
        beat = p.Heartbeat(seq=self._seq, worker_id=self.worker_id, registration=registration,
                           status=status, results=results, capacity=capacity, goodbye=goodbye)
        if results:
            self._unacked[self._seq] = results
            for result in results:
                ready = self._ready_at.pop(result.job_id, None)
                if ready is not None:
                    self.flush_delays.append(now - ready)
        self._sent_state[self._seq] = (state, now, bool(active or status.prefetched_job_ids
                                                        or results))
        self._seq += 1
        self._last_beat = now
        self._last_capacity = capacity
        self.frames_sent += 1
        self.results_sent += len(results)
        return beat

    def results_size(self, reserve: int = 0) -> int:
        """What the results of the next heartbeat will take of its frame, near enough."""
        return self._batch(reserve)[1]

    def _batch(self, reserve: int = 0) -> tuple[int, int]:
        """(how many, their size): as many waiting results as fit RESULT_BYTES_PER_BEAT
        less ``reserve``, one at least, so a frame never passes the server's 1 MiB limit."""
        taken = size = 0
        room = RESULT_BYTES_PER_BEAT - reserve
        for result in self._results:
            cost = result_size(result)
            if taken and size + cost > room:
                break
            taken += 1
            size += cost
        return taken, size

    def _take_results(self, reserve: int = 0) -> list[p.Result]:
        """The next heartbeat's results; the rest go in the next one, which is then due."""
        if self._deferred:
            self._results, self._deferred = self._deferred + self._results, []
        taken, _ = self._batch(reserve)
        results, self._results = self._results[:taken], self._results[taken:]
        if self._results:
            self._urgent = True  # the rest leave in the very next heartbeat
        return results

    # -- answers -----------------------------------------------------------------------
    def on_ack(self, ack: p.Ack, now: float | None = None) -> AckOutcome:
        """Read an ack: results it accepts are done with; those the server could not store
        go again; a state stricter than what that heartbeat said is a directive (an echo
        of an older state must not undo a SIGCONT that came since). With ``now``, the
        ack of a heartbeat with results times the server's round trip."""
        outcome = AckOutcome(rejected=list(ack.rejected))
        # Acks come in heartbeat order: those before this one that got none were idle
        # beats the server left unanswered (lean acks, docs/protocol.md §4.2).
        while self._sent_state and next(iter(self._sent_state)) < ack.seq:
            self._sent_state.pop(next(iter(self._sent_state)))
        said, sent_at, _ = self._sent_state.pop(ack.seq, (ack.state, None, False))
        if p.STATE_RANK[ack.state] > p.STATE_RANK[said]:  # type: ignore[index]
            outcome.directive = ack.state
        elif said == "quiet" and ack.state == "running":  # the server resumes it
            outcome.directive = "running"
        if now is not None and sent_at is not None and ack.seq in self._unacked:
            self.round_trip += SMOOTHING * (now - sent_at - self.round_trip)
        sent = {r.job_id: r for r in self._unacked.pop(ack.seq, [])}
        for rejected in ack.rejected:
            if rejected.reason.startswith("could not be stored") and rejected.job_id in sent:
                self._deferred.append(sent[rejected.job_id])
                outcome.resend += 1
        return outcome

    def ping_patience(self, now: float) -> float | None:
        """If the oldest ack is overdue, how long a ping may take before the connection is
        judged dead; None while nothing is overdue. An ack may wait behind a slow commit,
        so an overdue ack is only a reason to ask; both waits are a quarter of the
        server's heartbeat timeout, so this worker is back before the server gives up."""
        if self.welcome is None or not self._sent_state:
            return None
        patience = self.welcome.heartbeat_timeout / 4
        # The server leaves idle beats unanswered while it acked one within a window (lean
        # acks), so it is silent for at most that and a beat: an unanswered beat is judged
        # by the last frame heard, given that long more. The window is a quarter of its
        # timeout for a beat that held a job, and the welcome's idle ack interval, if it
        # gave one, for the others (sparse acks, §4.2).
        sparse = self.welcome.idle_ack_interval or patience
        oldest = max(next(iter(self._sent_state.values()))[1], self._heard)  # (seq order)
        if now - oldest > max(sparse, 2 * self.interval) + self.interval:
            return patience
        busy = next((sent_at for _, sent_at, held in self._sent_state.values() if held), None)
        if busy is not None and now - max(busy, self._heard) > (
                max(patience, 2 * self.interval) + self.interval):
            return patience
        return None

    def oldest_unanswered(self, now: float) -> float:
        if not self._sent_state:
            return 0.0
        return now - next(iter(self._sent_state.values()))[1]

    def drained(self, *, running: int, fast: bool) -> bool:
        """Nothing left to run or report (on the fast path, acks are not waited for)."""
        return not (running or self._results or self._deferred or (self._unacked and not fast))


class Servers:
    """The server URLs a worker may connect to, in the order given, and the one it uses
    (or tries) now. Any failure moves to the next one, round-robin: servers that share
    one database are interchangeable, and the one that failed is the least likely to
    answer next (it is down, stopping, or cut off from this worker)."""

    def __init__(self, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError("url must name at least one server")
        self.urls = tuple(urls)
        self._index = 0

    @property
    def current(self) -> str:
        return self.urls[self._index]

    def __len__(self) -> int:
        return len(self.urls)

    def advance(self) -> str:
        """Move to the next URL (the same one again when there is only one)."""
        self._index = (self._index + 1) % len(self.urls)
        return self.current


def result_size(result: p.Result) -> int:
    """A result's encoded size, near enough: its value's bytes (already encoded) plus its
    envelope, or an error's bound (messages and tracebacks are cut to a few KiB; an
    error with no details, such as a released job's, is its message and envelope)."""
    value = len(result.result) if isinstance(result.result, msgspec.Raw) else 0
    error = result.error
    if error is None:
        return value + 256
    # (6 bytes a character at most: a control character is escaped as \u00XX)
    return value + (16 * 1024 if error.details is not None else 512 + 6 * len(error.message))


def drain(ids: collections.deque[str], most: int) -> list[str]:
    """Up to ``most`` ids from the front of ``ids`` (the rest wait for the next frame)."""
    taken: list[str] = []
    while ids and len(taken) < most:
        taken.append(ids.popleft())
    return taken


def ids_size(ids: list[str]) -> int:
    """What a list of job ids takes of a frame as JSON, near enough."""
    return sum(len(job_id) + 3 for job_id in ids)


def work_urls(value: str | Sequence[str]) -> list[str]:
    """One server URL or several, each a base URL (http://host:port, as the CLI takes it)
    or a /work endpoint (ws://host:port/work), as the /work URLs to connect to. All are
    checked now: a typo in the third URL must not wait for two servers to fail first."""
    given = [value] if isinstance(value, str) else list(value)
    if not given:
        raise ValueError("url must name at least one server")
    for url in given:
        if not _is_server_url(url):
            raise ValueError(f"url must be the server's base URL (http://host:port) or its /work"
                             f" endpoint (ws://host:port/work), not {url!r}")
        if (base := dashboard_base(url)) is not None:  # it would answer 404, forever
            raise ValueError(f"url {url!r} is the dashboard's address, not the server's: give"
                             f" its base URL, {base}")
    # Two spellings of one server (its base URL and its /work URL) are one stop, not two.
    return list(dict.fromkeys(ws_url(url) for url in given))


def _is_server_url(url: object) -> bool:
    if not isinstance(url, str) or not url.startswith(("ws://", "wss://", "http://", "https://")):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (read for its check: a port that is not a number raises)
    except ValueError:  # a malformed host ("[::1") or port
        return False
    return bool(parts.hostname)


def refusal(body: bytes) -> str:
    """A refused handshake's JSON error as "code: message" (or its text, if not JSON)."""
    try:
        error = msgspec.json.decode(body)["error"]
        return f"{error['code']}: {error['message']}"
    except (msgspec.DecodeError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


def registration_refused(url: str, text: str) -> RegistrationRefused:
    """The server's ``invalid_message`` for a registration (before its welcome), in plain
    words: a retry would send the same registration, so the worker stops with this."""
    return RegistrationRefused("invalid_message", f"{url} refused this worker's registration:"
                               f" {plainly(text)}")
