"""Allocation policies: how many answers a prompt may get at most, from its history.

A stopping rule says when a prompt has enough answers; an allocation policy bounds how
many it may get at all (always within n_max), so answers go where they teach. The
history is the per-prompt Beta posterior the Est estimator keeps (decayed counts of
answers and correct answers, Beta(alpha, beta) prior): a prompt with N_pos correct
answers of N_tot has posterior Beta(a, b), a = alpha + N_pos, b = beta + N_tot - N_pos.
The scheduler asks the prompt's policy before each wave and cuts the wave to what is
left of the budget; a group the budget stopped before its rule did has stop reason
``budget``.

A group is *informative* when its rewards are not all equal: only then does a
group-relative advantage carry signal. For n answers at pass rate p that has
probability 1 - p^n - (1-p)^n; the policies use its posterior-predictive value

    I(n) = 1 - E[p^n] - E[(1-p)^n],   E[p^n] = prod_{i<n} (a + i) / (a + b + i),

which, unlike plugging in the posterior mean, knows how little a few answers say.

- ``posterior``: a prompt with no correct answer in its history nor in its answers so
  far gets ``pilot`` answers; otherwise the budget is the smallest n with
  I(n) >= ``confidence`` under the posterior updated by the answers so far, clipped to
  [pilot, n_max]. So an unsolved prompt costs a pilot, and more only if the pilot finds
  a correct answer.
- ``knapsack`` (Knapsack RL, arXiv 2509.25849): budgets n_x in [n_min, n_max] that
  maximise sum_x V_x(n_x) over the population (the dataset's prompts, those never seen
  at the prior) subject to mean_x n_x <= ``mean_budget``. V is I(n) (``value:
  informative``, what informative groups per answer counts) or the paper's task value
  E[(1 - p^n - (1-p)^n) p (1-p)^2], its InfoGain p(1-p)^2 favouring harder prompts
  (``value: paper``). Both are concave in n: their increments E[(p^n (1-p) +
  (1-p)^n p) w(p)], w = 1 or p(1-p)^2, shrink as n grows for every p. And for a separable concave objective under one
  budget the greedy that hands out answers one at a time to the largest marginal gain is
  optimal (the exchange argument: a solution missing a taken increment can swap it for
  one of no larger gain). The greedy's allocation is a threshold on the gains: every
  increment above the gain lambda of the first one that did not fit is taken, so a
  prompt's budget is n_min + #{n >= n_min : V(n + 1) - V(n) > lambda}. lambda is
  recalibrated on the population every ``recalibrate_every`` finished groups (one sort
  of its P x (n_max - n_min) gains), and any prompt's budget is read from it at once.
  Taking no increment tied at lambda keeps the allocation independent of order and
  within budget; being a threshold solution it is optimal for the answers it spends
  (Everett's theorem).
- ``pilot_commit`` (after Pilot-Commit, arXiv 2605.26606): every prompt first gets
  ``pilot`` answers; the rest of the budget (``commit`` answers in all, n_max unless
  set) is committed only where the pilot and the history predict an informative group:
  always when the pilot holds both kinds, else when the posterior (history plus pilot)
  probability that the m = commit - pilot answers still to come hold the missing kind,
  1 - E[(1-p)^m] after an all-wrong pilot or 1 - E[p^m] after an all-right one, is at
  least ``threshold``. The decision reads the pilot's answers only, so it is taken once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field

from strategies.estimator import MAX_ANSWERS, Estimator, MeanBudget, NMin, check_mean_budget
from strategies.registry import Params, Policy, PolicyError, Registry

Pilot = Annotated[
    int, Field(ge=1, le=MAX_ANSWERS, description="answers a prompt gets before it proves itself")
]


def power_moments(a: np.ndarray | float, b: np.ndarray | float, n_max: int) -> np.ndarray:
    """E[p^n] for n = 0..n_max under Beta(a, b), along the last axis."""
    a_, b_ = np.asarray(a, dtype=np.float64)[..., None], np.asarray(b, dtype=np.float64)[..., None]
    i = np.arange(n_max, dtype=np.float64)
    factors = (a_ + i) / (a_ + b_ + i)
    ones = np.ones((*factors.shape[:-1], 1))
    return np.concatenate([ones, np.cumprod(factors, axis=-1)], axis=-1)


def informative_probability(a: np.ndarray | float, b: np.ndarray | float, n_max: int) -> np.ndarray:
    """I(n) = 1 - E[p^n] - E[(1-p)^n] for n = 0..n_max under Beta(a, b): the chance
    that n answers hold both a correct and an incorrect one (0 for n < 2)."""
    out = 1.0 - power_moments(a, b, n_max) - power_moments(b, a, n_max)
    out[..., :2] = 0.0
    return np.asarray(np.maximum(out, 0.0))


def paper_value(a: np.ndarray | float, b: np.ndarray | float, n_max: int) -> np.ndarray:
    """Knapsack RL's task value E[(1 - p^n - (1-p)^n) p (1-p)^2] for n = 0..n_max under
    Beta(a, b), from E[p^i (1-p)^j] = prod_{k<i} (a+k)/(a+b+k) prod_{k<j} (b+k)/(a+b+i+k)."""
    a_, b_ = np.asarray(a, dtype=np.float64)[..., None], np.asarray(b, dtype=np.float64)[..., None]
    n = np.arange(n_max + 1, dtype=np.float64)
    s = a_ + b_
    gain = a_ / s * b_ * (b_ + 1) / ((s + 1) * (s + 2))  # E[p (1-p)^2]
    # E[p^(n+1) (1-p)^2] and E[p (1-p)^(n+2)]
    high = power_moments(a, b, n_max + 1)[..., 1:] * b_ * (b_ + 1) / ((s + n + 1) * (s + n + 2))
    low = power_moments(b, a, n_max + 2)[..., 2:] * a_ / (s + n + 2)
    out = gain - high - low
    out[..., :2] = 0.0
    return np.asarray(np.maximum(out, 0.0))


class AllocationPolicy(Policy, ABC):
    """Bounds a prompt's answers from its history and its answers so far."""

    scope = "prompt"

    def validate(self, n_max: int) -> None:
        """Raise PolicyError naming the parameter that cannot work with this n_max."""

    @abstractmethod
    def budget(
        self, history: Estimator, prompt_id: str, outcomes: Sequence[bool], n_max: int
    ) -> int:
        """Answers ``prompt_id`` may get in all, in [1, n_max]; ``outcomes`` are its
        answers so far (True = correct), in generation order."""

    def describe(self) -> dict[str, Any]:
        """What the policy has learned, for the sampler's stats."""
        return {}


