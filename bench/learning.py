"""Does adaptive sampling learn faster per answer generated, and per second? GRPO n=4 vs
Seq-Balance, with the advantage estimator ablated separately from the stopping rule.

On the toy arithmetic task (three domains: add1, add2, mul), the reference GRPO trainer
(`trainer_client.grpo.GRPOTrainer`) trains the toy model against a real sampler process
(`adaptive-rollout serve`) with either

- `grpo4`: plain GRPO, rule `fixed`, n = 4, GRPO advantages; or
- `seqbal`: Seq-Balance, rule `balanced` (K_pos = K_neg = 2, n_max 16, adaptive waves of
  up to 8), balanced down-sampling to n = 4, Reinforce-Ada's global-baseline advantage;
- `grpo4_global`: GRPO n=4's rule with Seq-Balance's advantage (global baseline), and
  `seqbal_grpo`: Seq-Balance's rule with GRPO advantages, so the rule and the advantage
  estimator are compared one at a time;

with everything else equal (batch of 16 groups, lr, temperature 1, static uniform domain
mix, one weight push per step, `max_staleness` 0 so the sampler runs at most one batch
ahead of the trainer: groups are one policy version old when trained on). Cost is counted in answers generated for the groups the
trainer trained on (`GroupStats.n_generated`); every run stops at the same answer budget
and is evaluated at checkpoints along the way: greedy exact-match accuracy per domain on
the held-out split. Curves are interpolated onto a common answers grid and averaged over
seeds, with the spread (min..max over seeds) shown. The same is done on a wall-clock axis
(training time, evaluations excluded), and each method is paired by seed with GRPO n=4
at equal answers and at equal wall-clock time (mean difference, sd, paired t).

    .venv/bin/python -m bench.learning --quick     # 3 seeds x 4 methods, ~10 minutes on 2 cores
    .venv/bin/python -m bench.learning             # 5 seeds, a larger answer budget
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, table, write_json

COMMON: dict[str, Any] = {
    "temperature": 1.0,
    "max_tokens": 6,
    "max_active_prompts": 48,
    "max_buffered_groups": 64,
    "max_staleness": 0,
    "mixing": {"name": "static", "params": {}},
}
# Seq-Balance K=2/2, n_max 16, n=4 with adaptive waves; the rows differ in the advantage.
SEQ_BALANCE: dict[str, Any] = {
    "rule": "balanced",
    "k_pos": 2,
    "k_neg": 2,
    "n_max": 16,
    "wave": "adaptive",
    "wave_size": 8,
    "group_size": 4,
    "downsample": "balanced",
}

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
) -> dict[str, Any]:
    """Train one (method, seed) to `budget` answers; evaluate at `checkpoints` points."""
    import torch

    from sampler_service.toy import build_toy
    from trainer_client.evaluate import greedy_accuracy_of, read_rows
    from trainer_client.grpo import GRPOTrainer, TrainConfig
    from trainer_client.launch import SamplerProcess

    toy = build_toy(work / f"toy-{seed}", seed=seed, n_eval=eval_n)
    eval_rows = read_rows(toy.eval_files)
    state = work / f"state-{method}-{seed}"
    shutil.rmtree(state, ignore_errors=True)
    config = {**COMMON, **METHODS[method]["config"], "batch_groups": batch_groups}
    started = time.monotonic()
    sampler = SamplerProcess(
        toy.model_dir,
        toy.data_files,
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
            steps=0,
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
                points.append({"answers": answers, "step": trainer.step, "wall_s": wall, **acc})
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


_AXES = {"answers", "step", "wall_s"}


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


def _paired(runs: list[dict[str, Any]], domains: list[str], axis: str, at: float) -> dict[str, Any]:
    """Per method, per seed: its mean accuracy minus GRPO n=4's at `at` on `axis`
    (interpolated), with mean, sd and the paired t over seeds."""

    def value(r: dict[str, Any]) -> float:
        xs = [p[axis] for p in r["points"]]
        ys = [float(np.mean([p[d] for d in domains])) for p in r["points"]]
        return float(np.interp(at, xs, ys))

    by = {(r["method"], r["seed"]): value(r) for r in runs}
    out: dict[str, Any] = {}
    for method in METHODS:
        seeds = sorted({s for m, s in by if m == method and ("grpo4", s) in by})
        if method == "grpo4" or not seeds:
            continue
        diffs = [by[(method, s)] - by[("grpo4", s)] for s in seeds]
        sd = float(np.std(diffs, ddof=1)) if len(diffs) > 1 else 0.0
        mean = float(np.mean(diffs))
        out[method] = {
            "diffs": diffs,
            "mean": mean,
            "sd": sd,
            "t": mean / (sd / math.sqrt(len(diffs))) if sd > 0 else None,
            "wins": sum(d > 0 for d in diffs),
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="3 seeds, 6,000 answers per run (~10 minutes)"
    )
    p.add_argument("--seeds", type=int, help="seeds per method (>= 3)")
    p.add_argument("--budget", type=int, help="answers generated per run")
    p.add_argument(
        "--checkpoints", type=int, default=6, help="evaluations along the way (plus one at 0)"
    )
    p.add_argument("--batch-groups", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-n", type=int, default=64, help="held-out prompts per domain")
    p.add_argument("--method", action="append", choices=list(METHODS))
    args = p.parse_args(argv)
    seeds = args.seeds or (3 if args.quick else 5)
    budget = args.budget or (6000 if args.quick else 16000)
    methods = args.method or list(METHODS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)  # the sampler process has its own core
    started = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
        for seed in range(seeds):
            for method in methods if seed % 2 == 0 else methods[::-1]:
                r = run_one(
                    method,
                    seed,
                    budget,
                    args.checkpoints,
                    Path(tmp),
                    batch_groups=args.batch_groups,
                    lr=args.lr,
                    eval_n=args.eval_n,
                )
                runs.append(r)
                last = r["points"][-1]
                print(
                    f"  {METHODS[method]['label']}, seed {seed}: {r['steps']} steps, {r['answers']} answers, "
                    + " ".join(f"{d}={last[d]:.3f}" for d in _domains(last))
                    + f" ({r['real_s']:.0f}s)",
                    flush=True,
                )
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
    for axis, at in (
        ("answers", f"{budget:,} answers"),
        ("wall_s", f"{wall_at:.0f} s of training"),
    ):
        print(f"\npaired by seed, mean accuracy minus GRPO n=4's at {at}:")
        for method, pr in paired[axis].items():
            t = "-" if pr["t"] is None else f"{pr['t']:+.2f}"
            print(
                f"  {METHODS[method]['label']}: "
                + ", ".join(f"{d:+.3f}" for d in pr["diffs"])
                + f" (mean {pr['mean']:+.3f}, sd {pr['sd']:.3f}, paired t {t}, "
                f"{pr['wins']} of {len(pr['diffs'])} seeds > 0)"
            )
    out = {
        "paired_by_seed": paired,
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
    }
    path = write_json("learning", out)
    png = _plot(curves, domains, grid, seeds, budget)
    print(f"wrote {path} and {png}; real time {time.monotonic() - started:.0f}s")
    return out


def _plot(
    curves: dict[str, Any], domains: list[str], grid: np.ndarray, seeds: int, budget: int
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [*domains, "mean"]
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), sharey=False)
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
