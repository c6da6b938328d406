"""Workflow definitions (ojs-workflows §3-§6, §10): chain, group and batch, nestable, each
job an enqueue request; their validation, and their nodes numbered in preorder. Pure.

A definition is a tree; its nodes are numbered in preorder, so that a subtree is a range
``[node, end]`` and its rows are read in one query. A batch's callbacks come after its
jobs (``role`` names them). Cycles cannot be written in a tree: the only way to name a
node twice is an explicit ``id``, and a repeated one is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from rota.base.errors import DomainError, Invalid
from rota.base.ids import job_id_problem
from rota.base.protocol import Name
from rota.base.wording import GOT, kind_of, plainly
from rota.core.jobs import EnqueueRequest, NewJobId
from rota.core.listing import slip_for

MAX_DEPTH = 4  # composites nested in one another, the outermost counted
# Jobs in all, batch callbacks not counted (at most 3 per batch): so that a group of
# 10,000 may still have its callback (the example).
MAX_JOBS = 10_000
ROLES = ("on_success", "on_failure", "on_complete")  # a batch's callbacks, in node order
KINDS = ("chain", "group", "batch")
# An enqueue's options that have no meaning in a workflow: a step runs when its parents
# are done (no delay, no run_at), and its id and uniqueness are the workflow's.
REFUSED = {"id": "a step's job id is given by the workflow",
           "unique": "a workflow's id makes it unique",
           "run_at": "a step runs when the steps before it are done",
           "delay": "a step runs when the steps before it are done"}

Steps = Annotated[list[Any], msgspec.Meta(extra_json_schema={
    "minItems": 1, "items": {"description": "a job (an enqueue request without id, unique,"
                             " run_at and delay) or a nested chain, group or batch"}})]


class Chain(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="chain",
            tag_field="type"):
    """Steps one after another; step k gets the results of the steps before it."""

    steps: Steps
    name: Name | None = None
    id: NewJobId | None = None


class Group(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="group",
            tag_field="type"):
    """Jobs side by side; done when all are, failed if any failed."""

    jobs: Steps
    name: Name | None = None
    id: NewJobId | None = None


class Callbacks(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    on_success: EnqueueRequest | None = None
    on_failure: EnqueueRequest | None = None
    on_complete: EnqueueRequest | None = None


class Batch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag="batch",
            tag_field="type"):
    """A group whose callbacks run when all its jobs are done (the firing matrix, §6.5)."""

    jobs: Steps
    callbacks: Callbacks
    name: Name | None = None
    id: NewJobId | None = None


Composite = Chain | Group | Batch
Step = Composite | EnqueueRequest
TYPES: dict[str, type[Composite]] = {"chain": Chain, "group": Group, "batch": Batch}
# A step's job as the caller checks it (Intake.build): None if it may run, else why not.
CheckJob = Callable[[str, EnqueueRequest], DomainError | None]


def at(path: str, key: str | int) -> str:
    """``steps[1].jobs[3]``-style paths, as every refusal names its place."""
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else key)


class _Reader:
    """One walk over a definition: counts jobs and depth, collects explicit ids."""

    def __init__(self, check_job: CheckJob) -> None:
        self.check_job = check_job
        self.jobs = 0
        self.ids: dict[str, str] = {}  # id -> the path it was first given at

    def composite(self, data: dict[str, Any], path: str, depth: int) -> Composite:
        kind = data["type"]
        if not isinstance(kind, str) or kind not in TYPES:
            said = f"{kind!r}" if isinstance(kind, str) else GOT[kind_of(kind)]
            raise Invalid("invalid_workflow", f"{at(path, 'type')} must be one of chain, group,"
                          f" batch, not {said} (a job step has no type: it names its spec)")
        if depth > MAX_DEPTH:
            raise Invalid("workflow_too_deep", f"{path or 'the workflow'}: workflows nest at"
                          f" most {MAX_DEPTH} deep (a chain, group or batch counts one)")
        cls = TYPES[kind]
        self.fields(data, cls, kind, path)
        field = "steps" if cls is Chain else "jobs"
        steps = data.get(field)
        head = {key: value for key, value in data.items() if key not in (field, "callbacks")}
        head[field] = []
        if cls is Batch:
            head["callbacks"] = {}
        composite = self.convert(head, cls, path)
        if composite.id is not None:
            self.claim(composite.id, at(path, "id"))
        if not isinstance(steps, list):
            raise Invalid("invalid_workflow" if steps is not None else "empty_workflow",
                          f"{at(path, field)} must be an array of steps, got"
                          f" {'nothing' if steps is None else GOT[kind_of(steps)]}")
        if not steps:
            raise Invalid("empty_workflow", f"{at(path, field)} is empty: a {kind} needs at"
                          " least one step")
        children = [self.step(item, at(at(path, field), i), depth) for i, item in enumerate(steps)]
        if isinstance(composite, Chain):
            composite.steps = children
        else:
            composite.jobs = children
        if isinstance(composite, Batch):
            composite.callbacks = self.callbacks(data.get("callbacks"), at(path, "callbacks"))
        return composite

    @staticmethod
    def fields(data: dict[str, Any], cls: type[Composite], kind: str, path: str) -> None:
        """Refuse a field ``cls`` has not: callbacks on a chain or a group (they would
        never run), and a slip for a known field named as such (``stpes``: steps)."""
        known = cls.__struct_fields__
        for key in data:
            if key == "type" or key in known:
                continue
            if cls is not Batch and (key == "callbacks" or slip_for(key, ["callbacks"])):
                raise Invalid("invalid_workflow", f"{at(path, key)}: only a batch has"
                              f" callbacks (this is a {kind}: make it a batch)")
            guess = slip_for(key, known)
            raise Invalid("invalid_workflow", f"{at(path, key)} is not a field Rota knows"
                          + (f"; did you mean {guess}?" if guess else "")
                          + f" (known: {', '.join(known)})")

    def callbacks(self, data: Any, path: str) -> Callbacks:
        unknown = sorted(set(data) - set(ROLES)) if isinstance(data, dict) else []
        if unknown:
            raise Invalid("invalid_workflow", f"{at(path, unknown[0])} is not a field Rota"
                          f" knows (known: {', '.join(ROLES)})")
        if not isinstance(data, dict) or not any(data.get(role) is not None for role in ROLES):
            raise Invalid("invalid_workflow", f"{path} must name at least one of"
                          f" {', '.join(ROLES)} (a batch without callbacks is a group)")
        return Callbacks(**{role: self.job(data[role], at(path, role), callback=True)
                            for role in ROLES
                            if data.get(role) is not None})

    def step(self, data: Any, path: str, depth: int) -> Step:
        if not isinstance(data, dict):
            raise Invalid("invalid_workflow", f"{path} must be an object (a job or a chain,"
                          f" group or batch), got {GOT[kind_of(data)]}")
        if "type" in data:
            return self.composite(data, path, depth + 1)
        return self.job(data, path)

    def job(self, data: Any, path: str, *, callback: bool = False) -> EnqueueRequest:
        if not isinstance(data, dict):
            raise Invalid("invalid_workflow", f"{path} must be a job (an object with a spec),"
                          f" got {GOT[kind_of(data)]}")
        for key, why in REFUSED.items():
            if key in data:
                raise Invalid("invalid_workflow", f"{at(path, key)} is not allowed in a"
                              f" workflow: {why}")
        if not callback:
            self.jobs += 1
            if self.jobs > MAX_JOBS:
                raise Invalid("workflow_too_large", f"{path}: a workflow holds at most"
                              f" {MAX_JOBS} jobs (its batches' callbacks not counted)")
        request = self.convert(data, EnqueueRequest, path)
        refused = self.check_job(path, request)
        if refused is not None:
            refused.message = f"{path}: {refused.message}"
            refused.args = (refused.message,)
            raise refused
        return request

    def convert(self, data: dict[str, Any], cls: type[Any], path: str) -> Any:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            said = plainly(str(exc), cls, lambda: data)
            raise Invalid("invalid_workflow", f"{path}: {said}" if path else said) from None

    def claim(self, given: str, path: str) -> None:
        if (problem := job_id_problem(given)) is not None:  # (a workflow's ids: a job id's rule)
            raise Invalid("invalid_id", f"{path}: {problem.replace('job id', 'workflow id')}")
        if given in self.ids:
            raise Invalid("invalid_workflow", f"{path} {given!r} is given twice (first at"
                          f" {self.ids[given]}): a workflow is a tree, each node once")
        self.ids[given] = path


def definition(data: Any, check_job: CheckJob) -> Composite:
    """A workflow definition from decoded JSON, or the first thing wrong with it, named by
    its path (``steps[1].jobs[3]: unknown spec 'x'``). ``check_job`` judges each job
    (spec, args, queue), in preorder; the core does not know the specs."""
    if not isinstance(data, dict):
        raise Invalid("invalid_workflow", f"a workflow is an object, got {GOT[kind_of(data)]}")
    if "type" not in data:
        raise Invalid("invalid_workflow", "type is required: chain, group or batch")
    return _Reader(check_job).composite(data, "", 1)


def digest(workflow: Composite) -> str:
    """What makes two definitions the same (a repeated create with the same id)."""
    return hashlib.sha256(msgspec.json.encode(workflow, order="sorted")).hexdigest()


Kind = Literal["job", "chain", "group", "batch"]


@dataclass(frozen=True, slots=True)
class Node:
    """One node of a definition, in preorder: ``end`` is the last node of its subtree."""

    node: int
    parent: int | None
    end: int
    kind: Kind
    position: int  # among its parent's steps or jobs (a batch's callbacks follow its jobs)
    role: str | None  # a batch callback's: on_success | on_failure | on_complete
    path: str  # where it was written ("steps[1].jobs[0]"), as refusals name it
    request: EnqueueRequest | None = None  # a job's


def plan(workflow: Composite) -> list[Node]:
    """Every node of a definition, in preorder."""
    nodes: list[Node] = []
    _place(workflow, None, 0, None, "", nodes)
    return nodes


def _place(step: Step, parent: int | None, position: int, role: str | None, path: str,
           nodes: list[Node]) -> int:
    """Append ``step``'s subtree to ``nodes``; the number of its last node."""
    index = len(nodes)
    if isinstance(step, EnqueueRequest):
        nodes.append(Node(index, parent, index, "job", position, role, path, step))
        return index
    kind = type(step).__struct_config__.tag
    nodes.append(Node(index, parent, index, kind, position, role, path))  # (end below)
    field = "steps" if isinstance(step, Chain) else "jobs"
    children: list[tuple[Step, str | None, str]] = [
        (child, None, at(at(path, field), i))
        for i, child in enumerate(step.steps if isinstance(step, Chain) else step.jobs)]
    if isinstance(step, Batch):
        children += [(getattr(step.callbacks, r), r, at(at(path, "callbacks"), r))
                     for r in ROLES if getattr(step.callbacks, r) is not None]
    end = index
    for i, (child, child_role, child_path) in enumerate(children):
        end = _place(child, index, i, child_role, child_path, nodes)
    nodes[index] = Node(index, parent, end, kind, position, role, path)
    return end
