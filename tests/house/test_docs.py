"""docs/protocol.md is the contract: it must name every message, field and error code."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from rota.base import protocol

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "protocol.md").read_text()
MESSAGE_TYPES = [protocol.Heartbeat, protocol.Welcome, protocol.Ack, protocol.Assign,
                 protocol.Cancel, protocol.TakeBack, protocol.Error]
SECTIONS = [protocol.Registration, protocol.Status, protocol.Result, protocol.ErrorInfo,
            protocol.SpecRef, protocol.SpecVerdict, protocol.SpecRejection,
            protocol.ResultRejection, protocol.JobCopy, protocol.Progress, protocol.LogLine,
            protocol.Alert]


def test_every_message_type_and_field_is_documented():
    for struct in MESSAGE_TYPES + SECTIONS:
        info = msgspec.structs.fields(struct)
        for field in info:
            named = f"`{field.name}`" in DOC or f'"{field.name}"' in DOC
            assert named, f"{struct.__name__}.{field.name} is not in the doc"
    for struct in MESSAGE_TYPES:
        tag = struct.__struct_config__.tag
        assert f"`{tag}`" in DOC, f"message type {tag} is not in the doc"


def test_every_error_code_the_server_sends_is_documented():
    sources = "".join(p.read_text() for p in (ROOT / "rota").rglob("*.py"))
    codes = set(re.findall(r'FrameError\(\s*"([a-z_]+)"', sources))
    codes |= set(re.findall(r'abort\(\s*"([a-z_]+)"', sources))
    codes |= set(re.findall(r'BadJson\(\s*"([a-z_]+)"', sources))
    codes |= set(re.findall(r'Abort\([^,]+,\s*"([a-z_]+)"', sources))
    assert {"malformed_json", "heartbeat_timeout", "worker_id_in_use"} <= codes
    for code in codes:
        assert f"`{code}`" in DOC, f"error code {code} is not in docs/protocol.md"


def test_readme_gives_the_two_quick_start_commands_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## Walkthrough")]
    commands = re.findall(r"```sh\n(.*)\n```", quick)
    assert len(commands) == 2 and commands[0].endswith("rota demo")
    assert commands[1] == "scripts/test"
    ci = (ROOT / ".ci" / "run").read_text()
    # CI runs the same command: for the oldest Python, the newest, and the soak runs.
    runs = re.findall(r"^.*\bscripts/test\b.*$", ci, re.M)
    assert len([line for line in runs if not line.lstrip().startswith("#")]) == 3, runs
    assert any(re.search(r"scripts/test -m soak\b", line) for line in runs)


def test_the_test_command_installs_what_the_suite_needs():
    """scripts/test checks for each Debian package the suite uses, and runs pytest."""
    script = (ROOT / "scripts" / "test").read_text()
    for package in ("faketime", "chromium", "postgresql", "redis-server"):
        assert f"missing+=({package})" in script, package
    assert "apt-get install" in script and 'sudo="sudo"' in script
    assert script.rstrip().endswith('-m pytest "$@"')


def test_the_work_schema_holds_every_message_and_field_the_doc_names():
    """GET /work.schema.json (rota/server/workschema.py) is made from the structs: every
    message type and every field docs/protocol.md documents is in it, each server frame is
    told apart by its ``type``, and the doc says where the schema is."""
    from rota.server.workschema import work_schema
    schema = work_schema()
    defs = schema["$defs"]
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    for struct in MESSAGE_TYPES + SECTIONS:
        named = defs[struct.__name__]["properties"]
        for field in msgspec.structs.fields(struct):
            assert field.name in named, f"{struct.__name__}.{field.name} not in the schema"
    mapping = defs["server_to_worker"]["discriminator"]["mapping"]
    assert set(mapping) == {s.__struct_config__.tag for s in MESSAGE_TYPES[1:]}
    assert defs["Heartbeat"]["properties"]["type"] == {"enum": ["heartbeat"]}
    assert "/work.schema.json" in DOC


def test_readme_the_manifest_and_docs_ojs_state_the_same_conformance_level():
    """README's Open Job Spec section, the manifest's CONFORMANCE_LEVEL and docs/ojs.md
    name one level (the level tests/ojs/run.py reaches with tests/ojs/excused.toml), and
    README gives the command that measures it."""
    from rota.server.ojs_api import CONFORMANCE_LEVEL
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Open Job Spec"):]
    section = section[:section.index("\n## ")]
    assert re.findall(r"conformance level (-?\d)", section) == [str(CONFORMANCE_LEVEL)]
    assert ("tests/ojs/serve.py sqlite -- .venv/bin/python tests/ojs/run.py" in section
            and "--excused tests/ojs/excused.toml" in section)
    assert "L1-RTR-014" in section and "docs/ojs.md" in section
    doc = (ROOT / "docs" / "ojs.md").read_text()
    assert re.findall(r"conformance level (-?\d)", doc) == [str(CONFORMANCE_LEVEL)]
