"""Reinforce-Ada *Est*: a per-prompt pass-rate estimate and the budget it implies.

Each prompt id keeps exponentially decayed counts (EMA with decay ``decay``, the paper's lambda) of answers
and correct answers; a Beta(alpha, beta) prior keeps the estimate away from 0 and 1 for
rarely-seen prompts. Hard prompts (low p) get more answers, with the constant c chosen so
that the dataset-wide mean budget is ``mean_budget``, which makes Est's cost comparable to
GRPO with that group size. Two budget forms (``budget_form``):

- ``sqrt`` (the default, the paper's Est): N_x = clip(round(c / sqrt(p_x + eps)), n_min,
  n_max).
- ``inverse``: N_x = max(n_min, round(c / (p_x + eps))), not clipped at n_max when c is
  calibrated: the ~1/p budget of the authors' unmerged variant, which the paper's own
  ablation warns spends most answers on the hardest prompts. The stopping rule still
  stops a prompt at n_max, so raise n_max to let the budget run.

The counts are also the per-prompt history the allocation policies
(``strategies.allocation``) read: ``posterior`` gives a prompt's Beta posterior.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import ConfigDict, Field

from strategies.registry import Params, PolicyError, parse_params

#: Bisection iterations for c; 200 halvings shrink any float interval to adjacent floats.
_BISECTION_STEPS = 200


#: The most answers one prompt may get: budgets scale memory and engine work, and an
#: unbounded one would let a single config change queue more than the machine can hold.
MAX_ANSWERS = 4_096
#: The floor of a prompt's budget and the mean of a population's budgets: the knobs of
#: the Est rule and of the knapsack allocation, bounded alike.
NMin = Annotated[int, Field(ge=1, le=MAX_ANSWERS)]
MeanBudget = Annotated[float, Field(gt=0.0, le=MAX_ANSWERS)]


#: Labels of a prompt's pass-rate bin (`Estimator.quartile`), hardest first, and of a
#: prompt the estimator has not seen.
QUARTILES = ("q1", "q2", "q3", "q4")
UNSEEN = "unseen"


def check_mean_budget(kind: str, n_min: int, mean_budget: float, n_max: int) -> None:
    """A mean budget is only reachable between the floor and the cap."""
    if not n_min <= mean_budget <= n_max:
        raise PolicyError(
            f"{kind} needs n_min <= mean_budget <= n_max (got {n_min} <= {mean_budget} <= {n_max})",
            field="mean_budget",
        )


class EstKnobs(Params):
    """The Est knobs a user sets (the sampler config's `est`). The paper gives no values;
    these defaults are ours. The only definition of them: the service's config, the
    estimator and the trainer-side checks all use this model. Every float is finite."""

    model_config = ConfigDict(allow_inf_nan=False)

    decay: float = Field(0.8, gt=0.0, le=1.0, description="EMA decay (lambda) of a prompt's counts")
    alpha: float = Field(
        1.0, gt=0.0, le=1e6, description="Beta prior: pseudo-count of right answers"
    )
    beta: float = Field(
        1.0, gt=0.0, le=1e6, description="Beta prior: pseudo-count of wrong answers"
    )
    eps: float = Field(0.01, gt=0.0, le=1.0, description="budget = c / sqrt(p + eps)")
    n_min: NMin = Field(2, description="smallest per-prompt budget")
    mean_budget: MeanBudget = Field(8.0, description="dataset-wide mean of the budgets")
    budget_form: Literal["sqrt", "inverse"] = Field(
        "sqrt",
        description="sqrt: c / sqrt(p + eps) clipped to [n_min, n_max] (the paper's Est); "
        "inverse: c / (p + eps), at least n_min, calibrated without the n_max cap",
    )


class EstimatorParams(EstKnobs):
    """What the estimator needs beyond the user's knobs."""

    n_max: int = Field(32, ge=1, le=MAX_ANSWERS)
    recalibrate_every: int = Field(64, ge=1)


class Estimator:
    """Pass-rate estimator and budget allocator for the ``est`` stopping rule."""

    def __init__(self, **params: Any) -> None:
        self.params = parse_params(EstimatorParams, params, kind="estimator", name="est")
        p = self.params
        check_mean_budget("est", p.n_min, p.mean_budget, p.n_max)
        self._stats: dict[str, tuple[float, float]] = {}  # id -> (N_tot, N_pos)
        # id -> consecutive finalized groups with no correct or no incorrect answer
        self._streaks: dict[str, int] = {}
        self._prompts: frozenset[str] = frozenset()
        self._finalized = 0
        self.c = 0.0
        self.recalibrate()

    def seen(self, prompt_id: str) -> bool:
        """Whether a finalized group of this prompt has updated the estimate."""
        return prompt_id in self._stats

    def p(self, prompt_id: str) -> float:
        """Posterior-mean pass rate (N_pos + alpha) / (N_tot + alpha + beta)."""
        n_tot, n_pos = self._stats.get(prompt_id, (0.0, 0.0))
        return (n_pos + self.params.alpha) / (n_tot + self.params.alpha + self.params.beta)

    def counts(self, prompt_id: str) -> tuple[float, float]:
        """The prompt's decayed counts (N_tot, N_pos) of answers and correct answers;
        (0, 0) for a prompt never seen."""
        return self._stats.get(prompt_id, (0.0, 0.0))

    def posterior(self, prompt_id: str) -> tuple[float, float]:
        """The prompt's Beta posterior (alpha + N_pos, beta + N_tot - N_pos) from its
        decayed counts; the prior for a prompt never seen."""
        n_tot, n_pos = self.counts(prompt_id)
        return self.params.alpha + n_pos, self.params.beta + (n_tot - n_pos)

    def quartile(self, prompt_id: str) -> str:
        """The prompt's pass-rate bin by its posterior mean: q1 below 0.25 (the hardest)
        to q4 from 0.75 up; fixed bins, so a prompt's bin moves only with its own
        estimate. `UNSEEN` before its first finalized group."""
        if not self.seen(prompt_id):
            return UNSEEN
        return QUARTILES[min(int(self.p(prompt_id) * 4), 3)]

    @property
    def finalized(self) -> int:
        """Finalized groups folded in so far (what the allocation policies recalibrate on)."""
        return self._finalized

    def streak(self, prompt_id: str) -> int:
        """Consecutive finalized groups of this prompt, up to the last, that had no correct
        or no incorrect answer (0 after a group with both)."""
        return self._streaks.get(prompt_id, 0)

    def update(self, prompt_id: str, n: int, k: int) -> None:
        """Fold in a finalized group of ``n`` answers, ``k`` of them correct.

        Every ``recalibrate_every`` finalized groups c is recomputed, so the mean budget
        tracks the estimates as they move.
        """
        if not 0 <= k <= n:
            raise ValueError(f"need 0 <= k <= n, got n={n}, k={k}")
        lam = self.params.decay
        n_tot, n_pos = self._stats.get(prompt_id, (0.0, 0.0))
        self._stats[prompt_id] = (lam * n_tot + n, lam * n_pos + k)
        if k in (0, n):
            self._streaks[prompt_id] = self._streaks.get(prompt_id, 0) + 1
        else:
            self._streaks.pop(prompt_id, None)
        self._finalized += 1
        if self._finalized % self.params.recalibrate_every == 0:
            self.recalibrate()

    def set_prompts(self, prompt_ids: Iterable[str]) -> None:
        """Declare the dataset's prompt ids (the population c is calibrated on)."""
        self._prompts = frozenset(prompt_ids)
        self.recalibrate()

    def budget(self, prompt_id: str) -> int:
        """N_x of ``budget_form`` (module docstring) at the current c."""
        return int(self._budgets(self.c, self._denominators(np.array([self.p(prompt_id)])))[0])

    def recalibrate(self) -> float:
        """Set c by bisection so the population's mean budget is closest to mean_budget.

        The mean budget is a non-decreasing step function of c, so an exact match may
        not exist: we take whichever side of the step nearest the target is closer
        (the upper side on a tie).
        """
        probs, weights = self._population()
        denominators = self._denominators(probs)
        target = self.params.mean_budget
        # At hi every budget exceeds both n_max and mean_budget, so the mean is >= target.
        top = max(self.params.n_max, target) + 1
        eps = self.params.eps
        lo = 0.0
        hi = top * (math.sqrt(1.0 + eps) if self.params.budget_form == "sqrt" else 1.0 + eps)
        if self._mean(lo, denominators, weights) >= target:
            self.c = lo
            return self.c
        for _ in range(_BISECTION_STEPS):
            mid = 0.5 * (lo + hi)
            if mid in (lo, hi):
                break
            if self._mean(mid, denominators, weights) >= target:
                hi = mid
            else:
                lo = mid
        below = self._mean(lo, denominators, weights)
        above = self._mean(hi, denominators, weights)
        self.c = lo if target - below < above - target else hi
        return self.c

    def current_mean_budget(self) -> float:
        """The mean budget over the calibration population at the current c."""
        probs, weights = self._population()
        return self._mean(self.c, self._denominators(probs), weights)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable learned state (c, group counter, per-prompt counts, streaks)."""
        return {
            "c": self.c,
            "finalized": self._finalized,
            "stats": {pid: [n_tot, n_pos] for pid, (n_tot, n_pos) in self._stats.items()},
            "streaks": dict(self._streaks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; parameters come from the constructor."""
        self.c = float(state["c"])
        self._finalized = int(state["finalized"])
        self._stats = {pid: (float(t), float(k)) for pid, (t, k) in state["stats"].items()}
        # Absent from states saved before streaks were kept: those start with no streak.
        self._streaks = {pid: int(s) for pid, s in state.get("streaks", {}).items()}

    def population(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decayed counts (N_tot, N_pos) of the population budgets are calibrated on,
        with the number of prompts at each.

        The population is the declared dataset, else the prompts seen so far, else a
        single unseen prompt (so a calibration is defined before any data). Unseen dataset
        prompts all sit at the prior (counts 0), so they are one weighted entry: a
        calibration costs O(prompts seen), not O(dataset).
        """
        if self._prompts:
            seen = [self._stats[i] for i in self._stats if i in self._prompts]
            unseen = len(self._prompts) - len(seen)
        else:
            seen = list(self._stats.values())
            unseen = 0 if seen else 1
        n_tot, n_pos = np.array([*seen, (0.0, 0.0)], dtype=np.float64).T
        return n_tot, n_pos, np.array([1.0] * len(seen) + [unseen])

    def _population(self) -> tuple[np.ndarray, np.ndarray]:
        """Posterior-mean pass rates of the population, with the prompts at each."""
        n_tot, n_pos, weights = self.population()
        a, b = self.params.alpha, self.params.beta
        return (n_pos + a) / (n_tot + a + b), weights

    def _denominators(self, probs: np.ndarray) -> np.ndarray:
        """What ``budget_form`` divides c by: computed once per calibration, not once
        per bisection step."""
        p = self.params
        return np.sqrt(probs + p.eps) if p.budget_form == "sqrt" else probs + p.eps

    def _budgets(self, c: float, denominators: np.ndarray) -> np.ndarray:
        """Budgets of ``budget_form`` (see `_denominators`); rounding is half-up."""
        p = self.params
        cap = p.n_max if p.budget_form == "sqrt" else MAX_ANSWERS
        return np.clip(np.floor(c / denominators + 0.5), p.n_min, cap).astype(np.int64)

    def _mean(self, c: float, denominators: np.ndarray, weights: np.ndarray) -> float:
        # np.average's own arithmetic without its argument handling (most of its cost
        # here, at ~60 bisection steps a calibration)
        return float((self._budgets(c, denominators) * weights).sum() / weights.sum())
