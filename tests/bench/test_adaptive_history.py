"""Adaptive waves read the pass-rate history: a prompt seen in an earlier epoch gets a
first wave sized from its estimated pass rate, not from the uninformed p = 1/2.

The real scheduler, stopping rule and estimator drive the simulated engine in simulated
time; the engine logs every request's size, so the first wave of each prompt is observed
where it is asked for.
"""

from __future__ import annotations

import math

from sim_waves import waves_until_every_prompt_asked

from sampler_service.scheduler import Scheduler

PROMPTS = 16
CONFIG = {
    "rule": "balanced",
    "wave": "adaptive",
    "k_pos": 2,
    "k_neg": 2,
    "n_max": 32,
    "wave_size": 16,
    "max_active_prompts": PROMPTS,
    "max_buffered_groups": 4 * PROMPTS,
    "max_staleness": None,  # one epoch as fast as it runs: nothing trains on it
}


def _first_waves(history: dict[str, list[float]] | None) -> tuple[dict[int, int], dict[int, float]]:
    """Run one epoch; return each prompt's first wave and the p the estimator held for it."""

    def prepare(scheduler: Scheduler) -> dict[int, float]:
        if history is not None:
            scheduler.live.estimator.load_state_dict({"c": 0.0, "finalized": 0, "stats": history})
        return {i: scheduler.live.estimator.p(f"p{i:06d}") for i in range(PROMPTS)}

    waves, prior = waves_until_every_prompt_asked([0.1] * PROMPTS, CONFIG, 64, prepare)
    first: dict[int, int] = {}
    for index, n, _ in waves:
        first.setdefault(index, n)
    return first, prior


def test_history_changes_the_first_adaptive_wave() -> None:
    cold, _ = _first_waves(None)
    # p = 1/2 for an unseen prompt: ceil(max(2 / 0.5, 2 / 0.5)) = 4 answers.
    assert set(cold.values()) == {4}
    # Earlier epochs saw 1 correct answer in 16 for every prompt (p = 2/18 with the prior).
    history = {f"p{i:06d}": [16.0, 1.0] for i in range(PROMPTS)}
    warm, prior = _first_waves(history)
    assert len(warm) == PROMPTS
    for index, n in warm.items():
        p = prior[index]
        assert p < 0.2
        assert n == min(16, math.ceil(max(2 / p, 2 / (1 - p))))
    assert set(warm.values()) == {16}
