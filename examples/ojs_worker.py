"""An OJS pull worker in plain Python: httpx only, no Rota import (docs/ojs.md, Pull workers).

It fetches jobs from its queues, runs the handler for each job's type, ACKs the result or
NACKs the error, and heartbeats so that the server keeps its leases while a job runs.
Each setting is an option or an environment variable:

    OJS_URL=http://127.0.0.1:8000 OJS_QUEUES=images,default OJS_TOKEN=<a worker token> \
    OJS_SPECS=image.resize=sha256:1cae… python3 examples/ojs_worker.py

OJS_SPECS (`type=checksum,...`, from `rota specs checksum specs/`) says which version of each
versioned type this worker runs; it gets no job of a type whose checksum is not the status
quo's. It prints a line per job. SIGTERM or Ctrl-C: it finishes the job it runs, gives the
ones it has not started back to the queue, and exits.
"""

import argparse
import os
import signal
import socket
import threading
from typing import Any

import httpx

LEASE_MS = 30_000  # each heartbeat renews the leases this long; we beat every third of it


def echo(args: dict[str, Any]) -> dict[str, Any]:
    return args


def resize(options: dict[str, Any]) -> dict[str, Any]:
    return {"resized": options["width"]}


HANDLERS = {"echo": echo, "image.resize": resize}  # type -> function of the job's args


def main() -> None:
    env = os.environ.get
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--url", default=env("OJS_URL", "http://127.0.0.1:8000"))
    cli.add_argument("--queues", default=env("OJS_QUEUES", "default"), help="a,b: in order")
    cli.add_argument("--token", default=env("OJS_TOKEN"), help="a worker token, if any")
    cli.add_argument("--worker-id", default=env("OJS_WORKER_ID", f"{socket.gethostname()}-{os.getpid()}"))
    cli.add_argument("--specs", default=env("OJS_SPECS", ""), help="type=checksum,...")
    cli.add_argument("--count", type=int, default=int(env("OJS_COUNT", "1")), help="jobs per FETCH")
    cli.add_argument("--poll", type=float, default=float(env("OJS_POLL", "1")),
                     help="seconds to wait after a FETCH that found nothing")
    opts = cli.parse_args()
    me = opts.worker_id
    specs = dict(pair.split("=", 1) for pair in opts.specs.split(",") if pair)
    headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else {}
    http = httpx.Client(base_url=opts.url.rstrip("/") + "/ojs/v1", headers=headers, timeout=30)
    stop, held, state = threading.Event(), set[str](), {"state": "running"}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def post(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        answer = http.post(path, json=body)
        if answer.is_success:
            return answer.json()
        error = answer.json().get("error", {})
        print(f"{path}: {answer.status_code} {error.get('code')}: {error.get('message')}", flush=True)
        return None

    def beat() -> None:  # renews the leases of the jobs we hold, and reads our directive
        while not stop.wait(LEASE_MS / 3000):
            got = post("/workers/heartbeat", {"worker_id": me, "active_jobs": sorted(held),
                                              "visibility_timeout_ms": LEASE_MS})
            if got:
                state["state"] = got["state"]  # running, quiet or terminate
            if state["state"] == "terminate":
                stop.set()

    threading.Thread(target=beat, daemon=True).start()
    print(f"worker {me} fetching {opts.queues} from {opts.url}", flush=True)
    while not stop.is_set():
        if state["state"] != "running":  # quiet: fetch nothing until told to run again
            stop.wait(1)
            continue
        body: dict[str, Any] = {"queues": opts.queues.split(","), "count": opts.count,
                                "worker_id": me, "visibility_timeout_ms": LEASE_MS}
        if specs:
            body["x_rota_specs"] = specs
        answer = http.post("/workers/fetch", json=body)
        if rejected := answer.headers.get("X-Rota-Rejected-Specs"):
            print(f"not the status quo, no such jobs for us: {rejected}", flush=True)
        if answer.is_client_error:  # a wrong token, queue or field: asking again will not help
            raise SystemExit(f"fetch refused: {answer.status_code} {answer.text}")
        jobs = answer.json()["jobs"] if answer.is_success else []  # a 503: try again soon
        held.update(job["id"] for job in jobs)
        for job in jobs:
            ref = {"job_id": job["id"], "worker_id": me, "x_rota_attempt": job["attempt"]}
            if stop.is_set():  # stopping: give the jobs not started back, no attempt counted
                post("/workers/nack", {**ref, "requeue": True,
                                       "error": {"code": "shutdown", "message": "worker stopping"}})
            else:
                try:
                    handler = HANDLERS.get(job["type"])
                    if handler is None:
                        raise LookupError(f"no handler for type {job['type']}")
                    if post("/workers/ack", {**ref, "result": handler(*job["args"])}):
                        print(f"completed {job['id']} {job['type']}", flush=True)
                except Exception as exc:  # the attempt failed: the answer says what follows
                    error = {"code": "handler_error", "message": str(exc),
                             "details": {"error_class": type(exc).__name__}}
                    if post("/workers/nack", {**ref, "error": error}):
                        print(f"failed {job['id']} {job['type']}: {exc!r}", flush=True)
            held.discard(job["id"])
        if not jobs:
            stop.wait(opts.poll)  # nothing to do (FETCH does not wait): ask again soon
    print(f"worker {me} stopped", flush=True)


if __name__ == "__main__":
    main()
