"""Step time of a training step (generation + trainer phase + weight sync) per sampling
rule and pipeline, on a simulated engine in simulated time, checked against closed forms.

What a user comparing against GRPO pays per step is generation *and* training: a rule
that generates 3x the answers of GRPO n=4 does not take 3x the step time if the trainer
phase is a large part of the step. The project's real `Scheduler` (real rules,
down-sampling, advantages, group and admission policies) drives
`bench.sim_backend.SimBackend` on `bench.virtual_clock`'s simulated-time event loop, and
a simulated trainer consumes each batch frame: it trains for

    r x T4 x (samples trained / 4B)

simulated seconds (T4 = GRPO n=4's synchronous generation time per batch of B groups;
Est trains on all of its samples), then pushes new weights through the scheduler's own
weight-update path (weight sync itself costs `SYNC_S`, 0), then acks the frame.

Pipelines:
- sync: `mode: rounds`, one cohort of B prompts per step, no generation while training
  (the paper's setting; adaptive waves do not apply in rounds);
- on-policy continuous: `mode: continuous`, `max_staleness` 0: prompts advance on their
  own, but nothing is admitted for step k+1 before step k's weights are pushed;
- one-step-off-policy: `max_staleness` 1: generation of step k+1 overlaps training of
  step k; answers may come from weights one step old (stale share reported). The
  trainer applies the service's drop rule before each frame it takes (groups past the
  bound dropped, their prompts served again), so what the bound costs is counted, by
  pass-rate quartile (`staleness/*` targets, `--staleness-only` to run just those).

Figures per row: step time relative to GRPO n=4 synchronous (same r), the informative
fraction of the trained groups (kept rewards not all equal), answers generated per
informative group (every answer, dropped groups too), engine-seconds per informative
group (time the engine was decoding or prefilling), and the policy-lag distribution of
the trained samples.

Exact stopping (the `exact/*` targets): the best exact twin against GRPO n=4 on-policy,
beside its whole-wave twin and its engine in arrival order, and run again at each
speculative width of `WIDTHS` (its `wave_size`; `bench/results/step_time_widths.png`):
exactness holds at every width, so the sweep shows what the one free mechanism can buy.

Self-checks that can fail: for the round-based rules (GRPO n=4, Seq-Pos K_pos 1,
Seq-Balance 2/2) expected answers per prompt and the chance a group is informative have
closed forms given a prompt's pass rate; over >= 5 independent prompt draws the
per-prompt residuals must average to 0 within 4 standard errors.

The engine model (`ENGINE`; fixed before any target was measured):
- decode step 12 ms + 0.05 ms per running sequence (assumed; the order of vLLM's time
  per output token for a ~1.5B model on one GPU), prefill 0.02 ms per prompt token,
  256 sequences at most;
- context term 8.5 ns per cached token per decode step: a Qwen2.5-1.5B KV cache holds
  28 layers x 2 (K, V) x 2 KV heads x 128 dims x 2 bytes = 28.7 kB per token (the model's
  config.json), read once per step at the 3.35 TB/s of an H100 SXM (NVIDIA's data sheet);
- answer lengths log-normal, log-sd 0.6, median 700 tokens for the easiest prompts,
  growing by half from the easiest to the hardest prompt (assumed: harder problems get
  longer reasoning), wrong answers 1.3x longer (incorrect solutions are longer than
  correct ones in Zeng et al. 2025, arXiv 2502.12215; the factor is assumed), cut at
  `max_tokens` 4,096 (a cut answer scores 0);
- `ENGINE_FLAT` is the same engine with lengths independent of difficulty and
  correctness; the table is repeated with it.

    python -m bench.step_time --quick   # B = 256, 3 measured steps, r 0.7 off-policy
    python -m bench.step_time           # B = 512, 6 measured steps, every r off-policy
    python -m bench.step_time --quick --staleness-only   # the staleness runs alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from bench import adaptive_sim, virtual_clock
from bench.common import DAPO_REFILL, RESULTS, Method, est, flags, grpo, table, write_json
from bench.sim_backend import EngineSpec, SimBackend, sim_scheduler
from sampler_service.config import SamplerConfig, check_consistency
from sampler_service.delivery import HOLD_POLL_S
from sampler_service.finalize import VolatileSink
from sampler_service.grouping import downsampled_tokens, fresh_tokens
from sampler_service.outbox import out_of_order, split_stale, too_stale
from sampler_service.scheduler import Scheduler
from trainer_client.contract.protocol import Group
from trainer_client.report import save_figure

#: The simulated engine's defaults (a ~1.5B model on one GPU), with wrong and hard
#: answers longer and the KV cache's cost per token held.
ENGINE = EngineSpec(wrong_length_factor=1.3, difficulty_length=0.5, kv_token_s=8.5e-9)
ENGINE_FLAT = replace(ENGINE, wrong_length_factor=1.0, difficulty_length=0.0)
MAX_TOKENS = 4096
#: Weight sync after each step, simulated seconds (stated constant).
SYNC_S = 0.0
RATIOS = (0.35, 0.7, 1.4)
PIPELINES = ("sync", "on_policy", "off_policy")
#: Standard errors a self-check may be off by.
CHECK_SE = 4.0


def rows() -> list[Method]:
    """The compared methods, as sampler configs without their pipeline knobs: the rows as
    they were first measured, each adaptive one (n_max >= 16) counted whole waves
    (`stopping: wave`), and beside each such row its twin with exact stopping."""
    measured = [Method(m.key, m.label, {**m.config, "stopping": "wave"}, m.extra) for m in _rows()]
    twins = [
        Method(f"{m.key}_exact", f"{m.label}, exact", {**m.config, "stopping": "exact"})
        for m in measured
        if _adaptive(m) and not m.extra
    ]
    return measured + twins


def _adaptive(method: Method) -> bool:
    """An adaptive-sampling row (not GRPO or DAPO), of n_max >= 16."""
    return not method.key.startswith(("grpo", "dapo")) and method.config.get("n_max", 32) >= 16


def _rows() -> list[Method]:
    """The rows as they were first measured."""
    ada = {
        "n_max": 32,
        "wave_size": 8,
        "group_size": 4,
        "downsample": "balanced",
        "advantage": "global",
    }
    bal = {**ada, "rule": "balanced", "k_pos": 2, "k_neg": 2}
    skip = [{"name": "history_skip", "params": {"explore": 0.5, "max_skip": 0.9}}]
    return [
        *(Method(f"grpo{n}", f"GRPO n={n}", grpo(n)) for n in (4, 8, 16)),
        Method("dapo4", "DAPO refill n=4", grpo(4, **DAPO_REFILL)),
        Method("seqpos1", "Seq-Pos K_pos 1", {**ada, "rule": "positive", "k_pos": 1}),
        Method("seqbal", "Seq-Balance 2/2", bal),
        Method("seqbal_adaptive", "Seq-Balance + adaptive waves", {**bal, "wave": "adaptive"}),
        Method("est", "Est (mean budget 8)", est(8)),
        Method(
            "seqbal_adaptive_skip",
            "Seq-Balance + adaptive + history skip",
            {**bal, "wave": "adaptive", "admission_policies": skip},
        ),
        Method(
            "seqpos1_posterior_skip",
            "Seq-Pos K_pos 1 + posterior budget + history skip",
            {
                **ada,
                "rule": "positive",
                "k_pos": 1,
                "allocation": {"name": "posterior", "params": {"pilot": 4}},
                "admission_policies": skip,
            },
        ),
        Method(
            "seqbal_knapsack",
            "Seq-Balance + knapsack (mean budget 6, n_min 4)",
            {**bal, "allocation": {"name": "knapsack", "params": {"mean_budget": 6, "n_min": 4}}},
        ),
        Method(
            "seqbal_pilot_commit",
            "Seq-Balance + pilot-commit (pilot 4)",
            {**bal, "allocation": {"name": "pilot_commit", "params": {"pilot": 4}}},
        ),
        Method(
            "grpo4_replay",
            "GRPO n=4 + replay",
            grpo(4, replay={"per_prompt": 2, "max_version_lag": 64}),
        ),
        Method(
            "dapo4_skip",
            "DAPO refill n=4 + history skip",
            grpo(4, **DAPO_REFILL, admission_policies=skip),
            extra=True,
        ),
        Method(
            "seqbal11_adaptive_skip",
            "Seq-Balance 1/1 + adaptive + history skip",
            {**bal, "k_pos": 1, "k_neg": 1, "wave": "adaptive", "admission_policies": skip},
            extra=True,
        ),
    ]


def pipeline_config(row: Method, pipeline: str, batch: int) -> dict[str, Any]:
    """The row's config with the admission knobs of a pipeline (module docstring)."""
    base = {"batch_groups": batch, "max_tokens": MAX_TOKENS, **row.config}
    if pipeline == "sync":
        return {
            **base,
            "mode": "rounds",
            "cohort_size": batch,
            "max_active_prompts": batch,
            "max_buffered_groups": batch,
            "max_staleness": None,  # rounds: the cohort is the bound
        }
    staleness = {"on_policy": 0, "off_policy": 1}[pipeline]
    return {
        **base,
        "max_staleness": staleness,
        "max_active_prompts": (staleness + 1) * batch,
        "max_buffered_groups": 8 * batch,
    }


