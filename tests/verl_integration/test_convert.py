"""Groups -> verl's padded batch (DataProto), checked with verl's own code.

- verl's GRPO advantage estimator on the converted batch reproduces the service's
  ``grpo`` advantages (real groups from a running sampler);
- the layout is what verl's loss path reads: verl's ``left_right_2_no_padding`` and
  ``ppo_loss`` consume the batch, and the service weights arrive in the loss as
  ``rollout_is_weights``;
- the V0 trainer's advantage block (verl's compute_advantage, rollout correction) with
  service advantages and weights, and verl's batch metrics on the result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support import group
from verl_suite import lease_groups, verl_config

from trainer_client.contract.protocol import Group, Sample
from trainer_client.verl.convert import (
    GroupSizeError,
    group_uid,
    groups_to_dataproto,
    groups_to_tensors,
)

pytestmark = pytest.mark.verl


def _sample(
    i: int,
    ids: list[int],
    reward: float,
    *,
    weight: float = 1.0,
    token_weights=None,
    adv: float = 0.0,
) -> Sample:
    return Sample(
        sample_id=f"s{i}",
        response_token_ids=ids,
        response_text="",
        logprobs=[-0.1 * (k + 1) for k in range(len(ids))],
        reward=reward,
        finish_reason="stop",
        policy_version=3,
        advantage=adv,
        weight=weight,
        token_weights=token_weights,
    )


def _group(gid: str, prompt: list[int], samples: list[Sample]) -> Group:
    return Group.model_validate(
        group(
            gid,
            [s.model_dump() for s in samples],
            prompt=prompt,
            domain="add1",
            answer="3",
            config_version=1,
            policy_version_min=3,
            policy_version_max=3,
            batch_id="frame",
        )
    )


@pytest.fixture(scope="module")
def real_groups(sampler) -> list[Group]:
    # Six groups with at least one whose answers differ (an all-right or all-wrong group has
    # zero advantages, and six of those would leave the advantage checks nothing to compare).
    groups = lease_groups(sampler.url, 24)
    return sorted(groups, key=lambda g: all(s.advantage == 0 for s in g.samples))[:6]


def test_verl_grpo_equals_service_grpo(real_groups: list[Group]) -> None:
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    batch = groups_to_dataproto(real_groups, pad_token_id=0, n=4)
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    out = compute_advantage(
        batch,
        adv_estimator=core_algos.AdvantageEstimator.GRPO,
        num_repeat=4,
        norm_adv_by_std_in_grpo=True,
    )
    service = torch.tensor([s.advantage for g in real_groups for s in g.samples])
    mask = out.batch["response_mask"].bool()
    adv = out.batch["advantages"]
    first = mask.float().argmax(dim=1)
    torch.testing.assert_close(
        adv[torch.arange(len(service)), first], service, atol=1e-5, rtol=1e-5
    )
    # the same value on every response token, zero on padding
    torch.testing.assert_close(adv, service[:, None] * mask, atol=1e-5, rtol=1e-5)
    # and verl's estimator called directly on the batch's rewards and uids
    direct, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["token_level_scores"],
        response_mask=batch.batch["response_mask"],
        index=batch.non_tensor_batch["uid"],
    )
    torch.testing.assert_close(direct, adv)
    assert any(abs(float(a)) > 0.1 for a in service), "degenerate test data: all advantages 0"


def test_layout_is_verls(real_groups: list[Group]) -> None:
    from verl.trainer.ppo.ray_trainer import compute_response_mask
    from verl.utils.model import compute_position_id_with_mask

    batch = groups_to_dataproto(real_groups, pad_token_id=0, n=4)
    t, nt = batch.batch, batch.non_tensor_batch
    rows = [(g, s) for g in real_groups for s in g.samples]
    B, P, R = len(rows), t["prompts"].shape[1], t["responses"].shape[1]
    assert (
        t["input_ids"].shape == t["attention_mask"].shape == t["position_ids"].shape == (B, P + R)
    )
    for key in (
        "responses",
        "response_mask",
        "rollout_log_probs",
        "rm_scores",
        "token_level_scores",
        "rollout_is_weights",
    ):
        assert t[key].shape == (B, R), key
    for i, (g, s) in enumerate(rows):
        p, r = len(g.prompt_token_ids), len(s.response_token_ids)
        assert t["prompts"][i, P - p :].tolist() == g.prompt_token_ids  # left-padded
        assert (
            t["attention_mask"][i, : P - p].sum() == 0 and t["attention_mask"][i, P - p : P].all()
        )
        assert t["responses"][i, :r].tolist() == s.response_token_ids  # right-padded
        assert t["response_mask"][i].tolist() == [1] * r + [0] * (R - r)
        torch.testing.assert_close(t["rollout_log_probs"][i, :r], torch.tensor(s.logprobs))
        assert t["rm_scores"][i, r - 1] == pytest.approx(s.reward) and t["rm_scores"][
            i
        ].sum() == pytest.approx(s.reward)
        assert nt["uid"][i] == group_uid(g) and "_" not in nt["uid"][i]
    torch.testing.assert_close(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    torch.testing.assert_close(
        t["position_ids"], compute_position_id_with_mask(t["attention_mask"])
    )
    torch.testing.assert_close(compute_response_mask(batch), t["response_mask"])
    assert list(nt["multi_modal_inputs"]) == [{}] * B
    assert len(set(nt["uid"])) == len(real_groups)


def test_service_weights_reach_verls_loss() -> None:
    """verl's ppo_loss multiplies the per-token loss by rollout_is_weights = sample x token weights."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    groups = [
        _group(
            "a1",
            [5, 6, 7],
            [
                _sample(0, [1, 2, 3], 1.0, weight=2.0, token_weights=[1.0, 0.5, 1.5], adv=1.0),
                _sample(1, [4], 0.0, weight=0.5, adv=-1.0),
            ],
        ),
        _group(
            "b2", [8], [_sample(2, [9, 9], 1.0, adv=0.5), _sample(3, [], 0.0, weight=3.0, adv=-0.5)]
        ),
    ]
    batch = groups_to_dataproto(groups, pad_token_id=0, n=2)
    w = batch.batch["rollout_is_weights"]
    torch.testing.assert_close(w[0], torch.tensor([2.0, 1.0, 3.0]))
    torch.testing.assert_close(w[1], torch.tensor([0.5, 0.0, 0.0]))
    # an empty response is one masked padding token: it carries no loss and no weight
    assert batch.batch["response_mask"][3].tolist() == [0, 0, 0] and w[3].sum() == 0

    actor = omega_conf_to_dataclass(
        verl_config(
            "http://unused:1", n=2, overrides=["actor_rollout_ref.model.path=/m"]
        ).actor_rollout_ref.actor
    )

    def loss_with(weights: torch.Tensor) -> float:
        td = batch.to_tensordict()
        td["rollout_is_weights"] = weights
        td["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
        td["advantages"] = batch.batch["sampler_advantages"]
        td = left_right_2_no_padding(td)
        lengths = batch.batch["attention_mask"].sum(dim=1).tolist()
        # current policy == behaviour policy: ratio 1, the loss is -sum(A * w) / tokens
        per_row = []
        for i, n_tok in enumerate(lengths):
            lp = torch.zeros(int(n_tok))
            r = int(batch.batch["response_mask"][i].sum())
            p_len = int(batch.batch["attention_mask"][i, : batch.batch["prompts"].shape[1]].sum())
            lp[p_len - 1 : p_len - 1 + r] = batch.batch["rollout_log_probs"][i, :r]
            per_row.append(lp)
        log_probs = torch.nested.as_nested_tensor(per_row, layout=torch.jagged)
        n_tokens = int(batch.batch["response_mask"].sum())
        tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=n_tokens, global_batch_size=len(batch))
        loss, _ = ppo_loss(actor, {"log_probs": log_probs}, td)
        return float(loss)

    mask = batch.batch["response_mask"].float()
    adv = batch.batch["sampler_advantages"]
    expected = float(-(adv * w * mask).sum() / mask.sum())
    assert loss_with(w) == pytest.approx(expected, abs=1e-6)
    unweighted = float(-(adv * mask).sum() / mask.sum())
    assert loss_with(torch.ones_like(w)) == pytest.approx(unweighted, abs=1e-6)
    assert expected != pytest.approx(unweighted)


