"""The episode benchmark's core at a tiny size (bench/episodes.py): the toy runs are the
episodes they claim to be, and the simulated environment's thread calls take no
simulated time only because the virtual clock is held for them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from bench import adaptive_sim, episodes, virtual_clock

pytestmark = pytest.mark.timeout(600)


def test_toy_episodes_have_two_turns_masks_and_a_loop_cost(toy) -> None:
    result = episodes.measure_toy(toy.model_dir, toy.data_files[1], pairs=1, warmup=8, groups=64)
    single, episode = result["runs"]["single"][0], result["runs"]["episodes"][0]
    # every episode ran its environment's two turns and carries observation tokens
    assert result["turns_per_episode"] == 2.0
    assert episode["masked_samples"] == episode["samples"] > 0
    assert single["masked_samples"] == 0 and single["turns"] == 0
    assert result["tokens_per_episode"] > result["tokens_per_answer"] > 0
    assert result["loop_cpu_ms_per_turn"] > 0 and result["loop_cpu_ms_per_answer"] > 0
    assert result["env_cpu_ms_per_episode"] > 0


def _sim(hold: bool) -> dict:
    rates = adaptive_sim.draw_pass_rates("hard", 64, np.random.default_rng(0))
    with tempfile.TemporaryDirectory() as tmp:
        data = adaptive_sim.write_dataset(Path(tmp), len(rates))
        episodes._rows_with_env(data)
        dataset = adaptive_sim.simulated_dataset(data, len(rates), 0)
        return virtual_clock.run(
            episodes.sim_run(
                episodes.sim_config("grpo4", "sync", 4),
                rates,
                dataset,
                steps=2,
                warmup=1,
                seed=0,
            ),
            hold=episodes.in_environment_call if hold else None,
        )


def test_sim_rounds_wait_for_the_slowest_episode_and_env_calls_take_no_time() -> None:
    held = _sim(hold=True)
    assert held["env_sim_s"] == 0.0 and held["env_errors"] == 0
    assert held["episodes_per_batch"] == 4 * 4  # fixed n = 4, B = 4
    assert 0 <= held["informative_per_batch"] <= 4
    # rounds: a batch's frame forms when its last group finishes
    for times in held["group_times"]:
        assert len(times) == 4
    assert held["batch_fill_s"] == pytest.approx(
        np.mean([max(t) for t in held["group_times"]]), rel=1e-6
    )
    # without the hold the clock jumps over the environment threads' calls
    assert _sim(hold=False)["env_sim_s"] > 0


def test_turn_counts_follow_the_stated_tail() -> None:
    rng = np.random.default_rng(1)
    draws = np.array([episodes.draw_turns(rng) for _ in range(100_000)])
    assert draws.min() == 1 and draws.max() == episodes.MAX_TURNS
    assert draws.mean() == pytest.approx(episodes.expected_turns(), rel=0.03)
    assert np.mean(draws >= 4) == pytest.approx(4**-episodes.PARETO_ALPHA, abs=0.01)
