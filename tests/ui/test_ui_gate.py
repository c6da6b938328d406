"""The dashboard's door, over plain HTTP: the login form and its cookie, the cookie as an
admin credential for the JSON API too, the same-origin rule for what a cookie-borne
request may change, ``--ui-read-only``, and the pages' answers to bad input.
(tests/ui/test_ui.py drives the same in a browser.)"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import websockets
from conftest import Live, start_server, stop_server, write_spec
from helpers import free_port, spawn_serve

from rota.core.auth import new_token
from rota.store.tokens import create_token

SAME = {"Sec-Fetch-Site": "same-origin"}


async def admin_server(tmp_path: Path, **settings: Any) -> tuple[Live, str]:
    live = await start_server(tmp_path, **settings)
    secret, _ = await live.coordinator.create_token("admin", "ops", None)
    live.http.headers["Authorization"] = f"Bearer {secret}"
    await live.push(write_spec(tmp_path / "specs", "echo"))
    return live, secret


# One guarded server for the module (and so one event loop for its tests): each test that
# changes something changes only what it made itself (its own job, a token of its own),
# so none depends on which ran before it.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def guarded(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[Live, str]]:
    live, secret = await admin_server(tmp_path_factory.mktemp("guarded"))
    yield live, secret
    await stop_server(live)


def browser(live: Live, token: str | None = None) -> httpx.AsyncClient:
    """A client that carries only the session cookie, as a browser would."""
    cookies = {"rota_session": token} if token else {}
    return httpx.AsyncClient(base_url=live.base, cookies=cookies)


async def test_login_sets_an_httponly_strict_cookie_and_goes_where_it_was_sent(guarded):
    live, secret = guarded
    async with browser(live) as client:
        page = await client.get("/ui/specs")
        assert page.status_code == 303 and page.headers["location"] == "/ui/login?next=%2Fui%2Fspecs"
        form = await client.get(page.headers["location"])
        assert form.status_code == 200 and 'name="next" value="/ui/specs"' in form.text
        done = await client.post("/ui/login", data={"token": secret, "next": "/ui/specs"},
                                 headers=SAME)
        assert done.status_code == 303 and done.headers["location"] == "/ui/specs"
        cookie = done.headers["set-cookie"]
        assert cookie.startswith(f"rota_session={secret};")
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
        assert "Secure" not in cookie  # plain http; over https it is Secure
        assert (await client.get("/ui/specs")).status_code == 200
        # ... and it is an admin credential for the JSON API as well.
        assert (await client.get("/workers")).status_code == 200


@pytest.mark.parametrize(("token", "why"), [("nonsense", "not a valid token"),
                                            ("", "not a valid token"),
                                            ("producer", "the dashboard needs an admin token")])
async def test_login_refuses_what_is_not_an_admin_token(guarded, token, why):
    live, _ = guarded
    if token == "producer":
        # Token names are unique, and the server is the module's: a name of its own.
        token, _ = await live.coordinator.create_token("producer", "app-login", None)
    async with browser(live) as client:
        answer = await client.post("/ui/login", data={"token": token}, headers=SAME)
        assert answer.status_code == 401 and why in answer.text
        assert "set-cookie" not in answer.headers


@pytest.mark.parametrize("target", ["//evil.example/ui", "https://evil.example/", "/jobs", ""])
async def test_login_only_ever_goes_back_to_a_dashboard_page(guarded, target):
    live, secret = guarded
    async with browser(live) as client:
        done = await client.post("/ui/login", data={"token": secret, "next": target},
                                 headers=SAME)
        assert done.headers["location"] == "/ui"


async def test_a_producer_token_in_the_cookie_is_no_credential(guarded):
    live, _ = guarded
    producer, _ = await live.coordinator.create_token("producer", "app-cookie", None)
    async with browser(live, producer) as client:
        answer = await client.get("/workers")
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized"
        assert (await client.get("/ui")).status_code == 303  # to the login form


async def test_without_a_credential_pages_send_to_login_and_the_api_says_401(guarded):
    live, _ = guarded
    async with browser(live) as client:
        page = await client.get("/ui/jobs?q=abc")
        assert page.status_code == 303
        assert page.headers["location"] == "/ui/login?next=%2Fui%2Fjobs%3Fq%3Dabc"
        action = await client.post("/ui/workers/state", data={"state": "quiet"}, headers=SAME)
        assert action.status_code == 401 and action.json()["error"]["code"] == "unauthorized"
        # The same form posted by a browser whose session ended in another tab: the login
        # form, then the overview (the form is not sent again), never a JSON error.
        posted = await client.post("/ui/workers/state", data={"state": "quiet"},
                                   headers={**SAME, "Sec-Fetch-Mode": "navigate"})
        assert posted.status_code == 303
        assert posted.headers["location"] == "/ui/login?next=%2Fui"
        assert (await client.get("/ui/static/rota.css")).status_code == 200  # the login's look


async def test_a_first_visit_sent_to_login_logs_no_warning(guarded, caplog):
    live, _ = guarded
    caplog.set_level(logging.DEBUG, "rota.server")
    async with browser(live) as client:
        assert (await client.get("/ui")).status_code == 303
    async with browser(live, "rota_000000000000_" + "x" * 43) as client:  # a stale session
        assert (await client.get("/ui/workers")).status_code == 303
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "login form" in r.getMessage()]
    assert [level for level, _ in lines] == [logging.DEBUG, logging.INFO], lines
    assert "its session cookie is not a valid admin token" in lines[1][1]
    # (A "server stalled" warning is the loop's own, about a loaded machine, not the visit.)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and not r.getMessage().startswith("server stalled")]


@pytest.mark.parametrize(("headers", "code"), [
    ({}, "cross_site"),  # a browser always says; a bare cookie from elsewhere is refused
    ({"Sec-Fetch-Site": "same-site"}, "cross_site"),  # a sibling subdomain is not this origin
    ({"Sec-Fetch-Site": "none"}, "cross_site"),
    ({"Sec-Fetch-Site": "cross-site"}, "origin_not_allowed"),
    ({"Origin": "http://evil.example"}, "origin_not_allowed"),
])
async def test_a_cookie_borne_change_from_elsewhere_is_refused(guarded, headers, code):
    live, secret = guarded
    job = await live.enqueue("echo")
    async with browser(live, secret) as client:
        for path in ("/jobs", f"/ui/jobs/{job['id']}/cancel"):
            answer = await client.post(path, json={"spec": "echo", "args": {}}, headers=headers)
            assert answer.status_code == 403, (path, answer.text)
            assert answer.json()["error"]["code"] == code
    assert (await live.job(job["id"]))["state"] == "available"  # nothing was done


@pytest.mark.parametrize("headers", [SAME, {"Origin": "same"}])
async def test_a_cookie_borne_change_from_this_origin_is_done(guarded, headers):
    live, secret = guarded
    if headers.get("Origin") == "same":
        headers = {"Origin": live.base}  # a browser too old to send Sec-Fetch-Site
    job = await live.enqueue("echo")
    async with browser(live, secret) as client:
        answer = await client.post(f"/ui/jobs/{job['id']}/cancel", headers=headers,
                                   data={"back": f"/ui/jobs/{job['id']}"})
        assert answer.status_code == 303 and answer.headers["location"] == f"/ui/jobs/{job['id']}"
        assert "rota_flash=" in answer.headers["set-cookie"]
        shown = await client.get(answer.headers["location"])
        assert f"job {job['id']} is cancelled" in shown.text
    assert (await live.job(job["id"]))["state"] == "cancelled"


async def test_a_bearer_token_needs_no_origin(guarded):
    live, _ = guarded
    answer = await live.http.post("/jobs", json={"spec": "echo", "args": {}})
    assert answer.status_code == 201  # scripts and clients are not browsers


async def test_read_only_refuses_cookie_borne_changes_and_every_dashboard_action(tmp_path):
    live, secret = await admin_server(tmp_path, ui_read_only=True)
    try:
        job = await live.enqueue("echo")
        async with browser(live, secret) as client:
            for path in (f"/jobs/{job['id']}/retry", f"/ui/jobs/{job['id']}/cancel", "/jobs"):
                answer = await client.post(path, headers=SAME, json={"spec": "echo"})
                assert answer.status_code == 403, path
                assert answer.json()["error"] == {
                    "code": "read_only", "message": "the dashboard is read-only (--ui-read-only)"}
            logged_in = await client.post("/ui/login", data={"token": secret}, headers=SAME)
            assert logged_in.status_code == 303  # logging in changes nothing
            page = await client.get(f"/ui/jobs/{job['id']}")
            assert "read-only" in page.text and "Cancel" not in page.text
        # A token (a script, `rota` itself) still acts: read-only is the dashboard's.
        assert (await live.http.delete(f"/jobs/{job['id']}")).status_code == 200
    finally:
        await stop_server(live)


async def test_an_open_server_needs_no_login_but_keeps_the_origin_rule(tmp_path):
    live = await start_server(tmp_path)  # no token: auth is off (loopback only)
    try:
        await live.push(write_spec(tmp_path / "specs", "echo"))
        job = await live.enqueue("echo")
        async with browser(live) as client:
            assert (await client.get("/ui")).status_code == 200
            assert "no login is needed" in (await client.get("/ui/login")).text
            refused = await client.post(f"/ui/jobs/{job['id']}/cancel")
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "cross_site"
            done = await client.post(f"/ui/jobs/{job['id']}/cancel", headers=SAME)
            assert done.status_code == 303
    finally:
        await stop_server(live)


async def test_the_poller_gets_the_live_region_alone(guarded):
    live, secret = guarded
    async with browser(live, secret) as client:
        whole = await client.get("/ui")
        region = await client.get("/ui", headers={"X-Rota-Live": "1"})
        assert whole.text.startswith("<!doctype html>") and '<main id="live">' in whole.text
        assert region.status_code == 200 and "<html" not in region.text
        assert "<h1>Overview</h1>" in region.text and region.headers["cache-control"] == "no-store"
        # Never framed by another site, never a script from elsewhere.
        assert whole.headers["x-frame-options"] == "DENY"
        policy = whole.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "default-src 'self'" in policy


@pytest.mark.parametrize(("path", "form", "status", "text"), [
    ("/ui/workers/w-none/state", {"state": "quiet"}, 303, "refused: no connected worker w-none"),
    ("/ui/workers/state", {"state": "quiet", "label": ""}, 303, "refused: choose a label"),
    ("/ui/jobs/nope/retry", {}, 303, "refused: no job nope"),
])
async def test_an_action_the_core_refuses_comes_back_as_a_message(guarded, path, form, status,
                                                                  text):
    live, secret = guarded
    async with browser(live, secret) as client:
        answer = await client.post(path, data=form, headers=SAME)
        assert answer.status_code == status
        shown = await client.get(answer.headers["location"])
        assert text in shown.text


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"state": "asleep"}, 422, "invalid_request"),
    (b"\xff\xfe", 400, "invalid_form"),
])
async def test_a_bad_form_is_a_precise_4xx(guarded, body, status, code):
    live, secret = guarded
    async with browser(live, secret) as client:
        kwargs = {"content": body} if isinstance(body, bytes) else {"data": body}
        answer = await client.post("/ui/workers/state", headers=SAME, **kwargs)
        assert answer.status_code == status and answer.json()["error"]["code"] == code


async def test_a_missing_job_page_is_a_404_page(guarded):
    live, secret = guarded
    async with browser(live, secret) as client:
        answer = await client.get("/ui/jobs/0000")
        assert answer.status_code == 404 and "There is no job 0000" in answer.text


async def test_the_cookie_is_no_credential_for_a_worker_socket(guarded):
    live, secret = guarded
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(live.ws, additional_headers={
                "Cookie": f"rota_session={secret}"}):
            pass
    assert refused.value.response.status_code == 401


async def test_rota_serve_ui_read_only_says_so_and_refuses_the_cookie(tmp_path):
    """The option end to end: the command line, the settings, the gate."""
    db, port = tmp_path / "rota.db", free_port()
    token_id, secret, hashed = new_token()
    create_token(db, name="ops", scope="admin", queues=None, token_id=token_id, hashed=hashed)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                 cookies={"rota_session": secret}) as http:
        proc = await spawn_serve(http, ["--db", str(db), "--port", str(port), "--ui-read-only"],
                                 tmp_path / "serve.log")
        try:
            answer = await http.post("/jobs", json={"spec": "x"}, headers=SAME)
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "read_only"
        finally:
            proc.terminate()
            await proc.wait()
    assert "the dashboard is at /ui, read-only" in (tmp_path / "serve.log").read_text()
