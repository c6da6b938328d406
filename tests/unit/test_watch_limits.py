"""`rota watch`'s LIMITS section and the jobs labels hold under BLOCKED, from a GET
/queues answer as the server gives it (rota/cli/live.py), without a server."""

from __future__ import annotations

from typing import Any

from rota.cli.live import render, snapshot

QUEUES = {"queues": [{"name": "emails", "counts": {"available": 5}, "workers": 1,
                      "paused": False, "oldest_available_age": 1.0,
                      "waiting": [{"spec": "send_email", "available": 5, "reason": None,
                                   "blocked": False,
                                   "held": {"concurrency_limit": 3, "no_label": 2},
                                   "missing_labels": ["gpu", "region:eu"],
                                   "missing_labels_more": 0}]}],
          "others": None,
          "limits": [{"name": "spec:send_email", "concurrency": 40, "running": 3},
                     {"name": "spec:send_email", "key": "acme", "concurrency": 3,
                      "running": 3},
                     {"name": "queue:emails", "rate": "5/s", "starts": 5, "next_start": 0.4},
                     {"name": "queue:idle", "concurrency": 2}]}


class FakeClient:
    def queues(self) -> dict[str, Any]:
        return QUEUES

    def workers(self) -> dict[str, Any]:
        return {"workers": []}

    def stats(self, minutes: int) -> dict[str, Any]:
        return {"now": "2026-11-27T10:00:00.000Z", "minute_starts": [], "series": []}


def test_watch_shows_each_limit_in_use_and_the_jobs_labels_hold():
    view = snapshot(FakeClient())  # type: ignore[arg-type]
    lines = render(view, "http://rota", 2.0, 200)
    at = lines.index("LIMITS")
    assert lines[at + 1:at + 5] == [
        "spec:send_email  3/40 running",
        "spec:send_email  3/3 running  key acme",
        "queue:emails     0 running  5 started of 5/s  next start in 0.4 s",
        ""]  # queue:idle: set, not in use
    assert "emails/send_email: 2 waiting: no connected worker has labels gpu, region:eu" in lines


def test_watch_says_when_no_limit_is_in_use():
    view = snapshot(FakeClient())  # type: ignore[arg-type]
    lines = render({**view, "limits": []}, "http://rota", 2.0, 200)
    assert lines[lines.index("LIMITS") + 1] == "(no limit in use)"
