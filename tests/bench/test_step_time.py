"""The step-time benchmark's engine terms, pipelines and self-checks (bench/step_time.py).

Simulated times are exact, so the engine terms are checked exactly; the self-check is
shown to pass for the rule its closed form describes and to fail for a different one.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import adaptive_sim, step_time
from bench.sim_backend import EngineSpec
from tests.bench.test_sim_engine import FLAT, _generate

KV = replace(FLAT, kv_token_s=1e-4)


def test_decode_steps_pay_for_the_context_they_read() -> None:
    # Two sequences of a 3-token prompt: context 2 x (3 + k) after k steps, so step k
    # takes 0.012 + 1e-4 x 2 x (3 + k) seconds (the engine integrates k continuously).
    (_,), (t,), _ = _generate(KV, [(0, 2)], [0.5])
    assert t == pytest.approx(100 * (0.012 + 1e-4 * 6) + 1e-4 * 2 * 100**2 / 2)
    # A second request arriving mid-way changes the running set, not the arithmetic.
    _, (t1, t2), _ = _generate(KV, [(0, 1), (1, 1)], [0.5, 0.5])
    assert t1 == t2 == pytest.approx(t)


def test_answer_length_grows_with_difficulty_and_for_wrong_answers() -> None:
    spec = EngineSpec(max_num_seqs=64, length_median=100, length_sigma=0.0, difficulty_length=0.5)
    (easy, hard), _, _ = _generate(spec, [(0, 4), (1, 4)], [1.0, 0.0])
    assert {len(c.token_ids) for c in easy} == {100}
    assert {len(c.token_ids) for c in hard} == {150}
    wrong = EngineSpec(
        max_num_seqs=64, length_median=100, length_sigma=0.0, wrong_length_factor=1.3
    )
    (right, bad), _, _ = _generate(wrong, [(0, 4), (1, 4)], [1.0, 0.0])
    assert {len(c.token_ids) for c in right} == {100} and {len(c.token_ids) for c in bad} == {130}


def test_closed_forms_match_direct_enumeration() -> None:
    q = 0.3
    # Seq-Balance 2/2, waves of 8 up to 32: enumerate the first-wave outcomes by hand for
    # the chance that one wave is not enough.
    p_not_met_8 = sum(
        math.comb(8, k) * q**k * (1 - q) ** (8 - k) for k in range(9) if k < 2 or 8 - k < 2
    )
    answers, informative = step_time.closed_form("seqbal", q)
    assert answers > 8 + 8 * p_not_met_8 - 1e-12
    assert informative == pytest.approx(1 - q**32 - (1 - q) ** 32)
    assert step_time.closed_form("seqpos1", q)[0] == pytest.approx(
        8 * (1 + (1 - q) ** 8 + (1 - q) ** 16 + (1 - q) ** 24)
    )
    assert step_time.effective_pass_rate(0.5, EngineSpec(length_sigma=0.0)) == 0.5


def _check(key: str, config: dict) -> list[dict]:
    row = step_time.Method(key, key, config)
    args = argparse.Namespace(batch=48, steps=1, warmup=0, seed=0, history_epochs=0)
    groups = []
    for draw in range(5):
        rates = adaptive_sim.draw_pass_rates("hard", 96, np.random.default_rng(draw))
        groups += step_time.run_one(row, "sync", rates, args, step_time.ENGINE, seed=draw)["groups"]
    return step_time.self_check(key, groups, step_time.ENGINE)


def test_self_check_passes_for_its_rule_and_fails_for_another() -> None:
    seqbal = next(r for r in step_time.rows() if r.key == "seqbal").config
    assert all(c["met"] for c in _check("seqbal", seqbal))
    # The same closed form against a rule that needs 3 of each: far more answers.
    wrong = _check("seqbal", {**seqbal, "k_pos": 3, "k_neg": 3})
    by_quantity = {c["quantity"]: c for c in wrong}
    assert not by_quantity["answers per prompt"]["met"]
    assert by_quantity["answers per prompt"]["z"] > step_time.CHECK_SE


def test_pipelines_bound_the_policy_lag() -> None:
    args = argparse.Namespace(batch=32, steps=2, warmup=2, seed=0, history_epochs=0)
    rates = adaptive_sim.draw_pass_rates("hard", 128, np.random.default_rng(0))
    row = next(r for r in step_time.rows() if r.key == "seqbal")
    on = step_time.run_one(row, "on_policy", rates, args, step_time.ENGINE)
    assert on["stale_share"] == 0.0 and on["step_s"] == pytest.approx(on["gen_s"])
    # 32 prompts in waves of 8 fill at most all 256 slots, and the engine idles in part
    # of a step (the trainer phase, the last prompts' waves): a share, below 1.
    assert 0.0 < on["occupancy"] < 1.0
    train = 0.05
    off = step_time.run_one(
        row, "off_policy", rates, args, step_time.ENGINE, train_s_per_sample=train
    )
    assert off["stale_share"] > 0.0
    # Training overlaps generation: a step is shorter than generating then training.
    assert off["step_s"] < on["gen_s"] + train * on["samples_trained"]


def test_targets_take_the_fastest_step_and_the_cheapest_informative_group() -> None:
    def row(
        method: str, informative: float, ratio: float, engine_s: float, stopping: str = "wave"
    ) -> dict[str, Any]:
        return {"method": method, "pipeline": "on_policy", "extra": False, "stopping": stopping,
                "informative_frac": informative, "ratio_by_r": {"0.7": ratio},
                "answers_per_informative": 10.0, "engine_s_per_informative": engine_s,
                "tokens_per_informative": 100 * engine_s, "surplus_share": 0.0}  # fmt: skip

    rows = [
        row("grpo4", 0.5, 1.0, 2.0),
        row("fast", 0.92, 1.4, 1.6),
        row("cheap", 0.95, 1.9, 1.1),
        row("cheaper_but_uninformative", 0.6, 1.0, 0.5),
        # Exact stopping's twins are judged by the exact targets alone.
        row("fast_exact", 0.93, 1.2, 1.4, "exact"),
        row("cheap_exact", 0.96, 1.1, 0.8, "exact"),
    ]
    t = step_time.targets(rows, "adaptive")
    assert t["best"] == "fast" and t["step_target_met"] is True
    assert t["engine_best"] == "cheap" and t["engine_ratio"] == pytest.approx(0.55)
    assert t["engine_target_met"] is True
    assert t["grpo4"]["engine_s_per_informative"] == 2.0
    seed = step_time._exact_ratios(rows)
    assert seed is not None and seed["method"] == "cheap_exact"  # the faster step
    assert seed["exact"]["engine_s_per_informative"] == pytest.approx(0.4)
    assert seed["wave"]["engine_s_per_informative"] == pytest.approx(0.55)
    judged = step_time.exact_targets([seed, seed])
    assert judged["exact/engine_s_per_informative"]["met"] is True
    assert judged["exact/step"]["measured"]["mean"] == pytest.approx(1.1)
    assert judged["exact/tokens_per_informative"]["measured"]["wave_stopping"]["mean"] == 0.55
    assert "arrival_order" not in judged["exact/step"]["measured"]
    # With the same row's figures in arrival order beside each seed's:
    arrival = {**seed, "arrival": {**seed["exact"], "step": 1.3}}
    judged = step_time.exact_targets([arrival, {**arrival, "arrival": seed["exact"]}])
    assert judged["exact/step"]["measured"]["arrival_order"]["mean"] == pytest.approx(1.2)
    assert "1.20x with engines in arrival order" in judged["exact/step"]["reason"]


def test_exact_targets_say_which_speculative_width_reaches_each_goal(tmp_path: Path) -> None:
    def figures(tokens: float, step: float) -> dict[str, float]:
        return {"tokens_per_informative": tokens, "engine_s_per_informative": 1.2,
                "step": step, "surplus_share": 0.1}  # fmt: skip

    def seed(step_at_32: float) -> dict[str, Any]:
        own = figures(1.1, 1.7)
        widths = {"1": figures(0.9, 2.1), "8": own, "32": figures(1.2, step_at_32)}
        return {"method": "row_exact", "exact": own, "wave": figures(1.4, 1.9), "widths": widths}

    judged = step_time.exact_targets([seed(1.45), seed(1.6)])
    step = judged["exact/step"]
    assert step["met"] is False  # judged at the row's own width
    assert step["measured"]["widths"] == pytest.approx({"1": 2.1, "8": 1.7, "32": 1.525})
    assert "the lowest is 1.52x (width 32), no width meets the goal" in step["reason"]
    tokens = judged["exact/tokens_per_informative"]
    assert "widths 1-32 the lowest is 0.90x (width 1), no width meets" in tokens["reason"]
    judged = step_time.exact_targets([seed(1.45), seed(1.45)])
    assert judged["exact/step"]["reason"].endswith("met at width 32")
    assert judged["exact/surplus_share"]["measured"]["widths"]["8"] == pytest.approx(0.1)
    png = step_time.plot_widths(judged, tmp_path / "widths.png")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")
    without = {**seed(1.45)}
    del without["widths"]
    judged = step_time.exact_targets([without])
    assert "widths" not in judged["exact/step"]["measured"]
    assert "width" not in judged["exact/step"]["reason"]
    assert step_time.plot_widths(judged, tmp_path / "none.png") is None


EXACT_ROW = "seqpos1_posterior_skip_exact"


@pytest.fixture(scope="module")
def exact_table() -> tuple[argparse.Namespace, list[dict[str, Any]]]:
    """A small draw's table of GRPO n=4 and the judged exact row, sync and on-policy."""
    # A history epoch first, so the posterior budget lets waves past `min_answers`.
    args = argparse.Namespace(batch=32, steps=2, warmup=1, seed=0, history_epochs=1, prompts=128)
    table = step_time.measure(
        args,
        step_time.ENGINE,
        lambda _: None,
        only=("grpo4", EXACT_ROW),
        pipelines=("sync", "on_policy"),
    )
    return args, table


