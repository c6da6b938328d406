"""Workflows from a producer: the definitions (``step``, ``chain``, ``group``, ``batch``),
built without sending anything and nestable, and what both producer clients do with them
(``POST /workflows`` and the reads, cancel and retry of one), with the handle a created
workflow comes back as. The synchronous calls are the ``Workflows`` mixin of ``Client``;
rota/client/flowing.py has ``AsyncClient``'s.

    with Client() as client:
        flow = client.chain(step("resize_image", url="https://example.com/a.png", width=64),
                            group(step("echo", message="a"), step("echo", message="b")))
        print(flow.id, flow.result(timeout=30))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Union

from rota.base.errors import ResultTimeout, WorkflowError
from rota.base.ids import path_segment

FINISHED = ("completed", "failed", "cancelled")  # a workflow's states that do not change
POLL_FIRST, POLL_MAX = 0.05, 1.0  # seconds between two reads while waiting, growing


@dataclass(frozen=True, slots=True)
class Step:
    """One job of a workflow: a spec, its args and enqueue options (``queue``,
    ``priority``, ``max_attempts``, ``ttl``, ``labels``, ...; not ``id``, ``unique``,
    ``run_at`` or ``delay``: a step runs when its parents are done)."""

    spec: str
    args: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def set(self, **options: Any) -> Step:
        """This step with these enqueue options too (as Celery's ``signature.set``):
        ``step("send_email", to="a@b").set(queue="urgent", priority=10)``."""
        return replace(self, options={**self.options, **options})

    def to_json(self) -> dict[str, Any]:
        kept = {key: value for key, value in self.options.items() if value is not None}
        return {"spec": self.spec, "args": dict(self.args), **kept}


# What a step of a chain (or a job of a group or batch) may be given as: a Step, a nested
# definition, or the JSON of either as POST /workflows takes it.
StepLike = Union[Step, "Chain", "Group", "Batch", Mapping[str, Any]]


def step(spec: str, args: Mapping[str, Any] | None = None, /, **kwargs: Any) -> Step:
    """A job of ``spec`` for a workflow: its args as keywords (``step("send_email",
    to="a@b")``), or as a dict when a name is no Python keyword (``step("x", {"from":
    1})``); both are merged. Enqueue options come with ``.set(queue=...)``."""
    if args is not None and not isinstance(args, Mapping):
        raise TypeError(f"step({spec!r}, ...): args go as keywords (step({spec!r}, to=...))"
                        f" or as one dict, not a {type(args).__name__}")
    return Step(spec, {**(args or {}), **kwargs})


def _json(item: StepLike, where: str, callback: bool = False) -> dict[str, Any]:
    if isinstance(item, Step) or (not callback and isinstance(item, Chain | Group | Batch)):
        return item.to_json()
    if isinstance(item, Mapping):
        return dict(item)
    if callback:
        raise TypeError(f"{where} must be one job, a step(...) or a dict, not"
                        f" {type(item).__name__} (a callback is not a nested workflow)")
    hint = " (pass the steps one by one: group(*steps))" if isinstance(item, list | tuple) else ""
    raise TypeError(f"{where} must be a step(...), a chain, group or batch, or a dict, not"
                    f" {type(item).__name__}{hint}")


def _composite(kind: str, field: str, items: tuple[StepLike, ...], name: str | None,
               id: str | None) -> dict[str, Any]:
    """A chain's, group's or batch's JSON: its type, name and id, and its steps."""
    head: dict[str, Any] = {"type": kind}
    if name is not None:
        head["name"] = name
    if id is not None:
        head["id"] = id
    head[field] = [_json(item, f"{kind} step {i}") for i, item in enumerate(items)]
    return head


@dataclass(frozen=True, slots=True)
class Chain:
    """Steps one after another: step k runs when step k-1 has completed, and reads the
    results of every step before it in ``ctx.parent_results`` (``{"0": ..., "1": ...}``).
    A failed step fails the chain; the steps after it are cancelled."""

    steps: tuple[StepLike, ...]
    name: str | None = None
    id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _composite("chain", "steps", self.steps, self.name, self.id)


@dataclass(frozen=True, slots=True)
class Group:
    """Jobs side by side; done when all are, failed if any failed. Its result is
    ``{"0": result of job 0, ...}``, what the step after it in a chain reads."""

    jobs: tuple[StepLike, ...]
    name: str | None = None
    id: str | None = None

    def to_json(self) -> dict[str, Any]:
        return _composite("group", "jobs", self.jobs, self.name, self.id)


@dataclass(frozen=True, slots=True)
class Batch:
    """A group with callbacks, run once all its jobs are done: ``on_complete`` always,
    ``on_success`` if none failed, ``on_failure`` if any did. Each callback reads the
    jobs' results in ``ctx.parent_results``."""

    jobs: tuple[StepLike, ...]
    on_success: Step | Mapping[str, Any] | None = None
    on_failure: Step | Mapping[str, Any] | None = None
    on_complete: Step | Mapping[str, Any] | None = None
    name: str | None = None
    id: str | None = None

    def to_json(self) -> dict[str, Any]:
        callbacks = {role: _json(given, role, callback=True) for role, given in (
            ("on_success", self.on_success), ("on_failure", self.on_failure),
            ("on_complete", self.on_complete)) if given is not None}
        return {**_composite("batch", "jobs", self.jobs, self.name, self.id),
                "callbacks": callbacks}


Definition = Chain | Group | Batch


def chain(*steps: StepLike, name: str | None = None, id: str | None = None) -> Chain:
    """A chain's definition, to send (``client.create_workflow``) or to nest."""
    return Chain(steps, name, id)


def group(*jobs: StepLike, name: str | None = None, id: str | None = None) -> Group:
    """A group's definition, to send or to nest."""
    return Group(jobs, name, id)


def batch(*jobs: StepLike, on_success: Step | Mapping[str, Any] | None = None,
          on_failure: Step | Mapping[str, Any] | None = None,
          on_complete: Step | Mapping[str, Any] | None = None,
          name: str | None = None, id: str | None = None) -> Batch:
    """A batch's definition (at least one callback), to send or to nest."""
    if on_success is None and on_failure is None and on_complete is None:
        raise TypeError("a batch needs at least one of on_success, on_failure, on_complete"
                        " (without callbacks, it is a group)")
    return Batch(jobs, on_success, on_failure, on_complete, name, id)


def body(definition: Definition | Mapping[str, Any]) -> dict[str, Any]:
    """The ``POST /workflows`` body of a definition (or of its JSON, as given)."""
    return _json(definition, "a workflow")


def list_params(state: str | None, name: str | None, limit: int, after: str | None
                ) -> dict[str, Any]:
    given = {"state": state, "name": name, "limit": limit, "after": after}
    return {key: value for key, value in given.items() if value is not None}


def job_ids(tree: Mapping[str, Any]) -> list[str]:
    """The job ids of a workflow's tree (its view's ``root``), in preorder."""
    found = [tree["job_id"]] if tree.get("job_id") else []
    for child in tree.get("children", ()):
        found += job_ids(child)
    return found


def result_of(tree: Mapping[str, Any], results: Mapping[str, Any]) -> Any:
    """A completed node's result, as the server passes it on: a job's own, a chain's
    last step's, a group's or batch's ``{"0": result of job 0, ...}`` (its callbacks
    not counted). ``results``: job id -> result."""
    if tree["kind"] == "job":
        return results[tree["job_id"]]
    steps = [c for c in tree["children"] if c.get("role") is None]
    if tree["kind"] == "chain":
        return result_of(steps[-1], results)
    return {str(c["position"]): result_of(c, results) for c in steps}


def unfinished(view: Mapping[str, Any], timeout: float | None) -> ResultTimeout:
    return ResultTimeout(view["id"], view["state"], timeout or 0.0, what="workflow")


class WorkflowHandle:
    """A workflow as the server stored it: ``id``, ``state``, ``name``, ``type``, and
    ``view``, the whole of ``GET /workflows/{id}`` (counts, error, the tree of steps in
    ``view["root"]``) as of its creation or last ``refresh()``. ``created`` is False when
    a workflow with this id existed already (the same definition, sent again)."""

    __slots__ = ("created", "view")

    def __init__(self, view: dict[str, Any], created: bool = True) -> None:
        self.view = view
        self.created = created

    @property
    def id(self) -> str:
        return str(self.view["id"])

    @property
    def state(self) -> str:
        return str(self.view["state"])

    @property
    def name(self) -> str | None:
        name = self.view.get("name")
        return None if name is None else str(name)

    @property
    def type(self) -> str:
        return str(self.view["type"])

    @property
    def done(self) -> bool:
        """Whether it has finished: completed, failed or cancelled."""
        return self.state in FINISHED

    @property
    def job_ids(self) -> list[str]:
        """Its steps' job ids, in the order they are written (a callback after its batch's
        jobs): each step has its job from the start, held until its turn."""
        return job_ids(self.view["root"])

    def failure(self) -> WorkflowError:
        return WorkflowError(self.id, self.state, self.view.get("error"))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.type} {self.state}>"


