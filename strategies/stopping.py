"""Stopping rules: how many more answers a prompt needs, given its counts so far.

The scheduler asks a prompt's rule after each completed wave. ``fixed`` is plain GRPO
(exactly group_size answers); ``positive`` and ``balanced`` are Reinforce-Ada's Seq-Pos
and Seq-Balance (keep sampling until K correct, or K correct and K incorrect, answers
exist); ``est`` pre-allocates a per-prompt budget N_x from the pass-rate estimator.
Every rule caps a prompt at n_max answers: the last wave is cut to fit.

Adaptive waves (positive and balanced only) size each wave to the answers expected to
satisfy the rule, ceil(max(m_pos / p, m_neg / (1 - p))), which cuts the overshoot of
fixed-size waves at the price of more, smaller waves. Under exact stopping a wave can
instead be cut where its answers become unlikely to be needed (``likely_needed``): the
chance that answer t + 1 counts is the chance that the t before it leave the rule open.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from fractions import Fraction
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from strategies.estimator import MAX_ANSWERS, Estimator
from strategies.registry import Params, Policy, PolicyError, Registry

StopReason = Literal["fixed", "budget", "rule", "n_max"]

# The stopping knobs' types with their bounds, the one definition of them: the rules'
# parameters below and the sampler's live config (so its API document) both use these,
# so no value is advertised that a rule then refuses.
KPos = Annotated[int, Field(ge=1, le=MAX_ANSWERS, description="correct answers to stop at")]
KNeg = Annotated[int, Field(ge=1, le=MAX_ANSWERS, description="incorrect answers to stop at")]
NMax = Annotated[int, Field(ge=1, le=MAX_ANSWERS, description="answers per prompt at most")]
WaveSize = Annotated[int, Field(ge=1, le=MAX_ANSWERS, description="answers per wave at most")]
GroupSize = Annotated[
    int, Field(ge=0, le=MAX_ANSWERS, description="answers kept per group; 0 keeps every sample")
]
Wave = Literal["fixed", "adaptive"]


class StoppingParams(Params):
    """Knobs of every rule; a rule ignores the ones it has no use for, so the service
    can pass its whole sampling config whatever the rule."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    k_pos: KPos = 2
    k_neg: KNeg = 2
    n_max: NMax = 32
    wave_size: WaveSize = 8
    group_size: GroupSize = 4
    wave: Wave = "fixed"
    estimator: Estimator | None = None


#: The stopping knobs' defaults, the one definition of them: the sampler's live config
#: starts from these too.
DEFAULTS = StoppingParams()


