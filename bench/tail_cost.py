"""What one `GET /events` subscriber costs end to end: bench/throughput.py's stream run
(1 worker x 10, batches of 1,000), alternately without and with a client reading every
event (a subprocess that counts what it reads), one fresh server per run.

    .venv/bin/python bench/tail_cost.py --jobs 10000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402  (bench/ is not a package)

READER = """import sys, httpx
events = 0
with httpx.stream("GET", sys.argv[1] + "/events", timeout=None) as response:
    for line in response.iter_lines():
        events += line.startswith("id: ")
        if events and events % 10000 == 0 and line.startswith("id: "):
            print(events, flush=True)
"""


def one(jobs: int, tail: bool) -> tuple[float, float]:
    """(jobs a second end to end, server CPU µs a job)."""
    workdir = Path(tempfile.mkdtemp(prefix="rota-tail-"))
    children = tp.Children()
    try:
        setup = tp.prepare(workdir, 10)
        tp.start_server(setup, children)
        tp.push_specs(setup)
        tp.start_workers(setup, 1, children)
        if tail:
            (workdir / "reader.py").write_text(READER)
            children.start("reader", [sys.executable, str(workdir / "reader.py"),
                                      setup.base_url], workdir)
            time.sleep(0.5)  # the reader's connection is open before the first job
        before = children.cpu_seconds()["server"]
        started = time.time()
        stats = asyncio.run(tp.enqueue_all(setup.base_url, jobs, 1, "httpx", 1000))
        done_at = tp.wait_for_completion(setup.db, len(stats.acked), 120, children,
                                         setup.base_url)
        cpu = children.cpu_seconds()["server"] - before
        if tail:  # it read every job's three events (enqueue, assign, result)
            log = workdir / "reader.log"
            tp.wait_until("the reader to read every event", lambda: (
                log.read_text().split() or ["0"])[-1] == str(3 * jobs // 10000 * 10000),
                children, 60)
        assert done_at is not None
        return jobs / (done_at - started), cpu / jobs * 1e6
    finally:
        children.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for tail in (False, True):
            runs[tail].append(one(args.jobs, tail))
            print(("with a subscriber   " if tail else "without a subscriber"),
                  f"{runs[tail][-1][0]:,.0f} jobs/s, server {runs[tail][-1][1]:.0f} µs/job",
                  flush=True)
    for tail in (False, True):
        rates, cpus = zip(*runs[tail], strict=True)
        print(("with" if tail else "without"), "a subscriber: median",
              f"{statistics.median(rates):,.0f} jobs/s, server {statistics.median(cpus):.0f}"
              " µs of CPU a job")


if __name__ == "__main__":
    main()
