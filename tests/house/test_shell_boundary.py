"""Nothing outside the shell reaches past it: routes, the dashboard, the feeds, the CLI
and the sessions ask the ``Coordinator``'s methods, never its ``store``, ``scheduler``
or ``engine`` (issue 21: "zero reaches past the shell").

The rule, checked on every module's syntax tree: outside the shell's own modules, no
attribute named ``store``, ``scheduler`` or ``engine`` is read, whatever it is read
from (``coordinator.store``, ``self.coordinator.engine``,
``request.app.state.coordinator.scheduler``, ``c.store``), nor through ``getattr`` with
that name. It does not guess which names hold a coordinator: no module outside the shell
has a reason to read such an attribute of anything, so any is counted. Two exceptions,
neither a reach: the engine's own modules read their ``self.scheduler`` (the engine owns
it), and a dotted module path (``rota.store.store``) is an import, not an object.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "rota"
PAST = {"store", "scheduler", "engine"}
# The shell: the Coordinator, the mixins it inherits, and the cluster shell, which
# applies other servers' notices to the engine.
SHELL = {"server." + name for name in ("coordinator", "shell_reads", "shell_directives", "cluster",
                                       "admission", "steering", "tokenwatch", "upkeep",
                                       "watching", "limiting", "composing", "clockwork",
                                       "pulling", "ojs_shell", "ojs_operating", "pushing",
                                       "callbacks", "secretbook")}
ENGINE = {"core.engine", "core.intake", "core.reservations", "core.heartbeats",
          "core.timers", "core.lines", "core.pulls",
          "core.endpoints"}  # the engine and its parts (mixins)


def reaches(source: str, module: str = "") -> list[str]:
    """Each reach past the shell in ``source``, as ``line: text``, in the source's order."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in PAST:
            owner = node.value
            root = owner
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "rota":
                continue  # rota.store.store: a module
            if module in ENGINE and isinstance(owner, ast.Name) and owner.id == "self":
                continue
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PAST):
            found.append((node.lineno, node.col_offset, ast.unparse(node)))
    return [f"{line}: {text}" for line, _, text in sorted(found)]


def test_the_rule_counts_every_form_of_reach():
    source = """
coordinator.store.get_job(job_id)
self.coordinator.engine.observe
request.app.state.coordinator.scheduler.live()
c = _coordinator(request); c.store
getattr(coordinator, "engine")
import rota.store.store
rota.store.store.token_view(row)
coordinator.get_job(job_id)
self.scheduler.jobs
"""
    assert [r.split(": ")[1] for r in reaches(source)] == [
        "coordinator.store", "self.coordinator.engine",
        "request.app.state.coordinator.scheduler", "c.store",
        "getattr(coordinator, 'engine')", "self.scheduler"]
    assert reaches("self.scheduler.jobs", "core.intake") == []  # the engine's own
    assert reaches("self.coordinator.scheduler", "core.intake") != []


def test_nothing_outside_the_shell_reaches_past_it():
    modules = {".".join(path.relative_to(PACKAGE).with_suffix("").parts): path
               for path in PACKAGE.rglob("*.py")}
    assert SHELL | ENGINE <= set(modules), "a module named here was renamed or removed"
    found = {name: reaches(path.read_text(), name) for name, path in sorted(modules.items())
             if name not in SHELL}
    assert {name: r for name, r in found.items() if r} == {}
