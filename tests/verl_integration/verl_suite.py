"""Helpers of the verl suite (imported by its conftest and tests; a module name that cannot
collide with other suites' conftest modules)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trainer_client.launch import SamplerProcess

REPO = Path(__file__).resolve().parents[2]
TIMINGS: dict[str, float] = {}


class Sampler(SamplerProcess):
    """One `adaptive-rollout serve` subprocess (hf backend, toy model), timed to ready."""

    def __init__(self, toy: Any, workdir: Path, config: dict[str, Any]) -> None:
        super().__init__(
            toy.model_dir,
            toy.data_files,
            workdir / "state",
            config,
            workdir / "sampler.log",
            heartbeat_s=0.5,
            extra=["--dtype", "float32"],
        )

    def start(self, timeout_s: float = 180.0) -> Sampler:  # type: ignore[override]
        started = time.monotonic()
        super().start(timeout_s)
        TIMINGS.setdefault("sampler start (s)", time.monotonic() - started)
        return self


#: A sampler config verl can train on: plain GRPO groups of 4, grpo advantages.
GRPO_CONFIG = {
    "rule": "fixed",
    "group_size": 4,
    "wave_size": 4,
    "n_max": 8,
    "advantage": "grpo",
    "max_tokens": 8,
    "max_active_prompts": 16,
    "max_buffered_groups": 64,
    "temperature": 1.0,
    # The tests lease groups without training on them: nothing to bound.
    "max_staleness": None,
}


def verl_config(
    url: str, *, n: int = 4, batch: int = 2, overrides: list[str] | None = None, **section: Any
) -> Any:
    """verl's own ppo_trainer config (Hydra compose), with our deploy overrides and `section`."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "deploy" / "verl"), version_base=None):
        cfg = compose(
            config_name="sampler_grpo",
            overrides=[
                f"++trainer.v1.adaptive_rollout.url={url}",
                f"actor_rollout_ref.rollout.n={n}",
                f"data.train_batch_size={batch}",
                f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
                *[
                    f"++trainer.v1.adaptive_rollout.{k}={json.dumps(v) if not isinstance(v, str) else v}"
                    for k, v in section.items()
                ],
                *(overrides or []),
            ],
        )
    GlobalHydra.instance().clear()
    return cfg


def lease_groups(
    url: str, count: int, *, consumer: str = "tests", timeout: float = 120.0
) -> list[Any]:
    """`count` finished groups from a live sampler (leased; the caller acks or lets them expire)."""
    from trainer_client.client import SamplerClient

    groups: list[Any] = []
    deadline = time.monotonic() + timeout
    with SamplerClient(url, consumer=consumer) as client:
        while len(groups) < count:
            assert time.monotonic() < deadline, (
                f"only {len(groups)} of {count} groups in {timeout}s"
            )
            groups.extend(
                client.lease(max_groups=count - len(groups), wait_s=5.0, consumer=consumer).groups
            )
        client.ack(groups)
    return groups
