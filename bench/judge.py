"""Judges: answers/s with a wave's answers batched into one request against one request
per answer, and what a judged answer costs the front's event loop.

The service's own verify function (`service._verifier`: the judge client, its retries and
its tally) runs on an event loop in this process and judges waves as the scheduler hands
them over: `--prompts` waves in flight at once, each of `--wave` answers, one right and
one wrong in turn (the toy's "7" and "8" for 3+4). Two modes, the same work:

- `batched`: `api: completions`, `batch` = the wave: one request per wave (a prompt list);
- `single`: `batch: 1`: one request per answer, all of a wave's at once.

Both have `concurrency` 64 (requests in flight per judge). Windows alternate between the
modes in pairs, the order swapped every pair, so a change in a shared machine's load hits
both. Per window: judged answers/s, requests per answer, and the loop thread's CPU per
judged answer (`time.thread_time()` read on the loop thread at the window's ends: the
judge is another process, so this is the front's own work: rendering templates, JSON,
HTTP, reading verdicts, counting).

Judges (`--judge`, repeatable; default both):
- `scripted`: `sampler_service.verifiers.testing_judge` in a process of its own, grading
  at once: what the front and the HTTP exchange cost, with a judge that costs nothing;
- `vllm`: the toy model under `vllm serve` (the vLLM CPU build in .venv-vllm), P(yes)
  from its first-token logprobs (template "{response}*1=", yes "1"): what batching buys
  against a real server, whose own per-request work is counted in its throughput.

    .venv/bin/python -m bench.judge --quick     # 2 pairs of 5 s windows per judge
    .venv/bin/python -m bench.judge             # 4 pairs of 10 s windows
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import common
from bench.common import child_env, environment, table, write_json
from bench.overhead import VLLM_PYTHON
from sampler_service.backends.base import Completion
from sampler_service.config import JudgeKnobs, SamplerConfig, ServeSettings
from sampler_service.dataset import PromptRow
from sampler_service.scheduler import VerifyFn
from sampler_service.service import _verifier
from sampler_service.tally import Tally
from sampler_service.verifiers.judge import Judges
from sampler_service.verifiers.pool import VerifierPool

JUDGES = ("scripted", "vllm")
MODES = ("batched", "single")
ROW = PromptRow(id="p", prompt="3+4=", answer="7", domain="d")
#: Each judge's knobs but for `batch`.
KNOBS: dict[str, dict[str, Any]] = {
    "scripted": {
        "template": "response: {response}\nanswer: {answer}",
        "verdict": {"form": "label"},
    },
    "vllm": {
        "template": "{response}*1=",
        # The toy's vocabulary has 18 tokens: vLLM's engine dies asked for more.
        "verdict": {"form": "yes_prob", "yes": "1", "no": None, "top_logprobs": 5},
    },
}
COLUMNS = [
    ("judge", "judge"),
    ("mode", "mode"),
    ("answers_per_s", "judged answers/s (median)"),
    ("requests_per_answer", "requests / answer"),
    ("loop_ms", "loop CPU ms / judged answer (median)"),
    ("speedup", "batched / single answers/s, per pair"),
    ("cpu_ratio", "single / batched loop CPU, per pair"),
]


async def window(
    url: str, judge: str, mode: str, wave: int, prompts: int, warmup_s: float, measure_s: float
) -> dict[str, Any]:
    """One window of one mode: waves judged for `warmup_s`, then measured for `measure_s`."""
    knobs = JudgeKnobs(
        api="completions", batch=wave if mode == "batched" else 1, concurrency=64, **KNOBS[judge]
    )
    config = SamplerConfig(judges={"j": knobs})
    tally = Tally([ROW.domain], time.monotonic, judges=["j"])
    judges = Judges({"j": url}, None, lambda: config.judges, tally)
    pool = VerifierPool(max_workers=1)  # the verify function's; never called here
    settings = ServeSettings(model=Path("-"), data=[Path("-")], verifier="judge:j")
    verify: VerifyFn = _verifier(pool, judges, settings, tally)
    texts = ["7", "8"] * (wave // 2) + ["7"] * (wave % 2)
    answers = [Completion(token_ids=[], logprobs=[], text=t, finish_reason="stop") for t in texts]
    failed = 0

    async def judging() -> None:
        nonlocal failed
        while True:
            verdicts = await verify(ROW, answers)
            failed += sum(v.kind != "ok" for v in verdicts)

    tasks = [asyncio.create_task(judging()) for _ in range(prompts)]
    try:
        await asyncio.sleep(warmup_s)
        stats = tally.judges["j"]
        cpu, wall, verdicts, requests = (
            time.thread_time(),
            time.monotonic(),
            stats.verdicts,
            stats.requests,
        )
        await asyncio.sleep(measure_s)
        cpu = time.thread_time() - cpu
        wall = time.monotonic() - wall
        verdicts, requests = stats.verdicts - verdicts, stats.requests - requests
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await judges.close()
        pool.close()
    return {
        "judge": judge,
        "mode": mode,
        "answers_per_s": verdicts / wall,
        "requests_per_answer": requests / max(verdicts, 1),
        "loop_ms": 1e3 * cpu / max(verdicts, 1),
        "failed": failed,
        "wall_s": wall,
    }


def _summary(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per judge and mode: medians, and the per-pair ratios on the batched row."""
    out = []
    for judge in dict.fromkeys(r["judge"] for r in rows):
        by_mode = {m: [r for r in rows if r["judge"] == judge and r["mode"] == m] for m in MODES}
        for mode in MODES:
            runs = by_mode[mode]
            line: dict[str, Any] = {
                "judge": judge,
                "mode": mode,
                "answers_per_s": statistics.median(r["answers_per_s"] for r in runs),
                "requests_per_answer": statistics.median(r["requests_per_answer"] for r in runs),
                "loop_ms": statistics.median(r["loop_ms"] for r in runs),
            }
            if mode == "batched":
                pairs_of = list(zip(runs, by_mode["single"], strict=True))
                line["speedup"] = [b["answers_per_s"] / s["answers_per_s"] for b, s in pairs_of]
                line["cpu_ratio"] = [s["loop_ms"] / b["loop_ms"] for b, s in pairs_of]
            out.append(line)
    return out