class Workflow(WorkflowHandle):
    """A workflow created or read with ``Client``: ``wait()`` until it finishes,
    ``result()`` for what it produced, ``refresh()``, ``cancel()``, ``retry()``."""

    __slots__ = ("_client",)

    def __init__(self, client: Workflows, view: dict[str, Any], created: bool = True) -> None:
        super().__init__(view, created)
        self._client = client

    def refresh(self) -> Workflow:
        """Read it again (its state, counts and tree); returns itself."""
        self.view = self._client.workflow(self.id).view
        return self

    def wait(self, timeout: float | None = None) -> Workflow:
        """Read it again until it has finished (completed, failed or cancelled; None: no
        time limit); returns itself. ``ResultTimeout`` if it has not within ``timeout``
        seconds: it goes on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = POLL_FIRST
        while not self.refresh().done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise unfinished(self.view, timeout)
            time.sleep(pause if left is None else min(pause, left))
            pause = min(POLL_MAX, pause * 2)
        return self

    def result(self, timeout: float | None = None) -> Any:
        """Once it has completed, its result as the server passes it on (a chain's: its
        last step's; a group's or batch's: ``{"0": result of job 0, ...}``), each step's
        read by its job id. ``WorkflowError`` if it failed or was cancelled (naming the
        failed jobs and their errors), ``ResultTimeout`` if it has not finished in time."""
        self.wait(timeout)
        if self.state != "completed":
            raise self.failure()
        results = {job_id: self._client.result(job_id)["result"] for job_id in self.job_ids}
        return result_of(self.view["root"], results)

    def cancel(self) -> Workflow:
        """As ``Client.cancel_workflow``; returns itself, read again."""
        self.view = self._client.cancel_workflow(self.id).view
        return self

    def retry(self) -> Workflow:
        """As ``Client.retry_workflow``; returns itself, read again."""
        self.view = self._client.retry_workflow(self.id).view
        return self


class Workflows:
    """``Client``'s workflow calls (a mixin: ``Client`` has ``_call`` and ``result``)."""

    __slots__ = ()
    _call: Callable[..., Any]
    result: Callable[..., dict[str, Any]]

    def create_workflow(self, definition: Definition | Mapping[str, Any]) -> Workflow:
        """One ``POST /workflows``: every step stored and the first jobs enqueued in one
        transaction. With an ``id`` given, sending it again returns the same workflow
        (``created`` False); another definition under that id is refused (409)."""
        answer = self._call("POST", "/workflows", json=body(definition))
        return Workflow(self, answer["workflow"], answer["created"])

    def chain(self, *steps: StepLike, name: str | None = None, id: str | None = None
              ) -> Workflow:
        """Create a chain of these steps (``rota.step(...)``, or nested ``rota.group``,
        ``rota.chain``, ``rota.batch``): each runs when the one before it completed."""
        return self.create_workflow(chain(*steps, name=name, id=id))

    def group(self, *jobs: StepLike, name: str | None = None, id: str | None = None
              ) -> Workflow:
        """Create a group of these jobs, run side by side."""
        return self.create_workflow(group(*jobs, name=name, id=id))

    def batch(self, *jobs: StepLike, on_success: Step | Mapping[str, Any] | None = None,
              on_failure: Step | Mapping[str, Any] | None = None,
              on_complete: Step | Mapping[str, Any] | None = None,
              name: str | None = None, id: str | None = None) -> Workflow:
        """Create a batch of these jobs with its callbacks (at least one)."""
        return self.create_workflow(batch(*jobs, on_success=on_success, on_failure=on_failure,
                                          on_complete=on_complete, name=name, id=id))

    def workflow(self, workflow_id: str) -> Workflow:
        """The workflow as ``GET /workflows/{id}`` shows it: state, counts, error, tree."""
        view = self._call("GET", f"/workflows/{path_segment(workflow_id)}")
        return Workflow(self, view, False)

    def workflows(self, *, state: str | None = None, name: str | None = None,
                  limit: int = 50, after: str | None = None) -> dict[str, Any]:
        """One page of ``GET /workflows``, newest first: ``{"workflows": [summary, ...],
        "next"}``; pass ``next`` back as ``after`` for the next page."""
        return self._call("GET", "/workflows", params=list_params(state, name, limit, after))

    def cancel_workflow(self, workflow_id: str) -> Workflow:
        """Cancel it: its steps not yet done are cancelled, running jobs through their
        workers."""
        answer = self._call("DELETE", f"/workflows/{path_segment(workflow_id)}")
        return Workflow(self, answer, False)

    def retry_workflow(self, workflow_id: str) -> Workflow:
        """Resume a failed workflow from its failed steps (409 ``not_failed`` otherwise):
        they run again, and the steps cancelled because of them wait again."""
        answer = self._call("POST", f"/workflows/{path_segment(workflow_id)}/retry")
        return Workflow(self, answer, False)
