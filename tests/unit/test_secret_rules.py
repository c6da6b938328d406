"""Endpoint signing secrets, the rules (rota/core/secrets.py): a name's environment
variable, what a value may be, the values a rotation keeps in force, and the push's
refusal of a spec whose secret is set nowhere."""

from __future__ import annotations

import pytest

from rota.base.specs import parse_spec
from rota.core.secrets import (env_name, in_force, name_problem, unknown_secrets,
                               value_problem, window_problem)


@pytest.mark.parametrize(("name", "variable"), [
    ("stripe", "ROTA_SECRET_STRIPE"),
    ("Stripe.Live", "ROTA_SECRET_STRIPE_LIVE"),
    ("billing-hook:v2", "ROTA_SECRET_BILLING_HOOK_V2"),
    ("a_b", "ROTA_SECRET_A_B"),
    ("9lives", "ROTA_SECRET_9LIVES"),
])
def test_a_name_maps_to_rota_secret_and_the_name_upper_cased_with_underscores(name, variable):
    assert env_name(name) == variable


def test_values_are_16_to_4096_bytes_of_printable_text():
    assert value_problem("x" * 16) is None and value_problem("é" * 2048) is None
    assert "16 bytes at least (this one is 15)" in str(value_problem("x" * 15))
    assert "4096 bytes at most" in str(value_problem("é" * 2049))  # bytes, not characters
    assert "holds '\\n'" in str(value_problem("a" * 20 + "\n"))
    assert "holds '\\x1b'" in str(value_problem("\x1b[31m" + "a" * 20))
    assert "begin or end with a space" in str(value_problem(" " + "a" * 20))
    assert name_problem("stripe.live") is None
    assert "not 'a b'" in str(name_problem("a b"))
    assert window_problem(0) is None and window_problem(30 * 86400) is None
    assert window_problem(-1) and window_problem(float("nan")) and window_problem(31 * 86400)


def test_a_rotation_keeps_the_previous_value_in_force_until_its_window_ends():
    row = {"value": "new-value-0123456789", "previous": "old-value-0123456789",
           "previous_until": 1000.0}
    assert in_force(row, 999.9) == ["new-value-0123456789", "old-value-0123456789"]
    assert in_force(row, 1000.0) == ["new-value-0123456789"]
    assert in_force({**row, "previous": None, "previous_until": None}, 0) == [row["value"]]


def test_a_push_of_a_spec_whose_secret_is_set_nowhere_is_refused_naming_both():
    hooked = parse_spec('name = "charge"\nversion = "1"\n[execute]\n'
                        'url = "https://pay.example.com/run"\nsecret = "stripe.live"\n')
    plain = parse_spec('name = "echo"\nversion = "1"\n')
    assert unknown_secrets([hooked, plain], lambda name: name == "stripe.live") is None
    refusal = unknown_secrets([plain, hooked], lambda name: False)
    assert refusal is not None and refusal.code == "unknown_secret"
    assert refusal.message == (
        "spec charge: its [execute] secret 'stripe.live' is not set (set it with 'rota"
        " secrets set stripe.live', or the server's environment variable"
        " ROTA_SECRET_STRIPE_LIVE)")


def test_a_push_of_a_literal_private_endpoint_is_refused_unless_allowed():
    from rota.base.specs import Execute, JobSpec
    from rota.core.secrets import private_endpoints

    def spec(url: str) -> JobSpec:
        return JobSpec(name="s", version="1", execute=Execute(url=url, secret="k"))
    for url in ("http://127.0.0.1:8080/x", "http://localhost/x", "http://[::1]/", "http://10.0.0.7/"):
        refusal = private_endpoints([spec(url)], allowed=False)
        assert refusal is not None and refusal.code == "private_endpoint"
        assert "--allow-private-endpoints" in str(refusal)
        assert private_endpoints([spec(url)], allowed=True) is None
    assert private_endpoints([spec("https://hooks.example.com/x")], allowed=False) is None


def test_a_url_without_a_scheme_is_said_so():
    from rota.base.egress import url_problem
    assert url_problem("localhost:9000") == \
        "has no scheme: write it as http://localhost:9000 (or https://)"
    assert url_problem("ftp://x") == "must be http or https, not 'ftp'"
