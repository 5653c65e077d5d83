"""Sessions: what driving an episode through the OpenAI-compatible proxy costs, per call
and per session, against the same task's in-process environment.

The toy calculator task on the real server (`adaptive-rollout serve`, the hf engine in its
own process, one torch thread), rule `fixed` (n = 4, one wave of 4), at most 16 tokens a
turn, 4 prompts in flight, groups leased and acked as they come. Four ways to run the
same episodes, in turn, the order rotated every round (a shared machine's drift hits all):

- `environment`: rows name the built-in `calculator` environment (in the server's process);
- `python`: rows name `session`, and the server calls `examples.calculator_harness:harness`
  per session (an `openai` client in the server's process, over loopback HTTP);
- `command`: the same harness as a command, a process per session;
- `claimed`: the same harness in this process, on 16 threads that claim sessions over
  HTTP (`POST /v1/sessions/claim`), as a harness fleet elsewhere would: the server's CPU
  is then the proxy's alone, the harness's is this process's (reported apart).

Per run, over the groups after the warm-up: sessions (episodes) per second, model turns
(each one a chat-completions call for a session) per second, and the CPU of the server's
process tree per episode and per turn (children that exited included: a command harness
is a process per session). The proxy's cost is the difference against `environment`.

    .venv/bin/python -m bench.sessions --quick    # 1 round, 16 groups per run
    .venv/bin/python -m bench.sessions            # 2 rounds, 32 groups per run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai

from bench.common import ROOT, child_env, environment, run_line, table, tree_cpu_s, write_json

VARIANTS = ("environment", "python", "command", "claimed")
#: Harness threads of the `claimed` variant (each drives one session at a time).
CLAIMERS = 16
CONFIG: dict[str, Any] = {
    "rule": "fixed",
    "n_max": 4,
    "wave_size": 4,
    "group_size": 4,
    "downsample": "none",
    "max_tokens": 16,
    "max_active_prompts": 4,
    "max_buffered_groups": 32,
    "max_staleness": None,  # no trainer: nothing to bound
    "episode": {"max_tokens_per_turn": 16, "env_timeout_s": 120.0},
}
HARNESS = {
    "python": "python:examples.calculator_harness:harness",
    "command": f"{sys.executable} -m examples.calculator_harness",
}
COLUMNS = [
    ("variant", "episodes driven by"),
    ("episodes_per_s", "episodes/s (median)"),
    ("turns_per_s", "model turns/s (median)"),
    ("turns_per_episode", "turns / episode"),
    ("cpu_ms_per_episode", "server CPU ms / episode (median)"),
    ("cpu_ms_per_turn", "server CPU ms / turn (median)"),
    ("vs_environment", "episodes/s vs environment, per round"),
    ("extra_ms_per_call", "extra server CPU ms / call vs environment (median)"),
    ("harness_cpu_ms_per_episode", "harness CPU ms / episode, apart (median)"),
]


class Mark(NamedTuple):
    """The counters at a window's edge."""

    at: float
    #: The server's process tree, waited-for children included.
    server_cpu: float
    #: This process (the `claimed` variant's harness threads).
    bench_cpu: float
    episodes: int
    turns: int


def _rows(data: list[Path], env: str, out: Path) -> Path:
    import orjson

    from trainer_client.toy import read_jsonl

    rows = [{**r, "env": env} for path in data for r in read_jsonl(path)]
    out.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return out


def _counts(c: httpx.Client) -> tuple[int, int]:
    """(episodes, model turns) the server has finished."""
    episodes = c.get("/v1/stats").json()["episodes"]
    turns = sum(int(k) * v for k, v in episodes["turns"].items())
    return episodes["episodes"], turns


def run(variant: str, toy: Any, work: Path, warmup: int, groups: int) -> dict[str, Any]:
    """One run: a fresh server for `variant`, `warmup` groups, then `groups` measured."""
    from trainer_client.launch import SamplerProcess

    env = "calculator" if variant == "environment" else "session"
    data = _rows(toy.data_files, env, work / f"{variant}.jsonl")
    extra = ["--torch-threads", "1"]
    if variant in HARNESS:
        extra += ["--harness", HARNESS[variant]]
    proc = SamplerProcess(
        toy.model_dir,
        [data],
        work / f"state-{variant}-{time.monotonic_ns()}",
        CONFIG,
        work / f"{variant}.log",
        extra=extra,
        env=child_env(ROOT),
    )
    taken = 0
    marks: dict[str, Mark] = {}
    stop = threading.Event()
    claimers: list[threading.Thread] = []
    with proc, httpx.Client(base_url=proc.url, timeout=120) as c:
        if variant == "claimed":
            claimers = [
                threading.Thread(target=_claim_and_drive, args=(proc.url, stop), daemon=True)
                for _ in range(CLAIMERS)
            ]
            for thread in claimers:
                thread.start()
        while taken < warmup + groups:
            r = c.post(
                "/v1/groups/lease",
                params={"features": "loss_mask"},
                json={"max_groups": 8, "wait_s": 30.0, "consumer": "bench"},
            )
            r.raise_for_status()
            leased = r.json()["groups"]
            if leased:
                c.post(
                    "/v1/groups/ack", json={"delivery_ids": [g["delivery_id"] for g in leased]}
                ).raise_for_status()
            before = taken
            taken += len(leased)
            for name, at in (("start", warmup), ("end", warmup + groups)):
                if before < at <= taken:
                    server_cpu, bench_cpu = tree_cpu_s(proc.pid, waited=True), time.process_time()
                    marks[name] = Mark(time.monotonic(), server_cpu, bench_cpu, *_counts(c))
        sessions = c.get("/v1/stats").json()["sessions"]
        stop.set()
        for thread in claimers:
            thread.join(timeout=30)
    start, end = marks["start"], marks["end"]
    episodes, turns = end.episodes - start.episodes, end.turns - start.turns
    seconds, cpu = end.at - start.at, end.server_cpu - start.server_cpu
    return {
        "variant": variant,
        "episodes": episodes,
        "turns": turns,
        "seconds": seconds,
        "episodes_per_s": episodes / seconds,
        "turns_per_s": turns / seconds,
        "cpu_ms_per_episode": 1e3 * cpu / episodes,
        "cpu_ms_per_turn": 1e3 * cpu / turns,
        "harness_cpu_ms_per_episode": (
            1e3 * (end.bench_cpu - start.bench_cpu) / episodes if variant == "claimed" else None
        ),
        "calls": sessions["calls"] if sessions else None,
        "refused": sessions["refused"] if sessions else None,
    }


