"""Multi-turn episodes: what a turn costs the sampler, and what a long tail of episode
lengths costs a batch, side by side with single answers and a fixed n per prompt.

Toy (`toy`): the real transformers engine on the toy model, an in-process `Scheduler`
with its `EpisodeRunner` and a memory sink, rule `fixed` (n = 4, one wave of 4, the same
max_tokens per answer and per turn). Single-answer runs and 2-turn-episode runs alternate
on one engine (drift of a shared machine hits both). The environment (`two_turns`) is
trivial: one observation token after the first turn, done after the second, so the
cost measured is the sampler's. Figures: episodes/s vs answers/s, model turns/s vs
answers/s, and the event loop thread's CPU (`time.thread_time()` read on the loop
thread at the start and end of the measured window: the model runs on its own thread,
environments on theirs, so this is the sampler's own work) per turn and per episode vs
per single answer. The environment threads' CPU (read by the environment at reset and
close) is reported apart.

Simulation (`sim`): the real `Scheduler` and `EpisodeRunner` drive the simulated engine
(`bench.sim_backend`) on the simulated-time loop (`bench.virtual_clock`). Episodes have
a heavy-tailed number of model turns (`TailEnv`: Pareto, P(turns >= t) = t^-1.5, at most
`MAX_TURNS`); every turn is a generate call, then a 40-token observation; the terminal
reward is the last turn's Bernoulli(p) draw, p the prompt's pass rate (hard mix). The
environment's calls run on the runner's real environment threads and answer at once;
while any episode is inside an environment call the simulated clock does not jump (the
loop waits for the thread in real time), and the run checks that the environment calls
took 0 simulated seconds in all. Compared: a fixed n = 4 per prompt in rounds (a batch of B prompts waits
for its slowest episode), the same fixed n = 4 in continuous mode, and Seq-Balance
K_pos = K_neg = 2 (waves of 8 up to 32, groups of 4) in continuous mode; the continuous
rows are one step off-policy (max_staleness 1, 2B prompts active), the trainer acks each
frame at once. Figures per batch of B groups: fill time (frame to frame), episodes and
turns generated, informative groups, and the time from a batch's start to the k-th group
reaching the sink (plot; in rounds a group reaches it when its round's frame forms).

    python -m bench.episodes --quick    # toy 2 pairs; sim B = 64, 3 measured batches
    python -m bench.episodes            # toy 3 pairs; sim B = 64, 6 measured batches
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import adaptive_sim, step_time, virtual_clock
from bench.common import RESULTS, table, write_json
from bench.sim_backend import REWARD_TEXT, EngineSpec, SimBackend, sim_scheduler
from sampler_service.backends.base import Completion
from sampler_service.config import SamplerConfig, check_consistency
from sampler_service.dataset import Dataset, PromptRow
from sampler_service.environments.base import Reset, Step
from sampler_service.episodes import (
    EnvThread,
    EpisodeRenderer,
    EpisodeRunner,
    load_factories,
)
from sampler_service.finalize import MemorySink
from sampler_service.scheduler import Scheduler
from sampler_service.verifiers.base import Verdict
from trainer_client.contract.protocol import Group
from trainer_client.report import save_figure

# -- environments -----------------------------------------------------------------------
#: CPU seconds of every finished environment thread (reset to close), this process.
ENV_THREAD_CPU: list[float] = []


class TwoTurns:
    """The toy's trivial environment: after the first turn one observation token ("="),
    done after the second; the row's verifier scores the last turn."""

    def __init__(self) -> None:
        self.turn = 0
        self.cpu_at_reset = 0.0

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        self.cpu_at_reset = time.thread_time()
        return Reset()

    async def step(self, action: str) -> Step:
        self.turn += 1
        if self.turn >= 2:
            return Step(observation=None, done=True)
        return Step(observation="=", done=False)

    async def close(self) -> None:
        ENV_THREAD_CPU.append(time.thread_time() - self.cpu_at_reset)


def two_turns() -> TwoTurns:
    return TwoTurns()


MAX_TURNS = 32
PARETO_ALPHA = 1.5
OBS_TOKENS = 40
_tail_rng = np.random.default_rng(0)
_tail_lock = threading.Lock()


