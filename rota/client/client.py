"""A small synchronous HTTP client for the Rota API, the CLI's and producers', and the job
handles and errors both producer clients share (``rota.client.producer`` has the asyncio one).

It speaks HTTP/1.1 over one kept-alive connection (rota/client/transport.py). A
general-purpose client (httpx) cost 0.3 ms more per call here on an idle loopback, as
much as the server's commit: for a producer that enqueues one job at a time, the client
was a third of the round trip (docs/performance.md).
"""

from __future__ import annotations

import http.client
import os
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from rota.base.errors import ApiError, JobError, ResultTimeout  # defined there, public here too
from rota.base.ids import path_segment
from rota.base.specs import JobSpec
from rota.base.unique import unique_option
from rota.client.failures import dashboard_url, not_the_api, refusal, transport_error
from rota.client.flows import Workflows
from rota.client.schedules import ScheduleCalls
from rota.client.webhooks import WebhookCalls
from rota.client.secrets import SecretCalls
from rota.client.transport import IDEMPOTENT, Transport

# The server's default max_result_wait: it refuses a longer ?wait= (400 invalid_wait), so
# a longer result() timeout is waited out in polls of at most this. A server started with
# a lower max_result_wait (ServerSettings) needs a client made with max_wait at most that.
MAX_WAIT = 300.0


def poll_wait(deadline: float | None, max_wait: float) -> float:
    """Seconds the next long poll may wait: to the deadline (None: none), at most max_wait.
    Rounded to milliseconds, so that the query holds a plain number."""
    if deadline is None:
        return max_wait
    return round(max(0.0, min(max_wait, deadline - time.monotonic())), 3)


def outcome(reply: dict[str, Any]) -> Any:
    """The result in a finished job's ``GET /jobs/{id}/result`` answer, or its JobError."""
    if reply["state"] != "completed":
        raise JobError(reply["id"], reply["state"], reply.get("error"))
    return reply["result"]


class JobHandle:
    """What ``enqueue`` returns: the job as the server stored it. ``id``, ``state`` and
    ``spec`` are the common fields; ``view`` is the whole job view of ``GET /jobs/{id}``
    (queue, priority, run_at, ...), as of the enqueue (or the last ``refresh()``).
    ``created`` is False when a job with this id existed already (the same job, sent
    again). ``handle["job"]`` and ``handle["created"]`` still read as the dict
    ``{"job": view, "created": bool}`` that ``enqueue`` used to return."""

    __slots__ = ("created", "view")

    def __init__(self, view: dict[str, Any], created: bool) -> None:
        self.view = view
        self.created = created

    @property
    def id(self) -> str:
        job_id: str = self.view["id"]
        return job_id

    @property
    def state(self) -> str:
        state: str = self.view["state"]
        return state

    @property
    def spec(self) -> str:
        spec: str = self.view["spec"]
        return spec

    def __getitem__(self, key: str) -> Any:
        if key == "job":
            return self.view
        if key == "created":
            return self.created
        raise KeyError(key)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.spec} {self.state}>"


class Job(JobHandle):
    """A job enqueued with ``Client``: ``job.result(timeout=10)`` waits for its result."""

    __slots__ = ("_client",)

    def __init__(self, client: Client, view: dict[str, Any], created: bool) -> None:
        super().__init__(view, created)
        self._client = client

    def result(self, timeout: float | None = None) -> Any:
        """As ``Client.wait``: the job's result once it completes."""
        return self._client.wait(self.id, timeout=timeout)

    def refresh(self) -> Job:
        """Read the job again (its state, attempt, progress, ...); returns itself."""
        self.view = self._client.job(self.id)
        return self


DEFAULT_URL = "http://127.0.0.1:8000"


def given_urls(url: object) -> list[str]:
    """The base URLs a client is given: ``url``, one or a list; None for ROTA_URL's (one,
    or several separated by commas, as the CLI reads it), else DEFAULT_URL (an unset
    ``os.environ.get("ROTA_URL")`` passed on means the default too). TypeError for a
    value of another type, named."""
    if url is None:
        env = os.environ.get("ROTA_URL", "")
        return [part.strip() for part in env.split(",") if part.strip()] or [DEFAULT_URL]
    if isinstance(url, str):
        return [url]
    if isinstance(url, Sequence) and all(isinstance(u, str) for u in url):
        return list(url)
    raise TypeError(f"url must be a server's base URL (a str), a list of them, or None (then"
                    f" ROTA_URL, else {DEFAULT_URL}), not {type(url).__name__}")


