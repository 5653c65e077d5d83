"""`adaptive-rollout demo`: the whole loop on one CPU machine, in a few minutes.

1. writes the toy model and arithmetic data (`trainer_client.toy`);
2. starts the sampler service as its own process on a free loopback port, with balanced
   adaptive sampling (Reinforce-Ada: sample each prompt until it has 2 right and 2 wrong
   answers, at most 16, keep 2 + 2, advantages against the mean of all its answers);
3. runs the reference GRPO trainer in this process against it over HTTP: groups stream
   in, the trainer acks them and pushes its weights back after every step;
4. prints greedy accuracy per domain on the held-out split before and after, the sampling
   figures from the service (answers per group, stop reasons, mixing shares), and writes
   `demo_out/report.png`.

`--task calculator` runs the same loop on multi-turn episodes: the toy model, warm-started
to call a calculator tool (`[37*4]`, answered `148;`) on some answers, is trained on
episodes (the loss over its own tokens only) and scored by greedy episode success.

The sampler is started through the console script, not imported: the trainer side of the
project never imports the server (only processes talk to each other, over HTTP).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trainer_client.launch import SamplerProcess
from trainer_client.toy.build import ToyTask
from trainer_client.train_config import BatchGroups, LearningRate, Steps, SyncEvery, TimeLimit

#: Reinforce-Ada's Seq-Balance: K_pos = K_neg = 2, n_max 16, adaptive waves of up to 8,
#: balanced down-sampling to n = 4 (the demo's rule, and the learning benchmark's).
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


class DemoSettings(BaseModel):
    """Settings of `adaptive-rollout demo` (its flags are generated from these fields)."""

    model_config = ConfigDict(extra="forbid")

    task: ToyTask = Field(
        "arithmetic",
        description="arithmetic: single answers, scored by greedy accuracy; calculator: "
        "episodes with the toy's calculator tool (call, read the result, answer), scored by "
        "greedy episode success",
    )
    out_dir: Path = Field(
        Path("demo_out"), description="output directory", json_schema_extra={"cli_flag": "out"}
    )
    seed: int = Field(0, description="seed for the toy data and the run")
    progress: bool = Field(True, description="show progress bars")
    time_limit_s: TimeLimit = Field(
        None,
        description="training time budget in seconds (unset: what is left of 3.5 minutes "
        "after start-up)",
    )
    # Trainer. Tuned on 2 CPU cores, where 200 steps take 1-3 minutes: with lr 5e-5 the
    # mean held-out accuracy rose in all 6 runs tried (+0.045..+0.087), with 1e-4 in all 6
    # (+0.037..+0.084); 2e-4 and up destabilize this tiny model (it collapses in ~30 steps).
    steps: Steps = Field(200, description="training steps")
    batch_groups: BatchGroups = Field(16, description="groups per training batch")
    lr: LearningRate = Field(5e-5, description="learning rate")
    sync_every: SyncEvery = Field(1, description="push weights every N steps")
    sampler: dict[str, Any] | None = Field(
        None, description="the sampler's initial config (unset: the task's default_sampler)"
    )

    def sampler_config(self) -> dict[str, Any]:
        """The sampler's initial config: `sampler` as given, else the task's default."""
        return dict(self.sampler) if self.sampler is not None else default_sampler(self.task)


#: The demo's sampler: balanced adaptive sampling (Reinforce-Ada) with the global
#: baseline, uniform domain mixing, and at most two policy versions of lag. A prompt
#: here often samples for longer than one trainer step (~0.23 s): Seq-Balance runs many
#: to 16 answers. With a bound of 1 those groups were dropped, 4.7-6.5% of the groups
#: emitted; with 2, 1.2-1.8%, and held-out greedy accuracy rose as much (3 seeds each:
#: +0.061/+0.071/+0.071 against +0.087/+0.053/+0.066).
ARITHMETIC_SAMPLER: dict[str, Any] = {
    **SEQ_BALANCE,
    "advantage": "global",
    "temperature": 1.0,
    "max_tokens": 6,
    "max_active_prompts": 24,
    "max_buffered_groups": 32,
    "max_staleness": 2,
    "mixing": {"name": "static"},
}
#: What the calculator task changes: a turn stops at the call's `]` (the environment's
#: stop string) or eos, so a turn is a call (`[37*4]`) or an answer; three turns leave
#: one spare after a call and its answer. An episode's prompt samples longer than a
#: single answer's, so fewer prompts are in flight: with 24, 6.8% of the emitted groups
#: were dropped as stale (held-out episode success 0.227 -> 0.645); with 16, 0.3% and
#: 0.6% in two runs (-> 0.659, 0.672); with 12, 0.0% in two (-> 0.633, 0.630), the
#: trainer waiting longer for groups.
CALCULATOR_SAMPLER: dict[str, Any] = {
    "max_tokens": 12,
    "max_active_prompts": 16,
    "episode": {"max_turns": 3, "max_tokens_per_turn": 12},
}


def default_sampler(task: ToyTask) -> dict[str, Any]:
    """The demo's sampler config for `task`."""
    extra = CALCULATOR_SAMPLER if task == "calculator" else {}
    return {**ARITHMETIC_SAMPLER, **extra}


