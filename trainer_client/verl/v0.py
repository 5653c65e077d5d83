"""verl <= 0.8 (and 0.9's legacy trainer): a `RayPPOTrainer` whose `fit` trains on the sampler's groups.

`SamplerRayPPOTrainer.fit` replaces verl's generate step by: lease ``train_batch_size``
groups from the sampler, convert them to a `DataProto` (trainer_client.verl.convert,
the layout verl's agent loop produces), then run verl's own pipeline on it: old
log-probs, reference log-probs, values, KL-in-reward, rollout correction, the advantage
estimator, critic and actor updates, checkpoints and metrics, all through the trainer's
own methods. At the end of a step the weights go to the sampler and the step's groups
are acked. Service advantages and weights are applied as in the V1 mode
(trainer_client.verl.v1).

Weights leave the actor workers through the ``adaptive_rollout`` checkpoint engine on
verl >= 0.9; on older verl through an actor checkpoint that includes ``hf_model``, which
the sampler then loads (``weight_sync: path``, shared storage) or receives as an upload
(single-file models).

verl's own entry point builds a plain `RayPPOTrainer`; run this one with
``python -m trainer_client.verl.v0 <the same hydra overrides>`` (``trainer.use_v1=False``
on verl 0.9). The rollout engine verl colocates on the actor GPUs in this trainer is
created and put to sleep but never used; give it little memory
(``actor_rollout_ref.rollout.gpu_memory_utilization=0.2``). Creating it needs vLLM in the
trainer's environment (the ``.venv-verl`` environment has none): `main` checks for it
first and exits naming it. The V1 trainer mode (trainer_client.verl.v1) needs no vLLM.
"""

from __future__ import annotations

import logging
import os
from pprint import pprint
from typing import Any

import torch
import verl
from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, apply_kl_penalty, compute_advantage
from verl.utils.debug import marked_timer

from trainer_client.contract.protocol import Group
from trainer_client.verl.convert import groups_to_dataproto
from trainer_client.verl.session import SamplerSession
from trainer_client.verl.settings import (
    MODE,
    IncompatibleSamplerConfig,
    SamplerSettings,
    check_verl_config,
    sampler_metrics,
)

log = logging.getLogger(__name__)

__all__ = ["SamplerRayPPOTrainer", "compute_advantages", "lease_batch_proto", "main"]


def _version_tuple(text: str) -> tuple[int, int]:
    parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in text.split(".")[:2]]
    return parts[0], parts[1]


#: verl >= 0.9 has checkpoint-engine backends on its actor workers.
HAS_CHECKPOINT_ENGINE = _version_tuple(verl.__version__) >= (0, 9)


