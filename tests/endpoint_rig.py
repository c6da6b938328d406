"""A push-execution endpoint for the tests and the bench, run as a subprocess:

    python tests/endpoint_rig.py --port 0 --log FILE [--secret S] [--nth PATH:N:STATUS ...]

prints its port on stdout's first line, then answers POSTs until killed. Each request's
signature is checked (rota.base.signing.verify, with --secret) and one JSON line is
appended to FILE: {"path", "delivery_id", "job_id", "attempt", "signed", "whole" (the
body arrived in full, not cut by the sender going away), "t"}.

Paths (a query string is allowed on each):
  /ok 200 {"echo": job.args}        /fail 500          /bad 400          /gone 404
  /hang never answers (until the client goes away)     /reset closes with a TCP RST
  /redirect 302 to http://other.invalid/x              /redirect-same 302 to /ok
  /slow?ms=N 200 after N ms         /429 429, Retry-After: 1
  /accept?ms=N 202, then after N ms POSTs {"token", "status": "completed",
      "result": {"echo": args}} to the body's callback.url (logged as path "callback")
  (/slow and /accept also take &jitter=M: up to M ms more, a random share of it each)
  /flaky?n=N 500 to a job's first N deliveries, then as /ok
  /notjson 200 text/plain           /huge 200, a 2 MiB JSON body
  /latin1 200, a body that is not UTF-8    /deep?n=N 200, JSON nested N deep (100,000)
  /empty 200 with no body          /nocontent 204
  /accept-silent 202, and never calls back
--nth PATH:N:STATUS answers the Nth request on PATH (1 = the first) with STATUS instead.
Standard library and rota.base only.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rota.base.signing import verify  # noqa: E402

HUGE = b'{"pad": "' + b"x" * (2 << 20) + b'"}'


class Rig(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # (the listen backlog, 5 by default: a wave of deliveries
    # overflows it, and the sender sees resets)

    def __init__(self, port: int, log: Path, secret: str | None,
                 nth: dict[tuple[str, int], int]) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.log, self.secret, self.nth = log, secret, nth
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()  # requests per path
        self.per_job: Counter[str] = Counter()  # /flaky deliveries per job

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # (a client gone is no news)
            super().handle_error(request, client_address)

    def record(self, line: dict[str, object]) -> None:
        with self.lock, self.log.open("a") as out:
            out.write(json.dumps(line) + "\n")


class Handler(BaseHTTPRequestHandler):
    server: Rig
    protocol_version = "HTTP/1.1"  # keep-alive, as the deliverer's pool expects
    disable_nagle_algorithm = True  # (headers and body are two writes: no 40 ms stall)

    def log_message(self, format: str, *args: object) -> None:  # (the JSON log is enough)
        pass

    def do_POST(self) -> None:
        parts = urlsplit(self.path)
        path, query = parts.path, {k: v[0] for k, v in parse_qs(parts.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        try:
            sent = json.loads(body)
        except ValueError:
            sent = {}
        job = sent.get("job", {}) if isinstance(sent, dict) else {}
        rig = self.server
        secret = rig.secret
        signed = secret is not None and verify(secret, dict(self.headers.items()), body,
                                               time.time())
        with rig.lock:
            rig.counts[path] += 1
            nth = rig.nth.get((path, rig.counts[path]))
            rig.per_job[str(job.get("id"))] += path == "/flaky"
            flaky = rig.per_job[str(job.get("id"))]
        rig.record({"path": path, "delivery_id": self.headers.get("X-Rota-Delivery-Id"),
                    "job_id": self.headers.get("X-Rota-Job-Id"),
                    "attempt": self.headers.get("X-Rota-Attempt"), "signed": signed,
                    "whole": len(body) == length, "t": time.time()})
        echo = {"echo": job.get("args")}
        if nth is not None:
            return self.answer(nth, {"nth": rig.counts[path]})
        if path == "/ok" or (path == "/flaky" and flaky > int(query.get("n", 1))):
            return self.answer(200, echo)
        if path in ("/fail", "/flaky"):
            return self.answer(500, {"error": "failing on purpose"})
        if path == "/bad":
            return self.answer(400, {"error": "bad on purpose"})
        if path == "/gone":
            return self.answer(404, {"error": "no such function"})
        if path == "/429":
            return self.answer(429, {"error": "slow down"}, {"Retry-After": "1"})
        if path == "/slow":
            time.sleep(delay(query))  # noqa: sleep-ok (the endpoint's work)
            return self.answer(200, echo)
        if path == "/redirect":
            return self.answer(302, {}, {"Location": "http://other.invalid/x"})
        if path == "/redirect-same":
            return self.answer(302, {}, {"Location": "/ok"})
        if path == "/notjson":
            return self.answer(200, b"hello", {"Content-Type": "text/plain"})
        if path == "/huge":
            return self.answer(200, HUGE)
        if path == "/latin1":
            return self.answer(200, b'{"name": "caf\xe9"}')
        if path == "/deep":
            depth = int(query.get("n", 100_000))  # (200 KB: under the cap, deeper than a
            return self.answer(200, b"[" * depth + b"]" * depth)  # parser goes)
        if path == "/empty":
            return self.answer(200, b"")
        if path == "/nocontent":
            return self.answer(204, b"")
        if path == "/accept-silent":
            return self.answer(202, {"accepted": True})
        if path == "/accept":
            callback = sent.get("callback", {}) if isinstance(sent, dict) else {}
            threading.Timer(delay(query), self.call_back,
                            (callback, echo)).start()
            return self.answer(202, {"accepted": True})
        if path == "/hang":
            return self.hang()
        if path == "/reset":
            return self.reset()
        return self.answer(404, {"error": f"no path {path}"})

    def answer(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(name, value)
        if status != 204:  # (a 204 has no body, so no length: RFC 9110 §8.6)
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def hang(self) -> None:
        """Answer nothing; return once the client closed its end (or the rig stops)."""
        self.close_connection = True
        poller = select.poll()  # (select.select refuses a descriptor above 1023)
        poller.register(self.connection, select.POLLIN)
        while True:
            if poller.poll(500) and not self.connection.recv(1, socket.MSG_PEEK):
                return

    def reset(self) -> None:
        """Close at once with SO_LINGER 0: the client sees a reset, no answer."""
        self.close_connection = True
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                   struct.pack("ii", 1, 0))
        self.connection.close()

    def call_back(self, callback: dict[str, object], echo: dict[str, object]) -> None:
        data = json.dumps({"token": callback.get("token"), "status": "completed",
                           "result": echo}).encode()
        try:  # (a delivery cut short, by a kill, names no URL: ValueError)
            request = urllib.request.Request(str(callback.get("url")), data=data,
                                             method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as answer:
                status = answer.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except (OSError, ValueError) as exc:
            status = str(exc)
        self.server.record({"path": "callback", "url": callback.get("url"),
                            "status": status, "t": time.time()})


def delay(query: dict[str, str]) -> float:
    """Seconds: ``ms`` (100 by default) and a random share of ``jitter`` (0)."""
    return (int(query.get("ms", 100)) + random.uniform(0, int(query.get("jitter", 0)))) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--secret", default=None)
    parser.add_argument("--nth", action="append", default=[], metavar="PATH:N:STATUS")
    options = parser.parse_args()
    nth = {}
    for rule in options.nth:
        path, n, status = rule.rsplit(":", 2)
        nth[(path, int(n))] = int(status)
    rig = Rig(options.port, options.log, options.secret, nth)
    print(rig.server_address[1], flush=True)
    try:
        rig.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
