"""Selection policies: group scope (nonzero_std, difffilter, maxvar, gfpo) and topk."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strategies import advantage, selection
from strategies.views import BatchGroup, BatchView, GroupView


def view(rewards, lengths=None, all_rewards=None, threshold=0.5) -> GroupView:
    lengths = [10] * len(rewards) if lengths is None else lengths
    return GroupView(rewards, lengths, rewards if all_rewards is None else all_rewards, threshold)


def test_nonzero_std_drops_constant_groups():
    policy = selection.build("nonzero_std")
    assert policy.scope == "group" and policy.name == "nonzero_std"
    assert policy.select(view([1, 1, 1, 1])) is None
    np.testing.assert_array_equal(policy.select(view([1, 0, 1])), [0, 1, 2])


def test_difffilter_is_strict_and_uses_all_generated_samples():
    policy = selection.build("difffilter")
    assert policy.select(view([1, 0, 0, 0, 0])) is None  # pass rate 0.2: not > 0.2
    np.testing.assert_array_equal(policy.select(view([1, 1, 0, 0, 0])), [0, 1, 2, 3, 4])
    assert policy.select(view([1, 1, 1, 1, 0])) is None  # 0.8: not < 0.8
    # Kept samples are 1 + 1 (rate 0.5), but over all 10 answers the rate is 0.1.
    assert policy.select(view([1, 0], all_rewards=[1] + [0] * 9)) is None


def test_maxvar_keeps_half_rounded_up_and_advantages_are_recomputed():
    policy = selection.build("maxvar")
    rewards = np.array([1, 0, 1, 1, 0, 0.5])
    kept = policy.select(view(rewards))
    np.testing.assert_array_equal(kept, [0, 1, 2])  # m = 3; {1,0,1} ties {1,0,0}: earlier
    full = advantage.compute(rewards, rewards, "grpo")
    sub = advantage.compute(rewards[kept], rewards, "grpo")
    # On the subset [1, 0, 1]: mean 2/3, ddof-1 std sqrt(1/3).
    expected = (np.array([1, 0, 1]) - 2 / 3) / (math.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(sub, expected)
    assert not np.allclose(sub, full[kept])


@pytest.mark.parametrize(("n", "m"), [(2, 2), (3, 2), (5, 3), (7, 4), (8, 4)])
def test_maxvar_size_rounds_half_up_with_minimum_two(n, m):
    rewards = np.linspace(0, 1, n)
    assert len(selection.build("maxvar").select(view(rewards))) == m


def test_gfpo_efficiency_and_short():
    rewards, lengths = np.array([1.0, 0.0, 1.0, 1.0]), np.array([10, 5, 20, 10])
    eff = selection.build("gfpo").select(view(rewards, lengths))
    np.testing.assert_array_equal(eff, [0, 2, 3])  # 1/10, 1/10, 1/20 beat 0/5
    short = selection.build("gfpo", k=2, metric="short").select(view(rewards, [30, 10, 20, 10]))
    np.testing.assert_array_equal(short, [1, 3])
    np.testing.assert_array_equal(selection.build("gfpo", k=9).select(view(rewards)), [0, 1, 2, 3])
    # Advantages are recomputed on the kept subset: grpo over [1, 1, 1] is all zero.
    np.testing.assert_array_equal(advantage.compute(rewards[eff], rewards, "grpo"), [0, 0, 0])
    assert advantage.compute(rewards, rewards, "grpo")[0] > 0


def test_topk_keeps_largest_abs_advantages_across_the_frame():
    policy = selection.build("topk")
    assert policy.scope == "batch"
    batch = BatchView(
        [BatchGroup([1, -1, 0.5, 0], 0.5), BatchGroup([2, 0, 0, 0.1], 0.25), BatchGroup([], 0.0)]
    )
    kept = policy.select(batch)  # S = 8, keep 4: |2|, |1|, |-1|, |0.5|
    np.testing.assert_array_equal(kept[0], [0, 1, 2])
    assert len(kept[1]) == 0  # one sample left: dropped
    assert len(kept[2]) == 0


def test_topk_ties_go_to_batch_index_then_sample_order():
    batch = BatchView([BatchGroup([1, 1, 0], 0.5), BatchGroup([1, 1, 1], 0.5)])
    kept = selection.build("topk", fraction=0.5).select(batch)  # 0.5 * 6 = 3 kept
    np.testing.assert_array_equal(kept[0], [0, 1])
    assert len(kept[1]) == 0  # its first sample was 3rd, alone in its group
    kept = selection.build("topk", fraction=0.75).select(batch)  # 4.5 -> 5 kept
    np.testing.assert_array_equal(kept[0], [0, 1])
    np.testing.assert_array_equal(kept[1], [0, 1, 2])


def test_batch_view_take_keeps_group_positions():
    batch = BatchView([BatchGroup([1, -2, 3], 0.5, [[0.0], [-1.0, -2.0], [-0.5]])])
    taken = batch.take([np.array([0, 2])])
    np.testing.assert_array_equal(taken.groups[0].advantages, [1, 3])
    np.testing.assert_array_equal(taken.groups[0].token_logprobs[1], [-0.5])
    assert taken.n_samples == 2


def test_registry_lists_policies_by_scope():
    assert selection.SELECTIONS.names("group") == ["nonzero_std", "difffilter", "maxvar", "gfpo"]
    assert selection.SELECTIONS.names("batch") == ["topk"]
