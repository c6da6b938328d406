"""README.md's walkthrough, typed as a new user would: every ```sh command of it, in order,
against a real server, in a fresh directory holding the repository's specs/ and examples/.

Each command runs in bash with the environment the one before left (an ``export`` carries
on, as in a terminal); ``rota serve`` and the lines ending in ``&`` run in the background
and are waited for on /healthz. The rest must exit 0 with no error line. A block preceded
by ``<!-- not run: WHY -->`` is skipped, and WHY printed. The test picks a free port: the
server gets it as ROTA_PORT, the clients as ROTA_URL, and URLs in commands are rewritten
to it. ``rota tokens`` runs without ROTA_URL, so that it works on ./rota.db, as it does for
someone on the default port.

The Push execution section's block is run as a user pastes it: whole, in a fresh shell,
its background lines waited for by nothing but its own curl line.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from helpers import clean_env, free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
# The walkthrough, and the Flow control, Workflows and Cron schedules sections after it,
# which go on from its state.
WALKTHROUGH = README[README.index("## Walkthrough"):README.index("## Enqueue from your web app")]
PUSH = README[README.index("## Push execution"):README.index("## Open Job Spec")]
BLOCK = re.compile(r"(?:<!-- not run: (?P<why>.+?) -->\n)?```(?P<lang>\w*)\n(?P<text>.*?)```",
                   re.S)
README_URL = "http://127.0.0.1:8000"
ERROR_LINE = re.compile(r'^(error:|Error:|Traceback)|"error"\s*:\s*\{', re.M)
# What the walkthrough says these commands show, beyond exiting 0 (each must be run).
SHOWS = {
    "curl -s": ['"state":"completed"', '"message":"hi"'],
    "rota jobs show order-17": ["completed", '"hi"'],
    "rota run echo": ['"now"'],
    "rota jobs cancel later-1": ["cancelled"],
    "rota jobs show resize-1": ["resized", "source is https://example.com/a.png"],
    # The chain's last step echoes what the first passed on; the batch ran its callback.
    "python examples/workflows.py": ["thumbnail-c {'message': 'thumbnail ready', 'after': {'0':",
                                     "'width': 256", "completed", "'message': 'both echoed'"],
    "rota workflows show thumbnail-c": ["(chain): completed", "└── echo  completed  job"],
    "rota workflows create": ["thumbnails (chain)", "├── group"],
    "rota schedules show heartbeat": ["@every 10s", "next fires:", "state:        active", "priority:"],
}


@dataclass
class Block:
    lang: str
    text: str
    not_run: str | None


def blocks(section: str = WALKTHROUGH) -> list[Block]:
    return [Block(m["lang"], m["text"], m["why"]) for m in BLOCK.finditer(section)]


def shell_lines(block: Block) -> list[str]:
    return [line for line in block.text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


class Terminal:
    """One user's shell: each command sees the variables the previous ones exported."""

    def __init__(self, cwd: Path, port: int) -> None:
        self.cwd, self.port = cwd, port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**clean_env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        self.state = cwd / ".env-state"
        self.background: list[tuple[str, asyncio.subprocess.Process, Path]] = []
        self.transcript: list[str] = []

    def command_env(self, command: str) -> dict[str, str]:
        env = {**self.env, "ROTA_PORT": str(self.port), "ROTA_URL": self.url}
        if "rota tokens" in command:
            del env["ROTA_URL"]
        return env

    def rewrite(self, command: str) -> str:
        return command.replace(README_URL, self.url)

    async def run(self, command: str) -> str:
        script = f"{self.rewrite(command)}\n__rc=$?\nenv -0 > {self.state}\nexit $__rc\n"
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", script, cwd=self.cwd, env=self.command_env(command),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 30)
        out, err = out_b.decode(), err_b.decode()
        self.transcript.append(f"$ {command}\n{out}{err}")
        assert proc.returncode == 0, f"{command!r} exited {proc.returncode}:\n{out}{err}"
        assert not ERROR_LINE.search(out + err), f"{command!r} reported an error:\n{out}{err}"
        pairs = (item.split("=", 1) for item in self.state.read_text().split("\0") if item)
        self.env = {k: v for k, v in pairs if k not in ("ROTA_PORT", "ROTA_URL", "_")}
        return out

    async def spawn(self, command: str) -> tuple[asyncio.subprocess.Process, Path]:
        """Run ``command`` in the background and go on at once, as a pasted line does."""
        line = command.split("#")[0].strip().removesuffix("&").strip()
        assigns = re.match(r"(?:\w+=\S*\s+)*", line)
        assert assigns is not None
        log = self.cwd / f"background-{len(self.background) + 1}.log"
        with log.open("wb") as sink:
            proc = await asyncio.create_subprocess_exec(
                "bash", "-c", f"{line[:assigns.end()]}exec {self.rewrite(line[assigns.end():])}",
                cwd=self.cwd, env=self.command_env(command), stdout=sink, stderr=sink)
        self.background.append((command, proc, log))
        self.transcript.append(f"$ {command}    (in the background: {log.name})")
        return proc, log

    async def start(self, command: str, http: httpx.AsyncClient) -> None:
        """Run ``command`` in the background, and wait until the server answers (for
        ``rota serve``) or one more worker is connected (for anything else)."""
        is_server = command.split("#")[0].strip().startswith("rota serve")
        workers_before = 0 if is_server else (await http.get("/healthz")).json()["workers"]
        proc, log = await self.spawn(command)

        async def ready() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"{command!r} exited {proc.returncode}:\n{log.read_text()}")
            try:
                health = (await http.get("/healthz")).json()
            except httpx.TransportError:
                return False
            return is_server or health["workers"] == workers_before + 1

        await wait_until(ready, timeout=20, what=f"{command!r} to be ready")

    async def stop_all(self) -> list[tuple[str, int | None, str]]:
        """SIGTERM what runs in the background, newest first; each one's exit code."""
        codes = []
        for command, proc, log in reversed(self.background):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 15)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
            codes.append((command, proc.returncode, log.read_text()))
        return codes


