"""tests/ojs/serve.py, as .ci/run uses it: it starts `rota serve` (one on SQLite; two on a
throwaway PostgreSQL, under the soak marker), gives the command their URLs in
$OJS_TEST_URL, stops them by pid afterwards and exits with the command's status."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

SERVE = Path(__file__).with_name("serve.py")
# What the command checks, through every server named: the test switch is on (the
# reset answers), and a job pushed through the first is read through each.
CHECK = """
import os, sys, httpx
urls = os.environ["OJS_TEST_URL"].split(",")
open(sys.argv[1], "w").write(",".join(urls))
assert len(urls) == int(sys.argv[2]), urls
for url in urls:
    assert httpx.post(url + "/ojs/v1/admin/reset").status_code == 200
job = httpx.post(urls[0] + "/ojs/v1/jobs", json={"type": "serve.check", "args": []})
assert job.status_code == 201, job.text
for url in urls:
    assert httpx.get(url + "/ojs/v1/jobs/" + job.json()["job"]["id"]).status_code == 200
sys.exit(7)
"""


def serve(kind: str, count: int, tmp_path: Path) -> list[str]:
    named = tmp_path / "urls"
    done = subprocess.run([sys.executable, str(SERVE), kind, "--", sys.executable, "-c",
                           CHECK, str(named), str(count)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 7, done.stderr  # the command's own status
    urls = named.read_text().split(",")
    for url in urls:  # stopped: nothing answers there any more
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/healthz", timeout=2)
    return urls


def test_one_server_on_sqlite_runs_the_command_and_is_stopped(tmp_path: Path) -> None:
    assert len(serve("sqlite", 1, tmp_path)) == 1


@pytest.mark.soak
def test_two_servers_on_postgresql_run_the_command_and_are_stopped(tmp_path: Path) -> None:
    assert len(set(serve("pg2", 2, tmp_path))) == 2


def test_a_bad_command_line_says_how_to_call_it() -> None:
    done = subprocess.run([sys.executable, str(SERVE), "mysql", "--", "true"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "usage: tests/ojs/serve.py {sqlite,pg2}" in done.stderr
