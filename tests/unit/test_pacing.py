"""Paced admission: what a prompt is expected to cost, and when the pacer delays it.

The costs are checked against closed forms; the decisions on a hand-driven clock, with
the pass-rate estimator taught which prompt is hard, so every branch is reached on
purpose: a cheap prompt fits, a hard one late in a window is delayed and runs first at
the next version, one that never fits runs after `max_delay_versions`, and a window past
its expected push holds nothing back.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.common import est
from sampler_service.config import SamplerConfig
from sampler_service.dataset import PromptRow
from sampler_service.live_config import LiveConfig
from sampler_service.pacing import Pacer
from strategies.pacing import AnswerCosts, expected_answers
from strategies.stopping import StoppingRule, build

SEQ_POS = {"rule": "positive", "k_pos": 1, "n_max": 32, "wave_size": 8, "group_size": 4}


def _rule(**knobs: Any) -> StoppingRule:
    cfg: dict[str, Any] = {**SEQ_POS, **knobs}
    return build(cfg.pop("rule"), **cfg)


@pytest.mark.parametrize("p", [0.02, 0.1, 0.3, 0.7])
def test_expected_answers_match_the_closed_forms(p: float) -> None:
    # Seq-Pos K_pos 1 in waves of 8: wave j+1 runs while the first j waves had no positive.
    seq_pos = _rule()
    assert expected_answers(seq_pos, p) == pytest.approx(
        sum(8 * (1 - p) ** (8 * j) for j in range(4))
    )
    fixed = _rule(rule="fixed", n_max=4, wave_size=4)
    assert expected_answers(fixed, p) == pytest.approx(4.0)


def test_a_rule_whose_budget_is_the_prompts_is_costed_per_prompt() -> None:
    """Est draws each prompt's own budget: that is its cost, whatever the pass rate."""
    cfg = SamplerConfig(**est(8))
    live = LiveConfig(cfg, 0, ["d"], ["easy", "hard"])
    live.estimator.update("easy", 8, 8)
    live.estimator.update("hard", 64, 1)
    rule = live.plan.rule
    costs = AnswerCosts()
    for prompt_id in ("easy", "hard"):
        assert costs(rule, 0.5, prompt_id) == pytest.approx(rule.budget(prompt_id))
    assert rule.budget("hard") > rule.budget("easy")


def test_costs_are_cached_per_rule_on_a_grid() -> None:
    costs = AnswerCosts()
    rule = _rule()
    assert costs(rule, 0.101, "x") == costs(rule, 0.1, "y")
    assert costs(rule, 0.1, "x") == pytest.approx(expected_answers(rule, 0.1))
    other = _rule(n_max=8)
    assert costs(other, 0.1, "x") == pytest.approx(expected_answers(other, 0.1))
    assert costs(other, 0.1, "x") < costs(rule, 0.1, "x")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _row(prompt_id: str) -> PromptRow:
    return PromptRow(prompt_id, "q", "a", "d")


def _pacer(max_delay_versions: int | str = 2, **knobs: Any) -> tuple[Pacer, Clock, list[int]]:
    """A pacer under Seq-Pos K_pos 1 (n_max 32) and max_staleness 1, pushes every 10 s
    and 1,000 tokens/s decoded, 100 tokens per answer: a prompt estimated easy costs
    ~800 tokens, one estimated at p = 0.02 ~2,900; the trainer takes 3 groups a step."""
    cfg = SamplerConfig(**SEQ_POS, max_staleness=1, max_delay_versions=max_delay_versions, **knobs)
    live = LiveConfig(cfg, 0, ["d"], ["easy", "hard", "other"])
    live.estimator.update("easy", 8, 8)
    live.estimator.update("hard", 200, 0)
    clock, decoded = Clock(), [0]
    pacer = Pacer(live, clock, lambda: decoded[0], lambda: 3)
    pacer.observe(0)
    clock.now, decoded[0] = 10.0, 10_000
    pacer.observe(1)  # a push after 10 s, 1,000 tokens/s meanwhile
    pacer.finished(tokens=800, answers=8)
    return pacer, clock, decoded


