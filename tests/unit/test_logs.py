"""The server's log plumbing (rota/cli/logsetup.py; rota/base/logs.py's batches): lean records,
the background handler, and a batch of lines logged as one record, which comes out as one
line per row, each with the usual prefix, in order with the records around it."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from datetime import datetime

import pytest

from rota.cli.logsetup import FORMAT, BackgroundHandler, Formatter, JsonFormatter, LeanRecord
from rota.base.logs import Lines, log_lines


def _record(factory: type[logging.LogRecord], msg: str, args: object,
            exc_info: object = None) -> logging.LogRecord:
    return factory("rota.server", logging.INFO, "(unknown file)", 0, msg, args, exc_info,
                   "(unknown function)")


@pytest.mark.parametrize("msg, args", [
    ("enqueue job=%s priority=%d", ("j1", 5)),
    ("keyed %(job)s at %(n)d", ({"job": "j2", "n": 3},)),
    ("no args at all", ()),
    ("a lone tuple %s", (("a", "b"),)),
])
def test_a_lean_record_formats_as_the_standard_one(msg: str, args: tuple[object, ...]):
    formatter = Formatter("%(levelname)s %(name)s %(filename)s:%(lineno)d %(message)s")
    lean, standard = _record(LeanRecord, msg, args), _record(logging.LogRecord, msg, args)
    assert formatter.format(lean) == formatter.format(standard)
    assert abs(lean.created - standard.created) < 1.0 and 0 <= lean.msecs < 1000


def test_a_lean_record_carries_a_traceback():
    try:
        raise ValueError("boom")
    except ValueError:
        info = sys.exc_info()
    text = Formatter(FORMAT).format(_record(LeanRecord, "failed: %s", ("x",), info))
    assert "failed: x" in text and "Traceback" in text and "ValueError: boom" in text


def test_info_lines_wait_for_the_thread_and_warnings_go_at_once():
    stream = io.StringIO()
    handler = BackgroundHandler(stream)
    handler.setFormatter(Formatter("%(levelname)s %(message)s"))
    try:
        handler.handle(_record(LeanRecord, "first", ()))
        handler.handle(_record(LeanRecord, "second", ()))
        warning = _record(LeanRecord, "look", ())
        warning.levelno, warning.levelname = logging.WARNING, "WARNING"
        handler.handle(warning)  # written at once, after everything queued before it
        assert stream.getvalue() == "INFO first\nINFO second\nWARNING look\n"
    finally:
        handler.close()


def test_lines_from_many_threads_are_all_written_once():
    stream = io.StringIO()
    handler = BackgroundHandler(stream)
    handler.setFormatter(Formatter("%(message)s"))

    def write(n: int) -> None:
        for i in range(2_000):
            handler.handle(_record(LeanRecord, "%d-%d", (n, i)))

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    handler.close()
    lines = stream.getvalue().splitlines()
    assert sorted(lines) == sorted(f"{n}-{i}" for n in range(4) for i in range(2_000))


def test_a_batch_is_written_one_line_per_row_with_its_prefix():
    stream = io.StringIO()
    handler = BackgroundHandler(stream)
    handler.setFormatter(Formatter(FORMAT))
    logger = logging.getLogger("rota.test-lines")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        logger.info("before")
        log_lines(logger, logging.INFO, "assign job=%s attempt=%d", [("a", 1), ("b", 2)])
        log_lines(logger, logging.INFO, "assign job=%s attempt=%d", [])  # nothing at all
        log_lines(logger, logging.DEBUG, "hidden job=%s", [("c",)])  # below the level
        logger.info("after")
        handler.flush()
    finally:
        logger.removeHandler(handler)
        handler.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(" rota.test-lines ")[1] for line in lines] == [
        "before", "assign job=a attempt=1", "assign job=b attempt=2", "after"]
    assert all(" INFO    rota.test-lines " in line for line in lines)


@pytest.mark.parametrize("fmt, rows", [
    ("result job=%s spec=%s@%s took_ms=%.2f", [("a", "s", "c1", 1.234), ("b", "t", "c2", 0.5)]),
    ("100%% done job=%s", [("a",)]),
    ("as is %%", [()]),  # no arguments: the format is written as it stands
])
def test_a_batch_in_rotas_format_is_what_each_line_alone_would_be(
        fmt: str, rows: list[tuple[object, ...]]):
    # Rota's own text format makes the prefix once a record: the lines must be exactly
    # those the standard formatter gives each row logged on its own.
    formatter = Formatter(FORMAT)
    batch = _record(LeanRecord, "", ())
    batch.msg = Lines(fmt, rows)
    alone = []
    for row in rows:
        line = _record(LeanRecord, fmt, row)
        line.created, line.msecs = batch.created, batch.msecs
        alone.append(formatter.format(line))
    stream = io.StringIO()
    handler = BackgroundHandler(stream)
    handler.setFormatter(formatter)
    try:
        handler.handle(batch)
        handler.flush()
    finally:
        handler.close()
    assert stream.getvalue().splitlines() == alone


def test_elsewhere_a_batch_reads_as_one_message_of_several_lines():
    assert str(Lines("job=%s", [("a",), ("b",)])) == "job=a\njob=b"


# -- --log-format json --------------------------------------------------------------------
def _json_lines(*records: logging.LogRecord) -> list[dict[str, object]]:
    stream = io.StringIO()
    handler = BackgroundHandler(stream)
    handler.setFormatter(JsonFormatter())
    try:
        for record in records:
            handler.handle(record)
        handler.flush()
    finally:
        handler.close()
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_json_line_carries_the_fields_of_its_format():
    [line] = _json_lines(_record(
        LeanRecord, "result job=%s spec=%s@%s queue=%s worker=%s attempt=%d"
        " outcome=completed duration_ms=%s", ("j1", "echo", "sha256:ab", "mail", "w1", 2, 15)))
    assert line.pop("message") == ("result job=j1 spec=echo@sha256:ab queue=mail worker=w1"
                                   " attempt=2 outcome=completed duration_ms=15")
    stamp = line.pop("time")
    assert isinstance(stamp, str) and stamp.endswith("Z")
    assert datetime.fromisoformat(stamp).tzinfo is not None
    assert line == {"level": "INFO", "logger": "rota.server", "event": "result",
                    "outcome": "completed", "job": "j1", "spec": "echo",
                    "checksum": "sha256:ab", "queue": "mail", "worker": "w1", "attempt": 2,
                    "duration_ms": 15}


@pytest.mark.parametrize("msg, args, fields", [
    ("no fields at all", (), {}),
    ("100%% done job=%s", ("j",), {"job": "j"}),  # "%%" takes no argument
    ("keyed %(job)s n=%(n)d", ({"job": "j2", "n": 3},), {"n": 3}),
    ("outbox %s worker=%s", ("full", "w1"), {"worker": "w1"}),  # no event: words vary
    ("directed by the server: state=%s", ("quiet",), {"event": "directed by the server",
                                                      "state": "quiet"}),
    ("job failed job=%s error=%s: %s", ("j", "ValueError", "boom"),
     {"event": "job failed", "job": "j", "error": "ValueError"}),
    ("level=%s message=%r", ("x", "forged"), {"event": None}),  # base keys are not replaced
])
def test_json_fields_follow_the_format(msg: str, args: tuple[object, ...],
                                       fields: dict[str, object]):
    [line] = _json_lines(_record(LeanRecord, msg, args))
    assert line["message"] == msg % (args[0] if len(args) == 1 and isinstance(args[0], dict)
                                     else args)
    assert line["level"] == "INFO"
    for key, value in fields.items():
        assert line.get(key) == value, (key, line)


def test_a_json_batch_is_one_object_per_row_as_if_logged_alone():
    fmt = "assign job=%s spec=%s@%s queue=%s worker=%s attempt=%d"
    rows = [("a", "echo", "sha256:1", "q", "w", 1), ("b", "echo", "sha256:1", "q", "w", 3)]
    batch = _json_lines(_record(LeanRecord, Lines(fmt, rows), ()))  # type: ignore[arg-type]
    alone = _json_lines(*(_record(LeanRecord, fmt, row) for row in rows))
    for line in batch + alone:
        line.pop("time")
    assert batch == alone and [line["job"] for line in batch] == ["a", "b"]
    assert batch[1]["attempt"] == 3 and batch[1]["event"] == "assign"


def test_a_json_line_keeps_a_traceback_and_survives_bad_arguments():
    try:
        raise ValueError("boom")
    except ValueError:
        info = sys.exc_info()
    [line] = _json_lines(_record(LeanRecord, "failed job=%s", ("x",), info))
    assert line["job"] == "x" and "ValueError: boom" in str(line["exc_info"])
    # A value JSON has no word for is written as its text; a line is one line.
    [line] = _json_lines(_record(LeanRecord, "odd job=%s", (object(),)))
    assert str(line["job"]).startswith("<object object")
    [line] = _json_lines(_record(LeanRecord, "two\nlines job=%s", ("x\ny",)))
    assert line["job"] == "x\ny"


def test_a_batch_is_formatted_from_a_copy_leaving_the_shared_record_alone():
    # The record also goes to other handlers (pytest's capture), which may be formatting
    # it on another thread: the log thread must never change it under them.
    seen: list[object] = []
    batch = _record(LeanRecord, "", ())
    batch.msg = Lines("job=%s", [("a",), ("b",)])

    class Watching(Formatter):
        def format(self, record: logging.LogRecord) -> str:
            seen.append(batch.msg)  # what another handler would see meanwhile
            return super().format(record)

    stream = io.StringIO()
    handler = BackgroundHandler(stream)
    handler.setFormatter(Watching("%(message)s"))
    try:
        handler.handle(batch)
        handler.flush()
    finally:
        handler.close()
    assert stream.getvalue() == "job=a\njob=b\n"
    assert all(isinstance(msg, Lines) for msg in seen) and len(seen) == 2
    assert batch.args == ()


def test_debug_is_rotas_own_and_trace_lets_the_libraries_through():
    """``--log-level debug`` wrote two lines a second of a worker's WebSocket frames;
    ``trace`` is the way to see them (in a process of its own: configure is global)."""
    import subprocess

    probe = ("import logging; from rota.cli import logsetup\n"
             "for level in ('debug', 'trace'):\n"
             "    logsetup.configure(level)\n"
             "    print(level, *(logging.getLogger(name).getEffectiveLevel() for name in\n"
             "          ('rota.worker', 'myapp', 'websockets.client', 'httpcore', 'asyncio',\n"
             "           'uvicorn.protocols', 'multiprocessing')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    debug, info = logging.DEBUG, logging.INFO
    assert out[0].split() == ["debug", *map(str, [debug, debug, info, info, info, info, info])]
    assert out[1].split() == ["trace", *map(str, [debug] * 7)]