class Trainer(VolatileSink):
    """The scheduler's sink: a trainer that takes frames one at a time, trains on each
    for its trainer phase, pushes weights, then acks it (frees its buffer space)."""

    def __init__(self, *, train_s_per_sample: float, steps: int, pass_rates: np.ndarray) -> None:
        self.train_s_per_sample = train_s_per_sample
        self.steps_wanted = steps
        self.rates = pass_rates
        self.held: deque[list[Group]] = deque()
        self.training: list[Group] = []
        #: Groups dropped as stale since the last step was recorded.
        self.stale: list[Group] = []
        #: When each group that waits for the rest of its frame finished, and how long
        #: each framed group waited for its frame to fill (0 for a frame's last member).
        self.finished_at: dict[str, float] = {}
        self.frame_wait_s: dict[str, float] = {}
        self.frames = asyncio.Event()
        self.version = 0
        self.records: list[dict[str, Any]] = []
        self.groups: list[tuple[float, int, bool]] = []  # (pass rate, answers, informative)
        self.scheduler: Scheduler | None = None
        self.engine: SimBackend | None = None
        #: Seconds weight updates waited for running answers (drained or aborted).
        self.drain_s = 0.0

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        self.finished_at[group.group_id] = asyncio.get_running_loop().time()

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        now = asyncio.get_running_loop().time()
        for group in groups:
            # A member framed again after its frame was split keeps its first wait.
            self.frame_wait_s.setdefault(
                group.group_id, now - self.finished_at.pop(group.group_id, now)
            )
        if groups:
            self.held.append(groups)
            self.frames.set()

    def buffered(self) -> int:
        """Groups not yet acked: waiting (READY) or being trained on (LEASED)."""
        return sum(len(f) for f in self.held) + len(self.training)

    def _snapshot(self) -> dict[str, Any]:
        assert self.scheduler is not None and self.engine is not None
        loop = asyncio.get_running_loop()
        st = self.scheduler.tally
        return {
            "t": loop.time(),
            "answers": st.samples,
            "engine_s": self.engine.stats.decode_s + self.engine.stats.prefill_s,
            "prefill_s": self.engine.stats.prefill_s,
            "slot_s": self.engine.stats.busy_slot_s,
            "slots": self.engine.spec.max_num_seqs,
            "skipped": sum(d.skipped for d in st.domains.values()),
            "admitted": sum(d.admitted for d in st.domains.values()),
            # Prompts finalized (their group formed or dropped), and groups dropped.
            "finalized": sum(st.stop_reasons.values()) + _early_drops(st.dropped),
            "dropped": sum(st.dropped.values()),
            "decoded": st.decoded,
            "surplus": st.waste["surplus"],
            "wasted": sum(st.waste.values()),
            "stale_tokens": st.waste["stale"],
            "aborted_tokens": st.waste["aborted"],
            "drain_s": self.drain_s,
            "spanning": st.spanning_answers,
            "hold_s": st.handout_hold_s,
            "late_framed": st.late_groups_framed,
        }

    async def run(self) -> None:
        assert self.scheduler is not None and self.engine is not None
        loop = asyncio.get_running_loop()
        self.records.append({**self._snapshot(), "t_frame": loop.time()})
        while len(self.records) <= self.steps_wanted:
            while not self.held:
                self.frames.clear()
                await self.frames.wait()
            self.stale += await self._drop_stale()
            if not self.held:
                continue
            await self._hold_for_late()
            frame = self.training = self._take_oldest()
            at_frame = self._snapshot()
            lags = Counter(self.version - s.policy_version for g in frame for s in g.samples)
            samples = sum(len(g.samples) for g in frame)
            informative = [_informative(g) for g in frame]
            self.groups.extend(
                (float(self.rates[int(g.prompt_id[1:])]), g.stats.n_generated, inf)
                for g, inf in zip(frame, informative, strict=True)
            )
            await asyncio.sleep(self.train_s_per_sample * samples + SYNC_S)
            update_started = loop.time()
            async with self.scheduler.paused_for_weights():
                self.drain_s += loop.time() - update_started
                self.version += 1
                await self.engine.load_weights({}, self.version)
            self.training = []
            self.scheduler.tally.acked(len(frame), sum(map(fresh_tokens, frame)))
            self.scheduler.poke()
            self.records.append(
                {
                    **at_frame,
                    "t_frame": at_frame["t"],
                    "t": loop.time(),
                    "groups": len(frame),
                    "informative": sum(informative),
                    "samples": samples,
                    "lags": dict(lags),
                    "trained_by_quartile": dict(
                        Counter(self._quartile(g) for g in frame for _ in g.samples)
                    ),
                    "groups_by_quartile": dict(Counter(map(self._quartile, frame))),
                    "stale_by_quartile": dict(Counter(map(self._quartile, self.stale))),
                    "stale_informative": sum(map(_informative, self.stale)),
                    "stale_frame_wait_s": [self.frame_wait_s[g.group_id] for g in self.stale],
                }
            )
            self.stale = []

    def _quartile(self, group: Group) -> int:
        """The pass-rate quartile of the group's prompt (0: below 0.25, the hardest)."""
        return min(int(float(self.rates[int(group.prompt_id[1:])]) * 4), 3)

    async def _drop_stale(self) -> list[Group]:
        """The service's drop rule (`Outbox.drop_stale`, through `split_stale`) over the
        frames waiting, checked where the service checks it (after a push, before a
        hand-out): a frame whose oldest sample is past the bound loses its members past
        it, whose prompts are served again, and the rest are framed again (no frame here
        was handed out before; with batch selections the frame is dropped whole)."""
        assert self.scheduler is not None
        scheduler = self.scheduler
        bound = scheduler.config.max_staleness
        split = not scheduler.live.policies.selections
        kept: deque[list[Group]] = deque()
        dropped: list[Group] = []
        again: list[Group] = []
        for frame in self.held:
            if not too_stale(self.version, min(g.policy_version_min for g in frame), bound):
                kept.append(frame)
                continue
            gone, back = split_stale(frame, self.version, bound, whole=not split)
            dropped += gone
            again += back
        if dropped or again:
            self.held = kept
            for group in dropped:
                quartile = scheduler.live.quartile(group.prompt_id)
                scheduler.tally.dropped_group(
                    "stale", fresh_tokens(group), group.domain, quartile, downsampled_tokens(group)
                )
                scheduler.dataset.serve_again(group.domain, group.prompt_id)
            await scheduler.finalizer.take_back(again)
            scheduler.poke()
        return dropped

    async def _hold_for_late(self) -> None:
        """The service's hand-out hold (`Delivery` with `handout_hold_s`): the frame
        about to go out waits for late prompts, and their groups take the places of its
        newer members (`Finalizer.frame_late_groups`). No weight push comes meanwhile
        (this trainer makes them), so no stale check follows."""
        assert self.scheduler is not None
        scheduler, loop = self.scheduler, asyncio.get_running_loop()
        since = loop.time()
        while scheduler.holds_handout(self._next_newest(), loop.time() - since):
            await asyncio.sleep(HOLD_POLL_S)
        await scheduler.finalizer.frame_late_groups(self._take_out_unordered, loop.time() - since)

    def _next_newest(self) -> int:
        """The newest policy version among the members of the frame handed out next."""
        return max(g.policy_version_min for g in self.held[self._handout_order()[0]])

    def _take_out_unordered(
        self, rank: Callable[[int], int], waiting: int | None
    ) -> list[list[Group]]:
        """The frames waiting, taken out if their members are not in framing order
        (`Outbox.take_out_unordered`)."""
        frames = [self.held[i] for i in self._handout_order()]
        ranks = [[rank(g.policy_version_min) for g in frame] for frame in frames]
        if not out_of_order(ranks, waiting):
            return []
        self.held.clear()
        return frames

    def _handout_order(self) -> list[int]:
        """The indices of the frames waiting in the order the service hands them out:
        oldest policy version first, then the first framed."""
        return sorted(
            range(len(self.held)),
            key=lambda i: (min(g.policy_version_min for g in self.held[i]), i),
        )

    def _take_oldest(self) -> list[Group]:
        """The frame the service hands out next, taken out."""
        oldest = self._handout_order()[0]
        frame = self.held[oldest]
        del self.held[oldest]
        return frame


