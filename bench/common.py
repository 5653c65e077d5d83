"""Shared helpers of the benchmarks: result files, tables, environment notes."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Method:
    """One compared method of a benchmark: its key in the results, its label in the tables
    and the sampler config it runs with."""

    key: str
    label: str
    config: dict[str, Any]
    #: Beyond the rows the targets are judged on: shown to locate the frontier.
    extra: bool = False


def fixed_groups(n: int, **knobs: Any) -> dict[str, Any]:
    """Sampler config knobs for groups of exactly `n` answers sampled in one wave, with
    `knobs` added or overriding (`grpo` makes them plain GRPO)."""
    return {"rule": "fixed", "group_size": n, "n_max": n, "wave_size": n, **knobs}


def grpo(n: int, **knobs: Any) -> dict[str, Any]:
    """Plain GRPO with groups of `n` answers (`knobs` added or overriding): the baseline
    every benchmark compares with, and the base of DAPO's filter-and-refill rows."""
    return fixed_groups(n, advantage="grpo", downsample="none", **knobs)


#: DAPO's dynamic sampling: a group whose rewards are all equal is dropped and its prompt
#: replaced, so every kept group carries signal.
DAPO_REFILL: dict[str, Any] = {"group_policies": [{"name": "nonzero_std"}]}


def est(mean_budget: float) -> dict[str, Any]:
    """Reinforce-Ada's Est: each prompt's answers set by its estimated pass rate, at
    `mean_budget` answers per prompt over the dataset (up to 32 each), with Est's own
    advantages and every answer kept."""
    return {
        "rule": "est",
        "advantage": "est",
        "group_size": 0,
        "downsample": "none",
        "n_max": 32,
        "wave_size": 32,
        "est": {"mean_budget": mean_budget},
    }


def flags(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The values of the command-line flags `names` (dest names), in that order: the part of
    a result's settings that echoes how it was run."""
    return {name: getattr(args, name) for name in names}


def environment() -> dict[str, Any]:
    """Where a result was measured (ratios only compare within one run)."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        rev = ""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "git": rev or None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def child_env(root: Path = ROOT) -> dict[str, str]:
    """The environment of a benchmark's child process: one torch thread (on two shared
    cores, threads that contend cost far more than they give), offline, quiet, and
    `root`'s code first on the path (a checkout measured side by side)."""
    return {
        **os.environ,
        "PYTHONPATH": str(root),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def git(*args: str) -> str:
    """`git -C ROOT ARGS...`, its output stripped (raises when git fails)."""
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def checkout(ref: str, where: Path) -> tuple[Path, bool]:
    """Code to measure, for side-by-side runs: `ref` a directory holding a checkout (used
    as it is), or a git revision of this repository checked out, detached, at `where`.
    Returns the root and whether a worktree was made (`git("worktree", "remove", ...)`
    it afterwards)."""
    path = (ROOT / ref).resolve() if not Path(ref).is_absolute() else Path(ref)
    if path.is_dir():
        return path, False
    rev = git("rev-parse", "--verify", f"{ref}^{{commit}}")
    git("worktree", "add", "--detach", str(where), rev)
    return where, True


def revision(root: Path) -> str | None:
    """The short commit a checkout is at (None: not a git checkout)."""
    done = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or None


def write_json(name: str, data: dict[str, Any], *, started: float | None = None) -> Path:
    """Write bench/results/<name>.json (atomically) and return its path.

    With `started` (a `time.monotonic()` reading), the run's wall time is stamped into
    `data` as ``real_s`` (so a summary printed afterwards can show it too) and the path
    and the time are printed: every benchmark reports its own length the same way.
    """
    if started is not None:
        data["real_s"] = time.monotonic() - started
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(results_text({"environment": environment(), **data}))
    tmp.replace(path)
    if started is not None:
        print(f"wrote {path}; real time {data['real_s']:.0f}s")
    return path


#: A JSON array of numbers, strings, booleans or nulls, one item a line (`json.dumps`
#: with an indent writes them so).
_SCALAR_ARRAY = re.compile(r'\[\n\s*((?:-?[\d.eE+-]+|"[^"\n]*"|true|false|null|,\n\s*)+?)\n\s*\]')


def results_text(data: dict[str, Any]) -> str:
    """A results file's text: indented, with arrays of scalars on one line (per-step
    series one number a line made the files a third longer, and the repository must fit
    the GPU check's carry)."""
    text = json.dumps(data, indent=1, default=_default)
    return _SCALAR_ARRAY.sub(lambda m: "[" + " ".join(m[1].split()) + "]", text) + "\n"


def _default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # nan
            return "nan"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}g}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(
    rows: Sequence[dict[str, Any]], columns: Iterable[tuple[str, str]], digits: int = 3
) -> str:
    """A Markdown table (also readable on a terminal) of `rows` for (key, header) columns."""
    columns = list(columns)
    cells = [[fmt(r.get(k), digits) for k, _ in columns] for r in rows]
    headers = [h for _, h in columns]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for c in cells:
        lines.append("| " + " | ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)) + " |")
    return "\n".join(lines)


def run_line(data: dict[str, Any], detail: str) -> str:
    """A result's first line: its mode, wall time, CPUs and date, `detail`, and the load
    average at its end (a shared machine's load moves absolute rates, not ratios)."""
    s, env = data["settings"], data["environment"]
    minutes, seconds = divmod(round(data["real_s"]), 60)
    load = ", ".join(f"{x:.1f}" for x in data["load_average"])
    return (
        f"{'Quick' if s['quick'] else 'Full'} run ({minutes} min {seconds} s, {env['cpus']} "
        f"CPUs, {env['time']}): {detail}; load average at the end (1, 5, 15 min) {load}.\n"
    )


def paired_run_line(data: dict[str, Any], pair_of: str, detail: str) -> str:
    """The run line of a benchmark of paired windows (each pair one of each kind, in
    alternating order): how many pairs of what, each window's warm-up and measured time."""
    s = data["settings"]
    return run_line(
        data,
        f"{s['pairs']} pairs per {pair_of}, windows of {fmt(s['warmup_s'])} s warm-up + "
        f"{fmt(s['measure_s'])} s measured, {detail}",
    )


def percentile(values: Sequence[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def tree_cpu_s(pid: int, include_root: bool = True, waited: bool = False) -> float:
    """CPU seconds (user + system) of a process and all its live descendants (Linux /proc).

    Engines such as vLLM run their engine core in a child process, so a process's own
    CPU time would miss most of the work. `include_root=False`: the descendants alone;
    `waited`: the root's children that exited and were waited for count too (short-lived
    ones, such as a harness per session).
    """
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
        if waited and int(entry) == pid:
            cpu[pid] += (int(fields[13]) + int(fields[14])) / tick
    total, frontier = 0.0, [pid]
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    while frontier:
        p = frontier.pop()
        if include_root or p != pid:
            total += cpu.get(p, 0.0)
        frontier.extend(children.get(p, []))
    return total


def thread_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds of one thread (default: the process's main thread, whose id is the pid)."""
    fields = Path(f"/proc/{pid}/task/{tid or pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_app(app: Any) -> None:
    """Run a bench server's ASGI app on a free loopback port, as `serve` runs the sampler's,
    and print `listening on URL` once it listens (the line the starting process waits for)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets=sockets)
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"listening on http://{host}:{port}", flush=True)

    server.startup = startup  # type: ignore[method-assign]
    server.run()
