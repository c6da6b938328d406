"""rota/logs.py: a batch of lines logged as one record comes out as one line per row,
each with the usual prefix, in order with the records around it."""

from __future__ import annotations

import io
import logging

from rota.logs import FORMAT, BackgroundHandler, Formatter, Lines, log_lines


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