def test_the_width_sweep_repeats_the_exact_row_at_its_own_width(
    exact_table: tuple[argparse.Namespace, list[dict[str, Any]]],
) -> None:
    """Width 8 is the row's own: the sweep's run repeats the table's figures exactly.
    Width 1 issues one answer at a time past `min_answers`, so nothing is surplus."""
    args, table = exact_table
    on = {r["method"]: r for r in table if r["pipeline"] == "on_policy"}
    widths = step_time.width_ratios(args, table, EXACT_ROW)
    assert list(widths) == [str(w) for w in step_time.WIDTHS]
    assert widths["8"] == step_time._ratios(on[EXACT_ROW], on["grpo4"])
    assert widths["1"]["surplus_share"] == 0.0 < widths["32"]["surplus_share"]


def test_the_sequential_floor_runs_every_exact_twin_one_answer_at_a_time(
    exact_table: tuple[argparse.Namespace, list[dict[str, Any]]],
) -> None:
    """Width 1 decodes no surplus: each exact twin's tokens are its own groups', read
    against GRPO n=4's on-policy run of the same table."""
    args, table = exact_table
    floor = step_time.sequential_floor(args, table)
    assert set(floor) == {r.key for r in step_time.rows() if r.key.endswith("_exact")}
    assert all(f["tokens_per_informative"] > 0 for f in floor.values())
    assert all(0 < f["informative_frac"] <= 1 for f in floor.values())
    one = step_time.width_ratios(args, table, EXACT_ROW)["1"]
    assert floor[EXACT_ROW]["tokens_per_informative"] == one["tokens_per_informative"]


