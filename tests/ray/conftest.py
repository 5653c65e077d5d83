"""Samplers with engine replicas as Ray actors, as real subprocesses, and helpers to watch them.

`ray_cluster` starts a real Ray head (`ray start --head --block`) that outlives the
samplers, as a cluster does in production, so a restarted sampler can re-attach to its
replicas and the test itself can reach them as a second driver. It is small: no
dashboard, a 256 MiB object store, usage statistics off, its own ports and temp dir.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ray_helpers import BASE_CONFIG, ENV, Sampler, wait_for

from sampler_service.backends.ray.replica import FAULT_EXIT_IN_LOAD_ENV
from trainer_client.launch import free_port

# The suite's own Ray token: Ray's default token file in the home directory is shared by
# every Ray on the machine. Set before anything imports ray (it reads these at import);
# the clusters, the samplers and this process (a driver) all inherit it.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


@pytest.fixture
def make_sampler(toy: Any, tmp_path: Path) -> Iterator[Callable[..., Sampler]]:
    samplers: list[Sampler] = []

    def make(
        extra: list[str],
        config: dict[str, Any] | None = None,
        name: str = "state",
        data: list[Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> Sampler:
        """`data`: prompt files instead of the toy's first; `env`: variables over ENV."""
        sampler = Sampler(
            toy.model_dir,
            data or toy.data_files[:1],
            tmp_path / name,
            {**BASE_CONFIG, **(config or {})},
            tmp_path / f"{name}.log",
            heartbeat_s=1.0,
            extra=extra,
            env={**ENV, **(env or {})},
        )
        sampler.state_dir = tmp_path / name
        sampler.start(timeout_s=600)
        samplers.append(sampler)
        return sampler

    yield make
    for sampler in samplers:
        sampler.stop()


@dataclass
class RayCluster:
    address: str
    temp_dir: Path
    fault_file: Path


@pytest.fixture(scope="module")
def ray_cluster(request: pytest.FixtureRequest) -> Iterator[RayCluster]:
    """A Ray head of our own (see the module docstring); the test process joins as a driver.

    Its actors inherit the test module's `RAY_HEAD_ENV` (a dict, e.g. a fault hook), if any.
    """
    import ray

    # Short: Ray puts unix sockets under it, and their paths are limited to ~100 bytes.
    temp = Path(tempfile.mkdtemp(prefix="ar-ray-", dir="/tmp"))
    # Distinct (`free_port` never repeats one): Ray refuses a head whose parts share a port.
    port = free_port()
    ports = {
        "--ray-client-server-port": free_port(),
        "--node-manager-port": free_port(),
        "--object-manager-port": free_port(),
        "--metrics-export-port": free_port(),
        "--dashboard-agent-listen-port": free_port(),
        "--dashboard-agent-grpc-port": free_port(),
        "--runtime-env-agent-port": free_port(),
    }
    fault_file = temp / "exit-in-load"
    cmd = [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--num-cpus=4",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--object-store-memory=268435456",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
        *(f"{k}={v}" for k, v in ports.items()),
    ]
    extra_env = getattr(request.module, "RAY_HEAD_ENV", {})
    env = {**os.environ, **ENV, FAULT_EXIT_IN_LOAD_ENV: str(fault_file), **extra_env}
    log = (temp / "ray-start.log").open("w")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    address = f"127.0.0.1:{port}"
    try:

        def joined() -> bool:
            output = (temp / "ray-start.log").read_text()
            if proc.poll() is not None:
                raise AssertionError(f"ray start exited: {output}")
            if "Ray runtime started" not in output:
                return False
            try:
                ray.init(address=address, namespace="adaptive-rollout", configure_logging=False)
            except (ConnectionError, RuntimeError):
                return False
            return True

        wait_for("the Ray head to accept a driver", joined, 180, every_s=2.0)
        yield RayCluster(address, temp, fault_file)
    finally:
        ray.shutdown()
        # Only what this fixture started: ray start's process group, then any process
        # still naming this cluster's temp dir (raylet workers).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _pids_naming(str(temp)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _pids_naming(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids
