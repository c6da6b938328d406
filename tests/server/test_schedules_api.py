"""Cron schedules over HTTP on a real server: add, show, list, pause, resume, delete; a push
that carries schedules (dry run included); and the precise 4xx of bad ones, with nothing
stored."""

from __future__ import annotations

import msgspec
import pytest
from conftest import Live, write_spec

pytestmark = pytest.mark.both_backends


async def put(live: Live, path: str, **body):
    return await live.http.put(f"/schedules/{path}", json=body)


async def test_a_schedule_is_added_shown_paused_resumed_and_deleted(live: Live, tmp_path):
    await live.push(write_spec(tmp_path / "specs", "report"))
    answer = await put(live, "nightly", spec="report", cron="30 2 * * *",
                       timezone="Europe/Berlin", args={"day": "today"})
    assert answer.status_code == 201, answer.text
    assert answer.json()["change"] == "new"
    shown = answer.json()["schedule"]
    assert shown["state"] == "active" and shown["overlap"] == "skip"
    assert shown["misfire"] == "catch_up" and shown["catch_up"] == 1
    assert len(shown["next_fires"]) == 5 and shown["last_tick"] is None
    # 02:30 in Berlin is 00:30 or 01:30 UTC
    assert all(t[11:16] in ("00:30", "01:30") for t in shown["next_fires"])
    again = await put(live, "nightly", spec="report", cron="30 2 * * *",
                      timezone="Europe/Berlin", args={"day": "today"})
    assert (again.status_code, again.json()["change"]) == (200, "unchanged")

    paused = (await live.http.post("/schedules/nightly/pause")).json()
    assert (paused["state"], paused["paused"]) == ("paused", True)
    listed = (await live.http.get("/schedules")).json()["schedules"]
    assert [(s["name"], s["state"]) for s in listed] == [("nightly", "paused")]
    resumed = (await live.http.post("/schedules/nightly/resume")).json()
    assert resumed["state"] == "active"

    gone = await live.http.delete("/schedules/nightly")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    missing = await live.http.get("/schedules/nightly")
    assert missing.status_code == 404
    assert missing.json()["error"] == {"code": "no_such_schedule", "message":
                                       "no schedule 'nightly' (`rota schedules` lists them)"}


async def test_a_schedule_of_a_spec_without_status_quo_waits_and_says_why(live: Live):
    shown = (await put(live, "later", spec="send_report", cron="@hourly")).json()["schedule"]
    assert shown["state"] == "waiting"
    assert shown["waiting_reason"] == "spec send_report has no status quo"


async def test_bad_schedules_are_refused_precisely_and_nothing_is_stored(live: Live, tmp_path):
    await live.push(write_spec(tmp_path / "specs", "report", extra='[args.day]\ntype = "string"\n'))
    cases = [
        ({"spec": "report", "cron": "@every 500ms"}, "invalid_cron",
         "schedule 'fast': '@every 500ms' fires every 0.5s; a schedule fires at most once a"
         " second ('@every 1s')"),
        ({"spec": "report", "cron": "0 25 * * *"}, "invalid_cron",
         "schedule 'fast': hour 25 is out of range 0-23"),
        ({"spec": "report", "cron": "@daily", "timezone": "+05:00"}, "invalid_timezone",
         "schedule 'fast': time zone '+05:00' is a fixed offset; use an IANA name such as"
         " 'America/New_York' or 'UTC'"),
        ({"spec": "report", "cron": "@daily", "overlap": "never"}, "invalid_schedule",
         "overlap must be one of allow, cancel_previous, enqueue, skip, not 'never'"),
        ({"spec": "report", "cron": "@daily", "args": {"day": 3}}, "invalid_args",
         "schedule 'fast': args.day must be a string, got an integer (spec 'report')"),
        ({"name": "other", "spec": "report", "cron": "@daily"}, "invalid_schedule",
         "the body names schedule 'other', the path 'fast'"),
    ]
    for body, code, message in cases:
        answer = await put(live, "fast", **body)
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"] == {"code": code, "message": message}
    assert (await live.http.get("/schedules")).json() == {"schedules": []}
    rule = ("a schedule's name is 1 to 100 letters, digits and '_.:-', starting with a letter"
            " or digit (its jobs' ids are cron-<name>-<tick>), not ")
    for path, said in (("a%20b", "'a b'"), ("a" * 101, "a name of 101 characters")):
        answer = await live.http.put(f"/schedules/{path}", json={"spec": "report",
                                                                 "cron": "@daily"})
        assert answer.status_code == 400
        assert answer.json()["error"] == {"code": "invalid_name", "message": rule + said}
    none = await live.http.get("/jobs", params={"schedule": "fast", "state": "available"})
    assert none.json() == {"jobs": [], "next_cursor": None}
    assert (await live.http.get("/jobs", params={"schedule": "fast"})).json()["jobs"] == []