def test_the_tokens_target_says_whether_sequential_sampling_could_meet_it() -> None:
    def floor(row_tokens: float) -> dict[str, dict[str, float]]:
        return {"row_exact": {"tokens_per_informative": row_tokens, "informative_frac": 0.93},
                "other_exact": {"tokens_per_informative": 0.5, "informative_frac": 0.6}}  # fmt: skip

    def seed(row_tokens: float) -> dict[str, Any]:
        own = {"tokens_per_informative": 1.1, "engine_s_per_informative": 1.2, "step": 1.7,
               "surplus_share": 0.1}  # fmt: skip
        return {"method": "row_exact", "exact": own, "wave": own, "floor": floor(row_tokens)}

    judged = step_time.exact_targets([seed(0.9), seed(1.1)])
    tokens = judged["exact/tokens_per_informative"]
    assert tokens["measured"]["sequential_floor"]["row_exact"] == pytest.approx(
        {"mean": 1.0, "min": 0.9, "max": 1.1, "informative_frac": 0.93}
    )
    # The other twin decodes less but has too few informative groups to compete.
    assert tokens["reason"].endswith(
        "spend at least 1.00x (row_exact), so no width of any listed row meets the goal"
    )
    assert "sequential_floor" not in judged["exact/step"]["measured"]
    reachable = step_time.exact_targets([seed(0.7)])["exact/tokens_per_informative"]
    assert reachable["reason"].endswith("spend at least 0.70x (row_exact), within the goal")


