"""Down-sampling a prompt's generated answers to the training group size n.

Adaptive sampling generates more answers than the group keeps; which ones are kept decides
the signal. ``balanced`` is Reinforce-Ada's choice (as many positives as negatives where
possible), ``max_variance`` is PODS' (the subset whose rewards spread the most), ``none``
keeps everything. All return ascending indices into the answers given; ``n == 0``
(or n at least the number of answers) keeps all of them. Ties go to the order the answers
are given in (the service gives the newest weights' answers first).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from strategies.registry import NoParams, Registry

Rewards = Sequence[float] | np.ndarray
Downsampler = Callable[[Rewards, int, float], list[int]]

DOWNSAMPLERS: Registry[Downsampler] = Registry("downsample")


def _keeps_all(size: int, n: int) -> bool:
    if n < 0:
        raise ValueError(f"group size must be >= 0, got {n}")
    return n == 0 or n >= size


def balanced(rewards: Rewards, n: int, threshold: float) -> list[int]:
    """Reinforce-Ada balanced down-sampling.

    Take tp = min(floor(n/2), |pos|) positives and tn = min(n - tp, |neg|) negatives,
    then fill up to n from the remaining positives, then the remaining negatives, each in
    the order given. A sample is positive iff its reward > threshold (strict).
    """
    values = np.asarray(rewards, dtype=float)
    if _keeps_all(len(values), n):
        return list(range(len(values)))
    pos = [i for i, r in enumerate(values) if r > threshold]
    neg = [i for i, r in enumerate(values) if not r > threshold]
    tp = min(n // 2, len(pos))
    tn = min(n - tp, len(neg))
    fill = (pos[tp:] + neg[tn:])[: n - tp - tn]
    return sorted(pos[:tp] + neg[:tn] + fill)


def max_variance(rewards: Rewards, n: int, threshold: float = 0.0) -> list[int]:
    """The n-subset of maximal reward variance (PODS).

    Some optimal subset is always the i largest plus the n - i smallest rewards, so only
    n + 1 candidates are compared. Within equal rewards the earlier answer is taken, and
    among candidates of equal variance the one first in the order given (smallest
    sorted index list) wins. ``threshold`` is unused; it keeps the downsampler signature.
    """
    values = np.asarray(rewards, dtype=float)
    if _keeps_all(len(values), n):
        return list(range(len(values)))
    ascending = sorted(range(len(values)), key=lambda i: (values[i], i))
    descending = sorted(range(len(values)), key=lambda i: (-values[i], i))
    best: list[int] = []
    best_var = -math.inf
    for top in range(n + 1):
        bottom = ascending[: n - top]
        taken = set(bottom)
        high = [i for i in descending if i not in taken][:top]
        subset = sorted(bottom + high)
        var = float(np.var(values[subset]))
        tie = math.isclose(var, best_var, rel_tol=1e-12, abs_tol=1e-15)
        if (var > best_var and not tie) or (tie and subset < best):
            best, best_var = subset, var
    return best


def none(rewards: Rewards, n: int, threshold: float = 0.0) -> list[int]:
    """Keep every generated answer (Est trains on all of them)."""
    return list(range(len(rewards)))


DOWNSAMPLERS.add("balanced", NoParams, lambda _params: balanced, scope="group")
DOWNSAMPLERS.add("max_variance", NoParams, lambda _params: max_variance, scope="group")
DOWNSAMPLERS.add("none", NoParams, lambda _params: none, scope="group")


def apply(name: str, rewards: Rewards, n: int, threshold: float) -> list[int]:
    """Down-sample with the method registered as ``name``."""
    return DOWNSAMPLERS.build(name)(rewards, n, threshold)
