"""``rota tokens``: refused on a database file that does not exist (a mistyped --db, or a
run in another directory, would make one the server never reads), and managed over the
API with --url from anywhere."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Live
from helpers import rota
from helpers import bearer, make_token, wait_until

from rota.core.auth import new_token
from rota.store.tokens import create_token


@pytest.mark.parametrize("command", [["create", "--scope", "admin"], ["list"],
                                     ["revoke", "ops"]])
async def test_a_missing_database_file_is_refused_not_created(tmp_path: Path,
                                                              command: list[str]):
    db = tmp_path / "mistyped.db"
    code, out, err = await rota("tokens", *command, "--db", str(db))
    assert code == 1 and out == ""
    assert err.startswith(f"error: no database at {db}: ") and len(err.splitlines()) == 1
    assert ("--create" in err) == (command[0] == "create")  # only create may make one
    assert not db.exists()


async def test_create_makes_the_first_database_when_asked(tmp_path: Path):
    db = tmp_path / "rota.db"
    code, out, err = await rota("tokens", "create", "--scope", "admin", "--name", "ops",
                                "--create", "--db", str(db))
    assert code == 0 and out.startswith("rota_"), err
    code, out, _ = await rota("tokens", "list", "--db", str(db))
    assert code == 0 and "name=ops" in out


async def test_tokens_over_the_api_from_another_directory(live: Live, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The server runs open: the first token comes from the API as from the file, and
    # turns authentication on before its answer leaves.
    code, out, err = await rota("tokens", "create", "--scope", "admin", "--name", "ops",
                                "--url", live.base, cwd=elsewhere)
    assert code == 0 and out.startswith("rota_") and "not shown again" in err, err
    admin = out.strip()
    assert (await live.http.get("/specs")).status_code == 401
    assert list(elsewhere.iterdir()) == []  # no stray rota.store.sqlite
    env = {"ROTA_URL": live.base, "ROTA_TOKEN": admin}
    code, out, _ = await rota("tokens", "create", "--scope", "producer", "--queues", "a,b",
                              "--name", "web", env=env)
    assert code == 0
    producer = out.strip()
    code, out, err = await rota("tokens", "create", "--scope", "worker", "--name", "web", env=env)
    assert (code, err) == (1, "error: a live token is already named 'web' (token_name_taken)\n")
    code, out, _ = await rota("tokens", "list", env=env)
    listed = {line.split()[0]: line for line in out.splitlines()}
    assert code == 0 and set(listed) == {admin.split("_")[1], producer.split("_")[1]}
    assert "queues=a,b  name=web" in listed[producer.split("_")[1]]
    assert admin.split("_", 2)[2] not in out  # never a secret
    # Only an admin manages tokens; a revoked token is refused at once.
    async with httpx.AsyncClient(base_url=live.base, headers=bearer(producer)) as web:
        refused = await web.get("/tokens")
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "forbidden")
        code, _, err = await rota("tokens", "revoke", "web", env={**env, "ROTA_TOKEN": producer})
        assert code == 1 and "forbidden" in err
        code, out, _ = await rota("tokens", "revoke", "web", env=env)
        assert (code, out) == (0, "revoked web\n")
        assert (await web.get("/jobs/x")).status_code == 401
    code, _, err = await rota("tokens", "revoke", "web", env=env)
    assert code == 1 and "no live token with id or name 'web' (not_found)" in err


async def test_an_explicit_db_beats_rota_url_and_both_flags_are_refused(live: Live,
                                                                        tmp_path: Path):
    secret = await make_token(live, "admin")
    db = str(live.settings.db)
    code, out, _ = await rota("tokens", "list", "--db", db, env={"ROTA_URL": "http://nowhere"})
    assert code == 0 and secret.split("_")[1] in out  # read from the file
    code, _, err = await rota("tokens", "list", "--db", db, "--url", live.base)
    assert code == 1 and "not both" in err


async def test_a_token_name_that_could_not_be_revoked_by_name_is_refused(live: Live,
                                                                       tmp_path: Path):
    """A name is one segment of DELETE /tokens/{id or name}: "web/prod" was accepted and
    could then never be revoked by name over the API (a new-user trial, issue 20). Names
    that would not read as what they are (direction and zero-width marks, C1) go too."""
    db = tmp_path / "rota.db"
    for name in ("web/prod", "a\u202eb", "x\x85y", "zero\u200bwidth"):
        code, out, err = await rota("tokens", "create", "--scope", "producer", "--name", name,
                                    "--create", "--db", str(db))
        assert (code, out) == (1, ""), name
        assert "is not a token name: a token name is 1 to 100 characters" in err, err
        assert len(err.splitlines()) == 1 and "\u202e" not in err and "\x85" not in err
        answer = await live.http.post("/tokens", json={"scope": "producer", "name": name})
        assert answer.status_code == 422, name
        assert answer.json()["error"]["code"] == "invalid_request"
    code, out, err = await rota("tokens", "create", "--scope", "admin", "--name", "web prod",
                                "--create", "--db", str(db))
    assert code == 0 and out.startswith("rota_"), err


async def test_a_read_of_the_tokens_begun_before_one_was_made_is_not_taken_after(
        live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's look at the tokens (every interval) and another (a request's unknown
    token) run on reader threads: one begun before a token was created and answered last
    must not put back the table without it."""
    watch = live.coordinator.tokenwatch
    read = watch.store.live_tokens
    first, calls = asyncio.Event(), [0]

    async def held() -> list[dict[str, Any]]:
        calls[0] += 1
        rows = await read()
        if calls[0] == 1:
            await first.wait()  # the early read, answered last
        return rows

    monkeypatch.setattr(watch.store, "live_tokens", held)
    early = asyncio.create_task(watch.refresh())
    await wait_until(lambda: calls[0] == 1, what="the early read")
    token_id, _, hashed = new_token()
    create_token(live.settings.db, name="late", scope="admin", queues=None,
                 token_id=token_id, hashed=hashed)
    late = asyncio.create_task(watch.refresh())
    # (proving the late read is not taken first: it waits for the early one)
    await asyncio.wait({late}, timeout=0.3)  # noqa: sleep-ok (proving nothing happens)
    first.set()
    await asyncio.gather(early, late)
    assert watch.tokens.valid_id(token_id)
