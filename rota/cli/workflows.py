"""``rota workflows``: the workflows (list), one as a tree of its steps (``show``), and
``cancel``, ``retry`` and ``create`` (a definition from a JSON file). A client of
``GET|POST /workflows`` and ``GET|DELETE /workflows/{id}``, ``POST /workflows/{id}/retry``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from rota.cli.base import URL_OPTION, api, fail, out, print_json

# (rota.core.workflows.STATES: the CLI, a client, imports no server code it can do without)
WORKFLOW_STATES = ("pending", "running", "completed", "failed", "cancelled")


def node_words(node: dict[str, Any]) -> str:
    """One node of a tree as a line says it: ``resize_image  completed  job 0196…``,
    ``group  running``, ``on_complete: echo  skipped``."""
    what = (node.get("spec") or "job") if node["kind"] == "job" else node["kind"]
    if node.get("role"):
        what = f"{node['role']}: {what}"
    job = f"  job {node['job_id']}" if node.get("job_id") else ""
    why = f" ({node['waiting_reason']})" if node.get("waiting_reason") else ""
    return f"{what}  {node['state']}{why}{job}"


def tree_lines(root: dict[str, Any]) -> list[str]:
    """A workflow's tree (its view's ``root``) drawn with box-drawing characters, one
    line a node, in the order the steps are written."""
    lines = [node_words(root)]

    def walk(node: dict[str, Any], prefix: str) -> None:
        children = node.get("children") or []
        for i, child in enumerate(children):
            last = i == len(children) - 1
            lines.append(f"{prefix}{'└── ' if last else '├── '}{node_words(child)}")
            walk(child, prefix + ("    " if last else "│   "))

    walk(root, "")
    return lines


def counts(summary: dict[str, Any]) -> str:
    """``3/4 jobs completed, 1 failed`` (a batch's callback that did not fire is neither)."""
    failed = f", {summary['failed_count']} failed" if summary.get("failed_count") else ""
    return f"{summary['completed_count']}/{summary['job_count']} jobs completed{failed}"


def print_workflow(view: dict[str, Any]) -> None:
    """A workflow's head line, its failure if any, and its tree."""
    name = f" {view['name']}" if view.get("name") else ""
    out(f"workflow {view['id']}{name} ({view['type']}): {view['state']}, {counts(view)},"
        f" created {view['created_at']}")
    error = view.get("error") or {}
    for failure in error.get("errors") or []:
        out(f"  failed: job {failure.get('job_id')} (attempt {failure.get('attempt')}):"
            f" {failure.get('code')}: {failure.get('message')}")
    for line in tree_lines(view["root"]):
        out(line)


@click.group(invoke_without_command=True)
@click.option("--state", type=click.Choice(WORKFLOW_STATES), help="Workflows in this state.")
@click.option("--name", help="Workflows of this name.")
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True,
              help="Workflows to show (newest first).")
@click.option("--json", "as_json", is_flag=True,
              help='Print {"workflows": [...], "next"} as JSON.')
@URL_OPTION
@click.pass_context
def workflows(ctx: click.Context, state: str | None, name: str | None, limit: int,
              as_json: bool, url: str) -> None:
    """The workflows, newest first: id, name, type, state, jobs done, created. 'rota
    workflows show ID' draws one as a tree."""
    if ctx.invoked_subcommand is not None:
        return
    reply = api(url, "workflows", state=state, name=name, limit=limit)
    if as_json:
        print_json(reply)
        return
    if not reply["workflows"]:
        out("no workflows" + (" match" if state or name else
                              ": create one with 'rota workflows create FILE.json' or"
                              " Client.chain/group/batch"))
        return
    out(f"{'ID':<38} {'NAME':<20} {'TYPE':<6} {'STATE':<10} {'COMPLETED':>11} {'FAILED':>6}"
        " CREATED")
    for row in reply["workflows"]:
        done = f"{row['completed_count']}/{row['job_count']}"
        out(f"{row['id']:<38} {row.get('name') or '-':<20} {row['type']:<6}"
            f" {row['state']:<10} {done:>11} {row['failed_count']:>6} {row['created_at']}")
    if reply.get("next"):
        out(f"(more: --limit {min(500, limit * 2)} shows more)" if limit < 500 else
            "(more than 500: narrow them with --state or --name)")


@workflows.command("show")
@click.argument("workflow_id")
@click.option("--json", "as_json", is_flag=True, help="Print GET /workflows/{id} as JSON.")
@URL_OPTION
def show(workflow_id: str, as_json: bool, url: str) -> None:
    """Show workflow WORKFLOW_ID: its state, counts, errors and its steps as a tree, each
    with its state and job id ('rota jobs show JOB' for one)."""
    view = api(url, "workflow", workflow_id).view
    if as_json:
        print_json(view)
    else:
        print_workflow(view)


@workflows.command("cancel")
@click.argument("workflow_id")
@URL_OPTION
def cancel(workflow_id: str, url: str) -> None:
    """Cancel workflow WORKFLOW_ID: its steps not yet done are cancelled, running jobs
    through their workers."""
    print_workflow(api(url, "cancel_workflow", workflow_id).view)


@workflows.command("retry")
@click.argument("workflow_id")
@URL_OPTION
def retry(workflow_id: str, url: str) -> None:
    """Resume failed workflow WORKFLOW_ID from its failed steps."""
    print_workflow(api(url, "retry_workflow", workflow_id).view)


@workflows.command("create")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@URL_OPTION
def create(file: Path, url: str) -> None:
    """Create the workflow FILE defines: a JSON chain, group or batch, as POST /workflows
    takes it ("-" reads standard input)."""
    try:
        text = click.get_text_stream("stdin").read() if str(file) == "-" else file.read_text()
    except OSError as exc:
        fail(f"cannot read {file}: {exc.strerror or exc}")
    except UnicodeDecodeError:
        fail(f"{file} is not UTF-8 text: give a JSON workflow definition")
    try:
        definition = json.loads(text)
    except json.JSONDecodeError as exc:
        fail(f"{file} is not JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}")
    if not isinstance(definition, dict):
        fail(f"{file} holds no JSON object: a workflow is {{\"type\": \"chain\", \"steps\":"
             " [...]}, or a group or batch")
    flow = api(url, "create_workflow", definition)
    if not flow.created:
        out("a workflow with this id exists already (the same definition):", err=True)
    print_workflow(flow.view)
