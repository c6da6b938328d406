"""``rota serve``'s options are made from ServerSettings' fields (rota/core/settings.py): each
field is an option whose default is the field's own, or says why it is not one; --help
shows every default; and the start-up checks (rota/server/startup.py) refuse in one sentence,
letting go of what they took."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from rota.server import startup
from rota.cli.app import main
from rota.cli.serve import serve, settings_options
from rota.core.retention import format_duration
from rota.core.settings import ServerSettings


@pytest.fixture(autouse=True)
def no_rota_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("ROTA_")]:
        monkeypatch.delenv(name)


def _parsed(args: list[str]) -> dict[str, object]:
    """What ``rota serve ARGS`` would run with, without running it."""
    with serve.make_context("serve", args) as ctx:
        return dict(ctx.params)


def test_every_setting_is_an_option_with_the_settings_default():
    params = {p.name: p for p in serve.params}
    parsed = _parsed([])
    for field in dataclasses.fields(ServerSettings):
        if "internal" in field.metadata:
            assert field.name not in params, field.name
            assert field.metadata["internal"], f"{field.name}: say why it is no option"
            continue
        assert "option" in field.metadata, f"{field.name} is neither an option nor internal"
        assert field.name in params, field.name
        assert parsed[field.name] == field.default, field.name
    # and the command's other options are no settings: how it logs, and a refusal lifted
    names = {f.name for f in dataclasses.fields(ServerSettings)}
    assert set(params) - names == {"log_level", "log_format", "insecure"}


def test_serve_help_shows_every_default_and_variable():
    ctx = click.Context(serve, info_name="serve")
    output = CliRunner().invoke(main, ["serve", "--help"]).output
    shown = 0
    for field, how in settings_options():
        if how.hidden:
            continue
        param = next(p for p in serve.params if p.name == field.name)
        _, text = param.get_help_record(ctx) or ("", "")
        assert param.opts[0] in output and param.envvar in text, field.name
        extra = text.rsplit("[", 1)[-1]  # click's "[env var: ...; default: ...]"
        default = field.default
        if default is None or default == () or default is False:
            assert "default:" not in extra, field.name
            continue
        written = format_duration(default) if how.kind == "duration" else str(default)
        assert f"default: {written}" in extra, (field.name, text)
        shown += 1
    assert shown >= 30  # (most settings have a default to show)


def test_settings_convert_from_their_variables_and_options(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("ROTA_RETAIN_COMPLETED", "12h")
    monkeypatch.setenv("ROTA_ALLOWED_ORIGINS", "https://a.example https://b.example")
    monkeypatch.setenv("ROTA_DB", "postgresql://rota@db/rota")
    parsed = _parsed(["--retain", "queue=emails:completed=1d:discarded=never",
                      "--max-waits-per-token", "7", "--ui-read-only"])
    assert parsed["retain_completed"] == 43200.0
    assert parsed["allowed_origins"] == ("https://a.example", "https://b.example")
    assert parsed["db"] == "postgresql://rota@db/rota"
    assert parsed["retain_queues"] == (("emails", "completed", 86400.0),
                                       ("emails", "discarded", None))
    assert parsed["max_waits_per_token"] == 7 and parsed["ui_read_only"] is True
    with pytest.raises(click.BadParameter):
        _parsed(["--max-waits-per-token", "0"])  # minimum=1
    with pytest.raises(click.BadParameter):
        _parsed(["--durability", "sometimes"])
    push = _parsed(["--allow-private-endpoints", "--public-url", "https://rota.example:8443/"])
    assert push["allow_private_endpoints"] is True
    assert push["public_url"] == "https://rota.example:8443"  # (the callback paths follow)
    for bad, why in (("ftp://rota.example", "must be http or https"),
                     ("https://u:p@rota.example", "user or password"),
                     ("https://rota.example/?a=1", "?query")):
        with pytest.raises(click.BadParameter, match=re.escape(why)):
            _parsed(["--public-url", bad])


def test_a_public_address_without_tokens_is_refused_and_nothing_stays_held(tmp_path: Path):
    db = tmp_path / "rota.db"
    settings = ServerSettings(db=db, host="0.0.0.0", port=0)
    with pytest.raises(startup.Refused, match="refusing to serve on 0.0.0.0 with no tokens"):
        with startup.started(settings, insecure=False):
            pass
    with startup.started(settings, insecure=True) as sock:  # the lock was let go
        assert sock.getsockname()[1] != 0
        with pytest.raises(startup.Refused, match="in use by another rota serve"):  # one server per file
            with startup.hold(db):
                pass


def test_a_busy_port_is_refused_in_one_sentence(tmp_path: Path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(startup.Refused, match="the port is in use"):
            with startup.taken(tmp_path / "rota.db", "127.0.0.1", port):
                pass
    with startup.hold(tmp_path / "rota.db"):  # and the file's lock went with it
        pass