def _claim_and_drive(url: str, stop: threading.Event) -> None:
    """One harness thread of the `claimed` variant: claim a session, drive it, again."""
    from examples.calculator_harness import drive

    http = httpx.Client(timeout=httpx.Timeout(120.0))
    while not stop.is_set():
        try:
            r = http.post(f"{url}/v1/sessions/claim", json={"wait_s": 2.0})
        except httpx.HTTPError:
            return  # the server is gone: the run is over
        session = r.json().get("session")
        if session is None:
            continue
        client = openai.OpenAI(
            base_url=session["base_url"], api_key="unused", max_retries=0, http_client=http
        )
        with contextlib.suppress(httpx.HTTPError, openai.APIConnectionError):
            drive(client, http, session["row"]["prompt"], session["session_url"], "unused")


def _summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {v: [r for r in runs if r["variant"] == v] for v in VARIANTS}
    base = by["environment"]
    rows = []
    for variant, mine in by.items():
        if not mine:
            continue

        def median(key: str, of: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[key] for r in of)

        row: dict[str, Any] = {
            "variant": variant,
            "episodes_per_s": median("episodes_per_s"),
            "turns_per_s": median("turns_per_s"),
            "turns_per_episode": sum(r["turns"] for r in mine) / sum(r["episodes"] for r in mine),
            "cpu_ms_per_episode": median("cpu_ms_per_episode"),
            "cpu_ms_per_turn": median("cpu_ms_per_turn"),
        }
        if variant == "claimed":
            row["harness_cpu_ms_per_episode"] = median("harness_cpu_ms_per_episode")
        if variant != "environment" and base:
            row["vs_environment"] = ", ".join(
                f"{m['episodes_per_s'] / b['episodes_per_s']:.2f}"
                for m, b in zip(mine, base, strict=False)
            )
            row["extra_ms_per_call"] = statistics.median(
                m["cpu_ms_per_turn"] - b["cpu_ms_per_turn"]
                for m, b in zip(mine, base, strict=False)
            )
        rows.append(row)
    return rows


def results_table(data: dict[str, Any]) -> str:
    return table(data["summary"], COLUMNS)


def results_run_line(data: dict[str, Any]) -> str:
    s = data["settings"]
    return run_line(
        data,
        f"{s['rounds']} round(s) of the four variants, {s['warmup']} warm-up + {s['groups']} "
        f"measured groups of 4 episodes per run, {CONFIG['max_active_prompts']} prompts in flight",
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 round of 16 groups per run")
    p.add_argument("--rounds", type=int, help="rounds of the four variants (1 quick, 2)")
    p.add_argument("--groups", type=int, help="measured groups per run (16 quick, 32)")
    p.add_argument("--warmup", type=int, default=4, help="groups before the window opens")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.groups = args.groups or (16 if args.quick else 32)
    from trainer_client.toy import build_toy

    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp:
        work = Path(tmp)
        toy = build_toy(work / "toy", n_train=64, n_eval=4, toy_task="calculator")
        for round_ in range(args.rounds):
            order = VARIANTS[round_ % len(VARIANTS) :] + VARIANTS[: round_ % len(VARIANTS)]
            for variant in order:
                result = run(variant, toy, work, args.warmup, args.groups)
                runs.append({**result, "round": round_})
                print(
                    f"round {round_} {variant:11}: {result['episodes_per_s']:6.2f} episodes/s, "
                    f"{result['cpu_ms_per_episode']:7.1f} CPU ms/episode, "
                    f"{result['cpu_ms_per_turn']:7.1f} CPU ms/turn",
                    flush=True,
                )
    data = {
        "settings": {
            "quick": args.quick,
            "rounds": args.rounds,
            "groups": args.groups,
            "warmup": args.warmup,
            "config": CONFIG,
        },
        "runs": runs,
        "summary": _summary(runs),
        "load_average": list(os.getloadavg()),
        "environment": environment(),
    }
    write_json("sessions", data, started=started)
    print(results_run_line(data) + results_table(data))
    return data


if __name__ == "__main__":
    main()
