"""A real server and real SDK workers for driving the dashboard from a synchronous
browser (Playwright's sync API): the server runs on an event loop in a thread of its own
(``ThreadedServer``), each worker on another. Used by tests/ui/test_ui.py and
tests/screenshots.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from conftest import ThreadedServer, write_spec
from helpers import set_limits

from rota.base.specs import JobSpec
from rota.worker.worker import Worker

CHROMIUM = "/usr/bin/chromium"  # Debian's package; scripts/test installs it when missing


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's chromium driven by Playwright's sync API (a test module's browser); the
    test fails, saying what to install, if it is missing."""
    import pytest
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"no {CHROMIUM}: apt-get install chromium (scripts/test does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


class Rig:
    """One server, an admin token (unless ``open``), specs pushed, workers on demand."""

    def __init__(self, tmp: Path, *, open: bool = False, **settings: Any) -> None:
        self.tmp = tmp
        self.server = ThreadedServer(tmp, **settings)
        self.live = self.server.live
        self.token: str | None = None
        if not open:
            self.token, _ = self.run(self.coordinator.create_token("admin", "ui-test", None))
        self.workers: list[tuple[Worker, threading.Thread, asyncio.AbstractEventLoop]] = []

    @property
    def coordinator(self) -> Any:
        return self.live.coordinator

    @property
    def base(self) -> str:
        return self.live.base

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the server's loop (the API client lives there too)."""
        return self.server._run(coro)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.run(self.live.http.request(method, path, headers=self.auth(), **kwargs))
        assert response.status_code < 300, response.text
        return response.json()

    def spec(self, name: str, **options: Any) -> JobSpec:
        spec = write_spec(self.tmp / "specs", name, **options)
        self.api("PUT", "/specs", json={"specs": [msgspec.to_builtins(spec)]})
        return spec

    def enqueue(self, spec: str, args: dict[str, Any] | None = None, **extra: Any) -> str:
        body = {"spec": spec, "args": args or {}, **extra}
        job_id: str = self.api("POST", "/jobs", json=body)["job"]["id"]
        return job_id

    def limits(self, rules: dict[tuple[str, str], Any]) -> None:
        """Put ``rules`` in force (tests/helpers.py set_limits: PUT /limits)."""
        self.run(set_limits(self.live.http, rules, self.auth()))

    def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self.api("GET", f"/jobs/{job_id}")
        return job

    def worker(self, handlers: dict[str, Callable[..., Any]], *, cls: type[Worker] = Worker,
               **options: Any) -> Worker:
        """Start an SDK worker (of class ``cls``) on a loop of its own and wait until it is
        connected."""
        options.setdefault("specs_dir", self.tmp / "specs")
        worker = cls(url=self.live.ws, handle_signals=False, token=self.token, **options)
        for name, handler in handlers.items():
            worker.handler(name)(handler)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_until_complete, args=(worker.run(),),
                                  daemon=True)
        thread.start()
        self.workers.append((worker, thread, loop))
        self.wait(lambda: worker.worker_id in self.coordinator.connections, "worker connects")
        return worker

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
        """Poll ``predicate`` from this thread (it may call ``run``) until it holds."""
        deadline = time.monotonic() + timeout
        while not (value := predicate()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.01)  # noqa: sleep-ok (a poll step bounded by the deadline)
        return value

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for worker, thread, loop in self.workers:
            loop.call_soon_threadsafe(worker.stop_now)
            thread.join(10)
            loop.close()
        self.server.close()



@contextlib.contextmanager
def filled(tmp: Path, fill: Callable[[Rig], Any]) -> Iterator[tuple[Rig, Any]]:
    """A rig and what ``fill`` put on it (ids worth a page): a module's shared server."""
    rig = Rig(tmp)
    try:
        yield rig, fill(rig)
    finally:
        rig.close()
