"""Reweighting policies: loss weights for the samples (or tokens) of a batch frame.

Sample-scope policies (``per``, ``softmax``, ``diffband``) give each sample a positive
raw weight; token-scope ones (``ar``) give each response token one. :func:`combine`
multiplies the policies of each scope and renormalizes to mean 1 over the frame (tokens:
over all its valid tokens), so reweighting moves emphasis without changing the loss scale.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from strategies.registry import Params, Policy, PolicyError, Registry
from strategies.views import BatchView

#: Keeps per's weight of a zero-advantage sample positive.
_PER_EPS = 1e-8


class SampleReweighting(Policy, ABC):
    """A policy weighting each sample of a frame."""

    scope = "batch"

    @abstractmethod
    def sample_weights(self, batch: BatchView) -> list[np.ndarray]:
        """Positive raw weight per sample, one array per group (any scale)."""


class TokenReweighting(Policy, ABC):
    """A policy weighting each response token of a frame."""

    scope = "token"

    @abstractmethod
    def token_weights(self, batch: BatchView) -> list[list[np.ndarray]]:
        """Positive raw weight per token, per sample, per group (any scale)."""


REWEIGHTINGS: Registry[SampleReweighting | TokenReweighting] = Registry("reweighting")


class PerParams(Params):
    alpha: float = Field(0.5, ge=0.0)


@REWEIGHTINGS.policy("per", PerParams)
class Per(SampleReweighting):
    """Prioritized replay: w = (|A| + 1e-8) ** alpha."""

    params: PerParams

    def sample_weights(self, batch: BatchView) -> list[np.ndarray]:
        return [(np.abs(g.advantages) + _PER_EPS) ** self.params.alpha for g in batch.groups]


class SoftmaxParams(Params):
    temperature: float = Field(1.0, gt=0.0)


@REWEIGHTINGS.policy("softmax", SoftmaxParams)
class Softmax(SampleReweighting):
    """w proportional to exp(|A| / temperature) over the frame."""

    params: SoftmaxParams

    def sample_weights(self, batch: BatchView) -> list[np.ndarray]:
        peak = max(
            (float(np.abs(g.advantages).max()) for g in batch.groups if len(g.advantages)),
            default=0.0,
        )
        # Shifting by the frame's peak changes no ratio and keeps exp() from overflowing.
        return [
            np.exp((np.abs(g.advantages) - peak) / self.params.temperature) for g in batch.groups
        ]


class DiffBandParams(Params):
    low_q: float = Field(0.25, ge=0.0, le=1.0)
    high_q: float = Field(0.75, ge=0.0, le=1.0)
    focus_weight: float = Field(2.0, gt=0.0)


@REWEIGHTINGS.policy("diffband", DiffBandParams)
class DiffBand(SampleReweighting):
    """Emphasize mid-difficulty groups: focus_weight for a group whose pass rate lies in
    [quantile(low_q), quantile(high_q)] of the frame's group pass rates, else 1.

    DataFlex-RL banded raw binary rewards, which is a no-op; the band is over pass rates.
    """

    params: DiffBandParams

    def __init__(self, params: DiffBandParams) -> None:
        super().__init__(params)
        if params.low_q > params.high_q:
            raise PolicyError(
                f"diffband needs low_q <= high_q (got {params.low_q} > {params.high_q})",
                field="high_q",
            )

    def sample_weights(self, batch: BatchView) -> list[np.ndarray]:
        if not batch.groups:
            return []
        rates = np.array([g.pass_rate for g in batch.groups])
        lo, hi = np.quantile(rates, [self.params.low_q, self.params.high_q])
        return [
            np.full(len(g.advantages), self.params.focus_weight if lo <= rate <= hi else 1.0)
            for g, rate in zip(batch.groups, rates, strict=True)
        ]


class ArParams(Params):
    alpha: float = Field(0.5, ge=0.0, le=1.0)


@REWEIGHTINGS.policy("ar", ArParams)
class Ar(TokenReweighting):
    """Token weights from the sampler's own probabilities: w_t = alpha p_t + 1 - alpha."""

    params: ArParams

    def token_weights(self, batch: BatchView) -> list[list[np.ndarray]]:
        alpha = self.params.alpha
        for g in batch.groups:
            if len(g.token_logprobs) != len(g.advantages):
                raise ValueError("reweighting 'ar' needs token_logprobs for every sample")
        return [
            [alpha * np.exp(lp) + (1.0 - alpha) for lp in g.token_logprobs] for g in batch.groups
        ]


def build(name: str, **params: Any) -> SampleReweighting | TokenReweighting:
    """Build the reweighting policy ``name`` (check ``.scope``: "batch" or "token")."""
    return REWEIGHTINGS.build(name, **params)


def _mean_one_scale(parts: Iterable[np.ndarray]) -> float:
    """The factor that gives the concatenation of ``parts`` mean 1 (1 if it is empty)."""
    arrays = list(parts)
    count = sum(len(a) for a in arrays)
    return count / sum(float(a.sum()) for a in arrays) if count else 1.0


def combine(
    policies: Sequence[SampleReweighting | TokenReweighting], batch: BatchView
) -> tuple[list[np.ndarray], list[list[np.ndarray]] | None]:
    """Apply every policy to the frame and return (sample_weights, token_weights).

    Weights of one scope multiply, then are renormalized to mean 1 over the frame's
    samples (tokens: over all its valid tokens). With no sample-scope policy every sample
    weight is 1; with no token-scope policy token_weights is None.
    """
    samples = [np.ones(len(g.advantages)) for g in batch.groups]
    tokens: list[list[np.ndarray]] | None = None
    for policy in policies:
        if isinstance(policy, SampleReweighting):
            samples = [s * w for s, w in zip(samples, policy.sample_weights(batch), strict=True)]
        elif tokens is None:
            tokens = policy.token_weights(batch)
        else:
            tokens = [
                [t * w for t, w in zip(ts, ws, strict=True)]
                for ts, ws in zip(tokens, policy.token_weights(batch), strict=True)
            ]
    scale = _mean_one_scale(samples)
    samples = [s * scale for s in samples]
    if tokens is not None:
        scale = _mean_one_scale(t for ts in tokens for t in ts)
        tokens = [[t * scale for t in ts] for ts in tokens]
    return samples, tokens
