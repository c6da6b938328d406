"""The egress module's import leaves sniffio's absence remembered in the server's process:
httpcore imports it at each request's start and end, and a failed import is not cached,
so each searched sys.path again (tests/conftest.py does the same for the test process,
which is why this looks in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys


def test_a_server_process_remembers_that_sniffio_is_missing() -> None:
    said = subprocess.run([sys.executable, "-c", "import sys, rota.server.egress_http;"
                           " print('sniffio' in sys.modules)"],
                          capture_output=True, text=True, check=True, timeout=60)
    assert said.stdout.strip() == "True"
