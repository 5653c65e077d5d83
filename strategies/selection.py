"""Data-selection policies: which groups, and which samples within them, are trained on.

Unlike DataFlex-RL, which only zeroed loss weights, a dropped sample or group here leaves
the payload entirely, so it neither reaches the trainer nor shrinks the gradient through
the token-mean denominator.

Group scope (``select(GroupView) -> indices | None``) runs when a group is finalized, on
its kept samples; ``None`` drops the group. Advantages are computed by the caller on what
is returned, so ``maxvar`` and ``gfpo`` get advantages of the kept subset.
Batch scope (``select(BatchView) -> list of indices``) runs when a batch frame forms; an
empty array drops that group. Indices are ascending. Ties go to generation order.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Literal

import numpy as np
from pydantic import Field

from strategies.downsample import max_variance
from strategies.registry import Params, Policy, PolicyError, Registry
from strategies.views import BatchView, GroupView

#: A group left with fewer samples than this carries no within-group contrast.
MIN_GROUP_SIZE = 2


class GroupSelection(Policy, ABC):
    """A selection applied to one finalized group."""

    scope = "group"

    @abstractmethod
    def select(self, view: GroupView) -> np.ndarray | None:
        """Ascending indices into the kept samples, or None to drop the group."""


class BatchSelection(Policy, ABC):
    """A selection applied to a whole batch frame."""

    scope = "batch"

    @abstractmethod
    def select(self, batch: BatchView) -> list[np.ndarray]:
        """Per group, ascending indices of the samples kept; empty drops the group."""


SELECTIONS: Registry[GroupSelection | BatchSelection] = Registry("selection")


def _all(view: GroupView) -> np.ndarray:
    return np.arange(len(view.rewards))


@SELECTIONS.policy("nonzero_std")
class NonzeroStd(GroupSelection):
    """DAPO dynamic sampling: drop groups whose kept rewards are all equal (no signal)."""

    def select(self, view: GroupView) -> np.ndarray | None:
        if len(view.rewards) == 0 or np.ptp(view.rewards) == 0:
            return None
        return _all(view)


class DiffFilterParams(Params):
    low: float = Field(0.2, ge=0.0, le=1.0)
    high: float = Field(0.8, ge=0.0, le=1.0)


@SELECTIONS.policy("difffilter", DiffFilterParams)
class DiffFilter(GroupSelection):
    """Keep a group iff low < pass rate < high, the pass rate over all its answers."""

    params: DiffFilterParams

    def __init__(self, params: DiffFilterParams) -> None:
        super().__init__(params)
        if params.low >= params.high:
            raise PolicyError(
                f"difffilter needs low < high (got {params.low} >= {params.high})", field="high"
            )

    def select(self, view: GroupView) -> np.ndarray | None:
        return _all(view) if self.params.low < view.pass_rate < self.params.high else None


class MaxVarParams(Params):
    keep_fraction: float = Field(0.5, gt=0.0, le=1.0)


@SELECTIONS.policy("maxvar", MaxVarParams)
class MaxVar(GroupSelection):
    """PODS: keep the m = max(2, round_half_up(keep_fraction * n)) samples of maximal
    reward variance among the n kept."""

    params: MaxVarParams

    def select(self, view: GroupView) -> np.ndarray | None:
        n = len(view.rewards)
        m = max(MIN_GROUP_SIZE, math.floor(self.params.keep_fraction * n + 0.5))
        return np.asarray(max_variance(view.rewards, min(m, n)), dtype=np.int64)


class GfpoParams(Params):
    k: int = Field(3, ge=1)
    metric: Literal["efficiency", "short"] = "efficiency"


@SELECTIONS.policy("gfpo", GfpoParams)
class Gfpo(GroupSelection):
    """GFPO: keep the top-k samples by reward per token (``efficiency``) or the k
    shortest (``short``), curbing length growth."""

    params: GfpoParams

    def select(self, view: GroupView) -> np.ndarray | None:
        if self.params.metric == "efficiency":
            key = -view.rewards / np.maximum(view.lengths, 1.0)
        else:
            key = view.lengths
        order = np.argsort(key, kind="stable")
        return np.sort(order[: self.params.k])


class TopKParams(Params):
    fraction: float = Field(0.5, gt=0.0, le=1.0)


@SELECTIONS.policy("topk", TopKParams)
class TopK(BatchSelection):
    """Keep the max(1, round_half_up(fraction * S)) samples of the frame's S with the
    largest |advantage| (ties by batch_index, then sample order). Advantages are not
    recomputed; a group left with fewer than 2 samples is dropped."""

    params: TopKParams

    def select(self, batch: BatchView) -> list[np.ndarray]:
        sizes = [len(g.advantages) for g in batch.groups]
        if sum(sizes) == 0:
            return [np.zeros(0, dtype=np.int64) for _ in sizes]
        # Flattened in (batch_index, sample) order, so a stable sort breaks ties by it.
        magnitude = np.abs(np.concatenate([g.advantages for g in batch.groups]))
        keep = max(1, math.floor(self.params.fraction * len(magnitude) + 0.5))
        chosen = np.zeros(len(magnitude), dtype=bool)
        chosen[np.argsort(-magnitude, kind="stable")[:keep]] = True
        kept = []
        for mask in np.split(chosen, np.cumsum(sizes)[:-1]):
            idx = np.flatnonzero(mask)
            kept.append(idx if len(idx) >= MIN_GROUP_SIZE else np.zeros(0, dtype=np.int64))
        return kept


def build(name: str, **params: Any) -> GroupSelection | BatchSelection:
    """Build the selection policy ``name`` (check ``.scope`` for where it applies)."""
    return SELECTIONS.build(name, **params)