def test_the_judged_row_is_the_fastest_adaptive_row_at_90_percent_informative() -> None:
    def row(method: str, informative: float, ratio: float, extra: bool = False) -> dict[str, Any]:
        return {"method": method, "pipeline": "on_policy", "extra": extra,
                "informative_frac": informative, "ratio_by_r": {"0.7": ratio}}  # fmt: skip

    table = [
        row("grpo4", 0.55, 1.0),  # GRPO and DAPO are the baselines, not adaptive rows
        row("dapo4", 1.0, 1.2),
        row("seqbal11_adaptive_skip", 0.96, 1.3, extra=True),  # beyond the listed rows
        row("seqbal_knapsack", 0.66, 1.25),  # too few informative groups
        row("seqpos1_posterior_skip", 0.94, 1.84),
        row("seqpos1_posterior_skip_exact", 0.93, 1.7),
        row("seqbal_exact", 0.92, 2.5),
        {**row("seqpos1_posterior_skip_exact", 0.93, 0.5), "pipeline": "off_policy"},
    ]
    assert step_time.best_row(table) == "seqpos1_posterior_skip_exact"
    table[5]["ratio_by_r"]["0.7"] = 1.9  # the twin slower: the listed row is judged
    assert step_time.best_row(table) == "seqpos1_posterior_skip"


def test_paced_admission_runs_every_delayed_prompt_within_max_delay_versions() -> None:
    """The off-policy pipeline on the hard mix (hard prompts run up to 4 waves of long
    answers), B = 64, the trainer applying the service's drop rule: the pacer delays
    prompts, none waits more than `max_delay_versions` (1) versions, and what was dropped
    stale is in the per-quartile counts. Seed 1 is one where the line, as long as
    max_active_prompts before it was bounded by a step a version, held overdue prompts a
    second version."""
    by_key = {r.key: r for r in step_time.rows()}
    args = argparse.Namespace(batch=64, steps=4, warmup=2, prompts=256, seed=1, history_epochs=2)
    rates = adaptive_sim.draw_pass_rates("hard", args.prompts, np.random.default_rng(1))
    t4 = step_time.run_one(by_key["grpo4"], "sync", rates, args, step_time.ENGINE)["gen_s"]
    result = step_time.run_one(
        by_key[step_time.STALENESS_ROW],
        "off_policy",
        rates,
        args,
        step_time.ENGINE,
        train_s_per_sample=0.7 * t4 / (4 * args.batch),
        overrides={"max_delay_versions": 1},
    )
    pacing = result["pacing"]
    assert pacing["active"] and pacing["delayed"] > 0
    assert pacing["longest_wait_versions"] <= 1
    stale = sum(q["stale_groups"] for q in result["quartiles"].values())
    assert (stale > 0) == (result["stale_dropped_share"] > 0)