def results_table(data: dict[str, Any]) -> str:
    def shown(values: list[float] | None) -> str:
        return ", ".join(f"{v:.2f}" for v in values) if values else ""

    rows = [
        {**r, "speedup": shown(r.get("speedup")), "cpu_ratio": shown(r.get("cpu_ratio"))}
        for r in data["summary"]
    ]
    return table(rows, COLUMNS)


def run_line(data: dict[str, Any]) -> str:
    s = data["settings"]
    detail = f"{s['prompts']} waves of {s['wave']} answers in flight"
    return common.paired_run_line(data, "judge", detail)


def _scripted_judge() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sampler_service.verifiers.testing_judge", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip().removeprefix("listening on ")


def _measure(judge: str, url: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    for pair in range(args.pairs):
        for mode in MODES if pair % 2 == 0 else MODES[::-1]:
            row = asyncio.run(
                window(url, judge, mode, args.wave, args.prompts, args.warmup_s, args.measure_s)
            )
            rows.append({**row, "pair": pair})
            print(
                f"{judge:8} {mode:7} pair {pair}: {row['answers_per_s']:8.0f} answers/s, "
                f"{row['loop_ms']:.3f} loop ms/answer, {row['failed']} failed",
                flush=True,
            )


def _measure_vllm(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from trainer_client.launch import EngineServer
    from trainer_client.toy import build_toy

    with tempfile.TemporaryDirectory(prefix="bench-judge-") as tmp:
        work = Path(tmp)
        toy = build_toy(work / "toy", seed=0)
        server = EngineServer(
            toy.model_dir, work / "vllm.log", python=str(VLLM_PYTHON), env=child_env()
        ).start()
        try:
            server.wait_ready()
            _measure("vllm", server.url, args, rows)
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 pairs of 5 s windows per judge")
    p.add_argument("--pairs", type=int, help="pairs per judge (default 2 quick, 4 full)")
    p.add_argument("--warmup-s", type=float, default=2.0, help="seconds before a window opens")
    p.add_argument("--measure-s", type=float, help="seconds measured per window (5 quick, 10)")
    p.add_argument("--judge", action="append", choices=JUDGES, help="default: both")
    p.add_argument("--wave", type=int, default=8, help="answers per wave (one prompt's)")
    p.add_argument("--prompts", type=int, default=16, help="waves in flight at once")
    args = p.parse_args(argv)
    args.pairs = args.pairs or (2 if args.quick else 4)
    args.measure_s = args.measure_s or (5.0 if args.quick else 10.0)
    judges = args.judge or list(JUDGES)
    if "vllm" in judges and not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run `make venv-vllm`, or --judge scripted")
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    if "scripted" in judges:
        proc, url = _scripted_judge()
        try:
            _measure("scripted", url, args, rows)
        finally:
            proc.terminate()
            proc.wait(30)
    if "vllm" in judges:
        _measure_vllm(args, rows)
    data = {
        "settings": {
            "quick": args.quick,
            "pairs": args.pairs,
            "warmup_s": args.warmup_s,
            "measure_s": args.measure_s,
            "wave": args.wave,
            "prompts": args.prompts,
            "judges": judges,
        },
        "rows": rows,
        "summary": _summary(rows),
        "load_average": list(os.getloadavg()),
        "environment": environment(),
    }
    write_json("judge", data, started=started)
    print(run_line(data) + results_table(data))
    return data


if __name__ == "__main__":
    main()