def given_token(token: object) -> str | None:
    """The bearer token a client sends: ``token``; None for ROTA_TOKEN's, as the CLI
    reads it ("" for none at all). TypeError for a value of another type, named."""
    if token is None:
        return os.environ.get("ROTA_TOKEN") or None
    if isinstance(token, str):
        return token or None
    raise TypeError(f"token must be a str, or None (then ROTA_TOKEN), not"
                    f" {type(token).__name__}")


class Failover:
    """The base URLs of servers that share one database, for a producer client, and the
    one its requests go to. A connection error (and only that: an HTTP error answer is
    the database's word, the same on every server) moves it to the next URL, for this
    request when that is safe (``again``) and for the ones after it."""

    def __init__(self, url: str | Sequence[str] | None) -> None:
        given = given_urls(url)
        if not given:
            raise ApiError(None, "bad_url", "no server URL given (give the server's base URL,"
                           " such as http://127.0.0.1:8000)")
        self.urls = list(dict.fromkeys(u.rstrip("/") for u in given))
        for u in self.urls:
            if (error := dashboard_url(u)) is not None:
                raise error
        self.index = 0

    @property
    def url(self) -> str:
        return self.urls[self.index]

    @property
    def where(self) -> str:
        """The servers, as an error names them."""
        return self.url if len(self.urls) == 1 else "any of " + ", ".join(self.urls)

    def round(self) -> list[int]:
        """Each server once, from the one in use now."""
        return [(self.index + step) % len(self.urls) for step in range(len(self.urls))]

    def failed(self, index: int) -> None:
        # Only if no other request has moved on already: two requests that fail at once
        # on one dead server must not skip the next one.
        if index == self.index:
            self.index = (index + 1) % len(self.urls)

    def gave_up(self, last: ApiError, exc: BaseException, method: str) -> ApiError:
        """The error of a request that every server failed, ``last`` the last one's."""
        return transport_error(self.where, exc, connected=last.code != "unreachable",
                               method=method, probe=False)

    @staticmethod
    def again(method: str, error: ApiError) -> bool:
        """Whether a request that failed so may go to the next server: if it never
        reached the first, or if it means the same thing twice. Any other may have been
        carried out (an enqueue with no id would be stored twice): its caller decides."""
        return error.code == "unreachable" or (error.code == "no_answer" and method in IDEMPOTENT)


