"""Does adaptive sampling learn faster per answer generated, and per second? GRPO n=4 vs
Seq-Balance, with the advantage estimator ablated separately from the stopping rule.

On the toy arithmetic task, the reference GRPO trainer (`trainer_client.grpo.GRPOTrainer`)
trains the toy model against a real sampler process (`adaptive-rollout serve`) with either

- `grpo4`: plain GRPO, rule `fixed`, n = 4, GRPO advantages; or
- `seqbal`: Seq-Balance, rule `balanced` (K_pos = K_neg = 2, n_max 16, adaptive waves of
  up to 8), balanced down-sampling to n = 4, Reinforce-Ada's global-baseline advantage;
- `grpo4_global`: GRPO n=4's rule with Seq-Balance's advantage (global baseline), and
  `seqbal_grpo`: Seq-Balance's rule with GRPO advantages, so the rule and the advantage
  estimator are compared one at a time;

with everything else equal (batch of 32 groups, AdamW lr 2e-4, temperature 1, one weight
push per step, `max_staleness` 0: the trainer pushes a step's weights before it acks the
step's groups, so the sampler starts the next batch on those weights and every step
trains on-policy, `version_lag` 0). Cost is counted in answers generated for the groups
the trainer trained on (`GroupStats.n_generated`); every run stops at the same answer
budget and is evaluated at checkpoints along the way on 256 held-out prompts: greedy
exact-match accuracy (the headline metric) and, second, the T=1 pass rate (8 samples per
prompt, the quantity the RL objective raises). Curves are interpolated onto a common
answers grid and averaged over seeds, with the spread (min..max over seeds) shown. The
same is done on a wall-clock axis (training time, evaluations excluded). Statistics are
paired by seed: each run's gain over its own start (did it learn?), and each method
minus GRPO n=4 at equal answers and at equal wall-clock time (mean, 95% t interval,
paired t, sign count with its exact sign-test p).

The budget, and why the earlier one showed nothing. The shipped toy model starts at T=1
pass rates of about 0.9 (add1), 0.3 (add2) and 0.09 (mul) and greedy held-out accuracy
0.78 / 0.45 / 0.09; add1's held-out split has only 18 problems (one problem moves its
accuracy by 0.056) and is nearly saturated, mul's groups are nearly all wrong. So the
benchmark trains and evaluates on `add2` only (`--domain` picks others): the domain with
headroom and a held-out split large enough for 256 prompts. Learning rate, measured on
GRPO n=4 against the sampler while the trainer still acked before pushing (every step
one policy version off, no importance correction): at 5e-4 the train reward falls (0.45
-> 0.2 within 20 steps; a bare in-process GRPO loop does the same), at 3e-4 greedy
accuracy dips to 0.17-0.25 after 20 steps and ends at 0.35-0.46 (from 0.43-0.45) at step
80, at 2e-4 with batches of 32 groups the T=1 train reward rises steadily over 80 steps
(0.30 -> 0.40 and 0.30 -> 0.44 on two seeds). Training on the whole add2 train split
instead of 512 prompts did not help (at 3e-4, two seeds). The quick budget is 10,240
answers (80 GRPO n=4 steps); on the trainer that pushes before it acks, GRPO n=4 raises
held-out greedy accuracy and the T=1 pass rate on every seed at that budget (BENCHMARKS.md
section 4).

    .venv/bin/python -m bench.learning --quick  # 3 seeds x 3 methods, 10,240 answers each
    .venv/bin/python -m bench.learning          # 5 seeds x 4 methods, 20,480 answers each
    ... --jobs 3                                # runs side by side (wall-clock axis shared)
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import resource
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, table, write_json
from trainer_client.demo import SEQ_BALANCE  # the rows below differ in the advantage

COMMON: dict[str, Any] = {
    "temperature": 1.0,
    "max_tokens": 6,
    "max_active_prompts": 48,
    "max_buffered_groups": 64,
    "max_staleness": 0,
    "mixing": {"name": "static", "params": {}},
}
# The budget (see the module docstring for why): the toy domain with headroom, its large
# held-out split, batches of 32 groups, lr 3e-4, and enough answers for GRPO n=4 to take
# 80 optimizer steps.
DOMAINS = ("add2",)
BATCH_GROUPS = 32
LR = 2e-4
EVAL_N = 256
QUICK_BUDGET = 10240
FULL_BUDGET = 20480
# Quick mode leaves out "GRPO n=4, global baseline" (the estimator swapped on GRPO's rule)
# to stay within its CPU budget; the full run has all four.
QUICK_METHODS = ("grpo4", "seqbal_grpo", "seqbal")
# Samples per held-out prompt for the second metric, the T=1 pass rate.
T1_SAMPLES = 8
METHODS: dict[str, dict[str, Any]] = {
    "grpo4": {
        "label": "GRPO n=4",
        "config": {
            "rule": "fixed",
            "group_size": 4,
            "wave_size": 4,
            "n_max": 4,
            "advantage": "grpo",
            "downsample": "none",
        },
    },
    "grpo4_global": {
        "label": "GRPO n=4, global baseline",
        "config": {
            "rule": "fixed",
            "group_size": 4,
            "wave_size": 4,
            "n_max": 4,
            "advantage": "global",
            "downsample": "none",
        },
    },
    "seqbal_grpo": {
        "label": "Seq-Balance, GRPO advantages",
        "config": {**SEQ_BALANCE, "advantage": "grpo"},
    },
    "seqbal": {
        "label": "Seq-Balance (K=2/2, n_max 16, n=4)",
        "config": {**SEQ_BALANCE, "advantage": "global"},
    },
}


def run_one(
    method: str,
    seed: int,
    budget: int,
    checkpoints: int,
    work: Path,
    *,
    batch_groups: int,
    lr: float,
    eval_n: int,
    n_train: int = 512,
    domains: list[str] | None = None,
    on_checkpoint: Any = None,
) -> dict[str, Any]:
    """Train one (method, seed) to `budget` answers; evaluate at `checkpoints` points
    (`on_checkpoint()` is called after each, for a progress bar)."""
    import torch

    from trainer_client.evaluate import greedy_accuracy_of, pass_rates_of, read_rows
    from trainer_client.grpo import GRPOTrainer, TrainConfig
    from trainer_client.launch import SamplerProcess
    from trainer_client.toy import build_toy

    toy = build_toy(work / f"toy-{method}-{seed}", seed=seed, n_train=n_train, n_eval=eval_n)
    data_files = [f for f in toy.data_files if domains is None or f.stem in domains]
    eval_rows = read_rows([f for f in toy.eval_files if domains is None or f.stem in domains])
    state = work / f"state-{method}-{seed}"
    shutil.rmtree(state, ignore_errors=True)
    config = {**COMMON, **METHODS[method]["config"], "batch_groups": batch_groups}
    started = time.monotonic()
    sampler = SamplerProcess(
        toy.model_dir,
        data_files,
        state,
        config,
        work / f"sampler-{method}-{seed}.log",
        seed=seed,
        extra=["--torch-threads", "1"],
    )
    with sampler:
        cfg = TrainConfig(
            url=sampler.url,
            model=toy.model_dir,
            out_dir=work / f"train-{method}-{seed}",
            steps=1,
            batch_groups=batch_groups,
            lr=lr,
            advantage="server",
            sync_every=1,
            consumer=f"learning-{method}",
            seed=seed,
            progress=False,
            watchdog_s=120.0,
        )
        trainer = GRPOTrainer(cfg)
        with trainer.client:
            points = [
                {
                    "answers": 0,
                    "step": 0,
                    "wall_s": 0.0,
                    **greedy_accuracy_of(trainer.model, trainer.tokenizer, eval_rows),
                    "t1": pass_rates_of(
                        trainer.model, trainer.tokenizer, eval_rows, T1_SAMPLES, 1.0, seed=seed
                    ),
                }
            ]
            wall = 0.0  # training time; evaluations are not counted
            answers, per_step = 0, 4.0 * batch_groups
            for k in range(1, checkpoints + 1):
                target = budget * k / checkpoints
                while answers < target:
                    # Steps to reach the next checkpoint at the answers/step seen so far.
                    # The first call is a single step: it measures answers/step.
                    cfg.steps = trainer.step + (
                        1 if trainer.step == 0 else max(1, math.ceil((target - answers) / per_step))
                    )
                    t0 = time.monotonic()
                    trainer.train()
                    wall += time.monotonic() - t0
                    answers = sum(sum(r["domain_generated"].values()) for r in trainer.history)
                    per_step = answers / max(trainer.step, 1)
                acc = greedy_accuracy_of(trainer.model, trainer.tokenizer, eval_rows)
                acc["t1"] = pass_rates_of(
                    trainer.model, trainer.tokenizer, eval_rows, T1_SAMPLES, 1.0, seed=seed
                )
                points.append({"answers": answers, "step": trainer.step, "wall_s": wall, **acc})
                if on_checkpoint is not None:
                    on_checkpoint()
            stats = trainer.client.stats()
    del trainer
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    return {
        "method": method,
        "seed": seed,
        "points": points,
        "steps": points[-1]["step"],
        "answers": points[-1]["answers"],
        "answers_per_step": points[-1]["answers"] / max(points[-1]["step"], 1),
        "sampler_samples": stats.get("samples"),
        "real_s": time.monotonic() - started,
    }


_AXES = {"answers", "step", "wall_s", "t1"}  # t1: the T=1 pass rates, a second metric


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _cpu_s() -> float:
    """CPU seconds of this process plus its finished children (the sampler processes)."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _domains(point: dict[str, Any]) -> list[str]:
    return [d for d in point if d not in _AXES]


