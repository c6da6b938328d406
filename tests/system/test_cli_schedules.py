"""``rota schedules`` and a spec directory's ``[[schedule]]`` tables through ``rota specs
push``, as a user types them, against a real server."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Live
from test_flow import invoke

from rota.base.specs import checksum, load_deploy, parse_spec

REPORT = '''name = "send_report"
version = "1"

[args.team]
type = "string"

[[schedule]]
name = "nightly-report"
cron = "30 2 * * *"
timezone = "America/New_York"
args = { team = "ops" }
'''
HOURLY = '''[[schedule]]
name = "hourly-report"
spec = "send_report"
cron = "@hourly"
args = { team = "sales" }
overlap = "enqueue"
'''


async def test_schedules_in_a_spec_directory_are_pushed_and_listed(live: Live, tmp_path: Path):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "send_report.toml").write_text(REPORT)
    (specs / "schedules.toml").write_text(HOURLY)
    loaded, tables = load_deploy(specs)
    # the table is no part of the spec: its checksum is the spec's alone
    assert [checksum(s) for s in loaded] == [checksum(parse_spec(REPORT.split("[[")[0]))]
    assert [t["name"] for t in tables] == ["hourly-report", "nightly-report"]

    code, out, _ = await invoke("specs", "push", str(specs), "--dry-run", "--url", live.base)
    assert code == 0
    assert "new       schedule hourly-report" in out and "dry run" in out
    code, out, err = await invoke("schedules", "--url", live.base)
    assert (code, out) == (0, "") and err.startswith("no schedules;")
    code, out, _ = await invoke("schedules", "--json", "--url", live.base)
    assert json.loads(out) == {"schedules": []} == (await live.http.get("/schedules")).json()
    code, _, err = await invoke("schedules", "add", "a b", "--spec", "x", "--cron", "@daily",
                                "--url", live.base)
    assert err == ("error: a schedule's name is 1 to 100 letters, digits and '_.:-', starting"
                   " with a letter or digit (its jobs' ids are cron-<name>-<tick>), not 'a b'"
                   " (invalid_schedule)\n")

    code, out, _ = await invoke("specs", "push", str(specs), "--url", live.base)
    assert code == 0 and out.count("new       schedule") == 2
    code, out, _ = await invoke("schedules", "--url", live.base)
    header, first, second = out.splitlines()
    assert header.split() == ["NAME", "EXPRESSION", "ZONE", "STATE", "LAST", "RUN", "NEXT",
                              "FIRE"]
    assert first.split()[:4] == ["hourly-report", "@hourly", "UTC", "active"]
    assert second.split()[:7] == ["nightly-report", "30", "2", "*", "*", "*",
                                  "America/New_York"]
    assert "never" in second

    code, out, _ = await invoke("schedules", "pause", "nightly-report", "--url", live.base)
    assert (code, out) == (0, "nightly-report is paused\n")
    code, out, _ = await invoke("specs", "push", str(specs), "--url", live.base)
    assert "unchanged schedule nightly-report" in out  # and still paused
    code, out, _ = await invoke("schedules", "show", "nightly-report", "--url", live.base)
    assert "state:        paused" in out and "timezone:     America/New_York" in out
    assert "next fires:   (paused)\n" in out  # not times that will not come
    assert "priority:     (the spec's)" in out and "max attempts: (the spec's)" in out
    code, out, _ = await invoke("schedules", "resume", "nightly-report", "--url", live.base)
    assert out.startswith("nightly-report is active; next fire 20")
    code, out, _ = await invoke("schedules", "show", "nightly-report", "--url", live.base)
    assert out.count("T0") + out.count("T1") + out.count("T2") >= 5  # the next fires
    code, out, _ = await invoke("schedules", "delete", "hourly-report", "--url", live.base)
    assert out == "hourly-report is deleted (its jobs stay)\n"


async def test_schedules_add_from_flags_and_bad_input_in_one_line(live: Live, tmp_path: Path):
    code, out, _ = await invoke("schedules", "add", "ping", "--spec", "echo", "--cron",
                                "@every 1m", "--url", live.base)
    assert code == 0 and out.startswith("new       ping  @every 1m (UTC)  state=waiting")
    code, _, err = await invoke("schedules", "add", "fast", "--spec", "echo", "--cron",
                                "@every 500ms", "--url", live.base)
    assert code == 1
    assert err == ("error: schedule 'fast': '@every 500ms' fires every 0.5s; a schedule fires"
                   " at most once a second ('@every 1s') (invalid_cron)\n")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "s.toml").write_text('[[schedule]]\nname = "x"\nspec = "y"\ncron = "@daily"\n'
                                'timezone = "Mars/Base"\n')
    code, _, err = await invoke("specs", "push", str(bad), "--url", live.base)
    assert code == 1
    assert err == (f"error: {bad / 's.toml'}: schedule 'x': unknown time zone 'Mars/Base'"
                   " (invalid_timezone)\n")
    (tmp_path / "two.toml").write_text(HOURLY + HOURLY.replace("hourly-report", "daily-report")
                                       .replace("@hourly", "@daily"))
    code, out, _ = await invoke("schedules", "add", "daily-report", "--file",
                                str(tmp_path / "two.toml"), "--url", live.base)
    assert code == 0 and out.startswith("new       daily-report  @daily (UTC)  state=waiting")
    code, out, _ = await invoke("schedules", "add", "--file", str(tmp_path / "two.toml"),
                                "--url", live.base)
    assert [line.split()[:2] for line in out.splitlines()] == [
        ["new", "hourly-report"], ["unchanged", "daily-report"]]
    code, _, err = await invoke("schedules", "show", "nope", "--url", live.base)
    assert (code, err) == (1, "error: no schedule 'nope' (`rota schedules` lists them)"
                              " (no_such_schedule)\n")


async def test_the_readme_schedule_table_is_pushed_as_written(live: Live, tmp_path: Path):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Cron schedules"):]
    table = section[section.index("```toml\n") + 8:section.index("```\n", 8)]
    root = Path(__file__).resolve().parents[2]
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "echo.toml").write_text((root / "specs" / "echo.toml").read_text() + "\n" + table)
    code, out, err = await invoke("specs", "push", str(specs), "--url", live.base)
    assert code == 0, err
    assert "new       schedule nightly-echo" in out
    shown = (await live.http.get("/schedules/nightly-echo")).json()
    assert (shown["spec"], shown["timezone"], shown["jitter"]) == ("echo", "Europe/Berlin", 30)
    assert shown["args"] == {"message": "good night"} and shown["state"] == "active"


async def test_add_refuses_an_existing_name_unless_replace_and_keeps_a_pause(live: Live,
                                                                             tmp_path: Path):
    add = ("schedules", "add", "tidy", "--spec", "echo", "--url", live.base)
    code, _, _ = await invoke(*add, "--cron", "@hourly", "--overlap", "enqueue", "--paused")
    assert code == 0
    code, out, err = await invoke(*add, "--cron", "@daily")
    assert (code, out) == (1, "")
    assert err == ("error: schedule tidy exists: give --replace to replace it whole (options"
                   " not given go back to their defaults), or use pause/resume/delete\n")
    shown = (await live.http.get("/schedules/tidy")).json()
    assert (shown["cron"], shown["overlap"], shown["paused"]) == ("@hourly", "enqueue", True)
    code, out, _ = await invoke(*add, "--cron", "@daily", "--replace", "--priority", "7",
                                "--max-attempts", "2")
    assert out == "changed   tidy  @daily (UTC)  state=paused  next=(paused)\n"
    code, out, _ = await invoke("schedules", "show", "tidy", "--url", live.base)
    assert "priority:     7\n" in out and "max attempts: 2\n" in out
    shown = (await live.http.get("/schedules/tidy")).json()
    assert (shown["overlap"], shown["paused"]) == ("skip", True)  # whole, and still paused
    code, out, _ = await invoke(*add, "--cron", "@daily", "--replace", "--active")
    assert code == 0 and out.endswith("state=waiting  next=(waiting: spec echo has no status"
                                      " quo)\n")
    code, out, _ = await invoke("schedules", "show", "tidy", "--url", live.base)
    assert "next fires:   (waiting: spec echo has no status quo)\n" in out
    (tmp_path / "s.toml").write_text(HOURLY)
    code, _, err = await invoke("schedules", "add", "--file", str(tmp_path / "s.toml"),
                                "--cron", "@daily", "--queue", "q", "--url", live.base)
    assert (code, err) == (1, "error: --file gives the whole definition: leave out --cron,"
                              " --queue (or leave out --file)\n")


async def test_a_schedules_jobs_are_listed_by_name_not_by_id_prefix(live: Live):
    from conftest import write_spec
    from helpers import wait_until

    await live.push(write_spec(live.tmp / "specs", "tick"))
    for name in ("ov", "ov-allow"):  # 'cron-ov-' is a prefix of ov-allow's ids too
        await live.http.put(f"/schedules/{name}", json={"spec": "tick", "cron": "@every 1s"})

    async def both() -> bool:
        found = [(await live.http.get("/jobs", params={"schedule": n})).json()["jobs"]
                 for n in ("ov", "ov-allow")]
        return all(found)

    await wait_until(both, timeout=10, what="a tick job of each")
    for name in ("ov", "ov-allow"):
        await live.http.post(f"/schedules/{name}/pause")
    listed = (await live.http.get("/jobs", params={"schedule": "ov"})).json()["jobs"]
    assert {j["schedule"] for j in listed} == {"ov"}
    assert all(j["id"].startswith("cron-ov-2") for j in listed)
    code, out, _ = await invoke("jobs", "list", "--schedule", "ov", "--url", live.base)
    assert code == 0
    ids = [line.split()[0] for line in out.splitlines()[1:]]
    assert ids == [j["id"] for j in listed]
    code, out, _ = await invoke("jobs", "list", "--schedule", "ov-allow", "--state",
                                "completed", "--url", live.base)
    assert (code, out) == (0, "")


async def test_a_push_names_the_schedules_whose_args_its_specs_would_refuse(live: Live,
                                                                           tmp_path: Path):
    from conftest import write_spec

    specs = tmp_path / "specs"
    await live.push(write_spec(specs, "echo"))
    code, _, _ = await invoke("schedules", "add", "nightly", "--spec", "echo", "--cron",
                              "@daily", "--url", live.base)
    assert code == 0
    write_spec(specs, "echo", version="2", extra='[args.level]\ntype = "string"\n')
    refused = "schedule nightly: its args {} refused: spec 'echo' requires argument 'level'"
    code, out, _ = await invoke("specs", "push", str(specs), "--dry-run", "--url", live.base)
    assert code == 0 and refused.format("would be") + "\n" in out
    code, out, _ = await invoke("specs", "push", str(specs), "--url", live.base)
    assert code == 0 and out.startswith("changed   echo")  # pushed all the same
    assert refused.format("are") + " (it waits until its args or its spec fit)\n" in out


async def test_add_warns_of_a_spec_with_no_status_quo_and_keeps_it(live: Live, tmp_path: Path):
    from conftest import write_spec

    await live.push(write_spec(tmp_path / "specs", "echo"))
    code, out, err = await invoke("schedules", "add", "typo", "--spec", "ecoh", "--cron",
                                  "@daily", "--url", live.base)
    assert code == 0 and "state=waiting" in out  # accepted: it may come before its spec
    assert err == ("warning: spec 'ecoh' has no status quo yet: the schedule waits until it"
                   " is pushed (did you mean echo?)\n")
    code, _, err = await invoke("schedules", "add", "other", "--spec", "nosuch", "--cron",
                                "@daily", "--url", live.base)
    assert code == 0 and err == ("warning: spec 'nosuch' has no status quo yet: the schedule"
                                 " waits until it is pushed\n")
    code, _, err = await invoke("schedules", "add", "fine", "--spec", "echo", "--cron",
                                "@daily", "--url", live.base)
    assert (code, err) == (0, "")
