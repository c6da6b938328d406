"""Workflows as they run: what a step's ending changes, what is entered next, and a
workflow's cancel and retry (ojs-workflows §4-§9). Pure: rows are read through the
``Rows`` it is given and every change is returned in a ``Decision`` for the store to
write, in the transaction that commits the ending.

Each composite node counts down: ``remaining`` children not yet done, ``failed`` among
those done. An ending walks up from its job node, one row per level, and stops at the
first ancestor with children left, so a group of 10,000 costs O(depth) per job and its
callbacks fire exactly once, when its count reaches zero (the store holds the workflow
row locked meanwhile). Entering a subtree, or building a composite's result from its
children, reads those rows once. A batch counts its jobs, then (from its firing) its
fired callbacks. A running chain keeps on its row what its next step will be given, so
its steps cost O(1) rows each, not a read of all the steps before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec

from rota.base import protocol as p
from rota.base.errors import Conflict
from rota.core.jobs import error_record
from rota.core.workflow_defs import Node

STATES = ("pending", "running", "completed", "failed", "cancelled")  # a workflow's (OJS §8)
LIVE = ("pending", "running")  # those that still advance
OPEN = ("waiting", "pending", "active")  # a node's states before its end
MAX_LISTED = 100  # failed jobs named in a workflow's error (failed_count counts them all)
TOO_LARGE = "parent_results_too_large"


@dataclass(slots=True)
class NodeRow:
    """A node as its row holds it (rota/core/workflow_defs.py Node, and its progress)."""

    node: int
    parent: int | None
    end: int
    kind: str  # job | chain | group | batch
    position: int
    role: str | None = None
    state: str = "waiting"  # waiting pending active completed failed cancelled skipped
    job_id: str | None = None
    spec: str | None = None
    remaining: int = 0  # a composite's children not yet done
    failed: int = 0  # ... and those of its done children that failed
    # JSON, once completed; while a chain runs, what its next step will be given (its
    # steps' results so far over what it received), so a step costs O(1) rows
    result: bytes | None = None
    error: bytes | None = None  # a job node's failure: {"code", "message", "attempt"}
    parent_results: bytes | None = None  # what a composite received when entered


@dataclass(slots=True)
class Head:
    """The workflow row's fields that its progress changes."""

    id: str
    state: str = "running"
    completed_count: int = 0
    failed_count: int = 0
    finished_at: float | None = None
    error: bytes | None = None  # JSON: OJS §9.6's record, once failed


class Rows(Protocol):
    """A workflow's node rows as the transaction sees them."""

    def row(self, node: int) -> NodeRow: ...

    def span(self, first: int, last: int) -> list[NodeRow]: ...  # preorder

    def children(self, node: int) -> list[NodeRow]: ...  # by position


class ListRows:
    """Rows held in a list, in preorder (a new workflow's; all of one, for cancel/retry)."""

    def __init__(self, rows: list[NodeRow]) -> None:
        self.rows = rows

    def row(self, node: int) -> NodeRow:
        return self.rows[node]

    def span(self, first: int, last: int) -> list[NodeRow]:
        return self.rows[first:last + 1]

    def children(self, node: int) -> list[NodeRow]:
        found, child = [], node + 1
        while child <= self.rows[node].end:
            found.append(self.rows[child])
            child = self.rows[child].end + 1
        return found


class Ending(NamedTuple):
    """A job node's job reached a terminal state."""

    node: int
    state: str  # completed | discarded | cancelled
    result: bytes | None = None  # JSON, when completed
    error: bytes | None = None  # the job's error record (rota/core/jobs.py error_record)
    attempt: int = 0


@dataclass
class Decision:
    """What the store writes, in this order: rows; ``reset`` (finished jobs back to
    pending: held); then ``release`` (pending -> available, with their parent_results),
    ``discard`` (pending -> discarded, with the error) and ``cancel`` (pending ->
    cancelled). ``live`` are released jobs to cancel the ordinary way, after the commit."""

    head: Head
    rows: list[NodeRow] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)
    release: list[tuple[str, bytes]] = field(default_factory=list)
    discard: list[tuple[str, bytes]] = field(default_factory=list)
    cancel: list[str] = field(default_factory=list)
    live: list[str] = field(default_factory=list)


