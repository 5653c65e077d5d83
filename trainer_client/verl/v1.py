"""verl 0.9 (V1 trainer, TransferQueue): the sampler does all rollout, verl does the optimization.

Two pieces, both loaded by verl from this module (``VERL_USE_EXTERNAL_MODULES=trainer_client.verl.v1``):

- `SamplerAgentLoopManager`, for ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``.
  verl calls ``generate_sequences(prompts)`` with a batch of dataloader prompts it has
  registered in TransferQueue as ``pending``; the manager drops those placeholders (the
  sampler owns the data and the mixing; verl's dataloader only paces the steps), takes as
  many finished groups from the sampler (POST /v1/groups/lease) and writes each as n
  trajectory records plus a ``finished`` prompt tag, in the layout of verl's own
  ``AgentLoopWorkerTQ`` (see trainer_client.verl.convert). verl's ReplayBuffer then
  returns them like any finished group.
- `SamplerPPOTrainer`, registered with ``@register_trainer("adaptive_rollout")``
  (``trainer.v1.trainer_mode=adaptive_rollout``). It is verl's PPOTrainer with no rollout
  engine on the trainer GPUs (pure actor workers, as separate_async without hybrid
  replicas) and these changes:

  * start-up: checks the sampler's config against rollout.n and the temperature
    (`IncompatibleSamplerConfig` lists every problem), sets the sampler's batch_groups
    to the step's group count, fixes the policy-version offset;
  * advantages: verl computes them (its GRPO on the rewards, KL-in-reward, rollout
    correction), then, when the service's advantages are used (``advantages: auto`` with
    the sampler's ``global``/``est`` estimator, or ``sampler``), they replace verl's; the
    service's sample and token weights are multiplied into ``rollout_is_weights``, which
    verl's ``ppo_loss`` multiplies into the per-token policy loss;
  * step end: the actor workers send their weights through the ``adaptive_rollout``
    checkpoint engine (trainer_client.verl.weights) to the sampler as the next policy
    version, then the groups the step trained on are acked; an exception before that
    leaves them unacked, so the sampler offers them again after a restart;
  * validation: there is no generation on the trainer, so ``_validate`` reports the
    sampler's own statistics (pass rates per domain, queue depths) instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import transfer_queue as tq
from omegaconf import DictConfig, open_dict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.utils.debug import marked_timer
from verl.utils.tensordict_utils import list_of_dict_to_tensordict
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

from trainer_client.client import SamplerClient
from trainer_client.contract.protocol import Group
from trainer_client.verl.convert import tq_records
from trainer_client.verl.session import SamplerSession
from trainer_client.verl.settings import (
    MODE,
    IncompatibleSamplerConfig,
    SamplerSettings,
    check_verl_config,
    sampler_metrics,
)
from trainer_client.verl.source import GroupSource
from trainer_client.verl.weights import (
    configure_for_sampler,  # also registers the checkpoint engine
)

log = logging.getLogger(__name__)

__all__ = ["SamplerAgentLoopManager", "SamplerPPOTrainer"]


def _plain(value: Any) -> Any:
    """Unwrap tensordict's NonTensorData/NonTensorStack into Python values."""
    if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):
        return value.tolist()
    if hasattr(value, "data") and not isinstance(value, torch.Tensor):
        return value.data
    return value


def _has(td: Any, key: str) -> bool:
    return key in td


