"""Paced admission: a prompt that would not finish within the staleness bound waits for
the next weight version instead of being sampled and dropped.

Under `max_staleness` s a group is handed out only while the served weights are at most
s versions past its oldest answer's. The trainer pushes a version every T seconds, so
what is admitted now must be done about s windows after the current one began. Prompts
that run long, the hard ones adaptive stopping samples most, are the ones that miss it:
admitted late in a window, or behind more work than the engine gets through by then,
they finish past the bound and are dropped.

The pacer keeps the work admitted within what the engine decodes by the bound. A
prompt's cost is the answers its rule is expected to take at its estimated pass rate
(`strategies.pacing`) times the current answer length (tokens per answer over recently
finished prompts). The engine's rate is the tokens it decoded per second over recent
windows, and T the seconds per weight push. A prompt is admitted when the tokens still
ahead of the running prompts plus its cost fit in rate x (window start + s T - now);
otherwise it is delayed, never skipped: delayed prompts are first in line once they
fit, which a new version's window gives them, and one that has waited
`max_delay_versions` versions is admitted whether it fits or not. For that to hold, the
line holds at most what those versions admit, a training step of prompts each: while it
is full, no new prompt is drawn (a longer line would hold its last prompts past
`max_delay_versions`, behind the overdue ones ahead of them). With
`max_delay_versions` 0, no bound, or nothing measured yet (two versions and a finished
prompt), nothing is delayed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sampler_service.dataset import PromptRow
from sampler_service.live_config import LiveConfig
from sampler_service.prompt_run import PromptRun
from strategies.pacing import AnswerCosts

#: Weight of the newest push interval and finished prompt in the running means.
EMA = 0.1
#: Seconds between two sums of the running prompts' outstanding tokens.
BACKLOG_EVERY_S = 0.05


@dataclass
class _Delayed:
    row: PromptRow
    #: The served version when it was delayed.
    since: int


class Pacer:
    """See the module docstring."""

    def __init__(
        self,
        live: LiveConfig,
        clock: Callable[[], float],
        decoded: Callable[[], int],
        step_groups: Callable[[], int],
    ) -> None:
        """`decoded()`: the tokens the engines have decoded so far (the tally's);
        `step_groups()`: the groups the trainer takes per step (admission's)."""
        self.live = live
        self._clock = clock
        self._decoded = decoded
        self._step_groups = step_groups
        self._costs = AnswerCosts()
        self._version: int | None = None
        self._window_start = 0.0
        self._window_decoded = 0
        #: Running means (None until measured): seconds per weight version, tokens the
        #: engines decode per second, tokens per answer.
        self.push_s: float | None = None
        self.token_rate: float | None = None
        self.answer_tokens: float | None = None
        self.delayed: deque[_Delayed] = deque()
        #: Prompts delayed, admitted after waiting `max_delay_versions` without fitting,
        #: and the most versions a delayed prompt waited.
        self.delays = 0
        self.overdue = 0
        self.longest_wait = 0
        self._backlog = 0.0
        self._backlog_at: float | None = None

    # -- measurements -------------------------------------------------------------------
    def observe(self, version: int) -> None:
        """The served version now; a new one starts a window (and times the last)."""
        if version == self._version:
            return
        now, decoded = self._clock(), self._decoded()
        if self._version is not None and version > self._version and now > self._window_start:
            seconds = now - self._window_start
            self.push_s = _ema(self.push_s, seconds / (version - self._version))
            self.token_rate = _ema(self.token_rate, (decoded - self._window_decoded) / seconds)
        self._version, self._window_start, self._window_decoded = version, now, decoded

    def finished(self, tokens: int, answers: int) -> None:
        """A prompt's answers are all in."""
        if answers > 0:
            self.answer_tokens = _ema(self.answer_tokens, tokens / answers)

    # -- decisions ----------------------------------------------------------------------
    @property
    def active(self) -> bool:
        cfg = self.live.config
        return (
            cfg.max_staleness is not None
            and cfg.delay_versions > 0
            and self.push_s is not None
            and self.token_rate is not None
            and self.answer_tokens is not None
        )

    def backlog(self, running: Callable[[], Iterable[PromptRun]]) -> float:
        """Tokens the running prompts are still expected to decode: summed over them at
        most every `BACKLOG_EVERY_S` (the sum is a pass over every running prompt), with
        the costs of those admitted since added as they are."""
        now = self._clock()
        if self._backlog_at is None or now - self._backlog_at >= BACKLOG_EVERY_S:
            self._backlog = sum(
                max(run.expected_tokens - run.recorded_tokens, 0.0) for run in running()
            )
            self._backlog_at = now
        return self._backlog

    def admitted(self, cost: float) -> None:
        """A prompt of this expected cost was admitted."""
        self._backlog += cost

    def cost(self, row: PromptRow) -> float:
        """Tokens the prompt is expected to decode (0 while pacing is off)."""
        if not self.active:
            return 0.0
        assert self.answer_tokens is not None
        p = self.live.estimator.p(row.id)
        return self._costs(self.live.plan.rule, p, row.id) * self.answer_tokens

    def fits(self, row: PromptRow, backlog: float) -> bool:
        """Whether the prompt, admitted now behind `backlog` tokens still to decode, is
        expected to finish within the bound."""
        if not self.active:
            return True
        assert self.push_s is not None and self.token_rate is not None
        bound = self.live.config.max_staleness or 0
        left = self._window_start + bound * self.push_s - self._clock()
        # Past it, the push is late: the trainer waits for groups, and holding them back
        # would only delay the push further.
        return left <= 0 or backlog + self.cost(row) <= self.token_rate * left

    def delayed_rows(self) -> list[PromptRow]:
        """The delayed prompts, first in line first."""
        return [item.row for item in self.delayed]

    def delay(self, row: PromptRow) -> None:
        self.delayed.append(_Delayed(row, self._version or 0))
        self.delays += 1

    def full(self) -> bool:
        """No more prompts are delayed once as many wait as the next
        `max_delay_versions` versions take (a step of groups each) or as may run at once:
        a longer line would hold its last prompts past `max_delay_versions`. Never while
        pacing is off: nothing is delayed then."""
        if not self.active:
            return False
        cfg = self.live.config
        line = min(cfg.max_active_prompts, cfg.delay_versions * self._step_groups())
        return len(self.delayed) >= line

    def take_delayed(self, backlog: float) -> PromptRow | None:
        """The first delayed prompt that fits now or has waited long enough, if any."""
        version = self._version or 0
        wait = self.live.config.delay_versions
        for i, item in enumerate(self.delayed):
            fits = self.fits(item.row, backlog)
            if fits or version - item.since >= wait:
                del self.delayed[i]
                self.overdue += not fits
                self.longest_wait = max(self.longest_wait, version - item.since)
                return item.row
        return None

    def to_dict(self) -> dict[str, Any]:
        """`/v1/stats` `pacing`."""
        return {
            "active": self.active,
            "push_s": self.push_s,
            "token_rate": self.token_rate,
            "answer_tokens": self.answer_tokens,
            "delayed_now": len(self.delayed),
            "delayed": self.delays,
            "admitted_overdue": self.overdue,
            "longest_wait_versions": self.longest_wait,
        }


def _ema(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - EMA) * mean + EMA * value