def _early_drops(dropped: Counter[str]) -> int:
    """Prompts dropped before their group was formed (they have no stop reason)."""
    return sum(
        dropped[r] for r in ("engine_error", "env_error", "verifier_error", "verifier_unavailable")
    )


def _informative(group: Group) -> bool:
    rewards = [s.reward for s in group.samples]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


async def simulate(
    config: dict[str, Any],
    pass_rates: np.ndarray,
    dataset_file: Path,
    *,
    spec: EngineSpec,
    steps: int,
    warmup: int,
    train_s_per_sample: float,
    seed: int,
    history_epochs: int,
) -> dict[str, Any]:
    """Run one method on one pipeline for warmup + steps training steps."""
    dataset = adaptive_sim.simulated_dataset(dataset_file, len(pass_rates), seed)
    cfg = SamplerConfig(**config)
    check_consistency(cfg, dataset.domains)
    engine = SimBackend(pass_rates, spec, seed=seed + 1)
    await engine.start()
    trainer = Trainer(
        train_s_per_sample=train_s_per_sample, steps=warmup + steps, pass_rates=pass_rates
    )
    scheduler = sim_scheduler(engine, dataset, trainer, cfg, seed)
    trainer.scheduler, trainer.engine = scheduler, engine
    if history_epochs:
        adaptive_sim.load_history(scheduler, pass_rates, history_epochs, seed)
    scheduler.start()
    try:
        async with asyncio.timeout(1e7):  # simulated seconds: a stuck simulation fails loudly
            await trainer.run()
    finally:
        await scheduler.stop()
        await engine.close()
    return {
        **summarize(trainer.records, warmup, trainer.groups),
        "pacing": scheduler.pacer.to_dict(),
    }


def summarize(
    records: list[dict[str, Any]], warmup: int, groups: list[tuple[float, int, bool]]
) -> dict[str, Any]:
    """Per-step figures over the steps after `warmup` (records[0] is the start)."""
    start, measured = records[warmup], records[warmup + 1 :]
    k = len(measured)
    end = measured[-1]
    informative = sum(r["informative"] for r in measured)
    n_groups = sum(r["groups"] for r in measured)
    lags: Counter[int] = Counter()
    for r in measured:
        lags.update({int(a): n for a, n in r["lags"].items()})
    samples = sum(lags.values())
    # Generation time of a step with nothing overlapping: frame formed - previous ack.
    gen = [r["t_frame"] - prev["t"] for prev, r in zip(records[warmup:], measured, strict=False)]

    def delta(key: str) -> float:
        return float(end[key] - start[key])

    quartiles: dict[str, Counter[int]] = {
        kind: Counter()
        for kind in ("trained_by_quartile", "groups_by_quartile", "stale_by_quartile")
    }
    for r in measured:
        for kind, counts in quartiles.items():
            counts.update(r[kind])

    decoded = max(delta("decoded"), 1.0)
    return {
        "steps": k,
        "step_s": (end["t"] - start["t"]) / k,
        "gen_s": float(np.mean(gen)),
        "samples_trained": samples / k,
        "answers": delta("answers") / k,
        # Over every prompt finalized in the window, dropped ones included.
        "informative_frac": informative / max(delta("finalized"), n_groups, 1),
        "answers_per_informative": delta("answers") / max(informative, 1),
        "engine_s_per_informative": delta("engine_s") / max(informative, 1),
        # Of the engine's busy time, what prefills took (prompts, and under `continue`
        # with `recompute` the running answers' re-prefill at each update).
        "prefill_share": delta("prefill_s") / max(delta("engine_s"), 1e-9),
        # Mean running sequences over the engine's slots, frame to frame.
        "occupancy": delta("slot_s")
        / max(end["slots"] * (end["t_frame"] - start["t_frame"]), 1e-9),
        "tokens_per_informative": delta("decoded") / max(informative, 1),
        # Decoded tokens a second, frame to frame: the engine's rate at the run's occupancy.
        "decode_tok_s": delta("decoded") / max(end["t_frame"] - start["t_frame"], 1e-9),
        "surplus_share": delta("surplus") / decoded,
        "wasted_share": delta("wasted") / decoded,
        "dropped_per_step": delta("dropped") / k,
        "skipped_per_step": delta("skipped") / k,
        "admitted_per_step": delta("admitted") / k,
        "stale_share": sum(n for lag, n in lags.items() if lag >= 1) / max(samples, 1),
        "lags": {str(lag): n / max(samples, 1) for lag, n in sorted(lags.items())},
        "stale_dropped_share": delta("stale_tokens") / decoded,
        "aborted_tokens": delta("aborted_tokens"),
        "drain_s_per_step": delta("drain_s") / k,
        # Seconds hand-outs waited for late prompts, and the groups moved to earlier frames.
        "hold_s_per_step": delta("hold_s") / k,
        "late_framed_per_step": delta("late_framed") / k,
        "spanning_per_step": delta("spanning") / k,
        # Of the groups dropped stale: how many had a right and a wrong answer (a GRPO
        # signal), and the seconds each waited, finished, for its frame to fill.
        "stale_informative": sum(r["stale_informative"] for r in measured),
        "stale_frame_wait_s": [round(w, 1) for r in measured for w in r["stale_frame_wait_s"]],
        "quartiles": {
            str(q): {
                "trained_samples": quartiles["trained_by_quartile"][q],
                "trained_groups": quartiles["groups_by_quartile"][q],
                "stale_groups": quartiles["stale_by_quartile"][q],
            }
            for q in range(4)
        },
        "groups": groups,
    }


def _hard_mix(args: argparse.Namespace) -> np.ndarray:
    """The pass rates of a prompt draw's hard mix (`args.prompts` of them, `args.seed`)."""
    return adaptive_sim.draw_pass_rates("hard", args.prompts, np.random.default_rng(args.seed))


def run_one(
    row: Method,
    pipeline: str,
    rates: np.ndarray,
    args: argparse.Namespace,
    spec: EngineSpec,
    *,
    train_s_per_sample: float = 0.0,
    seed: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One row on one pipeline; `overrides` replace knobs of the pipeline's config."""
    with tempfile.TemporaryDirectory() as tmp:
        data = adaptive_sim.write_dataset(Path(tmp), len(rates))
        return virtual_clock.run(
            simulate(
                {**pipeline_config(row, pipeline, args.batch), **(overrides or {})},
                rates,
                data,
                spec=spec,
                steps=args.steps,
                warmup=args.warmup,
                train_s_per_sample=train_s_per_sample,
                seed=args.seed if seed is None else seed,
                history_epochs=args.history_epochs,
            )
        )


# -- closed forms ---------------------------------------------------------------------
def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(0, min(k, n) + 1))