def test_the_walkthrough_has_the_commands_this_test_expects():
    commands = [line for b in blocks() if b.lang == "sh" for line in shell_lines(b)]
    assert commands[0].startswith("rota serve")
    for prefix in SHOWS:
        assert any(c.startswith(prefix) for c in commands), f"no command starts {prefix!r}"
    skipped = [b for b in blocks() if b.not_run]
    assert [shell_lines(b)[0].split()[:2] for b in skipped] == [["rota", "serve"]]


def test_python_blocks_that_name_an_example_are_that_example():
    named = 0
    for block in blocks():
        first, _, rest = block.text.partition("\n")
        if block.lang == "python" and (m := re.fullmatch(r"# from (examples/\S+\.py)", first)):
            assert rest in (ROOT / m[1]).read_text(), f"README's {m[1]} is not the file's text"
            named += 1
    assert named >= 3
    [flow] = [b for b in blocks() if b.lang == "json"]  # the workflow file shown whole
    assert flow.text == (ROOT / "examples/thumbnails.json").read_text()


@pytest.mark.timeout(120)  # every walkthrough command, servers and workers included
async def test_every_walkthrough_command_runs_in_order(tmp_path):
    for folder in ("specs", "examples"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    terminal = Terminal(tmp_path, free_port())
    outputs: dict[str, str] = {}
    async with httpx.AsyncClient(base_url=terminal.url, timeout=10) as http:
        try:
            for block in blocks():
                if block.lang != "sh":
                    continue
                for command in shell_lines(block):
                    if block.not_run:
                        print(f"not run: {command}\n    why: {block.not_run}")
                    elif command.startswith("rota serve") or command.rstrip().endswith("&"):
                        await terminal.start(command, http)
                    else:
                        outputs[command] = await terminal.run(command)
        finally:
            stopped = await terminal.stop_all()
            print("\n".join(terminal.transcript))
    for command, code, log in stopped:
        assert code == 0, f"{command!r} exited {code} on SIGTERM:\n{log}"
    for prefix, wanted in SHOWS.items():
        out = next(out for command, out in outputs.items() if command.startswith(prefix))
        for text in wanted:
            assert text in out, f"{prefix!r} printed no {text!r}:\n{out}"
    assert (tmp_path / "cert.pem").exists() and (tmp_path / "key.pem").exists()


@pytest.mark.timeout(90)
async def test_the_push_execution_block_runs_as_pasted(tmp_path):
    """README's Push execution block, pasted whole into a fresh shell in a copy of the
    repository's examples/: the lines ending in ``&`` start in the background and nothing
    waits for them but the block's own curl line. The endpoint's port (8080, in greet.toml's
    URL and endpoint.py's --port default) is moved to a free one in both, as the README says
    to move it; the server's is ROTA_PORT, and its URL in the commands rewritten, as in the
    walkthrough."""
    [block] = [b for b in blocks(PUSH) if b.lang == "sh"]
    commands = shell_lines(block)
    assert [c.split()[:2] for c in commands] == [
        ["export", "ROTA_SECRET_HOOKS=$(python"], ["python", "examples/push/endpoint.py"],
        ["rota", "serve"], ["curl", "-s"], ["rota", "specs"], ["rota", "run"]], commands
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    endpoint_port = str(free_port())
    for name in ("greet.toml", "endpoint.py"):
        copy = tmp_path / "examples" / "push" / name
        assert "8080" in copy.read_text(), name
        copy.write_text(copy.read_text().replace("8080", endpoint_port))
    terminal = Terminal(tmp_path, free_port())
    outputs: dict[str, str] = {}
    try:
        for command in commands:
            if command.split("#")[0].rstrip().endswith("&"):
                await terminal.spawn(command)
            else:
                outputs[command.split()[1]] = await terminal.run(command)
    finally:
        stopped = await terminal.stop_all()
        print("\n".join(terminal.transcript))
    assert '"status":"ok"' in outputs["-s"].replace(" ", ""), outputs["-s"]
    assert "new       greet  sha256:" in outputs["specs"], outputs["specs"]
    run = json.loads(outputs["run"])
    assert run["state"] == "completed" and run["result"]["greeting"] == "Hello, Ada!", run
    [(_, served, log)] = [s for s in stopped if s[0].startswith("rota serve")]
    assert served == 0 and "Traceback" not in log and "ERROR" not in log, log
    assert (tmp_path / "push.db").exists()
