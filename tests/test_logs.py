"""The server's log plumbing (rota.logs): lean records and the background handler."""

from __future__ import annotations

import io
import logging
import sys
import threading

import pytest

from rota.logs import FORMAT, BackgroundHandler, Formatter, LeanRecord


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