class SamplerRayPPOTrainer(RayPPOTrainer):
    """RayPPOTrainer fed by the sampler (see the module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        self.settings = SamplerSettings.from_verl_config(config)
        problems = check_verl_config(config)
        if problems:
            raise IncompatibleSamplerConfig(problems)
        if HAS_CHECKPOINT_ENGINE:
            from trainer_client.verl.weights import configure_for_sampler

            configure_for_sampler(config, self.settings)
        elif self.settings.weight_sync != "none":
            from omegaconf import open_dict

            with open_dict(config):
                contents = list(
                    config.actor_rollout_ref.actor.checkpoint.get("save_contents", []) or []
                )
                if "hf_model" not in contents:
                    config.actor_rollout_ref.actor.checkpoint.save_contents = [
                        *contents,
                        "hf_model",
                    ]
        super().__init__(config, *args, **kwargs)
        self.session = SamplerSession(self.settings)
        self.client = self.session.client

    # -- pieces of a step ------------------------------------------------------------------
    def push_weights(self, metrics: dict, *, initial: bool = False) -> None:
        """The actor's weights -> the sampler, as its next policy version."""
        if self.settings.weight_sync == "none":
            return
        if HAS_CHECKPOINT_ENGINE:
            metrics.update(
                self.session.push_weights(self.actor_rollout_wg, self.global_steps, initial=initial)
            )
            return
        version = self.session.next_version(self.global_steps, initial=initial)
        root = self.settings.weights_dir or os.path.join(
            self.config.trainer.default_local_dir, "sampler_weights"
        )
        local = os.path.join(root, f"policy_v{version:08d}")
        self.actor_rollout_wg.save_checkpoint(
            local, None, self.global_steps, max_ckpt_to_keep=self.settings.keep_weight_files
        )
        hf_dir = os.path.join(local, "huggingface")
        if self.settings.weight_sync == "path":
            reply = self.client.load_weights(hf_dir, version)
        else:
            reply = self.client.push_weights(hf_dir, version)
        assert self.session.versions is not None
        self.session.versions.note_pushed(version, self.global_steps)
        metrics[f"{MODE}/policy_version"] = float(reply.policy_version)

    # -- the loop --------------------------------------------------------------------------
    def fit(self) -> None:
        from omegaconf import OmegaConf
        from verl.trainer.ppo.metric_utils import (
            compute_data_metrics,
            compute_throughout_metrics,
            compute_timing_metrics,
        )
        from verl.utils.tracking import Tracking

        tracker = Tracking(
            project_name=self.config.trainer.project_name,
            experiment_name=self.config.trainer.experiment_name,
            default_backend=self.config.trainer.logger,
            config=OmegaConf.to_container(self.config, resolve=True),
        )
        self.global_steps = 0
        self._load_checkpoint()
        self.session.start(
            self.config,
            global_steps=self.global_steps,
            use_critic=self.use_critic,
            step_groups=int(self.config.data.train_batch_size),
        )
        if self.session.initial_push_due(self.global_steps):
            self.push_weights({}, initial=True)
        if self.config.trainer.get("val_before_train", True):
            tracker.log(
                data=sampler_metrics(self.client.stats(), prefix="val-aux"), step=self.global_steps
            )
        self.global_steps += 1
        while self.global_steps <= self.total_training_steps:
            metrics: dict[str, Any] = {}
            timing_raw: dict[str, float] = {}
            is_last_step = self.global_steps >= self.total_training_steps
            with marked_timer("step", timing_raw):
                with marked_timer("gen", timing_raw, color="red"):
                    groups = self.session.source.take(int(self.config.data.train_batch_size))
                    batch = lease_batch_proto(
                        groups,
                        self.config,
                        self.tokenizer,
                        self.global_steps,
                        sample_weights=self.settings.use_sample_weights,
                        drop_replayed=self.settings.replayed == "drop",
                    )
                batch = self.train_step(batch, metrics, timing_raw)
                if self.config.trainer.save_freq > 0 and (
                    is_last_step or self.global_steps % self.config.trainer.save_freq == 0
                ):
                    with marked_timer("save_checkpoint", timing_raw, color="green"):
                        self._save_checkpoint()
                with marked_timer("update_weights", timing_raw, color="red"):
                    self.push_weights(metrics)
                self.session.source.ack(groups)
            metrics.update(
                {
                    "training/global_step": self.global_steps,
                    f"{MODE}/groups_acked": float(len(groups)),
                }
            )
            metrics.update(compute_data_metrics(batch=batch, use_critic=self.use_critic))
            metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing_raw))
            metrics.update(
                compute_throughout_metrics(
                    batch=batch,
                    timing_raw=timing_raw,
                    n_gpus=self.resource_pool_manager.get_n_gpus(),
                )
            )
            try:
                metrics.update(sampler_metrics(self.client.stats()))
            except Exception as exc:  # metrics only  # noqa: BLE001
                log.warning("sampler stats unavailable: %s", exc)
            tracker.log(data=metrics, step=self.global_steps)
            self.global_steps += 1
        pprint(f"trained {self.global_steps - 1} steps on the sampler's groups")

    def train_step(self, batch: DataProto, metrics: dict, timing_raw: dict) -> DataProto:
        """verl's step from "a generated batch" on: log-probs, advantages, critic and actor updates."""
        batch.meta_info["global_token_num"] = torch.sum(
            batch.batch["attention_mask"], dim=-1
        ).tolist()
        if self.config.trainer.get("balance_batch", True):
            self._balance_batch(batch, metrics=metrics)
            batch.meta_info["global_token_num"] = torch.sum(
                batch.batch["attention_mask"], dim=-1
            ).tolist()
        rollout_corr = self.config.algorithm.get("rollout_correction", None)
        if rollout_corr and rollout_corr.get("bypass_mode", False):
            from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

            apply_bypass_mode(
                batch=batch,
                rollout_corr_config=rollout_corr,
                policy_loss_config=self.config.actor_rollout_ref.actor.policy_loss,
            )
        else:
            with marked_timer("old_log_prob", timing_raw, color="blue"):
                old_log_prob, _mfu = self._compute_old_log_prob(batch)
                old_log_prob.batch.pop("entropys", None)
                batch = batch.union(old_log_prob)
        if self.use_reference_policy:
            with marked_timer("ref", timing_raw, color="olive"):
                batch = batch.union(self._compute_ref_log_prob(batch))
        if self.use_critic:
            with marked_timer("values", timing_raw, color="cyan"):
                batch = batch.union(self._compute_values(batch))
        with marked_timer("adv", timing_raw, color="brown"):
            batch = compute_advantages(
                batch,
                self.config,
                metrics,
                sampler_advantages=self.session.use_sampler_advantages,
                sample_weights=self.settings.use_sample_weights,
                kl_ctrl=getattr(self, "kl_ctrl_in_reward", None),
            )
        if self.use_critic:
            with marked_timer("update_critic", timing_raw, color="pink"):
                critic_output = self._update_critic(batch)
            metrics.update(_reduce(critic_output.meta_info["metrics"]))
        if self.config.trainer.critic_warmup <= self.global_steps:
            with marked_timer("update_actor", timing_raw, color="red"):
                actor_output = self._update_actor(batch)
            metrics.update(_reduce(actor_output.meta_info["metrics"]))
        return batch


