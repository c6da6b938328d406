"""The /work wire protocol: one msgspec Struct per message, tagged by ``type``.

Workers send exactly one message type, ``heartbeat``; its optional sections carry
registration, status, results and capacity. The server sends ``welcome``, ``ack``,
``assign``, ``cancel``, ``take_back`` and ``error``. docs/protocol.md is the contract this module
implements: change the two together. Evolve by adding fields with defaults and new
message types; peers skip what they do not know.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from typing import Annotated, Any, Literal

import msgspec

from rota.base.errors import FrameError  # re-exported: decoding raises it
from rota.base.inputs import BadJson, explain, screen

WorkerState = Literal["running", "quiet", "terminate"]
# Lifecycle order: a worker only moves forward, except quiet -> running on SIGCONT.
STATE_RANK: dict[str, int] = {"running": 0, "quiet": 1, "terminate": 2}
# A state in a sentence ("the worker is ..."): "terminate" is the directive's verb.
STATE_SAID: dict[str, str] = {"running": "running", "quiet": "quiet",
                              "terminate": "terminating"}
Outcome = Literal["completed", "failed"]

# Names of specs, queues, labels and workers; job ids allow a few more characters, so
# that producers can use keys like "order-17" or "user@example.com". Neither allows
# spaces or control characters, so none can forge a line in the server's log.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
# A job id as a frame or a bulk action names one: what a producer may give now
# (rota/base/ids.py JOB_ID_PATTERN), or a "/" as well, which earlier versions accepted, so that
# jobs stored then can still be reported, renewed and cancelled.
JOB_REF_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@/+=-]{0,127}$"
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
JobId = Annotated[str, msgspec.Meta(pattern=JOB_REF_PATTERN)]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
# Integers Rota stores or compares are bounded (docs/operations.md, Limits): counts,
# attempts and priorities to 32 bits, which every JSON reader holds exactly (JavaScript's
# too); sequence numbers, process ids and byte counts to SQLite's signed 64 bits.
MAX_COUNT = 2**31 - 1
MAX_INT64 = 2**63 - 1
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT64)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
Priority = Annotated[int, msgspec.Meta(ge=-MAX_COUNT, le=MAX_COUNT)]
Percent = Annotated[float, msgspec.Meta(ge=0, le=100)]
# A worker process's CPU use, in percent of one core: at most 100 for each of 4,096 cores.
MAX_CPU_PERCENT = 100.0 * 4096
CpuPercent = Annotated[float, msgspec.Meta(ge=0, le=MAX_CPU_PERCENT)]
# Longer texts in progress, log lines and alerts are cut to this on the server.
MAX_TEXT = 8192
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_COUNT)]
# A registration's prefetch: more would be a backlog, not a prefetch; and the ids of a
# full line (named in every status) stay within a tenth of a frame.
MAX_PREFETCH = 1_000
# Alerts in one status: the server keeps the latest 20 per worker, and logs a few a second.
MAX_ALERTS = 100
# Jobs started since the last heartbeat, named in one status: a worker that starts more
# between two heartbeats names the rest in the next one.
MAX_STARTED = 10_000


# -- close codes (RFC 6455 section 7.4.1) ---------------------------------------
CLOSE_GOING_AWAY = 1001  # server shutting down
CLOSE_UNSUPPORTED = 1003  # binary frame or unknown message type
CLOSE_INVALID_PAYLOAD = 1007  # malformed JSON or wrong field types
CLOSE_POLICY = 1008  # protocol misuse: no registration first, id clash, seq going back
CLOSE_TOO_BIG = 1009  # frame larger than the server accepts (sent by the WebSocket layer)
CLOSE_INTERNAL = 1011  # the server failed; the worker should reconnect


class _Tagged(msgspec.Struct, tag_field="type", kw_only=True, omit_defaults=True):
    """Base for every message: the class name's snake form is the ``type`` tag."""


# -- worker -> server -------------------------------------------------------------
# A checksum as Rota makes them ("sha256:<hex>"), or another SDK's: no spaces, no
# control characters, since it is logged beside a spec mismatch.
Checksum = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9:._+/=-]{0,199}$")]
# Free texts a worker describes itself with: bounded, since each is kept and shown.
ShortText = Annotated[str, msgspec.Meta(max_length=255)]


class SpecRef(msgspec.Struct, frozen=True):
    """A job spec a worker implements, named with the checksum of its local copy."""

    name: Name
    checksum: Checksum


