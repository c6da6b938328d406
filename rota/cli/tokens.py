"""``rota tokens``: create, list and revoke bearer tokens, over the server's API (--url)
or on its database (--db), so that the first token needs no server."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from rota.cli.base import DATABASE
from rota.cli.base import TOKEN_OPTION as _TOKEN
from rota.cli.base import api as _api
from rota.cli.base import fail as _fail
from rota.cli.base import need_server as _need_server
from rota.cli.base import out as _out


DB_OPTION = click.option("--db", envvar="ROTA_DB", default="rota.db", show_default=True,
                         show_envvar=True, type=DATABASE,
                         help="The server's SQLite file or PostgreSQL URL (tokens are kept"
                         " there).")


def TOKENS_TARGET(command: Callable[..., Any]) -> Callable[..., Any]:  # noqa: N802
    """Where tokens are managed: the server's API (--url, with an admin --token), or
    its database file (--db)."""
    url = click.option("--url", envvar="ROTA_URL", show_envvar=True, default=None,
                       help="Manage the tokens of the server at this base URL, over its API"
                       " (with an admin token); without it, the --db file.")
    return url(_TOKEN(DB_OPTION(command)))


def _over_api(url: str | None) -> bool:
    """--url (or ROTA_URL) means the API, unless --db is given on the command line: an
    explicit file beats a URL left in the environment. Both given: refused."""
    explicit = click.core.ParameterSource.COMMANDLINE
    ctx = click.get_current_context()
    if url is None:
        return False
    if ctx.get_parameter_source("db") is explicit:
        if ctx.get_parameter_source("url") is explicit:
            _fail("give --url (the server's API) or --db (its file), not both")
        return False
    return True


def _token_file(db: Path | str, *, create: bool = False, offer_create: bool = False
                ) -> Path | str:
    """The database file, which must exist unless ``create``: a mistyped --db, or a run
    in another directory, would otherwise make a new database the server never reads.
    (A PostgreSQL URL names a database that exists, or connecting says it does not.)"""
    _need_server("tokens")
    if isinstance(db, Path) and not create and not db.exists():
        _fail(f"no database at {db.resolve()}: pass the server's file with --db, or use the"
              " server's API with --url and an admin --token"
              + ("; --create makes a new one, for the first token before any server ran"
                 if offer_create else ""))
    if isinstance(db, Path):
        from rota.store.dblock import refuse_linked
        from rota.base.errors import DatabaseLinked

        try:
            refuse_linked(db)
        except DatabaseLinked as exc:
            _fail(exc.message)
    return db


def _on_file(action: Callable[..., Any], db: Path | str, *args: Any, **kwargs: Any) -> Any:
    """Run a token ``action`` on the database; its refusals in one line."""
    from rota.store.sqlite import NewerDatabase
    from rota.base.errors import Conflict
    from rota.server.startup import database_failure

    try:
        return action(db, *args, **kwargs)
    except (Conflict, NewerDatabase) as exc:
        _fail(exc.message)
    except Exception as exc:
        if (failure := database_failure(db, exc)) is None:
            raise
        _fail(failure)


@click.group()
def tokens() -> None:
    """Create, list and revoke bearer tokens: over the server's API with --url (or
    ROTA_URL) and an admin --token, from anywhere; or on its database file (--db), so the
    first token needs no server (a running server sees changes within a second)."""


@tokens.command("create")
@click.option("--scope", required=True, type=click.Choice(["worker", "producer", "admin", "metrics"]),
              help="worker: /work; producer: enqueue, read specs, read and cancel its own jobs;"
              " metrics: GET /metrics only; admin: all.")
@click.option("--queues", help="Limit the token to these queues (comma-separated).")
@click.option("--name", help="A name to know it by (default: scope and id).")
@click.option("--create", "create_db", is_flag=True,
              help="Create the --db file if it does not exist (the first token, before any"
              " server ran; 'rota serve' creates it too).")
@TOKENS_TARGET
def tokens_create(scope: str, queues: str | None, name: str | None, create_db: bool,
                  db: Path | str, url: str | None) -> None:
    """Create a token and print it. It is shown only this once: the store keeps a hash."""
    from rota.base.ids import TOKEN_NAME_PATTERN, TOKEN_NAME_RULE
    from rota.base.logs import printable
    from rota.base.specs import NAME_PATTERN

    if name is not None and not re.match(TOKEN_NAME_PATTERN, name):
        _fail(f"{printable(name)!r} is not a token name: {TOKEN_NAME_RULE}")
    limited = [q.strip() for q in queues.split(",") if q.strip()] if queues else None
    for queue in limited or []:
        if not re.match(NAME_PATTERN, queue):
            _fail(f"{queue!r} is not a queue name")
    if _over_api(url):
        assert url is not None
        made = _api(url, "create_token", scope, name=name, queues=limited)
        token_id, secret = made["id"], made["token"]
    else:
        path = _token_file(db, create=create_db, offer_create=True)
        from rota.core.auth import new_token
        from rota.store.tokens import create_token

        token_id, secret, hashed = new_token()
        _on_file(create_token, path,
                 name=name or f"{scope}-{token_id}", scope=scope, queues=limited,
                 token_id=token_id, hashed=hashed)
    _out(secret)
    _out(f"token {token_id} ({scope}{', queues ' + ','.join(limited) if limited else ''})"
         " created; copy it now, it is not shown again", err=True)


@tokens.command("list")
@TOKENS_TARGET
def tokens_list(db: Path | str, url: str | None) -> None:
    """The live tokens: id, name, scope, queues, when created (never the secret)."""
    if _over_api(url):
        assert url is not None
        rows = _api(url, "tokens")["tokens"]
    else:
        path = _token_file(db)
        from rota.store.tokens import list_tokens, token_view

        rows = [token_view(row) for row in _on_file(list_tokens, path)]
    if not rows:
        _out("no tokens: the server runs open (loopback only)")
    for row in rows:
        queues = ",".join(row["queues"]) if row["queues"] else "*"
        _out(f"{row['id']}  {row['scope']:<8} queues={queues}  name={row['name']}"
             f"  created={row['created_at']}")


@tokens.command("revoke")
@click.argument("which", metavar="TOKEN")  # not "token": --token is the caller's own
@TOKENS_TARGET
def tokens_revoke(which: str, db: Path | str, url: str | None) -> None:
    """Revoke TOKEN (its id or name): its calls are refused and its workers disconnected."""
    if _over_api(url):
        assert url is not None
        _api(url, "revoke_token", which)
    else:
        path = _token_file(db)
        from rota.store.tokens import revoke_token

        if not _on_file(revoke_token, path, which):
            _fail(f"no live token with id or name {which!r}")
    _out(f"revoked {which}")
