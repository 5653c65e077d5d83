"""Group building and batch policies without a model: hand-computed expectations.

Every expected number below is worked out in the comment next to it from the rule's
definition, not from the functions under test.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import pytest
from support import group, sample

from sampler_service.backends.base import Completion
from sampler_service.config import SamplerConfig
from sampler_service.dataset import PromptRow
from sampler_service.grouping import (
    TOO_FEW_SAMPLES,
    apply_batch_policies,
    build_group,
    downsampled_tokens,
    kept_version_min,
    new_id,
    on_one_prompt,
)
from sampler_service.replay import Replayed
from sampler_service.verifiers.base import Verdict
from strategies import reweighting, selection
from trainer_client.contract.protocol import Group
from trainer_client.contract.wire import pack_group, unpack_group

ROW = PromptRow(id="p1", prompt="1+1=", answer="2", domain="add1", token_ids=[5, 6], text="1+1=")


def _answers(
    rewards: list[float], versions: list[int] | None = None, lengths: list[int] | None = None
) -> tuple[list[Completion], list[Verdict]]:
    versions = versions or [0] * len(rewards)
    lengths = lengths or [2] * len(rewards)
    completions = [
        Completion(list(range(n)), [-0.1] * n, f"a{i}", "stop", v)
        for i, (n, v) in enumerate(zip(lengths, versions, strict=True))
    ]
    return completions, [Verdict(r, "boom" if r < 0 else None) for r in rewards]


def _build(rewards: list[float], **cfg: Any) -> Any:
    completions, verdicts = _answers(rewards, cfg.pop("versions", None), cfg.pop("lengths", None))
    replay = cfg.pop("replay", None)
    counter = itertools.count()
    config = SamplerConfig(**cfg)
    return build_group(
        replay=replay,
        row=ROW,
        cfg=config,
        config_version=7,
        group_policies=config.policy_set().group,
        completions=completions,
        verdicts=verdicts,
        n_pos=sum(r > 0.5 for r in rewards),
        stop_reason="rule",
        make_id=lambda: f"id{next(counter)}",
    )


def test_balanced_downsample_with_global_baseline() -> None:
    # Answers 0..5 with rewards 0 1 0 0 1 0, versions 0 0 1 1 1 1. Ties are broken newest
    # weights first, then in generation order: 2, 3, 4, 5, 0, 1. Positives in that order
    # {4, 1}, negatives {2, 3, 5, 0}: tp = min(4 // 2, 2) = 2, tn = min(4 - 2, 4) = 2 ->
    # kept 1, 2, 3, 4 (answer 0, first in generation order but of version 0, is left out).
    # Global baseline over all six: 2/6 = 1/3, no std division -> 2/3, -1/3, -1/3, 2/3.
    result = _build(
        [0, 1, 0, 0, 1, 0], group_size=4, versions=[0, 0, 1, 1, 1, 1], advantage="global"
    )
    g = result.group
    assert result.drop_reason is None
    assert [s.response_text for s in g.samples] == ["a1", "a2", "a3", "a4"]
    assert [s.advantage for s in g.samples] == pytest.approx([2 / 3, -1 / 3, -1 / 3, 2 / 3])
    # Mixers see mean |A| of the down-sampled group: (1/3 + 2/3 + 1/3 + 2/3) / 4 = 1/2.
    assert result.mean_abs_advantage == pytest.approx(0.5)
    # Stats cover all six answers: mean 1/3; ddof-1 variance (2(2/3)^2 + 4(1/3)^2) / 5 = 4/15.
    assert (g.stats.n_generated, g.stats.n_pos, g.stats.n_neg) == (6, 2, 4)
    assert g.stats.reward_mean == pytest.approx(1 / 3)
    assert g.stats.reward_std == pytest.approx(math.sqrt(4 / 15))
    # Kept answers came from versions 0, 1, 1, 1: the one positive of version 0 has to stay.
    assert (g.policy_version_min, g.policy_version_max) == (0, 1)
    assert [s.policy_version for s in g.samples] == [0, 1, 1, 1]
    assert (g.config_version, g.stop_reason, g.prompt_id, g.domain) == (7, "rule", "p1", "add1")
    assert g.prompt_token_ids == [5, 6] and g.answer == "2"
    # Ids come from the injected source: four samples, then the group.
    assert [s.sample_id for s in g.samples] == ["id0", "id1", "id2", "id3"]
    assert g.group_id == "id4"


@pytest.mark.parametrize(
    ("rewards", "versions", "oldest"),
    [
        # A hard prompt: six wrong answers of v0, then a v1 wave with two right: the
        # group keeps 2 right + 2 wrong, all v1; its first wave's answers leave no mark.
        ([0] * 6 + [1, 0, 1, 0], [0] * 6 + [1] * 4, 1),
        # Its only right answer is of v0: kept (down-sampling needs it), so the group is v0.
        ([1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1], 0),
        ([0, 0], [3, 4], 3),  # fewer answers than a group: every one is kept
        ([], [], None),  # nothing counted yet
    ],
)
def test_the_version_a_group_would_have_is_its_kept_answers_oldest(
    rewards: list[float], versions: list[int], oldest: int | None
) -> None:
    """`kept_version_min` is the `policy_version_min` `build_group` gives the same answers
    (what the hand-out hold asks of a prompt still sampling)."""
    completions, verdicts = _answers(rewards, versions)
    cfg = SamplerConfig(group_size=4)
    assert kept_version_min(cfg, completions, verdicts) == oldest
    if len(rewards) >= 2:
        assert _build(rewards, group_size=4, versions=versions).group.policy_version_min == oldest


def test_a_group_says_what_all_its_answers_cost_and_what_down_sampling_left_out() -> None:
    # Answers of 1, 2, 4, 8, 16, 32 tokens, rewards 0 1 0 0 1 0, all of version 0:
    # balanced down-sampling keeps 0, 1, 2, 4 (generation order breaks the ties): 1 + 2 + 4 + 16 = 23 tokens; it leaves out answers 3
    # and 5: 8 + 32 = 40. The six cost 63, and the count survives the wire (a restarted
    # sampler reads its stored groups back from their bytes).
    g = _build([0, 1, 0, 0, 1, 0], group_size=4, lengths=[1, 2, 4, 8, 16, 32]).group
    assert g.stats.sampled_tokens == 63
    assert downsampled_tokens(g) == 40
    assert downsampled_tokens(unpack_group(pack_group(g))) == 40
    # Six wrong answers of the same lengths and a replayed right one of 3 tokens in the
    # last kept place: the group's own answers are 0, 1, 2 (7 tokens); the replay was
    # paid for by an earlier group, so 63 - 7 = 56 were left out.
    earlier = Completion([7, 8, 9], [-0.5, -0.25, -0.125], "old", "stop", 2)
    replayed = _build(
        [0] * 6, group_size=4, lengths=[1, 2, 4, 8, 16, 32], replay=Replayed(earlier, 1.0)
    ).group
    assert (replayed.stats.sampled_tokens, downsampled_tokens(replayed)) == (63, 56)


def test_maxvar_keeps_half_and_recomputes_grpo_advantages() -> None:
    # Eight answers 1 0 1 1 0 1 1 1, all kept (group_size 0). maxvar keeps
    # m = max(2, round(0.5 * 8)) = 4 of maximal variance: two 1s and both 0s, earliest
    # first -> answers 0, 1, 2, 4 with rewards 1 0 1 0. GRPO on them: mean 1/2, ddof-1
    # std sqrt(1/3), so A = +-(1/2) / sqrt(1/3) = +-sqrt(3)/2.
    result = _build(
        [1, 0, 1, 1, 0, 1, 1, 1],
        rule="fixed",
        group_size=0,
        n_max=8,
        wave_size=8,
        downsample="none",
        advantage="grpo",
        group_policies=[{"name": "maxvar", "params": {"keep_fraction": 0.5}}],
    )
    g = result.group
    assert [s.response_text for s in g.samples] == ["a0", "a1", "a2", "a4"]
    half_root3 = math.sqrt(3) / 2
    assert [s.advantage for s in g.samples] == pytest.approx(
        [half_root3, -half_root3, half_root3, -half_root3], rel=1e-5
    )
    # Before maxvar the mixer saw GRPO over all eight: mean 3/4, ddof-1 std sqrt(3/14);
    # |A| is 1/4 / std for the six 1s and 3/4 / std for the two 0s: mean 3/8 / std.
    assert result.mean_abs_advantage == pytest.approx(0.375 / math.sqrt(3 / 14), rel=1e-5)


def test_est_advantage_scales_by_the_root_of_the_mean_reward() -> None:
    # Rewards 1 0 0 0: rbar = 1/4, A = (r - 1/4) / sqrt(1/4) = 3/2, -1/2, -1/2, -1/2.
    result = _build(
        [1, 0, 0, 0], rule="est", group_size=0, downsample="none", advantage="est", n_max=8
    )
    assert [s.advantage for s in result.group.samples] == pytest.approx(
        [1.5, -0.5, -0.5, -0.5], rel=1e-5
    )


def test_group_policy_drop_is_named_and_mixer_signal_kept() -> None:
    result = _build([1, 1, 1, 1], group_policies=[{"name": "nonzero_std"}])
    assert result.group is None and result.drop_reason == "nonzero_std"
    assert result.mean_abs_advantage == 0.0  # all equal: every A is 0


def test_gfpo_keeping_one_sample_drops_the_group() -> None:
    # gfpo k=1 leaves a single sample: a singleton carries no comparison.
    result = _build(
        [1, 0, 1, 0], group_size=4, group_policies=[{"name": "gfpo", "params": {"k": 1}}]
    )
    assert result.group is None and result.drop_reason == TOO_FEW_SAMPLES


def test_gfpo_short_keeps_the_shortest_answers() -> None:
    # Lengths 5 3 4 1 with gfpo short k=2 keep answer 3 (1 token) and answer 1
    # (3 tokens), in generation order 1, 3, rewards 0 and 1. Global baseline over all
    # four answers (1 0 1 1): 3/4 -> A = -3/4, 1/4.
    result = _build(
        [1, 0, 1, 1],
        group_size=0,
        downsample="none",
        lengths=[5, 3, 4, 1],
        group_policies=[{"name": "gfpo", "params": {"k": 2, "metric": "short"}}],
    )
    assert [s.response_text for s in result.group.samples] == ["a1", "a3"]
    assert [s.advantage for s in result.group.samples] == pytest.approx([-0.75, 0.25])


def test_mismatched_answers_and_verdicts_are_refused() -> None:
    completions, verdicts = _answers([1, 0])
    with pytest.raises(ValueError):
        build_group(
            row=ROW,
            cfg=SamplerConfig(),
            config_version=0,
            group_policies=(),
            completions=completions,
            verdicts=verdicts[:1],
            n_pos=1,
            stop_reason="rule",
        )


def _group(gid: str, advantages: list[float], logprobs: list[list[float]] | None = None) -> Group:
    logprobs = logprobs or [[-0.5, -0.5]] * len(advantages)
    answers = [
        sample(list(range(len(lp))), lp, reward=float(a > 0), advantage=a)
        for a, lp in zip(advantages, logprobs, strict=True)
    ]
    return Group.model_validate(group(gid, answers))


def test_topk_drops_a_group_and_per_weights_have_mean_one() -> None:
    # Frame of 8 samples; topk 0.5 keeps floor(0.5 * 8 + 0.5) = 4 by |A|: all of A
    # (2, 2, 1, 1 > 0.5) and none of B, which is dropped and named.
    a = _group("A", [2.0, -2.0, 1.0, -1.0])
    b = _group("B", [0.5, -0.5, 0.1, -0.1])
    frame = apply_batch_policies(
        [a, b],
        [selection.build("topk", fraction=0.5)],
        [reweighting.build("per", alpha=0.5)],
        batch_id="f1",
    )
    assert frame.kept == [a] and frame.dropped == [(b, "topk")]
    # per: w = |A|^0.5 = sqrt2, sqrt2, 1, 1, mean (sqrt2 + 1) / 2; normalised:
    # 2 sqrt2 / (sqrt2 + 1) = 4 - 2 sqrt2 and 2 / (sqrt2 + 1) = 2 sqrt2 - 2.
    hi, lo = 4 - 2 * math.sqrt(2), 2 * math.sqrt(2) - 2
    assert [s.weight for s in a.samples] == pytest.approx([hi, hi, lo, lo])
    assert (a.batch_id, a.batch_index, a.batch_size) == ("f1", 0, 1)


def test_token_weights_from_logprobs_and_frame_positions() -> None:
    # ar alpha 0.5: w_t = 0.5 exp(lp) + 0.5. Token logprobs ln 0.5 and 0 give 0.75 and
    # 1; mean over the frame's tokens 0.875 -> 6/7 and 8/7.
    lps = [[math.log(0.5), 0.0], [math.log(0.5), 0.0]]
    groups = [_group("A", [1.0, -1.0], lps), _group("B", [1.0, -1.0], lps)]
    frame = apply_batch_policies(groups, [], [reweighting.build("ar", alpha=0.5)], batch_id="f2")
    assert frame.dropped == []
    assert [(g.batch_index, g.batch_size, g.batch_id) for g in frame.kept] == [
        (0, 2, "f2"),
        (1, 2, "f2"),
    ]
    for g in frame.kept:
        for s in g.samples:
            assert s.token_weights == pytest.approx([6 / 7, 8 / 7])
            assert s.weight == pytest.approx(1.0)


def test_a_replay_takes_the_last_kept_place_of_an_all_wrong_group() -> None:
    # Six wrong answers at version 5; balanced down-sampling of all-negative answers keeps
    # the first four (0, 1, 2, 3); the replay (reward 1, version 2) takes the place of 3.
    # GRPO baseline over the kept rewards 0 0 0 1: mean 1/4, no std division ->
    # -1/4, -1/4, -1/4, 3/4.
    earlier = Completion([7, 8, 9], [-0.5, -0.25, -0.125], "old", "stop", 2)
    result = _build(
        [0] * 6,
        group_size=4,
        versions=[5] * 6,
        advantage="grpo",
        norm_by_std=False,
        replay=Replayed(earlier, 1.0),
    )
    g = result.group
    assert [s.response_text for s in g.samples] == ["a0", "a1", "a2", "old"]
    assert [s.replayed for s in g.samples] == [False, False, False, True]
    assert [s.advantage for s in g.samples] == pytest.approx([-0.25, -0.25, -0.25, 0.75])
    # The replayed answer keeps what it was sampled with.
    old = g.samples[-1]
    assert (old.policy_version, old.reward, old.logprobs) == (2, 1.0, [-0.5, -0.25, -0.125])
    assert old.response_token_ids == [7, 8, 9]
    # The group's versions and counts are its own answers': all six at version 5, none
    # right, mean 0; the mixers' signal is the group's own (all wrong: 0).
    assert (g.policy_version_min, g.policy_version_max) == (5, 5)
    assert (g.stats.n_generated, g.stats.n_pos, g.stats.reward_mean) == (6, 0, 0.0)
    assert result.mean_abs_advantage == 0.0


def test_a_replay_takes_the_place_of_the_oldest_kept_answer_across_versions() -> None:
    # Five wrong answers of versions 0 0 1 1 1. Newest weights first: 2, 3, 4, 0, 1;
    # all negative, balanced keeps the first four in that order (2, 3, 4, 0), and the
    # replay takes the place of the one preferred least: answer 0, of version 0. The
    # group's versions are its own answers' (2, 3, 4): 1..1, not 0..1.
    earlier = Completion([7], [-0.5], "old", "stop", 0)
    g = _build([0] * 5, group_size=4, versions=[0, 0, 1, 1, 1], replay=Replayed(earlier, 1.0))
    g = g.group
    assert [s.response_text for s in g.samples] == ["a2", "a3", "a4", "old"]
    assert (g.policy_version_min, g.policy_version_max) == (1, 1)


def test_a_replay_with_the_global_baseline_counts_as_one_more_answer() -> None:
    # Two wrong answers (group_size 2) and the replay: the global baseline is the mean
    # over the three rewards 0 0 1 = 1/3; kept 0 and the replay -> -1/3, 2/3.
    earlier = Completion([1], [-1.0], "old", "stop", 0)
    result = _build([0, 0], group_size=2, advantage="global", replay=Replayed(earlier, 1.0))
    assert [s.advantage for s in result.group.samples] == pytest.approx([-1 / 3, 2 / 3])


def test_a_replay_into_a_group_with_right_answers_is_refused() -> None:
    earlier = Completion([1], [-1.0], "old", "stop", 0)
    with pytest.raises(ValueError, match="1 right answers"):
        _build([0, 1], group_size=2, replay=Replayed(earlier, 1.0))


def test_episodes_from_their_own_prompts_share_the_groups_prompt() -> None:
    """Episodes whose environment rendered their own first prompt: where all agree, it is
    the group's prompt; where they differ, the group's is what they share and each
    answer's remainder leads its response as context (mask 0, logprob 0.0)."""
    same = [
        Completion([9], [-0.5], "a", "stop", prompt_token_ids=[5, 6, 7], prompt_text="567")
        for _ in range(2)
    ]
    prompt, text, answers = on_one_prompt(ROW, same)
    assert (prompt, text, answers) == ([5, 6, 7], "567", same)
    # A single answer (no prompt of its own) continues the row's.
    assert on_one_prompt(ROW, [Completion([9], [-0.5], "a", "stop")])[:2] == ([5, 6], "1+1=")

    differ = [
        Completion([9], [-0.5], "a", "stop", loss_mask=[1], prompt_token_ids=[5, 6, 7, 8]),
        Completion([9, 3], [-0.5, -0.2], "b", "stop", prompt_token_ids=[5, 6, 4]),
    ]
    prompt, text, answers = on_one_prompt(ROW, differ)
    assert prompt == [5, 6] and text is None
    assert [a.token_ids for a in answers] == [[7, 8, 9], [4, 9, 3]]
    assert [a.loss_mask for a in answers] == [[0, 0, 1], [0, 1, 1]]
    assert [a.logprobs for a in answers] == [[0.0, 0.0, -0.5], [0.0, -0.5, -0.2]]
    for answer, own in zip(answers, differ, strict=True):
        assert prompt + answer.token_ids == [*(own.prompt_token_ids or []), *own.token_ids]


def test_ids_are_distinct_128_bit_hex_and_a_forked_child_draws_its_own_prefix() -> None:
    ids = [new_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one id, then out without pytest's teardown
        os.write(write, new_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read)
    os.close(write)
    assert len(child) == 32 and child[:16] != new_id()[:16]
