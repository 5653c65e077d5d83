"""Helpers shared by the vLLM suite's modules (a uniquely named module, importable
from the test files because pytest puts this directory on sys.path)."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from sampler_service.toy import ToyPaths

T = TypeVar("T")
LISTEN = re.compile(r"listening on (http://[\d.]+:\d+)")
#: Measurements for the terminal summary (name -> value).
REPORT: dict[str, Any] = {}


class LoopThread:
    """One event loop on a background thread: an engine lives on the loop that made it,
    so every test of a module submits its coroutines here."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class ServeProcess:
    """`python -m sampler_service serve --backend vllm` on a loopback port."""

    def __init__(self, toy: ToyPaths, state_dir: Path, config_file: Path, extra: list[str]) -> None:
        self.log = state_dir.parent / f"{state_dir.name}.log"
        self.cmd = [
            sys.executable, "-m", "sampler_service", "serve", "--backend", "vllm",
            "--model", str(toy.model_dir),
            *[arg for f in toy.data_files for arg in ("--data", str(f))],
            "--port", "0", "--state-dir", str(state_dir), "--config", str(config_file),
            "--heartbeat-s", "0.5", "--verifier-workers", "1", *extra,
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.ready_s = 0.0

    def start(self, timeout: float = 420.0) -> None:
        import httpx

        started = time.monotonic()
        log = self.log.open("a")
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.proc.stdout is not None
        deadline = started + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited ({self.proc.poll()}); log:\n{self.log.read_text()[-6000:]}")
            if match := LISTEN.search(line):
                self.url = match.group(1)
                # keep draining stdout (vLLM logs there): a full pipe would block the server
                threading.Thread(target=self._drain, args=(log,), daemon=True).start()
                break
        else:
            raise TimeoutError(f"server did not listen within {timeout}s")
        while time.monotonic() < deadline:
            if httpx.get(self.url + "/ready", timeout=10).status_code == 200:
                self.ready_s = time.monotonic() - started
                return
            time.sleep(0.5)
        raise TimeoutError(f"server not ready within {timeout}s")

    def _drain(self, log: Any) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            log.write(line)
            log.flush()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
