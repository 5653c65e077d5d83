"""Throughput and samples per group of each stopping rule on the toy model, through the
real service over loopback HTTP (hf backend, CPU).

    .venv/bin/python bench/toy_rules.py [--seconds 40]

For each rule it starts `adaptive-rollout serve` on the toy task, leases and acks groups
for a fixed time, and reads /v1/stats: groups/s, samples/s, mean answers per emitted
group and the stop reasons. Writes bench/results/toy_rules.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

RULES = {
    "fixed (GRPO n=4)": {"rule": "fixed", "group_size": 4, "n_max": 4, "wave_size": 4},
    "positive k=2": {"rule": "positive", "k_pos": 2, "n_max": 32, "wave_size": 8},
    "balanced k=2+2": {"rule": "balanced", "k_pos": 2, "k_neg": 2, "n_max": 32, "wave_size": 8},
    "balanced adaptive": {"rule": "balanced", "wave": "adaptive", "n_max": 32, "wave_size": 8},
    "est (mean budget 8)": {
        "rule": "est",
        "group_size": 0,
        "downsample": "none",
        "advantage": "est",
        "n_max": 32,
    },
}


def measure(toy_dir: Path, name: str, cfg: dict, seconds: float, work: Path) -> dict:
    config = work / f"{abs(hash(name))}.json"
    config.write_text(json.dumps({"max_tokens": 8, "max_active_prompts": 64, **cfg}))
    data = sorted((toy_dir / "data").glob("*.jsonl"))
    cmd = [
        sys.executable,
        "-m",
        "sampler_service",
        "serve",
        "--model",
        str(toy_dir / "model"),
        *[a for f in data for a in ("--data", str(f))],
        "--port",
        "0",
        "--state-dir",
        str(work / f"state-{abs(hash(name))}"),
        "--config",
        str(config),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    try:
        url = ""
        while not url:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited")
            if m := re.search(r"listening on (\S+)", line):
                url = m.group(1)
        with httpx.Client(base_url=url, timeout=60) as c:
            deadline = time.monotonic() + seconds
            emitted = 0
            while time.monotonic() < deadline:
                groups = c.post("/v1/groups/lease", json={"max_groups": 64, "wait_s": 1}).json()[
                    "groups"
                ]
                if groups:
                    c.post(
                        "/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in groups]}
                    )
                emitted += len(groups)
            stats = c.get("/v1/stats").json()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    hist = {int(k): v for k, v in stats["samples_per_group"].items()}
    finalized = sum(hist.values())
    return {
        "rule": name,
        "groups_per_s": stats["groups_per_s"],
        "samples_per_s": stats["samples_per_s"],
        "tokens_per_s": stats["tokens_per_s"],
        "answers_per_prompt": sum(k * v for k, v in hist.items()) / max(finalized, 1),
        "stop_reasons": stats["stop_reasons"],
        "dropped": stats["dropped"],
        "groups_consumed": emitted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="measuring time per rule")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "toy_rules.json"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "sampler_service", "toy", "--out", str(work / "toy")],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        rows = [measure(work / "toy", name, cfg, args.seconds, work) for name, cfg in RULES.items()]
    print(
        f"{'rule':22} {'groups/s':>9} {'samples/s':>10} {'tokens/s':>9} {'answers/prompt':>15}  stop reasons"
    )
    for r in rows:
        print(
            f"{r['rule']:22} {r['groups_per_s']:9.1f} {r['samples_per_s']:10.0f} {r['tokens_per_s']:9.0f} "
            f"{r['answers_per_prompt']:15.2f}  {r['stop_reasons']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