class Flow:
    """One workflow's rows as one transaction changes them."""

    def __init__(self, head: Head, rows: Rows, *, limit: int, now: float) -> None:
        self.head, self.limit, self.now = head, limit, now
        self.decision = Decision(head)
        self._rows = rows
        self._seen: dict[int, NodeRow] = {}
        self._changed: dict[int, None] = {}  # (ordered)
        self._queue: deque[Ending] = deque()
        self._failed_step: int | None = None

    # -- reading, through what this transaction already changed --------------------
    def row(self, node: int) -> NodeRow:
        if node not in self._seen:
            self._seen[node] = self._rows.row(node)
        return self._seen[node]

    def _mine(self, rows: list[NodeRow]) -> list[NodeRow]:
        return [self._seen.setdefault(r.node, r) for r in rows]

    def span(self, row: NodeRow) -> list[NodeRow]:
        return self._mine(self._rows.span(row.node, row.end)) if row.kind != "job" else [row]

    def children(self, row: NodeRow) -> list[NodeRow]:
        return self._mine(self._rows.children(row.node))

    def _touch(self, row: NodeRow, state: str | None = None) -> None:
        if state is not None:
            row.state = state
        self._seen.setdefault(row.node, row)
        self._changed[row.node] = None

    def done(self) -> Decision:
        """Every change made, for the store."""
        self._drain()
        self.decision.rows = [self._seen[node] for node in sorted(self._changed)]
        return self.decision

    # -- endings ---------------------------------------------------------------------
    def end(self, ending: Ending) -> None:
        """A job node's job ended: count it, and carry what follows up the tree."""
        self._queue.append(ending)
        self._drain()

    def _drain(self) -> None:
        while self._queue:
            self._settle(self._queue.popleft())

    def _settle(self, ending: Ending) -> None:
        if self.head.state not in LIVE:
            return  # cancelled (or finished): nothing advances any more
        row = self.row(ending.node)
        if row.kind != "job" or row.state != "pending":
            return  # counted already: each node ends once (a replay, a job retried by hand)
        if ending.state == "completed":
            row.result = ending.result if ending.result is not None else b"null"
            self._touch(row, "completed")
            self.head.completed_count += 1
        else:
            row.error = _failure(ending)
            self._touch(row, "failed" if ending.state == "discarded" else "cancelled")
            self.head.failed_count += 1
        self._up(row)

    def _up(self, child: NodeRow) -> None:
        """``child`` is done: tell its parent, which may be done in turn."""
        if child.parent is None:
            return self._close(child)
        parent = self.row(child.parent)
        ok = child.state == "completed"
        parent.remaining -= 1
        parent.failed += not ok
        self._touch(parent)
        if parent.kind == "chain":
            if not ok:  # §9.2: the chain fails; its later steps never run
                if parent.parent is None:
                    self._failed_step = child.position
                if child.end < parent.end:
                    self._drop(child.end + 1, parent.end)
                return self._finish(parent, failed=True)
            if parent.remaining:
                return self._enter(self.row(child.end + 1), self._chain_next(parent, child))
            parent.result = child.result
            return self._finish(parent, failed=False)
        if parent.kind == "batch" and child.role is None:
            if not parent.remaining:
                self._fire(parent)
            return None
        if not parent.remaining:  # a group's last child, or a batch's last fired callback
            self._finish(parent, failed=parent.failed > 0)
        return None

    def _finish(self, row: NodeRow, *, failed: bool) -> None:
        if failed:
            row.result = None  # (a chain's inputs so far: not a result)
            self._touch(row, "failed")
        else:
            if row.kind != "chain":
                row.result = _results(self.children(row))
            self._touch(row, "completed")
        self._up(row)

    def _fire(self, batch: NodeRow) -> None:
        """A batch's jobs are all done: fire its callbacks by the matrix (§6.5)."""
        kids = self.children(batch)
        jobs = [kid for kid in kids if kid.role is None]
        any_failed = any(kid.state != "completed" for kid in jobs)
        fire = {"on_complete", "on_failure" if any_failed else "on_success"}
        fired = [kid for kid in kids if kid.role in fire]
        todo = [kid for kid in fired if kid.state != "completed"]  # (a retry runs none twice)
        for kid in kids:
            if kid.role is not None and kid.role not in fire and kid.state != "completed":
                self._touch(kid, "skipped")
                self.decision.cancel.append(str(kid.job_id))
        if not todo:  # none fired, or all fired ran already (a retry): the jobs decide
            return self._finish(batch, failed=any_failed)
        # From here it counts its callbacks; a failed job fails it whatever they do (Rota's
        # rule, not OJS §8.3's: a batch that ran its on_failure has still failed).
        batch.remaining = len(todo)
        batch.failed = sum(kid.state != "completed" for kid in jobs)
        inputs = _results(jobs)
        for kid in todo:
            self._release(kid, inputs)
        return None

    def _close(self, root: NodeRow) -> None:
        """The root is done: so is the workflow."""
        self.head.state = root.state
        self.head.finished_at = self.now
        if root.state == "failed":
            self.head.error = self._error_record(root)

    def _error_record(self, root: NodeRow) -> bytes:
        """OJS §9.6: which step failed (a chain's), which jobs, and their errors."""
        failed = [row for row in self.span(root) if row.kind == "job" and row.error is not None]
        errors = [{"job_id": row.job_id, **msgspec.json.decode(row.error),
                   **({"callback": row.role} if row.role else {})}  # (OJS §9.5)
                  for row in failed[:MAX_LISTED]]
        record: dict[str, object] = {"failed_job_ids": [row.job_id for row in failed[:MAX_LISTED]],
                                     "errors": errors}
        if root.kind == "chain" and self._failed_step is not None:
            record = {"failed_step_index": self._failed_step, **record}
        return msgspec.json.encode(record)

    # -- entering ----------------------------------------------------------------------
    def start(self, root: NodeRow) -> None:
        """A new workflow: enter its root with nothing from parents."""
        self._enter(root, b"{}")
        self._drain()

    def _enter(self, top: NodeRow, inputs: bytes) -> None:
        """Start a subtree: its first jobs are released with ``inputs`` as their
        parent_results (a chain enters its first step, a group or batch all its jobs)."""
        rows = self.span(top)
        base = top.node
        stack = [(top, inputs)]
        while stack:
            row, given = stack.pop()
            if row.kind == "job":
                self._release(row, given)
                continue
            kids, child = [], row.node + 1
            while child <= row.end:
                kids.append(rows[child - base])
                child = rows[child - base].end + 1
            if row.kind != "chain":
                kids = [kid for kid in kids if kid.role is None]
            row.parent_results, row.remaining, row.failed = given, len(kids), 0
            if row.kind == "chain":
                row.result = given  # what its first step gets
            self._touch(row, "active")
            stack.extend((kid, given) for kid in reversed(kids[:1] if row.kind == "chain"
                                                             else kids))

    def _release(self, row: NodeRow, inputs: bytes) -> None:
        """Run a job node's job with these parent_results, or fail it if they are too
        large to pass (its job ends discarded, which fails the step)."""
        if row.state != "waiting":  # (a retry: its job ended before; held again first)
            self.decision.reset.append(str(row.job_id))
            row.error = None
        self._touch(row, "pending")
        if len(inputs) <= self.limit:
            self.decision.release.append((str(row.job_id), inputs))
            return
        record = error_record(p.ErrorInfo(
            type=TOO_LARGE, retryable=False,
            message=f"the results of its parents are {len(inputs)} bytes as JSON; the limit"
                    f" (max_parent_results_bytes) is {self.limit}"),
            attempt=0, worker_id=None, now=self.now)
        self.decision.discard.append((str(row.job_id), record))
        self._queue.append(Ending(row.node, "discarded", error=record))

    def _drop(self, first: int, last: int) -> None:
        """Nodes that will not run now (a failed chain's later steps): cancelled."""
        for row in self._mine(self._rows.span(first, last)):
            if row.state == "waiting":
                self._touch(row, "cancelled")
                if row.kind == "job":
                    self.decision.cancel.append(str(row.job_id))

    def _chain_next(self, chain: NodeRow, done: NodeRow) -> bytes:
        """What a chain's step after ``done`` gets (§7.2): what the step before it got,
        and ``done``'s result. The chain's row keeps it while it runs, so a 10,000-step
        chain does not read all its steps at each one."""
        if chain.result is None:  # (a chain entered before its row kept this: read once)
            chain.result = self._chain_inputs(chain, done.position + 1)
            return chain.result
        merged = msgspec.json.decode(chain.result, type=dict[str, msgspec.Raw])
        merged[str(done.position)] = msgspec.Raw(done.result or b"null")
        chain.result = msgspec.json.encode(merged)
        return chain.result

    def _chain_inputs(self, chain: NodeRow, step: int) -> bytes:
        """§7.2: a chain's step gets every earlier step's result, keyed by index, over
        what the chain itself received (read from its steps' rows)."""
        if not step:
            return chain.parent_results or b"{}"
        merged = msgspec.json.decode(chain.parent_results or b"{}", type=dict[str, msgspec.Raw])
        for kid in self.children(chain):
            if kid.position < step:
                merged[str(kid.position)] = msgspec.Raw(kid.result or b"null")
        return msgspec.json.encode(merged)

    # -- retry -------------------------------------------------------------------------
    def resume(self, row: NodeRow, inputs: bytes) -> None:
        """Enter again what did not complete; what completed keeps its result."""
        if row.state == "completed":
            return
        if row.kind == "job":
            return self._release(row, inputs)
        kids = self.children(row)
        todo = [kid for kid in kids if kid.state != "completed"]
        row.parent_results, row.failed = inputs, 0
        self._touch(row, "active")
        if row.kind == "chain":
            row.remaining = len(todo)
            row.result = self._chain_inputs(row, todo[0].position)  # (as _chain_next keeps)
            self.resume(todo[0], row.result)
            for kid in todo[1:]:
                self._hold(kid)
            return None
        jobs = [kid for kid in todo if kid.role is None]
        if row.kind == "batch" and not jobs:
            return self._fire(row)  # only a callback failed: fire again (none runs twice)
        row.remaining = len(jobs)
        for kid in jobs:
            self.resume(kid, inputs)
        for kid in todo:
            if kid.role is not None:
                self._hold(kid)
        return None

    def _hold(self, top: NodeRow) -> None:
        """A subtree back to waiting, its jobs held (pending) until it is entered."""
        for row in self.span(top):
            if row.state == "completed" or row.state == "waiting":
                continue
            if row.kind == "job":
                self.decision.reset.append(str(row.job_id))
            row.remaining = row.failed = 0
            row.error = row.result = None
            self._touch(row, "waiting")


