"""A push endpoint in the standard library: it checks each delivery's signature (and
refuses a replay), runs the job and answers its result as JSON (README, Push execution).

    ROTA_SECRET_HOOKS=... python examples/push/endpoint.py [--port 8080]

A 2xx with JSON completes the job with that JSON; a 4xx fails it for good; a 5xx (or no
answer in time) retries it. A long job may answer 202 and report later with the
``callback`` the delivery carries (docs/push.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rota.base.signing import DELIVERY, TOLERANCE, verify

SECRET = os.environ.get("ROTA_SECRET_HOOKS", "")
seen: dict[str, float] = {}  # delivery ids of the last TOLERANCE seconds: no replays


class Endpoint(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        now = time.time()
        delivery = self.headers.get(DELIVERY, "")
        if not verify(SECRET, dict(self.headers.items()), body, now) or delivery in seen:
            return self.answer(401, {"error": "bad signature, stale or replayed"})
        seen[delivery] = now
        for old in [d for d, at in seen.items() if at < now - TOLERANCE]:
            del seen[old]
        job = json.loads(body)["job"]
        name = job["args"].get("name", "")
        if not name:
            return self.answer(400, {"error": "no name"})  # a 4xx: not retried
        self.answer(200, {"greeting": f"Hello, {name}!", "attempt": job["attempt"]})

    def answer(self, status: int, payload: dict[str, object]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


if __name__ == "__main__":
    if not SECRET:
        sys.exit("endpoint.py: ROTA_SECRET_HOOKS is not set: export the value the server"
                 " signs with (the same ROTA_SECRET_HOOKS, or what `rota secrets set hooks`"
                 " printed)")
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=8080)
    port = parser.parse_args().port
    print(f"endpoint on http://127.0.0.1:{port}/greet", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Endpoint).serve_forever()
