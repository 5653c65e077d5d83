"""Shared test set-up: offline hub, quiet tokenizers, one torch thread, the toy task."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import Server, start_server

# Nothing phones home: no hub downloads, no usage statistics from vLLM or Ray.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_key, _value)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
# Tiny models on 2 shared cores: one torch thread each is ~30x faster than two threads
# spinning against each other and the server (measured in the hf backend: 19 vs 711 ms
# per call under load).
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The toy model and data (shipped warm-start weights), built once per session."""
    from trainer_client.toy import build_toy  # imports torch: only for tests that need it

    return build_toy(tmp_path_factory.mktemp("toy"), seed=0)


def _server_factory(toy: Any, where: Path) -> tuple[Callable[..., Server], list[Server]]:
    servers: list[Server] = []

    def make(config: dict[str, Any] | None = None, **kw: Any) -> Server:
        server = start_server(toy, where, config, **kw)
        servers.append(server)
        return server

    return make, servers


@pytest.fixture
def make_server(toy: Any, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start samplers for one test (it may kill or restart them); stopped after it."""
    make, servers = _server_factory(toy, tmp_path)
    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def make_module_server(
    toy: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., Server]]:
    """Start samplers shared by the tests of one module; stopped after the module."""
    make, servers = _server_factory(toy, tmp_path_factory.mktemp("server"))
    yield make
    for server in servers:
        server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Warnings are errors in the core suite (tests without a suite marker): a warning
    there is ours to fix or to ignore by name. The other suites run third-party stacks
    (vLLM, verl, Ray, a browser) whose conftests list the warnings they tolerate."""
    suites = {line.split(":")[0].strip() for line in config.getini("markers")}
    for item in items:
        if not any(item.get_closest_marker(name) for name in suites):
            item.add_marker(pytest.mark.filterwarnings("error"))
