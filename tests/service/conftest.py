"""Fixtures that run the real sampler: the toy model, and `adaptive-rollout serve` as a
subprocess on a loopback port (so kill -9 and restarts are real)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_service.toy import ToyPaths, build_toy

HERE = Path(__file__).parent
LISTEN = re.compile(r"listening on (http://[\d.]+:\d+)")


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> ToyPaths:
    return build_toy(tmp_path_factory.mktemp("toy"), seed=0)


class Server:
    """One `adaptive-rollout serve` process; restartable on the same state dir."""

    def __init__(
        self, toy: ToyPaths, state_dir: Path, config: dict[str, Any], extra: list[str], data: list[Path]
    ) -> None:
        self.toy, self.state_dir, self.extra, self.data = toy, state_dir, extra, data
        self.config_file = state_dir.parent / f"{state_dir.name}-config.json"
        self.config_file.write_text(json.dumps(config))
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.log = state_dir.parent / f"{state_dir.name}.log"

    def start(self, timeout: float = 120.0) -> None:
        cmd = [
            sys.executable, "-m", "sampler_service", "serve",
            "--model", str(self.toy.model_dir),
            *[arg for f in self.data for arg in ("--data", str(f))],
            "--port", "0", "--state-dir", str(self.state_dir),
            "--config", str(self.config_file), "--heartbeat-s", "0.5", "--verifier-workers", "1",
            *self.extra,
        ]
        env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = self.log.open("a")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited ({self.proc.poll()}); log:\n{self.log.read_text()[-4000:]}")
            if match := LISTEN.search(line):
                self.url = match.group(1)
                # Keep draining stdout so a chatty server never blocks on a full pipe.
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                break
        else:
            raise TimeoutError(f"server did not listen within {timeout}s")
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/ready").status_code == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"server not ready within {timeout}s")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0, **kw)


@pytest.fixture
def make_server(toy: ToyPaths, tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def make(
        config: dict[str, Any] | None = None,
        extra: list[str] | None = None,
        name: str = "state",
        data: list[Path] | None = None,
    ) -> Server:
        base = {"max_tokens": 8, "max_active_prompts": 16, "max_buffered_groups": 64}
        server = Server(toy, tmp_path / name, {**base, **(config or {})}, extra or [], data or toy.data_files)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.kill(signal.SIGTERM)
