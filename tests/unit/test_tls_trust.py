"""The certificates Rota's httpx clients trust are loaded once a process
(rota/base/tls.py default_trust): an httpx client made without a context loads the CA
bundle again, about 16 ms of CPU a client here."""

from __future__ import annotations

import subprocess
import sys

COUNT_LOADS = """
import ssl
loads = 0
load = ssl.SSLContext.load_verify_locations
def counted(self, *args, **kwargs):
    global loads
    loads += 1
    return load(self, *args, **kwargs)
ssl.SSLContext.load_verify_locations = counted
from rota.client.producer import AsyncClient
clients = [AsyncClient(["http://127.0.0.1:1", "https://127.0.0.1:2"]) for _ in range(5)]
print(loads)
"""


def test_async_clients_load_the_certificates_once_between_them() -> None:
    said = subprocess.run([sys.executable, "-c", COUNT_LOADS], capture_output=True,
                          text=True, check=True, timeout=60)
    assert said.stdout.split() == ["1"], said.stdout + said.stderr
