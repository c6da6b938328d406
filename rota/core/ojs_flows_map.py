"""OJS cron registrations and workflows (chain, group, batch) as Rota's schedule and
workflow definitions, and Rota's views of them as OJS shows them. Pure: each OJS job goes
through ``ojs_to_request``, as a PUSH does (docs/ojs.md, Cron and Workflows).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator, Mapping
from typing import Any

import msgspec

from rota.core.ojs_map import OjsRefusal, ojs_time, ojs_to_request, rota_args_to_ojs
from rota.core.workflow_defs import KINDS, ROLES

# A cron template's job runs at its schedule's ticks, as the schedule's own: these options
# have no meaning there (the ticks say when, the tick says the id; overlap_policy, not
# unique, keeps one at a time).
TEMPLATE_REFUSED = {"id": "a cron job's id is given by its tick",
                    "run_at": "a cron job runs at its tick (no delay_until, scheduled_at)",
                    "expires_at": "a cron job has no expires_at",
                    "unique": "a cron job's overlap_policy, not unique, keeps one at a time"}
# Rota's codes for a schedule it refuses, as OJS names them (the rest: invalid_request).
CRON_CODES = {"invalid_cron": "invalid_cron_expression"}


def _refused(message: str, status: int = 400, code: str = "invalid_request") -> OjsRefusal:
    return OjsRefusal(status, code, "validation_error", message)


def _with_path(path: str, refusal: OjsRefusal) -> OjsRefusal:
    """The refusal of a job inside a workflow or a template, named by where it is."""
    return OjsRefusal(refusal.status, refusal.code, refusal.type,
                      f"{path}: {refusal.message}", refusal.details)


def _request(job: Any, path: str, now: float) -> dict[str, Any]:
    """One OJS job (a workflow's step or a cron template) as Rota's enqueue request, in
    the JSON Rota's definitions take: the fields given only (a ``None`` is left out, so
    that Rota's own refusals of ``id``, ``unique``, ``run_at`` name what was given)."""
    if isinstance(job, dict) and "depends_on" in job:
        raise _refused(f"{path}.depends_on: DAG workflows are not supported; write a chain,"
                       " group or batch (ojs-workflows.md)", 422, "unsupported")
    try:
        request = ojs_to_request(job, now)
    except OjsRefusal as refusal:
        raise _with_path(path, refusal) from None
    return {key: value for key, value in msgspec.to_builtins(request).items()
            if value is not None}


# -- cron -------------------------------------------------------------------------------
def cron_definition(body: Any, now: float) -> dict[str, Any]:
    """A cron registration (the suites' ``{name, expression, timezone, overlap_policy,
    enabled, description, job_template: {type, args, options}}``, or ojs-cron.md's, with
    ``cron`` and the template's fields at the top level) as the JSON of Rota's schedule
    definition (rota/core/schedules.py ``check`` judges it next). OjsRefusal if it is not
    one."""
    if not isinstance(body, dict):
        raise _refused("a cron registration is a JSON object")
    expression = body.get("expression", body.get("cron"))
    if not isinstance(expression, str) or not expression.strip():
        raise _refused("expression is required: a cron expression (5 or 6 fields, or"
                       " @hourly, @daily, @weekly ...)", code="invalid_cron_expression")
    template = body.get("job_template")
    if template is None:  # ojs-cron.md: type, args and options at the top level
        template = {key: body[key] for key in ("type", "args", "options") if key in body}
    if not isinstance(template, dict) or "type" not in template:
        raise _refused("job_template is required: {type, args, options}")
    template = {"args": [], **template}  # (ojs-cron.md: args default to [])
    request = _request(template, "job_template", now)
    for key, why in TEMPLATE_REFUSED.items():
        if key in request:
            raise _refused(f"job_template: {why}")
    definition: dict[str, Any] = {
        "name": body.get("name"), "spec": request["spec"], "cron": expression,
        "args": request["args"], "paused": not body.get("enabled", True)}
    for ojs_name, rota_name in (("timezone", "timezone"), ("overlap_policy", "overlap"),
                                ("description", "description")):
        if body.get(ojs_name) is not None:
            definition[rota_name] = body[ojs_name]
    for key in ("queue", "priority", "max_attempts", "ojs"):
        if key in request:
            definition[key] = request[key]
    return definition


def cron_view(schedule: Mapping[str, Any]) -> dict[str, Any]:
    """A schedule as Rota's API shows it (rota/core/schedules.py ``view``), as OJS's
    cron job: its template with OJS's args, and its times as OJS writes them."""
    options: dict[str, Any] = {}
    for key in ("queue", "priority"):
        if schedule.get(key) is not None:
            options[key] = schedule[key]
    extras = schedule.get("ojs") or {}
    for key in ("retry", "tags", "metadata", "timeout_ms", "visibility_timeout_ms",
                "rate_limit"):
        if extras.get(key) is not None:
            options[key] = extras[key]
    if schedule.get("max_attempts") is not None:
        options["retry"] = {**options.get("retry", {}),
                            "max_attempts": schedule["max_attempts"]}
    fires = schedule.get("next_fires") or []
    enabled = not schedule.get("paused", False)
    view = {"name": schedule.get("name"), "expression": schedule.get("cron"),
            "timezone": schedule.get("timezone"),
            "overlap_policy": schedule.get("overlap"), "enabled": enabled,
            "next_run_at": _time(fires[0]) if fires and enabled else None,
            "last_run_at": _time(schedule.get("last_tick")),
            "run_count": schedule.get("run_count", 0),
            "created_at": _time(schedule.get("created_at")),
            "job_template": {"type": schedule.get("spec"),
                             "args": rota_args_to_ojs(schedule.get("args") or {}),
                             "options": options}}
    if schedule.get("description"):
        view["description"] = schedule["description"]
    if schedule.get("state") == "waiting" and schedule.get("waiting_reason"):
        view["waiting_reason"] = schedule["waiting_reason"]
    return view


def _time(text: str | None) -> str | None:
    """An RFC 3339 time of Rota's views as OJS writes it (ojs_time)."""
    if text is None:
        return None
    return ojs_time(dt.datetime.fromisoformat(text).timestamp())


# -- workflows --------------------------------------------------------------------------
def workflow_definition(body: Any, now: float) -> dict[str, Any]:
    """An OJS workflow (ojs-workflows.md: a chain of ``steps``, a group or a batch of
    ``jobs``, a batch's ``callbacks``, nested in one another) as the JSON of Rota's
    workflow definition (rota/core/workflow_defs.py judges it next), each job through
    ``ojs_to_request``. HB's DAG form (``depends_on``) is 422 ``unsupported``."""
    if not isinstance(body, dict):
        raise _refused("a workflow is a JSON object: {type: chain|group|batch, ...}")
    return _composite(body, "", now)


def _composite(data: dict[str, Any], path: str, now: float) -> dict[str, Any]:
    kind = data.get("type")
    field = "steps" if kind == "chain" else "jobs"
    shown: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else key
        if key == field and isinstance(value, list):
            shown[key] = [_step(item, f"{where}[{i}]", now) for i, item in enumerate(value)]
        elif key == "callbacks" and isinstance(value, dict):
            shown[key] = {role: _request(job, f"{where}.{role}", now)
                          if role in ROLES and job is not None else job
                          for role, job in value.items()}
        elif key == "steps" and isinstance(value, list) and any(
                isinstance(item, dict) and "depends_on" in item for item in value):
            raise _refused(f"{where}: DAG workflows (depends_on) are not supported; write a"
                           " chain, group or batch (ojs-workflows.md)", 422, "unsupported")
        else:  # (anything else as given: Rota's reader names what is wrong with it)
            shown[key] = value
    return shown


def _step(item: Any, path: str, now: float) -> Any:
    """A nested chain, group or batch (its type one of those, with steps or jobs), else
    a job."""
    if isinstance(item, dict) and item.get("type") in KINDS and (
            "steps" in item or "jobs" in item):
        return _composite(item, path, now)
    if not isinstance(item, dict):
        return item  # (Rota's reader: "must be an object")
    return _request(item, path, now)


def workflow_view(workflow: Mapping[str, Any]) -> dict[str, Any]:
    """A workflow as Rota's API shows it (rota/core/workflow_view.py ``view``), as OJS's:
    its top-level steps counted (``steps_total``, ``steps_completed``: what a chain's
    tests read) and its jobs, batch callbacks aside (``jobs_total``, ``jobs_completed``:
    what group and batch tests read), both for every kind; its steps or jobs listed."""
    root = workflow.get("root") or {}
    tops = [child for child in root.get("children", []) if child.get("role") is None]
    jobs = list(_jobs(root))
    view: dict[str, Any] = {
        "id": workflow["id"], "type": workflow["type"], "state": workflow["state"],
        "steps_total": len(tops),
        "steps_completed": sum(1 for step in tops if step["state"] == "completed"),
        "jobs_total": len(jobs),
        "jobs_completed": sum(1 for job in jobs if job["state"] == "completed"),
        "created_at": _time(workflow.get("created_at"))}
    if workflow.get("name") is not None:
        view["name"] = workflow["name"]
    for ojs_name, rota_name in (("started_at", "started_at"),
                                ("completed_at", "finished_at")):
        if workflow.get(rota_name) is not None:
            view[ojs_name] = _time(workflow[rota_name])
    view["steps" if workflow["type"] == "chain" else "jobs"] = [
        {"index": step.get("position", i), "type": step.get("spec") or step["kind"],
         "state": step["state"], "job_id": step.get("job_id")}
        for i, step in enumerate(tops)]
    callbacks = {child["role"]: {"type": child.get("spec"), "state": child["state"],
                                 "job_id": child.get("job_id")}
                 for child in root.get("children", []) if child.get("role") is not None}
    if callbacks:
        view["callbacks"] = callbacks
    view["metadata"] = {"job_count": workflow.get("job_count"),
                        "completed_count": workflow.get("completed_count"),
                        "failed_count": workflow.get("failed_count")}
    if workflow.get("error") is not None:
        view["error"] = workflow["error"]
    return view


def _jobs(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The job nodes under ``node``, in preorder, batch callbacks left out."""
    for child in node.get("children", []):
        if child.get("role") is not None:
            continue
        if child.get("kind") == "job":
            yield child
        else:
            yield from _jobs(child)