def seed_tail(seed: int) -> None:
    """Restart the turn-count draws (each simulated run draws its own)."""
    global _tail_rng
    with _tail_lock:
        _tail_rng = np.random.default_rng(seed)


def draw_turns(rng: np.random.Generator) -> int:
    """Pareto with x_m = 1: P(turns >= t) = t^-alpha, at most MAX_TURNS."""
    return min(MAX_TURNS, int((1.0 - rng.random()) ** (-1.0 / PARETO_ALPHA)))


class TailEnv:
    """A simulated tool environment: ends after a heavy-tailed number of model turns
    (`draw_turns`), answers every other turn with `OBS_TOKENS` tokens, and rewards the
    last turn as the simulated engine drew it. Every call is instant."""

    def __init__(self) -> None:
        self.turns = 1
        self.turn = 0

    async def reset(self, row: Mapping[str, Any], *, seed: int | None) -> Reset:
        with _tail_lock:
            self.turns = draw_turns(_tail_rng)
        return Reset()

    async def step(self, action: str) -> Step:
        self.turn += 1
        if self.turn >= self.turns:
            return Step(observation=None, done=True, reward=float(action == REWARD_TEXT[True]))
        return Step(observation=[2] * OBS_TOKENS, done=False)

    async def close(self) -> None:
        return None


def tail() -> TailEnv:
    return TailEnv()


TOY_ENV = "python:bench.episodes:two_turns"
SIM_ENV = "python:bench.episodes:tail"


# -- toy: the sampler's cost per turn ---------------------------------------------------
#: Groups measured per toy run (after 8 of warm-up).
TOY_GROUPS = 200
TOY_CONFIG = {
    "rule": "fixed",
    "n_max": 4,
    "wave_size": 4,
    "group_size": 4,
    "max_tokens": 8,
    "max_active_prompts": 16,
    "max_staleness": None,
    "episode": {"max_turns": 2, "max_tokens_per_turn": 8},
}


def _write_rows(source: Path, out: Path, env: str | None) -> Path:
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    with out.open("w") as fh:
        for row in rows:
            fh.write(json.dumps({**row, "env": env} if env else row) + "\n")
    return out


async def toy_run(
    engine: Any, tokenizer: Any, data: Path, *, warmup: int, groups: int
) -> dict[str, Any]:
    """One run of the toy sampler: `warmup` groups, then `groups` measured ones."""
    from sampler_service.verifiers import exact

    def tokenize(row: PromptRow) -> None:
        row.text, row.token_ids = row.prompt, tokenizer(row.prompt)["input_ids"]

    async def verify(row: PromptRow, completions: Sequence[Completion]) -> list[Verdict]:
        return [
            Verdict(exact.verify(c.verified_text, row.answer, row.metadata)) for c in completions
        ]

    dataset = Dataset([data], tokenize)
    config = SamplerConfig(**TOY_CONFIG)
    check_consistency(config, dataset.domains)
    sink = MemorySink()
    scheduler = Scheduler(backend=engine, dataset=dataset, verify=verify, sink=sink, config=config)
    scheduler.episodes = EpisodeRunner(
        tokenizer,
        EpisodeRenderer(tokenizer),
        load_factories(dataset.env_specs()),
        max_context=64,
    )

    def snapshot() -> dict[str, Any]:
        st = scheduler.tally
        return {
            "t": time.perf_counter(),
            "loop_cpu": time.thread_time(),
            "answers": st.samples,
            "tokens": st.tokens,
            "turns": sum(k * v for k, v in st.episodes.turns.items()),
            "episodes": st.episodes.episodes,
            "env_cpu": sum(ENV_THREAD_CPU),
        }

    async def reach(n: int) -> None:
        while len(sink.groups()) < n:
            await asyncio.sleep(0.005)

    scheduler.start()
    try:
        async with asyncio.timeout(600):
            await reach(warmup)
            start = snapshot()
            await reach(warmup + groups)
            end = snapshot()
    finally:
        await scheduler.stop()
    delta = {k: end[k] - start[k] for k in start}
    samples = [s for g in sink.groups() for s in g.samples]
    return {
        **delta,
        "wall_s": delta.pop("t"),
        "masked_samples": sum(1 for s in samples if s.loss_mask and 0 in s.loss_mask),
        "samples": len(samples),
    }