def lease_batch_proto(
    groups: list[Group],
    config: Any,
    tokenizer: Any,
    global_steps: int,
    *,
    sample_weights: bool,
    drop_replayed: bool,
) -> DataProto:
    """Leased groups as verl's DataProto (rollout.n samples each, the rollout temperature)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return groups_to_dataproto(
        groups,
        int(pad or 0),
        n=int(config.actor_rollout_ref.rollout.n),
        sample_weights=sample_weights,
        drop_replayed=drop_replayed,
        meta_info={
            "temperature": config.actor_rollout_ref.rollout.temperature,
            "global_steps": global_steps,
        },
    )


def compute_advantages(
    batch: DataProto,
    config: Any,
    metrics: dict,
    *,
    sampler_advantages: bool,
    sample_weights: bool,
    kl_ctrl: Any = None,
) -> DataProto:
    """verl's reward/KL/rollout-correction/advantage block, then the service's outputs."""
    batch.batch["token_level_scores"] = batch.batch["rm_scores"]
    if config.algorithm.use_kl_in_reward:
        batch, kl_metrics = apply_kl_penalty(
            batch, kl_ctrl=kl_ctrl, kl_penalty=config.algorithm.kl_penalty
        )
        metrics.update(kl_metrics)
    else:
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    rollout_corr = config.algorithm.get("rollout_correction", None)
    bypass = bool(rollout_corr and rollout_corr.get("bypass_mode", False))
    if "rollout_is_weights" in batch.batch:
        batch.batch.pop("rollout_is_weights")  # verl computes its own below, if configured
    if rollout_corr is not None and not bypass:
        from verl.trainer.ppo.rollout_corr_helper import (
            compute_rollout_correction_and_add_to_batch,
        )

        batch, is_metrics = compute_rollout_correction_and_add_to_batch(batch, rollout_corr)
        metrics.update(is_metrics)
    batch = compute_advantage(
        batch,
        adv_estimator=config.algorithm.adv_estimator,
        gamma=config.algorithm.gamma,
        lam=config.algorithm.lam,
        num_repeat=config.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=config.algorithm.get("norm_adv_by_std_in_grpo", True),
        config=config.algorithm,
    )
    return apply_sampler_outputs(
        batch, metrics, advantages=sampler_advantages, weights=sample_weights
    )


def _reduce(metrics: dict) -> dict:
    from verl.utils.metric import reduce_metrics

    return reduce_metrics(metrics)


def apply_sampler_outputs(
    batch: DataProto, metrics: dict, *, advantages: bool, weights: bool
) -> DataProto:
    """Service advantages replace verl's (optional); service weights multiply ``rollout_is_weights``."""
    mask = batch.batch["response_mask"].to(torch.float32)
    if advantages:
        adv = batch.batch["sampler_advantages"].to(torch.float32) * mask
        batch.batch["advantages"] = adv
        batch.batch["returns"] = adv.clone()
    if weights:
        service = batch.batch["sampler_weights"].to(torch.float32) * mask
        current = batch.batch.get("rollout_is_weights", None)
        combined = service if current is None else current.to(torch.float32) * service
        batch.batch["rollout_is_weights"] = combined
        valid = combined[mask > 0]
        if valid.numel():
            metrics[f"{MODE}/is_weight_mean"] = float(valid.mean())
            metrics[f"{MODE}/is_weight_max"] = float(valid.max())
    return batch


