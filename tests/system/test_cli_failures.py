"""Every expected failure of every ``rota`` command: one readable line on stderr, no
traceback, a non-zero exit (issue 13's table, and what a new user mistypes)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import Live, start_server, stop_server, write_spec
from helpers import free_port, wait_until
from pgserver import Cluster
from helpers import rota
from helpers import make_token

from rota.client.client import ApiError, Client
from rota.client.producer import AsyncClient
from rota import Worker


def one_line(code: int, err: str, what: str) -> str:
    assert code != 0, what
    assert "Traceback" not in err, f"{what}: {err}"
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"{what}: {err}"
    return lines[0]


# (command, what the line must say); run against a server with auth off, spec "echo" pushed
ON_A_SERVER = [
    (["enqueue", "ecoh"], "did you mean echo?"),
    (["enqueue", "nope"], "spec 'nope' has no status quo. Known specs: echo. Push a spec"),
    (["enqueue", "echo", "--args", "{oops"], "--args is not valid JSON"),
    (["enqueue", "echo", "--args", "[1]"], "must be a JSON object"),
    (["enqueue", "echo", "--priority", "99999999999"], "invalid_request"),
    (["enqueue", "echo", "--run-at", "9999-01-01T00:00:00Z"], "100 years ahead"),
    (["enqueue", "echo", "--delay", "-1"], "error: delay must be a number >= 0 (invalid_request)"),
    (["run", "ecoh"], "did you mean echo?"),
    (["jobs", "show", "missing"], "no job missing"),
    (["jobs", "cancel", "missing"], "no job missing"),
    (["jobs", "retry", "missing"], "no job missing"),
    (["specs", "history", "missing"], "never pushed"),
    (["specs", "push", "/nonexistent"], "does not exist"),
    (["specs", "retire", "missing"], "missing"),
    (["workers", "quiet", "--label", "typo"], "no connected worker with label 'typo'"),
    (["workers", "quiet"], "name one worker ID"),
    (["jobs", "list", "--state", "nope"], "unknown state 'nope'"),
    (["jobs", "list", "--limit", "0"], "Invalid value for '--limit'"),
    (["jobs", "retry"], "name the jobs to retry"),
    (["jobs", "cancel", "--dry-run"], "name the jobs to cancel"),
    (["jobs", "cancel", "a", "--state", "discarded"], "not both"),
    (["jobs", "retry", "--spec", "bad name"], "invalid_filter"),
    # a misspelt name matches nothing: said, not "0 matched" (issue 22)
    (["jobs", "retry", "--state", "discarded", "--spec", "ech"], "did you mean echo?"),
    (["jobs", "cancel", "--queue", "defualt", "--yes"], "did you mean default?"),
    (["jobs", "list", "--spec", "nope"], "spec 'nope' is unknown"),
    (["jobs", "cancel", "--queue", ""], "--queue is empty (an unset variable?)"),
    (["jobs", "cancel", "--state", "", "--spec", "echo"], "--state is empty"),
    (["jobs", "list", "--q", ""], "--q is empty"),
    (["queues", "pause"], "Missing argument 'NAME'"),
    (["queues", "pause", "bad name"], "invalid_queue"),
    (["workers", "resume"], "name one worker ID"),
    (["workers", "resume", "--label", "typo"], "no connected worker with label 'typo' to resume"),
    (["watch", "--interval", "0"], "Invalid value for '--interval'"),
    (["tail", "--event", "nope"], "nope"),
    (["enqueue"], "Missing argument 'SPEC'"),
    (["enqueue", "echo", "--nope"], "No such option"),
]


async def test_a_failed_command_says_why_in_one_line(live: Live, tmp_path: Path):
    """Every command of ON_A_SERVER, against one server (none changes it: each fails);
    every one that does not say why in one line is reported, not only the first."""
    await live.push(write_spec(tmp_path, "echo"))
    wrong = []
    for args, says in ON_A_SERVER:
        command = " ".join(args)
        code, _, err = await rota(*args, "--url", live.base)
        try:
            line = one_line(code, err, command)
        except AssertionError as exc:
            wrong.append(f"{command}: {exc}")
            continue
        if says not in line:
            wrong.append(f"{command}: {line!r} does not say {says!r}")
    assert not wrong, "\n".join(wrong)


async def test_wrong_urls_and_tokens_say_what_to_set(tmp_path: Path, caplog):
    live = await start_server(tmp_path)
    try:
        admin = await make_token(live, "admin")  # auth is on from here
        code, _, err = await rota("specs", "list", "--url", live.base)
        assert "set ROTA_TOKEN or pass --token" in one_line(code, err, "no token")
        unknown = "rota_0123456789ab_" + "x" * 43  # well formed, of no server
        for wrong in ("rota_x_y", unknown):  # mistyped, or revoked, or another server's
            code, _, err = await rota("specs", "list", "--url", live.base, "--token", wrong)
            line = one_line(code, err, "a wrong token")
            assert "refused the token given (--token or ROTA_TOKEN): it may have been revoked" \
                in line and "wants a token" not in line, line
        worker_token = await make_token(live, "worker")
        code, _, err = await rota("enqueue", "echo", "--url", live.base, "--token", worker_token)
        assert one_line(code, err, "a worker token to enqueue") == (
            "error: a worker token may not POST /jobs: it takes a producer or admin token: pass"
            " one with --token or ROTA_TOKEN (forbidden)")
        # The dashboard's address given for the API's, to a read or a write (which the
        # dashboard would refuse as a browser's cross-site request): said before sending.
        for page, argv in (("/ui", ["specs", "list"]), ("/ui/", ["enqueue", "echo"]),
                           ("/ui/", ["run", "echo"]), ("/ui", ["jobs", "cancel", "j1"]),
                           ("/ui/jobs", ["tail"])):
            code, _, err = await rota(*argv, "--url", live.base + page, "--token", admin)
            assert one_line(code, err, f"the dashboard's URL to {argv}") == (
                f"error: {live.base}{page.rstrip('/')} is the dashboard's address, not Rota's"
                f" API: --url is the server's base URL, {live.base}")
        code, _, err = await rota("specs", "list", "--url", live.ws, "--token", admin)
        assert "base URL" in one_line(code, err, "the ws:// URL")
        code, _, err = await rota("specs", "list", "--url", live.base + "/work", "--token", admin)
        assert "base URL" in one_line(code, err, "the /work path")
        code, _, err = await rota("specs", "list", "--url", f"http://127.0.0.1:{free_port()}")
        assert "is the server running?" in one_line(code, err, "nothing listens")
        for command in (["watch"], ["tail"], ["jobs", "list"], ["queues"]):
            code, _, err = await rota(*command, "--url", live.base)
            assert "set ROTA_TOKEN" in one_line(code, err, f"{command} with no token")
            code, _, err = await rota(*command, "--url", f"http://127.0.0.1:{free_port()}")
            assert "is the server running?" in one_line(code, err, f"{command}, nothing there")
        code, _, err = await rota("tail", "--url", live.ws, "--token", admin)
        assert "base URL" in one_line(code, err, "tail at the ws:// URL")
        code, _, err = await rota("worker", "nope:worker", cwd=tmp_path)
        assert "cannot load nope:worker" in one_line(code, err, "a bad worker target")
        write_spec(tmp_path, "echo")
        (tmp_path / "w.py").write_text("from rota import Worker\nworker = Worker(specs_dir='.')\n"
                                       "worker.handler('echo')(lambda ctx: ctx.args)\n")
        code, _, err = await rota("worker", "w:worker", "--url", live.base + "/ui/",
                                  "--token", admin, cwd=tmp_path)
        assert f"dashboard's address, not the server's: give its base URL, {live.base}" in \
            one_line(code, _errors_only(err), "a worker given the dashboard's URL")
        code, _, err = await rota("worker", "w:worker", "--url", live.base, cwd=tmp_path)
        line = one_line(code, _errors_only(err), "a worker with no token")
        assert "401" in line and "set ROTA_TOKEN (or --token) to a worker token" in line
        code, _, err = await rota("worker", "w:worker", "--url", live.base, "--token", unknown,
                                  cwd=tmp_path)
        line = one_line(code, _errors_only(err), "a worker with a wrong token")
        assert "(401 unauthorized: the token given is not valid here: revoked, mistyped, or" \
            " made by a server on another database): check ROTA_TOKEN (or --token)" in line, line
        tls = "https" + live.base[len("http"):]  # https:// for this plain server (issue 22)
        for command in (["queues"], ["enqueue", "echo"], ["tail"]):
            code, _, err = await rota(*command, "--url", tls)
            assert one_line(code, err, f"{command} over TLS") == (
                f"error: Rota at {tls} does not speak TLS: is it http://? (use {live.base})"
                " (http_expected)"), command
        async with AsyncClient(tls) as client:
            with pytest.raises(ApiError) as plain:
                await client.job("x")
        assert plain.value.code == "http_expected", plain.value
        lost = Worker(url="wss" + live.ws[len("ws"):], specs_dir=tmp_path, heartbeat_interval=0.1)
        lost.handler("echo")(lambda ctx: None)
        task = asyncio.create_task(lost.run())
        await wait_until(lambda: f"is it ws://? It does not speak TLS: give {live.ws}"
                         in caplog.text, what="the worker's hint")
        lost.stop()
        await asyncio.wait_for(task, 10)
        await asyncio.to_thread(_library_words, live.base, unknown)
        async with AsyncClient(live.base, token=unknown) as client:
            with pytest.raises(ApiError) as refused:
                await client.job("x")
        assert refused.value.message.startswith("the server refused the token given")
    finally:
        await stop_server(live)


async def test_a_read_that_gets_no_answer_is_simply_asked_again():
    """A server that hangs up after the request: an enqueue may be stored (repeat it with
    its id), a read changed nothing and has no such advice."""
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)  # the request (or a TLS probe): hang up
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        code, _, err = await rota("jobs", "show", "x", "--url", url)
        assert one_line(code, err, "a read") == (
            f"error: no answer from Rota at {url} (Remote end closed connection without"
            " response); a read changes nothing: ask again once the server answers (no_answer)")
        code, _, err = await rota("enqueue", "echo", "--url", url)
        assert "may have been carried out; repeat it with the same job id" in one_line(
            code, err, "an enqueue")
    finally:
        server.close()


def _library_words(base: str, wrong: str) -> None:
    """The library says what a program does (token=, url=), not the CLI's flags."""
    for token, says in ((None, "the server wants a token: pass token="),
                        (wrong, "the server refused the token given: it may have been revoked")):
        with Client(base, token=token) as client, pytest.raises(ApiError) as refused:
            client.specs()
        assert refused.value.status == 401 and refused.value.message.startswith(says)
    with Client(f"http://127.0.0.1:{free_port()}") as client, pytest.raises(ApiError) as down:
        client.specs()
    assert down.value.code == "unreachable" and "--url" not in down.value.message
    assert down.value.message.endswith("is the server running? (is the url given its address?)")
    with Client("https" + base[len("http"):]) as client, pytest.raises(ApiError) as plain:
        client.specs()
    assert plain.value.code == "http_expected" and plain.value.message.endswith(f"(use {base})")
    for url in (base + "/ui", [base + "/ui/jobs"]):  # every request, a write too
        with pytest.raises(ApiError) as page:
            Client(url).enqueue("echo", {})
        assert page.value.code == "not_the_api" and page.value.message.endswith(
            f"not Rota's API: use the server's base URL, {base}")


