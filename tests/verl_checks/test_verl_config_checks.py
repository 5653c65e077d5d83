"""What the verl integration checks and ships that needs no verl install (core suite).

- the shipped verl config selects an attention implementation verl[verl-core] can run,
  and the start-up check refuses flash attention without flash-attn and padding removal
  without flash attention;
- the launch script's sampler config gives every group exactly GROUP_SIZE samples for any
  GROUP_SIZE, and the sampler accepts it;
- the group-size checks take the sampler's defaults from the policy models in
  strategies (the one place they are defined).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from sampler_service.config import validate_config
from strategies.allocation import ALLOCATIONS
from strategies.stopping import StoppingParams
from trainer_client.verl.settings import (
    attention_of,
    check_attention,
    check_sampler_config,
    check_verl_config,
)

REPO = Path(__file__).resolve().parents[2]


def _shipped() -> dict:
    return yaml.safe_load((REPO / "deploy/verl/sampler_grpo.yaml").read_text())


def test_shipped_config_runs_without_flash_attn() -> None:
    shipped = _shipped()
    assert attention_of(shipped) == "sdpa"
    assert check_attention(shipped, flash_attn=False) == []
    assert check_verl_config(shipped, flash_attn=False) == []


def test_flash_attention_without_flash_attn_is_refused() -> None:
    verl_default = _shipped()
    del verl_default["actor_rollout_ref"]["model"]["override_config"]
    problems = check_attention(verl_default, flash_attn=False)
    assert len(problems) == 1 and "flash_attention_2" in problems[0] and "sdpa" in problems[0]
    assert check_attention(verl_default, flash_attn=True) == []


def test_padding_removal_needs_flash_attention() -> None:
    packed = _shipped()
    packed["actor_rollout_ref"]["model"]["use_remove_padding"] = True
    problems = check_attention(packed, flash_attn=True)
    assert len(problems) == 1 and "use_remove_padding=false" in problems[0]
    flash = _shipped()
    flash["actor_rollout_ref"]["model"]["override_config"]["attn_implementation"] = (
        "flash_attention_2"
    )
    flash["actor_rollout_ref"]["model"]["use_remove_padding"] = True
    assert check_attention(flash, flash_attn=True) == []


def _launch_config(**env: str) -> dict:
    out = subprocess.run(
        [str(REPO / "deploy/verl/launch.sh"), "sampler-config"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.parametrize("group_size", [2, 4, 8, 12, 16, 64])
def test_launch_config_fills_every_group(group_size: int) -> None:
    config = _launch_config(GROUP_SIZE=str(group_size))
    validate_config(config)  # the sampler accepts it
    problems, _ = check_sampler_config(config, rollout_n=group_size, temperature=1.0)
    assert problems == []
    assert config["wave_size"] >= group_size


def test_group_checks_use_the_samplers_defaults() -> None:
    # A config that leaves wave_size, k_pos and k_neg to the sampler: the check must use
    # the sampler's values for them, whatever they are.
    defaults = StoppingParams()
    fills = max(defaults.wave_size, defaults.k_pos + defaults.k_neg)
    ok, _ = check_sampler_config({"rule": "balanced", "group_size": fills}, rollout_n=fills)
    short, _ = check_sampler_config(
        {"rule": "balanced", "group_size": fills + 1}, rollout_n=fills + 1
    )
    assert ok == [] and len(short) == 1 and f"first wave {defaults.wave_size}" in short[0]


@pytest.mark.parametrize(("name", "knob"), [("posterior", "pilot"), ("knapsack", "n_min")])
def test_an_allocation_that_can_stop_short_of_a_group_is_a_problem(name: str, knob: str) -> None:
    least = ALLOCATIONS.entry(name).params.model_fields[knob].default
    base = {"rule": "fixed", "group_size": least}
    assert check_sampler_config({**base, "allocation": {"name": name}}, rollout_n=least)[0] == []
    short = {"rule": "fixed", "group_size": least + 1, "allocation": {"name": name}}
    problems, _ = check_sampler_config(short, rollout_n=least + 1)
    assert len(problems) == 1 and f"allocation.params.{knob} >= {least + 1}" in problems[0]
    fixed = {**short, "allocation": {"name": name, "params": {knob: least + 1}}}
    assert check_sampler_config(fixed, rollout_n=least + 1)[0] == []


def test_a_sampler_that_continues_answers_needs_token_level_rollout_correction() -> None:
    """Under weight_update_mode continue an answer's tokens may come from several
    versions: verl must weigh each by its own ratio (rollout_correction.rollout_is=token)."""
    sampler = {"rule": "fixed", "group_size": 4, "weight_update_mode": "continue"}
    [problem], _ = check_sampler_config(sampler, rollout_n=4, rollout_is="sequence")
    assert "rollout_correction.rollout_is=token" in problem and "'sequence'" in problem
    assert check_sampler_config(sampler, rollout_n=4)[0] != []
    assert check_sampler_config(sampler, rollout_n=4, rollout_is="token")[0] == []
    waits = {**sampler, "weight_update_mode": "wait"}
    assert check_sampler_config(waits, rollout_n=4)[0] == []
