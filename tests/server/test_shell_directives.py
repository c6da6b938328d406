"""The one directive method the API and the dashboard call (rota/server/shell_directives.py),
without a server: the real worker registry, and a store that records the notices it would
send the other servers. (tests/system/test_cluster.py runs it on two servers and PostgreSQL.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest

from rota.base import protocol as p
from rota.base.errors import Conflict, NotFound
from rota.core.ready import WorkerSlot
from rota.core.registry import ConnectedWorker, Registry
from rota.server.shell_directives import ShellDirectives


class Store:
    def __init__(self, shared: bool, elsewhere: Iterable[str] = ()) -> None:
        self.shared = shared
        self.elsewhere = set(elsewhere)  # workers connected to other servers
        self.told: list[tuple[str, str]] = []

    async def connected_somewhere(self, worker_id: str) -> bool:
        return worker_id in self.elsewhere

    def tell_servers(self, state: str, target: str) -> asyncio.Future[None]:
        self.told.append((state, target))
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


class Shell(ShellDirectives):
    """The part of the Coordinator the mixin uses."""

    def __init__(self, store: Store, workers: dict[str, list[str]]) -> None:
        self.store = store  # type: ignore[assignment]
        self.registry = Registry()
        for n, (worker_id, labels) in enumerate(workers.items()):
            reg = p.Registration(hostname="h", os="linux", pid=1, sdk="t", queues=["q"],
                                 concurrency=1, specs=[], labels=labels)
            slot = WorkerSlot(worker_id, ["q"], 1, {}, labels)
            self.registry.connections[worker_id] = ConnectedWorker(n, slot, reg, 0.0, 0.0)

    @property
    def connections(self) -> dict[str, ConnectedWorker]:
        return self.registry.connections

    def direct(self, worker_ids: Iterable[str], state: str) -> list[str]:
        return self.registry.direct(worker_ids, state)

    def select_workers(self, *, label: str | None = None, every: bool = False) -> list[str]:
        return self.registry.select(label=label, every=every)


WORKERS = {"a": ["eu"], "b": ["us"], "c": ["eu"]}


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared"])
async def test_by_label_tells_this_servers_workers_and_on_a_shared_store_the_others(shared):
    shell = Shell(Store(shared), WORKERS)
    done = await shell.direct_workers("quiet", label="eu")
    assert (done.workers, done.forwarded) == (["a", "c"], shared)
    assert {w: c.worker.state for w, c in shell.connections.items()} == {
        "a": "quiet", "b": "running", "c": "quiet"}
    assert shell.store.told == ([("quiet", "label=eu")] if shared else [])
    every = await shell.direct_workers("terminate", every=True)
    assert every.workers == ["a", "b", "c"]
    assert shell.store.told[1:] == ([("terminate", "all")] if shared else [])


async def test_a_label_is_quoted_in_the_notice():
    shell = Shell(Store(True), {"a": ["eu west"]})
    await shell.direct_workers("quiet", label="eu west")
    assert shell.store.told == [("quiet", "label=eu%20west")]


async def test_one_worker_here_is_told_here_and_its_state_again_is_no_error():
    shell = Shell(Store(True), WORKERS)
    for _ in range(2):
        done = await shell.direct_workers("quiet", worker_id="b")
        assert (done.workers, done.forwarded) == (["b"], False)
    assert shell.connections["b"].directive == "quiet" and shell.store.told == []


async def test_one_worker_on_another_server_is_passed_on_and_one_nowhere_is_not_found():
    shell = Shell(Store(True, elsewhere=["x/1"]), WORKERS)
    done = await shell.direct_workers("quiet", worker_id="x/1")
    assert (done.workers, done.forwarded) == (["x/1"], True)
    assert shell.store.told == [("quiet", "id=x/1")]
    with pytest.raises(NotFound, match="no connected worker y"):
        await shell.direct_workers("quiet", worker_id="y")
    alone = Shell(Store(False, elsewhere=["x/1"]), WORKERS)  # SQLite: no other server
    with pytest.raises(NotFound):
        await alone.direct_workers("quiet", worker_id="x/1")


async def test_no_way_back_from_terminate():
    shell = Shell(Store(False), WORKERS)
    await shell.direct_workers("terminate", worker_id="a")
    with pytest.raises(Conflict, match="worker a is terminating; it cannot go back to quiet"):
        await shell.direct_workers("quiet", worker_id="a")
    with pytest.raises(Conflict) as refused:
        await shell.direct_workers("running", worker_id="a")
    assert refused.value.code == "invalid_transition"
