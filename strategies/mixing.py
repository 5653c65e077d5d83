"""Domain mixing: the target share of each domain among newly admitted prompts.

A mixer observes every finalized group with its domain label (DataFlex-RL's mixers never
saw labels, so they always returned equal shares) and turns windowed per-domain
statistics into target proportions:

- ``static``: fixed proportions (uniform by default);
- ``reward_gap``: softmax((max_d m - m_d) / T), m_d the windowed mean reward, so lagging
  domains get more;
- ``dump_ucb``: softmax(UCB_d / T), UCB_d = v_d + c sqrt(2 ln(N + 1) / (n_d + 1)), v_d the
  windowed mean |A|, n_d the domain's real cumulative group count, N = sum n_d;
- ``tscl``: softmax(|slope_d| / T), slope_d the least-squares slope of the domain's group
  mean rewards over its window with positions scaled to [0, 1] (learning progress).

Before ``warmup`` finalized groups the learned mixers' targets are uniform; after it they
are recomputed every ``update_every`` groups. A domain with no data yet ties for the
largest share. Every share is at least ``floor``. :class:`DeficitAdmitter` turns targets into a deterministic
admission sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from strategies.registry import Params, Policy, PolicyError, Registry


def apply_floor(shares: np.ndarray, floor: float) -> np.ndarray:
    """Raise shares below ``floor`` to it and rescale the others to sum 1 - k * floor,
    repeating until none is below (needs len(shares) * floor <= 1)."""
    out = np.asarray(shares, dtype=float) / float(np.sum(shares))
    pinned = np.zeros(len(out), dtype=bool)
    while True:
        low = ~pinned & (out < floor)
        if not low.any():
            return out
        pinned |= low
        out[pinned] = floor
        free = ~pinned
        if free.any():
            out[free] *= (1.0 - pinned.sum() * floor) / out[free].sum()


def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max())
    shares: np.ndarray = z / z.sum()
    return shares


class MixerParams(Params):
    """Knobs every mixer has."""

    domains: list[str] = Field(min_length=1)
    floor: float = Field(0.05, ge=0.0, le=1.0)
    warmup: int = Field(32, ge=0)
    update_every: int = Field(8, ge=1)
    window: int = Field(64, ge=1)


class Mixer(Policy, ABC):
    """Collects per-domain group statistics and maintains target proportions."""

    scope = "domain"
    params: MixerParams

    def __init__(self, params: MixerParams) -> None:
        super().__init__(params)
        self.domains = list(params.domains)
        if len(set(self.domains)) != len(self.domains):
            raise PolicyError(f"duplicate domains in {self.domains}", field="domains")
        if len(self.domains) * params.floor > 1.0:
            raise PolicyError(
                f"floor {params.floor} x {len(self.domains)} domains exceeds 1", field="floor"
            )
        self._rewards: dict[str, deque[float]] = {
            d: deque(maxlen=params.window) for d in self.domains
        }
        self._adv: dict[str, deque[float]] = {d: deque(maxlen=params.window) for d in self.domains}
        self._counts = dict.fromkeys(self.domains, 0)
        self._total = 0
        self._targets = self._refresh()

    def observe(self, domain: str, reward_mean: float, adv_abs_mean: float) -> None:
        """Record one finalized (or dropped) group: its mean reward over all generated
        answers and its mean |advantage| over the kept ones."""
        if domain not in self._counts:
            raise PolicyError(f"unknown domain {domain!r}; known: {self.domains}", field="domain")
        self._rewards[domain].append(float(reward_mean))
        self._adv[domain].append(float(adv_abs_mean))
        self._counts[domain] += 1
        self._total += 1
        since = self._total - self.params.warmup
        if since >= 0 and since % self.params.update_every == 0:
            self._targets = self._refresh()

    def proportions(self) -> dict[str, float]:
        """Current target shares: they sum to 1 and each is >= floor."""
        return dict(self._targets)

    def counts(self) -> dict[str, int]:
        """Cumulative groups observed per domain."""
        return dict(self._counts)

    def _refresh(self) -> dict[str, float]:
        """Floored targets from the current statistics."""
        floored = apply_floor(self._shares(), self.params.floor)
        return dict(zip(self.domains, floored.tolist(), strict=True))

    @abstractmethod
    def _shares(self) -> np.ndarray:
        """Unfloored target shares in domain order (any positive scale)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable statistics and current targets."""
        return {
            "total": self._total,
            "counts": dict(self._counts),
            "rewards": {d: list(w) for d, w in self._rewards.items()},
            "adv": {d: list(w) for d, w in self._adv.items()},
            "targets": dict(self._targets),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; domains no longer configured are ignored, new
        ones start empty (then the targets are recomputed)."""
        self._total = int(state["total"])
        for d in self.domains:
            self._counts[d] = int(state["counts"].get(d, 0))
            self._rewards[d].clear()
            self._rewards[d].extend(state["rewards"].get(d, []))
            self._adv[d].clear()
            self._adv[d].extend(state["adv"].get(d, []))
        saved = state["targets"]
        same = set(saved) == set(self.domains)
        self._targets = {d: float(saved[d]) for d in self.domains} if same else self._refresh()


MIXERS: Registry[Mixer] = Registry("mixing")


class StaticParams(MixerParams):
    proportions: dict[str, float] | None = None


