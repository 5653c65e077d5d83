"""Compute to a target: the answers each sampling method needs to reach GRPO n=4's values.

Measured on the toy task's hard settings, in answers generated, in tokens and in
modelled GPU seconds.

On the toy arithmetic task, the reference GRPO trainer (`trainer_client.grpo.GRPOTrainer`)
trains the toy model against a real sampler process (`adaptive-rollout serve`), one
method per run (`METHODS`: GRPO n=4 and its baselines, the adaptive rules, and the
advantage-estimator ablations), everything else equal: batch of 32 groups, AdamW lr
2e-4 (tuned on GRPO n=4), temperature 1, one weight push per step, `max_staleness` 0
(the trainer pushes a step's weights before it acks the step's groups, so every step
trains on-policy).

Settings (`SETTINGS`), the toy's own domains as `adaptive-rollout toy` writes them (512
training prompts per domain, drawn by the seed): `mul` (hard: a third of its prompts
are never solved in 32 samples by the warm-start model), `add2+mul`, and `add2`. Each
setting's starting per-prompt pass-rate histogram (32 samples at T=1 per training
prompt, seed 0's prompts) is measured once and cached.

Metrics, evaluated at checkpoints along each run (the mean over the setting's domains):
- `train_t1`: the T=1 pass rate on the run's own training prompts (8 samples each),
  what the RL objective raises;
- `greedy`: held-out greedy exact-match accuracy; `t1`: held-out T=1 pass rate (8
  samples). Held-out prompts are `--eval-n` per domain, capped by the domain's held-out
  split (`mul` has 152 problems in all): the sizes used are recorded per run and printed;
- informative groups per 1,000 answers: trained groups whose rewards are not all equal,
  over every answer generated;
- stop reasons and drop reasons of every group the sampler finished (its `/v1/stats`).

Cost is every answer the sampler generated (`/v1/stats` `samples` and `tokens`, read
when the trainer returns at a checkpoint), for groups trained on and groups dropped or
skipped alike; with `max_staleness` 0 the sampler runs at most one batch ahead, so a
point's count may include part of the next batch, the same for every method.

Modelled time, what a GPU run would pay (the step-time benchmark's engine `ENGINE` and
trainer model, at full engine occupancy):

    model_s = A x c_prefill + T x lam x c_tok + r x c4 x S + K x SYNC_S

with A answers, T toy tokens generated, S samples trained, K optimizer steps;
c_prefill = prefill_per_token_s x P (P = 150 prompt tokens, the step-time benchmark's
median prompt); c_tok = (step_base_s + N x step_per_seq_s) / N + kv_token_s x (P + L / 2),
the decode seconds per token with N = max_num_seqs sequences running and L =
length_median; lam = L / (GRPO n=4's mean toy tokens per answer in the setting), so a
GRPO n=4 answer stands for a median-length LLM answer; c4 = c_prefill + L x c_tok, GRPO
n=4's seconds per answer, and r = 0.7 (the step-time benchmark's middle trainer ratio:
training a GRPO n=4 batch costs 0.7 x generating it). The toy's measured training
wall-clock (`wall_s`, evaluations excluded) is kept beside it; on the toy a trainer step
costs more than generating its batch, so that axis favours fewer optimizer steps.

Headline, per setting and metric: per seed, the answers (tokens, modelled seconds) at
which a method's interpolated curve first reaches GRPO n=4's final value of the same
seed, as a ratio to GRPO n=4's; the geometric mean over seeds with a paired 95% t
interval on the log ratios. A method that never reaches it within its budget gets its
budget as a lower bound and the ratio is reported as "> x". Also the paired differences
at equal answers, equal modelled time and equal wall-clock time (each the shortest run's),
and each run's gain over its own start. Every curve starts at no cost: what the sampler
generated before the first step is the first batch's, counted at the next checkpoint.

Each run's result is cached as bench/results/learning_runs/<setting>__<method>__s<seed>
__<config hash>.json, so a run is never repeated and results can be committed as they
land; the summary (bench/results/learning.json, with its `targets` object, and a PNG per
setting) is computed from the cached runs whose configuration matches.

    python -m bench.learning --setting mul --seeds 3              # the screen on mul
    python -m bench.learning --setting mul --method grpo4 --seeds 5
    python -m bench.learning --summary-only                       # summary of the cache
    python -m bench.learning --quick        # mul, 2 methods x 2 seeds of 10,240 answers
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import DAPO_REFILL, RESULTS, flags, grpo, table, write_json
from bench.step_time import ENGINE, SYNC_S
from trainer_client.demo import SEQ_BALANCE
from trainer_client.report import save_figure

COMMON: dict[str, Any] = {
    "temperature": 1.0,
    "max_tokens": 6,
    "max_active_prompts": 48,
    "max_buffered_groups": 64,
    "max_staleness": 0,
    "mixing": {"name": "static", "params": {}},
}
#: Training settings: name -> the toy domains trained and evaluated on.
SETTINGS: dict[str, tuple[str, ...]] = {
    "mul": ("mul",),
    "add2+mul": ("add2", "mul"),
    "add2": ("add2",),
}
#: The settings the targets are judged on.
HARD_SETTINGS = ("mul", "add2+mul")
BATCH_GROUPS = 32
LR = 2e-4
N_TRAIN = 512  # what `adaptive-rollout toy` writes per domain
EVAL_N = 256
BUDGET = 61440
CHECKPOINTS = 8
QUICK_BUDGET = 10240
QUICK_METHODS = ("grpo4", "seqbal")
#: Samples per prompt for the T=1 pass rates (training and held-out prompts).
T1_SAMPLES = 8
#: Samples per training prompt for the starting pass-rate histogram.
HIST_SAMPLES = 32
HIST_EDGES = (0.0, 1e-9, 0.125, 0.25, 0.5, 0.75, 1.0 - 1e-9, 1.0)
HIST_LABELS = ("0", "(0, 1/8)", "[1/8, 1/4)", "[1/4, 1/2)", "[1/2, 3/4)", "[3/4, 1)", "1")
#: The step-time benchmark's median simulated prompt length (tokens).
PROMPT_TOKENS = 150
#: Trainer seconds per sample as a multiple of GRPO n=4's generation seconds per answer.
TRAIN_RATIO = 0.7
METRICS = {
    "train_t1": "training-prompt T=1 pass rate",
    "greedy": "held-out greedy accuracy",
    "t1": "held-out T=1 pass rate",
}
#: Cost axes for compute to target.
COST_AXES = ("answers", "tokens", "model_s")
RUNS_DIR = RESULTS / "learning_runs"
_HISTORY_SKIP = [{"name": "history_skip", "params": {"explore": 0.5, "max_skip": 0.9}}]
_GRPO4 = grpo(4)
_SEQPOS1_POSTERIOR = {
    **SEQ_BALANCE,
    "rule": "positive",
    "k_pos": 1,
    "advantage": "global",
    "allocation": {"name": "posterior", "params": {"pilot": 4}},
    "admission_policies": _HISTORY_SKIP,
}
#: A prompt comes back once an epoch (16 steps here): the lag covers four.
_REPLAY = {"per_prompt": 2, "max_version_lag": 64}
#: kind: "baseline" (compared against), "adaptive" (the targets' candidates), "ablation".
METHODS: dict[str, dict[str, Any]] = {
    "grpo4": {"label": "GRPO n=4", "kind": "baseline", "config": _GRPO4},
    "grpo4_skip": {
        "label": "GRPO n=4 + history skip",
        "kind": "baseline",
        "config": {**_GRPO4, "admission_policies": _HISTORY_SKIP},
    },
    "dapo4": {
        "label": "DAPO refill n=4",
        "kind": "baseline",
        "config": {**_GRPO4, **DAPO_REFILL},
    },
    "seqpos1": {
        "label": "Seq-Pos K_pos 1 (n_max 16, n=4)",
        "kind": "adaptive",
        "config": {**SEQ_BALANCE, "rule": "positive", "k_pos": 1, "advantage": "global"},
    },
    "seqbal": {
        "label": "Seq-Balance (K=2/2, n_max 16, n=4)",
        "kind": "adaptive",
        "config": {**SEQ_BALANCE, "advantage": "global"},
    },
    "seqbal_posterior": {
        "label": "Seq-Balance + posterior budget (pilot 4) + history skip",
        "kind": "adaptive",
        "config": {
            **SEQ_BALANCE,
            "advantage": "global",
            "allocation": {"name": "posterior", "params": {"pilot": 4}},
            "admission_policies": _HISTORY_SKIP,
        },
    },
    "seqpos1_posterior": {
        "label": "Seq-Pos K_pos 1 + posterior budget (pilot 4) + history skip",
        "kind": "adaptive",
        "config": _SEQPOS1_POSTERIOR,
    },
    "seqbal_knapsack": {
        "label": "Seq-Balance + knapsack (mean budget 6, n_min 4)",
        "kind": "adaptive",
        "config": {
            **SEQ_BALANCE,
            "advantage": "global",
            "allocation": {"name": "knapsack", "params": {"mean_budget": 6, "n_min": 4}},
        },
    },
    "seqbal_pilot_commit": {
        "label": "Seq-Balance + pilot-commit (pilot 4)",
        "kind": "adaptive",
        "config": {
            **SEQ_BALANCE,
            "advantage": "global",
            "allocation": {"name": "pilot_commit", "params": {"pilot": 4}},
        },
    },
    "seqpos1_posterior_replay": {
        "label": "Seq-Pos K_pos 1 + posterior budget + history skip + replay",
        "kind": "adaptive",
        "config": {**_SEQPOS1_POSTERIOR, "replay": _REPLAY},
    },
    "seqpos1_posterior_replay_exact": {
        "label": "Seq-Pos K_pos 1 + posterior budget + history skip + replay, exact stopping",
        "kind": "adaptive",
        "config": {**_SEQPOS1_POSTERIOR, "replay": _REPLAY, "stopping": "exact"},
    },
    "seqpos1_posterior_replay_exact_hard16": {
        "label": "Seq-Pos K_pos 1 + posterior + skip + replay, exact, hard_wave_size 16",
        "kind": "ablation",
        "config": {
            **_SEQPOS1_POSTERIOR,
            "replay": _REPLAY,
            "stopping": "exact",
            "hard_wave_size": 16,
        },
    },
    "grpo4_replay": {
        "label": "GRPO n=4 + replay of earlier right answers",
        "kind": "adaptive",
        "config": {**_GRPO4, "replay": _REPLAY},
    },
    "est": {
        "label": "Est (budget ~ 1/sqrt(p), mean 8, n=4)",
        "kind": "adaptive",
        "config": {**SEQ_BALANCE, "rule": "est", "advantage": "global"},
    },
    "seqbal_maxrl": {
        "label": "Seq-Balance, MaxRL advantages",
        "kind": "adaptive",
        "config": {**SEQ_BALANCE, "advantage": "maxrl"},
    },
    "grpo4_global": {
        "label": "GRPO n=4, global baseline",
        "kind": "ablation",
        "config": {**_GRPO4, "advantage": "global"},
    },
    "seqbal_grpo": {
        "label": "Seq-Balance, GRPO advantages",
        "kind": "ablation",
        "config": {**SEQ_BALANCE, "advantage": "grpo"},
    },
}


# -- configuration and the run cache ---------------------------------------------------------
def run_config(
    setting: str,
    method: str,
    *,
    budget: int,
    checkpoints: int,
    batch_groups: int,
    lr: float,
    eval_n: int,
) -> dict[str, Any]:
    """Everything a run's result depends on besides its seed (hashed into its cache key)."""
    return {
        "setting": setting,
        "domains": list(SETTINGS[setting]),
        "method": method,
        "sampler": {**COMMON, **METHODS[method]["config"], "batch_groups": batch_groups},
        "budget": budget,
        "checkpoints": checkpoints,
        "batch_groups": batch_groups,
        "lr": lr,
        "n_train": N_TRAIN,
        "eval_n": eval_n,
        "t1_samples": T1_SAMPLES,
    }


