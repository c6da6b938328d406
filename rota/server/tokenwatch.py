"""Token watching: the token table the server authenticates with, kept as the store has
it, and the HTTP requests that stay open per token (ended when their token is revoked).

Tokens are created and revoked from the CLI straight into the store as well as through
the API, so the table is read again every heartbeat interval (``loop``), at once after
this server's own changes, and on demand when a request names a token not known yet
(``reread``). A change is handed to ``on_change`` with the new table's check, for the
engine to close the revoked tokens' workers. The Coordinator owns one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rota.core.auth import Principal, Tokens, new_token
from rota.base.errors import NotFound, StorageError
from rota.store.store import Store

log = logging.getLogger("rota.server")
REREAD_EVERY = 0.1  # seconds: the most often an unknown token makes the server look


@dataclass(eq=False, slots=True)
class Hold:
    """An HTTP request that stays open, of one token (TokenWatch.hold)."""

    principal: Principal
    revoked: asyncio.Future[None]


class TokenWatch:
    def __init__(self, store: Store, *, every: float, max_holds: int,
                 monotonic: Callable[[], float],
                 on_change: Callable[[Callable[[Principal], bool]], None]) -> None:
        self.store = store
        self.every = every  # seconds between looks (the heartbeat interval)
        self.max_holds = max_holds  # open requests per token (max_waits_per_token)
        self.monotonic = monotonic
        self.on_change = on_change
        self.tokens = Tokens()
        self.waits: collections.Counter[str | None] = collections.Counter()  # per token id
        self._holds: set[Hold] = set()
        self._rows: list[dict[str, Any]] = []
        self._reread: asyncio.Future[None] | None = None  # see reread
        self._reading = asyncio.Lock()  # see refresh
        self._reread_at = -REREAD_EVERY

    async def loop(self) -> None:
        """Look every interval, so that a revoked worker is gone within one."""
        failed = ""
        while True:
            await asyncio.sleep(self.every)
            try:
                await self.refresh()
            except StorageError:  # the store's health says so; the last table stands
                pass
            except Exception as exc:  # a bug: said once, and the loop goes on, or a
                # revoked token would keep working and a new one never be required
                if str(exc) != failed:
                    log.exception("reading the tokens failed; the last table stands")
                failed = str(exc)
            else:
                failed = ""

    async def reread(self) -> None:
        """Read the tokens now, for a request whose token is not known yet: `rota tokens
        create` writes the store, and a token used at once was refused until the next
        look (up to a heartbeat interval). Reads are shared by the requests that come
        while one runs, and made at most every REREAD_EVERY seconds (an unknown id costs
        a caller nothing more than that)."""
        if self._reread is None:
            now = self.monotonic()
            if now - self._reread_at < REREAD_EVERY:
                return
            self._reread_at = now
            self._reread = asyncio.ensure_future(self.refresh())
            self._reread.add_done_callback(self._reread_done)
        await asyncio.shield(self._reread)

    def _reread_done(self, future: asyncio.Future[None]) -> None:
        self._reread = None
        if not future.cancelled() and future.exception() is not None:
            log.warning("reading tokens failed: %s", future.exception())

    async def refresh(self) -> None:
        """Read the table; if it changed, take it and end what revoked tokens hold. One
        read at a time (the loop's, a request's for an unknown token, a test's): reads
        run on a pool of threads, and one that began before a token was created must not
        be taken after one that began after."""
        async with self._reading:
            rows = await self.store.live_tokens()
            if rows != self._rows:
                self._take(rows)

    def _take(self, rows: list[dict[str, Any]]) -> None:
        was_required = self.tokens.required
        self._rows, self.tokens = rows, Tokens(rows)
        log.info("tokens live=%d auth=%s", len(rows), "on" if self.tokens.required else "off")
        if was_required and not self.tokens.required:
            log.warning("AUTH IS OFF: the last token was revoked")
        self.on_change(self.tokens.valid)
        ended: collections.Counter[str | None] = collections.Counter()
        for hold in self._holds:
            if not hold.revoked.done() and not self.tokens.valid(hold.principal):
                hold.revoked.set_result(None)
                ended[hold.principal.token_id] += 1
        for token_id, n in ended.items():
            log.warning("token revoked token=%s: ending %d HTTP stream(s) and wait(s)",
                        token_id or "none", n)

    # -- HTTP requests that stay open (GET /events, result waits) ---------------------
    def hold(self, principal: Principal) -> Hold | None:
        """Count an HTTP request that stays open against its token's share (None: the
        token has ``max_holds`` open already); its ``revoked`` resolves if the token is
        revoked meanwhile. ``release`` it when it ends."""
        if self.waits[principal.token_id] >= self.max_holds:
            return None
        self.waits[principal.token_id] += 1
        hold = Hold(principal, asyncio.get_running_loop().create_future())
        self._holds.add(hold)
        if not self.tokens.valid(principal):  # revoked since the request was let in
            hold.revoked.set_result(None)
        return hold

    def release(self, hold: Hold) -> None:
        if hold in self._holds:
            self._holds.remove(hold)
            token_id = hold.principal.token_id
            self.waits[token_id] -= 1
            if self.waits[token_id] <= 0:
                del self.waits[token_id]

    # -- changes through the API --------------------------------------------------------
    async def create(self, scope: str, name: str | None, queues: list[str] | None
                     ) -> tuple[str, dict[str, Any]]:
        """A new token (POST /tokens): its secret, shown this once, and its row. In force
        at once: the first one turns authentication on before the answer leaves."""
        token_id, secret, hashed = new_token()
        row = await self.store.create_token(name=name or f"{scope}-{token_id}", scope=scope,
                                            queues=queues, token_id=token_id, hashed=hashed)
        await self.refresh()
        return secret, row

    async def revoke(self, id_or_name: str) -> list[dict[str, Any]]:
        """Revoke tokens (DELETE /tokens/{token}), at once: their workers are closed."""
        rows = await self.store.revoke_token(id_or_name)
        if not rows:
            raise NotFound("not_found", f"no live token with id or name {id_or_name!r}")
        await self.refresh()
        return rows
