"""bench/learning.py's yardstick, on hand-computed cases: the cost at which a curve first
reaches a target, ratios with their paired interval and lower bounds, modelled time, the
histogram's bins, the run cache and the targets object. No learning run is started."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench import learning


def test_first_reach_interpolates_between_checkpoints() -> None:
    xs, ys = [0, 100, 200], [0.1, 0.3, 0.5]
    assert learning.first_reach(xs, ys, 0.4) == (pytest.approx(150.0), True)
    assert learning.first_reach(xs, ys, 0.3) == (pytest.approx(100.0), True)
    assert learning.first_reach(xs, ys, 0.05) == (0.0, True)  # already there at the start


def test_first_reach_takes_the_first_crossing_and_a_budget_as_lower_bound() -> None:
    xs = [0, 100, 200]
    # Up to 0.5 then down: 0.4 is first reached three quarters of the way to 100.
    assert learning.first_reach(xs, [0.1, 0.5, 0.3], 0.4) == (pytest.approx(75.0), True)
    assert learning.first_reach(xs, [0.1, 0.2, 0.3], 0.6) == (200.0, False)


def test_ratio_stats_geometric_mean_and_paired_interval_on_log_ratios() -> None:
    st = learning.ratio_stats([0.5, 2.0], [False, False])
    assert st["geomean"] == pytest.approx(1.0)
    # log ratios -ln2, +ln2: sd ln2 * sqrt(2), se ln2, t quantile with 1 df 12.706.
    lo, hi = st["ci95"]
    assert lo == pytest.approx(2**-12.706)
    assert hi == pytest.approx(2**12.706)
    assert not st["lower_bound"]
    st = learning.ratio_stats([0.4, 0.5, 0.625], [False] * 3)
    assert st["geomean"] == pytest.approx(0.5)
    half = 4.303 * np.std(np.log([0.4, 0.5, 0.625]), ddof=1) / math.sqrt(3)
    assert st["ci95"] == pytest.approx([0.5 * math.exp(-half), 0.5 * math.exp(half)])
    assert st["text"] == f"0.50 ({st['ci95'][0]:.2f} .. {st['ci95'][1]:.2f})"


def test_a_censored_seed_makes_the_ratio_a_lower_bound_without_interval() -> None:
    st = learning.ratio_stats([0.5, 2.0], [False, True])
    assert st["lower_bound"] and st["ci95"] is None
    assert st["text"] == "> 1.00"
    assert learning.ratio_stats([], [])["geomean"] is None


def test_modelled_time_formula() -> None:
    c = learning.engine_costs()
    # Prefill: 2e-5 s x 150 prompt tokens; decode per token at 256 running sequences:
    # (0.012 + 256 x 5e-5) / 256 plus 8.5e-9 s x (150 + 700 / 2) cached tokens.
    assert c["prefill_s"] == pytest.approx(0.003)
    assert c["token_s"] == pytest.approx(9.6875e-5 + 4.25e-6)
    assert c["answer4_s"] == pytest.approx(0.003 + 700 * 1.01125e-4)
    # GRPO n=4 itself (4 toy tokens per answer, everything trained): generation is 100
    # median answers, training 0.7 of that.
    t = learning.modelled_s(100, 400, 100, 25, tokens_per_answer4=4.0)
    assert t == pytest.approx(100 * 0.0737875 * 1.7)
    # Twice the tokens per answer, a quarter trained: 0.3 + 800 x 175 x token_s + 0.7 x 25 x c4.
    t = learning.modelled_s(100, 800, 25, 7, tokens_per_answer4=4.0)
    assert t == pytest.approx(0.3 + 800 * 175 * 1.01125e-4 + 0.7 * 25 * 0.0737875)


def test_histogram_bins() -> None:
    p = np.array([0.0, 1 / 32, 0.125, 0.2, 0.5, 0.9, 31 / 32, 1.0])
    assert learning.histogram_counts(p) == [1, 1, 2, 0, 1, 2, 1]
    assert len(learning.HIST_LABELS) == len(learning.HIST_EDGES) - 1


def _run(method: str, seed: int, xs: list[int], ys: list[float], tokens_per: float = 4.0) -> dict:
    return {
        "method": method,
        "seed": seed,
        "points": [
            {
                "answers": x,
                "tokens": x * tokens_per,
                "samples_trained": x,
                "step": x // 128,
                "wall_s": x / 100,
                "informative": x // 40,
                "train_t1": {"a": y},
                "t1": {"a": y / 2},
                "a": y,
                "stop_reasons": {"fixed": x // 4},
                "dropped": {},
            }
            for x, y in zip(xs, ys, strict=True)
        ],
    }


def test_to_target_pairs_seeds_and_marks_lower_bounds() -> None:
    runs = [
        _run("grpo4", 0, [0, 100, 200], [0.1, 0.2, 0.3]),
        _run("grpo4", 1, [0, 100, 200], [0.1, 0.3, 0.3]),  # its final reached at 100
        _run("seqbal", 0, [0, 300, 600], [0.1, 0.4, 0.5]),  # 0.3 at 200: 200 / 200
        _run("seqbal", 1, [0, 300, 600], [0.1, 0.2, 0.25]),  # never 0.3: > 600 / 100
    ]
    out = learning.to_target(runs, ["a"], "train_t1", "answers")
    assert out["grpo4"]["ratios"] == pytest.approx([1.0, 1.0])
    assert out["seqbal"]["ratios"] == pytest.approx([1.0, 6.0])
    assert out["seqbal"]["censored"] == [False, True]
    assert out["seqbal"]["text"] == f"> {math.sqrt(6):.2f}"
    flat = [_run("grpo4", 0, [0, 100], [0.3, 0.2]), _run("seqbal", 0, [0, 100], [0.1, 0.4])]
    undefined = learning.to_target(flat, ["a"], "train_t1", "answers")["seqbal"]
    assert undefined["undefined_seeds"] == [0] and undefined["n"] == 0


def test_summary_counts_every_answer_and_models_time_from_grpo4_tokens() -> None:
    runs = [
        _run("grpo4", 0, [0, 128, 256], [0.1, 0.2, 0.3]),
        _run("seqbal", 0, [0, 128, 512], [0.1, 0.3, 0.4], tokens_per=8.0),
    ]
    block = learning.summarize_setting(runs, ["a"])
    assert block["tokens_per_answer_grpo4"] == pytest.approx(4.0)
    # Twice GRPO n=4's tokens per answer: its answers are modelled twice as long.
    last = runs[1]["points"][-1]
    assert last["model_s"] == pytest.approx(learning.modelled_s(512, 4096, 512, 4, 4.0))
    assert block["methods"]["seqbal"]["informative_per_1000"]["mean"] == pytest.approx(
        1000 * (512 // 40) / 512
    )
    assert block["to_target"]["train_t1"]["answers"]["seqbal"]["ratios"] == pytest.approx([0.5])
    assert block["equal_at"]["answers"] == 256
    rows = {r["method"]: r for r in learning.headline_rows(block)}
    assert rows["Seq-Balance (K=2/2, n_max 16, n=4)"]["train_t1/answers"] == "0.50"
    assert rows["GRPO n=4"]["stops"] == "fixed 1.00"
    # At 256 answers: seqbal 0.3 + 0.1 / 3 against GRPO n=4's 0.3.
    assert block["paired"]["train_t1"]["answers"]["seqbal"]["diffs"] == pytest.approx([0.1 / 3])


def test_targets_without_runs_say_why() -> None:
    tg = learning.targets({}, None)
    for setting in learning.HARD_SETTINGS:
        for key in ("answers", "model_s", "vs_baseline", "held_out", "informative"):
            e = tg[f"{setting}/{key}"]
            assert e["measured"] is None and e["met"] is False and e["reason"]
    assert tg["add2/not_worse"]["reason"] and tg["step_time"]["reason"]
    judged = {"best": "x", "ratio_r07": 1.4, "informative": 0.95, "answers_per_informative": 9.0,
              "step_target_met": True, "engine_best": "y", "engine_ratio": 1.2,
              "engine_target_met": False,
              "grpo4": {"informative": 0.5, "answers_per_informative": 8.0}}  # fmt: skip
    step = {"targets": {"difficulty/adaptive": judged}}
    assert learning.targets({}, step)["step_time"]["met"] is True
    # Either half of the target is enough: a slow step with cheap informative groups...
    cheap = {**judged, "ratio_r07": 1.8, "step_target_met": False, "engine_ratio": 0.5,
             "engine_target_met": True}  # fmt: skip
    assert learning.targets({}, {"targets": {"difficulty/adaptive": cheap}})["step_time"]["met"]
    # ...and a miss on both says which mix would show it: 0.6 x 0.5 / 1.2 = 25%.
    both = {**judged, "ratio_r07": 1.8, "step_target_met": False}
    missed = learning.targets({}, {"targets": {"difficulty/adaptive": both}})["step_time"]
    assert missed["met"] is False and "informative about 25% of the time" in missed["reason"]


def test_targets_judge_the_best_adaptive_method() -> None:
    grpo = [_run("grpo4", s, [0, 100, 200], [0.1, 0.2, 0.3]) for s in range(5)]
    fast = [_run("seqbal", s, [0, 40, 80], [0.1, 0.3, 0.35]) for s in range(5)]
    slow = [_run("seqpos1", s, [0, 300, 600], [0.1, 0.3, 0.35]) for s in range(5)]
    for i, r in enumerate(fast):  # a little spread, so the interval exists
        r["points"][1]["answers"] += i
    block = learning.summarize_setting(grpo + fast + slow, ["a"])
    tg = learning.targets({"mul": block}, None)
    e = tg["mul/answers"]
    assert e["method"] == "seqbal"
    assert e["measured"]["ratio"] == pytest.approx(np.exp(np.mean(np.log(np.arange(40, 45) / 200))))
    assert e["met"] is True
    assert tg["mul/vs_baseline"]["reason"]  # no baseline runs
    assert tg["add2+mul/answers"]["met"] is False


def test_the_cache_keys_on_setting_method_seed_and_config(tmp_path: Path) -> None:
    shape: dict[str, Any] = {
        "budget": 256, "checkpoints": 1, "batch_groups": 32, "lr": 2e-4, "eval_n": 256,
    }  # fmt: skip
    a = learning.run_config("mul", "grpo4", **shape)
    b = learning.run_config("mul", "grpo4", **{**shape, "budget": 512})
    assert learning.config_hash(a) == learning.config_hash(dict(reversed(list(a.items()))))
    assert learning.config_hash(a) != learning.config_hash(b)
    paths = {learning.run_path(tmp_path, c, s) for c in (a, b) for s in (0, 1)}
    assert len(paths) == 4
    run = {"config": a, "config_hash": learning.config_hash(a), "seed": 0, "points": []}
    learning.run_path(tmp_path, a, 0).write_text(json.dumps(run))
    loaded = learning._load_runs(tmp_path, {("mul", "grpo4"): a})
    assert [(r["method"], r["setting"], r["seed"]) for r in loaded] == [("grpo4", "mul", 0)]
    assert learning._load_runs(tmp_path, {("mul", "grpo4"): b}) == []


def test_a_lower_bound_ranks_behind_every_measured_ratio() -> None:
    def entry(geo: float, bound: bool) -> dict[str, Any]:
        return {"geomean": geo, "lower_bound": bound}

    block = {"to_target": {"train_t1": {"answers": {
        "grpo4": entry(1.0, False), "seqbal": entry(0.3, True), "seqpos1": entry(0.9, False),
    }}}}  # fmt: skip
    assert learning._best_adaptive(block) == "seqpos1"


def test_a_missed_answers_target_says_what_one_informative_group_taught() -> None:
    answers = {"ratio": 0.8, "ci95": [0.7, 0.9], "text": "0.80 (0.70 .. 0.90)", "seeds": 5}
    entries = {
        "answers": {"met": False, "measured": answers, "reason": None},
        "model_s": {"met": False, "measured": answers, "reason": None},
        "informative": {"met": True, "measured": {"ratio": 2.5}, "reason": None},
    }
    learning._explain_misses(entries)
    # 1 / (0.8 x 2.5) = 0.5: each informative group taught half of GRPO n=4's; 0.5x the
    # answers would need 1 / (0.5 x 0.5) = 4x the informative groups.
    assert "taught 0.50x" in entries["answers"]["reason"]
    assert "needs 4.00x the informative groups" in entries["answers"]["reason"]
    # The time target's cap is 0.6x: 1 / (0.6 x 0.5) = 3.33x the informative groups.
    assert "0.6x needs 3.33x the informative groups" in entries["model_s"]["reason"]
    met = {**entries, "answers": {"met": True, "measured": answers, "reason": None}}
    learning._explain_misses(met)
    assert met["answers"]["reason"] is None


def test_a_missed_informative_target_splits_share_and_group_size() -> None:
    block = {"methods": {
        "grpo4": {"informative_share": 0.4, "answers_per_group": 4.0, "stop_reasons": {}},
        "seqpos1": {"informative_share": 0.6, "answers_per_group": 5.0,
                    "stop_reasons": {"rule": 0.8, "n_max": 0.2}},
    }}  # fmt: skip
    why = learning._informative_why(block, "seqpos1")
    # 1.5x GRPO n=4's 0.4 / 4 per answer at 5 answers per group: 1.5 x 0.1 x 5 = 75%.
    assert "60% of its groups are informative (GRPO n=4 40%)" in why
    assert "rule 80%, n_max 20%" in why and "needs 75% of its groups informative" in why


def test_a_held_out_loss_is_traced_to_its_domain() -> None:
    grpo = [_run("grpo4", s, [0, 100], [0.1, 0.3]) for s in range(3)]
    worse = [_run("seqbal", s, [0, 100], [0.1, 0.3]) for s in range(3)]
    for i, (g, w) in enumerate(zip(grpo, worse, strict=True)):
        for p in g["points"] + w["points"]:
            p["b"], p["train_t1"]["b"] = p["a"], p["train_t1"]["a"]  # equal on both
        for p in g["points"]:
            p["t1"] = {"a": 0.5, "b": 0.5}
        for p in w["points"]:
            p["t1"] = {"a": 0.4 - i / 100, "b": 0.55}  # a loses 0.1-0.12, b gains 0.05
    block = learning.summarize_setting(grpo + worse, ["a", "b"])
    assert block["held_out_by_domain"]["t1"]["a"]["seqbal"] == pytest.approx(-0.11)
    why = learning._held_out_why(block, "seqbal")
    assert why is not None and "by domain a -0.110, b +0.050: the loss is on a" in why
    assert learning._held_out_why(block, "grpo4") is None