@MIXERS.policy("static", StaticParams)
class Static(Mixer):
    """Fixed proportions (uniform if none are given), floored; no warmup applies."""

    params: StaticParams

    def __init__(self, params: StaticParams) -> None:
        given = params.proportions
        if given is not None:
            unknown = sorted(set(given) - set(params.domains))
            if unknown:
                raise PolicyError(f"proportions for unknown domains {unknown}", field="proportions")
            if any(v < 0 for v in given.values()) or sum(given.values()) <= 0:
                raise PolicyError(
                    "proportions must be >= 0 with a positive sum", field="proportions"
                )
        super().__init__(params)

    def _shares(self) -> np.ndarray:
        given = self.params.proportions
        return np.array([given.get(d, 0.0) if given else 1.0 for d in self.domains])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the statistics; the targets always come from the configured proportions."""
        super().load_state_dict(state)
        self._targets = self._refresh()


class LearnedMixer(Mixer):
    """A mixer scoring domains from their statistics: uniform during warmup, then
    softmax of per-domain logits; a domain without enough data ties for the top logit."""

    #: Observations in its window a domain needs before it can be scored.
    min_points = 1

    def _shares(self) -> np.ndarray:
        scored = [d for d in self.domains if len(self._rewards[d]) >= self.min_points]
        if self._total < self.params.warmup or not scored:
            return np.ones(len(self.domains))
        logits = dict(zip(scored, self._logits(scored).tolist(), strict=True))
        top = max(logits.values())
        return _softmax(np.array([logits.get(d, top) for d in self.domains]))

    @abstractmethod
    def _logits(self, scored: list[str]) -> np.ndarray:
        """Softmax logits of the domains in ``scored`` (non-empty), in that order."""


class RewardGapParams(MixerParams):
    temperature: float = Field(0.2, gt=0.0)


@MIXERS.policy("reward_gap", RewardGapParams)
class RewardGap(LearnedMixer):
    """More prompts for domains whose windowed mean reward lags the best domain's."""

    params: RewardGapParams

    def _logits(self, scored: list[str]) -> np.ndarray:
        means = np.array([np.mean(self._rewards[d]) for d in scored])
        logits: np.ndarray = (means.max() - means) / self.params.temperature
        return logits


class DumpUcbParams(MixerParams):
    temperature: float = Field(0.5, gt=0.0)
    c: float = Field(1.0, ge=0.0)


@MIXERS.policy("dump_ucb", DumpUcbParams)
class DumpUcb(LearnedMixer):
    """UCB bandit over domains: value = windowed mean |A| (how much the domain still
    teaches) plus an exploration bonus from the real visit counts."""

    params: DumpUcbParams

    def _logits(self, scored: list[str]) -> np.ndarray:
        total = sum(self._counts.values())
        ucb = np.array(
            [
                np.mean(self._adv[d])
                + self.params.c * np.sqrt(2.0 * np.log(total + 1) / (self._counts[d] + 1))
                for d in scored
            ]
        )
        return ucb / self.params.temperature


class TsclParams(MixerParams):
    temperature: float = Field(0.1, gt=0.0)


@MIXERS.policy("tscl", TsclParams)
class Tscl(LearnedMixer):
    """Teacher-student curriculum: favor domains whose reward is changing fastest
    (up or down), i.e. where the policy is learning or forgetting."""

    params: TsclParams
    min_points = 2  # a slope needs two points

    def slope(self, domain: str) -> float:
        """Least-squares slope of the window's group rewards against position in [0, 1]."""
        y = np.array(self._rewards[domain])
        x = np.linspace(0.0, 1.0, len(y))
        dx = x - x.mean()
        return float(dx @ (y - y.mean()) / (dx @ dx))

    def _logits(self, scored: list[str]) -> np.ndarray:
        return np.array([abs(self.slope(d)) for d in scored]) / self.params.temperature


def build(name: str, domains: Sequence[str], **params: Any) -> Mixer:
    """Build the mixer ``name`` over ``domains`` (their order breaks ties)."""
    return MIXERS.build(name, domains=list(domains), **params)


class DeficitAdmitter:
    """Deterministic admission that tracks target shares (no random draws).

    Each admission goes to the available domain furthest behind its target over the last
    ``window`` admissions: the largest target x (n + 1) - admitted, n the admissions in
    the window; ties go to domain order. Realized shares converge to the targets.
    """

    def __init__(self, domains: Iterable[str], window: int = 200) -> None:
        self.domains = list(domains)
        if not self.domains:
            raise PolicyError("DeficitAdmitter needs at least one domain", field="domains")
        if window < 1:
            raise PolicyError(f"window must be >= 1, got {window}", field="window")
        self._history: deque[str] = deque(maxlen=window)
        self._counts: Counter[str] = Counter()

    def choose(self, targets: dict[str, float], available: set[str] | None = None) -> str:
        """Pick (and record) the domain of the next admitted prompt.

        ``available`` restricts the choice (e.g. to domains with prompts left); a domain
        missing from ``targets`` has target 0.
        """
        unknown = sorted(set(targets) - set(self.domains))
        if unknown:
            raise PolicyError(f"targets for unknown domains {unknown}", field="domain")
        candidates = [d for d in self.domains if available is None or d in available]
        if not candidates:
            raise ValueError("no domain is available for admission")
        n = len(self._history)
        choice = max(candidates, key=lambda d: targets.get(d, 0.0) * (n + 1) - self._counts[d])
        self.record(choice)
        return choice

    def record(self, domain: str) -> None:
        """Count one admission from ``domain``."""
        if domain not in self.domains:
            raise PolicyError(f"unknown domain {domain!r}", field="domain")
        if len(self._history) == self._history.maxlen:
            self._counts[self._history[0]] -= 1
        self._history.append(domain)
        self._counts[domain] += 1

    def shares(self) -> dict[str, float]:
        """Realized shares over the window (all 0 before the first admission)."""
        n = len(self._history)
        return {d: (self._counts[d] / n if n else 0.0) for d in self.domains}

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable admission window."""
        return {"history": list(self._history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the window, skipping domains no longer configured."""
        self._history.clear()
        self._counts.clear()
        for domain in state["history"]:
            if domain in self.domains:
                self.record(domain)
