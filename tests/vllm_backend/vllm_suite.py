"""Helpers shared by the vLLM suite's modules (a uniquely named module, importable
from the test files because pytest puts this directory on sys.path)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

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