def _failure(ending: Ending) -> bytes:
    """A job node's failure as a workflow's error names it (OJS §9.6)."""
    said = msgspec.json.decode(ending.error) if ending.error else {}
    code = said.get("type") or said.get("code") or ending.state
    message = said.get("message") or f"the job was {ending.state}"
    return msgspec.json.encode({"code": code, "message": message,
                                "attempt": said.get("attempt", ending.attempt)})


def _results(kids: list[NodeRow]) -> bytes:
    """A group's or batch's result: each job's (or nested composite's), keyed by index."""
    return b"{" + b",".join(b'"%d":%s' % (kid.position, kid.result or b"null")
                            for kid in kids if kid.role is None) + b"}"


def new_rows(nodes: list[Node], job_ids: Mapping[int, str]) -> list[NodeRow]:
    """A new workflow's rows, all waiting; ``job_ids`` names each job node's job."""
    return [NodeRow(node.node, node.parent, node.end, node.kind, node.position, node.role,
                    job_id=job_ids.get(node.node),
                    spec=node.request.spec if node.request is not None else None)
            for node in nodes]


def start(head: Head, rows: list[NodeRow], *, limit: int, now: float) -> Decision:
    """A new workflow's first moves: which jobs run at once (the rest stay held)."""
    flow = Flow(head, ListRows(rows), limit=limit, now=now)
    flow.start(flow.row(0))
    return flow.done()


