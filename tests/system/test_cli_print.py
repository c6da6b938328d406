"""What ``rota`` prints of a server's data cannot drive the terminal: a worker whose
hostname, result, error and traceback (and a producer whose args) hold newlines, carriage
returns, escape sequences (OSC 0 title, OSC 52 clipboard, CSI, the one-byte C1 CSI), a
bidirectional override, NUL and DEL is shown escaped by every command that prints them,
and forges no line. And nothing in rota/cli*.py prints but through rota/cli/base.py."""

from __future__ import annotations

import ast
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import Live, write_spec
from helpers import RawWorker, clean_env, registration, wait_until

from rota.cli.app import main

PACKAGE = Path(__file__).resolve().parents[2] / "rota"

# A forged second worker line, a carriage return that would overwrite the real one, a
# title, a clipboard write, a screen clear and colour, a reversal, NUL, C1 CSI and DEL.
HOSTILE = ("evil\nFORGED  running load=0/1\rFORGED\x1b]0;TITLE\x07\x1b]52;c;Q0xJUA==\x07"
           "\x1b[2J\x1b[31m\u202edesrever\x00nul\x9b1m\x7f")
RAW = ("\r", "\x1b", "\x07", "\u202e", "\x00", "\x9b", "\x7f")
QUIET_WORKERS = pytest.mark.parametrize("live", [{"heartbeat_timeout": 60.0}], indirect=True,
                                        ids=["quiet-raw-workers"])


async def invoke(*args: str) -> tuple[int, str, str]:
    """The command in-process, as on a terminal: color=True, so click strips no escape
    sequence on its own (it does for a pipe) and the test sees what a terminal would."""
    result = await asyncio.to_thread(CliRunner().invoke, main, list(args), color=True)
    return result.exit_code, result.stdout, result.stderr


def assert_harmless(what: str, *streams: str) -> None:
    for stream in streams:
        assert not [c for c in RAW if c in stream], f"{what}: {stream!r}"
        forged = [line for line in stream.split("\n") if line.startswith("FORGED")]
        assert not forged, f"{what} forged a line: {forged}"


async def hostile_worker(live: Live, tmp_path: Path) -> RawWorker:
    """A worker registered under the hostile hostname, holding a completed job (its
    result) and a discarded one (its error and traceback), both with hostile args."""
    echo = write_spec(tmp_path / "specs", "echo")
    await live.push(echo)
    raw = await RawWorker.open(live.ws, "w-evil")
    await raw.beat(registration=registration([echo], hostname=HOSTILE, concurrency=2),
                   capacity=2)
    await raw.expect("welcome")
    for job_id in ("good-1", "bad-1"):
        await live.enqueue("echo", {"note": HOSTILE}, id=job_id, max_attempts=1)
    copies = {copy["id"]: copy for copy in await raw.jobs(2)}
    good, bad = copies["good-1"], copies["bad-1"]
    await raw.beat(results=[
        {"job_id": good["id"], "attempt": good["attempt"], "outcome": "completed",
         "result": {"text": HOSTILE, HOSTILE: [HOSTILE]}},
        {"job_id": bad["id"], "attempt": bad["attempt"], "outcome": "failed",
         "error": {"type": f"Evil{HOSTILE}", "message": HOSTILE,
                   "details": {"traceback": f"Traceback (most recent call last):\n  {HOSTILE}\n"
                                            f"ValueError: {HOSTILE}\n"}}}])
    await raw.expect("ack")
    await live.wait_state("good-1", "completed")
    await live.wait_state("bad-1", "discarded")
    return raw