def test_a_prompt_that_would_miss_the_bound_waits_for_the_next_version_and_goes_first() -> None:
    pacer, clock, decoded = _pacer()
    assert pacer.active and pacer.push_s == 10.0 and pacer.token_rate == 1000.0
    hard, easy = _row("hard"), _row("easy")
    assert pacer.cost(hard) > 3 * pacer.cost(easy)
    clock.now = 17.0  # 3 s left before the expected push: 3,000 tokens of room
    assert pacer.fits(easy, backlog=0.0)
    assert not pacer.fits(hard, backlog=0.0)
    assert not pacer.fits(easy, backlog=2_500.0)  # behind what is already running
    pacer.delay(hard)
    assert pacer.take_delayed(backlog=0.0) is None  # still does not fit this window
    clock.now, decoded[0] = 20.0, 20_000
    pacer.observe(2)  # a new window: the whole of it is room
    assert pacer.take_delayed(backlog=0.0) is hard
    stats = pacer.to_dict()
    assert (stats["delayed"], stats["delayed_now"], stats["admitted_overdue"]) == (1, 0, 0)
    assert stats["longest_wait_versions"] == 1


def test_a_prompt_that_never_fits_runs_after_max_delay_versions() -> None:
    pacer, clock, decoded = _pacer(max_delay_versions=2)
    hard = _row("hard")
    backlog = 9_000.0  # the running prompts fill every window
    pacer.delay(hard)
    for version in (2, 3):
        clock.now, decoded[0] = 10.0 * version, 10_000 * version
        pacer.observe(version)
        assert not pacer.fits(hard, backlog)
        taken = pacer.take_delayed(backlog)
        assert taken is (hard if version == 3 else None)
    assert pacer.to_dict()["admitted_overdue"] == 1
    assert pacer.to_dict()["longest_wait_versions"] == 2


def test_the_line_holds_what_the_next_max_delay_versions_versions_admit() -> None:
    # Steps of 3 groups: two versions admit 6, so a line of 6 is full.
    pacer, _, _ = _pacer(max_delay_versions=2)
    for i in range(6):
        assert not pacer.full()
        pacer.delay(_row(f"p{i}"))
    assert pacer.full()
    # max_active_prompts caps it too.
    capped, _, _ = _pacer(max_delay_versions=2, max_active_prompts=4)
    for i in range(4):
        assert not capped.full()
        capped.delay(_row(f"p{i}"))
    assert capped.full()


def test_past_the_expected_push_nothing_is_held_back_and_zero_delay_versions_is_off() -> None:
    pacer, clock, _ = _pacer()
    clock.now = 21.0  # the push expected at 20 s has not come: the trainer waits for us
    assert pacer.fits(_row("hard"), backlog=1e9)
    off, clock, _ = _pacer(max_delay_versions=0)
    clock.now = 19.9
    assert not off.active and off.fits(_row("hard"), backlog=1e9)
    assert not off.full()  # with pacing off nothing waits in line: admission goes on


@pytest.mark.parametrize(
    ("knobs", "versions"),
    [
        ({}, 2),  # auto under wait
        ({"weight_update_mode": "abort"}, 2),
        ({"weight_update_mode": "continue"}, 4),  # answers run on across a push
        ({"weight_update_mode": "continue", "max_delay_versions": 1}, 1),
        ({"max_delay_versions": 0}, 0),
    ],
)
def test_the_delay_resolves_by_weight_update_mode(knobs: dict[str, Any], versions: int) -> None:
    assert SamplerConfig(**knobs).delay_versions == versions


def test_under_continue_the_line_holds_four_versions_of_admission() -> None:
    # auto under continue: 4 versions x steps of 3 groups = 12 in line (6 under wait).
    pacer, _, _ = _pacer(max_delay_versions="auto", weight_update_mode="continue")
    for i in range(11):
        pacer.delay(_row(f"p{i}"))
    assert not pacer.full()
    pacer.delay(_row("p11"))
    assert pacer.full()


@pytest.mark.parametrize("bad", [-1, "later", 1_001])
def test_a_bad_delay_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="max_delay_versions"):
        SamplerConfig(max_delay_versions=bad)
