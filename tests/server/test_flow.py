"""Flow control at the surfaces a user touches (README, Flow control): a job's
concurrency_key and labels through the CLI, both clients, a batch and the job view; a
spec's labels and [limits]; and limits set and cleared at runtime (API and CLI)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from click.testing import CliRunner
from conftest import Live, write_spec

from rota import AsyncClient, Client
from rota.cli.app import main


async def invoke(*args: str) -> tuple[int, str, str]:
    result = await asyncio.to_thread(CliRunner().invoke, main, list(args))
    return result.exit_code, result.stdout, result.stderr


async def test_a_jobs_key_and_labels_go_everywhere_a_job_does(live: Live, tmp_path: Path):
    """Given at enqueue (CLI, Client, AsyncClient, a batch), with the spec's labels
    added, sorted and each once: shown by GET /jobs/{id}."""
    await live.push(write_spec(tmp_path / "specs", "render", extra='labels = ["gpu"]\n'))
    code, out, err = await invoke("enqueue", "render", "--concurrency-key", "acme",
                                  "--label", "region:eu", "--label", "gpu", "--url", live.base)
    assert code == 0, err
    shown = json.loads(out)
    assert (shown["concurrency_key"], shown["labels"]) == ("acme", ["gpu", "region:eu"])
    again = (await live.http.get(f"/jobs/{shown['id']}")).json()
    assert (again["concurrency_key"], again["labels"]) == ("acme", ["gpu", "region:eu"])

    with Client(live.base) as client:  # (its calls block: in a thread, beside the server)
        job = await asyncio.to_thread(client.enqueue, "render", concurrency_key="user:17",
                                      labels=["cuda"])
        assert (job.view["concurrency_key"], job.view["labels"]) == ("user:17", ["cuda", "gpu"])
        plain = await asyncio.to_thread(client.enqueue, "render")
        assert (plain.view["concurrency_key"], plain.view["labels"]) == (None, ["gpu"])
    async with AsyncClient(live.base) as producer:
        job = await producer.enqueue("render", concurrency_key="acme", labels=["a", "a"])
        assert job.view["labels"] == ["a", "gpu"]
    batch = (await live.http.post("/jobs/batch", json={"jobs": [
        {"spec": "render", "concurrency_key": "k1", "labels": ["x"]},
        {"spec": "render", "concurrency_key": "bad key"}]})).json()["results"]
    assert (batch[0]["job"]["concurrency_key"], batch[0]["job"]["labels"]) == ("k1", ["gpu", "x"])
    assert batch[1]["status"] == 422 and "concurrency_key" in batch[1]["error"]["message"]

    # The same id again is the same job only with the same key and labels.
    first = await live.http.post("/jobs", json={"spec": "render", "id": "same",
                                                "concurrency_key": "acme"})
    other = await live.http.post("/jobs", json={"spec": "render", "id": "same",
                                                "concurrency_key": "other"})
    assert (first.status_code, other.status_code) == (201, 409)

    too_long = await live.http.post("/jobs", json={"spec": "render", "labels": ["x" * 129]})
    assert too_long.status_code == 422
    assert too_long.json()["error"]["message"].startswith("labels[0] must be a name of 1 to 128")
    many = await live.http.post("/jobs", json={"spec": "render",
                                               "labels": [f"l{n}" for n in range(16)]})
    assert many.status_code == 422 and many.json()["error"]["code"] == "invalid_labels"


SEND = ('[limits]\nconcurrency = 40\nkey_concurrency = 3\nrate = "5/s"\n'
        'key_rate = {limit = 100, period = 60, burst = 10}\n')


async def test_limits_from_spec_files_and_set_and_cleared_at_runtime(tmp_path: Path):
    """GET /limits shows a spec file's rule; `rota limits set` replaces it (stored: a
    restart keeps it) until `rota limits clear`; the engine holds what is in force."""
    from conftest import start_server, stop_server

    from rota.core.limits import LimitRule, Rate

    live = await start_server(tmp_path)
    try:
        await live.push(write_spec(tmp_path / "specs", "send", extra=SEND))
        await live.push(write_spec(tmp_path / "specs", "other", queue="emails"))
        spec_file = LimitRule(concurrency=40, key_concurrency=3, rate=Rate(5, 1.0),
                              key_rate=Rate(100, 60.0, 10))
        assert live.coordinator.limiting.in_force == {("spec", "send"): spec_file}
        code, out, err = await invoke("limits", "--url", live.base)
        assert (code, out) == (0, "spec:send                concurrency=40 rate=5/s"
                               " key_concurrency=3 key_rate=100/min burst=10  (spec file)\n")

        code, out, err = await invoke("limits", "set", "spec:send", "--rate", "10/s",
                                      "--burst", "20", "--url", live.base)
        assert code == 1 and "rate must have a burst of at most its limit 10, not 20" in err
        code, out, err = await invoke("limits", "set", "spec:send", "--concurrency", "2",
                                      "--key-rate", "100/min", "--key-burst", "5",
                                      "--url", live.base)
        assert (code, out) == (0, "spec:send: concurrency=2 key_rate=100/min burst=5 (until"
                               " 'rota limits clear spec:send')\n  its spec file's rate=5/s"
                               " key_concurrency=3 no longer applies until then (give it here"
                               " to keep it)\n"), err
        put = await live.http.put("/limits/queue/emails", json={"rate": {"limit": 10,
                                                                          "period": 30}})
        assert put.status_code == 200 and put.json()["source"] == "runtime"
        runtime = {("spec", "send"): LimitRule(concurrency=2, key_rate=Rate(100, 60.0, 5)),
                   ("queue", "emails"): LimitRule(rate=Rate(10, 30.0))}
        assert live.coordinator.limiting.in_force == runtime
    finally:
        await stop_server(live)

    live = await start_server(tmp_path)  # a restart keeps what was set
    try:
        assert live.coordinator.limiting.in_force == runtime
        listed = (await live.http.get("/limits")).json()["limits"]
        assert [(e["limit"], e["source"], e["rule"]) for e in listed] == [
            ("queue:emails", "runtime", {"rate": {"limit": 10, "period": 30.0, "burst": None}}),
            ("spec:send", "runtime", {"concurrency": 2, "key_rate": {
                "limit": 100, "period": 60.0, "burst": 5}})]
        code, out, err = await invoke("limits", "clear", "spec:send", "--url", live.base)
        assert (code, out) == (0, "spec:send: cleared; its spec file's apply: concurrency=40"
                               " rate=5/s key_concurrency=3 key_rate=100/min burst=10\n"), err
        assert live.coordinator.limiting.in_force == {("spec", "send"): spec_file,
                                                  ("queue", "emails"): runtime[("queue",
                                                                                "emails")]}
        code, _, err = await invoke("limits", "clear", "spec:send", "--url", live.base)
        assert (code, err) == (1, "error: no limit is set at runtime for spec:send: its spec"
                               " file's [limits] is in force until a new version of the spec"
                               " is pushed; `rota limits set spec:send` overrides it"
                               " (no_such_limit)\n")
        code, _, err = await invoke("limits", "clear", "spec:other", "--url", live.base)
        assert (code, err) == (1, "error: no limit is set at runtime for spec:other (`rota"
                               " limits` lists them) (no_such_limit)\n")
    finally:
        await stop_server(live)


async def test_a_bad_limit_is_refused_precisely_and_nothing_is_stored(live: Live,
                                                                      tmp_path: Path):
    await live.push(write_spec(tmp_path / "specs", "send"))
    for path, body, status, code, says in [
        ("/limits/spec/send", {"concurrency": 0}, 422, "invalid_limit",
         "concurrency must be an integer >= 1"),
        ("/limits/spec/send", {"key_concurrency": -3}, 422, "invalid_limit",
         "key_concurrency must be an integer >= 1"),
        ("/limits/spec/send", {"concurency": 3}, 422, "invalid_limit",
         "concurency is not a field Rota knows (known: concurrency, rate, key_concurrency,"
         " key_rate)"),
        ("/limits/spec/send", {"rate": {"limit": 5, "period": 1, "burst": 9}}, 422,
         "invalid_limit", "rate must have a burst of at most its limit 5, not 9"),
        ("/limits/spec/send", {"key_rate": "5/fortnight"}, 422, "invalid_limit",
         "key_rate must be a rate such as 100/min, 5/s, 1000/h or 10/30s (units: s, sec,"
         " second, m, min, minute, h, hour, d, day), not '5/fortnight'"),
        ("/limits/spec/send", {"rate": "0/s"}, 422, "invalid_limit",
         "rate must allow 1 to 2147483647 starts, not 0"),
        ("/limits/spec/send", {"rate": "99999999999999999999/s"}, 422, "invalid_limit",
         "rate must allow at most 2147483647 starts per period: 99999999999999999999 is too"
         " large"),
        ("/limits/spec/send", {}, 422, "invalid_limit", "a rule must set concurrency, rate,"
         " key_concurrency or key_rate (to remove a limit, clear it)"),
        ("/limits/tenant/send", {"concurrency": 1}, 422, "invalid_limit",
         "a limit's scope is queue or spec, not 'tenant' (as in /limits/spec/send_email)"),
        ("/limits/spec/" + "x" * 129, {"concurrency": 1}, 422, "invalid_limit",
         "a spec name is 1 to 128 letters, digits and '_.:-', starting with a letter or digit"),
        ("/limits/spec/sned", {"concurrency": 1}, 422, "unknown_spec", "spec 'sned' has no"
         " status quo; did you mean send?"),
        ("/limits/queue/defualt", {"concurrency": 1}, 422, "unknown_queue",
         "queue 'defualt' is unknown; did you mean default?"),
    ]:
        answer = await live.http.put(path, json=body)
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (status, code), (path, body, error)
        assert error["message"].startswith(says), (path, body, error["message"])
    assert (await live.http.get("/limits")).json()["limits"] == []
    assert await live.coordinator.store.runtime_limits() == []
    code, _, err = await invoke("limits", "set", "spec:send", "--concurrency", "0",
                                "--url", live.base)
    assert (code, err) == (1, "error: concurrency must be an integer >= 1 (invalid_limit)\n")
    code, _, err = await invoke("limits", "set", "spec:send", "--rate", "99999999999999999999/s",
                                "--url", live.base)
    assert (code, err) == (1, "error: --rate must allow at most 2147483647 starts per period:"
                              " 99999999999999999999 is too large\n")
    code, _, err = await invoke("limits", "set", "spec:send", "--rate", "5/fortnight",
                                "--url", live.base)
    assert (code, err) == (1, "error: --rate must be a rate such as 100/min, 5/s, 1000/h or"
                              " 10/30s (units: s, sec, second, m, min, minute, h, hour, d, day),"
                              " not '5/fortnight'\n")
    code, _, err = await invoke("limits", "set", "send", "--rate", "5/s", "--url", live.base)
    assert code == 1 and "names no limit: give queue:NAME or spec:NAME" in err


async def test_limits_set_changes_only_the_fields_given_unless_replace(live: Live,
                                                                       tmp_path: Path):
    """A new user sets a key's concurrency, then its rate: both hold (the CLI merges
    into the runtime rule); --replace sets the rule to the fields given; PUT replaces."""
    from rota.core.limits import LimitRule, Rate

    await live.push(write_spec(tmp_path / "specs", "keyed"))
    code, out, err = await invoke("limits", "set", "spec:keyed", "--concurrency", "3",
                                  "--key-concurrency", "2", "--url", live.base)
    assert (code, out) == (0, "spec:keyed: concurrency=3 key_concurrency=2 (until 'rota"
                           " limits clear spec:keyed')\n"), err
    code, out, err = await invoke("limits", "set", "spec:keyed", "--key-rate", "1/10s",
                                  "--url", live.base)
    assert (code, out) == (0, "spec:keyed: concurrency=3 key_concurrency=2 key_rate=1/10s"
                           " (until 'rota limits clear spec:keyed')\n  kept as set before:"
                           " concurrency, key_concurrency (--replace drops what is not"
                           " given)\n"), err
    in_force = live.coordinator.limiting.in_force
    assert in_force[("spec", "keyed")] == LimitRule(concurrency=3, key_concurrency=2,
                                                    key_rate=Rate(1, 10.0))
    code, out, err = await invoke("limits", "set", "spec:keyed", "--rate", "5/sec",
                                  "--replace", "--url", live.base)
    assert (code, out) == (0, "spec:keyed: rate=5/s (until 'rota limits clear"
                           " spec:keyed')\n"), err
    code, out, err = await invoke("limits", "set", "spec:keyed", "--concurrency", "2",
                                  "--url", live.base)  # a rate kept as it was
    assert out.startswith("spec:keyed: concurrency=2 rate=5/s (until"), (out, err)
    put = await live.http.put("/limits/spec/keyed", json={"concurrency": 4})
    assert put.json()["rule"] == {"concurrency": 4}  # the API replaces the whole rule


async def test_the_limits_page_says_where_each_limit_comes_from(live: Live, tmp_path: Path):
    """As `rota limits` does: "spec file", or "runtime, set <when>" (and by whom, with
    tokens on)."""
    await live.push(write_spec(tmp_path / "specs", "send", extra=SEND))
    await live.push(write_spec(tmp_path / "specs", "other"))
    put = (await live.http.put("/limits/spec/other", json={"concurrency": 2})).json()
    page = (await live.http.get("/ui/limits")).text
    assert ('per key: 100/min burst 10 starts <span class="muted">(spec file)</span>'
            in page), page
    assert (f'at most 2 running <span class="muted">(runtime, set {put["updated_at"]})</span>'
            in page), page
