"""Fixtures for the verl suite (run in .venv-verl: `make test-verl`).

Real verl 0.9.1, nothing of it mocked. What needs a process is real too: the sampler runs
as `python -m sampler_service serve` on the toy model (transformers backend) on a loopback
port, and TransferQueue runs on a local Ray instance started here with 2 CPUs (its
controller and storage unit are Ray actors; it has no in-process mode).

In an environment without verl (the core suite) this directory is not collected.
"""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support import report_measurements
from verl_suite import GRPO_CONFIG, TIMINGS, Sampler

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

if importlib.util.find_spec("verl") is None:  # core environment: nothing to run here
    collect_ignore_glob = ["test_*.py"]

_SESSION_START = time.monotonic()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    report_measurements(terminalreporter, "verl suite measurements", TIMINGS, _SESSION_START, ".1f")


@pytest.fixture(scope="session")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from trainer_client.toy import build_toy

    return build_toy(tmp_path_factory.mktemp("toy"), seed=0, n_train=128, n_eval=8)


@pytest.fixture(scope="session")
def sampler(toy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sampler]:
    """A sampler with plain GRPO groups of 4 (rollout.n = 4)."""
    server = Sampler(toy, tmp_path_factory.mktemp("sampler"), GRPO_CONFIG).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def reinforce_ada_sampler(toy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sampler]:
    """Reinforce-Ada balanced sampling with the global estimator and a reweighting policy."""
    config = {
        **GRPO_CONFIG,
        "rule": "balanced",
        "k_pos": 1,
        "k_neg": 1,
        "wave_size": 4,
        "n_max": 12,
        "advantage": "global",
        "batch_groups": 2,
        "batch_policies": [{"name": "per", "params": {"alpha": 0.5}}],
    }
    server = Sampler(toy, tmp_path_factory.mktemp("ada"), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_tq() -> Iterator[None]:
    """A local Ray (2 CPUs) with TransferQueue initialized, as verl's TaskRunner does."""
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    started = time.monotonic()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="verl_suite")
    tq.init(
        OmegaConf.create(
            {
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {"num_data_storage_units": 1, "total_storage_size": 10000},
                }
            }
        )
    )
    TIMINGS["ray + TransferQueue start (s)"] = time.monotonic() - started
    yield
    tq.close()
    ray.shutdown()


def pytest_configure(config: Any) -> None:
    # verl announces every optional training engine it cannot import (megatron, veomni, ...).
    config.addinivalue_line("filterwarnings", "ignore:.*engine is not available:UserWarning")
    config.addinivalue_line(
        "filterwarnings", "ignore:Disabled critic as algorithm.adv_estimator:UserWarning"
    )
