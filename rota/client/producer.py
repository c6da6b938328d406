"""An asyncio producer client whose concurrent enqueues share requests.

Many tasks enqueueing at once (a web app's request handlers, say) would each pay a whole
HTTP round trip and a whole commit on the server. Here ``enqueue()`` calls are coalesced
the way Nagle's algorithm coalesces small TCP segments: a call made while no request is
in flight leaves at once, alone; calls made while requests are in flight wait for one of
them to come back and then leave together, as one ``POST /jobs/batch``. At low load
nothing waits; under load the batches grow with the server's round trip. Each caller is
still answered only after its own job is committed, since the server answers a batch
after its commit, and a job the server refuses fails only its own caller.

Each caller gets an ``AsyncJob`` handle, whose ``await job.result(timeout=)`` long-polls
for the result as ``Client.wait`` does.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from rota.client.client import MAX_WAIT, ApiError, Failover, JobHandle, ResultTimeout, \
    given_token, outcome, poll_wait
from rota.client.failures import not_the_api, refusal, transport_error
from rota.client.flowing import AsyncWorkflows
from rota.client.schedules import AsyncScheduleCalls
from rota.base.ids import path_segment
from rota.base.tls import default_trust
from rota.base.unique import unique_option

# A batch is cut before its body reaches this (the server refuses bodies over 1 MiB by
# default); a single job larger than that goes alone and gets its own 413.
BATCH_BYTES = 512 * 1024


@dataclass(slots=True)
class _Waiting:
    body: bytes  # the job's enqueue request, as JSON
    answer: asyncio.Future[dict[str, Any]]


class AsyncJob(JobHandle):
    """A job enqueued with ``AsyncClient``: ``await job.result(timeout=10)`` waits for its
    result."""

    __slots__ = ("_client",)

    def __init__(self, client: AsyncClient, view: dict[str, Any], created: bool) -> None:
        super().__init__(view, created)
        self._client = client

    async def result(self, timeout: float | None = None) -> Any:
        """As ``AsyncClient.wait``: the job's result once it completes."""
        return await self._client.wait(self.id, timeout=timeout)

    async def refresh(self) -> AsyncJob:
        """Read the job again (its state, attempt, progress, ...); returns itself."""
        self.view = await self._client.job(self.id)
        return self


