"""Unique jobs through the HTTP API, on both backends: each conflict policy's answer,
the 409 that names the holder, a replaced job cancelled (and gone from the waiting
count), the key in the job's view, a spec's [unique] as its jobs' default, bad options
refused with nothing stored, and concurrent enqueues of one key making one job."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import corpus
import pytest
from conftest import Live, write_spec
from helpers import rota

from rota import ApiError, AsyncClient, Client, UniqueOptions

pytestmark = pytest.mark.both_backends

BY_USER = {"keys": ["args"], "args_keys": ["user"]}


async def post(live: Live, **body):
    return await live.http.post("/jobs", json={"spec": "mail", **body})


async def test_each_conflict_policy_answers_as_documented(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "mail", queue="nobody"))
    first = await post(live, args={"user": 1, "n": 1}, unique=BY_USER)
    assert first.status_code == 201 and first.json()["created"] is True
    held = first.json()["job"]
    assert len(held["unique_key"]) == 64
    assert (await live.job(held["id"]))["unique_key"] == held["unique_key"]
    # existing (the default): the job that holds the key, 200, created false
    again = await post(live, args={"user": 1, "n": 2}, unique=BY_USER)
    assert again.status_code == 200, again.text
    assert (again.json()["created"], again.json()["job"]["id"]) == (False, held["id"])
    # another user is another key
    other = await post(live, args={"user": 2, "n": 1}, unique=BY_USER)
    assert other.status_code == 201
    # reject: 409 naming the job
    refused = await post(live, args={"user": 1}, unique={**BY_USER, "on_conflict": "reject"})
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "unique_conflict" and held["id"] in error["message"]
    assert error["details"] == {"job_id": held["id"], "state": "available",
                                "unique_key": held["unique_key"]}
    # replace: the waiting holder is cancelled, recorded as replaced; the new one holds
    new = await post(live, args={"user": 1, "n": 3}, unique={**BY_USER, "on_conflict": "replace"})
    assert new.status_code == 201, new.text
    newer = new.json()["job"]
    assert newer["id"] != held["id"] and newer["unique_key"] == held["unique_key"]
    old = await live.job(held["id"])
    assert old["state"] == "cancelled" and old["unique_key"] is None
    assert old["errors"][-1]["type"] == "replaced" and newer["id"] in old["errors"][-1]["message"]
    page = await live.http.get(f"/ui/jobs/{newer['id']}")  # the dashboard's job page
    assert page.status_code == 200 and "Unique key" in page.text
    assert newer["unique_key"][:16] in page.text
    # what waits, as the server holds it: user 2's and the replacement
    assert live.coordinator.waiting()[0][:3] == ("nobody", "mail", 2)


async def test_replace_refuses_a_running_holder_and_a_finished_one_frees_the_key(
        live: Live, tmp_path: Path, connect):
    spec = write_spec(tmp_path, "mail")
    await live.push(spec)
    for_a_day = {**BY_USER, "states": "finished", "period": 86400}
    kept = (await post(live, args={"user": 1}, unique=for_a_day)).json()["job"]
    freed = (await post(live, args={"user": 2}, unique=BY_USER)).json()["job"]
    worker = await connect("w1")
    await worker.register([spec], concurrency=2)
    copies = await worker.jobs(2)
    assert {c["id"] for c in copies} == {kept["id"], freed["id"]}
    running = await post(live, args={"user": 2}, unique={**BY_USER, "on_conflict": "replace"})
    assert running.status_code == 409, running.text
    assert "replaces a waiting job only" in running.json()["error"]["message"]
    assert running.json()["error"]["details"]["state"] == "active"
    for copy in copies:
        await worker.complete(copy)
    await live.wait_state(kept["id"], "completed")
    await live.wait_state(freed["id"], "completed")
    reject = {**BY_USER, "on_conflict": "reject"}
    again = await post(live, args={"user": 1}, unique=reject)
    assert again.status_code == 409, again.text  # "finished": kept for the period
    after = await post(live, args={"user": 2}, unique=reject)
    assert after.status_code == 201, after.text  # "active" covers no finished job


async def test_a_specs_unique_table_is_its_jobs_default(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "mail", queue="nobody",
                               extra='[unique]\non_conflict = "reject"\n'))
    assert (await post(live, args={"a": 1})).status_code == 201
    refused = await post(live, args={"a": 2})  # keys default to the spec alone (OJS)
    assert refused.status_code == 409, refused.text
    own = await post(live, args={"a": 3}, unique={"key": "mine"})  # the request's own wins
    assert own.status_code == 201


async def test_contradicting_options_are_422_and_store_nothing(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "mail", queue="nobody"))
    for name, unique, words in corpus.UNIQUE_OPTIONS:
        refused = await post(live, args={"user": 1}, unique=unique)
        assert refused.status_code == 422, (name, refused.text)
        assert refused.json()["error"]["code"] == "invalid_unique", name
        assert words in refused.json()["error"]["message"], name
    unknown = await post(live, unique={"keys": ["meta"]})  # a dimension Rota has not
    assert unknown.status_code == 422 and "unique.keys[0] must be one of" in unknown.text
    forged = await post(live, unique={"key": "a\nERROR forged"})
    assert "unique.key must be a key of 1 to 256 characters, with no control" in forged.text
    assert (await live.http.get("/jobs")).json()["jobs"] == []


async def test_fifty_concurrent_enqueues_of_one_key_make_one_job(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "mail", queue="nobody"))
    answers = await asyncio.gather(*(post(live, args={"user": 1, "n": n}, unique=BY_USER)
                                     for n in range(50)))
    assert sorted(a.status_code for a in answers) == [200] * 49 + [201]
    assert len({a.json()["job"]["id"] for a in answers}) == 1
    assert [a.json()["created"] for a in answers].count(True) == 1
    # and in one batch: the first takes the key, the rest get it
    batch = await live.http.post("/jobs/batch", json={"jobs": [
        {"spec": "mail", "args": {"user": 9}, "unique": BY_USER} for _ in range(3)]})
    results = batch.json()["results"]
    assert [r["status"] for r in results] == [201, 200, 200]
    assert len({r["job"]["id"] for r in results}) == 1


@pytest.mark.sqlite_only("the clients' and the CLI's words; the store is the same")
async def test_the_clients_and_the_cli_take_a_unique_key(live: Live, tmp_path: Path):
    await live.push(write_spec(tmp_path, "mail", queue="nobody"))
    with Client(live.base) as client:
        made = await asyncio.to_thread(client.enqueue, "mail", {"n": 1}, unique_key="k1")
        same = await asyncio.to_thread(client.enqueue, "mail", {"n": 2},
                                       unique=UniqueOptions(key="k1"))
    assert made.created and not same.created and same.id == made.id
    async with AsyncClient(live.base) as producer:
        with pytest.raises(ApiError) as refused:
            await producer.enqueue("mail", unique={"key": "k1", "on_conflict": "reject"})
    assert refused.value.status == 409 and made.id in str(refused.value)
    code, out, err = await rota("enqueue", "mail", "--unique-key", "k1", "--url", live.base)
    assert code == 0 and json.loads(out)["id"] == made.id
    assert "a job with this unique key exists already" in err
    code, out, err = await rota("enqueue", "mail", "--unique-key", "k1", "--unique-on",
                                "reject", "--url", live.base)
    assert code != 0 and made.id in err and len(err.strip().splitlines()) == 1, err
    code, _, err = await rota("enqueue", "mail", "--unique-on", "reject", "--url", live.base)
    assert code != 0 and "--unique-on needs --unique-key" in err