def test_group_size_must_be_rollout_n() -> None:
    group = _group("c3", [1, 2], [_sample(0, [1], 1.0), _sample(1, [2], 0.0), _sample(2, [3], 0.0)])
    with pytest.raises(GroupSizeError, match=r"3 samples but actor_rollout_ref.rollout.n is 4"):
        groups_to_tensors([group], 0, n=4)


def test_v0_advantage_block_with_service_outputs(reinforce_ada_sampler) -> None:
    """The V0 trainer's advantage block: verl's pipeline, then the service's advantages and weights."""
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    from trainer_client.verl.v0 import compute_advantages

    groups = lease_groups(reinforce_ada_sampler.url, 4)[:4]
    assert all(len(g.samples) == 4 for g in groups)
    cfg = verl_config(
        reinforce_ada_sampler.url,
        n=4,
        overrides=[
            "actor_rollout_ref.model.path=/m",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=2.0",
        ],
    )
    batch = groups_to_dataproto(groups, 0, n=4)
    # the actor's recomputed log-probs: a little off the sampler's, so verl's IS weights are not 1
    gen = torch.Generator().manual_seed(0)
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"] + 0.05 * torch.randn(
        batch.batch["rollout_log_probs"].shape, generator=gen
    )
    metrics: dict = {}
    out = compute_advantages(batch, cfg, metrics, sampler_advantages=True, sample_weights=True)
    mask = out.batch["response_mask"].float()
    service_adv = torch.tensor([s.advantage for g in groups for s in g.samples])
    torch.testing.assert_close(out.batch["advantages"], service_adv[:, None] * mask)
    # verl's token-level IS weight, truncated at 2, times the service weight (from the per policy)
    ratio = torch.exp(out.batch["old_log_probs"] - out.batch["rollout_log_probs"]).clamp(max=2.0)
    service_w = torch.tensor([s.weight for g in groups for s in g.samples])
    torch.testing.assert_close(
        out.batch["rollout_is_weights"], ratio * service_w[:, None] * mask, atol=1e-5, rtol=1e-5
    )
    assert service_w.std() > 0, "the per policy should give unequal weights"
    assert any(k.startswith("rollout_corr/") for k in metrics)
    data_metrics = compute_data_metrics(batch=out, use_critic=False)
    assert data_metrics["critic/score/mean"] == pytest.approx(
        float(np.mean([s.reward for g in groups for s in g.samples]))
    )


