"""One admitted prompt while it is sampled: its plan, its answers so far and their
verdicts, and what its stopping rule and allocation budget make of them."""

from __future__ import annotations

from dataclasses import dataclass, field

from sampler_service.backends.base import Completion
from sampler_service.dataset import PromptRow
from sampler_service.live_config import PromptPlan
from sampler_service.verifiers.base import Verdict
from strategies.allocation import AllocationPolicy
from strategies.estimator import Estimator
from strategies.stopping import StopReason


@dataclass
class PromptRun:
    row: PromptRow
    plan: PromptPlan
    #: The allocation policy at admission and the history it reads (the estimator).
    allocation: AllocationPolicy | None = None
    history: Estimator | None = None
    completions: list[Completion] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    outcomes: list[bool] = field(default_factory=list)  # positive or not, in order
    n_pos: int = 0
    n_neg: int = 0
    done: bool = False
    #: Set when the allocation budget, not the rule or n_max, ended the prompt.
    cut: bool = False
    #: The allocation budget when last asked (None without a policy).
    budget: int | None = None
    #: Environment failures met by this prompt's episodes (each one re-run).
    env_errors: int = 0

    @property
    def n_generated(self) -> int:
        return self.n_pos + self.n_neg

    def next_wave(self) -> int:
        """The rule's next wave, cut to what is left of the allocation budget."""
        want = self.plan.rule.next_wave(self.n_pos, self.n_neg, prompt_id=self.row.id)
        if want == 0 or self.allocation is None or self.history is None:
            return want
        self.budget = self.allocation.budget(
            self.history, self.row.id, self.outcomes, self.plan.cfg.n_max
        )
        room = max(self.budget - self.n_generated, 0)
        self.cut = room == 0
        return min(want, room)

    def stop_reason(self) -> StopReason:
        """`budget` when the allocation stopped it, else the rule's reason."""
        if self.cut:
            return "budget"
        return self.plan.rule.stop_reason(self.n_pos, self.n_neg, prompt_id=self.row.id)
