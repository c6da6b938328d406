"""The egress pool under a wave of deliveries: at most SHARD requests in flight on one
httpcore pool (whose bookkeeping costs the square of what it carries), more pools as the
wave grows, and a light load kept on one pool and its keep-alive connections."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from test_deliverer import running_rig

from rota.server.egress_http import SHARD, Egress


async def test_a_wave_is_spread_over_pools_of_at_most_shard(tmp_path: Path) -> None:
    with running_rig(tmp_path / "rig.log") as rig:
        egress = Egress(allow_private=True)
        try:
            for _ in range(3):  # one at a time: one pool
                assert (await egress.post(rig.url("/ok"), b"{}", {}, timeout=10)).status == 200
            assert egress._busy == [0]
            peak: list[int] = []

            async def one() -> int | None:
                peak.append(max(egress._busy))
                return (await egress.post(rig.url("/slow?ms=300"), b"{}", {},
                                          timeout=20)).status

            wave = asyncio.gather(*(one() for _ in range(3 * SHARD + 1)))
            await asyncio.sleep(0)  # noqa: sleep-ok (one turn: every POST has its pool)
            assert egress._busy == [SHARD, SHARD, SHARD, 1]
            assert await wave == [200] * (3 * SHARD + 1)
            assert max(peak) <= SHARD and egress._busy == [0, 0, 0, 0]
        finally:
            await egress.aclose()


def test_the_missing_sniffio_is_remembered() -> None:
    """httpcore imports sniffio at each request's start and end; absent, each import
    searched sys.path again. The module's import leaves it known (or None: absent)."""
    assert "sniffio" in sys.modules
