"""What a server checks and takes before it serves, in order, each refusal one sentence.

1. the database file's one-server lock (rota/store/dblock.py, which also refuses a file with
   hard links): first, so a second server does not even migrate the file; a PostgreSQL
   database has no lock, several servers share it;
2. the listening socket: then, so a busy port migrates nothing;
3. the database opened and migrated (a database of a newer Rota is refused), which
   reads its tokens;
4. on PostgreSQL, this server's id, unless a live server holds it (two under one name
   would share a lease);
5. no tokens on an address that is not loopback: refused without ``insecure``.

``rota serve`` and ``rota demo`` (rota/cli/serve.py, rota/cli/worker.py) call these and
print a ``Refused`` as their one line of error.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
import socket
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from rota.base.errors import DatabaseInUse, DatabaseLinked, RotaError
from rota.core.settings import ServerSettings, loopback

# The writer thread hands a commit back to a busy event loop only when the loop lets go
# of the GIL; by default that can take 5 ms. 0.5 ms: 5-7% more jobs/s in a drain of
# 10,000 no-op jobs (docs/performance.md), and a shorter worst case on the idle path.
SWITCH_INTERVAL = 0.0005  # seconds, for sys.setswitchinterval
T = TypeVar("T")


class Refused(RotaError):
    """The server cannot start: the message says why, in one line."""

    def __init__(self, message: str) -> None:
        super().__init__("refused", message)


@contextlib.contextmanager
def taken(db: Path | None, host: str, port: int) -> Iterator[socket.socket]:
    """Hold the SQLite file's lock (``db``; None on PostgreSQL) and the listening socket
    while the block runs; both go however it ends (uvicorn closes the socket too)."""
    with contextlib.ExitStack() as held:
        if db is not None:
            held.enter_context(hold(db))
        yield held.enter_context(contextlib.closing(listen(host, port)))


@contextlib.contextmanager
def started(settings: ServerSettings, *, insecure: bool) -> Iterator[socket.socket]:
    """Every check above, holding the lock and the socket while the block runs: the
    socket to serve on. Raises ``Refused``."""
    from rota.store.tokens import server_id_in_use

    url = settings.database_url
    with taken(settings.db if url is None else None, settings.host, settings.port) as sock:
        db: Path | str = settings.db if url is None else url
        tokens = _opened(db)
        if url is not None:
            server_id = settings.server_id or f"{socket.gethostname()}:{settings.port}"
            in_use = _checked(db, lambda: server_id_in_use(url, server_id))
            if in_use is not None:
                raise Refused(in_use)
        if not tokens and not loopback(settings.host) and not insecure:
            raise Refused(
                f"refusing to serve on {settings.host} with no tokens: anyone who reaches"
                " it could take jobs and give orders. Create one with 'rota tokens create"
                " --scope admin', or pass --insecure")
        yield sock


@contextlib.contextmanager
def hold(db: Path) -> Iterator[None]:
    """The database's one-server lock while the block runs (docs/operations.md, One
    server per database). ``rota tokens`` takes no lock: it writes the file beside a
    running server, through SQLite's own locking."""
    from rota.store.dblock import hold_database

    with contextlib.ExitStack() as held:
        try:
            held.enter_context(hold_database(db))
        except (DatabaseInUse, DatabaseLinked) as exc:
            raise Refused(exc.message) from None
        except OSError as exc:
            raise Refused(f"cannot open the database {db}: {exc.strerror} ({exc.filename})"
                          ) from None
        yield


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, or ``Refused`` saying why there is none."""
    from rota.server.app import listen_socket

    try:
        return listen_socket(host, port)
    except OSError as exc:
        reason = ("the port is in use (another rota serve? pick one with --port)"
                  if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc))
        raise Refused(f"cannot listen on {host}:{port}: {reason}") from None


def _opened(db: Path | str) -> list[dict[str, object]]:
    """The live tokens, read after opening the database and applying any migration: the
    first write of a start."""
    from rota.store.sqlite import NewerDatabase
    from rota.store.tokens import list_tokens

    try:
        return _checked(db, lambda: list_tokens(db))
    except NewerDatabase as exc:
        raise Refused(exc.message) from None


def _checked(db: Path | str, call: Callable[[], T]) -> T:
    """``call()``, with a database that cannot be used as ``Refused``."""
    try:
        return call()
    except Exception as exc:
        if (failure := database_failure(db, exc)) is None:
            raise
        raise Refused(failure) from None


def database_failure(db: Path | str, exc: BaseException) -> str | None:
    """One line for a database that cannot be used (an SQLite error, a PostgreSQL server
    that is down or refuses us, a malformed URL); None if ``exc`` is none of these."""
    from rota.store.sqlite import storage_error

    where = db if isinstance(db, Path) else redacted(db)
    if isinstance(exc, sqlite3.Error):
        storage = storage_error(exc)
        return f"cannot open the database {where}: " + (
            f"{storage.message} [{storage.code}]" if storage is not None else str(exc))
    try:
        import psycopg
    except ImportError:
        return None
    if not isinstance(exc, psycopg.Error):
        return None
    from rota.store import pg

    storage = pg.storage_error(exc)
    if storage is not None:
        return f"cannot open the database {where}: {storage.message} [{storage.code}]"
    # A malformed URL, a refused login, a missing database: what PostgreSQL said, on one
    # line (libpq's messages run over several).
    said = " ".join(str(exc).split()) or type(exc).__name__
    return f"cannot open the database {where}: {said}"


def redacted(url: str) -> str:
    """A database URL without its password."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (it is a server dependency): a faster event loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
