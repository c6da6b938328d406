"""Flow control as the shell carries it out: the limits in force (spec files' rules overlaid by those set at runtime) handed to the engine, set and cleared over the API, and kept in step with other servers.

The spec file declares a scope's default; ``rota limits set`` (``PUT /limits/{kind}/{name}``)
replaces it until ``rota limits clear``. Every change (a push, a set, a clear, another
server's) hands the engine the whole table again (``Engine.set_limits``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from rota.base.errors import Invalid, NotFound
from rota.base.flow import WrittenRule
from rota.base.protocol import rfc3339
from rota.core.auth import Principal
from rota.core.effects import Effect
from rota.core.engine import Engine
from rota.core.intake import unknown_spec
from rota.core.limits import LimitRule, Rate, Scope, check_rule, check_scope, limit_name
from rota.core.rulebook import effective, rule_of, spec_rules
from rota.core.model import Instant
from rota.server.shell_reads import new_queue_problems
from rota.store.limits import rule_text
from rota.store.store import Store

log = logging.getLogger("rota.server")


class Limiting:
    def __init__(self, store: Store, engine: Engine, clock: Callable[[], Instant],
                 apply: Callable[[Iterable[Effect]], None]) -> None:
        self.store = store
        self.engine = engine
        self.clock = clock
        self.apply = apply
        # Rules set at runtime, by scope, with their rows (when, by whom).
        self.runtime: dict[Scope, tuple[LimitRule, dict[str, Any]]] = {}
        self.in_force: dict[Scope, LimitRule] = {}  # the table the engine was last handed

    def load(self, rows: list[dict[str, Any]],
             starts: dict[tuple[str, str | None], list[float]] | None = None) -> None:
        """Take the runtime table as stored (at start, with the rate starts kept, or after
        another server changed it) and hand the engine the limits in force. A row this
        Rota cannot read is left out, and said."""
        runtime = {}
        for row in rows:
            try:
                rule = msgspec.json.decode(row["rule"], type=LimitRule)
                check_rule(rule)
            except (msgspec.ValidationError, msgspec.DecodeError, Invalid) as exc:
                log.warning("limit %s:%s is stored unreadable, and not applied: %s",
                            row["kind"], row["name"], exc)
                continue
            runtime[(row["kind"], row["name"])] = (rule, row)
        self.runtime = runtime
        self.refresh(starts)

    async def reread(self) -> None:
        """Another server set or cleared a limit: the table as stored takes effect here."""
        self.load(await self.store.runtime_limits())

    def refresh(self, starts: dict[tuple[str, str | None], list[float]] | None = None) -> None:
        """Hand the engine every limit in force (after a push, too: a spec's own may change)."""
        self.in_force = effective(self.engine.specs,
                                  {s: rule for s, (rule, _) in self.runtime.items()})
        self.apply(self.engine.set_limits(self.in_force, self.clock(), starts))

    # -- the API's -------------------------------------------------------------------------
    async def set(self, kind: str, name: str, written: WrittenRule, by: Principal
                  ) -> dict[str, Any]:
        """Set a scope's runtime rule: stored first (a restart and the other servers keep
        it), then in force here."""
        scope = check_scope(kind, name)
        await self._known(scope)
        rule = rule_of(written)
        now = self.clock()
        who = by.name if by.token_id is not None else None
        await self.store.set_limit(kind, name, rule_text(rule), now.wall, who)
        self.runtime[scope] = (rule, {"kind": kind, "name": name, "updated_at": now.wall,
                                      "updated_by": who})
        log.info("limit set limit=%s rule=%s by=%s", limit_name(scope), rule_text(rule),
                 who or "-")
        self.refresh()
        return self.entry(scope, rule)

    async def queue_rate(self, queue: str, rate: Rate) -> None:
        """An OJS job's ``rate_limit`` sets its queue's rate (docs/ojs.md): as ``set``, the
        queue's other limits kept, when the rate in force differs (the last job's wins)."""
        scope = ("queue", queue)
        rule = self.in_force.get(scope) or LimitRule()
        if rule.rate == rate:
            return
        now = self.clock()
        rule = msgspec.structs.replace(self.runtime.get(scope, (rule, {}))[0], rate=rate)
        check_rule(rule)
        await self.store.set_limit("queue", queue, rule_text(rule), now.wall, None)
        self.runtime[scope] = (rule, {"kind": "queue", "name": queue, "updated_at": now.wall,
                                      "updated_by": None})
        log.info("limit set limit=%s rule=%s by=ojs-job", limit_name(scope), rule_text(rule))
        self.refresh()

    async def clear(self, kind: str, name: str) -> dict[str, Any]:
        """Remove a scope's runtime rule: its spec file's (if any) is in force again."""
        scope = check_scope(kind, name)
        if not await self.store.set_limit(kind, name, None, self.clock().wall):
            said = limit_name(scope)
            spec = self.engine.specs.get(name) if kind == "spec" else None
            if spec is not None and spec.limits is not None:  # not for clear to remove
                raise NotFound("no_such_limit", f"no limit is set at runtime for {said}: its"
                               " spec file's [limits] is in force until a new version of the"
                               f" spec is pushed; `rota limits set {said}` overrides it")
            raise NotFound("no_such_limit", f"no limit is set at runtime for {said}"
                           " (`rota limits` lists them)")
        self.runtime.pop(scope, None)
        log.info("limit cleared limit=%s", limit_name(scope))
        self.refresh()
        default = spec_rules({name: self.engine.specs[name]}).get(scope) \
            if kind == "spec" and name in self.engine.specs else None
        return {"limit": limit_name(scope), "cleared": True,
                "now": None if default is None else self.entry(scope, default)}

    def view(self) -> dict[str, Any]:
        """``GET /limits``: every rule in force, where it comes from, and (when the engine
        measures it) its use."""
        rules = self.in_force
        answer: dict[str, Any] = {"limits": [self.entry(scope, rules[scope])
                                             for scope in sorted(rules)]}
        use = getattr(self.engine, "limit_use", None)  # (CORE's: every rule's current use)
        if use is not None:
            answer["use"] = msgspec.to_builtins(use(self.clock()))
        return answer

    def entry(self, scope: Scope, rule: LimitRule) -> dict[str, Any]:
        kept = self.runtime.get(scope)
        row = kept[1] if kept is not None else {}
        return {"limit": limit_name(scope), "kind": scope[0], "name": scope[1],
                "rule": msgspec.to_builtins(rule),
                "source": "runtime" if kept is not None else "spec_file",
                "updated_at": None if row.get("updated_at") is None else rfc3339(
                    row["updated_at"]), "updated_by": row.get("updated_by")}

    async def _known(self, scope: Scope) -> None:
        """A limit on a name nothing has is a slip (a spec never pushed, a misspelt
        queue): refused, as a pause of one is (issue 22)."""
        kind, name = scope
        if kind == "spec" and name not in self.engine.specs:
            raise Invalid("unknown_spec", unknown_spec(name, self.engine.specs))
        if kind == "queue":
            problems = await new_queue_problems(self.store, self.engine, [name])
            if name in problems:
                raise Invalid("unknown_queue", problems[name])