class Client(Workflows, ScheduleCalls, SecretCalls, WebhookCalls):
    """A synchronous client for the Rota API, for producers (a web app's request handlers,
    scripts) and the CLI. It keeps one HTTP/1.1 connection alive; it is not thread-safe,
    so give each thread its own (they are cheap). ``token``: a bearer token (a producer
    token is enough to enqueue and read its own jobs); ``timeout``: seconds for a request
    to be answered; ``max_wait``: the longest single long poll (the server's
    ``max_result_wait``). Failed requests raise ``ApiError``. ``url`` may be a list: the
    base URLs of servers that share one database, used in turn (``Failover``). Left out,
    ``url`` is ROTA_URL's (else http://127.0.0.1:8000), ``token`` ROTA_TOKEN's, as for the CLI.

        with Client("http://127.0.0.1:8000", token=token) as client:
            job = client.enqueue("send_email", {"to": "ada@example.com"})
            print(job.id, job.state, job.result(timeout=30))
    """

    def __init__(self, url: str | Sequence[str] | None = None, *,
                 token: str | None = None, timeout: float = 30.0,
                 max_wait: float = MAX_WAIT) -> None:
        self.servers = Failover(url)
        self.max_wait = max_wait
        token = given_token(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # One connection per server, every URL checked now (bad_url before any request).
        self._transports = [Transport(u, timeout=timeout, headers=headers)
                            for u in self.servers.urls]

    @property
    def url(self) -> str:
        """The base URL of the server requests go to now."""
        return self.servers.url

    def close(self) -> None:
        for transport in self._transports:
            transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, *, json: Any = None,
              params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        body = None if json is None else msgspec.json.encode(json)
        status, content = self._request(method, path, body, params, timeout)
        try:
            answer = msgspec.json.decode(content) if content else {}
        except msgspec.DecodeError:
            answer = None  # not JSON: a proxy's page, or uvicorn's own 503
        if status >= 300:
            raise refusal(status, answer, content, token=self._transports[0].token,
                          url=self.url)
        if not isinstance(answer, dict):  # (every answer of the API is a JSON object)
            raise (not_the_api(self.url, status, content)
                   or ApiError(status, "http_error", "not an answer of Rota's API (a JSON"
                               f" object): {content[:200]!r}"))
        return answer

    def _request(self, method: str, path: str, body: bytes | None,
                 params: dict[str, Any] | None, timeout: float | None) -> tuple[int, bytes]:
        """One request, on the next server too when the one in use cannot be reached."""
        failure: tuple[ApiError, BaseException] | None = None
        for index in self.servers.round():
            transport = self._transports[index]
            try:
                return transport.request(method, path, body=body, params=params,
                                         timeout=timeout)
            except (OSError, http.client.HTTPException) as exc:
                error = transport_error(transport.url, exc, connected=transport.connected,
                                        method=method)
                self.servers.failed(index)
                if not self.servers.again(method, error):
                    raise error from exc
                failure = (error, exc)
        assert failure is not None  # (a round has one server at least)
        raise self.servers.gave_up(*failure, method) from failure[1]

    def enqueue(self, spec: str, args: dict[str, Any] | None = None, **options: Any) -> Job:
        """Enqueue a job of ``spec`` with ``args``; returned once it is committed.
        Options: id (the same id again is the same job, so a retried enqueue is safe),
        queue, priority, run_at, delay, ttl, visibility_timeout, max_attempts, max_fails
        (None means the spec's default), capture_logs, new_queue (queue is meant
        new, even spelt like a known one), concurrency_key (the key per-key limits count
        it under), labels (worker labels it requires, beside its spec's), unique (a dict
        or ``UniqueOptions``: an enqueue whose key a job holds gets that job, ``created``
        False, by default) or its shorthand unique_key="K"."""
        body: dict[str, Any] = {"spec": spec, "args": args or {}}
        body.update({key: value for key, value in unique_option(options).items()
                     if value is not None})
        answer = self._call("POST", "/jobs", json=body)
        return Job(self, answer["job"], answer["created"])

    def wait(self, job_id: str, *, timeout: float | None = None) -> Any:
        """The job's result once it completes, long-polling the server (None: no time
        limit). Raises ``JobError`` if it ended discarded or cancelled, ``ResultTimeout``
        if it has not finished within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reply = self.result(job_id, wait=poll_wait(deadline, self.max_wait))
            if reply["done"]:
                return outcome(reply)
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(job_id, reply["state"], timeout or 0.0)

    def enqueue_batch(self, jobs: list[dict[str, Any]]) -> dict[str, Any]:
        """One ``POST /jobs/batch`` (one transaction): ``{"results": [...]}``, a status
        and a job or an error for each, in order."""
        return self._call("POST", "/jobs/batch", json={"jobs": jobs})

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel the job (a running one through its worker); its view."""
        return self._call("DELETE", f"/jobs/{path_segment(job_id)}")

    def retry(self, job_id: str) -> dict[str, Any]:
        """Put a discarded or cancelled job back, with a fresh budget; its view."""
        return self._call("POST", f"/jobs/{path_segment(job_id)}/retry")

    def job(self, job_id: str) -> dict[str, Any]:
        """The job's view, as ``GET /jobs/{id}`` gives it."""
        return self._call("GET", f"/jobs/{path_segment(job_id)}")

    def result(self, job_id: str, *, wait: float = 0) -> dict[str, Any]:
        """One ``GET /jobs/{id}/result?wait=``: ``{id, state, done, result, error}``,
        within ``wait`` seconds (at most the server's max_result_wait). ``wait()`` is
        the loop most callers want."""
        return self._call("GET", f"/jobs/{path_segment(job_id)}/result",
                          params={"wait": wait}, timeout=wait + 30)

    def push_specs(self, specs: list[JobSpec], *, dry_run: bool = False) -> dict[str, Any]:
        body = {"specs": [msgspec.to_builtins(s) for s in specs], "dry_run": dry_run}
        return self._call("PUT", "/specs", json=body)

    def specs(self) -> dict[str, Any]:
        return self._call("GET", "/specs")

    def retire_spec(self, name: str, *, cancel_waiting: bool = False) -> dict[str, Any]:
        return self._call("POST", f"/specs/{path_segment(name)}/retire",
                          json={"cancel_waiting": cancel_waiting})

    def spec_history(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/specs/{path_segment(name)}/history")

    def workers(self) -> dict[str, Any]:
        return self._call("GET", "/workers")

    def direct(self, state: str, *, worker_id: str | None = None, label: str | None = None,
               every: bool = False) -> dict[str, Any]:
        """Ask one worker (by id), every worker with a label, or all, to change state."""
        if worker_id is not None:
            return self._call("POST", f"/workers/{path_segment(worker_id)}/state",
                              json={"state": state})
        body: dict[str, Any] = {"state": state, "all": every}
        if label is not None:
            body["label"] = label
        return self._call("POST", "/workers/state", json=body)

    def queues(self) -> dict[str, Any]:
        return self._call("GET", "/queues")

    def pause_queue(self, name: str, *, paused: bool = True) -> dict[str, Any]:
        """Pause a queue (it keeps its jobs and assigns none) or resume it (admin)."""
        action = "pause" if paused else "resume"
        return self._call("POST", f"/queues/{path_segment(name)}/{action}")

    def limits(self) -> dict[str, Any]:
        """``GET /limits`` (admin): every flow-control limit in force, and its source."""
        return self._call("GET", "/limits")

    def set_limit(self, kind: str, name: str, rule: dict[str, Any]) -> dict[str, Any]:
        """Set a queue's or spec's limits (``kind`` "queue" or "spec") at runtime: ``rule``
        has concurrency, rate ("100/min" or {limit, period, burst}), key_concurrency,
        key_rate. They replace its spec file's until ``clear_limit``, and its rule set at
        runtime before, whole (``rota limits set`` merges first)."""
        path = f"/limits/{path_segment(kind)}/{path_segment(name)}"
        return self._call("PUT", path, json=rule)

    def clear_limit(self, kind: str, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/limits/{path_segment(kind)}/{path_segment(name)}")

    def list_jobs(self, *, states: tuple[str, ...] | list[str] = (), spec: str | None = None,
                  queue: str | None = None, worker: str | None = None, q: str | None = None,
                  limit: int = 50, cursor: str | None = None, schedule: str | None = None
                  ) -> dict[str, Any]:
        """One page of ``GET /jobs`` (admin), newest first: ``{"jobs": [...],
        "next_cursor"}``; pass ``next_cursor`` back as ``cursor`` for the next page."""
        params = {"state": ",".join(states), "spec": spec, "queue": queue, "worker": worker,
                  "schedule": schedule, "q": q, "limit": limit, "cursor": cursor}
        return self._call("GET", "/jobs", params={k: v for k, v in params.items() if v})

    def bulk(self, action: str, *, ids: list[str] | None = None,
             filter: dict[str, Any] | None = None, dry_run: bool = False,
             limit: int | None = None) -> dict[str, Any]:
        """``POST /jobs/retry`` or ``/jobs/cancel`` (admin) of these ids or of the jobs that
        match ``filter`` (``GET /jobs``'s; ``state`` a list), at most ``limit`` (None: the
        server's cap): how many matched and were touched, the first ids, why others not."""
        body: dict[str, Any] = {"dry_run": dry_run}
        if ids is not None:
            body["ids"] = ids
        if filter is not None:
            body["filter"] = filter
        if limit is not None:
            body["limit"] = limit
        return self._call("POST", f"/jobs/{action}", json=body)

    def stats(self, minutes: int = 60) -> dict[str, Any]:
        """``GET /stats`` (admin): per-minute counts per queue and spec, and the age of
        each queue's oldest available job."""
        return self._call("GET", "/stats", params={"minutes": minutes})

    def create_token(self, scope: str, *, name: str | None = None,
                     queues: list[str] | None = None) -> dict[str, Any]:
        """A new token (admin): ``token`` in the answer is its secret, shown this once."""
        body: dict[str, Any] = {"scope": scope, "name": name, "queues": queues}
        return self._call("POST", "/tokens",
                          json={key: value for key, value in body.items() if value is not None})

    def tokens(self) -> dict[str, Any]:
        return self._call("GET", "/tokens")

    def revoke_token(self, id_or_name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/tokens/{path_segment(id_or_name)}")