def cancel(head: Head, rows: list[NodeRow], *, now: float) -> Decision:
    """DELETE /workflows/{id}: the workflow first (later endings then advance nothing),
    then every node not done; held jobs are cancelled here, released ones the usual way."""
    if head.state not in LIVE:
        raise Conflict("not_cancellable", f"workflow {head.id} is {head.state}")
    head.state, head.finished_at = "cancelled", now
    decision = Decision(head)
    for row in rows:
        if row.state in OPEN:
            if row.kind == "job":
                (decision.live if row.state == "pending" else decision.cancel).append(
                    str(row.job_id))
            row.state, row.result = "cancelled", None  # (a running chain's inputs so far)
            decision.rows.append(row)
    return decision


def retry(head: Head, rows: list[NodeRow], *, limit: int, now: float) -> Decision:
    """POST /workflows/{id}/retry: a failed workflow runs again from where it failed;
    what completed (callbacks included) does not run again."""
    if head.state != "failed":
        raise Conflict("not_failed", f"workflow {head.id} is {head.state}; only a failed"
                       " workflow is retried")
    head.state, head.finished_at, head.error = "running", None, None
    flow = Flow(head, ListRows(rows), limit=limit, now=now)
    flow.resume(flow.row(0), b"{}")
    jobs = [row for row in rows if row.kind == "job"]
    head.completed_count = sum(row.state == "completed" for row in jobs)
    head.failed_count = sum(row.error is not None for row in jobs)
    return flow.done()
