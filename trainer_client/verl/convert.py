"""Our groups in verl's layouts: TransferQueue records (verl 0.9 V1) and DataProto (V0).

One group of n samples becomes n rows. What each row carries, and where verl reads it:

| field | shape | value | read by |
|---|---|---|---|
| ``prompts`` | P | prompt token ids (DataProto: left-padded) | log-prob/actor workers, metrics |
| ``responses`` | R | response token ids (DataProto: right-padded) | same |
| ``input_ids`` | P+R | prompts then responses | model forward |
| ``attention_mask`` | P+R | DataProto only (records are unpadded) | model forward |
| ``position_ids`` | P+R | cumsum(attention_mask) - 1, clipped at 0 | model forward |
| ``response_mask`` / ``loss_mask`` | R | 1 on sampled response tokens, 0 on an episode's observation tokens (``Sample.loss_mask``) | losses, advantages |
| ``rollout_log_probs`` | R | the sampler's behaviour log-probs | rollout correction, bypass mode, debug metrics |
| ``rm_scores`` (= ``token_level_scores``) | R | the sample's reward at its last sampled response token, 0 elsewhere | verl's advantage estimators |
| ``rollout_is_weights`` | R | service sample weight x token weight (1 when unweighted) | ``ppo_loss`` multiplies the per-token policy loss |
| ``sampler_advantages`` | R | the service's advantage on every response token | our trainers, when the service's advantages are used |
| ``uid`` | - | the group id in hex (no ``_``) | GRPO grouping, record keys |
| ``multi_modal_inputs`` | - | ``{}`` | model forward |

Record keys are ``{uid}_{session}_{index}`` with session = the sample's position in the
group and index 0 (one output per session); the group's prompt key ``{uid}`` carries the
tag ``{"is_prompt": True, "status": "finished", "global_steps": step}``, which is what
verl's ReplayBuffer waits for. A sample with an empty response gets one padding token with
mask 0 (verl assumes R >= 1). A replayed answer (``Sample.replayed``: an earlier right
answer of the prompt, sampled by an older policy) is dropped from the loss by default
(mask 0; its reward still counts in its group's scores), or kept with its own
``rollout_log_probs`` for verl's rollout correction to weight (``drop_replayed=False``).

torch and numpy only; `groups_to_dataproto` imports verl when called.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import numpy as np
import torch

from trainer_client.contract.protocol import Group, Sample

_HEX = re.compile(r"^[0-9a-f]+$")


class GroupSizeError(ValueError):
    """A group whose sample count is not verl's rollout.n."""


def group_uid(group: Group | str) -> str:
    """The group id as verl's ``uid``: lowercase hex, never containing ``_``.

    The sampler's ids are uuid4 hex already; any other id is mapped to a stable uuid5.
    """
    gid = group if isinstance(group, str) else group.group_id
    low = gid.lower().replace("-", "")
    if _HEX.match(low):
        return low
    return uuid.uuid5(uuid.NAMESPACE_URL, gid).hex


def check_group_size(group: Group, n: int) -> None:
    if len(group.samples) != n:
        raise GroupSizeError(
            f"group {group.group_id} (prompt {group.prompt_id}) has {len(group.samples)} samples but "
            f"actor_rollout_ref.rollout.n is {n}: verl needs exactly n per group. Set the sampler's "
            f"group_size to {n} and remove policies that drop samples inside a group "
            "(trainer_client.verl.settings.check_sampler_config says which)"
        )


def _response(
    sample: Sample, pad_id: int, drop_replayed: bool
) -> tuple[list[int], list[float], list[float], list[int]]:
    """(token ids, logprobs, token weights, mask) of one response, at least one token long."""
    ids = list(sample.response_token_ids)
    if len(sample.logprobs) != len(ids):
        raise ValueError(
            f"sample {sample.sample_id}: {len(sample.logprobs)} logprobs for {len(ids)} tokens"
        )
    tw = sample.token_weights if sample.token_weights is not None else [1.0] * len(ids)
    if len(tw) != len(ids):
        raise ValueError(
            f"sample {sample.sample_id}: {len(tw)} token weights for {len(ids)} tokens"
        )
    mask = list(sample.loss_mask) if sample.loss_mask is not None else [1] * len(ids)
    if len(mask) != len(ids):
        raise ValueError(
            f"sample {sample.sample_id}: {len(mask)} loss mask values for {len(ids)} tokens"
        )
    if not ids:
        return [pad_id], [0.0], [0.0], [0]
    if sample.replayed and drop_replayed:
        mask = [0] * len(ids)
    return ids, list(sample.logprobs), [float(w) for w in tw], mask


