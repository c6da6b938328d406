"""Push execution's classification (rota/server/deliverer.py ``classify``), without
sockets: every class of an endpoint's answer, Retry-After in seconds and as an HTTP date
(capped), and the attempt's record in each failure."""

from __future__ import annotations

import email.utils

import pytest

from rota.base.egress import Answer
from rota.base.push import Delivery
from rota.core.settings import ServerSettings
from rota.server.deliverer import MAX_RETRY_AFTER, callback_base, classify, retry_after

NOW = 1_800_000_000.0
D = Delivery(job_id="j1", attempt=2, spec="resize", checksum="c" * 16, queue="default",
             args=[1], priority=0, url="https://fn.example/run", timeout=5.0, headers={},
             secret="s", delivery_id="del-1", deadline=NOW + 30, callback_token="tok")


def answer(status: int | None = 200, body: bytes = b"", **extra: object) -> Answer:
    return Answer(status=status, body=body, ms=12.5, **extra)  # type: ignore[arg-type]


def test_a_2xx_with_json_completes_with_the_body_or_its_ojs_result():
    done = classify(D, answer(200, b'{"echo": [1]}'), now=NOW)
    assert (done.kind, done.result, done.status, done.ms) == ("completed", {"echo": [1]}, 200,
                                                              12.5)
    assert (done.job_id, done.attempt, done.delivery_id) == ("j1", 2, "del-1")
    assert classify(D, answer(201, b"[1, 2]"), now=NOW).result == [1, 2]
    ojs = classify(D, answer(200, b'{"status": "completed", "result": {"id": 7}}'), now=NOW)
    assert (ojs.kind, ojs.result, ojs.fault) == ("completed", {"id": 7}, False)


def test_an_ojs_failed_body_fails_the_job_not_the_endpoint():
    body = b'{"status": "failed", "error": {"code": "smtp", "message": "refused"}}'
    done = classify(D, answer(200, body), now=NOW)
    assert done.kind == "failed" and done.fault is False and done.error is not None
    assert (done.error.type, done.error.code, done.error.message) == ("smtp", "smtp", "refused")
    assert done.error.retryable is True  # (OJS's default)
    final = classify(D, answer(200, b'{"status": "failed", "error": {"retryable": false}}'),
                     now=NOW)
    assert final.error is not None and final.error.retryable is False
    assert final.error.type == "handler_error"


def test_202_is_accepted_whatever_its_body():
    done = classify(D, answer(202, b"x" * 10, truncated=True), now=NOW)
    assert (done.kind, done.error, done.fault) == ("accepted", None, False)


def test_an_empty_2xx_such_as_a_204_completes_with_no_result():
    for status in (200, 204):
        done = classify(D, answer(status, b""), now=NOW)
        assert (done.kind, done.result, done.error) == ("completed", None, None)


@pytest.mark.parametrize("body, truncated, why", [
    (b"hello", False, "not JSON"),
    (b'{"name": "caf\xe9"}', False, "not UTF-8"), (b'{"pad": "xxxx', True, "over 1048576 bytes"),
])
def test_an_unusable_2xx_is_a_bad_response(body: bytes, truncated: bool, why: str):
    done = classify(D, answer(200, body, truncated=truncated), now=NOW)
    assert done.kind == "failed" and done.error is not None
    assert (done.error.type, done.error.retryable, done.fault) == ("bad_response", True, True)
    assert why in done.error.message


@pytest.mark.parametrize("status, retryable, fault", [
    (408, True, True), (429, True, True), (500, True, True), (503, True, True),
    (409, True, False),  # (the issue: 4xx other than 408, 409 and 429 fail without retry)
    (401, False, True), (403, False, True), (404, False, True),
    (400, False, False), (422, False, False),
])
def test_http_failures_by_status(status: int, retryable: bool, fault: bool):
    done = classify(D, answer(status, b'{"error": "x"}'), now=NOW)
    assert done.kind == "failed" and done.error is not None
    assert (done.error.type, done.error.retryable, done.fault) == (f"http_{status}", retryable,
                                                                   fault)
    assert done.error.details == {"delivery_id": "del-1", "status": status, "ms": 12.5,
                                  "body": '{"error": "x"}'}


def test_retry_after_in_seconds_or_as_a_date_capped_at_an_hour():
    later = email.utils.formatdate(NOW + 90, usegmt=True)
    assert classify(D, answer(429, headers={"retry-after": "1"}), now=NOW).retry_in == 1.0
    assert classify(D, answer(503, headers={"retry-after": later}), now=NOW).retry_in == 90.0
    assert classify(D, answer(503), now=NOW).retry_in is None
    assert retry_after("86400", NOW) == MAX_RETRY_AFTER
    assert retry_after(email.utils.formatdate(NOW + 86400, usegmt=True), NOW) == MAX_RETRY_AFTER
    assert retry_after(email.utils.formatdate(NOW - 60, usegmt=True), NOW) == 0.0
    assert retry_after("soon", NOW) is None and retry_after("-5", NOW) is None


def test_a_redirect_is_never_followed_here_and_names_its_location():
    done = classify(D, answer(302, headers={"location": "http://other.invalid/x"}), now=NOW)
    assert done.error is not None and done.error.type == "redirect"
    assert (done.error.retryable, done.fault) == (False, True)
    assert "http://other.invalid/x" in done.error.message
    looped = classify(D, answer(307, headers={"location": "/again"}, redirects=3), now=NOW)
    assert looped.error is not None and "after 3 redirects" in looped.error.message


@pytest.mark.parametrize("kind, retryable", [
    ("timeout", True), ("connect", True), ("address_refused", False), ("invalid_url", False)])
def test_no_answer(kind: str, retryable: bool):
    done = classify(D, answer(None, error=kind, message="what happened"), now=NOW)
    assert done.kind == "failed" and done.error is not None and done.status is None
    assert (done.error.type, done.error.retryable, done.fault) == (kind, retryable, True)
    assert done.error.message == "what happened"


def test_the_record_keeps_2048_bytes_of_the_body_as_text():
    done = classify(D, answer(500, b"\xff" + b"y" * 5000), now=NOW)
    assert done.body.startswith("\ufffd") and len(done.body) == 2048
    assert done.record()["body"] == done.body


def test_the_callback_base_is_the_public_url_else_where_the_server_listens():
    assert callback_base(ServerSettings(public_url="https://rota.example/"), 8000) \
        == "https://rota.example"
    assert callback_base(ServerSettings(host="127.0.0.1"), 8123) == "http://127.0.0.1:8123"
    assert callback_base(ServerSettings(host="::"), 80) == "http://[::1]:80"
    assert callback_base(ServerSettings(host="0.0.0.0", ssl_certfile="c.pem"), 443) \
        == "https://127.0.0.1:443"


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1",
                                     "::ffff:10.0.0.1", "100.100.100.200", "2002:7f00:1::1",
                                     "fc00::1", "0.0.0.0", "224.0.0.1"])
def test_an_address_off_the_public_internet_is_refused(address: str):
    from rota.base.egress import address_refused
    assert "--allow-private-endpoints" in (address_refused(address) or "")


def test_a_public_address_is_not_refused():
    from rota.base.egress import address_refused
    assert address_refused("8.8.8.8") is None and address_refused("2001:4860:4860::8888") is None
