"""Batch layout, the assembler's whole-frame rule, and the trainer's loss by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support import group, sample

from sampler_service.config.live import SamplerConfig
from trainer_client.batch import BatchAssembler, collate
from trainer_client.contract.features import LOSS_MASK, NO_TEXT, REPLAYED, VERSION_SPANS
from trainer_client.contract.protocol import Group
from trainer_client.grpo import (
    GRPOTrainer,
    TrainConfig,
    approx_kl,
    grpo_advantages,
    held_pushes,
    lag_warning,
    ppo_clip_loss,
    token_logprobs,
)

pytestmark = pytest.mark.timeout(120)


def G(gid: str, **kw) -> Group:
    return Group.model_validate(group(gid, **kw))


def _right_and_wrong(
    prompt: list[int],
    tokens: list[int],
    logprobs: list[float],
    advantage: float,
    weights: tuple[float, float],
    token_weights: list[float],
) -> Group:
    """Group "a": a right answer of `tokens[:2]` with per-token weights, a wrong one of
    `tokens[2]`, advantages +-`advantage`, answer weights `weights`."""
    right = sample(
        tokens[:2],
        logprobs=logprobs[:2],
        reward=1.0,
        advantage=advantage,
        weight=weights[0],
        token_weights=token_weights,
    )
    wrong = sample(
        tokens[2:], logprobs=logprobs[2:], reward=0.0, advantage=-advantage, weight=weights[1]
    )
    return G("a", prompt=prompt, samples=[right, wrong])


def test_collate_lays_out_rows_right_padded_and_aligned() -> None:
    g1 = _right_and_wrong([1, 2, 3], [4, 5, 6], [-0.1, -0.2, -0.3], 0.5, (2.0, 0.5), [1.5, 0.5])
    g2 = G(
        "b",
        prompt=[7],
        samples=[
            sample(
                [8, 9, 10], logprobs=[-1.0, -2.0, -3.0], reward=1.0, advantage=0.0, policy_version=3
            )
        ],
    )
    b = collate([g1, g2], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 0], [7, 8, 9, 10, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    assert b.response_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 1, 0]]
    assert torch.allclose(b.behaviour_logprobs[0], torch.tensor([0, 0, 0, -0.1, -0.2]))
    assert torch.allclose(b.behaviour_logprobs[2], torch.tensor([0, -1.0, -2.0, -3.0, 0]))
    assert b.token_weights.tolist() == [[0, 0, 0, 1.5, 0.5], [0, 0, 0, 1, 0], [0, 1, 1, 1, 0]]
    assert b.advantages.tolist() == [0.5, -0.5, 0.0]
    assert b.sample_weights.tolist() == [2.0, 0.5, 1.0]
    assert b.group_index.tolist() == [0, 0, 1]
    assert b.policy_versions.tolist() == [0, 0, 3]
    assert b.group_ids == ["a", "b"]
    s = b.summary()
    assert s["samples"] == 3 and s["groups"] == 2
    assert s["kept_fraction"] == pytest.approx(3 / 6)


def test_assembler_takes_whole_frames_only() -> None:
    asm = BatchAssembler(batch_groups=3, pad_id=0)
    frame1 = [G(f"x{i}", batch_id="f1", batch_index=i, batch_size=2) for i in range(2)]
    frame2 = [G(f"y{i}", batch_id="f2", batch_index=i, batch_size=2) for i in range(2)]
    assert asm.add(frame1[1]) is None  # out of order within a frame is fine
    assert asm.add(frame1[0]) is None  # 2 < 3 groups
    assert asm.add(frame2[0]) is None  # frame 2 incomplete: never split
    batch = asm.add(frame2[1])
    assert batch is not None and batch.group_ids == ["x0", "x1", "y0", "y1"]
    assert asm.pending_groups == 0
    single = BatchAssembler(batch_groups=1, pad_id=0)
    assert [b.group_ids for b in single.batches([G("p", batch_id="1"), G("q", batch_id="2")])] == [
        ["p"],
        ["q"],
    ]


def test_ppo_clip_loss_matches_hand_computation() -> None:
    # Two samples; sample 0 has 2 response tokens, sample 1 has 1 (its 2nd column is padding).
    old = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]])
    ratios = torch.tensor([[1.5, 0.7], [0.5, 9.0]])
    new = old + ratios.log()
    adv = torch.tensor([1.0, -2.0])
    weights = torch.tensor([[1.0, 2.0], [0.5, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = ppo_clip_loss(new, old, adv, weights, mask, clip_low=0.2, clip_high=0.28)
    # token (0,0): A=1,  r=1.5 -> max(-1.5, -1.28) = -1.28, w 1   -> -1.28 (clipped)
    # token (0,1): A=1,  r=0.7 -> max(-0.7, -0.8)  = -0.7,  w 2   -> -1.4
    # token (1,0): A=-2, r=0.5 -> max(1.0, 1.6)    = 1.6,   w 0.5 -> 0.8  (clipped)
    expected = (-1.28 - 1.4 + 0.8) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(2 / 3)


def test_grpo_advantages_per_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    index = torch.tensor([0, 0, 0, 1, 1, 2])
    adv = grpo_advantages(rewards, index)
    std0 = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert adv[:3].tolist() == pytest.approx(
        [(2 / 3) / (std0 + 1e-6), -(1 / 3) / (std0 + 1e-6), -(1 / 3) / (std0 + 1e-6)]
    )
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # equal rewards, and a singleton group


def test_approx_kl_is_zero_on_policy_and_positive_off() -> None:
    lp = torch.tensor([[0.0, -1.0, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    assert approx_kl(lp, lp, mask) == 0.0
    assert approx_kl(lp, lp - 0.3, mask) > 0


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2ForCausalLM

    from trainer_client.toy.model import build_config, build_tokenizer

    out = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer()
    cfg = build_config(len(tok), pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_token_logprobs_at_temperature(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    att = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    temps = torch.tensor([0.7, 1.3])
    lp = token_logprobs(model, ids, att, temps)
    with torch.no_grad():
        for row in range(2):
            n = int(att[row].sum())
            logits = model(input_ids=ids[row : row + 1, :n]).logits[0]
            for t in range(1, n):
                want = torch.log_softmax(logits[t - 1] / temps[row], -1)[ids[row, t]]
                assert lp[row, t].item() == pytest.approx(want.item(), abs=1e-5)
    assert lp[:, 0].tolist() == [0.0, 0.0]


class _NoClient:
    def close(self) -> None: ...


def test_train_step_loss_matches_hand_computed_value(tiny_model_dir: Path) -> None:
    """On a tiny batch the trainer's step-1 loss is the hand-computed PPO-clip value.

    At the start of a step the ratio to the proximal policy is 1, so with the service's
    weights and truncated importance weights w_t the PPO-clip token-mean loss is
    -sum_t A_i w_t / #response tokens; each w_t is checked here from the formula.
    """
    cfg = TrainConfig(
        url="http://unused", model=tiny_model_dir, tis_cap=1.5, advantage="server", lr=0.0
    )
    trainer = GRPOTrainer(cfg, client=_NoClient())  # type: ignore[arg-type]
    trainer._temperatures[0] = 0.8
    g = _right_and_wrong([3, 4], [5, 6, 7], [-2.0, -2.5, -0.01], 0.75, (1.2, 0.8), [0.5, 1.5])
    batch = collate([g], pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(
            trainer.model, batch.input_ids, batch.attention_mask, torch.full((2,), 0.8)
        )
    terms = []
    for i, adv, sw, tw, cols in ((0, 0.75, 1.2, [0.5, 1.5], [2, 3]), (1, -0.75, 0.8, [1.0], [2])):
        for col, w_tok in zip(cols, tw, strict=True):
            tis = min(math.exp(lp[i, col].item() - batch.behaviour_logprobs[i, col].item()), 1.5)
            terms.append(-adv * sw * w_tok * tis)
    expected = sum(terms) / 3
    metrics = trainer.train_step(batch)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # lr 0: nothing moved, and the ratio was exactly 1 so nothing was clipped.
    assert metrics["clip_frac"] == 0.0
    assert metrics["version_lag_mean"] == 0.0


def test_the_reference_trainer_declares_no_text_loss_mask_replayed_and_version_spans(
    tiny_model_dir: Path,
) -> None:
    """It trains on token ids alone, so its stream and leases ask for groups without texts,
    on sampled tokens only, so it takes multi-turn episodes, on replayed answers as
    off-policy ones, and on answers of several versions through its importance weights."""
    trainer = GRPOTrainer(TrainConfig(url="http://unused", model=tiny_model_dir))
    declared = f"{LOSS_MASK},{NO_TEXT},{REPLAYED},{VERSION_SPANS}"
    try:
        assert trainer.client.features == declared
        assert trainer.client._query_params(None)["features"] == declared
    finally:
        trainer.client.close()


def _with_replay() -> Group:
    """A fresh wrong answer and a replayed right one, sampled by an older policy with
    logprobs far from the model's (-3.0 and -0.05 per token)."""
    return G(
        "r",
        prompt=[3, 4],
        samples=[
            sample([7, 8], logprobs=[-1.0, -1.0], reward=0.0, advantage=-0.5, policy_version=5),
            sample(
                [5, 6],
                logprobs=[-3.0, -0.05],
                reward=1.0,
                advantage=0.5,
                replayed=True,
                policy_version=0,
            ),
        ],
    )


