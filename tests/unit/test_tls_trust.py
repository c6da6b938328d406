"""The certificates Rota's clients trust are loaded once a process for each
SSL_CERT_FILE (rota/base/tls.py): a new context loads them again, about 15 ms of CPU,
at every httpx client made (AsyncClient) or https connection opened (the sync Client).
Each check runs in a new interpreter, whose contexts are not made yet."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import tls_files

COUNT_LOADS = """
import ssl
loads = 0
def counted(method):
    def count(self, *args, **kwargs):
        global loads
        loads += 1
        return method(self, *args, **kwargs)
    return count
ssl.SSLContext.load_verify_locations = counted(ssl.SSLContext.load_verify_locations)
ssl.SSLContext.load_default_certs = counted(ssl.SSLContext.load_default_certs)
"""

ASYNC_CLIENTS = COUNT_LOADS + """
from rota.client.producer import AsyncClient
clients = [AsyncClient(["http://127.0.0.1:1", "https://127.0.0.1:2"]) for _ in range(5)]
print(loads)
"""

# Three requests over https to a server that closes each connection after its answer:
# three connections, and the CA of SSL_CERT_FILE trusted by each.
SYNC_CONNECTIONS = COUNT_LOADS + """
import http.server, os, sys, threading
from rota.client.transport import Transport

class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(b"{}")
    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
tls.load_cert_chain(sys.argv[1], sys.argv[2])
server.socket = tls.wrap_socket(server.socket, server_side=True)
threading.Thread(target=server.serve_forever, daemon=True).start()
before = loads
transport = Transport(f"https://127.0.0.1:{server.server_address[1]}", timeout=5, headers={})
statuses = [transport.request("GET", "/")[0] for _ in range(3)]
print(loads - before, statuses)
"""


def run(script: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    said = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, timeout=60, env=env)
    assert said.returncode == 0, said.stderr
    return said.stdout.strip().split(maxsplit=1)


def test_async_clients_load_the_certificates_once_between_them() -> None:
    assert run(ASYNC_CLIENTS) == ["1"]


def test_the_sync_clients_connections_load_the_certificates_once(tmp_path: Path) -> None:
    chain, key, ca_file = tls_files(tmp_path)
    assert run(SYNC_CONNECTIONS, str(chain), str(key),
               env={**os.environ, "SSL_CERT_FILE": str(ca_file)}) == ["1", "[200, 200, 200]"]


def test_a_context_is_made_again_for_a_replaced_file_and_for_another_thread(
        tmp_path: Path, monkeypatch) -> None:
    import threading

    from rota.base.tls import default_trust, system_trust

    *_, ca_file = tls_files(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    kept = [system_trust(), default_trust()]
    assert all(a is b for a, b in zip([system_trust(), default_trust()], kept))
    (tmp_path / "rotated").mkdir()
    *_, rotated = tls_files(tmp_path / "rotated")
    ca_file.write_bytes(rotated.read_bytes() + ca_file.read_bytes())  # a bundle rotated
    again = [system_trust(), default_trust()]
    assert all(a is not b for a, b in zip(again, kept))
    elsewhere: list[object] = []
    thread = threading.Thread(target=lambda: elsewhere.extend([system_trust(), default_trust()]))
    thread.start()
    thread.join()
    assert all(a is not b for a, b in zip(elsewhere, again))
