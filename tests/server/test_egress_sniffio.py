"""What the egress modules' imports leave in a fresh interpreter (tests/conftest.py and
the other tests import everything, which is why these look in a new process): httpx
only once the server sends something, and sniffio's absence remembered then."""

from __future__ import annotations

import subprocess
import sys


def imported_after(statement: str, *names: str) -> list[bool]:
    """Whether each module is imported once ``statement`` ran in a new interpreter."""
    said = subprocess.run([sys.executable, "-c", f"import sys; {statement};"
                           f" print(*(name in sys.modules for name in {names!r}))"],
                          capture_output=True, text=True, check=True, timeout=60)
    return [word == "True" for word in said.stdout.split()]


def test_a_server_process_remembers_that_sniffio_is_missing() -> None:
    # httpcore imports it at each request's start and end, and a failed import is not
    # cached: each searched sys.path again.
    assert imported_after("import rota.server.egress_http", "sniffio") == [True]


def test_a_server_that_sends_nothing_never_imports_httpx() -> None:
    # (45 ms and more of every server's start: rota/server/outbound.py)
    assert imported_after("import rota.server.app, rota.cli.serve, rota.server.outbound,"
                          " rota.server.deliverer, rota.server.hooks, rota.server.pulling",
                          "httpx", "rota.server.egress_http") == [False, False]
