"""Advantage estimators for the kept samples of one prompt.

- ``grpo``: baseline and spread from the kept samples only (plain GRPO); a singleton
  group has no baseline, so its advantage is 0. Divides by the std by default.
- ``global``: Reinforce-Ada's baseline from **all** answers generated for the prompt,
  using their real rewards, so down-sampling does not bias it and non-binary rewards
  stay correct. No std division by default (the released script uses A = r - mean).
- ``est``: A = (r - rbar) / sqrt(max(rbar, 0) + eps) with rbar over all answers, which
  up-weights prompts the policy rarely solves; ``norm_by_std`` does not apply.
- ``maxrl``: A = (r - rbar) / (max(rbar, 0) + eps) with rbar over all answers, MaxRL's
  advantage (Tajwar et al., "Maximum Likelihood Reinforcement Learning", arXiv
  2602.02710): with binary rewards the gradient of log p (maximum likelihood of a correct
  answer, not RL's p) is E[grad log pi | correct], which MaxRL estimates from N answers
  with K correct as (1/K) sum_{correct} grad log pi_i, dividing by the successes instead
  of N. Subtracting the zero-mean control variate (1/N) sum_i grad log pi_i leaves
  (1/N) sum_i (r_i - rbar) / rbar grad log pi_i, rbar = K / N: this advantage. It weights
  a prompt by 1/p where GRPO's std weights it by 1/sqrt(p(1-p)) and est by 1/sqrt(p); a
  group with no correct answer gives 0. ``norm_by_std`` does not apply.

With std division, A = (r - mean) / (std_ddof1 + eps); a spread over fewer than two
rewards is taken as 0.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np

from strategies.registry import NoParams, Registry

Rewards = Sequence[float] | np.ndarray
AdvantageFn = Callable[[np.ndarray, np.ndarray, bool | None, float], np.ndarray]

ESTIMATORS: Registry[AdvantageFn] = Registry("advantage")


# A group's rewards are a handful of numbers: numpy's `mean` and `std` spend most of their
# ~4 and ~12 us in Python-level argument handling (`numpy/_core/_methods.py`), and a
# group needs several of them. These make the same C reductions in the same order, so
# their results are numpy's to the bit.


def mean(values: np.ndarray) -> float:
    """The mean of a non-empty float array."""
    return float(values.sum()) / len(values)


def std(values: np.ndarray) -> float:
    """Unbiased (ddof 1) std; 0 when there are fewer than two values."""
    n = len(values)
    if n < 2:
        return 0.0
    deviations = values - mean(values)
    return math.sqrt(float((deviations * deviations).sum()) / (n - 1))


def _centered(kept: np.ndarray, ref: np.ndarray, norm_by_std: bool, eps: float) -> np.ndarray:
    adv: np.ndarray = kept - mean(ref)
    return adv / (std(ref) + eps) if norm_by_std else adv


def _grpo(kept: np.ndarray, all_: np.ndarray, norm_by_std: bool | None, eps: float) -> np.ndarray:
    if len(kept) < 2:
        return np.zeros(len(kept))
    return _centered(kept, kept, True if norm_by_std is None else norm_by_std, eps)


def _global(kept: np.ndarray, all_: np.ndarray, norm_by_std: bool | None, eps: float) -> np.ndarray:
    return _centered(kept, all_, False if norm_by_std is None else norm_by_std, eps)


def _est(kept: np.ndarray, all_: np.ndarray, norm_by_std: bool | None, eps: float) -> np.ndarray:
    rbar = mean(all_)
    adv: np.ndarray = (kept - rbar) / np.sqrt(max(rbar, 0.0) + eps)
    return adv


def _maxrl(kept: np.ndarray, all_: np.ndarray, norm_by_std: bool | None, eps: float) -> np.ndarray:
    rbar = mean(all_)
    adv: np.ndarray = (kept - rbar) / (max(rbar, 0.0) + eps)
    return adv


ESTIMATORS.add("grpo", NoParams, lambda _params: _grpo, scope="group")
ESTIMATORS.add("global", NoParams, lambda _params: _global, scope="group")
ESTIMATORS.add("est", NoParams, lambda _params: _est, scope="group")
ESTIMATORS.add("maxrl", NoParams, lambda _params: _maxrl, scope="group")


def compute(
    kept_rewards: Rewards,
    all_rewards: Rewards,
    estimator: str = "grpo",
    norm_by_std: bool | None = None,
    eps: float = 1e-6,
) -> np.ndarray:
    """Advantages of the kept samples (same order as ``kept_rewards``).

    ``all_rewards`` are the rewards of every answer generated for the prompt (the kept
    ones included); ``norm_by_std=None`` means the estimator's default.
    """
    fn = _estimator(estimator)
    kept = np.asarray(kept_rewards, dtype=float)
    all_ = np.asarray(all_rewards, dtype=float)
    if len(kept) == 0:
        return np.zeros(0)
    if len(all_) == 0:
        raise ValueError("all_rewards is empty but kept_rewards is not")
    return fn(kept, all_, norm_by_std, eps)


@functools.cache
def _estimator(name: str) -> AdvantageFn:
    """The estimator ``name`` (they take no parameters): built once, not per group."""
    return ESTIMATORS.build(name)
