"""`adaptive-rollout serve` as a real subprocess on a loopback port (so kill -9 and
restarts are real), through the same launcher the demo uses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainer_client.launch import SamplerProcess

HERE = Path(__file__).parent
BASE_CONFIG = {"max_tokens": 8, "max_active_prompts": 16, "max_buffered_groups": 64}


class Server(SamplerProcess):
    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, **{"timeout": 60.0, **kw})


@pytest.fixture
def make_server(toy: Any, tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []
    # The misbehaving verifiers of flaky_verifiers.py are imported by the server.
    env = {"PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

    def make(
        config: dict[str, Any] | None = None,
        extra: list[str] | None = None,
        name: str = "state",
        data: list[Path] | None = None,
    ) -> Server:
        server = Server(
            toy.model_dir,
            data or toy.data_files,
            tmp_path / name,
            {**BASE_CONFIG, **(config or {})},
            tmp_path / f"{name}.log",
            heartbeat_s=0.5,
            extra=extra,
            env=env,
        )
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()
