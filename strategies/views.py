"""Light read-only views that selection and reweighting policies take as input.

They hold plain numpy arrays, so both the service (when a group is finalized or a batch
frame forms) and the trainer side (applying a policy to groups it received) can build
them without any of the service's types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def _array(values: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(values, dtype=float).reshape(-1)


@dataclass(frozen=True, eq=False)
class GroupView:
    """One finalized prompt: its kept samples and every answer generated for it.

    ``rewards`` and ``lengths`` (response tokens) are per kept sample, in generation
    order; ``all_rewards`` covers every generated answer (kept ones included);
    a sample is positive iff its reward > ``threshold``.
    """

    rewards: np.ndarray
    lengths: np.ndarray
    all_rewards: np.ndarray
    threshold: float

    def __post_init__(self) -> None:
        for name in ("rewards", "lengths", "all_rewards"):
            object.__setattr__(self, name, _array(getattr(self, name)))
        if len(self.lengths) != len(self.rewards):
            raise ValueError(
                f"lengths ({len(self.lengths)}) and rewards ({len(self.rewards)}) differ"
            )

    @property
    def pass_rate(self) -> float:
        """n_pos / n_generated over all generated answers (0 for none)."""
        if len(self.all_rewards) == 0:
            return 0.0
        return float(np.mean(self.all_rewards > self.threshold))


@dataclass(frozen=True, eq=False)
class BatchGroup:
    """One group of a batch frame: per kept sample its advantage and token logprobs."""

    advantages: np.ndarray
    pass_rate: float
    token_logprobs: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        object.__setattr__(self, "advantages", _array(self.advantages))
        object.__setattr__(self, "token_logprobs", [_array(t) for t in self.token_logprobs])
        if self.token_logprobs and len(self.token_logprobs) != len(self.advantages):
            raise ValueError(
                f"token_logprobs ({len(self.token_logprobs)}) and advantages "
                f"({len(self.advantages)}) differ"
            )

    def take(self, indices: np.ndarray) -> BatchGroup:
        """The same group restricted to the samples at ``indices``."""
        idx = np.asarray(indices, dtype=np.int64)
        logprobs = [self.token_logprobs[i] for i in idx] if self.token_logprobs else []
        return BatchGroup(self.advantages[idx], self.pass_rate, logprobs)


@dataclass(frozen=True, eq=False)
class BatchView:
    """A batch frame: consecutive groups in ``batch_index`` order."""

    groups: list[BatchGroup]

    @property
    def n_samples(self) -> int:
        return sum(len(g.advantages) for g in self.groups)

    def take(self, kept: Sequence[np.ndarray]) -> BatchView:
        """The frame after a batch selection; a dropped group stays as an empty group,
        so positions still match ``batch_index``."""
        if len(kept) != len(self.groups):
            raise ValueError(f"{len(kept)} index arrays for {len(self.groups)} groups")
        return BatchView([g.take(k) for g, k in zip(self.groups, kept, strict=True)])