# -- agent-loop manager ---------------------------------------------------------------------
class SamplerAgentLoopManager:
    """Feeds verl's TransferQueue with the sampler's finished groups (see the module docstring)."""

    def __init__(
        self,
        config: DictConfig,
        llm_client: Any = None,
        teacher_client: Any = None,
        reward_loop_worker_handles: Any = None,
        *,
        client: SamplerClient | None = None,
        settings: SamplerSettings | None = None,
    ) -> None:
        self.config = config
        self.settings = settings or SamplerSettings.from_verl_config(config)
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.source = GroupSource(self.settings, client)
        self.client = self.source.client
        #: Set by the trainer: sampler policy version - verl step (for staleness tags).
        self.version_offset = 0
        self._in_queue: dict[str, Group] = {}  # uid -> group written to TQ, not yet acked
        self.groups_written = 0
        self.groups_acked = 0

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> SamplerAgentLoopManager:
        """verl's factory: ``create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)``."""
        return cls(*args, **kwargs)

    # -- what verl calls -------------------------------------------------------------------
    def generate_sequences(self, prompts: Any) -> None:
        """Replace verl's pending prompts by as many finished sampler groups, in TransferQueue."""
        if _has(prompts, "validate") and bool(_plain(prompts["validate"])):
            raise RuntimeError(
                "the adaptive-rollout sampler does not run validation generations; use "
                f"trainer.v1.trainer_mode={MODE} (it reports the sampler's statistics as validation "
                "metrics) or set trainer.test_freq=-1 and trainer.val_before_train=False"
            )
        count = int(prompts.batch_size[0])
        steps = _plain(prompts["global_steps"]) if _has(prompts, "global_steps") else 0
        global_steps = int(steps[0] if isinstance(steps, list) else steps)
        placeholders = [str(u) for u in _plain(prompts["uid"])] if _has(prompts, "uid") else []
        groups = self.take_groups(count)
        if placeholders:
            tq.kv_clear(keys=placeholders, partition_id="train")
        self.write_groups(groups, global_steps)

    # -- sampler side ----------------------------------------------------------------------
    def take_groups(self, count: int) -> list[Group]:
        """`count` finished groups, oldest first; waits (and says why) until the sampler has them."""
        return self.source.take(count)

    def write_groups(
        self, groups: list[Group], global_steps: int, partition_id: str = "train"
    ) -> list[str]:
        """Write `groups` as finished GRPO groups; returns their uids."""
        if not groups:
            return []
        records = tq_records(
            groups,
            n=self.n,
            global_steps=global_steps,
            version_offset=self.version_offset,
            sample_weights=self.settings.use_sample_weights,
            drop_replayed=self.settings.replayed == "drop",
        )
        # Trajectories first, then the prompt tags: the ReplayBuffer must never see a
        # finished group whose records are not in yet.
        tq.kv_batch_put(
            keys=records.keys,
            partition_id=partition_id,
            fields=list_of_dict_to_tensordict(records.fields),
            tags=records.tags,
        )
        tq.kv_batch_put(
            keys=records.prompt_keys, partition_id=partition_id, tags=records.prompt_tags
        )
        for uid, group in zip(records.prompt_keys, groups, strict=True):
            self._in_queue[uid] = group
        self.groups_written += len(groups)
        return records.prompt_keys

    def ack(self, uids: Iterable[str]) -> int:
        """Ack the groups with these uids (verl has trained on them); unknown uids are ignored."""
        groups = [self._in_queue.pop(uid) for uid in dict.fromkeys(uids) if uid in self._in_queue]
        self.groups_acked += self.source.ack(groups)
        return len(groups)

    @property
    def unacked(self) -> int:
        return len(self._in_queue) + self.source.pending

    def close(self) -> None:
        self.client.close()


def uids_of(keys: Iterable[str]) -> list[str]:
    """The group uids behind TransferQueue record keys ``{uid}_{session}_{index}``."""
    return list(dict.fromkeys(key.split("_", 1)[0] for key in keys))