@pytest.mark.parametrize("mode", ["clip", "drop"])
def test_a_replayed_answer_is_weighted_as_off_policy(tiny_model_dir: Path, mode: str) -> None:
    """At the start of a step the PPO ratio is 1, so the loss is -sum_t A w_t / #tokens:
    the fresh answer's tokens weigh 1 (no tis_cap), the replayed answer's weigh
    min(pi_old / pi_sampled, replay_is_cap) under `clip` and 0 under `drop`."""
    cap = 1.0
    cfg = TrainConfig(
        url="http://unused",
        model=tiny_model_dir,
        advantage="server",
        lr=0.0,
        replayed=mode,
        replay_is_cap=cap,
    )
    trainer = GRPOTrainer(cfg, client=_NoClient())  # type: ignore[arg-type]
    trainer._temperatures[0] = 1.0
    trainer.version = 5  # the fresh answer is current; the replayed one is 5 versions old
    batch = collate([_with_replay()], pad_id=0)
    assert batch.replayed.tolist() == [False, True]
    with torch.no_grad():
        lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, torch.ones(2))
    terms = [0.5, 0.5]  # the fresh answer: -(-0.5) x 1 per token
    for col in (2, 3):
        ratio = math.exp(lp[1, col].item() - batch.behaviour_logprobs[1, col].item())
        terms.append(-0.5 * (min(ratio, cap) if mode == "clip" else 0.0))
    metrics = trainer.train_step(batch)
    assert metrics["loss"] == pytest.approx(sum(terms) / 4, rel=1e-5, abs=1e-7)
    # the sampler's lag is its fresh answers': a replayed one is old by design
    assert metrics["version_lag_max"] == 0.0
    # the check can fail: taken as fresh, every token weighs 1, (0.5 + 0.5 - 0.5 - 0.5) / 4
    fresh = _with_replay()
    fresh.samples[1].replayed = False
    as_fresh = trainer.train_step(collate([fresh], pad_id=0))["loss"]
    assert as_fresh == pytest.approx(0.0, abs=1e-7)
    assert metrics["loss"] > 0.05


