"""Replay of earlier right answers into groups whose answers are all wrong.

A prompt the policy rarely solves mostly yields all-wrong groups, which carry no
advantage and teach nothing. When the sampler has seen the prompt solved before, one
answer of such a group can be swapped for an earlier right answer of the same prompt:
the group keeps its size (verl needs exactly n per group) and gains the one positive
that gives every answer a nonzero advantage (AR3PO's response reuse).

A replayed answer was sampled by an older policy: it keeps the policy version and the
logprobs it was sampled with, travels flagged (`Sample.replayed`, behind the `replayed`
wire feature), does not set its group's `policy_version_min`/`max` (so staleness drops
judge the group by its fresh answers), and trainers treat it as off-policy (a clipped
importance ratio or dropped, by their setting).

The store keeps at most `per_prompt` right answers per prompt, the newest last, and
offers only those at most `max_version_lag` policy versions older than the served
weights. It is bounded by `per_prompt` x prompts seen solved, and it is saved with the
rest of the scheduler's state so a restart keeps it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sampler_service.backends.base import Completion


@dataclass(frozen=True)
class Replayed:
    """An earlier right answer and the reward it was scored with."""

    completion: Completion
    reward: float


@dataclass
class ReplayStore:
    """Per prompt, the newest right answers (see the module docstring)."""

    _answers: dict[str, deque[Replayed]] = field(default_factory=dict)
    #: Right answers stored and answers replayed into groups since start (or restore).
    stored: int = 0
    replayed: int = 0

    def remember(
        self,
        prompt_id: str,
        completions: Sequence[Completion],
        rewards: Sequence[float],
        threshold: float,
        per_prompt: int,
    ) -> None:
        """Keep the prompt's right answers (reward above `threshold`), at most `per_prompt`."""
        right = [
            Replayed(c, float(r))
            for c, r in zip(completions, rewards, strict=True)
            if r > threshold
        ]
        if not right:
            return
        kept = self._answers.setdefault(prompt_id, deque())
        kept.extend(right)
        while len(kept) > per_prompt:
            kept.popleft()
        self.stored += len(right)

    def take(self, prompt_id: str, served_version: int, max_version_lag: int) -> Replayed | None:
        """The prompt's newest right answer within `max_version_lag` versions of the served
        weights, or None; older ones are forgotten (they only get older)."""
        kept = self._answers.get(prompt_id)
        while kept and served_version - kept[0].completion.policy_version > max_version_lag:
            kept.popleft()
        if not kept:
            self._answers.pop(prompt_id, None)
            return None
        self.replayed += 1
        return kept[-1]

    def stats(self) -> dict[str, int]:
        return {
            "prompts": len(self._answers),
            "answers": sum(len(kept) for kept in self._answers.values()),
            "stored": self.stored,
            "replayed": self.replayed,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "answers": {
                prompt_id: [{"completion": asdict(r.completion), "reward": r.reward} for r in kept]
                for prompt_id, kept in self._answers.items()
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._answers = {
            prompt_id: deque(Replayed(Completion(**r["completion"]), r["reward"]) for r in kept)
            for prompt_id, kept in state.get("answers", {}).items()
        }
