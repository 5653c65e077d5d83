"""Prompts a restart continues: each attempt the answer journal stored becomes a
`PromptRun` again, with its stored answers at their indices.

Exactness is kept as under sequential sampling: the answers are counted in index order,
and an index issued before the restart whose answer was not stored (it was decoding, or
verified in the journal's last moments) is drawn again at the same index (`redo`), so a
group that mixes answers from before and after the restart holds each index once. An
answer stale by the bound now is dropped as `stale` and its index drawn again. A prompt
whose rule already holds on what was stored takes no more answers; the stored answers
above the stopping index are surplus.
"""

from __future__ import annotations

from dataclasses import dataclass

from sampler_service.dataset import Dataset
from sampler_service.grouping import sampled_tokens
from sampler_service.journal import unpack_answer
from sampler_service.live_config import LiveConfig
from sampler_service.outbox import too_stale
from sampler_service.prompt_run import PromptRun
from sampler_service.store import StoredAttempt
from sampler_service.tally import Resumed, Tally, WaveOutcome
from sampler_service.verifiers.base import Verdict


@dataclass(frozen=True)
class Resumption:
    """What a restart found: the prompts to sample on, and the attempts to forget (their
    prompt is no longer in the dataset)."""

    runs: list[PromptRun]
    gone: list[str]


def resume(
    attempts: list[StoredAttempt],
    dataset: Dataset,
    live: LiveConfig,
    served_version: int,
    tally: Tally,
) -> Resumption:
    """Rebuild the stored attempts as runs of the live config (see the module docstring);
    each is counted in the tally as a wave outcome of what was found stored."""
    runs, gone = [], []
    for attempt in attempts:
        row = dataset.find(attempt.domain, attempt.prompt_id)
        if row is None:
            gone.append(attempt.attempt_id)
            continue
        run = PromptRun(row, live.plan, live.allocation, live.estimator)
        run.attempt_id = attempt.attempt_id
        stale: set[int] = set()
        stale_tokens = 0
        for index, version, reward, payload in attempt.answers:
            completion = unpack_answer(payload)
            if too_stale(served_version, version, live.config.max_staleness):
                stale.add(index)
                stale_tokens += sampled_tokens(completion.token_ids, completion.loss_mask)
                continue
            run.arrived(index, completion, Verdict(reward))
        stored = set(run.waiting)
        run.issued = max(attempt.issued, max(stored, default=-1) + 1)
        surplus_answers = surplus_tokens = 0
        if run.count_arrived():  # the rule holds on what was stored
            surplus_answers = len(run.waiting)
            surplus_tokens = sum(
                sampled_tokens(c.token_ids, c.loss_mask) for c, _ in run.waiting.values()
            )
            run.waiting.clear()
        else:
            run.redo = [i for i in range(run.n_generated, run.issued) if i not in stored]
        run.recorded_tokens = run.sampled_tokens()
        found = Resumed(
            answers=len(attempt.answers),
            stale_answers=len(stale),
            counted_tokens=run.recorded_tokens,
            stale_tokens=stale_tokens,
            regenerated=sum(i not in stale for i in run.redo),
        )
        surplus = (surplus_answers, surplus_tokens)
        tally.wave(WaveOutcome.resumption(row.domain, run.quartile(), found, *surplus))
        runs.append(run)
    return Resumption(runs, gone)