def _with_spans(spans: list[list[int]] | None) -> Group:
    """A right answer of four tokens whose sampler logprobs are far from the model's,
    decoded under versions 3 then 4 from its third token (`spans`), and a wrong one."""
    return G(
        "s",
        prompt=[3, 4],
        samples=[
            sample(
                [5, 6, 7, 8],
                logprobs=[-6.0, -0.05, -6.0, -0.05],
                reward=1.0,
                advantage=0.5,
                policy_version=3,
                version_spans=spans,
            ),
            sample([7], logprobs=[-1.0], reward=0.0, advantage=-0.5, policy_version=4),
        ],
    )


def test_an_answer_of_two_versions_is_weighed_by_the_truncated_importance_ratio(
    tiny_model_dir: Path,
) -> None:
    """With no tis_cap configured, a batch holding an answer a `continue` update ran
    across weighs every token by min(pi_old / pi_sampler, 2): each token's sampler
    logprob is its own span's version's, so the one correction covers both spans. A batch
    without one is not corrected."""
    cfg = TrainConfig(url="http://unused", model=tiny_model_dir, advantage="server", lr=0.0)
    trainer = GRPOTrainer(cfg, client=_NoClient())  # type: ignore[arg-type]
    trainer._temperatures[0] = 1.0
    trainer.version = 4
    batch = collate([_with_spans([[3, 0], [4, 2]])], pad_id=0)
    assert batch.spanning.tolist() == [True, False]
    with torch.no_grad():
        lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, torch.ones(2))
    terms, truncated = [], 0
    for i, adv, cols in ((0, 0.5, [2, 3, 4, 5]), (1, -0.5, [2])):
        for col in cols:
            ratio = math.exp(lp[i, col].item() - batch.behaviour_logprobs[i, col].item())
            truncated += ratio > 2.0
            terms.append(-adv * min(ratio, 2.0))
    metrics = trainer.train_step(batch)
    assert metrics["loss"] == pytest.approx(sum(terms) / 5, rel=1e-5, abs=1e-7)
    assert metrics["tis_truncated_tokens"] == truncated > 0
    # The check can fail: without spans nothing is corrected, each token weighs 1.
    plain = trainer.train_step(collate([_with_spans(None)], pad_id=0))
    assert plain["loss"] == pytest.approx((-0.5 * 4 + 0.5) / 5, abs=1e-7)
    assert plain["tis_truncated_tokens"] == 0.0 and plain["loss"] != metrics["loss"]