def config_hash(config: dict[str, Any]) -> str:
    """A short stable digest of a JSON-able configuration."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]


def run_path(runs_dir: Path, config: dict[str, Any], seed: int) -> Path:
    return (
        runs_dir / f"{config['setting']}__{config['method']}__s{seed}__{config_hash(config)}.json"
    )


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


# -- one learning run ----------------------------------------------------------------------
def _trainer_class() -> Any:
    from trainer_client.grpo import GRPOTrainer

    class CountingTrainer(GRPOTrainer):
        """The reference trainer, its step log also counting informative groups (kept
        rewards not all equal: the advantage is nonzero somewhere)."""

        def _record(self, batch: Any, metrics: Any, acked: int, **timing: float) -> Any:
            record = super()._record(batch, metrics, acked, **timing)
            record["informative"] = sum(
                1
                for g in batch.groups
                if len(g.samples) >= 2
                and max(s.reward for s in g.samples) > min(s.reward for s in g.samples)
            )
            return record

    return CountingTrainer


def _by_prompt(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with each prompt as its own "domain", so the evaluators score per prompt."""
    return [{**r, "domain": r["id"]} for r in rows]


def run_one(config: dict[str, Any], seed: int, work: Path) -> dict[str, Any]:
    """Train one (setting, method, seed) to `budget` answers generated; evaluate at
    `checkpoints` points plus one at 0."""
    import torch

    from trainer_client.evaluate import greedy_accuracy_of, pass_rates_of, read_rows
    from trainer_client.grpo import TrainConfig
    from trainer_client.launch import SamplerProcess
    from trainer_client.toy import build_toy

    torch.set_num_threads(1)  # the sampler process has its own core
    domains, method = config["domains"], config["method"]
    name = f"{config['setting']}-{method}-{seed}"
    toy = build_toy(work / f"toy-{name}", seed=seed, n_train=N_TRAIN, n_eval=config["eval_n"])
    data_files = [f for f in toy.data_files if f.stem in domains]
    train_rows = read_rows(data_files)
    eval_rows = read_rows([f for f in toy.eval_files if f.stem in domains])
    sizes = {
        "train": dict(Counter(r["domain"] for r in train_rows)),
        "eval": dict(Counter(r["domain"] for r in eval_rows)),
    }
    state = work / f"state-{name}"
    shutil.rmtree(state, ignore_errors=True)
    started = time.monotonic()
    sampler = SamplerProcess(
        toy.model_dir,
        data_files,
        state,
        # A method that names no stopping counts whole waves: every run in the cache was
        # measured so, before exact stopping existed (the key hashes the config as named).
        {"stopping": "wave", **config["sampler"]},
        work / f"sampler-{name}.log",
        seed=seed,
        extra=["--torch-threads", "1"],
    )
    with sampler:
        cfg = TrainConfig(
            url=sampler.url,
            model=toy.model_dir,
            out_dir=work / f"train-{name}",
            steps=1,
            batch_groups=config["batch_groups"],
            lr=config["lr"],
            advantage="server",
            sync_every=1,
            consumer=f"learning-{method}",
            seed=seed,
            progress=False,
            watchdog_s=120.0,
        )
        trainer = _trainer_class()(cfg)

        def point(trainer: Any, stats: dict[str, Any], wall: float) -> dict[str, Any]:
            m, tok = trainer.model, trainer.tokenizer
            h = trainer.history
            return {
                "answers": _generated(stats),
                # Every decoded token: surplus answers and dropped prompts cost too.
                "tokens": stats["waste"]["decoded"] if "waste" in stats else stats["tokens"],
                "trained_answers": sum(sum(r["domain_generated"].values()) for r in h),
                "samples_trained": sum(r["samples"] for r in h),
                "groups_trained": sum(r["groups"] for r in h),
                "informative": sum(r["informative"] for r in h),
                "step": trainer.step,
                "wall_s": wall,
                **greedy_accuracy_of(m, tok, eval_rows),
                "t1": pass_rates_of(m, tok, eval_rows, T1_SAMPLES, 1.0, seed=seed),
                "train_t1": pass_rates_of(m, tok, train_rows, T1_SAMPLES, 1.0, seed=seed),
                "stop_reasons": stats["stop_reasons"],
                "dropped": stats["dropped"],
            }

        with trainer.client:
            # The start is at no cost: what the sampler generated meanwhile is the first
            # batch's, counted at the next checkpoint.
            nothing = {"samples": 0, "tokens": 0, "stop_reasons": {}, "dropped": {}}
            points = [point(trainer, nothing, 0.0)]
            wall = 0.0  # training time; evaluations are not counted
            answers, per_step = 0, 4.0 * config["batch_groups"]
            budget, k_max = config["budget"], config["checkpoints"]
            for k in range(1, k_max + 1):
                target = budget * k / k_max
                while answers < target:
                    # Steps to reach the next checkpoint at the answers/step seen so far;
                    # the first call is a single step, which measures answers/step.
                    cfg.steps = trainer.step + (
                        1 if trainer.step == 0 else max(1, math.ceil((target - answers) / per_step))
                    )
                    t0 = time.monotonic()
                    trainer.train()
                    wall += time.monotonic() - t0
                    stats = trainer.client.stats()
                    answers = _generated(stats)
                    per_step = answers / max(trainer.step, 1)
                points.append(point(trainer, stats, wall))
            final = trainer.client.stats()
    del trainer
    return {
        "config": config,
        "config_hash": config_hash(config),
        "seed": seed,
        "sizes": sizes,
        "points": points,
        "final_stats": {
            k: final[k]
            for k in ("samples", "tokens", "groups_emitted", "samples_per_group", "stop_reasons")
        }
        | {"dropped": final["dropped"], "skipped": final["skipped"]},
        "real_s": time.monotonic() - started,
    }