def measure_toy(model_dir: Path, data_file: Path, *, pairs: int, warmup: int, groups: int) -> dict:
    """Single-answer and episode runs alternating on one engine."""
    import torch
    from transformers import AutoTokenizer

    from sampler_service.backends.hf import HFBackend

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    async def main(work: Path) -> dict[str, list[dict[str, Any]]]:
        single = _write_rows(data_file, work / "single.jsonl", None)
        episodes = _write_rows(data_file, work / "episodes.jsonl", TOY_ENV)
        engine = HFBackend(model_dir, tokenizer=tokenizer)
        await engine.start()
        runs: dict[str, list[dict[str, Any]]] = {"single": [], "episodes": []}
        try:
            for _ in range(pairs):
                for kind, data in (("single", single), ("episodes", episodes)):
                    runs[kind].append(
                        await toy_run(engine, tokenizer, data, warmup=warmup, groups=groups)
                    )
        finally:
            await engine.close()
        return runs

    with tempfile.TemporaryDirectory() as tmp:
        runs = asyncio.run(main(Path(tmp)))
    return {"runs": runs, **summarize_toy(runs)}


def summarize_toy(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    def total(kind: str, key: str) -> float:
        return float(sum(r[key] for r in runs[kind]))

    single_rate = total("single", "answers") / total("single", "wall_s")
    episode_rate = total("episodes", "answers") / total("episodes", "wall_s")
    turn_rate = total("episodes", "turns") / total("episodes", "wall_s")
    cpu_answer = total("single", "loop_cpu") / total("single", "answers")
    cpu_turn = total("episodes", "loop_cpu") / total("episodes", "turns")
    cpu_episode = total("episodes", "loop_cpu") / total("episodes", "answers")
    return {
        "answers_per_s": single_rate,
        "episodes_per_s": episode_rate,
        "turns_per_s": turn_rate,
        "episode_rate_ratio": episode_rate / single_rate,
        "turn_rate_ratio": turn_rate / single_rate,
        # Both counted when an episode ends (answers are counted when their wave is
        # verified, so a window's answers and turns may be a wave apart).
        "turns_per_episode": total("episodes", "turns") / total("episodes", "episodes"),
        "tokens_per_answer": total("single", "tokens") / total("single", "answers"),
        "tokens_per_episode": total("episodes", "tokens") / total("episodes", "answers"),
        "loop_cpu_ms_per_answer": 1e3 * cpu_answer,
        "loop_cpu_ms_per_turn": 1e3 * cpu_turn,
        "loop_cpu_ms_per_episode": 1e3 * cpu_episode,
        "cpu_turn_ratio": cpu_turn / cpu_answer,
        "cpu_episode_ratio": cpu_episode / cpu_answer,
        "env_cpu_ms_per_episode": 1e3 * total("episodes", "env_cpu") / total("episodes", "answers"),
    }


# -- simulation: filling a batch under a long tail --------------------------------------
#: The simulated engine's defaults (a ~1.5B model on one GPU) with shorter answers (a
#: turn's), and the KV cache's cost per token held.
ENGINE = EngineSpec(length_median=300.0, kv_token_s=8.5e-9)
EPISODE_KNOBS = {
    "max_turns": MAX_TURNS,
    "max_total_tokens": 65_536,
    "max_tokens_per_turn": 2048,
    "env_timeout_s": 86_400.0,  # simulated seconds: a turn never times out
}
SIM_ROWS = (
    ("fixed4_rounds", "fixed n=4, rounds", "grpo4", "sync"),
    ("fixed4_continuous", "fixed n=4, continuous", "grpo4", "off_policy"),
    ("seqbal_continuous", "Seq-Balance 2/2, continuous", "seqbal", "off_policy"),
)


class BatchTrainer(step_time.Trainer):
    """step_time's trainer with an instant trainer phase, remembering when each group
    finished (its first appearance, pending or in a frame)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(train_s_per_sample=0.0, **kw)
        self.finished: dict[str, float] = {}

    def _seen(self, group: Group) -> None:
        self.finished.setdefault(group.group_id, asyncio.get_running_loop().time())

    async def add_pending(self, group: Group, state: dict[str, Any] | None) -> None:
        self._seen(group)

    async def add_frame(
        self, groups: list[Group], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        for group in groups:
            self._seen(group)
        await super().add_frame(groups, dropped, state)


class _SimTokenizer:
    """The simulated engine's tokens have no text."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


def sim_config(key: str, pipeline: str, batch: int) -> dict[str, Any]:
    row = next(r for r in step_time.rows() if r.key == key)
    return {**step_time.pipeline_config(row, pipeline, batch), "episode": EPISODE_KNOBS}


async def sim_run(
    config: dict[str, Any],
    rates: np.ndarray,
    dataset: Dataset,
    *,
    steps: int,
    warmup: int,
    seed: int,
) -> dict[str, Any]:
    """warmup + steps batches of one method; figures per measured batch."""
    seed_tail(seed)
    cfg = SamplerConfig(**config)
    check_consistency(cfg, dataset.domains)
    engine = SimBackend(rates, ENGINE, seed=seed + 1)
    await engine.start()
    trainer = BatchTrainer(steps=warmup + steps, pass_rates=rates)
    loop = asyncio.get_running_loop()
    scheduler = sim_scheduler(engine, dataset, trainer, cfg, seed)
    tokenizer = _SimTokenizer()
    scheduler.episodes = EpisodeRunner(
        tokenizer, EpisodeRenderer(tokenizer), load_factories({SIM_ENV}), clock=loop.time
    )
    trainer.scheduler, trainer.engine = scheduler, engine
    scheduler.start()
    try:
        async with asyncio.timeout(1e7):
            await trainer.run()
    finally:
        await scheduler.stop()
        await engine.close()
    summary = step_time.summarize(trainer.records, warmup, trainer.groups)
    episodes = scheduler.tally.episodes
    # time to the k-th finished group of each measured batch, from the batch's start
    starts = [r["t"] for r in trainer.records[warmup:-1]]
    ends = [r["t_frame"] for r in trainer.records[warmup + 1 :]]
    finished = sorted(trainer.finished.values())
    per_batch = [[t - a for t in finished if a < t <= b] for a, b in zip(starts, ends, strict=True)]
    return {
        "batch_fill_s": summary["gen_s"],
        "episodes_per_batch": summary["answers"],
        "informative_per_batch": summary["informative_frac"] * cfg.batch_groups,
        "informative_frac": summary["informative_frac"],
        "turns_per_episode": episodes.to_dict()["turns_per_episode"],
        "max_turns_seen": max(episodes.turns),
        "env_errors": episodes.env_errors,
        "env_sim_s": episodes.env_seconds,
        "dropped": dict(scheduler.tally.dropped),
        "group_times": per_batch,
    }


def measure_sim(batch: int, steps: int, warmup: int, seed: int) -> dict[str, Any]:
    rates = adaptive_sim.draw_pass_rates("hard", 16 * batch, np.random.default_rng(seed))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = adaptive_sim.write_dataset(Path(tmp), len(rates))
        for key, label, row, pipeline in SIM_ROWS:
            _rows_with_env(data)
            dataset = adaptive_sim.simulated_dataset(data, len(rates), seed)
            began = time.perf_counter()
            result = virtual_clock.run(
                sim_run(
                    sim_config(row, pipeline, batch),
                    rates,
                    dataset,
                    steps=steps,
                    warmup=warmup,
                    seed=seed,
                ),
                hold=in_environment_call,
            )
            out[key] = {"label": label, "real_s": time.perf_counter() - began, **result}
    base = out["fixed4_rounds"]["batch_fill_s"]
    for result in out.values():
        result["fill_ratio"] = result["batch_fill_s"] / base
    return out


def in_environment_call() -> bool:
    """Whether an episode waits on its environment thread: some task of the running loop
    is inside `EnvThread.call`, whose `wait_for` awaits a future that is not done yet
    (the thread has not answered, or its answer is still on the way to this loop), so
    the virtual clock must not jump over that call."""
    for task in asyncio.all_tasks():
        coro: Any = task.get_coro()
        in_call = False
        while getattr(coro, "cr_code", None) is not None:
            in_call = in_call or coro.cr_code is _ENV_CALL
            if in_call and coro.cr_code is _WAIT_FOR:
                awaited = coro.cr_frame.f_locals.get("fut")
                if awaited is not None and not awaited.done():
                    return True
            coro = coro.cr_await
    return False


_ENV_CALL = EnvThread.call.__code__
_WAIT_FOR = asyncio.wait_for.__code__


def _rows_with_env(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "env": SIM_ENV}) + "\n" for r in rows))