def last_sampled(mask: Sequence[int]) -> int:
    """Where a sample's reward goes: its last sampled token (an episode may end with an
    observation, which the policy did not produce)."""
    return max((i for i, m in enumerate(mask) if m), default=len(mask) - 1)


def per_token_weights(sample: Sample) -> list[float]:
    """The service's weight of each response token: sample weight x token weight."""
    tw = (
        sample.token_weights
        if sample.token_weights is not None
        else [1.0] * len(sample.response_token_ids)
    )
    return [float(sample.weight) * float(w) for w in tw]


# -- TransferQueue records (verl 0.9, V1 trainer) ------------------------------------------
@dataclass
class Records:
    """What one batch of groups writes into TransferQueue (see the module docstring)."""

    keys: list[str] = field(default_factory=list)
    fields: list[dict[str, Any]] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    prompt_keys: list[str] = field(default_factory=list)
    prompt_tags: list[dict[str, Any]] = field(default_factory=list)


def tq_records(
    groups: Sequence[Group],
    *,
    n: int,
    global_steps: int,
    pad_token_id: int = 0,
    version_offset: int = 0,
    sample_weights: bool = True,
    drop_replayed: bool = True,
) -> Records:
    """Rows for verl's ReplayBuffer: one record per sample, one finished prompt tag per group.

    `version_offset` maps the sampler's policy versions onto verl's global steps
    (version = step + offset, see `weights.WeightPusher`), so verl's staleness metrics
    (``min_global_steps``/``max_global_steps``) are in its own units.
    """
    out = Records()
    for group in groups:
        check_group_size(group, n)
        uid = group_uid(group)
        prompt = torch.tensor(group.prompt_token_ids, dtype=torch.int64)
        if prompt.numel() == 0:
            raise ValueError(
                f"group {group.group_id}: empty prompt (verl needs at least one prompt token)"
            )
        min_step = max(0, group.policy_version_min - version_offset)
        max_step = max(0, group.policy_version_max - version_offset)
        for session, sample in enumerate(group.samples):
            ids, logprobs, _, mask = _response(sample, pad_token_id, drop_replayed)
            responses = torch.tensor(ids, dtype=torch.int64)
            response_mask = torch.tensor(mask, dtype=torch.int64)
            input_ids = torch.cat([prompt, responses])
            rm_scores = torch.zeros(len(ids), dtype=torch.float32)
            rm_scores[last_sampled(mask)] = float(sample.reward)
            weights = (
                torch.tensor(per_token_weights(sample) or [0.0], dtype=torch.float32)
                * response_mask
            )
            row: dict[str, Any] = {
                "prompts": prompt,
                "responses": responses,
                "response_mask": response_mask,
                "loss_mask": response_mask,
                "input_ids": input_ids,
                "position_ids": torch.arange(input_ids.numel(), dtype=torch.int64),
                "rollout_log_probs": torch.tensor(logprobs, dtype=torch.float32),
                "rm_scores": rm_scores,
                "sampler_advantages": torch.full(
                    (len(ids),), float(sample.advantage), dtype=torch.float32
                )
                * response_mask,
                "sampler_weights": weights,
                "multi_modal_inputs": {},
                # verl counts messages: the prompt, then each model turn and observation
                "num_turns": 2 * sample.num_turns,
                "uid": uid,
                "session_id": session,
                "global_steps": global_steps,
                "index": group.batch_index,
                "data_source": group.domain,
                "reward_model": {"ground_truth": group.answer or "", "style": "rule"},
                "extra_fields": {
                    "min_global_steps": min_step,
                    "max_global_steps": max_step,
                    "reward_extra_info": {"acc": float(sample.reward)},
                    "sampler_group_id": group.group_id,
                    "sampler_policy_version": sample.policy_version,
                },
            }
            if sample_weights:
                row["rollout_is_weights"] = weights.clone()
            out.keys.append(f"{uid}_{session}_0")
            out.fields.append(row)
            out.tags.append(
                {
                    "status": "success",
                    "prompt_len": int(prompt.numel()),
                    "response_len": len(ids),
                    "seq_len": int(input_ids.numel()),
                    "global_steps": global_steps,
                    "min_global_steps": min_step,
                    "max_global_steps": max_step,
                }
            )
        out.prompt_keys.append(uid)
        out.prompt_tags.append(
            {"is_prompt": True, "status": "finished", "global_steps": global_steps}
        )
    return out


