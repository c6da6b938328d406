"""Endpoint signing secrets at the surfaces a user touches: ``rota secrets set|list|delete``
and ``/secrets`` (set, rotate with a window, generate, never a value listed, precise
refusals), the server's lookup (environment first, then the database, kept across a
restart), and the push that refuses a spec whose [execute] secret is set nowhere."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from conftest import Live, start_server, stop_server, write_spec
from helpers import end, free_port, spawn_serve, wait_until

from rota.cli.app import main

pytestmark = pytest.mark.both_backends
EXECUTE = '[execute]\nurl = "https://hooks.example.com/run"\nsecret = "{}"\n'
VALUE = "s3cret-value-0123456789"


async def invoke(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = await asyncio.to_thread(CliRunner().invoke, main, list(args), input=stdin)
    return result.exit_code, result.stdout, result.stderr


async def test_set_rotate_list_and_delete_through_the_cli_and_the_api(live: Live):
    book = live.coordinator.secrets
    code, out, err = await invoke("secrets", "set", "stripe.live", "--value", "-",
                                  "--url", live.base, stdin=VALUE + "\n")
    assert (code, out, err) == (0, "secret stripe.live new\n", "")
    assert book.secret_values("stripe.live") == [VALUE.encode()]
    # a rotation: both values sign until the window ends, the new one first
    code, out, _ = await invoke("secrets", "set", "stripe.live", "--value", "n" * 20,
                                "--previous-for", "1h", "--url", live.base)
    assert code == 0 and out.startswith("secret stripe.live rotated (the previous value"
                                        " stays valid until 20"), out
    assert book.secret_values("stripe.live") == [b"n" * 20, VALUE.encode()]
    again = await live.http.put("/secrets/stripe.live", json={"value": "n" * 20})
    assert (again.status_code, again.json()["change"]) == (200, "unchanged")
    assert book.secret_values("stripe.live") == [b"n" * 20, VALUE.encode()]
    listed = (await live.http.get("/secrets")).json()["secrets"]
    assert [s["name"] for s in listed] == ["stripe.live"] and listed[0]["source"] == "db"
    assert VALUE not in json.dumps(listed) and "n" * 20 not in json.dumps(listed)
    code, out, _ = await invoke("secrets", "list", "--url", live.base)
    assert out.startswith("stripe.live  database  updated=20") and "previous valid" in out
    # generated: shown once, on stdout; a window of 0 drops the previous value at once
    put = await live.http.put("/secrets/stripe.live", json={"window": 0})
    made = put.json()["value"]
    assert put.status_code == 200 and put.json()["change"] == "rotated" and len(made) == 43
    assert book.secret_values("stripe.live") == [made.encode()]
    code, out, err = await invoke("secrets", "set", "other", "--generate", "--url", live.base)
    assert code == 0 and len(out.strip()) == 43 and "not shown again" in err
    code, out, _ = await invoke("secrets", "delete", "other", "--url", live.base)
    assert (code, out) == (0, "deleted secret other\n") and book.secret_values("other") is None
    code, _, err = await invoke("secrets", "delete", "other", "--url", live.base)
    assert (code, err) == (1, "error: no secret other in the database (not_found)\n")
    # the store keeps it: a restart reads it back
    await stop_server(live)
    again = await start_server(live.tmp)
    try:
        assert again.coordinator.secrets.secret_values("stripe.live") == [made.encode()]
    finally:
        await stop_server(again)
        live.http = httpx.AsyncClient()  # (the fixture closes its own again)


@pytest.mark.sqlite_only("the refusals are the routes', whatever the store")
async def test_bad_names_values_and_bodies_get_a_precise_4xx_and_a_cli_line(live: Live):
    for path, body, status, code, said in [
        ("/secrets/a%20b", {"value": VALUE}, 400, "invalid_name", "a secret's name is"),
        ("/secrets/ok", {"value": "short"}, 422, "invalid_secret", "16 bytes at least"),
        ("/secrets/ok", {"value": "x" * 4097}, 422, "invalid_request", "value"),
        ("/secrets/ok", {"value": VALUE + "\u0007"}, 422, "invalid_secret", "printable"),
        ("/secrets/ok", {"value": VALUE, "window": -5}, 422, "invalid_window", "0 to"),
        ("/secrets/ok", {"valeu": VALUE}, 422, "invalid_request", "valeu"),
    ]:
        answer = await live.http.put(path, json=body)
        assert answer.status_code == status, (body, answer.text)
        error = answer.json()["error"]
        assert error["code"] == code and said in error["message"], (body, error)
    assert (await live.http.get("/secrets")).json() == {"secrets": []}
    for args, said in [
        (["set", "ok"], "give --value VALUE (or --value - to read it from stdin), or --generate"),
        (["set", "ok", "--value", "short"], "a secret is 16 bytes at least (this one is 5)"),
        (["set", "a b", "--generate"], "a secret's name is"),
        (["set", "ok", "--generate", "--previous-for", "soon"], "--previous-for: 'soon' is"),
    ]:
        code, _, err = await invoke("secrets", *args, "--url", live.base)
        assert code == 1 and err.startswith(f"error: {said}") and err.count("\n") == 1, err


@pytest.mark.sqlite_only("the push's check is the server's, whatever the store")
async def test_a_push_naming_a_secret_set_nowhere_is_refused_dry_run_too(live: Live,
                                                                       tmp_path: Path):
    specs = tmp_path / "specs"
    write_spec(specs, "charge", extra=EXECUTE.format("stripe.live"))
    for dry in ([], ["--dry-run"]):
        code, out, err = await invoke("specs", "push", str(specs), *dry, "--url", live.base)
        assert (code, out) == (1, "")
        assert err == ("error: spec charge: its [execute] secret 'stripe.live' is not set (set"
                       " it with 'rota secrets set stripe.live', or the server's environment"
                       " variable ROTA_SECRET_STRIPE_LIVE) (unknown_secret)\n")
    assert (await live.http.get("/specs")).json() == {"specs": []}
    await invoke("secrets", "set", "stripe.live", "--generate", "--url", live.base)
    code, out, err = await invoke("specs", "push", str(specs), "--url", live.base)
    assert code == 0 and out.startswith("new       charge"), err
    listed = (await live.http.get("/secrets")).json()["secrets"]
    assert [(s["name"], s["source"], s["specs"]) for s in listed] == [
        ("stripe.live", "db", ["charge"])]
    code, out, err = await invoke("secrets", "delete", "stripe.live", "--url", live.base)
    assert (code, out) == (0, "deleted secret stripe.live\n")
    assert err == ("warning: spec(s) charge name it: their deliveries cannot be signed until"
                   " it is set again ('rota secrets set stripe.live')\n")


@pytest.mark.sqlite_only("the environment is the server process's, whatever the store")
async def test_the_servers_environment_comes_first(tmp_path: Path):
    """A real `rota serve` with ROTA_SECRET_<NAME>: a push naming it is taken, and the
    listing says where it comes from; the database's value does not replace it."""
    port = free_port()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}")
    proc = await spawn_serve(http, ["--db", str(tmp_path / "rota.db"), "--port", str(port)],
                             tmp_path / "serve.log",
                             env={"ROTA_SECRET_BILLING_HOOK": "from-the-environment-1234"})
    try:
        write_spec(tmp_path / "specs", "bill", extra=EXECUTE.format("billing-hook"))
        url = f"http://127.0.0.1:{port}"
        code, _, err = await invoke("specs", "push", str(tmp_path / "specs"), "--url", url)
        assert code == 0, err
        code, out, err = await invoke("secrets", "set", "billing-hook", "--value", VALUE,
                                      "--url", url)
        assert code == 0 and "signs with ROTA_SECRET_BILLING_HOOK from its environment" in err
        code, out, _ = await invoke("secrets", "list", "--url", url)
        assert out.startswith("billing-hook  environment (ROTA_SECRET_BILLING_HOOK)")
        assert out.rstrip().endswith("specs=bill")
        line = "secrets: 0 in the database, 1 from the environment (ROTA_SECRET_BILLING_HOOK)"
        log = tmp_path / "serve.log"
        await wait_until(lambda: line in log.read_text(), what="the start's secrets line")
        await wait_until(lambda: "secret billing-hook new" in log.read_text(), what="the set")
        assert "from-the-environment" not in log.read_text() and VALUE not in log.read_text()
    finally:
        await end([proc], [http])
