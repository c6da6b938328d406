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
from collections.abc import Callable
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
    cli.add_argument("--worker-id",
                     default=env("OJS_WORKER_ID", f"{socket.gethostname()}-{os.getpid()}"))
    cli.add_argument("--specs", default=env("OJS_SPECS", ""), help="type=checksum,...")
    cli.add_argument("--count", type=int, default=int(env("OJS_COUNT", "1")),
                     help="jobs per FETCH")
    cli.add_argument("--poll", type=float, default=float(env("OJS_POLL", "1")),
                     help="seconds to wait after a FETCH that found nothing")
    opts = cli.parse_args()
    me = opts.worker_id
    specs = dict(pair.split("=", 1) for pair in opts.specs.split(",") if pair)
    headers = {"Authorization": f"Bearer {opts.token}"} if opts.token else {}
    http = httpx.Client(base_url=opts.url.rstrip("/") + "/ojs/v1", headers=headers, timeout=30)
    stop, state = threading.Event(), {"state": "running"}
    held, lock = set[str](), threading.Lock()  # the jobs we hold, shared with the heartbeat
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def post(path: str, body: dict[str, Any]) -> httpx.Response | None:
        try:
            answer = http.post(path, json=body)
        except httpx.TransportError as exc:  # the server restarting, say: try again later
            print(f"{path}: {exc!r}", flush=True)
            return None
        if not answer.is_success:  # the error is JSON: {"error": {"code", "message", ...}}
            print(f"{path}: {answer.status_code} {answer.text}", flush=True)
        return answer

    def beat() -> None:  # renews the leases of the jobs we hold, and reads our directive
        while not stop.wait(LEASE_MS / 3000):
            with lock:
                ids = sorted(held)
            answer = post("/workers/heartbeat", {"worker_id": me, "active_jobs": ids,
                                                 "visibility_timeout_ms": LEASE_MS})
            if answer and answer.is_success:
                state["state"] = answer.json()["state"]  # running, quiet or terminate
            if state["state"] == "terminate":
                stop.set()

    threading.Thread(target=beat, daemon=True).start()
    print(f"worker {me} fetching {opts.queues} from {opts.url}", flush=True)
    while not stop.is_set():
        body: dict[str, Any] = {"queues": opts.queues.split(","), "count": opts.count,
                                "worker_id": me, "visibility_timeout_ms": LEASE_MS}
        if specs:
            body["x_rota_specs"] = specs
        answer = post("/workers/fetch", body) if state["state"] == "running" else None
        if answer is not None and (rejected := answer.headers.get("X-Rota-Rejected-Specs")):
            print(f"not the status quo, no such jobs for us: {rejected}", flush=True)
        if answer is not None and (waiting := answer.headers.get("X-Rota-Waiting-Specs")):
            print(f"jobs wait for a checksum we did not declare: {waiting}", flush=True)
        if answer is not None and answer.is_client_error:  # a wrong token, queue or field
            raise SystemExit(1)  # asking again would not mend it
        jobs = answer.json()["jobs"] if answer is not None and answer.is_success else []
        with lock:
            held.update(job["id"] for job in jobs)
        for job in jobs:
            ref = {"job_id": job["id"], "worker_id": me, "x_rota_attempt": job["attempt"]}
            if stop.is_set():  # stopping: give the jobs not started back, no attempt counted
                post("/workers/nack", {**ref, "requeue": True,
                                       "error": {"code": "shutdown", "message": "stopping"}})
            else:
                run(post, job, ref)
            with lock:
                held.discard(job["id"])
        if not jobs:  # nothing to do (FETCH does not wait), quiet, or the server away
            stop.wait(opts.poll)
    print(f"worker {me} stopped", flush=True)


def run(post: Callable[[str, dict[str, Any]], httpx.Response | None], job: dict[str, Any],
        ref: dict[str, Any]) -> None:
    """Run one job, then ACK its result or NACK its error (the answer says what follows)."""
    try:
        handler = HANDLERS.get(job["type"])
        if handler is None:
            raise LookupError(f"no handler for type {job['type']}")
        result = handler(*job["args"])
    except Exception as exc:
        error = {"code": "handler_error", "message": str(exc),
                 "details": {"error_class": type(exc).__name__}}
        if (answer := post("/workers/nack", {**ref, "error": error})) and answer.is_success:
            print(f"failed {job['id']} {job['type']}: {exc!r}", flush=True)
        return
    if (answer := post("/workers/ack", {**ref, "result": result})) and answer.is_success:
        print(f"completed {job['id']} {job['type']}", flush=True)


if __name__ == "__main__":
    main()