def effective_pass_rate(p: float, spec: EngineSpec, max_tokens: int = MAX_TOKENS) -> float:
    """Chance an answer scores 1: correct and not cut at max_tokens (a cut answer scores 0)."""
    median = spec.length_median * (1.0 + spec.difficulty_length * (1.0 - p))
    z = (
        (math.log(max_tokens + 0.5) - math.log(median)) / spec.length_sigma
        if spec.length_sigma
        else math.inf
    )
    return p * 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def closed_form(key: str, q: float, *, n_max: int = 32, wave: int = 8) -> tuple[float, float]:
    """(expected answers, P(informative)) of a round-based rule for a prompt whose
    answers score 1 with probability q.

    A prompt runs waves of `wave` answers until its rule holds or n_max is reached, so
    E[answers] = sum over rounds j of wave x P(rule not yet met after j waves). Balanced
    down-sampling keeps a positive and a negative whenever both exist, so a group is
    informative unless every answer agreed (for Seq-Pos K_pos 1: unless the first wave
    was all correct or all n_max answers were wrong).
    """
    rounds = n_max // wave
    if key == "grpo4":
        return 4.0, 1.0 - q**4 - (1 - q) ** 4
    if key == "seqpos1":
        answers = sum(wave * (1 - q) ** (wave * j) for j in range(rounds))
        return answers, 1.0 - q**wave - (1 - q) ** n_max
    if key == "seqbal":

        def not_met(m: int) -> float:  # P(fewer than 2 positives or fewer than 2 negatives)
            if m < 4:
                return 1.0
            return _binom_cdf(1, m, q) + _binom_cdf(1, m, 1 - q)

        answers = sum(wave * not_met(wave * j) for j in range(rounds))
        return answers, 1.0 - q**n_max - (1 - q) ** n_max
    raise KeyError(key)


CHECKED = ("grpo4", "seqpos1", "seqbal")


def self_check(
    key: str, groups: list[tuple[float, int, bool]], spec: EngineSpec
) -> list[dict[str, Any]]:
    """Pooled per-prompt residuals (measured - closed form) of answers and informative,
    and their z-scores; a check is met when |z| <= CHECK_SE."""
    out = []
    expected = [closed_form(key, effective_pass_rate(p, spec)) for p, _, _ in groups]
    for i, (name, measured) in enumerate(
        (
            ("answers per prompt", [a for _, a, _ in groups]),
            ("informative", [float(f) for *_, f in groups]),
        )
    ):
        resid = np.array(measured, dtype=float) - np.array([e[i] for e in expected])
        se = float(resid.std(ddof=1) / math.sqrt(len(resid))) if len(resid) > 1 else math.inf
        mean = float(resid.mean())
        z = mean / se if se > 0 else (0.0 if mean == 0 else math.inf)
        out.append(
            {
                "rule": key,
                "quantity": name,
                "prompts": len(resid),
                "measured": float(np.mean(measured)),
                "expected": float(np.mean([e[i] for e in expected])),
                "z": z,
                "met": abs(z) <= CHECK_SE,
            }
        )
    return out


def run_checks(args: argparse.Namespace, spec: EngineSpec, bar: Any = None) -> list[dict[str, Any]]:
    """Each checked rule on the sync pipeline over `args.draws` prompt draws."""
    by_key = {r.key: r for r in rows()}
    small = argparse.Namespace(**{**vars(args), "batch": args.check_batch, "steps": 1, "warmup": 0})
    out = []
    for key in CHECKED:
        groups: list[tuple[float, int, bool]] = []
        for draw in range(args.draws):
            seed = args.seed + 1000 * (draw + 1)
            rates = adaptive_sim.draw_pass_rates(
                "hard", args.check_batch * 2, np.random.default_rng(seed)
            )
            groups += run_one(by_key[key], "sync", rates, small, spec, seed=seed)["groups"]
            if bar is not None:
                bar.update(1)
        out += self_check(key, groups, spec)
    return out