SIM_COLUMNS = [
    ("label", "method"),
    ("fill_ratio", "batch fill time / fixed rounds"),
    ("batch_fill_s", "batch fill (sim s)"),
    ("episodes_per_batch", "episodes per batch"),
    ("informative_per_batch", "informative groups per batch"),
    ("s_per_informative", "sim s per informative group"),
    ("turns_per_episode", "turns per episode"),
    ("env_sim_s", "env sim s (0 = exact)"),
]
TOY_COLUMNS = [
    ("episodes_per_s", "2-turn episodes/s"),
    ("answers_per_s", "single answers/s"),
    ("episode_rate_ratio", "episodes/s / answers/s"),
    ("turn_rate_ratio", "turns/s / answers/s"),
    ("loop_cpu_ms_per_answer", "loop CPU ms / answer"),
    ("loop_cpu_ms_per_turn", "loop CPU ms / turn"),
    ("cpu_turn_ratio", "per turn / per answer"),
    ("cpu_episode_ratio", "per episode / per answer"),
    ("env_cpu_ms_per_episode", "env thread CPU ms / episode"),
]


def sim_table(sim: dict[str, Any]) -> str:
    rows = [
        {**r, "s_per_informative": r["batch_fill_s"] / max(r["informative_per_batch"], 1e-9)}
        for r in sim.values()
    ]
    return table(rows, SIM_COLUMNS)