async def test_a_push_carries_schedules_and_its_dry_run_changes_nothing(live: Live, tmp_path):
    spec = write_spec(tmp_path / "specs", "report")
    tables = [{"name": "nightly", "spec": "report", "cron": "@daily"}]
    body = {"specs": [msgspec.to_builtins(spec)], "schedules": tables, "dry_run": True}
    dry = (await live.http.put("/specs", json=body)).json()
    assert dry["schedules"] == [{"name": "nightly", "change": "new"}]
    assert (await live.http.get("/schedules")).json() == {"schedules": []}
    body["dry_run"] = False
    assert (await live.http.put("/specs", json=body)).json()["schedules"] == [
        {"name": "nightly", "change": "new"}]
    await live.http.post("/schedules/nightly/pause")
    tables[0]["cron"] = "@hourly"
    pushed = (await live.http.put("/specs", json=body)).json()
    assert pushed["schedules"] == [{"name": "nightly", "change": "changed"}]
    shown = (await live.http.get("/schedules/nightly")).json()
    assert (shown["cron"], shown["state"]) == ("@hourly", "paused")  # a push never un-pauses
    # a bad schedule refuses the whole push: neither spec nor schedule is stored
    bad = {"specs": [msgspec.to_builtins(write_spec(tmp_path / "s2", "other"))],
           "schedules": [{"name": "x", "spec": "other", "cron": "@every 0.2s"}]}
    answer = await live.http.put("/specs", json=bad)
    assert answer.status_code == 422
    assert answer.json()["error"]["message"] == (
        "schedules[0]: schedule 'x': '@every 0.2s' fires every 0.2s; a schedule fires at"
        " most once a second ('@every 1s')")
    names = [s["name"] for s in (await live.http.get("/specs")).json()["specs"]]
    assert names == ["report"]


async def test_a_row_stored_before_a_rule_refused_it_is_listed_waiting(live: Live):
    """An odd row (stored by an older Rota) never fails the listing of all."""
    from rota.core.schedules import ScheduleDef
    from rota.store import ticks

    odd = [ScheduleDef(name="huge", spec="echo", cron="@every 1000000000h"),
           ScheduleDef(name="nines", spec="echo", cron="@every " + "9" * 400 + "s")]
    await live.coordinator.store.writer.submit(
        lambda conn: [ticks.upsert(conn, d, 1_800_000_000.0) for d in odd])
    assert (await put(live, "fine", spec="echo", cron="@daily")).status_code == 201
    answer = await live.http.get("/schedules")
    assert answer.status_code == 200, answer.text
    listed = {s["name"]: s for s in answer.json()["schedules"]}
    assert listed["fine"]["next_fires"] and listed["fine"]["state"] == "waiting"
    huge = listed["huge"]
    assert (huge["state"], huge["cron"], huge["next_fires"]) == (
        "waiting", "@every 1000000000h", [])
    assert huge["waiting_reason"] == (
        "it cannot be read: duration '1000000000h' in '@every 1000000000h' is over a year;"
        " the longest is '@every 8760h' (a yearly time is '@yearly')")
    shown = await live.http.get("/schedules/nines")
    assert shown.status_code == 200 and shown.json()["state"] == "waiting"
    code = await live.http.put("/schedules/spaced", json={"spec": "echo", "cron": " @daily\n"})
    assert code.json()["schedule"]["cron"] == "@daily"


async def test_the_async_client_manages_schedules_as_the_sync_one(live: Live, tmp_path):
    """AsyncClient has the schedule calls too: add, show, pause, resume, list, delete."""
    from rota import ApiError, AsyncClient
    report = write_spec(tmp_path / "specs", "report")
    async with AsyncClient(live.base) as client:
        pushed = await client.push_deploy([report], [{"name": "hourly", "spec": "report",
                                                      "cron": "@hourly"}], dry_run=True)
        assert pushed["dry_run"] is True
        await client.push_deploy([report])
        made = await client.put_schedule("nightly", {"spec": "report", "cron": "30 2 * * *"})
        assert made["change"] == "new" and made["schedule"]["state"] == "active"
        assert (await client.pause_schedule("nightly"))["state"] == "paused"
        assert (await client.pause_schedule("nightly", paused=False))["state"] == "active"
        assert [s["name"] for s in (await client.schedules())["schedules"]] == ["nightly"]
        assert (await client.schedule("nightly"))["cron"] == "30 2 * * *"
        assert (await client.delete_schedule("nightly"))["deleted"] is True
        with pytest.raises(ApiError) as missing:
            await client.schedule("nightly")
        assert missing.value.code == "no_such_schedule"
