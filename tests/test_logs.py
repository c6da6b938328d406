"""The server's log plumbing (rota.logs): lean records, the background handler, and a
batch of lines logged as one record, which comes out as one line per row, each with the
usual prefix, in order with the records around it."""

from __future__ import annotations

import io
import logging
import sys
import threading

import pytest

from rota.logs import FORMAT, BackgroundHandler, Formatter, LeanRecord, Lines, log_lines


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


def test_elsewhere_a_batch_reads_as_one_message_of_several_lines():
    assert str(Lines("job=%s", [("a",), ("b",)])) == "job=a\njob=b"


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
