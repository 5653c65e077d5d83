"""Admission policies: which prompts are worth sampling at all, decided before any answer.

A prompt whose recent groups were all-correct or all-wrong gave its GRPO-style advantage
nothing to work with, and most likely will again (GRESO, arXiv 2506.02177; DAPO's
observation that zero-variance groups are wasted compute). ``history_skip`` skips such a
prompt at admission with a probability that grows with its streak of zero-variance
groups, and always lets it through with a floor probability so a prompt the policy has
grown into (or out of) can come back. The streak lives in the per-prompt pass-rate
estimator the ``est`` rule and adaptive waves use, so it is persisted with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pydantic import Field

from strategies.estimator import Estimator
from strategies.registry import Params, Policy, Registry


class AdmissionPolicy(Policy, ABC):
    """Decides, per prompt about to be admitted, the probability of skipping it."""

    scope = "prompt"

    @abstractmethod
    def skip_probability(self, history: Estimator, prompt_id: str) -> float:
        """Probability in [0, 1) of skipping ``prompt_id`` now, given its history."""


ADMISSIONS: Registry[AdmissionPolicy] = Registry("admission")


class HistorySkipParams(Params):
    #: Per zero-variance group of the streak, the chance a prompt is still admitted
    #: (before the max_skip cap): p_skip = 1 - explore ** streak.
    explore: float = Field(0.5, ge=0.0, le=1.0)
    #: Cap on p_skip, so every prompt keeps a 1 - max_skip chance of being sampled. At
    #: most 0.99, which bounds the expected draws per admission at 100.
    max_skip: float = Field(0.9, ge=0.0, le=0.99)


@ADMISSIONS.policy("history_skip", HistorySkipParams)
class HistorySkip(AdmissionPolicy):
    """p_skip = min(max_skip, 1 - explore ** streak), streak = consecutive finalized groups
    of the prompt with no correct or no incorrect answer."""

    params: HistorySkipParams

    def probability(self, streak: int) -> float:
        """p_skip for a streak of ``streak`` zero-variance groups (0 for no streak)."""
        return min(self.params.max_skip, 1.0 - self.params.explore**streak)

    def skip_probability(self, history: Estimator, prompt_id: str) -> float:
        return self.probability(history.streak(prompt_id))


def build(name: str, **params: Any) -> AdmissionPolicy:
    """Build the admission policy ``name``; bad parameters raise PolicyError."""
    return ADMISSIONS.build(name, **params)
