"""Retiring a spec: new jobs are refused, the ones that wait still run on matching
workers (or are cancelled on request), the history says so, a restart remembers it, and
pushing the spec again brings it back. Through a real server, the HTTP route and the
``rota specs retire`` command."""

from __future__ import annotations

from pathlib import Path

from conftest import RawWorker, start_server, stop_server, write_spec
from helpers import rota

# The server's scenarios run on SQLite; what they rely on the store for runs on both
# backends in tests/store/test_store_contract.py.


async def test_a_retired_spec_takes_no_new_jobs_and_its_waiting_jobs_still_run(
        tmp_path: Path):
    spec = write_spec(tmp_path / "specs", "echo")
    live = await start_server(tmp_path)
    try:
        await live.push(spec)
        worker = await RawWorker.open(live.ws, "w1")
        await worker.register([spec], concurrency=1)
        running = await live.enqueue("echo", {"n": 1})
        [held] = await worker.jobs(1)
        assert held["id"] == running["id"]
        waiting = await live.enqueue("echo", {"n": 2})
        later = await live.enqueue("echo", {"n": 3}, delay=3600)

        code, out, err = await rota("specs", "retire", "echo", "--url", live.base)
        assert code == 0, err
        assert "echo is now retired" in out
        assert "waiting: 2 (scheduled 1, available 1, retryable 0); running: 1;" \
               " matching workers: 1" in out
        assert "--cancel-waiting" in out

        refused = await live.http.post("/jobs", json={"spec": "echo", "args": {}})
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["code"] == "spec_retired"
        assert "was retired at" in error["message"] and "push it again" in error["message"]
        batch = await live.http.post("/jobs/batch", json={"jobs": [{"spec": "echo"}]})
        assert batch.json()["results"][0]["error"]["code"] == "spec_retired"

        # What waits still runs on the worker that matches.
        await worker.complete(held, capacity=1)
        [next_job] = await worker.jobs(1)
        assert next_job["id"] == waiting["id"]
        await worker.complete(next_job, capacity=1)
        await live.wait_state(waiting["id"], "completed")

        [listed] = (await live.http.get("/specs")).json()["specs"]
        assert listed["name"] == "echo" and listed["retired_at"] is not None
        history = (await live.http.get("/specs/echo/history")).json()["history"]
        assert [entry["event"] for entry in history] == ["push", "retire"]

        # Again, cancelling what waits: the scheduled one.
        again = await live.http.post("/specs/echo/retire", json={"cancel_waiting": True})
        assert again.status_code == 200, again.text
        report = again.json()
        assert report["already_retired"] is True and report["cancelled"] == 1
        assert report["jobs"] == {"scheduled": 0, "available": 0, "retryable": 0, "active": 0}
        assert (await live.job(later["id"]))["state"] == "cancelled"
        assert len((await live.http.get("/specs/echo/history")).json()["history"]) == 2

        missing = await live.http.post("/specs/nope/retire")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        code, _, err = await rota("specs", "retire", "nope", "--url", live.base)
        assert code != 0 and "no status quo" in err
        await worker.ws.close()
    finally:
        await stop_server(live)

    live = await start_server(tmp_path, port=live.port)  # a restart remembers it
    try:
        refused = await live.http.post("/jobs", json={"spec": "echo", "args": {}})
        assert refused.json()["error"]["code"] == "spec_retired"
        pushed = await live.push(spec)  # the same version again brings it back
        assert pushed["specs"][0]["change"] == "restored"
        job = await live.enqueue("echo", {"n": 4})
        assert job["state"] == "available"
        history = (await live.http.get("/specs/echo/history")).json()["history"]
        assert [entry["event"] for entry in history] == ["push", "retire", "push"]
        assert (await live.http.get("/specs")).json()["specs"][0]["retired_at"] is None
    finally:
        await stop_server(live)
