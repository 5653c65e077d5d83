"""Pure policy math for adaptive rollout sampling: stopping rules, answer allocation,
down-sampling, advantages, selection, reweighting and domain mixing, on numpy arrays (no
I/O)."""

from strategies import (
    admission,
    advantage,
    allocation,
    downsample,
    estimator,
    mixing,
    registry,
    reweighting,
    selection,
    stopping,
    views,
)
from strategies.registry import PolicyError

__all__ = [
    "PolicyError",
    "admission",
    "advantage",
    "allocation",
    "downsample",
    "estimator",
    "mixing",
    "registry",
    "reweighting",
    "selection",
    "stopping",
    "views",
]