def _errors_only(err: str) -> str:
    """A worker logs its start at INFO; its failure is the one 'error:' line."""
    return "\n".join(line for line in err.splitlines() if line.startswith("error:")
                     or "Traceback" in line)


async def test_serve_failures_are_one_line(live: Live, tmp_path: Path):
    busy, demo, public = await asyncio.gather(  # three processes of their own, all at once
        rota("serve", "--db", str(tmp_path / "b.db"), "--port", str(live.port)),
        rota("demo", "--db", str(tmp_path / "d.db"), "--port", str(live.port), cwd=tmp_path),
        rota("serve", "--host", "0.0.0.0", "--db", str(tmp_path / "o.db"), "--port", "0"))
    code, _, err = busy
    assert f"cannot listen on 127.0.0.1:{live.port}" in one_line(code, err, "a busy port")
    code, _, err = demo
    assert "the port is in use" in one_line(code, err, "demo on a busy port")
    code, _, err = public
    assert "refusing to serve on 0.0.0.0 with no tokens" in one_line(code, err, "open and public")
    code, _, err = await rota("tokens", "list", "--db", str(tmp_path / "typo.db"))
    assert "typo.db" in one_line(code, err, "tokens on a missing file")
    assert not (tmp_path / "typo.db").exists()  # (two servers on one file: test_server_lock)