class AsyncClient(AsyncWorkflows, AsyncScheduleCalls):
    """An asyncio client for the Rota API, for producers where many tasks enqueue at
    once (an async web app): concurrent ``enqueue()`` calls share requests (see the
    module's docstring). It belongs to the event loop it is first used in. ``token``: a
    bearer token; ``timeout``: seconds for a request to be answered; ``max_batch``: jobs
    per batch request; ``max_in_flight``: enqueue requests at once; ``max_wait``: the
    longest single long poll (the server's ``max_result_wait``). Failed requests raise
    ``ApiError``. ``url`` may be a list: the base URLs of servers that share one
    database, used in turn, as ``Client`` does (``rota.client.client.Failover``); left
    out, ``url`` and ``token`` are ROTA_URL's and ROTA_TOKEN's, as for ``Client``.

        async with AsyncClient("http://127.0.0.1:8000", token=token) as client:
            job = await client.enqueue("send_email", {"to": "ada@example.com"})
            print(job.id, job.state, await job.result(timeout=30))
    """

    def __init__(self, url: str | Sequence[str] | None = None, *,
                 token: str | None = None, timeout: float = 30.0, max_batch: int = 1000,
                 max_in_flight: int = 1, max_wait: float = MAX_WAIT) -> None:
        if not 1 <= max_batch <= 10_000:
            raise ValueError("max_batch must be 1 to 10,000 (the server's limit per batch)")
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.servers = Failover(url)
        token = given_token(token)
        self.max_batch = max_batch
        self.max_in_flight = max_in_flight
        self.max_wait = max_wait
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._token = bool(token)
        self._https = [httpx.AsyncClient(base_url=base, timeout=timeout, headers=headers,
                                         limits=httpx.Limits(max_connections=max_in_flight + 4),
                                         verify=default_trust())
                       for base in self.servers.urls]  # a pool per server
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # the one it belongs to
        self._closed = False
        self.requests = 0  # enqueue requests sent: how well calls were coalesced

    @property
    def url(self) -> str:
        """The base URL of the server requests go to now."""
        return self.servers.url

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Send what is waiting, wait for every answer, then close the connections."""
        self._closed = True
        while self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
            # A task leaves _in_flight in its done callback (_sent), and a gather of
            # tasks that have all finished returns without yielding (Python 3.12+): let
            # the loop turn once, or this spins.
            await asyncio.sleep(0)
        for http in self._https:
            await http.aclose()

    def _check_usable(self, *, new_work: bool = True) -> None:
        # Its connections belong to one event loop; after aclose() it takes no new work
        # (what was waiting still goes). Said plainly here rather than as whatever httpx
        # raises from deep inside.
        if new_work and self._closed:
            raise ApiError(None, "client_closed", "this AsyncClient is closed; make a new one"
                           " (or use it inside 'async with AsyncClient(...)')")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise ApiError(None, "client_error", "an AsyncClient belongs to the event loop it"
                           " was first used in; make one per asyncio.run()")

    # -- enqueueing -------------------------------------------------------------------
    async def enqueue(self, spec: str, args: dict[str, Any] | None = None, **options: Any
                      ) -> AsyncJob:
        """As ``Client.enqueue``: the job's handle once it is committed, or ``ApiError``
        with the status and code that ``POST /jobs`` would have given it alone."""
        self._check_usable()
        request: dict[str, Any] = {"spec": spec, "args": args or {}}
        request.update({key: value for key, value in unique_option(options).items()
                        if value is not None})
        waiting = _Waiting(msgspec.json.encode(request),
                           asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        self._pump()
        # A caller that gives up stops waiting; its job may still be stored.
        answer = await waiting.answer
        return AsyncJob(self, answer["job"], answer["created"])

    async def enqueue_batch(self, jobs: list[dict[str, Any]]) -> dict[str, Any]:
        """One ``POST /jobs/batch`` as given: ``{"results": [...]}``."""
        return await self._call("POST", "/jobs/batch", content=msgspec.json.encode({"jobs": jobs}))

    def _pump(self) -> None:
        while self._waiting and len(self._in_flight) < self.max_in_flight:
            batch = [self._waiting.popleft()]
            size = len(batch[0].body)
            while (self._waiting and len(batch) < self.max_batch
                   and size + len(self._waiting[0].body) < BATCH_BYTES):
                batch.append(self._waiting.popleft())
                size += len(batch[-1].body) + 1
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._pump()

    async def _send(self, batch: list[_Waiting]) -> None:
        self.requests += 1
        try:
            if len(batch) == 1:  # alone: the plain route answers in the caller's own shape
                _settle(batch[0], await self._call("POST", "/jobs", content=batch[0].body,
                                                   queued=True))
                return
            content = b'{"jobs":[' + b",".join(w.body for w in batch) + b"]}"
            answer = await self._call("POST", "/jobs/batch", content=content, queued=True)
        except ApiError as exc:
            for waiting in batch:
                _fail(waiting, exc)
            return
        except asyncio.CancelledError:  # nobody may wait forever
            for waiting in batch:
                _fail(waiting, ApiError(None, "client_error", "enqueue cancelled (the client"
                                        " is closing); it may have been stored"))
            raise
        except Exception as exc:  # a bug: each caller hears it, and the task ends cleanly
            for waiting in batch:
                _fail(waiting, ApiError(None, "client_error", f"enqueue not sent: {exc!r}"))
            return
        for waiting, item in zip(batch, answer["results"], strict=True):
            if "error" in item:
                error = item["error"]
                _fail(waiting, ApiError(item["status"], error["code"], error["message"]))
            else:
                _settle(waiting, {"job": item["job"], "created": item["created"]})

    # -- the rest of the API ------------------------------------------------------------
    async def job(self, job_id: str) -> dict[str, Any]:
        """The job's view, as ``GET /jobs/{id}`` gives it."""
        return await self._call("GET", f"/jobs/{path_segment(job_id)}")

    async def wait(self, job_id: str, *, timeout: float | None = None) -> Any:
        """The job's result once it completes, long-polling the server (None: no time
        limit). Raises ``JobError`` if it ended discarded or cancelled, ``ResultTimeout``
        if it has not finished within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reply = await self.result(job_id, wait=poll_wait(deadline, self.max_wait))
            if reply["done"]:
                return outcome(reply)
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(job_id, reply["state"], timeout or 0.0)

    async def result(self, job_id: str, *, wait: float = 0) -> dict[str, Any]:
        """One ``GET /jobs/{id}/result?wait=``: ``{id, state, done, result, error}``;
        ``wait()`` is the loop most callers want."""
        return await self._call("GET", f"/jobs/{path_segment(job_id)}/result",
                                params={"wait": wait}, timeout=wait + 30)

    async def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel the job (a running one through its worker); its view."""
        return await self._call("DELETE", f"/jobs/{path_segment(job_id)}")

    async def retry(self, job_id: str) -> dict[str, Any]:
        """Put a discarded or cancelled job back, with a fresh budget; its view."""
        return await self._call("POST", f"/jobs/{path_segment(job_id)}/retry")

    async def _call(self, method: str, path: str, *, content: bytes | None = None,
                    params: dict[str, Any] | None = None, timeout: float | None = None,
                    queued: bool = False) -> Any:
        """One request. ``queued``: it carries enqueues taken before aclose(), which
        still go."""
        self._check_usable(new_work=not queued)
        headers = {"Content-Type": "application/json"} if content is not None else None
        response = await self._request(method, path, content, params, headers, timeout)
        try:
            body = msgspec.json.decode(response.content) if response.content else {}
        except msgspec.DecodeError:
            body = None
        status, url = response.status_code, self.url
        if status >= 300:
            raise refusal(status, body, response.content, token=self._token, url=url)
        if not isinstance(body, dict):  # (every answer of the API is a JSON object)
            raise (not_the_api(url, status, response.content) or ApiError(
                status, "http_error", "not an answer of Rota's API (a JSON object):"
                f" {response.content[:200]!r}"))
        return body


    async def _request(self, method: str, path: str, content: bytes | None,
                       params: dict[str, Any] | None, headers: dict[str, str] | None,
                       timeout: float | None) -> httpx.Response:
        """One request, on the next server too when the one in use cannot be reached."""
        failure: tuple[ApiError, BaseException, httpx.TransportError] | None = None
        for index in self.servers.round():
            try:
                return await self._https[index].request(
                    method, path, content=content, params=params, headers=headers,
                    timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
            except httpx.TransportError as exc:
                connected = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout
                                           | httpx.UnsupportedProtocol)
                cause = TimeoutError(str(exc)) if isinstance(exc, httpx.TimeoutException) else exc
                # (the probe for a TLS server blocks: off the loop)
                error = await asyncio.to_thread(transport_error, self.servers.urls[index],
                                                cause, connected=connected, method=method)
                self.servers.failed(index)
                if not self.servers.again(method, error):
                    raise error from exc
                failure = (error, cause, exc)
        assert failure is not None  # (a round has one server at least)
        raise self.servers.gave_up(failure[0], failure[1], method) from failure[2]


def _settle(waiting: _Waiting, value: dict[str, Any]) -> None:
    if not waiting.answer.done():  # its caller may have given up
        waiting.answer.set_result(value)


def _fail(waiting: _Waiting, error: ApiError) -> None:
    if not waiting.answer.done():
        waiting.answer.set_exception(error)