# -- padded batch (DataProto, verl <= 0.8 and the legacy trainer of 0.9) ---------------------
def groups_to_tensors(
    groups: Sequence[Group],
    pad_token_id: int,
    *,
    n: int | None = None,
    sample_weights: bool = True,
    drop_replayed: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """(tensors, non-tensors) of a padded batch: prompts left-padded, responses right-padded."""
    rows = []
    for group in groups:
        if n is not None:
            check_group_size(group, n)
        for sample in group.samples:
            rows.append((group, sample, _response(sample, pad_token_id, drop_replayed)))
    if not rows:
        raise ValueError("no samples in these groups")
    B = len(rows)
    P = max(len(g.prompt_token_ids) for g, _, _ in rows)
    R = max(len(r[0]) for _, _, r in rows)
    if P == 0:
        raise ValueError("empty prompts (verl needs at least one prompt token)")
    prompts = torch.full((B, P), pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros((B, P), dtype=torch.int64)
    responses = torch.full((B, R), pad_token_id, dtype=torch.int64)
    response_mask = torch.zeros((B, R), dtype=torch.int64)
    response_attention = torch.zeros((B, R), dtype=torch.int64)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    scores = torch.zeros((B, R), dtype=torch.float32)
    weights = torch.zeros((B, R), dtype=torch.float32)
    advantages = torch.zeros((B, R), dtype=torch.float32)
    for i, (group, sample, (ids, lps, _, mask)) in enumerate(rows):
        p, r = len(group.prompt_token_ids), len(ids)
        prompts[i, P - p :] = torch.tensor(group.prompt_token_ids, dtype=torch.int64)
        prompt_mask[i, P - p :] = 1
        responses[i, :r] = torch.tensor(ids, dtype=torch.int64)
        response_mask[i, :r] = torch.tensor(mask, dtype=torch.int64)
        response_attention[i, :r] = 1
        logprobs[i, :r] = torch.tensor(lps, dtype=torch.float32)
        scores[i, last_sampled(mask)] = float(sample.reward)
        if len(sample.response_token_ids):
            weights[i, :r] = torch.tensor(per_token_weights(sample), dtype=torch.float32)
            advantages[i, :r] = float(sample.advantage) * response_mask[i, :r]
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0),
        "response_mask": response_mask,
        "rollout_log_probs": logprobs,
        "rm_scores": scores,
        "token_level_scores": scores.clone(),
        "sampler_advantages": advantages,
        "sampler_weights": weights,
    }
    if sample_weights:
        tensors["rollout_is_weights"] = weights.clone()
    non_tensors = {
        "uid": np.array([group_uid(g) for g, _, _ in rows], dtype=object),
        "multi_modal_inputs": np.array([{} for _ in rows], dtype=object),
        "data_source": np.array([g.domain for g, _, _ in rows], dtype=object),
        "reward_model": np.array(
            [{"ground_truth": g.answer or "", "style": "rule"} for g, _, _ in rows], dtype=object
        ),
        "sampler_group_id": np.array([g.group_id for g, _, _ in rows], dtype=object),
        # verl's agent loop counts messages: the prompt, then each model turn and observation
        "__num_turns__": np.array([2 * s.num_turns for _, s, _ in rows], dtype=np.int32),
    }
    return tensors, non_tensors


class BatchOptions(TypedDict, total=False):
    """The keyword options of `groups_to_tensors`, for the functions that pass them on."""

    n: int | None
    sample_weights: bool
    drop_replayed: bool


def groups_to_dataproto(
    groups: Sequence[Group],
    pad_token_id: int,
    *,
    meta_info: dict[str, Any] | None = None,
    **options: Unpack[BatchOptions],
) -> Any:
    """A verl `DataProto` of these groups, as verl's agent loop would have produced it;
    ``options`` are `groups_to_tensors`'s."""
    from verl import DataProto

    tensors, non_tensors = groups_to_tensors(groups, pad_token_id, **options)
    return DataProto.from_dict(
        tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info or {})
    )
