"""The server's endpoint signing secrets: ``SecretBook.secret_values(name)``, what a delivery signs with, from the environment (``ROTA_SECRET_<NAME>``) first, else the database; and setting, listing and deleting the database's (``/secrets``).

The database's rows are held in memory: read at start, changed here after each commit,
and read again when another server sharing PostgreSQL changed one (its ``rota_secrets``
notice, rota/server/cluster.py). A lookup reads no row: a dict and the environment.
The rules (env names, values, rotation windows) are rota/core/secrets.py's.
"""

from __future__ import annotations

import logging
import os
import secrets as random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rota.base.errors import Invalid, NotFound
from rota.base.protocol import rfc3339
from rota.base.specs import JobSpec
from rota.core.secrets import (DEFAULT_WINDOW, ENV_PREFIX, env_name, in_force, value_problem,
                               window_problem)
from rota.store.store import Store

log = logging.getLogger("rota.server")


def generated() -> str:
    """A new secret: 32 random bytes, URL-safe base64 (43 printable characters)."""
    return random.token_urlsafe(32)


class SecretBook:
    def __init__(self, store: Store, wall: Callable[[], float],
                 environ: Mapping[str, str] = os.environ) -> None:
        self.store = store
        self.wall = wall  # the time now, in seconds since the epoch (the coordinator's clock)
        self.environ = environ
        self.rows: dict[str, dict[str, Any]] = {}  # the database's, by name

    # -- the lookup (the deliverer's and the push's) ----------------------------------------
    def secret_values(self, name: str) -> list[bytes] | None:
        """The values to sign with for secret ``name``: the environment's, or the
        database's current one and, while a rotation's window lasts, the one it
        replaced; None if it is set nowhere. (An empty variable counts as unset.)"""
        value = self.environ.get(env_name(name))
        if value:
            return [value.encode("utf-8", "surrogateescape")]  # (os.environ's bytes)
        row = self.rows.get(name)
        if row is None:
            return None
        return [v.encode() for v in in_force(row, self.wall())]

    def known(self, name: str) -> bool:
        return self.source(name) is not None

    def source(self, name: str) -> str | None:
        """Where secret ``name`` comes from: "env", "db", or None (nowhere)."""
        if self.environ.get(env_name(name)):
            return "env"
        return "db" if name in self.rows else None

    # -- kept in step with the database ----------------------------------------------------
    def load(self, rows: dict[str, dict[str, Any]]) -> None:
        self.rows = rows

    async def reload(self) -> None:
        """Read the table again (at start, or after another server changed it)."""
        self.load(await self.store.secrets())

    def announce(self) -> None:
        """At start: one line naming where the secrets come from (never a value), and one
        for each variable of the environment whose value breaks the rule (used anyway:
        the operator chose it, and a receiver may hold it already)."""
        variables = sorted(k for k, v in self.environ.items() if k.startswith(ENV_PREFIX) and v)
        for variable in variables:
            if (problem := value_problem(self.environ[variable])) is not None:
                log.warning("secret %s from the environment: %s (used as it is)", variable,
                            problem)
        if variables or self.rows:
            log.info("secrets: %d in the database, %d from the environment%s", len(self.rows),
                     len(variables), f" ({', '.join(variables)})" if variables else "")

    # -- the API's ---------------------------------------------------------------------------
    async def set(self, name: str, value: str | None, window: float | None
                  ) -> tuple[dict[str, Any], str, str | None]:
        """Store secret ``name`` (``value``, or one generated when None), the value it
        replaces staying valid ``window`` seconds (default a day). Its view, the change
        ("new", "rotated", "unchanged") and the generated value (shown only this once)."""
        window = DEFAULT_WINDOW if window is None else window
        if (problem := window_problem(window)) is not None:
            raise Invalid("invalid_window", problem)
        made = generated() if value is None else None
        value = made if made is not None else value
        assert value is not None
        if (problem := value_problem(value)) is not None:
            raise Invalid("invalid_secret", f"secret {name}: {problem}")
        row, change = await self.store.set_secret(name, value, self.wall(), window)
        self.rows[name] = row
        if change != "unchanged":
            log.info("secret %s %s%s", name, change, " (the environment's is used here:"
                     f" {env_name(name)})" if self.source(name) == "env" else "")
        return self.view(name), change, made

    async def delete(self, name: str, specs: Iterable[JobSpec]) -> dict[str, Any]:
        """Delete the database's secret ``name``; its view now, with the specs of the
        status quo (``specs``) that name it: if it is set nowhere else, their deliveries
        cannot be signed until it is set again (said, and logged, not refused)."""
        row = await self.store.delete_secret(name)
        if row is None:
            self.rows.pop(name, None)
            raise NotFound("not_found", f"no secret {name} in the database"
                           + (f" (this server takes it from {env_name(name)})"
                              if self.source(name) == "env" else ""))
        self.rows.pop(name, None)
        users = sorted(s.name for s in specs if s.execute is not None
                       and s.execute.secret == name)
        stranded = users and not self.known(name)
        log.log(logging.WARNING if stranded else logging.INFO, "secret %s deleted%s", name,
                f": spec(s) {', '.join(users)} name it, set nowhere now" if stranded else "")
        return self.view(name, row, specs=users)  # (its source now: the environment's, or none)

    def listing(self, specs: Iterable[JobSpec]) -> list[dict[str, Any]]:
        """Every secret the database holds or a spec of the status quo names, with where
        it comes from (None: nowhere, so that spec's deliveries cannot be signed)."""
        users: dict[str, list[str]] = {}
        for spec in specs:
            if spec.execute is not None:
                users.setdefault(spec.execute.secret, []).append(spec.name)
        return [self.view(name, specs=sorted(users.get(name, [])))
                for name in sorted(self.rows.keys() | users.keys())]

    def view(self, name: str, row: dict[str, Any] | None = None, *,
             specs: list[str] | None = None) -> dict[str, Any]:
        """A secret as the API shows it: never a value."""
        row = row if row is not None else self.rows.get(name)
        stamp = (lambda key: rfc3339(row[key]) if row is not None and row[key] is not None
                 else None)
        view = {"name": name, "source": self.source(name), "env": env_name(name),
                "created_at": stamp("created_at"), "updated_at": stamp("updated_at"),
                "rotated_at": stamp("rotated_at"),
                "previous_valid_until": (stamp("previous_until") if row is not None
                                         and len(in_force(row, self.wall())) > 1 else None)}
        if specs is not None:
            view["specs"] = specs
        return view