def _episode(logprob_at_obs: float, weight_at_obs: float) -> Group:
    """One group of two episodes: tokens 9 and 10 of the first came from an observation
    (mask 0), with whatever logprob and token weight were recorded there."""
    return G(
        "ep",
        prompt=[3, 4],
        samples=[
            sample(
                [5, 9, 10, 6],
                logprobs=[-2.0, logprob_at_obs, logprob_at_obs, -2.5],
                reward=1.0,
                advantage=0.75,
                token_weights=[0.5, weight_at_obs, weight_at_obs, 1.5],
                loss_mask=[1, 0, 0, 1],
                num_turns=2,
            ),
            sample([7], logprobs=[-0.01], reward=0.0, advantage=-0.75),
        ],
    )


def test_collate_takes_the_response_mask_from_the_loss_mask() -> None:
    b = collate([_episode(0.0, 1.0)], pad_id=0)
    assert b.response_mask.tolist() == [[0, 0, 1, 0, 0, 1], [0, 0, 1, 0, 0, 0]]
    with pytest.raises(ValueError, match="3 loss mask values for 4 tokens"):
        collate([G("x", samples=[sample([5, 6, 7, 8], loss_mask=[1, 0, 1])])], pad_id=0)


def test_the_loss_has_no_term_at_observation_tokens(tiny_model_dir: Path) -> None:
    """What was recorded at mask-0 positions (logprob, token weight, even inf) changes
    neither the step's loss nor its gradient; the same change at a mask-1 position does."""
    cfg = TrainConfig(
        url="http://unused", model=tiny_model_dir, tis_cap=2.0, advantage="server", lr=0.0
    )
    trainer = GRPOTrainer(cfg, client=_NoClient())  # type: ignore[arg-type]
    trainer._temperatures[0] = 1.0
    runs = [
        trainer.train_step(collate([_episode(lp, w)], pad_id=0))
        for lp, w in ((0.0, 1.0), (-7.0, 3.0), (-math.inf, math.inf))
    ]
    for other in runs[1:]:  # equal up to float32 summation order (minibatches shuffle)
        for key in ("loss", "grad_norm", "approx_kl"):
            assert other[key] == pytest.approx(runs[0][key], rel=1e-6, abs=1e-9), key
    assert math.isfinite(runs[0]["loss"]) and runs[0]["grad_norm"] > 0
    # the check can fail: the same episode with its observation tokens trained on differs
    unmasked = _episode(-7.0, 3.0)
    unmasked.samples[0].loss_mask = None
    changed = trainer.train_step(collate([unmasked], pad_id=0))["loss"]
    assert changed != pytest.approx(runs[0]["loss"], rel=1e-3)

    # and at the loss itself: the gradient w.r.t. the policy's logprobs is zero there
    logprobs = torch.tensor([[-1.0, -0.5, -0.7, -1.2]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    grads = []
    for old_at_obs, w_at_obs in ((-1.0, 1.0), (math.inf, math.inf)):
        old = torch.tensor([[-1.1, old_at_obs, old_at_obs, -1.0]])
        weights = torch.tensor([[1.0, w_at_obs, w_at_obs, 1.0]])
        loss, _ = ppo_clip_loss(logprobs, old, torch.tensor([0.5]), weights, mask)
        (grad,) = torch.autograd.grad(loss, logprobs)
        grads.append((loss.item(), grad))
    assert grads[0][0] == grads[1][0]
    assert torch.equal(grads[0][1], grads[1][1])
    assert grads[0][1][0, 1] == 0 and grads[0][1][0, 2] == 0 and grads[0][1][0, 0] != 0


@pytest.mark.parametrize(
    ("credit", "batch_groups", "sync_every", "pushes"),
    [
        (32, 16, 1, 1),
        (16, 16, 1, 0),
        (48, 16, 1, 2),
        (40, 16, 1, 2),
        (32, 16, 2, 1),
        (64, 16, 2, 2),
    ],
)
def test_held_pushes_counts_the_pushes_a_held_step_waits_through(
    credit: int, batch_groups: int, sync_every: int, pushes: int
) -> None:
    assert held_pushes(credit, batch_groups, sync_every) == pushes


def test_the_lag_warning_measures_against_what_the_samplers_bound_allows() -> None:
    """Under max_staleness 2, with one step held ahead, groups may lag 3 versions when
    trained: the default threshold says nothing there (the demo's default run warned,
    telling the user to bound what was bounded), and says so past it or unbounded."""
    quiet = lag_warning(2.03, 3, threshold=None, max_staleness=2, held_ahead=1)
    assert quiet is None
    past = lag_warning(3.2, 4, threshold=None, max_staleness=2, held_ahead=1)
    assert past is not None and "lower its max_staleness (2 now" in past and "3 in all" in past
    unbounded = lag_warning(2.03, 3, threshold=None, max_staleness=None, held_ahead=1)
    assert unbounded is not None and "bound it with its max_staleness" in unbounded
    assert "more than 2:" in unbounded
    told = lag_warning(0.6, 1, threshold=0.5, max_staleness=2, held_ahead=1)
    assert told is not None and "more than 0.5:" in told
    assert lag_warning(9.0, 9, threshold=0.0, max_staleness=None, held_ahead=1) is None
    # on-policy, nothing held ahead: any lag is past what the bound allows
    strict = lag_warning(0.5, 1, threshold=None, max_staleness=0, held_ahead=0)
    assert strict is not None and "lower its max_staleness (0 now" in strict


class _ConfigClient(_NoClient):
    """The sampler's own config as `GET /v1/config` returns it."""

    def __init__(self, **changes: object) -> None:
        self.config = {"config_version": 3, **SamplerConfig(**changes).model_dump(mode="json")}

    def get_config(self) -> dict[str, object]:
        return self.config


@pytest.mark.parametrize(("bound", "warns"), [(2, False), (None, True)])
def test_the_trainer_reads_the_bound_from_the_samplers_config(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], bound: int | None, warns: bool
) -> None:
    trainer = GRPOTrainer(
        TrainConfig(url="http://unused", model=tiny_model_dir),
        client=_ConfigClient(max_staleness=bound),  # type: ignore[arg-type]
    )
    g = _right_and_wrong([3, 4], [5, 6, 7], [-1.0, -1.0, -1.0], 0.5, (1.0, 1.0), [0.5, 0.5])
    batch = collate([g], pad_id=0)
    trainer._temperature_of(batch)  # the first batch's config version: read from the sampler
    trainer._check_lag({"version_lag_mean": 2.5, "version_lag_max": 3.0})
    assert ("warning: step 0 trained on groups 2.5" in capsys.readouterr().err) is warns