def test_staleness_figures_add_up_the_prompt_draws_quartile_counts() -> None:
    """Drops are rare: the quartile figures come from the draws' counts added up, not from
    a mean of per-draw ratios (one draw with no easy group dropped would make it inf)."""

    def run(hard: tuple[int, int], easy: tuple[int, int]) -> dict[str, Any]:
        counts = {"0": hard, "1": (0, 10), "2": (0, 10), "3": easy}
        return {
            "quartiles": {
                q: {"stale_groups": s, "trained_groups": t, "trained_samples": 4 * t}
                for q, (s, t) in counts.items()
            }
        }

    pooled = step_time._pooled_quartiles([run((2, 98), (0, 50)), run((1, 99), (1, 49))])
    assert pooled["0"] == {"stale_groups": 3, "trained_groups": 197, "trained_samples": 788}
    assert pooled["3"]["stale_groups"] == 1 and pooled["3"]["trained_groups"] == 99
    unbounded = step_time._pooled_quartiles([run((0, 100), (0, 50))] * 2)
    figures = step_time.staleness_figures(pooled, 0.01, unbounded)
    assert figures["stale_share"] == 0.01
    assert figures["quartile_ratio"] == pytest.approx((3 / 200) / (1 / 100))
    hard_share = 788 / (788 + 2 * 80 + 4 * 99)
    assert figures["hard_share"] == pytest.approx(hard_share / (800 / (800 + 160 + 400)))
    one_draw = step_time._pooled_quartiles([run((2, 98), (0, 50))])
    assert step_time.staleness_figures(one_draw, 0.01, unbounded)["quartile_ratio"] == math.inf


def test_weight_update_and_staleness_targets_read_every_prompt_draw() -> None:
    """`--seeds 2`: each target is judged on both prompt draws (the weight update modes'
    on their mean, the staleness quartiles on their counts added up), the table shows the
    first draw's runs, and that draw repeats exactly when run alone."""
    args = argparse.Namespace(batch=16, steps=2, warmup=1, prompts=64, seed=0, seeds=2,
                              history_epochs=2, continue_kv="recompute")  # fmt: skip
    quiet = lambda _: None  # noqa: E731
    both = step_time.measure_continue(args, step_time.ENGINE, quiet)
    first = step_time.measure_continue(
        argparse.Namespace(**{**vars(args), "seeds": 1}), step_time.ENGINE, quiet
    )
    step = both["targets"]["continue/step"]
    assert len(step["per_seed"]) == 2 and step["per_seed"][0] != step["per_seed"][1]
    assert step["measured"] == pytest.approx(np.mean(step["per_seed"]))
    assert first["targets"]["continue/step"]["per_seed"] == step["per_seed"][:1]
    # The step at wait's tokens and a full engine's rate, from the first draw's own runs.
    runs, judged = first["runs"], first["targets"]["continue/step"]
    wait, cont = runs["off_policy/wait"], runs["off_policy/continue"]
    full_rate = runs["unbounded/continue"]["decode_tok_s"]
    assert judged["full_engine_step"] == [wait["decode_tok_s"] / full_rate]
    assert judged["rate_share"] == [cont["decode_tok_s"] / full_rate]
    # The step ratio is the work ratio over the rate ratio.
    assert judged["per_seed"][0] == pytest.approx(
        judged["work"][0] * judged["full_engine_step"][0] / judged["rate_share"][0]
    )
    assert all(r["decode_tok_s"] > 0 for r in runs.values())
    # Under recompute, continue re-prefills the answers an update runs across.
    assert cont["spanning_per_step"] > 0
    assert cont["prefill_share"] > wait["prefill_share"] > 0
    assert first["runs"] == both["runs"]

    stale = step_time.measure_staleness(args, step_time.ENGINE, quiet)
    alone = step_time.measure_staleness(
        argparse.Namespace(**{**vars(args), "seeds": 1}), step_time.ENGINE, quiet
    )
    assert stale["seeds"] == 2 and stale["runs"] == alone["runs"]
    hard_pooled, hard_first = stale["quartiles"]["bounded"]["0"], alone["quartiles"]["bounded"]["0"]
    assert hard_pooled["trained_groups"] > hard_first["trained_groups"] > 0
    dropped = stale["dropped"]  # of the run without the hand-out hold
    assert dropped["groups"] == sum(
        q["stale_groups"] for q in stale["quartiles"]["unheld"].values()
    )
    assert 0 <= dropped["informative"] <= dropped["groups"] and dropped["groups"] > 0
    waits = stale["runs"]["unheld"]["stale_frame_wait_s"]
    assert len(waits) == sum(
        q["stale_groups"] for q in stale["runs"]["unheld"]["quartiles"].values()
    )
    assert all(w >= 0 for w in waits)