# -- the tables -----------------------------------------------------------------------
def measure(
    args: argparse.Namespace,
    spec: EngineSpec,
    log: Any,
    bar: Any = None,
    *,
    only: Collection[str] | None = None,
    pipelines: Sequence[str] = PIPELINES,
    overrides: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every row (or those keyed `only`, GRPO n=4 first) on every pipeline (or those
    named), with `overrides` on every config; step times per r (module docstring)."""
    rates = _hard_mix(args)
    table_rows = []
    t4 = None
    for row in rows():
        if only is not None and row.key not in only:
            continue
        for pipeline in pipelines:
            started = time.monotonic()
            if pipeline != "off_policy":
                res = run_one(row, pipeline, rates, args, spec, overrides=overrides)
                if t4 is None:  # GRPO n=4 sync comes first
                    t4 = res["gen_s"]
                res["step_s_by_r"] = _steps_by_r(res, t4, args.batch)
            else:
                assert t4 is not None
                res = {"step_s_by_r": {}}
                for r in args.off_policy_r:
                    one = run_one(
                        row,
                        pipeline,
                        rates,
                        args,
                        spec,
                        train_s_per_sample=r * t4 / (4 * args.batch),
                        overrides=overrides,
                    )
                    res["step_s_by_r"][str(r)] = one["step_s"]
                    if r == 0.7 or "answers" not in res:
                        res.update({k: v for k, v in one.items() if k != "step_s"})
            res.pop("groups", None)
            res.update(
                method=row.key,
                label=row.label,
                pipeline=pipeline,
                extra=row.extra,
                stopping=row.config.get("stopping", "wave"),
            )
            table_rows.append(res)
            log(f"  {row.label} / {pipeline}: {time.monotonic() - started:.1f}s real")
            if bar is not None:
                bar.update(1)
    base = next(r for r in table_rows if r["method"] == "grpo4" and r["pipeline"] == "sync")
    for r in table_rows:
        r["ratio_by_r"] = {k: v / base["step_s_by_r"][k] for k, v in r["step_s_by_r"].items()}
    return table_rows


def _steps_by_r(res: dict[str, Any], t4: float, batch: int) -> dict[str, float]:
    """A generate-then-train run's step at each r: its generation plus a trainer phase of r
    times GRPO n=4's generation (`t4`) per 4 x B samples."""
    return {
        str(r): res["gen_s"] + r * t4 * res["samples_trained"] / (4 * batch) + SYNC_S
        for r in RATIOS
    }


def steps_table(table_rows: list[dict[str, Any]]) -> str:
    """The step-time table of `measure`'s rows: one column per r, extra rows marked with *."""
    flat = []
    for r in table_rows:
        row = {**r, "label": r["label"] + (" *" if r["extra"] else "")}
        for k, v in r["ratio_by_r"].items():
            row[f"ratio_{k}"] = v
        flat.append(row)
    return table(
        flat,
        [
            ("label", "method"),
            ("pipeline", "pipeline"),
            ("ratio_0.35", "step vs GRPO n=4 sync, r 0.35"),
            ("ratio_0.7", "r 0.7"),
            ("ratio_1.4", "r 1.4"),
            ("informative_frac", "informative"),
            ("answers_per_informative", "answers / informative group"),
            ("tokens_per_informative", "tokens / informative group"),
            ("engine_s_per_informative", "engine-s / informative group"),
            ("samples_trained", "samples trained / step"),
            ("surplus_share", "surplus share"),
            ("stale_share", "stale share"),
            ("skipped_per_step", "prompts skipped / step"),
            ("dropped_per_step", "groups dropped / step"),
        ],
    )


#: Informative fraction the best configuration must reach.
MIN_INFORMATIVE = 0.9


#: Which rows compete for "best": the listed ones, the listed adaptive-sampling ones
#: (no GRPO or DAPO), or every row including the extra ones.
COMPETING = ("listed", "adaptive", "all")


def targets(table_rows: list[dict[str, Any]], competing: str = "listed") -> dict[str, Any]:
    """The targets, on the on-policy pipeline at r 0.7: the best row (lowest step-time
    ratio among the competing non-GRPO rows with >= 90% informative groups) should be
    within 1.5x of GRPO n=4 sync and spend <= 11 answers per informative group; or, the
    alternative the allocation work is judged by, some such row spends <= 0.6x GRPO n=4's
    engine-seconds per informative group (`engine_ratio`, with its row `engine_best`)."""
    good = [
        r
        for r in table_rows
        if r["pipeline"] == "on_policy"
        and r["stopping"] == "wave"
        and not r["method"].startswith("grpo")
        and (competing == "all" or not r["extra"])
        and (competing != "adaptive" or not r["method"].startswith("dapo"))
        and r["informative_frac"] >= MIN_INFORMATIVE
    ]
    if not good:
        return {"best": None, "step_target_met": False, "answers_target_met": False,
                "engine_target_met": False}  # fmt: skip
    grpo4 = next(r for r in table_rows if r["method"] == "grpo4" and r["pipeline"] == "on_policy")
    best = min(good, key=lambda r: r["ratio_by_r"]["0.7"])
    cheapest = min(good, key=lambda r: r["engine_s_per_informative"])
    engine_ratio = cheapest["engine_s_per_informative"] / grpo4["engine_s_per_informative"]
    return {
        "best": best["method"],
        "ratio_r07": best["ratio_by_r"]["0.7"],
        "informative": best["informative_frac"],
        "answers_per_informative": best["answers_per_informative"],
        "step_target_met": best["ratio_by_r"]["0.7"] <= 1.5,
        "answers_target_met": best["answers_per_informative"] <= 11,
        "engine_best": cheapest["method"],
        "engine_ratio": engine_ratio,
        "engine_target_met": engine_ratio <= 0.6,
        "grpo4": {
            "informative": grpo4["informative_frac"],
            "answers_per_informative": grpo4["answers_per_informative"],
            "engine_s_per_informative": grpo4["engine_s_per_informative"],
        },
    }


#: Exact stopping's goals, as ratios to GRPO n=4 (on-policy, r 0.7, hard mix, lengths by
#: difficulty), for the best exact row at >= 90% informative.
EXACT_GOALS = {
    "tokens_per_informative": ("decoded tokens per informative group vs GRPO n=4", 0.8),
    "engine_s_per_informative": ("engine-seconds per informative group vs GRPO n=4", 1.1),
    "step": ("on-policy step at r 0.7 vs GRPO n=4 sync", 1.5),
}


def _exact_ratios(table_rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One seed's figures for the exact targets: the best exact row (lowest on-policy step
    ratio at r 0.7 among the exact twins with >= 90% informative groups), its ratios to
    GRPO n=4, the same ratios of its wave-stopping twin, and both surplus shares."""
    on = {r["method"]: r for r in table_rows if r["pipeline"] == "on_policy"}
    twins = [
        r
        for k, r in on.items()
        if k.endswith("_exact") and r["informative_frac"] >= MIN_INFORMATIVE
    ]
    if not twins:
        return None
    best = min(twins, key=lambda r: r["ratio_by_r"]["0.7"])
    today, grpo4 = on[best["method"].removesuffix("_exact")], on["grpo4"]
    return {
        "method": best["method"],
        "exact": _ratios(best, grpo4),
        "wave": _ratios(today, grpo4),
    }


def _ratios(row: dict[str, Any], grpo4: dict[str, Any]) -> dict[str, float]:
    """An on-policy row's figures for the exact targets, against GRPO n=4's."""
    return {
        "tokens_per_informative": row["tokens_per_informative"] / grpo4["tokens_per_informative"],
        "engine_s_per_informative": row["engine_s_per_informative"]
        / grpo4["engine_s_per_informative"],
        "step": row["ratio_by_r"]["0.7"],
        "surplus_share": row["surplus_share"],
    }


def arrival_ratios(args: argparse.Namespace, method: str, log: Any) -> dict[str, float]:
    """The exact targets' figures of `method` with its engine serving answers in arrival
    order (`engine_priority: arrival`) instead of the service's default for exact stopping
    (lowest answer index first), on the same prompts: what that order is worth."""
    on = {
        r["method"]: r
        for r in measure(
            args,
            ENGINE,
            log,
            only=("grpo4", method),
            pipelines=("sync", "on_policy"),
            overrides={"engine_priority": "arrival"},
        )
        if r["pipeline"] == "on_policy"
    }
    return _ratios(on[method], on["grpo4"])


#: Speculative widths (answers a prompt's wave issues at most) the exact row is run at.
#: Exact stopping holds at every width: a width only adds indices, so this is the trade
#: the one mechanism free under exactness offers, from no surplus (width 1: answers one
#: at a time after the first `min_answers`) to every answer the budget allows at once.
WIDTHS = (1, 2, 4, 8, 16, 32)


def width_ratios(
    args: argparse.Namespace, table_rows: list[dict[str, Any]], method: str
) -> dict[str, dict[str, float]]:
    """The exact targets' figures of `method` on-policy at each of `WIDTHS` (its
    `wave_size`), against GRPO n=4 in `table_rows` (one prompt draw's table). The row's
    own width is run again too: it must repeat the table's figures, a check on the sweep."""
    by = {(r["method"], r["pipeline"]): r for r in table_rows}
    sync4, on4 = by[("grpo4", "sync")], by[("grpo4", "on_policy")]
    row = next(m for m in rows() if m.key == method)
    rates = _hard_mix(args)
    out = {}
    for width in WIDTHS:
        res = run_one(row, "on_policy", rates, args, ENGINE, overrides={"wave_size": width})
        steps = _steps_by_r(res, sync4["gen_s"], args.batch)
        res["ratio_by_r"] = {r: v / sync4["step_s_by_r"][r] for r, v in steps.items()}
        out[str(width)] = _ratios(res, on4)
    return out


def sequential_floor(
    args: argparse.Namespace, table_rows: list[dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """Every exact twin on-policy at width 1, against GRPO n=4 in `table_rows` (one prompt
    draw's table): its tokens per informative group and its informative fraction. Width 1
    decodes no surplus, so it spends what sequential sampling spends on the row's groups;
    a wider wave forms the same groups and adds surplus, so no width of the row decodes
    less, whatever the engine does."""
    on4 = next(r for r in table_rows if r["method"] == "grpo4" and r["pipeline"] == "on_policy")
    rates = _hard_mix(args)
    out = {}
    for row in rows():
        if row.key.endswith("_exact"):
            res = run_one(row, "on_policy", rates, args, ENGINE, overrides={"wave_size": 1})
            out[row.key] = {
                "tokens_per_informative": res["tokens_per_informative"]
                / on4["tokens_per_informative"],
                "informative_frac": res["informative_frac"],
            }
    return out


def floor_summary(per_seed: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """`sequential_floor`'s figures of each row over the seeds: the mean tokens ratio with
    its spread, and the mean informative fraction."""
    out = {}
    for key in per_seed[0]["floor"]:
        tokens = [f["floor"][key]["tokens_per_informative"] for f in per_seed]
        informative = [f["floor"][key]["informative_frac"] for f in per_seed]
        out[key] = {
            "mean": float(np.mean(tokens)),
            "min": min(tokens),
            "max": max(tokens),
            "informative_frac": float(np.mean(informative)),
        }
    return out


def _floor_text(floor: dict[str, dict[str, float]], goal: float) -> str:
    """What the sequential floor says of the tokens goal."""
    eligible = {k: v for k, v in floor.items() if v["informative_frac"] >= MIN_INFORMATIVE}
    if not eligible:
        return ""
    lowest = min(eligible, key=lambda k: eligible[k]["mean"])
    value = eligible[lowest]["mean"]
    verdict = "so no width of any listed row meets the goal" if value > goal else "within the goal"
    return (
        f"; one answer at a time (width 1, no surplus: sequential sampling's tokens) the "
        f"exact twins at >= {MIN_INFORMATIVE:.0%} informative spend at least {value:.2f}x "
        f"({lowest}), {verdict}"
    )


def exact_targets(per_seed: list[dict[str, Any] | None]) -> dict[str, Any]:
    """`exact/<name>` targets over the seeds' figures: the mean, with the spread."""
    seeds = [f for f in per_seed if f is not None]
    out: dict[str, Any] = {}
    if not seeds:
        return {f"exact/{k}": {"met": False, "reason": "no exact row reached 90% informative"}
                for k in (*EXACT_GOALS, "surplus_share")}  # fmt: skip
    methods = sorted({f["method"] for f in seeds})

    def summary(kind: str, key: str) -> dict[str, Any]:
        values = [f[kind][key] for f in seeds]
        return {"mean": float(np.mean(values)), "min": min(values), "max": max(values)}

    def beside(key: str) -> dict[str, Any]:
        """The twin's figures, and the exact row's in arrival order where measured."""
        out = {"wave_stopping": summary("wave", key)}
        if all("arrival" in f for f in seeds):
            out["arrival_order"] = summary("arrival", key)
        return out

    def arrival_text(key: str) -> str:
        if "arrival_order" not in (twin := beside(key)):
            return ""
        return f", {twin['arrival_order']['mean']:.2f}x with engines in arrival order"

    def by_width(key: str) -> dict[str, Any]:
        """The seeds' mean figure at each speculative width, where measured."""
        if not all("widths" in f for f in seeds):
            return {}
        widths = seeds[0]["widths"]
        return {"widths": {w: float(np.mean([f["widths"][w][key] for f in seeds])) for w in widths}}

    def widths_text(key: str, goal: float) -> str:
        if not (measured := by_width(key)):
            return ""
        means = measured["widths"]
        lowest = min(means, key=means.__getitem__)
        reached = [w for w, v in means.items() if v <= goal]
        return (
            f"; over speculative widths {min(means, key=int)}-{max(means, key=int)} the lowest "
            f"is {means[lowest]:.2f}x (width {lowest}), "
            + (f"met at width {', '.join(reached)}" if reached else "no width meets the goal")
        )

    floor = floor_summary(seeds) if all("floor" in f for f in seeds) else {}
    for key, (what, goal) in EXACT_GOALS.items():
        exact, wave = summary("exact", key), summary("wave", key)
        met = exact["mean"] <= goal
        measured = {**exact, "seeds": len(seeds), **beside(key), **by_width(key)}
        floor_text = ""
        if key == "tokens_per_informative" and floor:
            measured["sequential_floor"] = floor
            floor_text = _floor_text(floor, goal)
        out[f"exact/{key}"] = {
            "target": what,
            "goal": f"<= {goal}x",
            "method": methods,
            "measured": measured,
            "met": met,
            "reason": f"{exact['mean']:.2f}x ({exact['min']:.2f}-{exact['max']:.2f} over "
            f"{len(seeds)} seeds) against {wave['mean']:.2f}x with whole-wave stopping"
            + arrival_text(key)
            + widths_text(key, goal)
            + floor_text,
        }
    surplus = summary("exact", "surplus_share")
    out["exact/surplus_share"] = {
        "target": "surplus tokens (above the index where the rule held) / decoded tokens",
        "goal": "reported (speculative waves trade it against parallelism)",
        "method": methods,
        "measured": {
            **surplus,
            "seeds": len(seeds),
            **beside("surplus_share"),
            **by_width("surplus_share"),
        },
        "met": None,
        "reason": "whole-wave stopping has no surplus: it trains on the whole wave"
        + arrival_text("surplus_share"),
    }
    return out


def plot_widths(judged: dict[str, Any], path: Path) -> Path | None:
    """The exact row's figures against GRPO n=4 at each speculative width, each target's
    goal drawn as a line: where a width would meet a goal, and what it pays in the others."""
    if "widths" not in judged["exact/step"]["measured"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    widths = list(judged["exact/step"]["measured"]["widths"])
    for n, (key, (what, goal)) in enumerate(EXACT_GOALS.items()):
        means = judged[f"exact/{key}"]["measured"]["widths"]
        colour = f"C{n}"
        ax.plot(range(len(widths)), [means[w] for w in widths], "o-", color=colour, label=what)
        ax.axhline(goal, color=colour, ls="--", lw=0.8)
    ax.set_xticks(range(len(widths)), widths)
    method = judged["exact/step"]["method"][0]
    own = next((m.config.get("wave_size") for m in rows() if m.key == method), None)
    ax.set_xlabel(f"speculative width (answers a wave issues at most; the row's own is {own})")
    ax.set_ylabel("x GRPO n=4 (dashed: goal)")
    ax.set_title(f"Exact stopping at each width: {method}, on-policy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


#: Staleness and weight update modes are judged on the best adaptive row, the lowest
#: on-policy step at r 0.7 with >= 90% informative groups among the listed rows and their
#: exact twins (a full run takes the difficulty table's pick, `best_row`; a section run
#: alone takes this one, the pick of the committed results), on the one-step-off-policy
#: pipeline at r 0.7, against the same run without a bound.
STALENESS_ROW = "seqpos1_posterior_skip_exact"
STALENESS_RUNS: dict[str, dict[str, Any]] = {
    "bounded": {},
    "arrival": {"engine_priority": "arrival"},
    "unpaced": {"max_delay_versions": 0},
    "unheld": {"handout_hold_s": 0},
    "unbounded": {"max_staleness": None},
    # Hard prompts' waves of 16, not the row's 8: two waves in a row, not four, for a
    # prompt that runs to n_max 32 (what its lateness is made of).
    "hard16": {"hard_wave_size": 16},
    # Every prompt's waves of 16, not only the hard ones': more surplus.
    "wide": {"wave_size": 16},
}
#: Measured steps of the staleness and weight update runs, whatever `--steps` says (if
#: more): drops are rare events, counted per quartile, and a step under `continue` varies
#: by +-10% from one to the next (seed 0: 288-345 s), so 3 steps can flatter a mode.
SECTION_STEPS = 10
STALENESS_GOALS = {
    "stale_share": ("stale-dropped tokens / decoded tokens", 0.02, "<="),
    "quartile_ratio": ("drop rate, hardest pass-rate quartile / easiest", 1.2, "<="),
    "hard_share": ("hardest quartile's share of trained samples vs without a bound", 0.9, ">="),
}


def _draw(args: argparse.Namespace, i: int) -> argparse.Namespace:
    """`args` for prompt draw `i` of `--seeds` (seed `args.seed + i`)."""
    return argparse.Namespace(**{**vars(args), "seed": args.seed + i})


def _drop_rate(quartile: dict[str, int]) -> float:
    """Stale-dropped groups of a quartile over its groups trained or dropped."""
    seen = quartile["stale_groups"] + quartile["trained_groups"]
    return quartile["stale_groups"] / seen if seen else 0.0


def _hard_share(q: dict[str, dict[str, int]]) -> float:
    """The hardest quartile's share of the trained samples."""
    return q["0"]["trained_samples"] / max(sum(v["trained_samples"] for v in q.values()), 1)


def staleness_figures(
    quartiles: dict[str, dict[str, int]], stale_share: float, unbounded: dict[str, dict[str, int]]
) -> dict[str, float]:
    """The staleness targets' figures of a run, from its quartile counts and stale share
    (`unbounded`: the quartile counts of the same prompts without a bound)."""
    hard, easy = _drop_rate(quartiles["0"]), _drop_rate(quartiles["3"])
    return {
        "stale_share": stale_share,
        "quartile_ratio": 1.0 if hard == easy else (hard / easy if easy else math.inf),
        "hard_share": _hard_share(quartiles) / max(_hard_share(unbounded), 1e-12),
    }


def best_row(table_rows: list[dict[str, Any]]) -> str:
    """The adaptive row (listed, or an exact twin) with the lowest on-policy step at r 0.7
    among those with >= 90% informative groups."""
    adaptive = {m.key for m in rows() if _adaptive(m) or m.key.endswith("_exact")}
    return str(
        min(
            (
                r
                for r in table_rows
                if r["pipeline"] == "on_policy"
                and r["method"] in adaptive
                and not r["extra"]
                and r["informative_frac"] >= MIN_INFORMATIVE
            ),
            key=lambda r: r["ratio_by_r"]["0.7"],
        )["method"]
    )


def measure_staleness(
    args: argparse.Namespace, spec: EngineSpec, log: Any, judged: str = STALENESS_ROW
) -> dict[str, Any]:
    """The `judged` row off-policy at r 0.7 in each of `STALENESS_RUNS`, side by side, for
    each of `args.seeds` prompt draws, and the `staleness/<name>` targets of the bounded
    runs: the stale share is the draws' mean, the quartile figures come from the draws'
    counts added up (drops are rare events). The runs shown are the first draw's."""
    per_seed = [_staleness_runs(_draw(args, i), spec, log, judged) for i in range(args.seeds)]
    pooled = {name: _pooled_quartiles([runs[name] for runs in per_seed]) for name in STALENESS_RUNS}
    figures = {
        name: staleness_figures(
            pooled[name],
            float(np.mean([runs[name]["stale_dropped_share"] for runs in per_seed])),
            pooled["unbounded"],
        )
        for name in STALENESS_RUNS
    }
    stale_shares = [runs["bounded"]["stale_dropped_share"] for runs in per_seed]
    counts = ", ".join(
        f"q{int(k) + 1} {v['stale_groups']} of {v['stale_groups'] + v['trained_groups']}"
        for k, v in pooled["bounded"].items()
    )
    section_targets = {}
    for key, (what, goal, sense) in STALENESS_GOALS.items():
        measured = figures["bounded"][key]
        met = measured <= goal if sense == "<=" else measured >= goal
        section_targets[f"staleness/{key}"] = {
            "measured": measured,
            "goal": f"{sense} {goal}",
            "met": met,
            "reason": f"{what} of {judged} off-policy (max_staleness 1, r 0.7), "
            f"{_longer(args).steps} measured steps, {len(per_seed)} prompt draws (stale share "
            f"{min(stale_shares):.4f}-{max(stale_shares):.4f}); engines in arrival order "
            f"{figures['arrival'][key]:.3f}, not paced {figures['unpaced'][key]:.3f}, hand-outs "
            f"not held {figures['unheld'][key]:.3f}, without a "
            f"bound {figures['unbounded'][key]:.3f}, hard prompts in waves of 16 "
            f"{figures['hard16'][key]:.3f}, every prompt in waves of 16 {figures['wide'][key]:.3f}; "
            f"stale-dropped groups by pass-rate quartile (q1 hardest): {counts}",
        }
    # What the hand-out hold saves: the groups the same runs drop without it.
    waits = [w for runs in per_seed for w in runs["unheld"]["stale_frame_wait_s"]]
    return {
        "row": judged,
        "runs": per_seed[0],
        "seeds": len(per_seed),
        "quartiles": pooled,
        "dropped": {
            "run": "unheld",
            "groups": sum(q["stale_groups"] for q in pooled["unheld"].values()),
            "informative": sum(runs["unheld"]["stale_informative"] for runs in per_seed),
            "median_frame_wait_s": float(np.median(waits)) if waits else None,
            "step_s": float(np.mean([runs["unheld"]["step_s"] for runs in per_seed])),
        },
        "figures": figures,
        "targets": section_targets,
    }


def _judged_draw(
    args: argparse.Namespace, spec: EngineSpec, judged: str
) -> tuple[Method, Method, np.ndarray, float]:
    """The judged row, GRPO n=4, the draw's hard mix, and the trainer's seconds per sample
    at r 0.7 (0.7x GRPO n=4's synchronous generation time per sample)."""
    row = next(r for r in rows() if r.key == judged)
    grpo4 = next(r for r in rows() if r.key == "grpo4")
    rates = _hard_mix(args)
    t4 = run_one(grpo4, "sync", rates, args, spec)["gen_s"]
    return row, grpo4, rates, 0.7 * t4 / (4 * args.batch)


def _longer(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with at least `SECTION_STEPS` measured steps."""
    return argparse.Namespace(**{**vars(args), "steps": max(args.steps, SECTION_STEPS)})


def _staleness_runs(
    args: argparse.Namespace, spec: EngineSpec, log: Any, judged: str
) -> dict[str, dict[str, Any]]:
    """One prompt draw's runs of `measure_staleness`, by name."""
    row, _, rates, train_s = _judged_draw(args, spec, judged)
    # More measured steps than the tables: drops are rare events, counted per quartile.
    longer = _longer(args)
    runs = {}
    for name, overrides in STALENESS_RUNS.items():
        started = time.monotonic()
        res = run_one(
            row,
            "off_policy",
            rates,
            longer,
            spec,
            train_s_per_sample=train_s,
            overrides=overrides,
        )
        res.pop("groups", None)
        runs[name] = res
        log(f"  staleness seed {args.seed} {name}: {time.monotonic() - started:.1f}s real")
    return runs


def _pooled_quartiles(runs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """The runs' quartile counts added up."""
    return {
        q: {k: sum(r["quartiles"][q][k] for r in runs) for k in runs[0]["quartiles"][q]}
        for q in runs[0]["quartiles"]
    }


#: Weight updates that neither drain nor abort, judged on the staleness row at r 0.7 with the
#: service's default drain cap (weight_drain_timeout_s), each update mode side by side.
CONTINUE_MODES = ("wait", "abort", "continue")
CONTINUE_GOALS = {
    "step": ("step with continue vs the same row with wait", 0.85, "<="),
    "engine_s_per_informative": ("engine-seconds per informative group vs GRPO n=4", 1.0, "<="),
    "aborted": ("tokens aborted by weight updates under continue", 0.0, "<="),
}


def measure_continue(
    args: argparse.Namespace, spec: EngineSpec, log: Any, judged: str = STALENESS_ROW
) -> dict[str, Any]:
    """The `judged` row in each weight update mode on both asynchronous pipelines (and
    off-policy without a bound and unpaced), and GRPO n=4 on-policy, for each of
    `args.seeds` prompt draws; the table is the first draw's runs, the `continue/<name>`
    targets the mean of the draws' figures with their spread, on the off-policy pipeline
    (max_staleness 1: on-policy, max_staleness 0, admits nothing that an update could
    run across)."""
    per_seed = [_continue_runs(_draw(args, i), spec, log, judged) for i in range(args.seeds)]
    figures = [_continue_figures(runs) for runs in per_seed]
    runs = per_seed[0]
    unbounded = "; ".join(
        f"{name}: step {runs[f'{name}/continue']['step_s'] / runs[f'{name}/wait']['step_s']:.3f}x "
        f"wait, engine-s {runs[f'{name}/continue']['engine_s_per_informative'] / runs['grpo4/on_policy']['engine_s_per_informative']:.3f}x "
        "GRPO n=4"
        for name in CONTINUE_VARIANTS
    )
    drains = ", ".join(f"{name} {r['drain_s_per_step']:.1f}" for name, r in runs.items())
    full, work, share = (
        [f[k] for f in figures] for k in ("full_engine_step", "work", "rate_share")
    )
    rates = ", ".join(f"{name} {r['decode_tok_s']:,.0f}" for name, r in runs.items())
    section_targets = {}
    for key, (what, goal, sense) in CONTINUE_GOALS.items():
        values = [f[key] for f in figures]
        measured = float(np.mean(values))
        section_targets[f"continue/{key}"] = {
            "measured": measured,
            "per_seed": values,
            "goal": f"{sense} {goal}",
            "met": measured <= goal,
            "reason": f"{what}: {judged} off-policy (max_staleness 1, r 0.7, kv "
            f"{args.continue_kv}, wave_min_need {CONTINUE_KNOBS['wave_min_need']:g}), "
            f"{_longer(args).steps} measured steps; mean of {len(values)} "
            f"prompt draws ({min(values):.3g}-{max(values):.3g}); first draw: {unbounded}; "
            f"drain s/step by run: {drains}",
        }
    whole = [f["step_vs_whole_wait"] for f in figures]
    section_targets["continue/step"].update(
        full_engine_step=full, work=work, rate_share=share, vs_whole_wave_wait=whole
    )
    section_targets["continue/step"]["reason"] += (
        f"; against the faster wait of whole or cut waves {np.mean(whole):.3g}x "
        f"({min(whole):.3g}-{max(whole):.3g}); continue decodes {np.mean(work):.3g}x wait's tokens a step ({min(work):.3g}-"
        f"{max(work):.3g}) at {np.mean(share):.3g} of the rate of an engine always full "
        f"(continue without a bound; {min(share):.3g}-{max(share):.3g}), and wait's tokens "
        f"at that full rate would take {np.mean(full):.3g}x wait's step ({min(full):.3g}-"
        f"{max(full):.3g}); decoded tokens/s by run (first draw): {rates}"
    )
    return {"row": judged, "runs": runs, "seeds": len(per_seed), "targets": section_targets}


#: The judged row's waves in every weight update mode's run: cut where an answer is less
#: likely than this to be needed. Continue keeps the engine full, so the answers a cut
#: wave leaves out are replaced by other prompts' answers, not by idle slots.
CONTINUE_KNOBS: dict[str, Any] = {"wave_min_need": 0.6}

#: Off-policy variants of the weight update modes' runs: without max_staleness
#: ("unbounded") and without paced admission ("unpaced"), what the bound and the pacing
#: cost an answer an update ran across (its group is as old as its oldest version); with
#: the staleness runs' waves of 16 ("wide"); and with whole waves ("whole_waves", the
#: row as the other sections run it).
CONTINUE_VARIANTS: dict[str, dict[str, Any]] = {
    "whole_waves": {"wave_min_need": 0.0},
    "unbounded": {"max_staleness": None},
    "unpaced": {"max_delay_versions": 0},
    "hard16": STALENESS_RUNS["hard16"],
    "wide": STALENESS_RUNS["wide"],
}


def _continue_runs(
    args: argparse.Namespace, spec: EngineSpec, log: Any, judged: str
) -> dict[str, dict[str, Any]]:
    """One prompt draw's runs of `measure_continue`, by `pipeline/mode`."""
    row, grpo4, rates, train_s = _judged_draw(args, spec, judged)
    longer = _longer(args)
    runs: dict[str, dict[str, Any]] = {}
    settings = [(p, m, {}) for p in ("off_policy", "on_policy") for m in CONTINUE_MODES] + [
        (name, m, extra) for name, extra in CONTINUE_VARIANTS.items() for m in ("wait", "continue")
    ]
    for pipeline, mode, extra in settings:
        started = time.monotonic()
        res = run_one(
            row,
            "off_policy" if pipeline in CONTINUE_VARIANTS else pipeline,
            rates,
            longer,
            spec,
            train_s_per_sample=train_s,
            overrides={
                "weight_update_mode": mode,
                "weight_update_kv": args.continue_kv,
                **CONTINUE_KNOBS,
                **extra,
            },
        )
        res.pop("groups", None)
        runs[f"{pipeline}/{mode}"] = res
        log(
            f"  continue seed {args.seed} {pipeline}/{mode}: step {res['step_s']:.1f}s, drain "
            f"{res['drain_s_per_step']:.1f}s/step ({time.monotonic() - started:.1f}s real)"
        )
    base = run_one(grpo4, "on_policy", rates, longer, spec, train_s_per_sample=train_s)
    base.pop("groups", None)
    runs["grpo4/on_policy"] = base
    return runs


def _continue_figures(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """One draw's figures for the `continue/<name>` targets."""
    cont, wait = runs["off_policy/continue"], runs["off_policy/wait"]
    return {
        "step": cont["step_s"] / wait["step_s"],
        # Against the faster wait of the two: with whole waves, wait's engine idles less
        # at the tail of a step.
        "step_vs_whole_wait": cont["step_s"]
        / min(wait["step_s"], runs["whole_waves/wait"]["step_s"]),
        # The step ratio is `work` x wait's rate / continue's: continue's decoded tokens a
        # step over wait's, and its rate as a share of the engine always full (continue
        # without a bound). At wait's tokens and the full rate it would be
        # `full_engine_step`, how far the goal is within reach.
        "work": cont["decode_tok_s"] * cont["step_s"] / (wait["decode_tok_s"] * wait["step_s"]),
        "rate_share": cont["decode_tok_s"] / runs["unbounded/continue"]["decode_tok_s"],
        "full_engine_step": wait["decode_tok_s"] / runs["unbounded/continue"]["decode_tok_s"],
        "engine_s_per_informative": cont["engine_s_per_informative"]
        / runs["grpo4/on_policy"]["engine_s_per_informative"],
        "aborted": cont["aborted_tokens"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="B 256, 3 steps, r 0.7 off-policy")
    p.add_argument("--batch", type=int, default=None, help="groups per step (B)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    p.add_argument("--history-epochs", type=int, default=2)
    p.add_argument("--draws", type=int, default=5, help="prompt draws per self-check")
    p.add_argument("--check-batch", type=int, default=128, help="prompts per self-check draw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="prompt draws of the difficulty table and of the weight update modes' runs "
        "(their targets: the mean and spread)",
    )
    p.add_argument("--no-flat", action="store_true", help="skip the difficulty-free table")
    p.add_argument(
        "--staleness-only",
        action="store_true",
        help="measure only the staleness runs and update their targets in the results",
    )
    p.add_argument(
        "--continue-only",
        action="store_true",
        help="measure only the weight update modes and update their targets in the results",
    )
    p.add_argument(
        "--continue-kv",
        choices=("recompute", "keep"),
        default="recompute",
        help="weight_update_kv of the weight update modes' runs (the service's default: recompute)",
    )
    args = p.parse_args(argv)
    args.batch = args.batch or (256 if args.quick else 512)
    args.steps = args.steps or (3 if args.quick else 6)
    args.prompts = 4 * args.batch
    args.off_policy_r = (0.7,) if args.quick else RATIOS
    started = time.monotonic()
    if args.staleness_only:
        return _staleness_only(args, started)
    if args.continue_only:
        return _continue_only(args, started)

    # One tick per self-check draw and per (row, pipeline) run, on stderr.
    bar = tqdm(
        total=len(CHECKED) * args.draws
        + len(rows()) * len(PIPELINES) * (args.seeds + (0 if args.no_flat else 1)),
        desc="step_time",
        unit="run",
        dynamic_ncols=True,
    )

    def log(msg: str) -> None:
        tqdm.write(msg)

    checks = run_checks(args, ENGINE, bar)
    log("\n== self-checks against closed forms (sync pipeline) ==")
    for c in checks:
        log(
            f"[{'met' if c['met'] else 'MISSED'}] {c['rule']} {c['quantity']}: measured "
            f"{c['measured']:.4f}, closed form {c['expected']:.4f}, z {c['z']:+.2f}"
        )
    tables = {"difficulty": measure(args, ENGINE, log, bar)}
    per_seed = []
    for extra_seed in range(args.seeds):
        seeded = _draw(args, extra_seed)
        table = tables["difficulty"] if extra_seed == 0 else measure(seeded, ENGINE, log, bar)
        if (figures := _exact_ratios(table)) is not None:
            figures["arrival"] = arrival_ratios(seeded, figures["method"], log)
            figures["widths"] = width_ratios(seeded, table, figures["method"])
            figures["floor"] = sequential_floor(seeded, table)
        per_seed.append(figures)
    if not args.no_flat:
        tables["flat"] = measure(args, ENGINE_FLAT, log, bar)
    bar.close()
    for name, tr in tables.items():
        log(
            f"\n== step time, lengths {'by difficulty and correctness' if name == 'difficulty' else 'independent of difficulty'} =="
        )
        log(steps_table(tr))
    judged = {
        f"{name}/{competing}": targets(tr, competing)
        for name, tr in tables.items()
        for competing in COMPETING
    }
    judged.update(exact_targets(per_seed))
    plot_widths(judged, RESULTS / "step_time_widths.png")
    best = best_row(tables["difficulty"])
    if best != STALENESS_ROW:
        log(f"the best adaptive row is now {best}, not {STALENESS_ROW}: judged on {best}")
    staleness = measure_staleness(args, ENGINE, log, best)
    judged.update(staleness["targets"])
    continued = measure_continue(args, ENGINE, log, best)
    judged.update(continued["targets"])
    log(f"\ntargets: {judged}")
    out = {
        "settings": {
            **flags(
                args,
                "batch",
                "steps",
                "warmup",
                "prompts",
                "history_epochs",
                "draws",
                "check_batch",
                "seed",
                "seeds",
                "quick",
            ),
            "ratios": RATIOS,
            "off_policy_r": list(args.off_policy_r),
            "sync_s": SYNC_S,
            "max_tokens": MAX_TOKENS,
            "engine": asdict(ENGINE),
            "engine_flat": asdict(ENGINE_FLAT),
        },
        "checks": checks,
        "tables": tables,
        "targets": judged,
        "staleness": staleness,
        "continue": continued,
    }
    write_json("step_time", out, started=started)
    return out


def _staleness_only(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """`--staleness-only`: the staleness runs."""
    return _section_only("staleness", measure_staleness(args, ENGINE, print), args, started)


def _continue_only(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """`--continue-only`: the weight update modes' runs."""
    return _section_only("continue", measure_continue(args, ENGINE, print), args, started)


def _section_only(
    name: str, section: dict[str, Any], args: argparse.Namespace, started: float
) -> dict[str, Any]:
    """One section measured alone: its targets and section replace those in
    `bench/results/step_time.json`, the rest is kept."""
    for key, target in section["targets"].items():
        print(f"{key}: {target}")
    path = RESULTS / "step_time.json"
    out = json.loads(path.read_text()) if path.exists() else {"targets": {}}
    out["targets"].update(section["targets"])
    out[name] = {**section, "settings": flags(args, "batch", "steps", "warmup", "seed", "seeds")}
    write_json("step_time", out, started=started)
    return out


if __name__ == "__main__":
    main()
