"""What a prompt is expected to cost before it runs: the answers its stopping rule takes at
its estimated pass rate.

Paced admission delays a prompt that would not finish within the staleness bound, and
what a prompt takes is set by its rule: Seq-Balance 2/2 stops after 4 answers at p = 0.5
and runs to n_max at p = 0.02. `expected_answers` walks the rule's own waves
(`StoppingRule.next_wave`) with each wave's positives drawn Binomial(wave, p), so every
rule is costed by the code that samples it. Adaptive waves are costed as for a prompt
the estimator has not seen (what that changes is the size of the first wave, not when
the rule holds).
"""

from __future__ import annotations

import math
from collections import defaultdict

from strategies.stopping import StoppingRule

#: Pass rates are costed on this grid (a cache of 51 entries per rule).
P_STEP = 0.02


def expected_answers(rule: StoppingRule, p: float, prompt_id: str | None = None) -> float:
    """Mean answers the rule draws for a prompt of pass rate `p`, whole waves counted
    (`prompt_id`: for a rule whose waves depend on the prompt, `per_prompt`)."""
    expected = 0.0
    # Probability of each (positives, negatives) the rule reaches, by answers so far.
    frontier: dict[tuple[int, int], float] = {(0, 0): 1.0}
    while frontier:
        later: defaultdict[tuple[int, int], float] = defaultdict(float)
        for (pos, neg), prob in frontier.items():
            wave = rule.next_wave(pos, neg, prompt_id=prompt_id)
            if wave == 0:
                expected += prob * (pos + neg)
                continue
            for k in range(wave + 1):
                pmf = math.comb(wave, k) * p**k * (1 - p) ** (wave - k)
                later[pos + k, neg + wave - k] += prob * pmf
        frontier = later
    return expected


class AnswerCosts:
    """`expected_answers` cached on a grid of pass rates, for one rule at a time (a new
    rule, after a config change, starts a new cache); a rule whose waves depend on the
    prompt (`per_prompt`: Est's budget) is costed per prompt, uncached."""

    def __init__(self) -> None:
        self._rule: StoppingRule | None = None
        self._cache: dict[int, float] = {}

    def __call__(self, rule: StoppingRule, p: float, prompt_id: str) -> float:
        key = round(p / P_STEP)
        if rule.per_prompt:
            return expected_answers(rule, key * P_STEP, prompt_id)
        if rule is not self._rule:
            self._rule, self._cache = rule, {}
        if (cost := self._cache.get(key)) is None:
            cost = self._cache[key] = expected_answers(rule, key * P_STEP)
        return cost
