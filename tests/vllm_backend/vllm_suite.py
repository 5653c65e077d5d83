"""Helpers shared by the vLLM suite's modules (a uniquely named module, importable
from the test files because pytest puts this directory on sys.path)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx

from trainer_client.launch import SamplerProcess
from trainer_client.toy import ToyPaths

T = TypeVar("T")

#: A small balanced config whose groups the tests lease without training on them.
CONFIG = {
    "rule": "balanced",
    "k_pos": 2,
    "k_neg": 2,
    "n_max": 12,
    "wave_size": 4,
    "group_size": 4,
    "max_tokens": 8,
    "max_active_prompts": 8,
    "max_buffered_groups": 8,
    "max_staleness": None,  # groups are leased without training on them
}
#: Measurements for the terminal summary (name -> value).
REPORT: dict[str, Any] = {}


class LoopThread:
    """One event loop on a background thread: an engine lives on the loop that made it,
    so every test of a module submits its coroutines here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="vllm-test-loop", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class ServeProcess(SamplerProcess):
    """`adaptive-rollout serve --backend vllm` on a loopback port, timed to /ready."""

    def __init__(
        self, toy: ToyPaths, state_dir: Path, config: dict[str, Any], extra: list[str]
    ) -> None:
        super().__init__(
            toy.model_dir,
            toy.data_files,
            state_dir,
            config,
            state_dir.parent / f"{state_dir.name}.log",
            heartbeat_s=0.5,
            extra=["--backend", "vllm", *extra],
        )
        self.ready_s = 0.0

    def start(self, timeout_s: float = 420.0) -> str:
        started = time.monotonic()
        url = super().start(timeout_s)
        self.ready_s = time.monotonic() - started
        return url


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EngineServer:
    """`vllm serve` (vLLM's OpenAI server module: the `vllm` console script reads the
    metadata of a `vllm` distribution, which the CPU build is not) on a loopback port,
    with the RL endpoints on and the sampler's logprob semantics."""

    def __init__(self, model_dir: Path, log_path: Path, port: int | None = None) -> None:
        self.model_dir = model_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> EngineServer:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "64", "--enforce-eager", "--dtype", "float32",
            "--kv-cache-memory-bytes", str(256 * 1024 * 1024),
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
        ]  # fmt: skip
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
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
