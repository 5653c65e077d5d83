"""bench/learning.py's paired statistics: per-seed differences, t-based 95% CI, sign test."""

from __future__ import annotations

import math

import pytest

from bench import learning


def test_paired_stats_of_known_differences() -> None:
    st = learning.paired_stats([0.1, 0.2, 0.3])
    assert st["n"] == 3
    assert st["mean"] == pytest.approx(0.2)
    assert st["sd"] == pytest.approx(0.1)
    se = 0.1 / math.sqrt(3)
    assert st["t"] == pytest.approx(0.2 / se)
    lo, hi = st["ci95"]
    assert lo == pytest.approx(0.2 - 4.303 * se)  # t quantile, 2 degrees of freedom
    assert hi == pytest.approx(0.2 + 4.303 * se)
    assert (st["wins"], st["losses"]) == (3, 0)
    assert st["sign_p"] == pytest.approx(0.25)  # 2 * 0.5**3


def test_mixed_signs_give_an_interval_across_zero() -> None:
    st = learning.paired_stats([0.05, -0.04, 0.01, -0.02])
    lo, hi = st["ci95"]
    assert lo < 0 < hi
    assert (st["wins"], st["losses"]) == (2, 2)
    assert st["sign_p"] == 1.0


def test_ties_are_not_counted_and_one_seed_has_no_interval() -> None:
    st = learning.paired_stats([0.0, 0.1])
    assert (st["wins"], st["losses"]) == (1, 0)
    one = learning.paired_stats([0.3])
    assert one["ci95"] is None and one["t"] is None and one["sd"] == 0.0


def test_sign_test_and_t_quantiles() -> None:
    assert learning.sign_test_p(5, 0) == pytest.approx(2 / 32)
    assert learning.sign_test_p(4, 1) == pytest.approx(2 * 6 / 32)
    assert learning.t95(1) == pytest.approx(12.706)
    assert learning.t95(11) == pytest.approx(2.179)  # rounded up to the next tabulated df
    assert learning.t95(100) == pytest.approx(1.96)
    with pytest.raises(ValueError):
        learning.t95(0)


def test_paired_by_seed_pairs_each_method_with_grpo4_of_the_same_seed() -> None:
    def run(method: str, seed: int, acc0: float, acc1: float) -> dict:
        return {
            "method": method,
            "seed": seed,
            "points": [
                {"answers": 0, "step": 0, "wall_s": 0.0, "a": acc0},
                {"answers": 100, "step": 10, "wall_s": 10.0, "a": acc1},
            ],
        }

    runs = [
        run("grpo4", 0, 0.4, 0.5),
        run("grpo4", 1, 0.3, 0.6),
        run("seqbal", 1, 0.3, 0.5),
        run("seqbal", 0, 0.4, 0.7),
    ]
    paired = learning._paired(runs, ["a"], "answers", 100)
    assert list(paired) == ["seqbal"]
    assert paired["seqbal"]["diffs"] == pytest.approx([0.2, -0.1])
    assert paired["seqbal"]["seeds"] == [0, 1]
    half = learning._paired(runs, ["a"], "wall_s", 5.0)["seqbal"]
    assert half["diffs"] == pytest.approx([0.1, -0.05])  # interpolated half way
    gains = learning._gains(runs, ["a"], "answers", 100)
    assert gains["grpo4"]["diffs"] == pytest.approx([0.1, 0.3])
    assert gains["seqbal"]["diffs"] == pytest.approx([0.3, 0.2])
