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
weights. It is bounded by `per_prompt` x prompts seen solved. It is saved with the rest
of the scheduler's state, incrementally: each save writes only the prompts whose kept
answers changed since the last one, each under a key of its own (`KEY_PREFIX` + prompt
id), so a save costs what changed, not the whole store.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sampler_service.backends.base import Completion

#: Where a prompt's kept answers are saved (a key per prompt in the state store).
KEY_PREFIX = "replay/"


@dataclass(frozen=True)
class Replayed:
    """An earlier right answer and the reward it was scored with."""

    completion: Completion
    reward: float


@dataclass
class ReplayStore:
    """Per prompt, the newest right answers (see the module docstring)."""

    _answers: dict[str, deque[Replayed]] = field(default_factory=dict)
    #: Prompts whose kept answers changed since `changes` was last asked.
    _changed: set[str] = field(default_factory=set)
    #: Right answers stored since start (or restore); replays are the tally's to count.
    stored: int = 0

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
        self._changed.add(prompt_id)

    def take(self, prompt_id: str, served_version: int, max_version_lag: int) -> Replayed | None:
        """The prompt's newest right answer within `max_version_lag` versions of the served
        weights, or None; older ones are forgotten (they only get older)."""
        kept = self._answers.get(prompt_id)
        while kept and served_version - kept[0].completion.policy_version > max_version_lag:
            kept.popleft()
            self._changed.add(prompt_id)
        if not kept:
            self._answers.pop(prompt_id, None)
            return None
        return kept[-1]

    def stats(self) -> dict[str, int]:
        return {
            "prompts": len(self._answers),
            "answers": sum(len(kept) for kept in self._answers.values()),
            "stored": self.stored,
        }

    def changes(self) -> dict[str, list[dict[str, Any]]]:
        """The saved form of every prompt changed since the last call, by key (an empty
        list for a prompt with nothing kept any more)."""
        out = {
            KEY_PREFIX + prompt_id: [
                # a shallow copy: the lists are encoded later, on the store's thread
                {"completion": dict(vars(r.completion)), "reward": r.reward}
                for r in self._answers.get(prompt_id, ())
            ]
            for prompt_id in self._changed
        }
        self._changed.clear()
        return out

    def restore(self, saved: dict[str, list[dict[str, Any]]]) -> None:
        """Load what `changes` saved (keys with `KEY_PREFIX`; empty lists are skipped)."""
        self._answers = {
            key.removeprefix(KEY_PREFIX): deque(
                Replayed(Completion(**r["completion"]), r["reward"]) for r in kept
            )
            for key, kept in saved.items()
            if kept
        }
        self._changed.clear()
