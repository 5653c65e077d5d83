"""The README's quick start and the episodes page's examples, run as written: their
commands are read from README.md and docs/episodes.md (so this test breaks when the docs
drift from what works) and run in a fresh directory that looks like the repository after
`make venv`, against a real sampler on a loopback port. The one change: port 8000 becomes
a free port, so the test never meets another server."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from trainer_client.launch import free_port

pytestmark = pytest.mark.timeout(900)

README = Path(__file__).parents[2] / "README.md"
EPISODES_PAGE = Path(__file__).parents[2] / "docs" / "episodes.md"
SECTION = "## Run the sampler, then train against it"


def quick_start_commands() -> list[str]:
    """Every command of the section's bash blocks, continuation lines joined, in order;
    a python block is one command: `python` and its code."""
    text = README.read_text(encoding="utf-8")
    assert SECTION in text, f"README.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    commands = []
    for language, block in re.findall(r"```(bash|python)\n(.*?)```", section, re.S):
        if language == "python":
            commands.append(f"python\n{block}")
            continue
        lines = block.replace("\\\n", " ").splitlines()
        commands += [line.strip() for line in lines if line.strip()]
    return commands


def _ctrl_c_as_in_a_terminal() -> None:
    """In the child: SIGINT with its default action, as a user's terminal delivers it. A
    test run started as a background job of a non-interactive shell has SIGINT ignored,
    and an ignored signal stays ignored through exec (curl would then never end)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The first line a process prints, or "" if none came within `timeout_s`."""
    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines[0] if lines else ""


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    commands = quick_start_commands()
    assert any(" serve " in c for c in commands) and any(" train " in c for c in commands)
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    port = str(free_port())
    env = dict(os.environ)
    server: subprocess.Popen[str] | None = None
    outputs: dict[str, str] = {}
    try:
        for written in commands:
            command = written.replace("8000", port)
            if command.startswith("export "):
                key, _, value = command.removeprefix("export ").partition("=")
                env[key] = shlex.split(value)[0]
                continue
            if " serve " in command:  # runs until stopped: wait until it listens
                with (tmp_path / "serve.log").open("w") as log:
                    server = subprocess.Popen(
                        ["bash", "-c", f"exec {command}"],
                        cwd=tmp_path,
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                    )
                line = _first_line(server, 180)
                assert f"listening on http://127.0.0.1:{port}" in line, (
                    line + (tmp_path / "serve.log").read_text()[-3000:]
                )
                # As docs/serve.md says: answers get what the toy's context leaves.
                config = httpx.get(f"http://127.0.0.1:{port}/v1/config", timeout=30).json()
                assert config["max_tokens"] == 58, config
                continue
            if command.startswith("python\n"):  # the trainer loop, as a user's script
                (tmp_path / "loop.py").write_text(command.removeprefix("python\n"))
                done = subprocess.run(
                    [".venv/bin/python", "loop.py"], cwd=tmp_path, env=env,
                    capture_output=True, text=True, timeout=600, check=False,
                )  # fmt: skip
                assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
                served = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).json()
                assert served["policy_version"] >= 2, served
                continue
            if command.startswith("curl -N"):  # a stream: its first message, then Ctrl-C
                stream = subprocess.Popen(
                    ["bash", "-c", f"exec {command}"], cwd=tmp_path, env=env,
                    stdout=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal,
                )  # fmt: skip
                line = _first_line(stream, 60)
                stream.send_signal(signal.SIGINT)
                stream.wait(timeout=30)
                stream.stdout.close()  # type: ignore[union-attr]
                assert orjson.loads(line)["type"] == "heartbeat", (written, line)
                continue
            done = subprocess.run(
                ["bash", "-c", command], cwd=tmp_path, env=env,
                capture_output=True, text=True, timeout=600, check=False,
            )  # fmt: skip
            assert done.returncode == 0, (written, done.stdout[-3000:], done.stderr[-3000:])
            if command.startswith("curl"):
                assert '{"error":' not in done.stdout, (written, done.stdout[:2000])  # a 4xx body
            outputs[written] = done.stdout
        train = next(out for cmd, out in outputs.items() if " train " in cmd)
        assert re.search(r"trained 10 steps; sampler serves policy v\d+", train), train
        stats = next(out for cmd, out in outputs.items() if cmd.endswith(" stats"))
        assert "trained groups" in stats and "domains" in stats, stats

        # A stop prints what this sampler did: its figures are those of the store it left.
        assert server is not None
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=90)
        summary = [line for line in out.splitlines() if "sampler stopped" in line]
        assert len(summary) == 1, out
        figures = re.search(
            r"(\d+) groups delivered and (\d+) acked since it started; (\d+) groups stored",
            summary[0],
        )
        assert figures, summary[0]
        delivered, acked, stored = map(int, figures.groups())
        with sqlite3.connect(tmp_path / "sampler_state" / "sampler.sqlite") as db:
            assert db.execute("SELECT COUNT(*) FROM groups").fetchone()[0] == stored
        assert acked >= 10 * 8 and delivered >= acked
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.communicate()


EPISODES = "# Multi-turn episodes"


def test_the_episode_examples_run_as_written(tmp_path: Path) -> None:
    """The episodes page's environment and row, saved under the names it gives them,
    and its commands run from that directory: both samplers serve episodes (the user's
    module imported from the working directory) and drop no prompt as an environment
    error."""
    section = EPISODES_PAGE.read_text(encoding="utf-8").split(EPISODES, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(python|jsonl|bash)\n(.*?)```", section, re.S)
    code = {language: block for language, block in blocks if language != "bash"}
    assert "`my_envs.py`" in section and "`my_prompts.jsonl`" in section
    (tmp_path / "my_envs.py").write_text(code["python"])
    (tmp_path / "my_prompts.jsonl").write_text(code["jsonl"])
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    commands = [block.strip() for language, block in blocks if language == "bash"]
    commands = [line for block in commands for line in block.splitlines() if line.strip()]
    served = 0
    for written in commands:
        if " serve " not in written:
            done = subprocess.run(
                ["bash", "-c", written], cwd=tmp_path, capture_output=True, text=True,
                timeout=300, check=False,
            )  # fmt: skip
            assert done.returncode == 0, (written, done.stderr[-3000:])
            continue
        port = str(free_port())
        command = re.sub(r"--port \d+", f"--port {port}", written)
        with (tmp_path / f"serve-{port}.log").open("w") as log:
            server = subprocess.Popen(
                ["bash", "-c", f"exec {command}"], cwd=tmp_path, stdout=subprocess.PIPE,
                stderr=log, text=True,
            )  # fmt: skip
        try:
            line = _first_line(server, 180)
            assert "listening on" in line, (written, (tmp_path / f"serve-{port}.log").read_text())
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=150) as c:
                r = c.post(
                    "/v1/groups/lease",
                    params={"features": "loss_mask"},
                    json={"max_groups": 1, "wait_s": 120},
                )
                assert r.status_code == 200 and r.json()["groups"], (written, r.text)
                stats = c.get("/v1/stats").json()
                assert stats["episodes"]["episodes"] > 0, (written, stats["episodes"])
                assert "env_error" not in stats["dropped"], (written, stats["dropped"])
            served += 1
        finally:
            server.send_signal(signal.SIGTERM)
            server.communicate(timeout=90)
    assert served == 2
