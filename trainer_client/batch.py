"""Turn streamed groups into training batches.

`BatchAssembler` collects whole batch frames until it holds at least `batch_groups`
groups (a frame is never split: its batch-scope weights were normalized over the whole
frame), then `collate` lays the samples out as right-padded tensors, one row per sample:

    row i = prompt tokens + response tokens of sample i, then padding

Per-token tensors have the shape of `input_ids` and are aligned with it: column t holds
the value for token t (the behaviour logprob of token t, its token weight, ...), and
`response_mask` marks the response tokens. Per-sample values (advantage, weight, reward)
are vectors of length B.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from trainer_client.contract.protocol import Group


@dataclass
class TrainBatch:
    """One training batch: B samples from the groups in `groups`."""

    input_ids: torch.Tensor  # [B, L] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, L] long, 1 on prompt and response tokens
    response_mask: torch.Tensor  # [B, L] float, 1 on response tokens
    behaviour_logprobs: torch.Tensor  # [B, L] float, the sampler's logprob of token t (0 elsewhere)
    token_weights: torch.Tensor  # [B, L] float, the service's token weights (1 when it sent none)
    advantages: torch.Tensor  # [B] the service's advantage of each sample
    sample_weights: torch.Tensor  # [B] the service's sample weight (mean 1 over its frame)
    rewards: torch.Tensor  # [B]
    group_index: torch.Tensor  # [B] long, index into `groups` of each sample's group
    policy_versions: torch.Tensor  # [B] long, the policy version that generated the sample
    replayed: torch.Tensor  # [B] bool, an earlier answer replayed into its group (off-policy)
    spanning: torch.Tensor  # [B] bool, decoded under several policy versions (version_spans)
    groups: list[Group] = field(default_factory=list)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.groups]

    @property
    def delivery_ids(self) -> list[str]:
        """Delivery ids as received (ack the groups through the client to use the newest)."""
        return [g.delivery_id or "" for g in self.groups]

    @property
    def domains(self) -> list[str]:
        return [g.domain for g in self.groups]

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {name: getattr(self, name).to(device) for name in TENSOR_FIELDS}
        return TrainBatch(**moved, groups=self.groups)

    def summary(self) -> dict[str, float]:
        """Sampling statistics of the batch, for the training log."""
        generated = sum(g.stats.n_generated for g in self.groups)
        positives = sum(g.stats.n_pos for g in self.groups)
        return {
            "groups": len(self.groups),
            "samples": self.size,
            "reward_mean": float(self.rewards.mean()) if self.size else 0.0,
            "pass_rate": positives / max(generated, 1),
            "samples_per_group": generated / max(len(self.groups), 1),
            "kept_fraction": self.size / max(generated, 1),
            "response_tokens": float(self.response_mask.sum()),
        }


TENSOR_FIELDS = (
    "input_ids",
    "attention_mask",
    "response_mask",
    "behaviour_logprobs",
    "token_weights",
    "advantages",
    "sample_weights",
    "rewards",
    "group_index",
    "policy_versions",
    "replayed",
    "spanning",
)


def collate(groups: Sequence[Group], pad_id: int) -> TrainBatch:
    """Lay out every sample of `groups` as one right-padded row (see the module docstring)."""
    rows = [(gi, g, s) for gi, g in enumerate(groups) for s in g.samples]
    if not rows:
        raise ValueError("no samples in these groups")
    width = max(len(g.prompt_token_ids) + len(s.response_token_ids) for _, g, s in rows)
    B = len(rows)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attention = torch.zeros((B, width), dtype=torch.long)
    response = torch.zeros((B, width), dtype=torch.float32)
    behaviour = torch.zeros((B, width), dtype=torch.float32)
    token_w = torch.zeros((B, width), dtype=torch.float32)
    for i, (_, g, s) in enumerate(rows):
        p, r = len(g.prompt_token_ids), len(s.response_token_ids)
        if len(s.logprobs) != r:
            raise ValueError(
                f"group {g.group_id} sample {s.sample_id}: {len(s.logprobs)} logprobs for {r} tokens"
            )
        input_ids[i, :p] = torch.tensor(g.prompt_token_ids, dtype=torch.long)
        input_ids[i, p : p + r] = torch.tensor(s.response_token_ids, dtype=torch.long)
        attention[i, : p + r] = 1
        if s.loss_mask is None:
            response[i, p : p + r] = 1.0
        elif len(s.loss_mask) == r:
            # an episode: observation tokens (mask 0) are context, not trained on
            response[i, p : p + r] = torch.tensor(s.loss_mask, dtype=torch.float32)
        else:
            raise ValueError(
                f"group {g.group_id} sample {s.sample_id}: {len(s.loss_mask)} loss mask "
                f"values for {r} tokens"
            )
        behaviour[i, p : p + r] = torch.tensor(s.logprobs, dtype=torch.float32)
        tw = s.token_weights if s.token_weights is not None else [1.0] * r
        if len(tw) != r:
            raise ValueError(
                f"group {g.group_id} sample {s.sample_id}: {len(tw)} token weights for {r} tokens"
            )
        token_w[i, p : p + r] = torch.tensor(tw, dtype=torch.float32)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention,
        response_mask=response,
        behaviour_logprobs=behaviour,
        token_weights=token_w,
        advantages=torch.tensor([s.advantage for _, _, s in rows], dtype=torch.float32),
        sample_weights=torch.tensor([s.weight for _, _, s in rows], dtype=torch.float32),
        rewards=torch.tensor([s.reward for _, _, s in rows], dtype=torch.float32),
        group_index=torch.tensor([gi for gi, _, _ in rows], dtype=torch.long),
        policy_versions=torch.tensor([s.policy_version for _, _, s in rows], dtype=torch.long),
        replayed=torch.tensor([s.replayed for _, _, s in rows], dtype=torch.bool),
        spanning=torch.tensor([bool(s.version_spans) for _, _, s in rows], dtype=torch.bool),
        groups=list(groups),
    )


class BatchAssembler:
    """Collects groups into batches of at least `batch_groups` groups, whole frames only.

    Groups of one frame share a `batch_id` and arrive together; a frame is complete when
    all `batch_size` of its members are in. Set the sampler's `batch_groups` to the same
    number (the trainer does) so that one frame is one batch; frames a batch-scope
    selection shrank are combined until the batch is full.
    """

    def __init__(self, batch_groups: int, pad_id: int) -> None:
        if batch_groups < 1:
            raise ValueError("batch_groups must be >= 1")
        self.batch_groups = batch_groups
        self.pad_id = pad_id
        self._complete: list[Group] = []  # groups of complete frames, in arrival order
        self._partial: dict[str, dict[int, Group]] = {}  # batch_id -> batch_index -> group

    @property
    def pending_groups(self) -> int:
        return len(self._complete) + sum(len(m) for m in self._partial.values())

    def add(self, group: Group) -> TrainBatch | None:
        """Add one group; returns a batch once enough whole frames are in."""
        members = self._partial.setdefault(group.batch_id, {})
        members[group.batch_index] = group
        if len(members) >= group.batch_size:
            del self._partial[group.batch_id]
            self._complete.extend(members[i] for i in sorted(members))
        if len(self._complete) >= self.batch_groups:
            groups, self._complete = self._complete, []
            return collate(groups, self.pad_id)
        return None

    def batches(self, groups: Iterable[Group]) -> Iterator[TrainBatch]:
        """Batches from a group iterator (e.g. `SamplerClient.groups()`)."""
        for group in groups:
            batch = self.add(group)
            if batch is not None:
                yield batch