class Registration(msgspec.Struct, kw_only=True):
    hostname: ShortText
    os: ShortText
    pid: NonNegative
    sdk: ShortText
    queues: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=100)]
    concurrency: Positive
    specs: Annotated[list[SpecRef], msgspec.Meta(max_length=1000)]
    labels: Annotated[list[Name], msgspec.Meta(max_length=100)] = []
    started_at: ShortText | None = None
    # Jobs the worker may hold beyond concurrency, waiting in its own line (§3.5). 0, the
    # default, keeps an older worker to what it can run at once.
    prefetch: Annotated[int, msgspec.Meta(ge=0, le=MAX_PREFETCH)] = 0
    # It names the jobs it starts (``status.started``) and answers ``take_back`` (§3.5).
    # False, the default: an older worker, every job it holds counts as started.
    reports_starts: bool = False
    # Its idle heartbeats need no ack: one that carries no result and meets no directive
    # is answered only when no ack went out for ``heartbeat_timeout / 4`` (§4.2). False,
    # the default: every heartbeat gets its ack, as an older worker expects.
    lean_acks: bool = False
    # With lean acks: how long the worker, while idle, may go without an ack (§4.2,
    # "Sparse acks"). The server keeps it within [heartbeat_timeout / 4, 60] and says what
    # it applies in ``welcome``. Absent, as from an older worker: heartbeat_timeout / 4.
    idle_ack_interval: Annotated[float, msgspec.Meta(gt=0, le=3600)] | None = None


class Progress(msgspec.Struct, kw_only=True, omit_defaults=True):
    job_id: JobId
    percent: Percent
    message: str | None = None


class LogLine(msgspec.Struct, kw_only=True, omit_defaults=True):
    job_id: JobId
    message: str
    level: LogLevel = "info"
    time: str | None = None


class Alert(msgspec.Struct, kw_only=True, omit_defaults=True):
    message: str
    level: LogLevel = "warning"
    job_id: JobId | None = None


class Status(msgspec.Struct, kw_only=True, omit_defaults=True):
    state: WorkerState  # required: a status that omits it must not read as "running"
    active_job_ids: list[JobId] = []
    prefetched_job_ids: list[JobId] = []  # held, not started: renewed like running ones
    cpu_percent: CpuPercent | None = None
    memory_rss: NonNegative | None = None
    progress: list[Progress] = []
    logs: list[LogLine] = []
    alerts: Annotated[list[Alert], msgspec.Meta(max_length=MAX_ALERTS)] = []
    # Jobs started since the last heartbeat (a worker that registered reports_starts).
    started: Annotated[list[JobId], msgspec.Meta(max_length=MAX_STARTED)] = []
    # Jobs a ``take_back`` named that it removed from its line, unstarted.
    given_back: Annotated[list[JobId], msgspec.Meta(max_length=MAX_PREFETCH)] = []


class ErrorInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    message: str
    retryable: bool = True
    details: Any = None
    code: str | None = None  # a machine code, kept beside ``type`` in the job's error record


class Result(msgspec.Struct, kw_only=True, omit_defaults=True):
    job_id: JobId
    attempt: Positive
    outcome: Outcome
    result: Any = None
    error: ErrorInfo | None = None


class Heartbeat(_Tagged, tag="heartbeat"):
    seq: NonNegative
    worker_id: Name
    registration: Registration | None = None
    status: Status | None = None
    results: list[Result] = []
    capacity: Count | None = None
    goodbye: bool = False  # deregister: the server forgets this worker after this heartbeat


# -- server -> worker -------------------------------------------------------------
class SpecRejection(msgspec.Struct, kw_only=True):
    name: str
    checksum: str
    expected: str | None
    reason: str


class SpecVerdict(msgspec.Struct, kw_only=True):
    accepted: list[str]
    rejected: list[SpecRejection]


class Welcome(_Tagged, tag="welcome"):
    worker_id: str
    server_time: str
    heartbeat_interval: float
    heartbeat_timeout: float
    visibility_timeout: float
    specs: SpecVerdict
    # The idle ack interval applied, when the registration asked for one (§4.2): sent
    # only then, so an older worker never sees the field.
    idle_ack_interval: float | None = None


class ResultRejection(msgspec.Struct, kw_only=True):
    job_id: str
    attempt: int
    reason: str


class Ack(_Tagged, tag="ack"):
    seq: int
    state: WorkerState
    server_time: str
    accepted: list[str] = []
    rejected: list[ResultRejection] = []


