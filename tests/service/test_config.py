"""Whole-config checks that protect the sampler from configurations it cannot serve."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sampler_service.config import ConfigError, SamplerConfig, ServeSettings, check_consistency


def test_frame_larger_than_the_buffer_is_refused() -> None:
    # Admission stops at max_buffered_groups, so this frame could never fill (a silent hang).
    with pytest.raises(ConfigError) as info:
        check_consistency(SamplerConfig(batch_groups=512, max_buffered_groups=256), ["a", "b"])
    assert info.value.field == "batch_groups"
    check_consistency(SamplerConfig(batch_groups=256, max_buffered_groups=256), ["a", "b"])


@pytest.mark.parametrize(
    "knobs",
    [
        # under est, the config's own check
        {"rule": "est", "n_max": 16, "est": {"mean_budget": 20.0}},
        # under another rule the estimator still learns, and its own check fires
        {"rule": "balanced", "est": {"n_min": 10, "mean_budget": 8.0}},
    ],
)
def test_the_est_budget_check_names_one_field_whichever_check_fires(knobs) -> None:
    with pytest.raises(ConfigError) as info:
        check_consistency(SamplerConfig(**knobs), ["a"])
    assert info.value.field == "est.mean_budget"
    assert "n_min <= mean_budget <= n_max" in str(info.value)


def test_verifier_workers_default_to_the_cores_the_front_may_run_on() -> None:
    settings = ServeSettings(model=Path("m"), data=[Path("d.jsonl")])
    cores = os.sched_getaffinity(0)
    assert settings.verifier_pool_size == max(2, len(cores) - 1)
    try:
        os.sched_setaffinity(0, {min(cores)})  # one core: still a second worker to go on
        assert settings.verifier_pool_size == 2
    finally:
        os.sched_setaffinity(0, cores)
    chosen = ServeSettings(model=Path("m"), data=[Path("d.jsonl")], verifier_workers=3)
    assert chosen.verifier_pool_size == 3
