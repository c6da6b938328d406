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