def test_a_worker_takes_the_servers_base_url_too():
    from rota import Worker

    assert Worker(url="http://127.0.0.1:8000").url == "ws://127.0.0.1:8000/work"
    assert Worker(url="https://rota.internal/").url == "wss://rota.internal/work"
    assert Worker(url="ws://127.0.0.1:8000/work").url == "ws://127.0.0.1:8000/work"
    with pytest.raises(ValueError, match="base URL"):
        Worker(url="127.0.0.1:8000")


async def test_a_failed_jobs_traceback_is_printed_as_lines(live: Live, connect, tmp_path: Path):
    echo = write_spec(tmp_path, "echo")
    await live.push(echo)
    job = await live.enqueue("echo", max_attempts=1)
    worker = await connect()
    await worker.register([echo])
    [copy] = await worker.jobs(1)
    trace = 'Traceback (most recent call last):\n  File "app.py", line 3, in send\nValueError: boom\n'
    await worker.beat(results=[{"job_id": copy["id"], "attempt": copy["attempt"],
                                "outcome": "failed", "error": {
                                    "type": "ValueError", "message": "boom",
                                    "details": {"traceback": trace}}}])
    await live.wait_state(job["id"], "discarded")
    code, out, err = await rota("jobs", "show", job["id"], "--url", live.base)
    assert code == 0 and json.loads(out)["errors"][0]["details"]["traceback"] == "(on stderr)"
    assert '      File "app.py", line 3, in send\n    ValueError: boom' in err  # lines, not \\n
    assert "attempt 1" in err and "ValueError: boom" in err.splitlines()[0]