def _generated(stats: dict[str, Any]) -> int:
    """Answers the engine was asked for: those the rules counted, and those above where a
    prompt's rule held (surplus, under exact stopping)."""
    return int(stats["samples"]) + int(stats.get("waste", {}).get("surplus_answers", 0))


def starting_histogram(setting: str, seed: int = 0) -> dict[str, Any]:
    """Per-prompt T=1 pass rates of the warm-start model on the setting's training
    prompts (`HIST_SAMPLES` each), binned by `HIST_EDGES`, per domain."""
    import torch

    from trainer_client.evaluate import measure_pass_rates, read_rows
    from trainer_client.toy import build_toy

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-learning-hist-") as tmp:
        toy = build_toy(Path(tmp) / "toy", seed=seed, n_train=N_TRAIN, n_eval=1)
        rows = read_rows([f for f in toy.data_files if f.stem in SETTINGS[setting]])
        rates = measure_pass_rates(toy.model_dir, _by_prompt(rows), HIST_SAMPLES, 1.0, seed=seed)
    out: dict[str, Any] = {"samples_per_prompt": HIST_SAMPLES, "seed": seed, "domains": {}}
    for d in SETTINGS[setting]:
        p = np.array([rates[r["id"]] for r in rows if r["domain"] == d])
        counts = histogram_counts(p)
        out["domains"][d] = {
            "prompts": len(p),
            "mean": float(p.mean()),
            "counts": dict(zip(HIST_LABELS, counts, strict=True)),
            # The chance a GRPO n=4 group of such a prompt is informative, averaged.
            "grpo4_informative": float(np.mean(1 - p**4 - (1 - p) ** 4)),
        }
    return out


def histogram_counts(p: np.ndarray) -> list[int]:
    """Prompts per bin: exactly 0, the bins [a, b) between `HIST_EDGES`, exactly 1."""
    counts, _ = np.histogram(p, bins=np.array(HIST_EDGES))
    return [int(c) for c in counts]


# -- pure statistics -----------------------------------------------------------------------
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


def first_reach(xs: list[float], ys: list[float], target: float) -> tuple[float, bool]:
    """The cost at which the piecewise-linear curve (xs, ys) first reaches `target`, and
    whether it does; a curve that never reaches it gives its last cost (a lower bound)."""
    if ys[0] >= target:
        return float(xs[0]), True
    for i in range(1, len(xs)):
        if ys[i] >= target:
            frac = (target - ys[i - 1]) / (ys[i] - ys[i - 1])
            return float(xs[i - 1] + frac * (xs[i] - xs[i - 1])), True
    return float(xs[-1]), False


def ratio_stats(ratios: list[float], censored: list[bool]) -> dict[str, Any]:
    """Per-seed cost ratios summarized as a geometric mean with a paired 95% t interval
    of the mean log ratio. If any seed's ratio is a lower bound (its method never reached
    the target), the geometric mean is one too: it is reported as "> x", without an
    interval."""
    n = len(ratios)
    if n == 0:
        return {"n": 0, "ratios": [], "censored": [], "geomean": None, "ci95": None,
                "lower_bound": False, "text": "-"}  # fmt: skip
    logs = np.log(np.array(ratios, dtype=float))
    geo = float(np.exp(logs.mean()))
    bound = any(censored)
    ci = None
    if n > 1 and not bound:
        half = t95(n - 1) * float(logs.std(ddof=1)) / math.sqrt(n)
        ci = [float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))]
    if bound:
        text = f"> {geo:.2f}"
    elif ci is None:
        text = f"{geo:.2f}"
    else:
        text = f"{geo:.2f} ({ci[0]:.2f} .. {ci[1]:.2f})"
    return {
        "n": n,
        "ratios": [float(r) for r in ratios],
        "censored": list(censored),
        "geomean": geo,
        "ci95": ci,
        "lower_bound": bound,
        "text": text,
    }