@QUIET_WORKERS
async def test_every_command_prints_worker_text_escaped(live: Live, tmp_path: Path):
    raw = await hostile_worker(live, tmp_path)
    url = ("--url", live.base)
    commands: list[list[str]] = [
        ["workers", "list"], ["jobs", "show", "good-1"], ["jobs", "show", "bad-1"],
        ["jobs", "list"], ["jobs", "list", "--json"], ["jobs", "list", "--q", "evil"],
        ["queues"], ["queues", "--json"], ["watch", "--json"], ["specs", "list"],
        ["enqueue", "echo", "--args", json.dumps({"note": HOSTILE}), "--id", "e-1"],
        ["jobs", "retry", "bad-1", "--dry-run"], ["jobs", "cancel", "e-1"],
    ]
    for command in commands:
        code, out, err = await invoke(*command, *url)
        assert code == 0, (command, err)
        assert_harmless(" ".join(command), out, err)
    # Shown escaped, not dropped: the operator still sees what the worker sent.
    code, out, _ = await invoke("workers", "list", *url)
    [line] = out.splitlines()
    assert line.startswith("w-evil ") and "host=evil\\nFORGED  running" in line
    assert "\\x1b]52;c;Q0xJUA==\\x07" in line and "\\u202edesrever\\x00nul\\x9b1m\\x7f" in line
    code, out, err = await invoke("jobs", "show", "bad-1", *url)
    assert json.loads(out)["errors"][0]["message"] == HOSTILE  # JSON keeps the text exact
    assert err.startswith("--- attempt 1 on w-evil: Evilevil\\nFORGED")
    # A traceback is the worker's lines: each escaped, and indented under rota's own.
    assert err.splitlines()[1:4] == [
        "    Traceback (most recent call last):", "      evil",
        "    FORGED  running load=0/1\\rFORGED\\x1b]0;TITLE\\x07\\x1b]52;c;Q0xJUA==\\x07"
        "\\x1b[2J\\x1b[31m\\u202edesrever\\x00nul\\x9b1m\\x7f"]

    # rota run prints the result it waited for (through the same path as jobs show).
    running = asyncio.create_task(invoke("run", "echo", "--id", "r-1", "--wait", "30", *url))
    await raw.beat(capacity=1)  # room for one more
    [copy] = await raw.jobs(1, timeout=15)
    await raw.complete(copy, result={"text": HOSTILE})
    code, out, err = await running
    assert code == 0, err
    assert_harmless("run", out, err)
    assert json.loads(out)["result"] == {"text": HOSTILE}


@QUIET_WORKERS
async def test_watch_and_tail_print_worker_text_escaped(live: Live, tmp_path: Path):
    await hostile_worker(live, tmp_path)
    watch = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "watch", "--interval", "0.2", "--url", live.base,
        env=clean_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    tail = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rota", "tail", "--url", live.base, env=clean_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        frame = []
        while not any(line.startswith("rota watch  ") for line in frame[1:]):  # a whole one
            line = await asyncio.wait_for(watch.stdout.readline(), 15)  # type: ignore[union-attr]
            assert line, "rota watch ended"
            frame.append(line.decode())
        assert any(line.startswith("w-evil") for line in frame)
        assert_harmless("watch", "".join(frame))
        # tail: what happens from now on; a second registration of the hostname
        opened = await asyncio.wait_for(tail.stderr.readline(), 15)  # type: ignore[union-attr]
        assert b"following the events of" in opened
        again = await RawWorker.open(live.ws, "w-evil-2")
        await again.beat(registration=registration([], hostname=HOSTILE), capacity=1)
        await again.expect("welcome")
        line = (await asyncio.wait_for(tail.stdout.readline(), 15)).decode()  # type: ignore[union-attr]
        assert "worker_connect" in line and "w-evil-2" in line
        assert_harmless("tail", line)
        await again.ws.close()
    finally:
        for proc in (watch, tail):
            if proc.returncode is None:
                proc.send_signal(signal.SIGINT)
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()


# What prints, where: everything goes through rota/cli/base.py's out, out_lines, screen,
# error, fail and print_json; a command that printed another way could print a worker's
# text raw. (click.confirm is allowed: its question is rota's own words and counts.)
PRINTERS = {("click", "echo"), ("click", "secho"), ("click", "echo_via_pager"),
            ("sys.stdout", "write"), ("sys.stderr", "write"), (None, "print")}
OUTPUT_PATH = {"out", "screen", "error", "print_json"}


def _printing_calls(tree: ast.AST) -> list[tuple[str, int]]:
    """(innermost enclosing function, line) of each call that writes to stdout or stderr."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where = node.name
        if isinstance(node, ast.Call):
            callee = node.func
            key = ((None, callee.id) if isinstance(callee, ast.Name) else
                   (ast.unparse(callee.value), callee.attr) if isinstance(callee, ast.Attribute)
                   else None)
            if key in PRINTERS:
                found.append((where, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(tree, "<module>")
    return found


def test_the_cli_prints_only_through_cli_base():
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        calls = _printing_calls(ast.parse(path.read_text()))
        allowed = OUTPUT_PATH if path.name == "base.py" else set()
        stray = sorted({(name, line) for name, line in calls if name not in allowed})
        assert not stray, f"{path.name} prints outside rota/cli/base.py's output path: {stray}"
    assert _printing_calls(ast.parse((PACKAGE / "cli" / "base.py").read_text()))  # (it looks)