def aggregate(
    runs: list[dict[str, Any]], domains: list[str], grid: np.ndarray, axis: str = "answers"
) -> dict[str, Any]:
    """Per method and domain: mean, min, max over seeds of accuracy interpolated on `grid`
    along `axis` (answers generated or training wall time)."""
    out: dict[str, Any] = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        curves = {}
        for d in [*domains, "mean"]:
            ys = []
            for r in mine:
                xs = [p[axis] for p in r["points"]]
                vals = [
                    p[d] if d != "mean" else float(np.mean([p[x] for x in domains]))
                    for p in r["points"]
                ]
                ys.append(np.interp(grid, xs, vals))
            ys_arr = np.array(ys)
            curves[d] = {
                "mean": ys_arr.mean(0).tolist(),
                "min": ys_arr.min(0).tolist(),
                "max": ys_arr.max(0).tolist(),
                "std": ys_arr.std(0, ddof=1).tolist() if len(ys) > 1 else [0.0] * len(grid),
            }
        out[method] = curves
    return out


# Two-sided 95% quantiles of Student's t by degrees of freedom (no scipy here).
_T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}


def t95(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (conservative between
    tabulated values; 1.96 beyond 30)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df > 30:
        return 1.96
    return _T95[min(k for k in _T95 if k >= df)]


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided sign-test p-value for `wins` positive and `losses` negative
    differences (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_stats(diffs: list[float]) -> dict[str, Any]:
    """Summary of per-seed paired differences: mean, sd, paired t, a 95% confidence
    interval of the mean (t-based), and the sign count with its exact sign-test p."""
    n = len(diffs)
    mean = float(np.mean(diffs)) if n else float("nan")
    sd = float(np.std(diffs, ddof=1)) if n > 1 else 0.0
    se = sd / math.sqrt(n) if n > 1 else float("nan")
    half = t95(n - 1) * se if n > 1 else float("nan")
    wins = sum(d > 0 for d in diffs)
    losses = sum(d < 0 for d in diffs)
    return {
        "diffs": [float(d) for d in diffs],
        "n": n,
        "mean": mean,
        "sd": sd,
        "t": mean / se if n > 1 and sd > 0 else None,
        "ci95": [mean - half, mean + half] if n > 1 else None,
        "wins": wins,
        "losses": losses,
        "sign_p": sign_test_p(wins, losses),
    }


def _value_at(
    r: dict[str, Any], domains: list[str], axis: str, at: float, metric: str = "greedy"
) -> float:
    """A run's mean over `domains` of its greedy accuracy (or, `metric` "t1", its T=1
    pass rate), interpolated at `at` on `axis`."""
    xs = [p[axis] for p in r["points"]]
    ys = [
        float(np.mean([(p if metric == "greedy" else p[metric])[d] for d in domains]))
        for p in r["points"]
    ]
    return float(np.interp(at, xs, ys))


def _paired(
    runs: list[dict[str, Any]], domains: list[str], axis: str, at: float, metric: str = "greedy"
) -> dict[str, Any]:
    """Per method, per seed: its mean accuracy minus GRPO n=4's at `at` on `axis`
    (interpolated), summarized by `paired_stats`."""
    by = {(r["method"], r["seed"]): _value_at(r, domains, axis, at, metric) for r in runs}
    out: dict[str, Any] = {}
    for method in METHODS:
        seeds = sorted({s for m, s in by if m == method and ("grpo4", s) in by})
        if method == "grpo4" or not seeds:
            continue
        out[method] = paired_stats([by[(method, s)] - by[("grpo4", s)] for s in seeds])
        out[method]["seeds"] = seeds
    return out


def _gains(
    runs: list[dict[str, Any]], domains: list[str], axis: str, at: float, metric: str = "greedy"
) -> dict[str, Any]:
    """Per method: each seed's mean accuracy at `at` on `axis` minus its own at 0 (did it
    learn?), summarized by `paired_stats`."""
    out: dict[str, Any] = {}
    for method in METHODS:
        mine = sorted((r for r in runs if r["method"] == method), key=lambda r: r["seed"])
        if not mine:
            continue
        out[method] = paired_stats(
            [
                _value_at(r, domains, axis, at, metric) - _value_at(r, domains, axis, 0.0, metric)
                for r in mine
            ]
        )
        out[method]["seeds"] = [r["seed"] for r in mine]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 seeds, fewer answers (< 10 minutes)")
    p.add_argument("--seeds", type=int, help="seeds per method (>= 3)")
    p.add_argument("--budget", type=int, help="answers generated per run")
    p.add_argument(
        "--checkpoints", type=int, help="evaluations along the way, plus one at 0 [4 quick, 8]"
    )
    p.add_argument("--batch-groups", type=int, default=BATCH_GROUPS)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--eval-n", type=int, default=EVAL_N, help="held-out prompts per domain")
    p.add_argument("--method", action="append", choices=list(METHODS))
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs side by side (1: one after another, the only setting whose wall-clock "
        "axis is measured on an otherwise idle machine)",
    )
    p.add_argument(
        "--domain",
        action="append",
        choices=["add1", "add2", "mul"],
        help=f"train and evaluate on these toy domains [{', '.join(DOMAINS)}]",
    )
    args = p.parse_args(argv)
    if args.domain is None:
        args.domain = list(DOMAINS)
    if args.checkpoints is None:
        args.checkpoints = 4 if args.quick else 8
    seeds = args.seeds or (3 if args.quick else 5)
    budget = args.budget or (QUICK_BUDGET if args.quick else FULL_BUDGET)
    methods = args.method or list(QUICK_METHODS if args.quick else METHODS)
    domains_arg = args.domain or None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(1)  # the sampler process has its own core
    started, cpu0 = time.monotonic(), _cpu_s()
    runs = []
    bar = tqdm(
        total=seeds * len(methods) * args.checkpoints,
        desc="learning",
        unit="eval",
        dynamic_ncols=True,
    )
    tasks = [
        (method, seed)
        for seed in range(seeds)
        for method in (methods if seed % 2 == 0 else methods[::-1])
    ]

    def done(r: dict[str, Any]) -> None:
        runs.append(r)
        last = r["points"][-1]
        tqdm.write(
            f"  {METHODS[r['method']]['label']}, seed {r['seed']}: {r['steps']} steps, "
            f"{r['answers']} answers, "
            + " ".join(f"{d}={last[d]:.3f}" for d in _domains(last))
            + f" ({r['real_s']:.0f}s)"
        )

    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        kwargs = {
            "batch_groups": args.batch_groups,
            "lr": args.lr,
            "eval_n": args.eval_n,
            "domains": domains_arg,
        }
        if args.jobs <= 1:
            for method, seed in tasks:
                bar.set_postfix_str(f"{method} seed {seed}")
                done(
                    run_one(
                        method,
                        seed,
                        budget,
                        args.checkpoints,
                        Path(tmp),
                        on_checkpoint=lambda: bar.update(1),
                        **kwargs,
                    )
                )
        else:  # runs side by side, each in its own process (and its own sampler process)
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_one_thread) as ex:
                futures = [
                    ex.submit(run_one, m, sd, budget, args.checkpoints, Path(tmp), **kwargs)
                    for m, sd in tasks
                ]
                for f in as_completed(futures):
                    done(f.result())
                    bar.update(args.checkpoints)
        runs.sort(key=lambda r: tasks.index((r["method"], r["seed"])))
    bar.close()
    domains = _domains(runs[0]["points"][0])
    grid = np.linspace(0, budget, args.checkpoints + 1)
    curves = aggregate(runs, domains, grid)
    # Equal wall-clock: up to the shortest run's training time, so every run covers it.
    wall_at = min(r["points"][-1]["wall_s"] for r in runs)
    wall_grid = np.linspace(0, wall_at, args.checkpoints + 1)
    wall_curves = aggregate(runs, domains, wall_grid, axis="wall_s")
    rows = []
    for method, c in curves.items():
        row: dict[str, Any] = {"method": METHODS[method]["label"]}
        mine = [r for r in runs if r["method"] == method]
        row["steps"] = float(np.mean([r["steps"] for r in mine]))
        row["answers_per_step"] = float(np.mean([r["answers_per_step"] for r in mine]))
        t1_0 = [_value_at(r, domains, "answers", 0.0, "t1") for r in mine]
        t1_b = [_value_at(r, domains, "answers", budget, "t1") for r in mine]
        row["t1_start"], row["t1"] = float(np.mean(t1_0)), float(np.mean(t1_b))
        row["t1_spread"] = f"{min(t1_b):.3f}..{max(t1_b):.3f}"
        for d in [*domains, "mean"]:
            row[f"{d}_start"] = c[d]["mean"][0]
            row[d] = c[d]["mean"][-1]
            row[f"{d}_spread"] = f"{c[d]['min'][-1]:.3f}..{c[d]['max'][-1]:.3f}"
        rows.append(row)
    print(
        f"\n== held-out greedy accuracy after {budget:,} answers generated (mean over {seeds} seeds; min..max) =="
    )
    cols = [("method", "method"), ("steps", "steps"), ("answers_per_step", "answers/step")]
    for d in [*domains, "mean"]:
        cols += [(f"{d}_start", f"{d} @0"), (d, f"{d} @budget"), (f"{d}_spread", f"{d} spread")]
    print(table(rows, cols))
    print("\naccuracy (mean over seeds) along the way:")
    grid_rows = []
    for i, a in enumerate(grid):
        gr: dict[str, Any] = {"answers": int(a)}
        for method, c in curves.items():
            gr[method] = c["mean"]["mean"][i]
        grid_rows.append(gr)
    print(
        table(
            grid_rows,
            [("answers", "answers"), *[(m, f"{METHODS[m]['label']} mean acc") for m in curves]],
        )
    )
    paired = {
        "answers": _paired(runs, domains, "answers", budget),
        "wall_s": _paired(runs, domains, "wall_s", wall_at),
    }
    gains = {
        "answers": _gains(runs, domains, "answers", budget),
        "wall_s": _gains(runs, domains, "wall_s", wall_at),
    }
    t1 = {
        "gains": {"answers": _gains(runs, domains, "answers", budget, "t1")},
        "paired_by_seed": {
            "answers": _paired(runs, domains, "answers", budget, "t1"),
            "wall_s": _paired(runs, domains, "wall_s", wall_at, "t1"),
        },
    }

    def show(pr: dict[str, Any]) -> str:
        t = "-" if pr["t"] is None else f"{pr['t']:+.2f}"
        ci = "-" if pr["ci95"] is None else f"[{pr['ci95'][0]:+.3f}, {pr['ci95'][1]:+.3f}]"
        return (
            ", ".join(f"{d:+.3f}" for d in pr["diffs"])
            + f" (mean {pr['mean']:+.3f}, 95% CI {ci}, sd {pr['sd']:.3f}, paired t {t}, "
            f"{pr['wins']} of {pr['n']} seeds > 0, sign test p {pr['sign_p']:.2f})"
        )

    print(f"\nlearned? per seed, mean accuracy at {budget:,} answers minus at 0:")
    for method, pr in gains["answers"].items():
        print(f"  {METHODS[method]['label']}: {show(pr)}")
    print(f"\nsecond metric, held-out T=1 pass rate ({T1_SAMPLES} samples per prompt):")
    for name, block in (
        ("at budget minus at 0", t1["gains"]["answers"]),
        ("minus GRPO n=4's, equal answers", t1["paired_by_seed"]["answers"]),
        ("minus GRPO n=4's, equal wall-clock", t1["paired_by_seed"]["wall_s"]),
    ):
        for method, pr in block.items():
            print(f"  {name}: {METHODS[method]['label']}: {show(pr)}")
    for axis, at in (
        ("answers", f"{budget:,} answers"),
        ("wall_s", f"{wall_at:.0f} s of training"),
    ):
        print(f"\npaired by seed, mean accuracy minus GRPO n=4's at {at}:")
        for method, pr in paired[axis].items():
            print(f"  {METHODS[method]['label']}: {show(pr)}")
    out = {
        "paired_by_seed": paired,
        "gains": gains,
        "t1": t1,
        "wall_at": wall_at,
        "settings": {
            **vars(args),
            "seeds": seeds,
            "budget": budget,
            "methods": {m: METHODS[m] for m in methods},
            "common": COMMON,
        },
        "runs": runs,
        "grid": grid.tolist(),
        "curves": curves,
        "wall_grid": wall_grid.tolist(),
        "wall_curves": wall_curves,
        "summary": rows,
        "real_s": time.monotonic() - started,
        "cpu_s": _cpu_s() - cpu0,
    }
    path = write_json("learning", out)
    png = _plot(curves, domains, grid, seeds, budget)
    print(
        f"wrote {path} and {png}; real time {time.monotonic() - started:.0f}s, "
        f"CPU {out['cpu_s']:.0f}s (this process and its sampler processes)"
    )
    return out


def _plot(
    curves: dict[str, Any], domains: list[str], grid: np.ndarray, seeds: int, budget: int
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = domains if len(domains) == 1 else [*domains, "mean"]
    fig, axes = plt.subplots(
        1, len(names), figsize=(4.2 * len(names) + 1, 3.8), sharey=False, squeeze=False
    )
    axes = axes[0]
    for ax, d in zip(axes, names, strict=True):
        for method, c in curves.items():
            (line,) = ax.plot(grid, c[d]["mean"], "o-", label=METHODS[method]["label"])
            ax.fill_between(grid, c[d]["min"], c[d]["max"], color=line.get_color(), alpha=0.2)
        ax.set_title(f"{d}: held-out greedy accuracy", fontsize=10)
        ax.set_xlabel("answers generated")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"toy task, reference GRPO trainer: mean over {seeds} seeds, band = min..max", fontsize=10
    )
    fig.tight_layout()
    path = RESULTS / "learning.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