def engine_costs() -> dict[str, float]:
    """The step-time engine's seconds per answer (prefill) and per generated token
    (decode at full occupancy), and GRPO n=4's seconds per median-length answer."""
    e = ENGINE
    prefill = e.prefill_per_token_s * PROMPT_TOKENS
    token = (e.step_base_s + e.max_num_seqs * e.step_per_seq_s) / e.max_num_seqs + e.kv_token_s * (
        PROMPT_TOKENS + e.length_median / 2
    )
    return {"prefill_s": prefill, "token_s": token, "answer4_s": prefill + e.length_median * token}


def modelled_s(
    answers: float,
    tokens: float,
    samples_trained: float,
    steps: float,
    tokens_per_answer4: float,
    costs: dict[str, float] | None = None,
) -> float:
    """Modelled seconds of a run (the formula of the module docstring):
    A x c_prefill + T x lam x c_tok + r x c4 x S + K x SYNC_S, lam = L / tokens_per_answer4."""
    c = costs or engine_costs()
    lam = ENGINE.length_median / tokens_per_answer4
    gen = answers * c["prefill_s"] + tokens * lam * c["token_s"]
    return gen + TRAIN_RATIO * c["answer4_s"] * samples_trained + steps * SYNC_S


# -- aggregation over cached runs ----------------------------------------------------------
_AXES = {
    "answers",
    "tokens",
    "trained_answers",
    "samples_trained",
    "groups_trained",
    "informative",
    "step",
    "wall_s",
    "model_s",
    "t1",
    "train_t1",
    "stop_reasons",
    "dropped",
}


def _domains(point: dict[str, Any]) -> list[str]:
    return [d for d in point if d not in _AXES]


def _metric(p: dict[str, Any], domains: list[str], metric: str) -> float:
    """A point's mean over `domains` of `metric` (greedy accuracy sits at the top level)."""
    return float(np.mean([(p if metric == "greedy" else p[metric])[d] for d in domains]))


def _value_at(
    r: dict[str, Any], domains: list[str], axis: str, at: float, metric: str = "greedy"
) -> float:
    """A run's `metric` (mean over `domains`), interpolated at `at` on `axis`."""
    xs = [p[axis] for p in r["points"]]
    ys = [_metric(p, domains, metric) for p in r["points"]]
    return float(np.interp(at, xs, ys))


def _paired(
    runs: list[dict[str, Any]], domains: list[str], axis: str, at: float, metric: str = "greedy"
) -> dict[str, Any]:
    """Per method, per seed: its metric minus GRPO n=4's at `at` on `axis`
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
    """Per method: each seed's metric at `at` on `axis` minus its own at 0 (did it
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


def to_target(runs: list[dict[str, Any]], domains: list[str], metric: str, axis: str) -> dict:
    """Per method: per seed, the cost on `axis` at which it first reaches GRPO n=4's final
    `metric` of that seed, over GRPO n=4's own, summarized by `ratio_stats`. A seed on
    which GRPO n=4 reaches its own final value at no cost (it never rose above its start)
    has no ratio and is listed under `undefined_seeds`."""
    base = {r["seed"]: r for r in runs if r["method"] == "grpo4"}
    out: dict[str, Any] = {}
    for method in METHODS:
        mine = sorted(
            (r for r in runs if r["method"] == method and r["seed"] in base),
            key=lambda r: r["seed"],
        )
        if not mine:
            continue
        ratios, censored, seeds, undefined, costs = [], [], [], [], []
        for r in mine:
            b = base[r["seed"]]
            target = _metric(b["points"][-1], domains, metric)
            bx, _ = first_reach(
                [p[axis] for p in b["points"]],
                [_metric(p, domains, metric) for p in b["points"]],
                target,
            )
            x, reached = first_reach(
                [p[axis] for p in r["points"]],
                [_metric(p, domains, metric) for p in r["points"]],
                target,
            )
            if bx <= 0:
                undefined.append(r["seed"])
                continue
            ratios.append(x / bx)
            censored.append(not reached)
            seeds.append(r["seed"])
            costs.append({"cost": x, "grpo4_cost": bx, "reached": reached, "target": target})
        out[method] = {
            **ratio_stats(ratios, censored),
            "seeds": seeds,
            "undefined_seeds": undefined,
            "per_seed": costs,
        }
    return out


def _with_model_time(runs: list[dict[str, Any]]) -> float | None:
    """Add `model_s` to every point of `runs` (one setting's); returns the lambda's
    denominator, GRPO n=4's mean toy tokens per answer, or None without GRPO n=4 runs
    (then no point gets a modelled time)."""
    base = [r for r in runs if r["method"] == "grpo4"]
    if not base:
        return None
    tpa = sum(r["points"][-1]["tokens"] for r in base) / sum(
        r["points"][-1]["answers"] for r in base
    )
    costs = engine_costs()
    for r in runs:
        for p in r["points"]:
            p["model_s"] = modelled_s(
                p["answers"], p["tokens"], p["samples_trained"], p["step"], tpa, costs
            )
    return tpa


def _curves(runs: list[dict[str, Any]], domains: list[str], metric: str, axis: str) -> dict:
    """Per method: mean, min and max over seeds of `metric` interpolated on a common grid
    along `axis`, up to the shortest run's end."""
    out: dict[str, Any] = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        grid = np.linspace(0, min(r["points"][-1][axis] for r in mine), 25)
        ys = np.array(
            [
                np.interp(
                    grid,
                    [p[axis] for p in r["points"]],
                    [_metric(p, domains, metric) for p in r["points"]],
                )
                for r in mine
            ]
        )
        out[method] = {
            "grid": grid.tolist(),
            "mean": ys.mean(0).tolist(),
            "min": ys.min(0).tolist(),
            "max": ys.max(0).tolist(),
        }
    return out


def _method_rows(runs: list[dict[str, Any]], domains: list[str]) -> dict[str, Any]:
    """Per method: final metrics, costs, informative groups per 1,000 answers and the
    share of each stop and drop reason, as mean (min..max) over seeds."""
    out: dict[str, Any] = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method]
        if not mine:
            continue
        lasts = [r["points"][-1] for r in mine]
        row: dict[str, Any] = {"seeds": sorted(r["seed"] for r in mine)}
        for key in ("answers", "tokens", "step", "samples_trained", "wall_s", "model_s"):
            row[key] = float(np.mean([p.get(key, float("nan")) for p in lasts]))
        for metric in METRICS:
            start = [_metric(r["points"][0], domains, metric) for r in mine]
            end = [_metric(p, domains, metric) for p in lasts]
            row[metric] = {
                "start": float(np.mean(start)),
                "end": float(np.mean(end)),
                "min": min(end),
                "max": max(end),
            }
        per_k = [1000 * p["informative"] / max(p["answers"], 1) for p in lasts]
        row["informative_per_1000"] = {
            "mean": float(np.mean(per_k)),
            "min": min(per_k),
            "max": max(per_k),
            "per_seed": per_k,
        }
        row["answers_per_step"] = row["answers"] / max(row["step"], 1)
        # informative per answer = (informative share of groups) / (answers per group)
        groups = [max(sum(p["stop_reasons"].values()), 1) for p in lasts]
        row["answers_per_group"] = float(np.mean([p["answers"] for p in lasts]) / np.mean(groups))
        row["informative_share"] = float(
            np.mean([p["informative"] for p in lasts]) / np.mean(groups)
        )
        for key in ("stop_reasons", "dropped"):
            total: Counter[str] = Counter()
            for p in lasts:
                total.update(p[key])
            groups = sum(sum(p["stop_reasons"].values()) for p in lasts)
            row[key] = {k: v / max(groups, 1) for k, v in sorted(total.items())}
        out[method] = row
    return out