def toy_table(toy: dict[str, Any]) -> str:
    return table([toy], TOY_COLUMNS)


def plot(sim: dict[str, Any], batch: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for result in sim.values():
        times = sorted(t for b in result["group_times"] for t in b)
        batches = max(len(result["group_times"]), 1)
        ax.step(times, np.arange(1, len(times) + 1) / batches, where="post", label=result["label"])
    ax.axhline(batch, color="grey", lw=0.5)
    ax.set_xlabel("simulated seconds since the batch started")
    ax.set_ylabel(f"groups reaching the sink per batch (B = {batch})")
    ax.set_title("Episode groups under a long tail of turns")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="toy,sim")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    started = time.monotonic()
    parts = set(args.parts.split(","))
    batch, steps = 64, 3 if args.quick else 6
    pairs = 2 if args.quick else 3
    path = RESULTS / "episodes.json"
    # The parts not run now keep their last results; the environment is this run's.
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    result.pop("environment", None)
    result["settings"] = {
        "quick": args.quick,
        "seed": args.seed,
        "batch": batch,
        "steps": steps,
        "warmup": 1,
        "pairs": pairs,
        "toy_groups": TOY_GROUPS,
        "pareto_alpha": PARETO_ALPHA,
        "max_turns": MAX_TURNS,
    }
    if "toy" in parts:
        from trainer_client.toy import build_toy

        with tempfile.TemporaryDirectory() as tmp:
            toy = build_toy(Path(tmp) / "toy", seed=0)
            result["toy"] = measure_toy(
                toy.model_dir, toy.data_files[1], pairs=pairs, warmup=8, groups=TOY_GROUPS
            )
        print(toy_table(result["toy"]))
    if "sim" in parts:
        result["sim"] = measure_sim(batch, steps, 1, args.seed)
        plot(result["sim"], batch, RESULTS / "episodes.png")
        print(sim_table(result["sim"]))
    write_json("episodes", result, started=started)
    return result


def expected_turns() -> float:
    """Mean of `draw_turns`: sum over t of P(turns >= t), t = 1..MAX_TURNS."""
    return sum(t ** (-PARETO_ALPHA) for t in range(1, MAX_TURNS + 1))


if __name__ == "__main__":
    # The sampler imports the environments as `bench.episodes`; run that module's main,
    # so the counters and draws it reads are the ones the environments write.
    from bench import episodes

    episodes.main()
