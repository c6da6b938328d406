"""Review of issue 27's /work edge (rota/server/edge.py LeanWebSocket, rota/server/sessions.py
Session.on_text): cases the fast path handles differently from the receive loop. Fake
peers on raw TCP against a real server in this process (tests/wirepeer.py)."""

from __future__ import annotations

import logging

import pytest
from conftest import Live
from wirepeer import Opener, said
from wirepeer import fake, log, wire  # noqa: F401 (fixtures)


@pytest.mark.xfail(strict=True, reason="review of issue 27: Session.on_text spends a goodbye's"
                   " tokens, then hands it to the receive loop without its PAUSE, and the"
                   " loop spends them again: a goodbye costs two frames, and a worker at"
                   " the edge of its burst is throttled on its way out")
@pytest.mark.parametrize("live", [{"rate_limit": 0.5, "rate_burst": 5}], indirect=True)
async def test_a_goodbye_within_the_burst_is_counted_once(
        wire: Live, fake: Opener, log: list[logging.LogRecord]) -> None:
    peer = await fake("bye")
    await peer.register()  # (the connection's own bucket, before the worker's)
    for _ in range(4):  # the worker's bucket: 4 of its 5 frames
        await peer.beat()
    seq = peer.seq
    await peer.send(peer.beat_frame(goodbye=True))  # the 5th: still within the burst
    closed = await peer.closed(timeout=10)
    assert closed.code == 1000, closed
    assert [m["seq"] for m in closed.before if m["type"] == "ack"] == [seq], closed
    assert not said(log, "throttled worker=bye"), "a goodbye within the burst was throttled"
