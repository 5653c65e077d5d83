"""What each sampling rule costs and yields, on a simulated engine in simulated time.

The project's real `Scheduler` (with the real stopping rules, down-sampling, advantages
and group policies from `strategies`) drives `bench.sim_backend.SimBackend`, a
continuous-batching engine model, on `bench.virtual_clock.VirtualTimeLoop`, an asyncio
loop whose clock jumps to the next timer whenever nothing is runnable. The scheduler gets
`clock=loop.time`, so every wall time below is engine time, not the time this script
takes. Rewards are Bernoulli draws from per-prompt pass rates, drawn from a difficulty
mix: Reinforce-Ada's hard set (19.7% of prompts in (0, 0.1], 61.7% in (0.1, 0.3], 17.4%
in (0.3, 0.5], 1.3% in (0.5, 1]) or uniform on (0, 1).

For batches of B groups (B = 512) it reports, per batch: answers and tokens generated,
prompts admitted, the fraction of emitted groups whose kept rewards are not all equal
("informative"), answers per informative group, simulated wall time and the wall time
relative to synchronous GRPO n=4. A concurrency sweep and an engine-occupancy timeline
show where round-based sampling loses time.

    .venv/bin/python -m bench.adaptive_sim --quick     # ~1-2 minutes on 2 cores
    .venv/bin/python -m bench.adaptive_sim             # more batches and a wider sweep
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import virtual_clock
from bench.common import DAPO_REFILL, RESULTS, Method, est, flags, grpo, table, write_json
from bench.sim_backend import EngineSpec, SimBackend, sim_scheduler
from sampler_service.config import SamplerConfig, check_consistency
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.finalize import MemorySink
from sampler_service.scheduler import Scheduler
from trainer_client.contract.protocol import Group
from trainer_client.report import save_figure

#: Difficulty mixes: (share of prompts, (low, high] pass-rate interval).
MIXES: dict[str, list[tuple[float, tuple[float, float]]]] = {
    "hard": [(0.197, (0.0, 0.1)), (0.617, (0.1, 0.3)), (0.174, (0.3, 0.5)), (0.013, (0.5, 1.0))],
    "uniform": [(1.0, (0.0, 1.0))],
}


#: Prompts at or below this pass rate are "hardest" (the hard set's first bucket).
HARD_P = 0.1


def methods(batch: int) -> list[Method]:
    """The compared rules, as sampler configs."""
    rounds = {"mode": "rounds", "cohort_size": batch}
    ada = {
        "k_pos": 2,
        "k_neg": 2,
        "n_max": 32,
        "wave_size": 8,
        "group_size": 4,
        "downsample": "balanced",
        "advantage": "global",
        # The rule asked when a whole wave is back, as these figures were measured;
        # bench/step_time.py runs every listed row with exact stopping beside it.
        "stopping": "wave",
    }
    return [
        Method("grpo4", "GRPO n=4 (sync)", {**rounds, **grpo(4)}),
        Method("grpo16", "GRPO n=16 (sync)", {**rounds, **grpo(16)}),
        Method("dapo4", "DAPO filter+refill n=4 (sync)", {**rounds, **grpo(4, **DAPO_REFILL)}),
        Method("dapo16", "DAPO filter+refill n=16 (sync)", {**rounds, **grpo(16, **DAPO_REFILL)}),
        Method("seqpos_rounds", "Seq-Pos rounds 4x8, n=4", {**rounds, **ada, "rule": "positive"}),
        Method(
            "seqbal_rounds", "Seq-Balance rounds 4x8, n=4", {**rounds, **ada, "rule": "balanced"}
        ),
        Method("grpo4_cont", "GRPO n=4 continuous", grpo(4)),
        Method("seqbal_cont", "Seq-Balance continuous", {**ada, "rule": "balanced"}),
        Method(
            "seqbal_adaptive",
            "Seq-Balance continuous, adaptive waves",
            {**ada, "rule": "balanced", "wave": "adaptive"},
        ),
        Method("est", "Est (mean budget 8), continuous", {**est(8), "stopping": "wave"}),
    ]


# -- the simulated task -----------------------------------------------------------------
def draw_pass_rates(mix: str, n: int, rng: np.random.Generator) -> np.ndarray:
    shares = np.array([s for s, _ in MIXES[mix]])
    counts = rng.multinomial(n, shares / shares.sum())
    rates = []
    for count, (_, (lo, hi)) in zip(counts, MIXES[mix], strict=True):
        # (lo, hi]: 1 - U is in (0, 1], so lo is excluded and hi reachable.
        rates.append(lo + (hi - lo) * (1.0 - rng.random(count)))
    out = np.concatenate(rates)
    rng.shuffle(out)
    return out


def write_dataset(directory: Path, n: int) -> Path:
    path = directory / "sim.jsonl"
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"p{i:06d}", "prompt": f"p{i}", "answer": "-"}) + "\n")
    return path


class BatchRecorder(MemorySink):
    """A sink that consumes every frame at once (an always-ready trainer) and records
    per-batch figures at the moment the frame forms."""

    def __init__(self, clock: Any, scheduler_ref: list[Scheduler], engine: SimBackend) -> None:
        super().__init__()
        self._rates = engine.pass_rates
        self._clock = clock
        self._scheduler = scheduler_ref
        self._engine = engine
        self.records: list[dict[str, Any]] = []
        self.done = asyncio.Event()
        self.want = 0

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        self.dropped.extend(dropped)
        if not groups:
            return
        sched = self._scheduler[0]
        informative = sum(1 for g in groups if _informative(g))
        self.records.append(
            {
                "t": self._clock(),
                "cpu": time.process_time(),
                "samples": sched.tally.samples,
                "tokens": sched.tally.tokens,
                "admitted": sum(d.admitted for d in sched.tally.domains.values()),
                "groups": len(groups),
                "informative": informative,
                "hard_informative": sum(
                    1
                    for g in groups
                    if _informative(g) and self._rates[int(g.prompt_id[1:])] <= HARD_P
                ),
                "kept_samples": sum(len(g.samples) for g in groups),
                "n_generated_emitted": sum(g.stats.n_generated for g in groups),
                "stop_n_max": sum(1 for g in groups if g.stop_reason == "n_max"),
                "busy_slot_s": self._engine.stats.busy_slot_s,
                "engine_tokens": self._engine.stats.tokens,
            }
        )
        if len(self.records) >= self.want:
            self.done.set()


def _informative(group: Group) -> bool:
    rewards = [s.reward for s in group.samples]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


def simulated_dataset(dataset_file: Path, n_prompts: int, seed: int) -> Dataset:
    """The simulated prompts with log-normal prompt lengths (median 150 tokens, 16-2048);
    a prompt's first token is its index, which is how the simulated engine finds its
    pass rate."""
    prompt_lens = np.clip(
        np.round(np.exp(np.random.default_rng(seed + 7).normal(math.log(150), 0.4, n_prompts))),
        16,
        2048,
    )

    def tokenize(row: PromptRow) -> None:
        index = int(row.id[1:])
        row.text = row.prompt if isinstance(row.prompt, str) else ""
        row.token_ids = [index] + [0] * (int(prompt_lens[index]) - 1)

    return Dataset([dataset_file], tokenize, seed=seed)


def load_history(scheduler: Scheduler, pass_rates: np.ndarray, epochs: int, seed: int) -> None:
    """Put a run past its first epoch: the estimator has seen every prompt in `epochs`
    earlier epochs, 8 answers each (Est budgets, adaptive first waves and history
    skipping use it).

    Folded in through the estimator's own state format, as update() would leave it:
    n_tot and n_pos decayed by lambda per epoch, and the streak of trailing epochs whose
    8 answers were all correct or all wrong.
    """
    hist = np.random.default_rng(seed + 3)
    lam = scheduler.live.estimator.params.decay
    n_tot = np.zeros(len(pass_rates))
    n_pos = np.zeros(len(pass_rates))
    streaks = np.zeros(len(pass_rates), dtype=np.int64)
    for _ in range(epochs):
        k = hist.binomial(8, pass_rates)
        n_tot = lam * n_tot + 8
        n_pos = lam * n_pos + k
        streaks = np.where((k == 0) | (k == 8), streaks + 1, 0)
    scheduler.live.estimator.load_state_dict(
        {
            "c": 0.0,
            "finalized": 0,
            "stats": {
                f"p{i:06d}": [float(t), float(k)]
                for i, (t, k) in enumerate(zip(n_tot, n_pos, strict=True))
            },
            "streaks": {f"p{i:06d}": int(s) for i, s in enumerate(streaks) if s},
        }
    )
    scheduler.live.estimator.recalibrate()


async def simulate(
    method: Method,
    pass_rates: np.ndarray,
    dataset_file: Path,
    *,
    batch: int,
    batches: int,
    warmup: int,
    spec: EngineSpec,
    seed: int,
    history_epochs: int,
    record_timeline: bool = False,
) -> dict[str, Any]:
    """Run one method until warmup + batches frames of `batch` groups have formed."""
    loop = asyncio.get_running_loop()
    dataset = simulated_dataset(dataset_file, len(pass_rates), seed)
    cfg = SamplerConfig(
        **{
            "batch_groups": batch,
            "max_active_prompts": batch,
            "max_buffered_groups": 8 * batch,
            "max_tokens": 4096,
            "max_staleness": None,  # frames are consumed as they form: nothing to bound
            **method.config,
        }
    )
    check_consistency(cfg, dataset.domains)
    engine = SimBackend(pass_rates, spec, seed=seed + 1, record_timeline=record_timeline)
    await engine.start()
    holder: list[Scheduler] = []
    sink = BatchRecorder(loop.time, holder, engine)
    sink.want = warmup + batches
    scheduler = sim_scheduler(engine, dataset, sink, cfg, seed)
    holder.append(scheduler)
    if history_epochs:
        load_history(scheduler, pass_rates, history_epochs, seed)
    cpu0, t0 = time.process_time(), loop.time()
    scheduler.start()
    try:
        async with asyncio.timeout(1e7):  # simulated seconds: a stuck simulation fails loudly
            await sink.done.wait()
    finally:
        await scheduler.stop()
        await engine.close()
    recs = sink.records
    start = (
        recs[warmup - 1]
        if warmup
        else {
            "t": t0,
            "cpu": cpu0,
            "samples": 0,
            "tokens": 0,
            "admitted": 0,
            "busy_slot_s": 0.0,
            "engine_tokens": 0,
        }
    )
    measured = recs[warmup : warmup + batches]
    end = measured[-1]
    k = len(measured)
    times = np.diff([start["t"]] + [r["t"] for r in measured])
    groups = sum(r["groups"] for r in measured)
    informative = sum(r["informative"] for r in measured)
    answers = (end["samples"] - start["samples"]) / k
    wall = (end["t"] - start["t"]) / k
    out = {
        "method": method.key,
        "label": method.label,
        "config": method.config,
        "batches": k,
        "groups_per_batch": groups / k,
        "answers": answers,
        "tokens": (end["tokens"] - start["tokens"]) / k,
        "prompts_admitted": (end["admitted"] - start["admitted"]) / k,
        "informative_frac": informative / groups,
        "answers_per_informative": answers * k / max(informative, 1),
        "hard_informative": sum(r["hard_informative"] for r in measured) / k,
        "kept_per_group": sum(r["kept_samples"] for r in measured) / groups,
        "generated_per_emitted_group": sum(r["n_generated_emitted"] for r in measured) / groups,
        "n_max_frac": sum(r["stop_n_max"] for r in measured) / groups,
        "wall_s": wall,
        "wall_s_sd": float(np.std(times, ddof=1)) if k > 1 else 0.0,
        "engine_occupancy": (end["busy_slot_s"] - start["busy_slot_s"])
        / (spec.max_num_seqs * wall * k),
        "engine_tokens_per_s": (end["engine_tokens"] - start["engine_tokens"]) / (wall * k),
        "sim_cpu_s_per_batch": (end["cpu"] - start["cpu"]) / k,
        "dropped": dict(scheduler.tally.dropped),
    }
    if record_timeline:
        horizon = recs[min(len(recs), 3) - 1]["t"]
        out["timeline"] = [(t, r, q) for t, r, q in engine.stats.timeline if t <= horizon]
        out["frame_times"] = [r["t"] for r in recs[:3]]
        out["rounds"] = round_breakdown(
            engine.stats.timeline, [r["t"] for r in recs], spec.max_num_seqs, start["t"], end["t"]
        )
    return out


def round_breakdown(
    timeline: list[tuple[float, int, int]],
    frame_times: list[float],
    slots: int,
    t_start: float,
    t_end: float,
) -> list[dict[str, Any]]:
    """Split an engine timeline into busy periods (the engine's rounds in rounds mode).

    A period starts when a sequence starts on an empty engine and ends when the engine is
    empty again; its index counts periods since the last batch frame formed. For each:
    duration, mean occupancy (running / slots) and the time spent below full occupancy.
    """
    periods: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    prev_t, prev_r = None, 0
    for t, running, queued in timeline:
        if current is not None and prev_t is not None:
            dt = t - prev_t
            current["slot_s"] += prev_r * dt
            if prev_r < slots:
                current["below_full_s"] += dt
        if current is None and running > 0:
            current = {"start": t, "slot_s": 0.0, "below_full_s": 0.0}
        elif current is not None and running == 0 and queued == 0:
            current["end"] = t
            periods.append(current)
            current = None
        prev_t, prev_r = t, running
    out = []
    for p in periods:
        if p["start"] < t_start or p["end"] > t_end:
            continue
        last_frame = max((f for f in frame_times if f <= p["start"] + 1e-9), default=0.0)
        index = sum(1 for q in periods if last_frame - 1e-9 <= q["start"] <= p["start"])
        duration = p["end"] - p["start"]
        out.append(
            {
                "round": index,
                "duration_s": duration,
                "occupancy": p["slot_s"] / (slots * duration),
                "below_full_s": p["below_full_s"],
            }
        )
    return out


def summarize_rounds(
    rounds: list[dict[str, Any]], wall: float, batches: int
) -> list[dict[str, Any]]:
    rows = []
    for k in sorted({r["round"] for r in rounds}):
        rs = [r for r in rounds if r["round"] == k]
        rows.append(
            {
                "round": k,
                "count": len(rs),
                "duration_s": float(np.mean([r["duration_s"] for r in rs])),
                "occupancy": float(np.mean([r["occupancy"] for r in rs])),
                "below_full_s": float(np.mean([r["below_full_s"] for r in rs])),
                "share_of_batch": sum(r["duration_s"] for r in rs) / (wall * batches),
            }
        )
    return rows


def run_one(
    method: Method, mix: str, args: argparse.Namespace, spec: EngineSpec, *, timeline: bool = False
) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    rates = draw_pass_rates(mix, args.prompts, rng)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_dataset(Path(tmp), args.prompts)
        result = virtual_clock.run(
            simulate(
                method,
                rates,
                data,
                batch=args.batch,
                batches=args.batches,
                warmup=args.warmup,
                spec=spec,
                seed=args.seed,
                history_epochs=args.history_epochs,
                record_timeline=timeline,
            )
        )
    result["mix"] = mix
    return result


COLUMNS = [
    ("label", "method"),
    ("answers", "answers/batch"),
    ("tokens", "tokens/batch"),
    ("prompts_admitted", "prompts/batch"),
    ("informative_frac", "informative frac"),
    ("answers_per_informative", "answers/informative group"),
    ("hard_informative", "informative groups with p<=0.1"),
    ("n_max_frac", "n_max frac"),
    ("wall_s", "wall s/batch"),
    ("rel_wall", "wall vs GRPO n=4"),
    ("engine_occupancy", "engine occupancy"),
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="fewer batches and a smaller sweep (~1-2 min)"
    )
    p.add_argument("--batch", type=int, default=512, help="groups per batch (B)")
    p.add_argument("--batches", type=int, default=None, help="measured batches per method")
    p.add_argument("--warmup", type=int, default=1, help="batches run before measuring")
    p.add_argument("--prompts", type=int, default=2048, help="prompts in the simulated dataset")
    p.add_argument(
        "--history-epochs",
        type=int,
        default=2,
        help="earlier epochs the pass-rate estimator has seen (0: a cold first epoch)",
    )
    p.add_argument(
        "--mix", action="append", choices=sorted(MIXES), help="difficulty mixes (default: all)"
    )
    p.add_argument("--method", action="append", help="method keys (default: all)")
    p.add_argument("--max-num-seqs", type=int, default=EngineSpec.max_num_seqs)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--replot",
        action="store_true",
        help="redraw adaptive_sim.png from the saved JSON (re-simulating only the timelines)",
    )
    args = p.parse_args(argv)
    if args.replot:
        return replot()
    args.batches = args.batches or (3 if args.quick else 8)
    spec = replace(EngineSpec(), max_num_seqs=args.max_num_seqs)
    chosen = [m for m in methods(args.batch) if not args.method or m.key in args.method]
    mixes = args.mix or list(MIXES)
    started = time.monotonic()

    results: dict[str, list[dict[str, Any]]] = {}
    for mix in mixes:
        rows = []
        for m in chosen:
            t = time.monotonic()
            timeline = mix == "hard" and m.key in ("seqbal_rounds", "seqbal_cont")
            rows.append(run_one(m, mix, args, spec, timeline=timeline))
            print(f"  [{mix}] {m.label}: {time.monotonic() - t:.1f}s real", flush=True)
        base = next((r for r in rows if r["method"] == "grpo4"), None)
        for r in rows:
            r["rel_wall"] = r["wall_s"] / base["wall_s"] if base else None
            r["rel_answers"] = r["answers"] / base["answers"] if base else None
        results[mix] = rows
        print(
            f"\n== mix {mix}: B={args.batch}, engine {spec.max_num_seqs} seqs, "
            f"{args.batches} measured batches per method =="
        )
        print(table(rows, COLUMNS))

    breakdown = []
    for rows in results.values():
        for r in rows:
            if r["method"] == "seqbal_rounds" and "rounds" in r:
                breakdown = summarize_rounds(r.pop("rounds"), r["wall_s"], r["batches"])
            r.pop("rounds", None)
    if breakdown:
        print("\n== why rounds lose time: Seq-Balance rounds, hard mix, per round of a batch ==")
        print(
            table(
                breakdown,
                [
                    ("round", "round"),
                    ("duration_s", "mean s"),
                    ("share_of_batch", "share of batch time"),
                    ("occupancy", "mean occupancy"),
                    ("below_full_s", "s below full occupancy"),
                ],
            )
        )

    # Sweep: rounds vs continuous Seq-Balance (same rule, same batch) as the engine's
    # concurrency and the spread of answer lengths change.
    variants = [
        (seqs, spec.length_sigma)
        for seqs in ([64, 256, 1024] if args.quick else [64, 128, 256, 512, 1024, 2048])
    ]
    variants += [(seqs, 1.0) for seqs in ([256, 1024] if args.quick else [64, 256, 1024])]
    by_key = {m.key: m for m in methods(args.batch)}
    sweep = []
    for seqs, sigma in [] if args.method else variants:
        s = replace(spec, max_num_seqs=seqs, length_sigma=sigma)
        row: dict[str, Any] = {"max_num_seqs": seqs, "length_sigma": sigma}
        keys = (
            ("seqbal_rounds", "seqbal_cont")
            if args.quick
            else ("seqbal_rounds", "seqbal_cont", "seqbal_adaptive")
        )
        for key in keys:
            r = run_one(by_key[key], "hard", args, s)
            row[key] = r["wall_s"]
            row[key + "_occupancy"] = r["engine_occupancy"]
            row[key + "_answers"] = r["answers"]
        row["cont_vs_rounds"] = row["seqbal_cont"] / row["seqbal_rounds"]
        if "seqbal_adaptive" in row:
            row["adaptive_vs_rounds"] = row["seqbal_adaptive"] / row["seqbal_rounds"]
        sweep.append(row)
        print(
            f"  [sweep] max_num_seqs={seqs} sigma={sigma}: cont/rounds {row['cont_vs_rounds']:.2f}",
            flush=True,
        )
    if sweep:
        print(
            "\n== Seq-Balance, hard mix: continuous vs rounds by engine concurrency and length spread =="
        )
        print(
            table(
                sweep,
                [
                    ("max_num_seqs", "max_num_seqs"),
                    ("length_sigma", "length log-sd"),
                    ("seqbal_rounds", "rounds s"),
                    ("seqbal_cont", "continuous s"),
                    ("seqbal_adaptive", "adaptive s"),
                    ("cont_vs_rounds", "cont/rounds"),
                    ("adaptive_vs_rounds", "adaptive/rounds"),
                    ("seqbal_rounds_occupancy", "rounds occupancy"),
                    ("seqbal_cont_occupancy", "cont occupancy"),
                ],
            )
        )

    checks = _checks(results, sweep, spec)
    print("\n== checks ==")
    for c in checks:
        print(f"[{'met' if c['met'] else 'MISSED'}] {c['target']}: {c['measured']}")

    timelines = {
        r["method"]: r.pop("timeline") for rows in results.values() for r in rows if "timeline" in r
    }
    frame_times = {
        r["method"]: r.pop("frame_times")
        for rows in results.values()
        for r in rows
        if "frame_times" in r
    }
    out = {
        "settings": {
            **flags(
                args, "batch", "batches", "warmup", "prompts", "history_epochs", "seed", "quick"
            ),
            "engine": asdict(spec),
            "max_tokens": 4096,
            "mixes": {k: MIXES[k] for k in mixes},
        },
        "results": results,
        "sweep": sweep,
        "rounds_breakdown": breakdown,
        "checks": checks,
    }
    write_json("adaptive_sim", out, started=started)
    if not args.no_plot:
        png = _plot(results, sweep, timelines, frame_times, spec)
        print(f"wrote {png}")
    return out


def replot() -> dict[str, Any]:
    """Redraw the PNG from bench/results/adaptive_sim.json; the occupancy timelines are not
    saved (too large), so the two Seq-Balance hard-mix runs are simulated again for them."""
    saved = json.loads((RESULTS / "adaptive_sim.json").read_text())
    st = saved["settings"]
    spec = EngineSpec(**st["engine"])
    args = argparse.Namespace(
        seed=st["seed"],
        prompts=st["prompts"],
        batch=st["batch"],
        batches=2,
        warmup=st["warmup"],
        history_epochs=st["history_epochs"],
    )
    by_key = {m.key: m for m in methods(st["batch"])}
    timelines, frame_times = {}, {}
    for key in ("seqbal_rounds", "seqbal_cont"):
        r = run_one(by_key[key], "hard", args, spec, timeline=True)
        timelines[key], frame_times[key] = r["timeline"], r["frame_times"]
    png = _plot(saved["results"], saved["sweep"], timelines, frame_times, spec)
    print(f"wrote {png}")
    return saved


def _checks(
    results: dict[str, list[dict[str, Any]]], sweep: list[dict[str, Any]], spec: EngineSpec
) -> list[dict[str, Any]]:
    checks = []
    for mix, rows in results.items():
        r = {x["method"]: x for x in rows}
        if "seqbal_rounds" in r and "seqbal_cont" in r:
            ratio = r["seqbal_cont"]["wall_s"] / r["seqbal_rounds"]["wall_s"]
            checks.append(
                {
                    "mix": mix,
                    "target": f"[{mix}] continuous Seq-Balance wall <= 0.7x rounds "
                    f"(engine {spec.max_num_seqs} seqs)",
                    "measured": f"{ratio:.2f}x",
                    "value": ratio,
                    "met": ratio <= 0.7,
                }
            )
        if "seqbal_cont" in r and "seqbal_adaptive" in r:
            a, b = (
                r["seqbal_adaptive"]["answers_per_informative"],
                r["seqbal_cont"]["answers_per_informative"],
            )
            checks.append(
                {
                    "mix": mix,
                    "target": f"[{mix}] adaptive waves cut answers per informative group",
                    "measured": f"{b:.2f} -> {a:.2f}",
                    "value": a / b,
                    "met": a < b,
                }
            )
    return checks


def _plot(
    results: dict[str, list[dict[str, Any]]],
    sweep: list[dict[str, Any]],
    timelines: dict[str, list[tuple[float, int, int]]],
    frame_times: dict[str, list[float]],
    spec: EngineSpec,
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    mixes = list(results)
    labels = [r["label"] for r in results[mixes[0]]]
    y = np.arange(len(labels))
    h = 0.8 / len(mixes)
    for i, mix in enumerate(mixes):
        rel = [r["rel_wall"] or 0 for r in results[mix]]
        api = [r["answers_per_informative"] for r in results[mix]]
        axes[0, 0].barh(y + i * h, rel, h, label=mix)
        axes[0, 1].barh(y + i * h, api, h, label=mix)
    for ax, title in (
        (axes[0, 0], "wall time per batch of 512 groups, relative to GRPO n=4 (sync)"),
        (axes[0, 1], "answers generated per informative group"),
    ):
        ax.set_yticks(y + h * (len(mixes) - 1) / 2, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.legend(title="difficulty mix")
        ax.grid(axis="x", alpha=0.3)
    ax = axes[1, 0]
    ax.axhline(spec.max_num_seqs, color="0.6", ls="--", lw=0.8, label="max_num_seqs")
    for key, color, lw in (("seqbal_cont", "tab:blue", 2.5), ("seqbal_rounds", "tab:red", 0.8)):
        if key not in timelines:
            continue
        tl = np.array(timelines[key], dtype=float)
        ax.step(
            tl[:, 0], tl[:, 1], where="post", color=color, lw=lw, label=f"{key}: running sequences"
        )
        for t in frame_times.get(key, []):
            ax.axvline(t, color=color, ls=":", lw=1)
    ax.set_xlabel("simulated seconds (dotted: a batch of 512 groups is complete)")
    ax.set_ylabel("sequences decoding")
    ax.set_title(
        "engine occupancy, hard mix: synchronous rounds idle the engine at every round's tail",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    for sigma in sorted({s["length_sigma"] for s in sweep}):
        rows = [s for s in sweep if s["length_sigma"] == sigma]
        seqs = [s["max_num_seqs"] for s in rows]
        ax.plot(
            seqs,
            [s["cont_vs_rounds"] for s in rows],
            "o-",
            label=f"continuous / rounds, length log-sd {sigma}",
        )
        if all("adaptive_vs_rounds" in s for s in rows):
            ax.plot(
                seqs,
                [s["adaptive_vs_rounds"] for s in rows],
                "s--",
                label=f"continuous adaptive / rounds, length log-sd {sigma}",
            )
    ax.axhline(0.7, color="k", ls="--", lw=0.8, label="target 0.7")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("engine concurrency (max_num_seqs)")
    ax.set_ylabel("wall time per batch, relative to Seq-Balance rounds")
    ax.set_title(
        "Seq-Balance (hard mix): what the round barrier costs vs engine concurrency", fontsize=10
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = RESULTS / "adaptive_sim.png"
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
