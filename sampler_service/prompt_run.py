"""One admitted prompt while it is sampled: its plan, its answers so far and their
verdicts, and what its stopping rule and allocation budget make of them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sampler_service.backends.base import Completion
from sampler_service.dataset import PromptRow
from sampler_service.grouping import kept_version_min, new_id, sampled_tokens
from sampler_service.live_config import PromptPlan
from sampler_service.verifiers.base import Verdict
from strategies.allocation import AllocationPolicy
from strategies.estimator import MAX_ANSWERS, QUARTILES, UNSEEN, Estimator
from strategies.stopping import StopReason


@dataclass
class PromptRun:
    """A prompt's answers are indexed in the order they were issued; they are counted in
    that order, whatever order they finish in (`arrived`, then `count_arrived`). Under
    exact stopping the rule is asked after each counted answer from `min_answers` on,
    so the prompt stops at the first index where it holds, as under sequential sampling;
    under wave stopping it is asked when a whole wave is counted."""

    row: PromptRow
    plan: PromptPlan
    #: The allocation policy at admission and the history it reads (the estimator).
    allocation: AllocationPolicy | None = None
    history: Estimator | None = None
    #: Tokens it was expected to decode when admitted (paced admission; 0 unpaced).
    expected_tokens: float = 0.0
    #: Its place in the order prompts were admitted in, and the weight version served
    #: then (0 for one resumed after a restart: the oldest).
    admitted: int = 0
    admitted_version: int = 0
    #: This admission of the prompt: the answer journal's key, and its group's id.
    attempt_id: str = field(default_factory=new_id)
    #: The counted answers, in index order (1..j).
    completions: list[Completion] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    outcomes: list[bool] = field(default_factory=list)  # positive or not, in order
    n_pos: int = 0
    n_neg: int = 0
    #: Answers issued so far: the next one's index.
    issued: int = 0
    #: Indices below `issued` to draw again first: a restart resumed the prompt without
    #: them (they were decoding, or not yet stored, when it stopped).
    redo: list[int] = field(default_factory=list)
    #: Verified answers above the counted ones, by index, waiting for those below.
    waiting: dict[int, tuple[Completion, Verdict]] = field(default_factory=dict)
    #: The rule held on the counted answers: the prompt takes no more.
    stopped: bool = False
    done: bool = False
    #: Set when the allocation budget, not the rule or n_max, ended the prompt.
    cut: bool = False
    #: The allocation budget when last asked (None without a policy).
    budget: int | None = None
    #: Environment failures met by this prompt's episodes (each one re-run).
    env_errors: int = 0
    #: Sampled tokens of counted answers the tally has recorded as decoded (those of
    #: finished waves).
    recorded_tokens: int = 0
    #: `group_version_min` as of how many counted answers (a hold asks it every poll).
    _kept_version: tuple[int, int | None] = (0, None)

    @property
    def n_generated(self) -> int:
        return self.n_pos + self.n_neg

    @property
    def exact(self) -> bool:
        return self.plan.cfg.counts_in_order

    @property
    def min_answers(self) -> int:
        """Answers counted before exact stopping asks the rule (`min_answers`, else the
        group size: no group is smaller than what down-sampling keeps)."""
        cfg = self.plan.cfg
        return min(cfg.min_answers or cfg.group_size, cfg.n_max)

    def quartile(self) -> str:
        """Its pass-rate bin in the history it was admitted with (`Estimator.quartile`)."""
        return self.history.quartile(self.row.id) if self.history is not None else UNSEEN

    def priorities(self, indices: Sequence[int]) -> tuple[int, ...]:
        """The engine priorities of its answers `indices` (`engine_priority`)."""
        order = self.plan.cfg.engine_order
        if order == "oldest_prompt":
            return (self.admitted,) * len(indices)
        if order == "answer_index":
            return tuple(self.admitted_version * MAX_ANSWERS + i for i in indices)
        return ()

    def group_version_min(self) -> int | None:
        """The `policy_version_min` its group would have if it ended on the answers
        counted so far (`grouping.kept_version_min`; None before the first): what decides
        whether the staleness bound drops it."""
        counted, version = self._kept_version
        if counted != len(self.completions):
            version = kept_version_min(self.plan.cfg, self.completions, self.verdicts)
            self._kept_version = (len(self.completions), version)
        return version

    def sampled_tokens(self) -> int:
        """Sampled tokens of the counted answers."""
        return sum(sampled_tokens(c.token_ids, c.loss_mask) for c in self.completions)

    def next_wave(self) -> int:
        """The rule's next wave, cut to what is left of the allocation budget."""
        return self._budgeted(
            self.plan.rule.next_wave(self.n_pos, self.n_neg, prompt_id=self.row.id)
        )

    def _budgeted(self, want: int) -> int:
        """`want` cut to what is left of the allocation budget (asked anew: it reads the
        outcomes so far)."""
        if want == 0 or self.allocation is None or self.history is None:
            return want
        self.budget = self.allocation.budget(
            self.history, self.row.id, self.outcomes, self.plan.cfg.n_max
        )
        room = max(self.budget - self.n_generated, 0)
        self.cut = room == 0
        return min(want, room)

    def wave_size(self) -> int:
        """Answers to issue next; 0 once the prompt is finished. Exact stopping asks the
        rule only from `min_answers` on, so it issues at least up to there, cuts the wave
        where its answers become unlikely to be needed (`wave_min_need`), and widens a
        hard prompt's waves (`_hard_wave`); the allocation budget bounds every wave. Wave
        sizes only decide which indices decode at once: the group stays the first j."""
        if self.stopped:
            return 0
        rule, cfg = self.plan.rule, self.plan.cfg
        want = rule.next_wave(self.n_pos, self.n_neg, prompt_id=self.row.id)
        if self.exact and self.n_generated < self.min_answers:
            want = max(want, self.min_answers - self.n_generated)
        if want and self.exact and cfg.wave_min_need > 0:
            want = rule.likely_needed(
                self.n_pos,
                self.n_neg,
                want,
                keep=max(self.min_answers - self.n_generated, 1),
                min_need=cfg.wave_min_need,
                prompt_id=self.row.id,
            )
        if want and (hard := self._hard_wave()):
            want = max(want, min(hard, cfg.n_max - self.n_generated))
        return self._budgeted(want)

    def _hard_wave(self) -> int | None:
        """`hard_wave_size` under exact stopping for a prompt the estimator puts in the
        hardest quartile, else None. Those run the most waves one after another, each as
        long as its longest answer, which makes them the last to finish a step and the
        first to outlive the staleness bound; a wider wave only adds indices, so the group
        stays what sequential sampling forms."""
        hard = self.plan.cfg.hard_wave_size
        if hard is None or not self.exact or self.history is None:
            return None
        return hard if self.quartile() == QUARTILES[0] else None

    def _holds(self) -> bool:
        """Exact stopping: the prompt stops at the answer just counted (the rule holds
        from `min_answers` on, or n_max or the allocation budget is reached)."""
        if self.n_generated >= self.min_answers:
            return self.next_wave() == 0
        return self._budgeted(1) == 0

    def arrived(self, index: int, completion: Completion, verdict: Verdict) -> None:
        """A verified answer, counted once every answer below it is."""
        self.waiting[index] = (completion, verdict)

    def count_arrived(self) -> bool:
        """Count the waiting answers that continue the counted ones, in index order;
        True once the prompt stops (exact: at the first index from `min_answers` on
        where the rule holds; the answers above it are surplus)."""
        threshold = self.plan.cfg.positive_threshold
        while (answer := self.waiting.pop(self.n_generated, None)) is not None:
            completion, verdict = answer
            positive = verdict.reward > threshold
            self.completions.append(completion)
            self.verdicts.append(verdict)
            self.outcomes.append(positive)
            self.n_pos += positive
            self.n_neg += not positive
            if self.exact and self._holds():
                self.stopped = True
                return True
        return False

    def surplus(self) -> list[int]:
        """Indices issued above the counted answers (once stopped: to cancel or discard)."""
        return list(range(self.n_generated, self.issued))

    def stop_reason(self) -> StopReason:
        """`budget` when the allocation stopped it, else the rule's reason."""
        if self.cut:
            return "budget"
        return self.plan.rule.stop_reason(self.n_pos, self.n_neg, prompt_id=self.row.id)
