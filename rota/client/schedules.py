"""The cron schedule calls of ``Client`` and ``AsyncClient`` (admin): list, show, add or
replace, pause, resume and delete schedules, and a push of specs with schedules."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from rota.base.ids import path_segment
from rota.base.specs import JobSpec


class ScheduleCalls:
    """Mixed into ``Client``: each is one request of the schedules API."""

    def _call(self, method: str, path: str, *, json: Any = None,
              params: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        raise NotImplementedError  # (Client's)

    def push_deploy(self, specs: list[JobSpec], schedules: Sequence[dict[str, Any]] = (), *,
                    dry_run: bool = False) -> dict[str, Any]:
        """``PUT /specs`` with the directory's schedules (``[[schedule]]`` tables)."""
        body = {"specs": [msgspec.to_builtins(s) for s in specs], "dry_run": dry_run,
                "schedules": list(schedules)}
        return self._call("PUT", "/specs", json=body)

    def schedules(self) -> dict[str, Any]:
        """``GET /schedules``: every schedule, with its last run and next fire times."""
        return self._call("GET", "/schedules")

    def schedule(self, name: str) -> dict[str, Any]:
        return self._call("GET", f"/schedules/{path_segment(name)}")

    def put_schedule(self, name: str, definition: dict[str, Any]) -> dict[str, Any]:
        """Add or replace schedule ``name``: ``{"schedule": view, "change": ...}``."""
        return self._call("PUT", f"/schedules/{path_segment(name)}", json=definition)

    def pause_schedule(self, name: str, *, paused: bool = True) -> dict[str, Any]:
        action = "pause" if paused else "resume"
        return self._call("POST", f"/schedules/{path_segment(name)}/{action}")

    def delete_schedule(self, name: str) -> dict[str, Any]:
        return self._call("DELETE", f"/schedules/{path_segment(name)}")


class AsyncScheduleCalls:
    """Mixed into ``AsyncClient``: the same calls as ``ScheduleCalls``, awaited."""

    __slots__ = ()
    _call: Callable[..., Any]

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        content = None if body is None else msgspec.json.encode(body)
        return await self._call(method, path, content=content)

    async def push_deploy(self, specs: list[JobSpec], schedules: Sequence[dict[str, Any]] = (),
                          *, dry_run: bool = False) -> dict[str, Any]:
        return await self._json("PUT", "/specs", {
            "specs": [msgspec.to_builtins(s) for s in specs], "dry_run": dry_run,
            "schedules": list(schedules)})

    async def schedules(self) -> dict[str, Any]:
        return await self._json("GET", "/schedules")

    async def schedule(self, name: str) -> dict[str, Any]:
        return await self._json("GET", f"/schedules/{path_segment(name)}")

    async def put_schedule(self, name: str, definition: dict[str, Any]) -> dict[str, Any]:
        return await self._json("PUT", f"/schedules/{path_segment(name)}", definition)

    async def pause_schedule(self, name: str, *, paused: bool = True) -> dict[str, Any]:
        action = "pause" if paused else "resume"
        return await self._json("POST", f"/schedules/{path_segment(name)}/{action}")

    async def delete_schedule(self, name: str) -> dict[str, Any]:
        return await self._json("DELETE", f"/schedules/{path_segment(name)}")