def run_demo(settings: DemoSettings) -> int:
    """Run the demo; returns 0 when the held-out score improved on average, else 1."""
    import torch
    from transformers.utils import logging as hf_logging

    from trainer_client.client import SamplerClient
    from trainer_client.evaluate import greedy_accuracy_of
    from trainer_client.grpo import Evaluator, GRPOTrainer, TrainConfig
    from trainer_client.report import accuracy_table, plot_report, sampling_tables
    from trainer_client.toy import build_toy

    started = time.monotonic()
    out = settings.out_dir
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("sampler_state", "train"):  # a fresh run every time
        shutil.rmtree(out / stale, ignore_errors=True)
    # Two processes share the machine's cores: the sampler generates while we train.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    hf_logging.disable_progress_bar()  # no "Loading weights" bars between ours

    episodes = settings.task == "calculator"
    evaluate_rows: Evaluator = greedy_accuracy_of
    score_name = "greedy accuracy"
    if episodes:
        from trainer_client.toy.calculator import greedy_episode_success_of

        evaluate_rows, score_name = greedy_episode_success_of, "greedy episode success"
    what = "calculator tool episodes" if episodes else "arithmetic"
    print(f"== adaptive-rollout demo: toy {what}, sampler + GRPO trainer over loopback HTTP ==")
    toy = build_toy(out / "toy", seed=settings.seed, toy_task=settings.task)
    model_dir, data, evals = toy.model_dir, toy.data_files, toy.eval_files
    print(
        f"toy model {model_dir}; domains: {', '.join(f.stem for f in data)} "
        f"(held-out: {sum(len(f.read_text().splitlines()) for f in evals)} prompts)"
    )

    config = {**settings.sampler_config(), "batch_groups": settings.batch_groups}
    sampler = SamplerProcess(
        model_dir, data, out / "sampler_state", config, out / "sampler.log", seed=settings.seed
    )
    with sampler:
        print(
            f"sampler listening on {sampler.url} (log {out / 'sampler.log'}); config: "
            + ", ".join(
                f"{k}={v}"
                for k, v in config.items()
                if k in ("rule", "k_pos", "k_neg", "n_max", "wave", "group_size")
            )
        )
        # Training gets what remains of 3.5 minutes after start-up, so the whole run (with
        # the final evaluation, report and shutdown) ends well inside 5 minutes even on a
        # slow or busy machine; on an idle 2-core machine the 200 steps need less.
        budget = (
            settings.time_limit_s
            if settings.time_limit_s is not None
            else max(30.0, 210.0 - (time.monotonic() - started))
        )
        cfg = TrainConfig(
            url=sampler.url,
            model=model_dir,
            out_dir=out / "train",
            steps=settings.steps,
            batch_groups=settings.batch_groups,
            lr=settings.lr,
            advantage="server",
            sync_every=settings.sync_every,
            watchdog_s=60.0,
            consumer="demo-trainer",
            seed=settings.seed,
            progress=settings.progress,
            eval_files=evals,
            time_limit_s=budget,
        )
        trainer = GRPOTrainer(cfg, evaluate_rows=evaluate_rows)
        with trainer.client:
            trainer.train()
            with SamplerClient(sampler.url) as client:
                stats = client.stats()
                health = client.health()
    history = trainer.history
    before, after = trainer.evals[0]["greedy_accuracy"], trainer.evals[-1]["greedy_accuracy"]
    (out / "sampler_stats.json").write_text(json.dumps(stats, indent=1))
    report = plot_report(
        out / "report.png",
        history,
        stats,
        before,
        after,
        title=f"adaptive-rollout demo ({what}): {len(history)} GRPO steps, balanced "
        "adaptive sampling",
        score_name=score_name,
    )

    mean_before = sum(before.values()) / len(before)
    mean_after = sum(after.values()) / len(after)
    improved = mean_after > mean_before
    wall = time.monotonic() - started
    print()
    print(f"{score_name} on the held-out split (exact match):")
    print(accuracy_table(before, after))
    print()
    print(sampling_tables(history, stats))
    episode_stats = stats.get("episodes") or {}
    if episode_stats.get("episodes"):
        turns = ", ".join(f"{k}: {v}" for k, v in episode_stats["turns"].items())
        print(
            f"episodes finished (sampler): {episode_stats['episodes']}, turns per episode "
            f"{episode_stats['turns_per_episode']:.2f} ({turns}); environment errors "
            f"{episode_stats['env_errors']}; their tokens: sampled "
            f"{episode_stats['model_tokens']} (decoded also counts cancelled episodes'), "
            f"from observations {episode_stats['observation_tokens']} (never trained on)"
        )
    print()
    groups = sum(r["groups"] for r in history)
    acked = sum(r["acked"] for r in history)
    print(
        f"{len(history)} steps, {groups} groups trained on and acked ({acked}); sampler serves policy "
        f"v{health.policy_version}; {stats.get('samples', 0)} answers generated"
    )
    print(f"report: {report}; train log: {out / 'train' / 'train_log.jsonl'}")
    print(
        f"wall time {wall:.0f}s; held-out {score_name} {mean_before:.3f} -> {mean_after:.3f}: "
        + ("improved" if improved else "NOT improved")
    )
    summary = {
        "task": settings.task,
        "score": score_name,
        "before": before,
        "after": after,
        "mean_before": mean_before,
        "mean_after": mean_after,
        "improved": improved,
        "steps": len(history),
        "wall_s": wall,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if improved else 1
