"""Push execution's input in the hostile corpus: every [execute] slip of tests/corpus.py
(EXECUTE_SLIPS) pushed at PUT /specs gets a 422 whose message names what is wrong, and
`rota specs push` says it in one line; on the watched server of tests/server/test_hostile.py
(no ERROR line, no traceback, the bystander served, no stored job changed). The callback
routes' bodies and path segments are in test_hostile.py's templates and PATH_ROUTES."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import corpus
from helpers import rota
from test_hostile import Watch, assert_http, watched  # noqa: F401  (fixture)


def spec_with(execute: object) -> dict[str, Any]:
    return {"name": "hostile-exec", "version": "1", "execute": execute}


def toml_value(value: object) -> str:
    """A value as TOML, on one line (inline tables): enough for these tables."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}"
                                for k, v in value.items()) + " }"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(value)  # strings (JSON's escapes are TOML's), numbers


async def test_every_execute_slip_is_refused_precisely(watched: Watch, tmp_path: Path):
    live = watched.live
    env = {"ROTA_URL": live.base, "ROTA_TOKEN": live.admin}  # type: ignore[attr-defined]
    for name, execute, named in corpus.EXECUTE_SLIPS:
        answer = await live.http.put("/specs", json={"dry_run": True,
                                                     "specs": [spec_with(execute)]})
        assert_http(answer, True, f"PUT /specs [execute] {name}")
        message = answer.json()["error"]["message"]
        assert answer.status_code == 422 and named in message, (name, answer.text)
        assert corpus.FORGED not in message.replace(f"\\nERROR {corpus.FORGED}", ""), name
        watched.pairs += 1
        folder = tmp_path / name.replace(" ", "-").replace(",", "")
        folder.mkdir()
        (folder / "hostile-exec.toml").write_text(
            f'name = "hostile-exec"\nversion = "1"\nexecute = {toml_value(execute)}\n')
        code, out, err = await rota("specs", "push", "--dry-run", str(folder), env=env)
        said = (out + err).strip()
        assert code != 0 and "\n" not in said and named in said, (name, said)
        assert "Traceback" not in said, name
    assert all(s["name"] != "hostile-exec" for s in (await live.http.get("/specs")).json()["specs"])


# Tokens whose attempt part is a digit to str.isdigit but not to int(), or no number at all.
ODD_TOKENS = ["\u00b2.x", "\u0661.x", "\uff11.x", "1" * 10 + ".x", "-1.x", ".", "1.",
              "1." + "0" * 40 + "\n" + corpus.FORGED, "0x1.x", " 1.x"]


async def test_a_callback_with_an_odd_token_is_refused_as_not_the_jobs(watched: Watch):
    for token in ODD_TOKENS:
        for path in ("/jobs/keep-available/callback", "/jobs/keep-available/callback/heartbeat"):
            body: dict[str, Any] = {"token": token, "status": "completed", "result": 1}
            if path.endswith("heartbeat"):
                body = {"token": token}
            answer = await watched.live.http.post(path, json=body)
            assert_http(answer, True, f"{path} token={token!r}")
            assert (answer.status_code, answer.json()["error"]["code"]) == \
                (403, "invalid_token"), (token, answer.text)
            watched.pairs += 1
