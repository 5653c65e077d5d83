"""The V1 path end to end, short of the GPU work: sampler -> our manager -> TransferQueue -> verl.

TransferQueue runs on a local 2-CPU Ray instance (it has no in-process mode). The prompts
come from verl's own dataset class and collate function over the pacing file, registered
as ``pending`` the way verl's trainer registers them; what our manager writes is read back
by verl's ReplayBuffer (the async one, which verl picks for any mode but ``sync``, so for
ours), then goes through verl's V1 advantage step and our trainer mode's additions, and is
acked at step end.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest
import torch
from verl_suite import verl_config

from trainer_client.client import SamplerClient
from trainer_client.verl.convert import group_uid, per_token_weights
from trainer_client.verl.pacing import write_pacing_dataset
from trainer_client.verl.settings import MODE

pytestmark = pytest.mark.verl


def _prompts(cfg: Any, toy: Any, tmp_path: Any, count: int, step: int) -> Any:
    """A batch of dataloader prompts as PPOTrainer._next_train_batch builds it, registered as pending."""
    import transfer_queue as tq
    from omegaconf import open_dict
    from transformers import AutoTokenizer
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn

    path = write_pacing_dataset(tmp_path / "pacing.parquet", rows=8)
    with open_dict(cfg):
        cfg.data.train_files = str(path)
    tokenizer = AutoTokenizer.from_pretrained(toy.model_dir)
    dataset = create_rl_dataset(str(path), cfg.data, tokenizer, None, is_train=True)
    batch_dict = collate_fn([dataset[i] for i in range(count)])
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(count)], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", step)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in range(count)]
    tq.kv_batch_put(keys=list(batch["uid"]), partition_id="train", tags=tags)
    return batch


def _replay_buffer() -> Any:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    def refill(count: int) -> None:
        raise AssertionError(f"the replay buffer asked for {count} more prompts")

    return ReplayBufferAsync(
        trainer_mode=MODE,
        trainer_config={},
        max_off_policy_threshold=8,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        refill_fn=refill,
        poll_interval=0.2,
    )


def _trainer(cfg: Any, manager: Any, *, sampler_advantages: bool) -> Any:
    """Our trainer mode as verl builds it, before its worker groups: what its advantage and
    step-end hooks need."""
    from trainer_client.verl.session import VersionMap
    from trainer_client.verl.v1 import SamplerPPOTrainer

    trainer = SamplerPPOTrainer(cfg)
    trainer.session.use_sampler_advantages = sampler_advantages
    trainer.session.versions = VersionMap(0, 0)
    trainer.agent_loop_manager = manager
    trainer.global_steps = 1
    trainer.timing_raw = {}
    return trainer


@pytest.mark.parametrize("which", ["grpo", "global"])
def test_manager_groups_through_replay_buffer_and_advantages(
    which, request, ray_tq, toy, tmp_path
) -> None:
    import transfer_queue as tq

    from trainer_client.verl.v1 import SamplerAgentLoopManager, uids_of

    server = request.getfixturevalue("sampler" if which == "grpo" else "reinforce_ada_sampler")
    count, n, step = 2, 4, 1
    cfg = verl_config(
        server.url,
        n=n,
        batch=count,
        overrides=["actor_rollout_ref.model.path=/m"],
        consumer=f"tq-{which}",
        weight_sync="none",
    )
    manager = SamplerAgentLoopManager.create(
        config=cfg, llm_client=None, teacher_client=None, reward_loop_worker_handles=None
    )
    prompts = _prompts(cfg, toy, tmp_path, count, step)
    placeholders = list(prompts["uid"])

    manager.generate_sequences(prompts)

    listed = tq.kv_list("train")["train"]
    assert not set(placeholders) & set(listed), "the dataloader's pending prompts must be gone"
    meta, _ = _replay_buffer().sample(global_steps=step, partition_id="train", batch_size=count)
    groups = {group_uid(g): g for g in manager._in_queue.values()}
    assert set(uids_of(meta.keys)) == set(groups) and len(groups) == count
    assert len(meta.keys) == count * n  # whole groups: n sessions each
    assert all(
        tag["status"] == "success" and tag["seq_len"] == tag["prompt_len"] + tag["response_len"]
        for tag in meta.tags
    )

    data = tq.kv_batch_get(keys=meta.keys, partition_id="train")
    for i, key in enumerate(meta.keys):
        uid, session, index = key.rsplit("_", 2)
        group, sample = groups[uid], groups[uid].samples[int(session)]
        assert index == "0" and data["uid"][i] == uid
        assert data["prompts"][i].tolist() == group.prompt_token_ids
        assert data["responses"][i].tolist() == sample.response_token_ids
        assert data["input_ids"][i].tolist() == group.prompt_token_ids + sample.response_token_ids
        torch.testing.assert_close(data["rollout_log_probs"][i], torch.tensor(sample.logprobs))
        assert data["rm_scores"][i][-1].item() == pytest.approx(sample.reward)

    # what the actor's log-prob pass would write (PPOTrainer._compute_old_log_prob) ...
    from tensordict import TensorDict

    old = TensorDict({"old_log_probs": data["rollout_log_probs"]}, batch_size=len(meta.keys))
    tq.kv_batch_put(keys=meta.keys, partition_id="train", fields=old)
    # ... then verl's V1 advantage step (PPOTrainer._compute_advantage) plus our trainer mode's part
    trainer = _trainer(cfg, manager, sampler_advantages=(which == "global"))
    metrics: dict = {}
    trainer._compute_advantage(meta, metrics)
    out = tq.kv_batch_get(
        keys=meta.keys,
        partition_id="train",
        select_fields=["advantages", "rollout_is_weights", "response_mask"],
    )
    for i, key in enumerate(meta.keys):
        uid, session, _ = key.rsplit("_", 2)
        sample = groups[uid].samples[int(session)]
        mask = out["response_mask"][i].float()
        torch.testing.assert_close(
            out["advantages"][i], sample.advantage * mask, atol=1e-5, rtol=1e-5
        )
        weights = torch.tensor(per_token_weights(sample))
        torch.testing.assert_close(
            out["rollout_is_weights"][i], weights * mask, atol=1e-6, rtol=1e-6
        )
    if which == "global":
        # per weighs each sample by (|A| + 1e-8) ** 0.5, scaled by one factor per frame: within a
        # group the weight over that priority is one number. (A frame whose |A| are all equal,
        # as when every group is half right, is left at weight 1: that is per's answer too.)
        for group in groups.values():
            scaled = [s.weight / (abs(s.advantage) + 1e-8) ** 0.5 for s in group.samples]
            assert max(scaled) == pytest.approx(min(scaled), rel=1e-4), (
                f"per's weights do not follow |A|**0.5 in group {group.group_id}"
            )

    # step end: acked (weights are not pushed here: weight_sync=none; test_weights pushes them)
    trainer._step_keys = list(meta.keys)
    trainer.on_step_end()
    assert manager.groups_acked == count and manager.unacked == 0
    assert trainer._pending_sync_metrics[f"{MODE}/groups_acked"] == count
    assert (
        SamplerClient(server.url).ack([g.delivery_id for g in groups.values()]).acked == 0
    )  # already gone
    tq.kv_clear(keys=meta.keys, partition_id="train")


def test_validation_batches_are_refused(ray_tq, sampler) -> None:
    from verl.utils import tensordict_utils as tu

    from trainer_client.verl.v1 import SamplerAgentLoopManager

    cfg = verl_config(sampler.url, overrides=["actor_rollout_ref.model.path=/m"])
    manager = SamplerAgentLoopManager(cfg)
    batch = tu.get_tensordict({"uid": np.array(["x"], dtype=object)})
    tu.assign_non_tensor_data(batch, "validate", True)
    with pytest.raises(RuntimeError, match="does not run validation generations"):
        manager.generate_sequences(batch)