ALLOCATIONS: Registry[AllocationPolicy] = Registry("allocation")


class PilotParams(Params):
    pilot: Pilot = 4


class PilotFirst(AllocationPolicy):
    """A policy that gives every prompt a pilot of answers before it decides on more."""

    params: PilotParams

    def validate(self, n_max: int) -> None:
        if self.params.pilot > n_max:
            raise PolicyError(
                f"pilot ({self.params.pilot}) must be <= n_max ({n_max})", field="pilot"
            )


class PosteriorParams(PilotParams):
    confidence: float = Field(
        0.9, gt=0.0, lt=1.0, description="posterior chance of an informative group to aim for"
    )


@ALLOCATIONS.policy("posterior", PosteriorParams)
class Posterior(PilotFirst):
    """Pilot for a prompt never solved; else the smallest n with I(n) >= confidence."""

    params: PosteriorParams

    def budget(
        self, history: Estimator, prompt_id: str, outcomes: Sequence[bool], n_max: int
    ) -> int:
        pilot = min(self.params.pilot, n_max)
        n_pos = sum(outcomes)
        if history.counts(prompt_id)[1] == 0 and n_pos == 0:
            return pilot
        a, b = history.posterior(prompt_id)
        probs = informative_probability(a + n_pos, b + len(outcomes) - n_pos, n_max)
        reached = np.flatnonzero(probs >= self.params.confidence)
        return max(pilot, int(reached[0]) if len(reached) else n_max)


class KnapsackParams(Params):
    mean_budget: MeanBudget = Field(8.0, description="mean answers per prompt over the population")
    n_min: NMin = Field(2, description="fewest answers a prompt gets")
    value: Literal["informative", "paper"] = Field(
        "informative",
        description="informative: 1 - p^n - (1-p)^n; paper: that times p(1-p)^2",
    )
    recalibrate_every: int = Field(
        64, ge=1, le=1_000_000, description="finished groups between recalibrations"
    )