async def test_serve_and_tokens_on_a_postgresql_url_fail_in_one_line(pg_cluster: Cluster,
                                                                    tmp_path: Path):
    down = f"postgresql://rota:secret@127.0.0.1:{free_port()}/rota"
    for command in (["serve", "--port", "0"], ["tokens", "list"]):
        code, _, err = await rota(*command, "--db", down)
        line = one_line(code, err, f"{command[0]}: nothing listens")
        assert "the PostgreSQL server cannot be reached" in line and "storage_unavailable" in line
        assert "secret" not in line and "rota:***@127.0.0.1" in line
    code, _, err = await rota("serve", "--port", "0", "--db",
                              pg_cluster.url("nonexistent_database"))
    assert 'database "nonexistent_database" does not exist' in one_line(code, err, "no db")
    code, _, err = await rota("tokens", "list", "--db", "postgresql://127.0.0.1:notaport/x")
    assert "invalid URL: the port 'notaport' is not a number" in one_line(code, err, "a bad URL")


async def test_tokens_on_a_postgresql_database(pg_url: str):
    code, secret, err = await rota("tokens", "create", "--scope", "admin", "--name", "ops",
                                   "--db", pg_url)
    assert code == 0, err
    code, _, err = await rota("tokens", "create", "--scope", "admin", "--name", "ops",
                              "--db", pg_url)
    assert "already named 'ops'" in one_line(code, err, "a name taken")
    code, out, err = await rota("tokens", "list", "--db", pg_url)
    assert code == 0 and "name=ops" in out and secret.strip() not in out, err
    code, out, err = await rota("tokens", "revoke", "ops", "--db", pg_url)
    assert code == 0 and "revoked ops" in out, err
    code, out, _ = await rota("tokens", "list", "--db", pg_url)
    assert "no tokens" in out


async def test_a_worker_label_the_server_would_refuse_is_one_line_before_connecting(tmp_path):
    """`--label gpu,region:eu` (or ROTA_LABELS="gpu,eu"): exit 2 at once, not a worker
    that reconnects for ever while the server refuses its registration."""
    write_spec(tmp_path, "echo")
    (tmp_path / "w.py").write_text("from rota import Worker\nworker = Worker(specs_dir='.')\n"
                                   "worker.handler('echo')(lambda ctx: ctx.args)\n")
    nowhere = f"http://127.0.0.1:{free_port()}"
    rule = "must be a name of 1 to 128 letters, digits and '_.:-', starting with a letter or digit"
    for argv, env, bad in ((["--label", "gpu,region:eu"], {}, "gpu,region:eu"),
                           ([], {"ROTA_LABELS": "gpu,eu"}, "gpu,eu")):
        code, _, err = await rota("worker", "w:worker", "--url", nowhere, *argv, env=env,
                                  cwd=tmp_path, timeout=15)
        line = one_line(code, err, f"a bad label {bad}")
        assert code == 2 and f"labels[0] {rule}, got {bad!r}: one label per --label;" \
            " ROTA_LABELS takes several, separated by spaces" in line, line


async def test_a_token_with_a_newline_is_one_line_for_every_command(live: Live):
    """Not the HTTP library's 'Invalid header value' traceback: said before sending."""
    said = ("error: the token given (--token or ROTA_TOKEN) holds a newline: a token is one"
            " line, as 'rota tokens create' printed it (was it read from a file with its line"
            " ending?)")
    url = live.base
    for command in (["schedules"], ["specs", "list"], ["jobs", "list"], ["tail"],
                    ["enqueue", "echo"], ["tokens", "list", "--url", url]):
        argv = [*command] if "--url" in command else [*command, "--url", url]
        code, _, err = await rota(*argv, "--token", "abc\ndef")
        assert one_line(code, err, f"{command}: a newline") == said
        code, _, err = await rota(*argv, env={"ROTA_TOKEN": "rota_x\r\n"})
        assert one_line(code, err, f"{command}: ROTA_TOKEN") == said
    code, _, err = await rota("specs", "list", "--url", url, "--token", "rota_\u00e9")
    assert one_line(code, err, "non-ASCII") == (
        "error: the token given (--token or ROTA_TOKEN) holds 'é', which no token has: give"
        " it as 'rota tokens create' printed it")