class StoppingRule(Policy, ABC):
    """Base rule: subclasses define ``done`` and how many answers they still want."""

    scope = "prompt"
    params: StoppingParams
    #: Whether the waves depend on the prompt beyond its answers (a per-prompt budget).
    per_prompt: ClassVar[bool] = False
    #: Whether it stops on which answers are right, not on their count alone.
    stops_on_outcomes: ClassVar[bool] = False

    def __init__(self, params: StoppingParams) -> None:
        super().__init__(params)
        self.validate()

    def validate(self) -> None:
        """Raise PolicyError (-> HTTP 422) naming the knob of an impossible config."""
        p = self.params
        for knob in ("group_size", "wave_size"):
            if getattr(p, knob) > p.n_max:
                raise PolicyError(
                    f"{knob} ({getattr(p, knob)}) must be <= n_max ({p.n_max})", field=knob
                )

    @abstractmethod
    def done(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> bool:
        """Whether the rule's own condition holds (n_max is not part of it)."""

    def next_wave(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> int:
        """Answers to request now: 0 once done or at n_max, else in
        [1, min(wave_size, n_max - n_generated)]."""
        n = n_pos + n_neg
        if n >= self.params.n_max or self.done(n_pos, n_neg, prompt_id=prompt_id):
            return 0
        want = self._want(n_pos, n_neg, prompt_id)
        return max(1, min(want, self.params.wave_size, self.params.n_max - n))

    def stop_reason(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> StopReason:
        """Why a finished prompt stopped: the rule held (it wins ties) or n_max was hit."""
        return "rule" if self.done(n_pos, n_neg, prompt_id=prompt_id) else "n_max"

    def likely_needed(
        self,
        n_pos: int,
        n_neg: int,
        want: int,
        *,
        keep: int,
        min_need: float,
        prompt_id: str | None = None,
    ) -> int:
        """Answer t + 1 of a wave is needed only if the t before it leave the rule open.
        The chance of that is the mass of the outcomes of t answers under which the rule
        is not done, each answer drawn from the pass rate's Beta belief (the estimator's
        posterior, or a uniform prior, updated by the prompt's answers so far and by the
        wave's earlier ones); the wave stops at the first answer past `keep` whose chance
        is below `min_need`. A rule that stops on its count alone needs every answer it
        wants."""
        if not self.stops_on_outcomes:
            return want
        est = self.params.estimator
        right_a, wrong_b = (
            est.posterior(prompt_id) if est is not None and prompt_id is not None else (1, 1)
        )
        right_a, wrong_b = right_a + n_pos, wrong_b + n_neg
        #: Right answers among the wave's first t -> chance of that with the rule open.
        still_open = {0: 1.0}
        t = 0
        while t < want and (t < keep or sum(still_open.values()) >= min_need):
            grown: dict[int, float] = {}
            for right, chance in still_open.items():
                p = (right_a + right) / (right_a + wrong_b + t)
                for k, q in ((right + 1, p), (right, 1.0 - p)):
                    if q > 0 and not self.done(n_pos + k, n_neg + t + 1 - k):
                        grown[k] = grown.get(k, 0.0) + chance * q
            still_open = grown
            t += 1
        return t

    @abstractmethod
    def _want(self, n_pos: int, n_neg: int, prompt_id: str | None) -> int:
        """Answers this rule would like before the wave_size and n_max caps."""


RULES: Registry[StoppingRule] = Registry("rule")


@RULES.policy("fixed", StoppingParams)
class Fixed(StoppingRule):
    """Plain GRPO: exactly group_size answers (waves never overshoot it)."""

    def validate(self) -> None:
        super().validate()
        if self.params.group_size == 0:
            raise PolicyError("rule 'fixed' needs group_size >= 1", field="group_size")

    def done(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> bool:
        return n_pos + n_neg >= self.params.group_size

    def stop_reason(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> StopReason:
        return "fixed"

    def _want(self, n_pos: int, n_neg: int, prompt_id: str | None) -> int:
        return self.params.group_size - (n_pos + n_neg)


class _CountRule(StoppingRule):
    """Rules that stop on counts of correct/incorrect answers (Seq-Pos, Seq-Balance)."""

    stops_on_outcomes = True

    @abstractmethod
    def _missing(self, n_pos: int, n_neg: int) -> tuple[int, int]:
        """(m_pos, m_neg): answers of each kind the rule still needs."""

    def _want(self, n_pos: int, n_neg: int, prompt_id: str | None) -> int:
        if self.params.wave == "fixed":
            return self.params.wave_size
        n = n_pos + n_neg
        est = self.params.estimator
        if n == 0 and est is not None and prompt_id is not None and est.seen(prompt_id):
            p = Fraction(est.p(prompt_id))  # exact, so ceil() below is not off by one
        else:
            p = Fraction(n_pos + 1, n + 2)
        m_pos, m_neg = self._missing(n_pos, n_neg)
        # A rate of exactly 0 (only reachable through a float estimate) means "unbounded".
        return max(
            math.ceil(m / q) if q > 0 else self.params.n_max
            for m, q in ((m_pos, p), (m_neg, 1 - p))
            if m > 0
        )


@RULES.policy("positive", StoppingParams)
class Positive(_CountRule):
    """Seq-Pos: stop at n_pos >= k_pos."""

    def validate(self) -> None:
        super().validate()
        p = self.params
        if p.k_pos > p.n_max:
            raise PolicyError(f"k_pos ({p.k_pos}) must be <= n_max ({p.n_max})", field="k_pos")

    def done(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> bool:
        return n_pos >= self.params.k_pos

    def _missing(self, n_pos: int, n_neg: int) -> tuple[int, int]:
        return max(0, self.params.k_pos - n_pos), 0


@RULES.policy("balanced", StoppingParams)
class Balanced(_CountRule):
    """Seq-Balance: stop at n_pos >= k_pos and n_neg >= k_neg."""

    def validate(self) -> None:
        super().validate()
        p = self.params
        if p.k_pos + p.k_neg > p.n_max:
            raise PolicyError(
                f"rule 'balanced' needs k_pos + k_neg <= n_max "
                f"(got {p.k_pos} + {p.k_neg} > {p.n_max})",
                field="k_pos",
            )

    def done(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> bool:
        return n_pos >= self.params.k_pos and n_neg >= self.params.k_neg

    def _missing(self, n_pos: int, n_neg: int) -> tuple[int, int]:
        return max(0, self.params.k_pos - n_pos), max(0, self.params.k_neg - n_neg)


@RULES.policy("est", StoppingParams)
class Est(StoppingRule):
    """Reinforce-Ada Est: generate the prompt's pre-allocated budget N_x (capped at n_max),
    of the estimator's ``budget_form``: the paper's c / sqrt(p + eps) by default, or the
    uncapped c / (p + eps).

    N_x is read from the estimator at each call, so a recalibration while the prompt is
    in flight applies to its remaining waves. ``wave: adaptive`` does not apply.
    """

    per_prompt = True

    def validate(self) -> None:
        super().validate()
        p = self.params
        if p.estimator is None:
            raise PolicyError("rule 'est' needs an estimator", field="estimator")
        est = p.estimator.params
        if not est.n_min <= est.mean_budget <= p.n_max:
            raise PolicyError(
                f"rule 'est' needs n_min <= mean_budget <= n_max "
                f"(got {est.n_min} <= {est.mean_budget} <= {p.n_max})",
                field="mean_budget",
            )

    def budget(self, prompt_id: str | None) -> int:
        """N_x for this prompt, capped at the rule's n_max."""
        if prompt_id is None:
            raise ValueError("rule 'est' needs prompt_id")
        assert self.params.estimator is not None  # validate() guarantees it
        return min(self.params.estimator.budget(prompt_id), self.params.n_max)

    def done(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> bool:
        return n_pos + n_neg >= self.budget(prompt_id)

    def stop_reason(self, n_pos: int, n_neg: int, *, prompt_id: str | None = None) -> StopReason:
        return "budget"

    def _want(self, n_pos: int, n_neg: int, prompt_id: str | None) -> int:
        return self.budget(prompt_id) - (n_pos + n_neg)


def build(name: str, **params: Any) -> StoppingRule:
    """Build the stopping rule ``name``; an impossible config raises PolicyError."""
    return RULES.build(name, **params)