@ALLOCATIONS.policy("knapsack", KnapsackParams)
class Knapsack(AllocationPolicy):
    """Greedy (threshold) allocation of a mean budget by marginal informative value."""

    params: KnapsackParams

    def __init__(self, params: KnapsackParams) -> None:
        super().__init__(params)
        self.threshold = -np.inf
        self.planned_mean = float("nan")
        # What the threshold was calibrated on: the history, its group count, n_max.
        self._calibrated: tuple[Estimator, int, int] | None = None

    def validate(self, n_max: int) -> None:
        check_mean_budget("knapsack", self.params.n_min, self.params.mean_budget, n_max)

    def gains(self, a: np.ndarray | float, b: np.ndarray | float, n_max: int) -> np.ndarray:
        """V(n + 1) - V(n) for n = n_min..n_max-1 (non-increasing: V is concave)."""
        value = informative_probability if self.params.value == "informative" else paper_value
        n_min = min(self.params.n_min, n_max)
        return np.diff(value(a, b, n_max), axis=-1)[..., n_min:]

    def allocate(self, gains: np.ndarray, weights: np.ndarray, n_max: int) -> np.ndarray:
        """Budgets of prompts with these gains (one row each, ``weights`` prompts per
        row) under the mean budget; sets ``threshold``. The greedy of the module
        docstring: increments by decreasing gain while the answers they cost fit."""
        n_min = min(self.params.n_min, n_max)
        spare = (self.params.mean_budget - n_min) * float(weights.sum())
        order = np.argsort(-gains, axis=None, kind="stable")
        cost = np.cumsum(np.broadcast_to(weights[:, None], gains.shape).ravel()[order])
        taken = int(np.searchsorted(cost, spare + 1e-9, side="right"))
        self.threshold = -np.inf if taken >= cost.size else float(gains.ravel()[order[taken]])
        budgets = n_min + (gains > self.threshold).sum(axis=-1)
        self.planned_mean = float(np.average(budgets, weights=weights))
        return np.asarray(budgets)

    def calibrate(self, history: Estimator, n_max: int) -> None:
        """Recompute the threshold on the history's population."""
        n_tot, n_pos, weights = history.population()
        alpha, beta = history.params.alpha, history.params.beta
        self.allocate(self.gains(alpha + n_pos, beta + (n_tot - n_pos), n_max), weights, n_max)
        self._calibrated = (history, history.finalized, n_max)

    def budget(
        self, history: Estimator, prompt_id: str, outcomes: Sequence[bool], n_max: int
    ) -> int:
        last = self._calibrated
        if (
            last is None
            or last[0] is not history
            or last[2] != n_max
            or not 0 <= history.finalized - last[1] < self.params.recalibrate_every
        ):
            self.calibrate(history, n_max)
        gains = self.gains(*history.posterior(prompt_id), n_max)
        return min(self.params.n_min, n_max) + int((gains > self.threshold).sum())

    def describe(self) -> dict[str, Any]:
        """The threshold (None while every increment fits) and the population's mean
        budget (None before the first calibration)."""
        return {
            "threshold": self.threshold if np.isfinite(self.threshold) else None,
            "planned_mean_budget": self.planned_mean if np.isfinite(self.planned_mean) else None,
        }


class PilotCommitParams(PilotParams):
    commit: int | None = Field(
        None, ge=1, le=MAX_ANSWERS, description="answers in all once committed (none: n_max)"
    )
    threshold: float = Field(
        0.75, gt=0.0, le=1.0, description="predicted chance of an informative group to commit"
    )


@ALLOCATIONS.policy("pilot_commit", PilotCommitParams)
class PilotCommit(PilotFirst):
    """A pilot, then ``commit`` answers where an informative group is predicted."""

    params: PilotCommitParams

    def validate(self, n_max: int) -> None:
        super().validate(n_max)
        commit = self.params.commit
        if commit is not None and not self.params.pilot <= commit <= n_max:
            raise PolicyError(
                f"commit ({commit}) must be in [pilot, n_max] ([{self.params.pilot}, {n_max}])",
                field="commit",
            )

    def commit_probability(
        self, history: Estimator, prompt_id: str, pilot: Sequence[bool], m: int
    ) -> float:
        """Posterior chance that the pilot plus m more answers form an informative group."""
        n_pos = sum(pilot)
        if 0 < n_pos < len(pilot):
            return 1.0
        a, b = history.posterior(prompt_id)
        a, b = a + n_pos, b + len(pilot) - n_pos
        # The missing kind is the other one: E[(1-p)^m] = moments of Beta(b, a).
        stay = power_moments(b, a, m) if n_pos == 0 else power_moments(a, b, m)
        return float(1.0 - stay[-1])

    def budget(
        self, history: Estimator, prompt_id: str, outcomes: Sequence[bool], n_max: int
    ) -> int:
        total = min(self.params.commit or n_max, n_max)
        pilot = min(self.params.pilot, total)
        if len(outcomes) < pilot:
            return pilot
        chance = self.commit_probability(history, prompt_id, outcomes[:pilot], total - pilot)
        return total if chance >= self.params.threshold else pilot


def build(name: str, **params: Any) -> AllocationPolicy:
    """Build the allocation policy ``name``; bad parameters raise PolicyError."""
    return ALLOCATIONS.build(name, **params)