class JobCopy(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    spec: str
    checksum: str
    queue: str
    args: Any
    attempt: int
    priority: int
    visibility_timeout: float
    enqueued_at: str
    capture_logs: bool = False  # forward the job's ctx.log() lines to the server
    # A workflow's step (docs/protocol.md §3.2): its workflow, and the results of the
    # steps before it (JSON, as stored); absent for any other job.
    workflow_id: str | None = None
    parent_results: Any = None


class Assign(_Tagged, tag="assign"):
    jobs: list[JobCopy]


class Cancel(_Tagged, tag="cancel"):
    """Stop these jobs: cancelled by an operator, or their reservation lapsed."""

    job_ids: list[str]
    reason: str


class TakeBack(_Tagged, tag="take_back"):
    """Give these jobs back if they still wait in the line, unstarted (``given_back``):
    another worker is idle. Sent only to a worker that registered ``reports_starts``."""

    job_ids: list[str]


class Error(_Tagged, tag="error"):
    code: str
    message: str


ServerMessage = Welcome | Ack | Assign | Cancel | TakeBack | Error


# -- codecs: built once, reused for every frame ----------------------------------
_encoder = msgspec.json.Encoder()
# Worker frames decode against every message type: a union makes the "type" tag
# required, and a server message sent by a worker is then refused by name.
_worker_frame_decoder = msgspec.json.Decoder(Heartbeat | ServerMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)


def encode(message: msgspec.Struct) -> str:
    return _encoder.encode(message).decode()


def decode_heartbeat(frame: str | bytes) -> Heartbeat:
    """Decode a worker frame, turning every failure into a precise FrameError."""
    try:
        frame = screen(frame)
        message = _worker_frame_decoder.decode(frame)
    except BadJson as exc:
        raise FrameError(exc.code, exc.message, CLOSE_INVALID_PAYLOAD) from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        probe = _peek(frame)  # only on this error path: parse once more
        if text == "Object missing required field `type`" or probe.type not in (None, "heartbeat"):
            raise _unknown_type(text) from exc
        error = FrameError("invalid_message", text, CLOSE_INVALID_PAYLOAD)
        error.worker_id = probe.worker_id if isinstance(probe.worker_id, str) else None
        raise error from exc
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        bad = explain(frame, exc)  # type: ignore[arg-type]  # bytes, once screened
        raise FrameError(bad.code, bad.message, CLOSE_INVALID_PAYLOAD) from None
    if not isinstance(message, Heartbeat):
        raise _unknown_type(f"{type(message).__name__.lower()!r} is a server message")
    return message


_BEAT_HEAD = '{"type":"heartbeat","seq":'
_SEQ_AT = len(_BEAT_HEAD)


def split_seq(frame: str) -> tuple[int, str] | None:
    """(seq, the rest) of a heartbeat frame laid out as ``encode`` writes one (its type,
    then its seq as plain digits), or None. Two frames with the same rest differ only in
    their seq: the session answers a repeat without decoding it (``Heartbeats.repeat``).
    A rest that names a seq again (JSON's last duplicate would win), or holds any escape
    (which could spell one), is not split."""
    if not frame.startswith(_BEAT_HEAD):
        return None
    end = frame.find(",", _SEQ_AT, _SEQ_AT + 19)  # 18 digits at most: well within int64
    if end < 0:
        return None
    digits = frame[_SEQ_AT:end]
    try:
        seq = int(digits)
    except ValueError:
        return None
    rest = frame[end:]
    # Plain JSON digits only: int() also takes "-1", "+1", " 1", "0_1", "01", "١".
    if seq < 0 or str(seq) != digits or '"seq"' in rest or "\\" in rest:
        return None  # (an escape could spell "seq" again: "s\\u0065q")
    return seq, rest


class _Probe(msgspec.Struct):
    type: Any = None
    worker_id: Any = None


def _peek(frame: str | bytes) -> _Probe:
    try:
        probe = msgspec.json.decode(frame, type=_Probe)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _Probe()
    if not isinstance(probe.type, str):
        probe.type = None
    return probe


def _unknown_type(detail: str) -> FrameError:
    return FrameError("unknown_type",
                      f"unknown message type ({detail}); workers send only 'heartbeat'",
                      CLOSE_UNSUPPORTED)


def decode_server_message(frame: str | bytes) -> ServerMessage:
    return _server_decoder.decode(frame)


def cut_text(text: str) -> str:
    """Texts in status sections are kept to MAX_TEXT characters."""
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"


def rfc3339(ts: float) -> str:
    """Format a Unix timestamp as RFC 3339 UTC with millisecond precision."""
    # As datetime does it: rounded to the microsecond, then cut to the millisecond.
    fraction, whole = math.modf(ts)
    second, micros = int(whole), round(fraction * 1e6)
    if micros >= 1_000_000:
        second, micros = second + 1, micros - 1_000_000
    elif micros < 0:
        second, micros = second - 1, micros + 1_000_000
    return f"{_rfc3339_second(second)}.{micros // 1000:03d}Z"


@functools.lru_cache(maxsize=256)
def _rfc3339_second(second: int) -> str:
    # Every job view, ack and assign formats a timestamp, and most fall in the same few
    # seconds: the date and time part is made once per second.
    return dt.datetime.fromtimestamp(second, tz=dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