# -- trainer mode ---------------------------------------------------------------------------
class NoRolloutReplica(RolloutReplica):
    """The rollout replica class named by ``rollout.name`` in this trainer mode: never started."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            f"trainer mode {MODE} starts no rollout replica: the adaptive-rollout sampler does all rollout"
        )


RolloutReplicaRegistry.register(MODE, lambda: NoRolloutReplica)


def without_rollout_replicas(config: DictConfig) -> None:
    """Let verl build its empty LLM server manager without an inference engine.

    A trainer without hybrid replicas gets ``LLMServerManager.create_empty``, whose
    constructor still asserts ``rollout.nnodes > 0`` (standalone replicas) and resolves
    ``rollout.name``'s replica class, which for ``vllm`` imports vLLM. Nothing else reads
    either in this mode (the actor workers build no rollout), so the rollout is named after
    this mode's replica class (it refuses to start) and given one nominal standalone node
    that is never launched (create_empty starts no replica).
    """
    with open_dict(config):
        rollout = config.actor_rollout_ref.rollout
        rollout.name = MODE
        rollout.nnodes = max(1, int(rollout.get("nnodes") or 0))


@register_trainer(MODE)
class SamplerPPOTrainer(PPOTrainer):
    """verl's PPO trainer with the sampler as its only rollout (see the module docstring)."""

    def __init__(self, config: DictConfig) -> None:
        self.settings = SamplerSettings.from_verl_config(config)
        problems = check_verl_config(config)
        if problems:
            raise IncompatibleSamplerConfig(problems)
        configure_for_sampler(config, self.settings)
        without_rollout_replicas(config)
        # No inference engine on the trainer GPUs: actor workers only, as verl's
        # separate_async trainer does without hybrid replicas.
        self._enable_hybrid_replicas = False
        super().__init__(config)
        self.session = SamplerSession(self.settings)
        self.client = self.session.client
        self._step_keys: list[str] = []

    # -- start-up --------------------------------------------------------------------------
    def on_init_end(self) -> None:
        step_groups = int(self.config.data.train_batch_size) // self.parameter_sync_step
        self.session.start(
            self.config,
            global_steps=self.global_steps,
            use_critic=self.use_critic,
            step_groups=step_groups,
        )
        if self.session.initial_push_due(self.global_steps):
            self.session.push_weights(self.actor_rollout_wg, self.global_steps, initial=True)

    def on_train_begin(self) -> None:
        self._sync_manager_offset()

    def _sync_manager_offset(self) -> None:
        manager = getattr(self, "agent_loop_manager", None)
        if isinstance(manager, SamplerAgentLoopManager) and self.session.versions is not None:
            manager.version_offset = self.session.versions.offset

    # -- one step --------------------------------------------------------------------------
    def step(self, metrics: dict, timing_raw: dict) -> KVBatchMeta:
        batch = super().step(metrics, timing_raw)
        self._step_keys = list(batch.keys)
        return batch

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        use_weights = self.settings.use_sample_weights
        if use_weights:
            # verl (re)writes rollout_is_weights only when its rollout correction is on; start
            # from 1 so that what is there afterwards is verl's own factor (or 1).
            mask = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"]
            )
            ones = [
                torch.ones(m.numel(), dtype=torch.float32) for m in mask["response_mask"].unbind()
            ]
            tq.kv_batch_put(
                keys=batch.keys,
                partition_id=batch.partition_id,
                fields=list_of_dict_to_tensordict([{"rollout_is_weights": o} for o in ones]),
            )
        batch = super()._compute_advantage(batch, metrics)
        return apply_sampler_outputs(
            batch,
            metrics,
            advantages=self.session.use_sampler_advantages,
            weights=use_weights,
        )

    def on_sample_end(self) -> None:
        return None

    def on_step_end(self) -> None:
        sync_metrics: dict[str, float] = {}
        if self.settings.weight_sync != "none":
            with marked_timer("update_weights", self.timing_raw, color="red"):
                sync_metrics = self.session.push_weights(self.actor_rollout_wg, self.global_steps)
            self._sync_manager_offset()
        manager = getattr(self, "agent_loop_manager", None)
        if isinstance(manager, SamplerAgentLoopManager):
            acked = manager.ack(
                uid for uid in uids_of(self._step_keys) if not uid.startswith("pad")
            )
            sync_metrics[f"{MODE}/groups_acked"] = float(acked)
            sync_metrics[f"{MODE}/groups_unacked"] = float(manager.unacked)
        try:
            sync_metrics.update(sampler_metrics(self.client.stats()))
        except Exception as exc:  # metrics only  # noqa: BLE001
            log.warning("sampler stats unavailable: %s", exc)
        self._pending_sync_metrics = {
            **(getattr(self, "_pending_sync_metrics", None) or {}),
            **sync_metrics,
        }

    def _validate(self) -> dict[str, float]:
        """No generation here: the sampler's statistics stand in for validation metrics."""
        metrics = sampler_metrics(self.client.stats(), prefix="val-aux")
        return metrics or {
            f"val-aux/{MODE}/policy_version": float(self.client.health().policy_version)
        }


def apply_sampler_outputs(
    batch: KVBatchMeta, metrics: dict, *, advantages: bool, weights: bool
) -> KVBatchMeta:
    """After verl's advantage step: service advantages (optional) and weights into TQ.

    - ``advantages``: ``advantages`` and ``returns`` become the service's advantage on
      every response token;
    - ``weights``: ``rollout_is_weights`` = what verl left there x the service's weights.

    Padding rows verl added to fill mini-batches (response_mask 0) stay 0.
    """
    if not (advantages or weights):
        return batch
    fields = ["response_mask", "sampler_advantages", "sampler_weights"]
    if weights:
        fields.append("rollout_is_weights")
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    masks = [m.to(torch.float32) for m in data["response_mask"].unbind()]

    def fit(rows: Any) -> list[torch.Tensor]:
        out = []
        for row, m in zip(rows.unbind(), masks, strict=True):
            row = row.to(torch.float32)[: m.numel()]
            if row.numel() < m.numel():
                row = torch.nn.functional.pad(row, (0, m.numel() - row.numel()))
            out.append(row * m)
        return out

    def nested(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor(rows, layout=torch.jagged)

    update: dict[str, torch.Tensor] = {}
    if advantages:
        adv = fit(data["sampler_advantages"])
        update["advantages"] = nested(adv)
        update["returns"] = nested([a.clone() for a in adv])
    if weights:
        w = [
            a * b
            for a, b in zip(
                fit(data["rollout_is_weights"]), fit(data["sampler_weights"]), strict=True
            )
        ]
        update["rollout_is_weights"] = nested(w)
        flat = torch.cat([x[m > 0] for x, m in zip(w, masks, strict=True)]) if w else torch.zeros(0)
        if flat.numel():
            metrics[f"{MODE}/is_weight_mean"] = float(flat.mean())
            metrics[f"{MODE}/is_weight_max"] = float(flat.max())
    from tensordict import TensorDict

    tq.kv_batch_put(
        keys=batch.keys,
        partition_id=batch.partition_id,
        fields=TensorDict(update, batch_size=len(batch)),
    )
    return batch
