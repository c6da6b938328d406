"""An operator's directive to workers (go quiet, terminate, resume), one behaviour for the
API (``POST /workers/...``) and the dashboard's forms: the ``Coordinator`` inherits this
mixin. On a database several servers share (docs/scaling.md), a directive is passed on
to the servers that hold the workers it names (``Store.tell_servers``; rota/server/cluster.py
applies it there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rota.base.errors import Conflict
from rota.core.endpoints import is_endpoint
from rota.core.engine import Engine
from rota.core.model import Instant
from rota.core.registry import ConnectedWorker
from rota.store.store import Store
from rota.core.verdicts import directive_refusal, directive_target


@dataclass(frozen=True)
class Directed:
    """What a directive did: the workers of this server told (for one worker named, that
    one, also when it was in that state already), and whether the other servers on the
    database were told too."""

    workers: list[str]
    forwarded: bool


class ShellDirectives:
    """A mixin of the ``Coordinator``."""

    if TYPE_CHECKING:
        store: Store

        @property
        def connections(self) -> dict[str, ConnectedWorker]: ...

        engine: Engine
        clock: Callable[[], Instant]

    def direct(self, worker_ids: Iterable[str], state: str) -> list[str]:
        """Tell these workers (never an endpoint: docs/push.md) to be in ``state``."""
        worker_ids = [w for w in worker_ids if w not in self.engine.endpoints]
        directed = self.engine.registry.direct(worker_ids, state)
        wall = self.clock().wall
        for worker_id in directed:
            self.engine.observe.event(wall, "worker_state", worker=worker_id, state=state)
        return directed

    def select_workers(self, *, label: str | None = None, every: bool = False) -> list[str]:
        return self.engine.registry.select(label=label, every=every)

    async def direct_workers(self, state: str, *, worker_id: str | None = None,
                             label: str | None = None, every: bool = False) -> Directed:
        """Ask the worker ``worker_id``, or every worker with ``label``, or all of them
        (``every``), to be in ``state``: they hear it in their next ack. NotFound if the
        named worker is connected to no server; Conflict if it cannot go back to
        ``state`` (never from terminate)."""
        if worker_id is not None:
            return await self._direct_one(worker_id, state)
        directed = self.direct(self.select_workers(label=label, every=every), state)
        shared = self.store.shared
        if shared:  # the workers of the other servers on this database too
            await self.store.tell_servers(
                state, directive_target(label=None if every else label or ""))
        return Directed(directed, forwarded=shared)

    async def _direct_one(self, worker_id: str, state: str) -> Directed:
        conn = self.connections.get(worker_id)
        if conn is None:
            if self.store.shared and await self.store.connected_somewhere(worker_id):
                # Connected to another server on this database: that server passes it on.
                await self.store.tell_servers(state, directive_target(worker_id=worker_id))
                return Directed([worker_id], forwarded=True)
        if conn is not None and is_endpoint(worker_id):
            raise Conflict("push_endpoint", f"{worker_id} is a push endpoint, not a worker"
                           " process: it takes no directive (pause its queue instead)")
        current = None if conn is None else conn.worker.state
        directed = conn is not None and bool(self.direct([worker_id], state))
        refusal = directive_refusal(worker_id, state, current, directed)
        if refusal is not None:
            raise refusal
        return Directed([worker_id], forwarded=False)