def test_an_episode_trains_on_its_sampled_tokens_only() -> None:
    """An episode's observation tokens (loss mask 0) are context in verl's batch: its
    `response_mask` is the loss mask, the reward sits on the last sampled token, verl's
    GRPO advantage is zero on observation tokens, and the record counts verl's turns."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from trainer_client.verl.convert import tq_records

    episode = _sample(0, [1, 2, 3, 4, 5], 1.0, adv=1.0)
    episode.loss_mask, episode.num_turns = [1, 0, 0, 1, 0], 2  # ends on an observation
    group = _group("e1", [5, 6], [episode, _sample(1, [7], 0.0, adv=-1.0)])
    tensors, non_tensors = groups_to_tensors([group], 0, n=2)
    assert tensors["response_mask"][0].tolist() == [1, 0, 0, 1, 0]
    assert tensors["rm_scores"][0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert tensors["sampler_advantages"][0].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert non_tensors["__num_turns__"].tolist() == [4, 2]
    adv, _ = compute_grpo_outcome_advantage(
        tensors["rm_scores"], tensors["response_mask"], non_tensors["uid"]
    )
    assert adv[0, [1, 2, 4]].tolist() == [0.0, 0.0, 0.0] and adv[0, 0] > 0 and adv[0, 3] > 0
    records = tq_records([group], n=2, global_steps=1)
    assert records.fields[0]["response_mask"].tolist() == [1, 0, 0, 1, 0]
    assert records.fields[0]["rm_scores"].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    assert [r["num_turns"] for r in records.fields] == [4, 2]


def test_a_replayed_answer_is_left_out_of_the_loss_unless_kept() -> None:
    """A replayed answer (sampled by an older policy) has response_mask 0 by default, its
    reward still in the group's scores (verl's GRPO baseline sees the right answer);
    kept, it trains with its own rollout log-probs for verl's rollout correction."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from trainer_client.verl.convert import tq_records

    old = _sample(1, [7, 8], 1.0, adv=0.5)
    old.replayed = True
    group = _group("r1", [5, 6], [_sample(0, [9, 9], 0.0, adv=-0.5), old])
    tensors, non_tensors = groups_to_tensors([group], 0, n=2)
    assert tensors["response_mask"].tolist() == [[1, 1], [0, 0]]
    assert tensors["rm_scores"].tolist() == [[0.0, 0.0], [0.0, 1.0]]
    adv, _ = compute_grpo_outcome_advantage(
        tensors["rm_scores"], tensors["response_mask"], non_tensors["uid"]
    )
    assert (adv[0] < 0).all() and (adv[1] == 0).all()  # the fresh wrong answer is pushed down
    assert tq_records([group], n=2, global_steps=1).fields[1]["response_mask"].tolist() == [0, 0]
    kept, _ = groups_to_tensors([group], 0, n=2, drop_replayed=False)
    assert kept["response_mask"].tolist() == [[1, 1], [1, 1]]
    assert kept["rollout_log_probs"][1].tolist() == pytest.approx([-0.1, -0.2])
