"""Group building and batch policies as pure functions: the sampling semantics without
an engine, a store or an event loop.

The scheduler gathers a prompt's answers and verdicts and hands them here; what comes
back is the finished group (or the reason it is dropped) and, for a batch frame, the
groups that stay with their batch-scope weights. Keeping this free of I/O lets it be
tested with hand-computed numbers and reused by the simulated benchmarks unchanged.

Pipeline per prompt (docs/architecture.md, "A prompt from admission to ack"): down-sample
to group_size -> advantages over the kept samples with the configured estimator -> group
policies on the kept samples, recomputing advantages on what a policy keeps -> drop if
fewer than 2 samples remain.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence, Sized
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from sampler_service.backends.base import Completion, TokenIds, VersionSpans, as_list
from sampler_service.config import Reweighting, SamplerConfig
from sampler_service.dataset import PromptRow
from sampler_service.replay import Replayed
from sampler_service.verifiers.base import Verdict
from strategies import advantage, downsample, reweighting, views
from strategies.selection import BatchSelection, GroupSelection
from trainer_client.contract.protocol import Group, GroupStats, Sample, StopReason

#: Reason a group is dropped when group policies leave it with a single sample: a
#: singleton carries no comparison, so its advantage would be meaningless.
TOO_FEW_SAMPLES = "too_few_samples"


def _new_id_prefix() -> None:
    global _ID_PREFIX, _ID_SEQUENCE
    _ID_PREFIX, _ID_SEQUENCE = os.urandom(8).hex(), itertools.count()


_ID_PREFIX, _ID_SEQUENCE = "", itertools.count()
_new_id_prefix()
os.register_at_fork(after_in_child=_new_id_prefix)  # a forked child draws its own


def new_id() -> str:
    """Id for groups, samples, batch frames and deliveries (dedupe keys for clients).

    64 random bits drawn once per process, then a 64-bit sequence number: as unique
    across processes and restarts as random ids, without a system call per id. The loop
    makes five ids a group, and `os.urandom` for each was 6% of its CPU in the front
    benchmark's profile at 700-token answers (`python -m bench.front --only profile`).
    """
    return f"{_ID_PREFIX}{next(_ID_SEQUENCE):016x}"


@dataclass(frozen=True)
class GroupResult:
    """What finalizing one prompt produced.

    ``group`` is None exactly when ``drop_reason`` is set. ``mean_abs_advantage`` is the
    mean |A| over the down-sampled group before group policies: the signal the domain
    mixers observe, so a policy that drops the group does not hide its domain's signal.
    """

    group: Group | None
    drop_reason: str | None
    mean_abs_advantage: float


def on_one_prompt(
    row: PromptRow, completions: Sequence[Completion]
) -> tuple[list[int], str | None, list[Completion]]:
    """The group's prompt (ids and text) and its answers as continuations of it.

    A group has one prompt, but an episode whose environment added messages or tools to
    a chat row began from its own (`Completion.prompt_token_ids`). Where every answer
    began from the same prompt, that is the group's. Where they differ, the group's is
    the ids they all share, its text unknown (None), and the rest of each answer's own
    prompt leads its response as context (mask 0, logprob 0.0, never trained on), so
    prompt plus response is still token for token what the engine was sent.
    """
    if all(c.prompt_token_ids is None for c in completions):  # single answers: the row's
        return row.token_ids, row.text, list(completions)
    prompts = [
        c.prompt_token_ids if c.prompt_token_ids is not None else row.token_ids for c in completions
    ]
    first = completions[0]
    if all(p == prompts[0] for p in prompts):
        text = first.prompt_text if first.prompt_token_ids is not None else row.text
        return prompts[0], text, list(completions)
    shared = min(len(p) for p in prompts)
    shared = next((j for j in range(shared) if len({p[j] for p in prompts}) > 1), shared)
    answers = [
        replace(
            c,
            token_ids=p[shared:] + as_list(c.token_ids),
            logprobs=[0.0] * (len(p) - shared) + as_list(c.logprobs),
            loss_mask=[0] * (len(p) - shared)
            + (as_list(c.loss_mask) if c.loss_mask is not None else [1] * len(c.token_ids)),
            version_spans=shifted_spans(c.version_spans, len(p) - shared),
        )
        for c, p in zip(completions, prompts, strict=True)
    ]
    return prompts[0][:shared], None, answers


def shifted_spans(spans: VersionSpans | None, offset: int) -> VersionSpans | None:
    """Version spans of an answer whose response gained `offset` tokens in front (the
    first span starts at 0: what leads it was decoded under no version, only read)."""
    if spans is None:
        return None
    return [(version, start + offset if i else 0) for i, (version, start) in enumerate(spans)]


def sampled_tokens(token_ids: Sized, loss_mask: TokenIds | None) -> int:
    """Tokens the policy sampled in an answer: mask-1 tokens of an episode, else all."""
    return len(token_ids) if loss_mask is None else int(np.sum(loss_mask))


def fresh_tokens(group: Group) -> int:
    """Sampled tokens of a group's own answers (a replayed one was counted when it was
    sampled, for an earlier group): what training on it uses of what was decoded."""
    return sum(
        sampled_tokens(s.response_token_ids, s.loss_mask) for s in group.samples if not s.replayed
    )


def downsampled_tokens(group: Group) -> int:
    """Sampled tokens of the answers down-sampling left out of a group: a group dropped
    once built wastes them with its own (nobody trains on any of its prompt's answers)."""
    return max(group.stats.sampled_tokens - fresh_tokens(group), 0)


def freshest_first(completions: Sequence[Completion]) -> np.ndarray:
    """Answer indices, the newest weights' first, then in generation order: the order
    down-sampling breaks its ties in. Answers of one reward class are alike to the
    estimate, so a group keeps the freshest its rewards allow, and its
    `policy_version_min` (what staleness counts) moves with the prompt's latest waves: a
    hard prompt sampled across weight updates would otherwise keep its first wave's
    answers and miss the bound."""
    return np.array(
        sorted(range(len(completions)), key=lambda i: (-completions[i].policy_version, i)),
        dtype=np.int64,
    )


def kept_by_preference(
    cfg: SamplerConfig, completions: Sequence[Completion], rewards: np.ndarray
) -> np.ndarray:
    """The indices of the answers down-sampling keeps, the one it preferred most first
    (ties broken `freshest_first`)."""
    preference = freshest_first(completions)
    picked = downsample.apply(
        cfg.downsample, rewards[preference], cfg.group_size, cfg.positive_threshold
    )
    return preference[picked]


def kept_version_min(
    cfg: SamplerConfig, completions: Sequence[Completion], verdicts: Sequence[Verdict]
) -> int | None:
    """The oldest weights among the answers a group of these would keep (None for no
    answers): the `policy_version_min` staleness would judge it by. More answers of the
    same prompt are newer and only displace older ones of their class, so for a prompt
    still sampling this is the version its group would have if it ended now, and the
    oldest it is likely to end with."""
    if not completions:
        return None
    rewards = np.array([v.reward for v in verdicts], dtype=np.float64)
    kept = kept_by_preference(cfg, completions, rewards)
    return min((completions[i].policy_version for i in kept), default=None)


def build_group(
    *,
    row: PromptRow,
    cfg: SamplerConfig,
    config_version: int,
    group_policies: Sequence[GroupSelection],
    completions: Sequence[Completion],
    verdicts: Sequence[Verdict],
    n_pos: int,
    stop_reason: str,
    n_env_errors: int = 0,
    replay: Replayed | None = None,
    make_id: Callable[[], str] = new_id,
    group_id: str | None = None,
) -> GroupResult:
    """Turn a prompt's answers (generation order) into its training group.

    ``n_pos`` counts answers whose reward is above ``cfg.positive_threshold``; the
    caller has it already from the stopping rule's bookkeeping. ``replay``, given when
    every answer is wrong, takes the place of the kept answer down-sampling preferred least
    (`sampler_service.replay`): it counts in the advantages' baseline as one more answer,
    and not in the group's generated counts or policy versions. ``group_id`` is the
    prompt's attempt id where it has one (the answer journal's key).
    """
    if len(completions) != len(verdicts) or not completions:
        raise ValueError(f"{len(completions)} completions for {len(verdicts)} verdicts")
    rewards = np.array([v.reward for v in verdicts], dtype=np.float64)
    lengths = np.array([len(c.token_ids) for c in completions], dtype=np.float64)
    n_gen = len(rewards)
    cost = sum(sampled_tokens(c.token_ids, c.loss_mask) for c in completions)
    generated_rewards = rewards

    def advantages(kept: np.ndarray) -> np.ndarray:
        return advantage.compute(rewards[kept], rewards, cfg.advantage, norm_by_std=cfg.norm_by_std)

    ranked = kept_by_preference(cfg, completions, rewards)
    kept = np.sort(ranked)
    adv = advantages(kept)
    # The domain's own signal (what the mixers observe): a replay does not count in it.
    mean_abs = advantage.mean(np.abs(adv)) if len(adv) else 0.0
    if replay is not None:
        if n_pos:
            raise ValueError(f"a replay for prompt {row.id}, which has {n_pos} right answers")
        completions = [*completions, replay.completion]
        rewards = np.append(rewards, replay.reward)
        lengths = np.append(lengths, len(replay.completion.token_ids))
        kept = np.append(np.sort(ranked[:-1]), n_gen)
        adv = advantages(kept)

    for policy in group_policies:
        view = views.GroupView(
            rewards=rewards[kept],
            lengths=lengths[kept],
            all_rewards=rewards,
            threshold=cfg.positive_threshold,
        )
        chosen = policy.select(view)
        if chosen is None or len(chosen) == 0:
            return GroupResult(None, policy.name, mean_abs)
        if len(chosen) != len(kept):
            kept = kept[np.asarray(chosen, dtype=np.int64)]
            adv = advantages(kept)
    if len(kept) < 2:
        return GroupResult(None, TOO_FEW_SAMPLES, mean_abs)

    indices = kept.tolist()
    prompt_ids, prompt_text, answers = on_one_prompt(row, [completions[i] for i in indices])
    # The values are this process's own (engine answers, verdicts, numpy floats made
    # Python floats here), so the models are built without validation: validating would
    # copy every answer's token ids and logprobs once more. An engine's packed arrays stay
    # arrays (the wire's lists, for the encoder that writes them as they are): a group
    # leaves this process only as bytes (`wire.pack_group`).
    samples = [
        Sample.model_construct(
            sample_id=make_id(),
            response_token_ids=cast(list[int], c.token_ids),
            response_text=c.text,
            logprobs=cast(list[float], c.logprobs),
            reward=float(rewards[i]),
            finish_reason=c.finish_reason,
            policy_version=c.policy_version,
            advantage=float(a),
            loss_mask=cast(list[int] | None, c.loss_mask),
            num_turns=c.num_turns,
            version_spans=c.version_spans,
            replayed=i >= n_gen,
            index=i if i < n_gen else None,
        )
        for i, c, a in zip(indices, answers, adv, strict=True)
    ]
    # A replayed answer is old by design: the group's versions are its fresh answers'.
    versions = [s.policy_version for s in samples if not s.replayed]
    group = Group.model_construct(
        group_id=group_id or make_id(),
        prompt_id=row.id,
        domain=row.domain,
        prompt_token_ids=prompt_ids,
        prompt_text=prompt_text,
        answer=row.answer,
        metadata=row.metadata,
        config_version=config_version,
        policy_version_min=min(versions),
        policy_version_max=max(versions),
        stop_reason=cast(StopReason, stop_reason),  # the rule's own names
        stats=GroupStats.model_construct(
            n_generated=n_gen,
            n_pos=n_pos,
            n_neg=n_gen - n_pos,
            reward_mean=advantage.mean(generated_rewards),
            reward_std=advantage.std(generated_rewards),
            n_env_errors=n_env_errors,
            outcomes=generated_rewards.tolist(),
            sampled_tokens=cost,
        ),
        samples=samples,
        batch_id="",
        batch_index=0,
        batch_size=0,
    )
    return GroupResult(group, None, mean_abs)


def _batch_view(groups: Sequence[Group]) -> views.BatchView:
    return views.BatchView(
        groups=[
            views.BatchGroup(
                advantages=np.array([s.advantage for s in g.samples]),
                pass_rate=g.stats.n_pos / g.stats.n_generated,
                token_logprobs=[np.array(s.logprobs) for s in g.samples],
            )
            for g in groups
        ]
    )


@dataclass(frozen=True)
class FrameResult:
    """A formed batch frame: its id, the groups that stay, in frame order, and the dropped
    ones with the name of the policy that dropped each."""

    batch_id: str
    kept: list[Group]
    dropped: list[tuple[Group, str]]


def apply_batch_policies(
    groups: Sequence[Group],
    selections: Sequence[BatchSelection],
    weightings: Sequence[Reweighting],
    batch_id: str,
) -> FrameResult:
    """Batch-scope selection, then reweighting, written into the groups of one frame.

    Selections run in order, each on what the previous left; a group left with fewer
    than 2 samples is dropped (advantages are not recomputed: they were relative to the
    prompt's own answers). Weights are normalised to mean 1 over the samples that stay.
    The groups are modified in place (their samples, weights and frame position) because
    the frame's stored bytes are fixed from them.
    """
    dropped: list[tuple[Group, str]] = []
    frame = list(groups)
    for policy in selections:
        keep = policy.select(_batch_view(frame))
        survivors = []
        for group, idx in zip(frame, keep, strict=True):
            if len(idx) < 2:
                dropped.append((group, policy.name))
                continue
            group.samples = [group.samples[i] for i in np.asarray(idx).tolist()]
            survivors.append(group)
        frame = survivors
    # Without weightings every weight is 1, the samples' default: no view to build
    # (it copies every answer's logprobs into an array).
    if frame and weightings:
        sample_w, token_w = reweighting.combine(list(weightings), _batch_view(frame))
        for gi, group in enumerate(frame):
            for si, sample in enumerate(group.samples):
                sample.weight = float(sample_w[gi][si])
                if token_w is not None:
                    sample.token_weights = [float(w) for w in token_w[gi][si]]
    for i, group in enumerate(frame):
        group.batch_id, group.batch_index, group.batch_size = batch_id, i, len(frame)
    return FrameResult(batch_id, frame, dropped)