def _informative_ratio(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: per seed, informative groups per 1,000 answers over GRPO n=4's."""

    def rate(r: dict[str, Any]) -> float:
        p = r["points"][-1]
        return p["informative"] / max(p["answers"], 1)

    base = {r["seed"]: rate(r) for r in runs if r["method"] == "grpo4"}
    out: dict[str, Any] = {}
    for method in METHODS:
        mine = sorted(
            (r for r in runs if r["method"] == method and base.get(r["seed"])),
            key=lambda r: r["seed"],
        )
        if mine:
            out[method] = ratio_stats(
                [rate(r) / base[r["seed"]] for r in mine], [False] * len(mine)
            )
    return out


def summarize_setting(runs: list[dict[str, Any]], domains: list[str]) -> dict[str, Any]:
    """Everything the summary reports for one setting's runs."""
    tpa = _with_model_time(runs)
    axes = ["answers", "tokens", *(["model_s"] if tpa else [])]
    out: dict[str, Any] = {
        "runs": sorted(f"{r['method']}/s{r['seed']}" for r in runs),
        "tokens_per_answer_grpo4": tpa,
        "methods": _method_rows(runs, domains),
        "to_target": {m: {a: to_target(runs, domains, m, a) for a in axes} for m in METRICS},
        "informative_ratio": _informative_ratio(runs),
    }
    equal = {"answers": min(r["points"][-1]["answers"] for r in runs)}
    equal["wall_s"] = min(r["points"][-1]["wall_s"] for r in runs)
    if tpa:
        equal["model_s"] = min(r["points"][-1]["model_s"] for r in runs)
    out["equal_at"] = equal
    out["paired"] = {
        m: {a: _paired(runs, domains, a, at, m) for a, at in equal.items()} for m in METRICS
    }
    out["gains"] = {m: _gains(runs, domains, "answers", equal["answers"], m) for m in METRICS}
    if len(domains) > 1:  # where a held-out difference comes from
        out["held_out_by_domain"] = {
            metric: {
                d: {
                    m: v["mean"]
                    for m, v in _paired(runs, [d], "answers", equal["answers"], metric).items()
                }
                for d in domains
            }
            for metric in ("greedy", "t1")
        }
    out["curves"] = {
        m: {a: _curves(runs, domains, m, a) for a in ("answers", *(["model_s"] if tpa else []))}
        for m in METRICS
    }
    return out


def _best_adaptive(block: dict[str, Any]) -> str | None:
    """The adaptive method with the smallest answers-to-target ratio on the training
    prompts' T=1 pass rate; a lower bound ranks behind every measured ratio."""
    cands = [
        (v["lower_bound"], v["geomean"], m)
        for m, v in block["to_target"]["train_t1"]["answers"].items()
        if METHODS[m]["kind"] == "adaptive" and v["geomean"] is not None
    ]
    return min(cands)[2] if cands else None


def _entry(target: str, setting: str | None, goal: str, **fields: Any) -> dict[str, Any]:
    return {"target": target, "setting": setting, "goal": goal, "method": None,
            "measured": None, "met": False, "reason": None, **fields}  # fmt: skip


def _explain_misses(entries: dict[str, dict[str, Any]]) -> None:
    """Why a cost target is missed, from the runs: cost to the target = 1 / (informative
    groups per answer x what one informative group teaches), both as ratios to GRPO n=4,
    so the second is 1 / (cost ratio x informative ratio)."""
    informative = entries["informative"]["measured"]
    for key, cap in (("answers", 0.5), ("model_s", 0.6)):
        e = entries[key]
        if e["met"] or e["reason"] is not None or not e["measured"] or not informative:
            continue
        inf = informative["ratio"]
        taught = 1.0 / (e["measured"]["ratio"] * inf)
        bound = " at most" if e["measured"]["text"].startswith(">") else ""
        e["reason"] = (
            f"{inf:.2f}x the informative groups per answer, but each taught{bound} "
            f"{taught:.2f}x what one of GRPO n=4's does (1 / (cost ratio x informative "
            f"ratio)); at that rate {cap}x needs {1 / (cap * taught):.2f}x the informative groups"
        )


def _informative_why(block: dict[str, Any], method: str, goal: float = 1.5) -> str:
    """Why the informative-groups ratio falls short: informative groups per answer =
    (informative share of the groups) / (answers per group), each against GRPO n=4's."""
    me, g = block["methods"][method], block["methods"]["grpo4"]
    share, size = me["informative_share"], me["answers_per_group"]
    stops = ", ".join(f"{k} {v:.0%}" for k, v in me["stop_reasons"].items())
    needed = goal * g["informative_share"] * size / g["answers_per_group"]
    return (
        f"{share:.0%} of its groups are informative (GRPO n=4 {g['informative_share']:.0%}) "
        f"at {size:.2f} answers per group (GRPO n=4 {g['answers_per_group']:.2f}); stops: "
        f"{stops}; {goal}x at this group size needs {needed:.0%} of its groups informative"
    )


def _held_out_why(block: dict[str, Any], method: str) -> str | None:
    """Where a held-out loss comes from: the paired difference per domain."""
    by_domain = block.get("held_out_by_domain")
    paired = {m: block["paired"][m]["answers"].get(method) or {} for m in ("greedy", "t1")}
    losing = [m for m, v in paired.items() if v.get("ci95") and v["ci95"][1] < 0]
    if not by_domain or not losing:
        return None
    parts = []
    for metric in losing:
        diffs = {d: v[method] for d, v in by_domain[metric].items() if method in v}
        each = ", ".join(f"{d} {v:+.3f}" for d, v in diffs.items())
        parts.append(
            f"{METRICS[metric]} {paired[metric]['mean']:+.3f} at equal answers, by domain "
            f"{each}: the loss is on {min(diffs, key=lambda d: diffs[d])}"
        )
    return "; ".join(parts)


def _step_time_why(st: dict[str, Any]) -> str:
    """Why the step-time target is missed, from `bench/step_time.py`'s figures: GRPO n=4's
    uninformative groups cost 4 answers each, so its engine-seconds per informative group
    scale as 1 / (its informative fraction); the fraction at which the adaptive row's cost
    (held fixed, an approximation) would be 0.6x of GRPO n=4's says what prompt mix would
    show the target."""
    g = st["grpo4"]
    needed = 0.6 * g["informative"] / st["engine_ratio"]
    return (
        f"to keep >= 90% of its groups informative {st['best']} spends "
        f"{st['answers_per_informative']:.2f} answers per informative group against GRPO "
        f"n=4's {g['answers_per_informative']:.2f} (whose {1 - g['informative']:.0%} "
        f"uninformative groups cost 4 answers each); the cheapest such row "
        f"({st['engine_best']}) pays {st['engine_ratio']:.2f}x GRPO n=4's engine-seconds "
        f"per informative group, and {st['best']}'s step is {st['ratio_r07']:.2f}x; 0.6x "
        f"would need a prompt mix on which GRPO n=4's groups are informative "
        f"about {needed:.0%} of the time or less (here {g['informative']:.0%})"
    )


def targets(by_setting: dict[str, Any], step_time: dict[str, Any] | None) -> dict[str, Any]:
    """One entry per target, computed from the runs (measured None, met False and a
    reason where the runs needed are missing)."""
    out: dict[str, Any] = {}
    five = "needs 5 seeds of GRPO n=4 and the method"
    for setting in HARD_SETTINGS:
        block = by_setting.get(setting)
        best = _best_adaptive(block) if block else None
        keys = {
            "answers": ("answers to GRPO n=4's final training-prompt T=1", "<= 0.5x, CI below 1"),
            "model_s": ("modelled time to the same", "<= 0.6x, CI below 1"),
            "vs_baseline": ("answers to the same vs the strongest baseline", "<= 0.75x"),
            "held_out": (
                "held-out greedy and T=1 at equal answers, minus GRPO n=4",
                "CI high >= 0 (not worse)",
            ),
            "informative": ("informative groups per 1,000 answers vs GRPO n=4", ">= 1.5x"),
        }
        entries = {k: _entry(t, setting, g) for k, (t, g) in keys.items()}
        if best is None:
            for e in entries.values():
                e["reason"] = "no cached runs of GRPO n=4 and an adaptive method"
        else:
            assert block is not None
            tt = block["to_target"]["train_t1"]
            for key, axis, cap in (("answers", "answers", 0.5), ("model_s", "model_s", 0.6)):
                s = tt.get(axis, {}).get(best)
                e = entries[key]
                e["method"] = best
                if s is None:
                    e["reason"] = "no modelled time (no GRPO n=4 runs)"
                    continue
                e["measured"] = {"ratio": s["geomean"], "ci95": s["ci95"], "text": s["text"],
                                 "seeds": s["n"]}  # fmt: skip
                e["met"] = bool(
                    s["n"] >= 5
                    and not s["lower_bound"]
                    and s["ci95"] is not None
                    and s["geomean"] <= cap
                    and s["ci95"][1] < 1
                )
                e["reason"] = None if s["n"] >= 5 else five
            bases = {
                m: v
                for m, v in tt["answers"].items()
                if m in ("grpo4_skip", "dapo4") and v["geomean"] is not None
            }
            e = entries["vs_baseline"]
            e["method"] = best
            if not bases:
                e["reason"] = "no cached runs of GRPO n=4 + history skip or DAPO refill"
            else:
                strongest = min(bases, key=lambda m: bases[m]["geomean"])
                ratio = tt["answers"][best]["geomean"] / bases[strongest]["geomean"]
                e["measured"] = {"ratio": ratio, "baseline": strongest,
                                 "lower_bound": tt["answers"][best]["lower_bound"]}  # fmt: skip
                e["met"] = bool(ratio <= 0.75 and not tt["answers"][best]["lower_bound"])
                if not e["met"]:
                    e["reason"] = (
                        f"{strongest} alone needs {bases[strongest]['text']} of GRPO n=4's "
                        f"answers; {best} {tt['answers'][best]['text']}"
                    )
                    if bases[strongest]["lower_bound"]:
                        e["reason"] += (
                            " (some seeds of both never reach it: the ratio is not determined)"
                            if tt["answers"][best]["lower_bound"]
                            else f" (some {strongest} seeds never reach it: the ratio is at "
                            f"most {ratio:.2f})"
                        )
            e = entries["held_out"]
            e["method"] = best
            his = {m: block["paired"][m]["answers"].get(best) for m in ("greedy", "t1")}
            e["measured"] = {m: (v["mean"], v["ci95"]) if v else None for m, v in his.items()}
            e["met"] = all(v is not None and v["ci95"] is not None and v["ci95"][1] >= 0
                           for v in his.values())  # fmt: skip
            ir = block["informative_ratio"].get(best)
            e = entries["informative"]
            e["method"] = best
            if ir:
                e["measured"] = {"ratio": ir["geomean"], "ci95": ir["ci95"], "text": ir["text"]}
                e["met"] = bool(ir["geomean"] >= 1.5)
                e["reason"] = None if e["met"] else _informative_why(block, best)
            if not entries["held_out"]["met"]:
                entries["held_out"]["reason"] = _held_out_why(block, best)
            _explain_misses(entries)
        for k, e in entries.items():
            out[f"{setting}/{k}"] = e
    # add2: not worse than GRPO n=4 (training-prompt T=1 at equal answers, paired).
    e = _entry("add2: training-prompt T=1 at equal answers minus GRPO n=4", "add2", "CI high >= 0")
    block = by_setting.get("add2")
    best = _best_adaptive(by_setting[HARD_SETTINGS[0]]) if HARD_SETTINGS[0] in by_setting else None
    if block is None or best is None or best not in block["paired"]["train_t1"]["answers"]:
        e["reason"] = "no cached add2 runs of GRPO n=4 and the best adaptive method on mul"
    else:
        pr = block["paired"]["train_t1"]["answers"][best]
        e |= {"method": best, "measured": {"mean": pr["mean"], "ci95": pr["ci95"]}}
        e["met"] = bool(pr["ci95"] is not None and pr["ci95"][1] >= 0)
    out["add2/not_worse"] = e
    e = _entry(
        "step time: best adaptive row >= 90% informative within 1.5x GRPO n=4's step, "
        "or within 0.6x its engine-seconds per informative group",
        None,
        ">= 0.9 informative and (<= 1.5x step (r 0.7) or <= 0.6x engine-s / informative)",
    )
    st = (step_time or {}).get("targets", {}).get("difficulty/adaptive")
    if st is None or "engine_ratio" not in st:
        e["reason"] = "no bench/results/step_time.json with the engine-seconds ratio"
    else:
        e |= {"method": st["best"], "measured": {"step_ratio": st["ratio_r07"],
              "informative": st["informative"], "engine_ratio": st["engine_ratio"],
              "engine_method": st["engine_best"]}}  # fmt: skip
        e["met"] = bool(st["step_target_met"] or st["engine_target_met"])
        e["reason"] = None if e["met"] else _step_time_why(st)
    out["step_time"] = e
    out.update(_exact_targets(by_setting.get(HARD_SETTINGS[0])))
    return out


#: The method exact stopping is judged on, and its twin counting whole waves.
EXACT_PAIR = ("seqpos1_posterior_replay_exact", "seqpos1_posterior_replay")


def _exact_targets(block: dict[str, Any] | None) -> dict[str, Any]:
    """`exact/learning_mul_<axis>`: answers and decoded tokens to GRPO n=4's final
    training-prompt T=1 on mul, exact stopping over the same method counting whole waves,
    per seed, as a geometric mean with a paired 95% interval; met when exact stopping is
    no costlier on average."""
    exact, wave = EXACT_PAIR
    out = {}
    for axis in ("answers", "tokens"):
        e = _entry(
            f"{axis} to GRPO n=4's final training-prompt T=1: {exact} over {wave}",
            HARD_SETTINGS[0],
            "<= 1x (not worse than whole waves)",
        )
        by_method = (block or {}).get("to_target", {}).get("train_t1", {}).get(axis, {})
        mine, theirs = by_method.get(exact), by_method.get(wave)
        if not mine or not theirs:
            e["reason"] = f"needs cached runs of {exact} and {wave} on {HARD_SETTINGS[0]}"
        else:
            seeds = sorted(set(mine["seeds"]) & set(theirs["seeds"]))
            pair = [
                (mine["ratios"][mine["seeds"].index(s)], theirs["ratios"][theirs["seeds"].index(s)])
                for s in seeds
            ]
            censored = [
                mine["censored"][mine["seeds"].index(s)]
                or theirs["censored"][theirs["seeds"].index(s)]
                for s in seeds
            ]
            paired = ratio_stats([a / b for a, b in pair], censored)
            e |= {
                "method": exact,
                "measured": {
                    "ratio": paired["geomean"],
                    "ci95": paired["ci95"],
                    "text": paired["text"],
                    "seeds": paired["n"],
                    "vs_grpo4": {exact: mine["text"], wave: theirs["text"]},
                },
                "met": bool(paired["geomean"] is not None and paired["geomean"] <= 1.0),
            }
        out[f"exact/learning_mul_{axis}"] = e
    return out


# -- printing, plotting, the command line ----------------------------------------------------
def headline_rows(block: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: its cost to each of GRPO n=4's final values, as ratios."""
    rows = []
    for method, m in block["methods"].items():
        row: dict[str, Any] = {"method": METHODS[method]["label"], "seeds": len(m["seeds"])}
        for metric in METRICS:
            for axis in COST_AXES:
                v = block["to_target"][metric].get(axis, {}).get(method)
                row[f"{metric}/{axis}"] = v["text"] if v else "-"
        inf = m["informative_per_1000"]
        row["inf"] = f"{inf['mean']:.0f} ({inf['min']:.0f}..{inf['max']:.0f})"
        row["stops"] = ", ".join(f"{k} {v:.2f}" for k, v in m["stop_reasons"].items())
        row["drops"] = ", ".join(f"{k} {v:.2f}" for k, v in m["dropped"].items()) or "-"
        rows.append(row)
    return rows


def final_rows(block: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: its costs at the end and each metric from start to end."""
    rows = []
    for method, m in block["methods"].items():
        row: dict[str, Any] = {
            "method": METHODS[method]["label"],
            **{k: m[k] for k in ("answers", "step", "answers_per_step", "model_s", "wall_s")},
        }
        for k in METRICS:
            row[k] = (
                f"{m[k]['start']:.3f} -> {m[k]['end']:.3f} ({m[k]['min']:.3f}..{m[k]['max']:.3f})"
            )
        rows.append(row)
    return rows


def equal_rows(block: dict[str, Any]) -> list[dict[str, Any]]:
    """Each method minus GRPO n=4 at equal answers, modelled time and wall-clock."""
    rows = []
    for metric, by_axis in block["paired"].items():
        for axis, by_method in by_axis.items():
            for method, pr in by_method.items():
                ci = pr["ci95"]
                rows.append(
                    {
                        "metric": METRICS[metric],
                        "at": f"{axis} {block['equal_at'][axis]:,.0f}",
                        "method": METHODS[method]["label"],
                        "mean": f"{pr['mean']:+.3f}",
                        "ci": "-" if ci is None else f"{ci[0]:+.3f} .. {ci[1]:+.3f}",
                        "wins": f"{pr['wins']} of {pr['n']}",
                    }
                )
    return rows


#: Columns of a table: (row key, header).
Columns = list[tuple[str, str]]

#: The tables of one setting's summary, by name: how to read their rows from the setting's
#: block, and their columns. `main` prints them; bench/render.py puts them in BENCHMARKS.md
#: and bench/notes/learning.md.
TABLES: dict[str, tuple[Callable[[dict[str, Any]], list[dict[str, Any]]], Columns]] = {
    "headline": (
        headline_rows,
        [
            ("method", "method"),
            ("seeds", "seeds"),
            ("train_t1/answers", "train T=1: answers"),
            ("train_t1/tokens", "train T=1: tokens"),
            ("train_t1/model_s", "train T=1: modelled time"),
            ("greedy/answers", "held-out greedy: answers"),
            ("greedy/model_s", "held-out greedy: modelled time"),
            ("t1/answers", "held-out T=1: answers"),
            ("t1/model_s", "held-out T=1: modelled time"),
            ("inf", "informative / 1,000 answers"),
            ("stops", "stop reasons (share of groups)"),
            ("drops", "dropped"),
        ],
    ),
    "finals": (
        final_rows,
        [
            ("method", "method"),
            ("answers", "answers generated"),
            ("step", "optimizer steps"),
            ("answers_per_step", "answers/step"),
            ("model_s", "modelled s"),
            ("wall_s", "toy training wall s"),
            *METRICS.items(),
        ],
    ),
    "equal": (
        equal_rows,
        [
            ("metric", "metric"),
            ("at", "equal"),
            ("method", "method minus GRPO n=4"),
            ("mean", "mean"),
            ("ci", "95% CI (t)"),
            ("wins", "seeds > 0"),
        ],
    ),
}


def _setting_table(name: str, block: dict[str, Any]) -> str:
    """The table `name` of TABLES for one setting's block."""
    rows_of, columns = TABLES[name]
    return table(rows_of(block), columns)


def _print_setting(setting: str, block: dict[str, Any], sizes: dict[str, Any]) -> None:
    print(f"\n== {setting}: cost to reach GRPO n=4's final value, ratio to GRPO n=4 ==")
    print(f"held-out prompts: {sizes.get('eval')}, training prompts: {sizes.get('train')}")
    print(_setting_table("headline", block))
    print("\nfinal values, mean over seeds (start -> end, min..max at the end):")
    print(_setting_table("finals", block))
    print("\npaired by seed, minus GRPO n=4 at equal cost:")
    print(_setting_table("equal", block))


def _plot(setting: str, block: dict[str, Any], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = list(block["curves"]["train_t1"])
    fig, axes = plt.subplots(
        len(METRICS), len(axes_names), figsize=(5 * len(axes_names), 3.2 * len(METRICS)),
        squeeze=False,
    )  # fmt: skip
    for i, metric in enumerate(METRICS):
        for j, axis in enumerate(axes_names):
            ax = axes[i][j]
            for method, c in block["curves"][metric][axis].items():
                (line,) = ax.plot(c["grid"], c["mean"], "-", label=METHODS[method]["label"])
                ax.fill_between(c["grid"], c["min"], c["max"], color=line.get_color(), alpha=0.2)
            ax.set_title(f"{setting}: {METRICS[metric]}", fontsize=9)
            ax.set_xlabel("answers generated" if axis == "answers" else "modelled seconds")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("toy task, reference GRPO trainer: mean over seeds, band = min..max", fontsize=10)
    fig.tight_layout()
    save_figure(fig, png, dpi=100)
    plt.close(fig)
    return png


def _load_runs(runs_dir: Path, configs: dict[tuple[str, str], dict[str, Any]]) -> list[dict]:
    """Cached runs whose configuration is one of `configs` (by setting and method)."""
    out = []
    for path in sorted(runs_dir.glob("*__s*__*.json")):
        r = json.loads(path.read_text())
        c = r.get("config", {})
        want = configs.get((c.get("setting"), c.get("method")))
        if want is not None and config_hash(want) == r["config_hash"]:
            out.append({**r, "method": c["method"], "setting": c["setting"]})
    return out


def _histogram(runs_dir: Path, setting: str, measure: bool) -> dict[str, Any] | None:
    """The setting's starting histogram, measured once (if `measure`) and cached."""
    key = {"setting": setting, "n_train": N_TRAIN, "samples": HIST_SAMPLES, "seed": 0}
    path = runs_dir / f"hist__{setting}__{config_hash(key)}.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    if not measure:
        return None
    hist = starting_histogram(setting)
    _write_atomic(path, hist)
    return hist


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", action="append", choices=list(SETTINGS),
                   help="settings to run (default: none with --summary-only, else mul)")  # fmt: skip
    p.add_argument("--method", action="append", choices=list(METHODS),
                   help="methods to run [all]")  # fmt: skip
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"mul, GRPO n=4 and Seq-Balance, 2 seeds of {QUICK_BUDGET:,} answers, "
        "summary in learning_quick.json",
    )
    p.add_argument("--seeds", type=int, help="seeds per method, from --first-seed [3; quick 2]")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--budget", type=int, help=f"answers generated per run [{BUDGET:,}]")
    p.add_argument(
        "--checkpoints",
        type=int,
        help=f"evaluations along the way, plus one at 0 [{CHECKPOINTS}; quick 4]",
    )
    p.add_argument("--batch-groups", type=int, default=BATCH_GROUPS)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument(
        "--eval-n",
        type=int,
        default=EVAL_N,
        help="held-out prompts per domain, capped by the domain's held-out split",
    )
    p.add_argument("--jobs", type=int, default=1, help="runs side by side")
    p.add_argument("--summary-only", action="store_true", help="run nothing, summarize the cache")
    p.add_argument("--runs-dir", type=Path, default=RUNS_DIR, help="the run cache")
    p.add_argument("--out", type=Path, help="the summary [bench/results/learning.json]")
    p.add_argument(
        "--no-histograms",
        action="store_true",
        help="do not measure the starting histograms (cached ones are still reported)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.method = args.method or list(QUICK_METHODS)
    args.seeds = args.seeds or (2 if args.quick else 3)
    args.budget = args.budget or (QUICK_BUDGET if args.quick else BUDGET)
    args.checkpoints = args.checkpoints or (4 if args.quick else CHECKPOINTS)
    args.out = args.out or RESULTS / ("learning_quick.json" if args.quick else "learning.json")
    if args.budget < 1 or args.checkpoints < 1 or args.seeds < 1:
        p.error("--budget, --checkpoints and --seeds must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    shape = flags(args, "budget", "checkpoints", "batch_groups", "lr", "eval_n")
    configs = {(s, m): run_config(s, m, **shape) for s in SETTINGS for m in METHODS}
    started = time.monotonic()
    if not args.summary_only:
        settings = args.setting or ["mul"]
        methods = args.method or list(METHODS)
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        tasks = [
            (configs[(s, m)], seed)
            for s in settings
            for seed in seeds
            for m in methods
            if not run_path(args.runs_dir, configs[(s, m)], seed).is_file()
        ]
        print(f"{len(tasks)} runs to do (cached runs are not repeated)")

        def done(r: dict[str, Any]) -> None:
            path = run_path(args.runs_dir, r["config"], r["seed"])
            _write_atomic(path, r)
            last = r["points"][-1]
            print(
                f"  {path.name}: {last['step']} steps, {last['answers']} answers, train T=1 "
                f"{last['train_t1']}, greedy {[last[d] for d in _domains(last)]}, "
                f"{r['real_s']:.0f} s",
                flush=True,
            )

        with tempfile.TemporaryDirectory(prefix="bench-learning-") as tmp:
            if args.jobs <= 1:
                for config, seed in tasks:
                    done(run_one(config, seed, Path(tmp)))
            else:
                ctx = multiprocessing.get_context("spawn")
                with ProcessPoolExecutor(args.jobs, mp_context=ctx) as ex:
                    futures = [ex.submit(run_one, c, sd, Path(tmp)) for c, sd in tasks]
                    for f in as_completed(futures):
                        done(f.result())
    runs = _load_runs(args.runs_dir, configs)
    by_setting: dict[str, Any] = {}
    sizes: dict[str, Any] = {}
    for setting, domains in SETTINGS.items():
        mine = [r for r in runs if r["setting"] == setting]
        if not mine:
            continue
        sizes[setting] = mine[0]["sizes"]
        by_setting[setting] = summarize_setting(mine, list(domains))
        _print_setting(setting, by_setting[setting], sizes[setting])
    hists = {}
    for setting in HARD_SETTINGS:
        hist = _histogram(args.runs_dir, setting, measure=not args.no_histograms)
        if hist is None:
            continue
        hists[setting] = hist
        for d, h in hist["domains"].items():
            print(f"{setting} start, {d}: {h['prompts']} prompts, mean {h['mean']:.3f}, "
                  f"per-prompt pass rate counts {h['counts']}")  # fmt: skip
    step_path = RESULTS / "step_time.json"
    step = json.loads(step_path.read_text()) if step_path.is_file() else None
    tg = targets(by_setting, step)
    print("\ntargets:")
    for k, e in tg.items():
        print(f"  {k}: met {e['met']} ({e['method']}: {e['measured']}; goal {e['goal']}"
              + (f"; {e['reason']}" if e["reason"] else "") + ")")  # fmt: skip
    out = {
        "targets": tg,
        "settings": {
            **shape,
            "settings": {k: list(v) for k, v in SETTINGS.items()},
            "n_train": N_TRAIN,
            "t1_samples": T1_SAMPLES,
            "methods": METHODS,
            "common": COMMON,
            "engine_costs": engine_costs(),
            "train_ratio": TRAIN_RATIO,
            "prompt_tokens": PROMPT_TOKENS,
        },
        "sizes": sizes,
        "histograms": hists,
        "by_setting": by_setting,
        "real_s": time.monotonic() - started,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.parent == RESULTS:
        path = write_json(args.out.stem, out)
    else:
        _write_atomic(args.out, out)
        path = args.out
    for setting, block in by_setting.items():
        _plot(setting, block, path.with_name(f"{path.stem}_{setting}.png"))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