# -- entry point ----------------------------------------------------------------------------
def _task_runner_cls() -> Any:
    """verl's TaskRunner as a Ray actor that builds our trainer in place of RayPPOTrainer."""
    import importlib

    import ray

    for name in ("verl.trainer.main_ppo_v0", "verl.trainer.main_ppo"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "TaskRunner") and hasattr(module, "RayPPOTrainer"):
            break
    else:
        raise ImportError(
            "no verl TaskRunner that builds a RayPPOTrainer (verl.trainer.main_ppo_v0 / main_ppo)"
        )
    base = getattr(module.TaskRunner, "__ray_actor_class__", module.TaskRunner)
    module_name = module.__name__

    class SamplerTaskRunner(base):  # type: ignore[misc, valid-type]
        def run(self, config: Any) -> Any:
            target: Any = importlib.import_module(module_name)
            target.RayPPOTrainer = SamplerRayPPOTrainer  # run() builds the trainer by this name
            return super().run(config)

    return ray.remote(SamplerTaskRunner)


#: Why the V0 path cannot start without vLLM, and what to do instead.
VLLM_REQUIRED = (
    "python -m trainer_client.verl.v0 needs vLLM in the trainer's environment: verl's legacy "
    "(DataProto) trainer builds its vLLM rollout on the training GPUs even though the sampler "
    "does all rollout. Install the vLLM build verl supports there (pip install vllm), or use "
    "the V1 trainer mode, which needs no vLLM: deploy/verl/launch.sh trainer "
    f"(python -m verl.trainer.main_ppo ... trainer.v1.trainer_mode={MODE})."
)


def main() -> None:
    """``python -m trainer_client.verl.v0 <hydra overrides>``: verl's main_ppo with our trainer."""
    import importlib.util
    import sys

    if importlib.util.find_spec("vllm") is None:
        sys.exit(f"error: {VLLM_REQUIRED}")
    import hydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")

    @hydra.main(config_path=config_dir, config_name="ppo_trainer", version_base=None)
    def _main(config: Any) -> None:
        from omegaconf import open_dict
        from verl.trainer.main_ppo import run_ppo
        from verl.trainer.ppo.utils import need_critic, need_reference_policy
        from verl.utils.config import validate_config

        with open_dict(config):
            if "use_v1" in config.trainer:
                config.trainer.use_v1 = False
        try:
            from verl.utils.device import auto_set_device

            auto_set_device(config)
        except ImportError:
            pass
        validate_config(
            config=config,
            use_reference_policy=need_reference_policy(config),
            use_critic=need_critic(config),
        )
        run_ppo(config, task_runner_class=_task_runner_cls())

    _main()


if __name__ == "__main__":
    main()
