"""Render the benchmark tables of BENCHMARKS.md and bench/notes/*.md from the committed
result JSON.

A table on one of those pages that comes from a result file sits between two markers,

    <!-- render:NAME -->
    ...
    <!-- /render:NAME -->

and is rewritten by this script from `bench/results/*.json`, so the prose's numbers are
those of the committed run. Each block appears on one page: BENCHMARKS.md holds the
current figures, a benchmark's notes the rest of its tables. `tests/bench/test_render.py`
fails when a page and the JSON differ.

    python -m bench.render           # rewrite the pages
    python -m bench.render --check   # exit 1 if a page is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import episodes, front, http_hop, judge, learning, restart, scaleout, sessions
from bench.common import RESULTS, ROOT, fmt, table
from bench.step_time import EXACT_GOALS, steps_table
from bench.step_time import rows as step_time_rows

DOC = ROOT / "BENCHMARKS.md"
NOTES = ROOT / "bench" / "notes"
_BLOCK = re.compile(
    r"(<!-- render:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /render:(?P=name) -->)", re.S
)


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _step_table(which: str) -> str:
    return steps_table(_load("step_time")["tables"][which])


def _step_checks() -> str:
    checks = _load("step_time")["checks"]
    return table(
        [{**c, "status": "met" if c["met"] else "**missed**"} for c in checks],
        [
            ("rule", "rule (sync)"),
            ("quantity", "quantity"),
            ("prompts", "prompts"),
            ("measured", "measured mean"),
            ("expected", "closed form"),
            ("z", "z"),
            ("status", "within 4 SE"),
        ],
        digits=4,
    )


def _step_targets() -> str:
    data = _load("step_time")
    lines = []
    for key, t in data["targets"].items():
        which, _, competing = key.partition("/")
        if which in ("exact", "staleness", "continue"):  # their own tables
            continue
        labels = {r["method"]: r["label"] for r in data["tables"][which]}
        lines.append(
            {
                "lengths": which,
                "rows": {"all": "listed + extra (*)", "adaptive": "listed, no GRPO/DAPO"}.get(
                    competing, competing
                ),
                "best": labels.get(t["best"], "none"),
                "ratio": t.get("ratio_r07"),
                "informative": t.get("informative"),
                "step": "met" if t["step_target_met"] else "**missed**",
                "api": t.get("answers_per_informative"),
                "answers": "met" if t["answers_target_met"] else "**missed**",
                "engine": t.get("engine_ratio"),
                "engine_met": "met" if t.get("engine_target_met") else "**missed**",
            }
        )
    return table(
        lines,
        [
            ("lengths", "lengths"),
            ("rows", "rows competing"),
            ("best", "best on-policy row with >= 90% informative"),
            ("ratio", "step vs GRPO n=4 sync, r 0.7"),
            ("informative", "informative"),
            ("step", "<= 1.5x"),
            ("api", "answers / informative group"),
            ("answers", "<= 11"),
            ("engine", "cheapest engine-s / informative group vs GRPO n=4"),
            ("engine_met", "<= 0.6x"),
        ],
    )


def _step_staleness() -> str:
    data = _load("step_time")["staleness"]
    runs, figures = data["runs"], data["figures"]
    lines = []
    for key, t in data["targets"].items():
        name = key.partition("/")[2]
        lines.append(
            {
                "target": name,
                "measured": t["measured"],
                "arrival": figures["arrival"][name],
                "unpaced": figures["unpaced"][name],
                "unheld": figures["unheld"][name],
                "unbounded": figures["unbounded"][name],
                "hard16": figures["hard16"][name],
                "wide": figures["wide"][name],
                "goal": t["goal"],
                "met": "met" if t["met"] else "**missed**",
            }
        )
    seeds = data["seeds"]

    def counts(run: str) -> str:
        return ", ".join(
            f"q{int(k) + 1} {v['stale_groups']}/{v['stale_groups'] + v['trained_groups']}"
            for k, v in data["quartiles"][run].items()
        )

    return (
        table(
            lines,
            [
                ("target", "target"),
                ("measured", "max_staleness 1, paced, held"),
                ("arrival", "engines in arrival order"),
                ("unpaced", "not paced"),
                ("unheld", "hand-outs not held"),
                ("unbounded", "no bound"),
                ("hard16", "hard prompts' waves of 16"),
                ("wide", "all waves of 16"),
                ("goal", "goal"),
                ("met", "met"),
            ],
        )
        + f"\nStale-dropped groups / groups seen by pass-rate quartile (q1 hardest), over "
        f"{seeds} prompt draw{'s' if seeds > 1 else ''}: {counts('bounded')} (hand-outs not held: "
        f"{counts('unheld')}; hard prompts' waves of 16: "
        f"{counts('hard16')}; all waves of 16: {counts('wide')}); the first draw's "
        f"step {runs['bounded']['step_s']:.0f} s (hand-outs held "
        f"{runs['bounded']['hold_s_per_step']:.0f} s a step, "
        f"{runs['bounded']['late_framed_per_step']:.1f} late groups a step taking a newer "
        f"one's place), {runs['unheld']['step_s']:.0f} s not held, "
        f"{runs['arrival']['step_s']:.0f} s in arrival "
        f"order, {runs['unpaced']['step_s']:.0f} s not paced, "
        f"{runs['unbounded']['step_s']:.0f} s without a bound, {runs['hard16']['step_s']:.0f} s "
        f"with hard prompts' waves of 16 and {runs['wide']['step_s']:.0f} s with all waves of "
        f"16 (surplus {runs['hard16']['surplus_share']:.1%} and {runs['wide']['surplus_share']:.1%} "
        f"of decoded tokens against {runs['bounded']['surplus_share']:.1%}); "
        f"{runs['bounded']['pacing']['delayed']} prompts delayed."
        + _stale_groups(data["dropped"])
        + "\n"
    )


def _stale_groups(dropped: dict[str, Any]) -> str:
    """What the stale-dropped groups were (nothing where none was dropped)."""
    if not dropped["groups"]:
        return ""
    return (
        f" Of the {dropped['groups']} groups dropped stale with hand-outs not held, "
        f"{dropped['informative']} had a "
        f"right and a wrong answer (the rest carry no GRPO signal); finished, they waited a "
        f"median {dropped['median_frame_wait_s']:.0f} s for their frame to fill (a step "
        f"takes {dropped['step_s']:.0f} s)."
    )


def _step_continue() -> str:
    data = _load("step_time")["continue"]
    runs = data["runs"]
    lines = [
        {
            "run": name,
            "step": r["step_s"],
            "drain": r["drain_s_per_step"],
            "aborted": r["aborted_tokens"],
            "spanning": r["spanning_per_step"],
            "engine": r["engine_s_per_informative"],
            "occupancy": r["occupancy"],
            "rate": r["decode_tok_s"],
            "wasted": r["wasted_share"],
        }
        for name, r in runs.items()
    ]

    def spread(t: dict[str, Any]) -> str:
        values = t["per_seed"]
        if len(values) < 2:
            return ""
        return f", {min(values):.3g}-{max(values):.3g} over {len(values)} prompt draws"

    verdicts = "; ".join(
        f"{key.partition('/')[2]} {t['measured']:.3g}{spread(t)} (goal {t['goal']}: "
        f"{'met' if t['met'] else 'missed'})"
        for key, t in data["targets"].items()
    )
    return (
        table(
            lines,
            [
                ("run", "pipeline / weight_update_mode"),
                ("step", "step (s)"),
                ("drain", "drain s / step"),
                ("aborted", "aborted tokens"),
                ("spanning", "spanning answers / step"),
                ("engine", "engine-s / informative group"),
                ("occupancy", "engine occupancy"),
                ("rate", "decoded tokens / s"),
                ("wasted", "wasted share of decoded tokens"),
            ],
        )
        + f"\nThe runs are the first prompt draw's. Targets: {verdicts}.\n"
    )


def _step_settings() -> str:
    s = _load("step_time")["settings"]
    return (
        f"B = {s['batch']} groups per step, {s['prompts']} prompts (hard mix), "
        f"{s['warmup']} warm-up + {s['steps']} measured steps per run, "
        f"{s['history_epochs']} epochs of estimator history, seed {s['seed']}, "
        f"quick mode: {s['quick']}; off-policy simulated at r in "
        f"{', '.join(fmt(r) for r in s['off_policy_r'])}; self-checks over {s['draws']} "
        f"prompt draws of {s['check_batch']} prompts.\n"
    )


def _episodes_settings() -> str:
    s = _load("episodes")["settings"]
    return (
        f"Toy: {s['pairs']} pairs of runs, {s['toy_groups']} groups of 4 measured per run. "
        f"Simulation: B = {s['batch']} groups per batch, 1 warm-up + {s['steps']} measured "
        f"batches, turns per episode Pareto alpha {fmt(s['pareto_alpha'])} capped at "
        f"{s['max_turns']} (mean {fmt(episodes.expected_turns())}), seed {s['seed']}, "
        f"quick mode: {s['quick']}.\n"
    )


def _learning_summary() -> str:
    data = _load("learning_earlier_add2")
    domains = [d for d in data["curves"][next(iter(data["curves"]))] if d != "mean"]
    names = domains if len(domains) == 1 else [*domains, "mean"]
    rows = []
    for row in data["summary"]:
        cells = {"method": row["method"], "steps": row["steps"], "aps": row["answers_per_step"]}
        for d in names:
            cells[d] = f"{row[f'{d}_start']:.3f} -> {row[d]:.3f} ({row[f'{d}_spread']})"
        cells["t1"] = f"{row['t1_start']:.3f} -> {row['t1']:.3f} ({row['t1_spread']})"
        rows.append(cells)
    return table(
        rows,
        [("method", "method"), ("steps", "optimizer steps"), ("aps", "answers/step")]
        + [(d, f"{d} greedy accuracy") for d in names]
        + [("t1", "T=1 pass rate")],
    )


def _ci(pr: dict[str, Any]) -> str:
    lo_hi = pr.get("ci95")
    return "-" if lo_hi is None else f"{lo_hi[0]:+.3f} .. {lo_hi[1]:+.3f}"


def _learning_paired() -> str:
    data = _load("learning_earlier_add2")
    labels = {m: spec["label"] for m, spec in data["settings"]["methods"].items()}
    rows = []
    for metric, src in (("greedy", data), ("T=1 pass", data["t1"])):
        blocks = [("gains", "answers", "own start, equal answers")]
        blocks += [("paired_by_seed", "answers", "GRPO n=4, equal answers")]
        blocks += [("paired_by_seed", "wall_s", "GRPO n=4, equal wall-clock")]
        for key, axis, name in blocks:
            for method, pr in src[key].get(axis, {}).items():
                rows.append(
                    {
                        "metric": metric,
                        "axis": name,
                        "method": labels[method],
                        "diffs": ", ".join(f"{d:+.3f}" for d in pr["diffs"]),
                        "mean": f"{pr['mean']:+.3f}",
                        "ci": _ci(pr),
                        "t": pr["t"],
                        "wins": f"{pr['wins']} of {pr['n']}",
                        "p": pr["sign_p"],
                    }
                )
    return table(
        rows,
        [
            ("metric", "metric"),
            ("method", "method"),
            ("axis", "minus"),
            ("diffs", "per seed"),
            ("mean", "mean"),
            ("ci", "95% CI (t)"),
            ("t", "paired t"),
            ("wins", "seeds > 0"),
            ("p", "sign test p"),
        ],
    )


def _learning_histograms() -> str:
    data = _load("learning")
    rows = []
    for setting, hist in data["histograms"].items():
        for domain, h in hist["domains"].items():
            rows.append(
                {
                    "setting": setting,
                    "domain": domain,
                    "prompts": h["prompts"],
                    "mean": h["mean"],
                    **h["counts"],
                    "inf": h["grpo4_informative"],
                }  # fmt: skip
            )
    return table(
        rows,
        [("setting", "setting"), ("domain", "domain"), ("prompts", "prompts"),
         ("mean", "mean pass rate")]
        + [(k, f"p {k}") for k in learning.HIST_LABELS]
        + [("inf", "P(GRPO n=4 group informative)")],
    )  # fmt: skip


def _learning_by_setting(
    rows_of: Callable[[dict[str, Any]], list[dict[str, Any]]], columns: list[tuple[str, str]]
) -> Callable[[], str]:
    """A learning table with one block of `rows_of` rows per setting, the setting first."""

    def render() -> str:
        rows = []
        for setting, block in _load("learning")["by_setting"].items():
            rows += [{"setting": setting, **r} for r in rows_of(block)]
        return table(rows, [("setting", "setting"), *columns])

    return render


def _measured(value: Any) -> str:
    """A target's measured value, compact: numbers to 3 digits, dicts as `key value`."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_measured(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_measured(v) for v in value) + ")"
    return fmt(value)


def _learning_targets() -> str:
    rows = []
    for key, e in _load("learning")["targets"].items():
        rows.append(
            {
                "key": key,
                "target": e["target"],
                "method": e["method"] or "-",
                "measured": _measured(e["measured"]),
                "goal": e["goal"],
                "met": "met"
                if e["met"]
                else "not measured"
                if e["measured"] is None
                else "**missed**",
                "reason": e["reason"] or "",
            }
        )
    return table(
        rows,
        [("key", "target"), ("target", "what"), ("method", "method"), ("measured", "measured"),
         ("goal", "goal"), ("met", "met"), ("reason", "why")],
    )  # fmt: skip


def _scaleout_run() -> str:
    data = _load("scaleout")
    env = data["environment"]
    load = ", ".join(f"{x:.1f}" for x in data["load_average"])
    minutes, seconds = divmod(round(data["wall_s"]), 60)
    return (
        f"{'Quick' if data['quick'] else 'Full'} run ({minutes} min {seconds} s, "
        f"{env['cpus']} CPUs, {env['time']}); load average at the end "
        f"(1, 5, 15 min): {load}.\n"
    )


def _scaleout_kill() -> str:
    kill = _load("scaleout")["kill"]
    rows = [
        {**r, "run": i + 1, "over": r["all_reissued_done_s"] - r["detect_s"] - r["median_wave_s"]}
        for i, r in enumerate(kill["runs"])
    ]
    rows.append(
        {
            "run": "median",
            "detect_s": kill["detect_s"],
            "all_reissued_done_s": kill["all_reissued_done_s"],
            "median_wave_s": kill["median_wave_s"],
            "over": kill["over_target_s"],
        }
    )
    return table(
        rows,
        [
            ("run", "kill"),
            ("inflight_samples_at_kill", "samples in flight"),
            ("reissued_waves", "waves re-issued"),
            ("detect_s", "detected (s)"),
            ("all_reissued_done_s", "all done (s)"),
            ("median_wave_s", "median wave (s)"),
            ("over", "done - detected - one wave (s)"),
        ],
    )


def _scaleout_affinity() -> str:
    a = _load("scaleout")["affinity"]
    slow, fast = a["waves"]
    return (
        f"Replica 0 slowed {fmt(a['slowed_by'])}x: it ran {slow} of {slow + fast} waves "
        f"(share **{a['slow_share']:.2f}**, target < 1/{a['replicas']}); "
        f"{fmt(a['groups_per_s'])} groups/s.\n"
    )


def _scaleout_hop() -> str:
    levels = _load("scaleout")["ray_hop"]
    rows = [
        {
            **level,
            "ratios": ", ".join(f"{r:.2f}" for r in level["pair_ratios"]),
            "median": f"**{level['ratio']:.2f}**",
        }
        for level in levels
    ]
    return table(
        rows,
        [
            ("active_prompts", "active prompts"),
            ("pool_groups_per_s", "pool groups/s"),
            ("process_groups_per_s", "engine process groups/s"),
            ("ratios", "pair ratios"),
            ("median", "median ratio"),
            ("waves_per_call", "waves per submit call"),
        ],
    )


def _front(render: Callable[[dict[str, Any]], str]) -> Callable[[], str]:
    return lambda: render(_load("front"))


def _step_exact() -> str:
    """The exact-stopping targets: each figure's mean and spread over the seeds, with the
    same row under whole-wave stopping, and with its engine in arrival order, beside it."""
    data = _load("step_time")
    rows = []

    def spread(m: dict[str, Any]) -> str:
        return f"{m['mean']:.3g} ({m['min']:.3g}-{m['max']:.3g})"

    for key, t in data["targets"].items():
        if not key.startswith("exact/"):
            continue
        m = t["measured"]
        arrival = m.get("arrival_order")
        rows.append(
            {
                "target": f"`{key}`",
                "what": t["target"],
                "exact": spread(m),
                "arrival": spread(arrival) if arrival else "-",
                "wave": spread(m["wave_stopping"]),
                "goal": t["goal"],
                "met": {True: "met", False: "**missed**", None: "-"}[t["met"]],
            }
        )
    seeds = next(iter(rows), None) and data["targets"]["exact/step"]["measured"]["seeds"]
    return table(
        rows,
        [
            ("target", "target"),
            ("what", "figure"),
            ("exact", f"exact stopping, mean (min-max, {seeds} seeds)"),
            ("arrival", "exact, engines in arrival order"),
            ("wave", "whole-wave stopping"),
            ("goal", "goal"),
            ("met", "met"),
        ],
    )


def _step_widths() -> str:
    """The exact row at each speculative width: each figure's mean over the seeds."""
    measured = {
        key: _load("step_time")["targets"][f"exact/{key}"]["measured"]
        for key in (*EXACT_GOALS, "surplus_share")
    }
    rows = [
        {"width": width, **{key: f"{m['widths'][width]:.3g}" for key, m in measured.items()}}
        for width in measured["step"]["widths"]
    ]
    return table(
        rows,
        [
            ("width", "speculative width"),
            ("tokens_per_informative", "tokens / informative vs GRPO n=4"),
            ("engine_s_per_informative", "engine-s / informative vs GRPO n=4"),
            ("step", "on-policy step vs GRPO n=4 sync"),
            ("surplus_share", "surplus share"),
        ],
    )


def _step_floor() -> str:
    """Every exact twin one answer at a time (width 1): the tokens sequential sampling
    spends on its groups, the least any width of the row decodes."""
    target = _load("step_time")["targets"]["exact/tokens_per_informative"]
    floor = target["measured"]["sequential_floor"]
    labels = {m.key: m.label.removesuffix(", exact") for m in step_time_rows()}
    lines = [
        {
            "row": labels.get(key, key),
            "tokens": f"{f['mean']:.3g} ({f['min']:.3g}-{f['max']:.3g})",
            "informative": f["informative_frac"],
        }
        for key, f in sorted(floor.items(), key=lambda kv: kv[1]["mean"])
    ]
    seeds = target["measured"]["seeds"]
    return table(
        lines,
        [
            ("row", "row, exact stopping"),
            (
                "tokens",
                f"tokens / informative vs GRPO n=4 at width 1, mean (min-max, {seeds} seeds)",
            ),
            ("informative", "informative"),
        ],
    )


RENDERERS: dict[str, Callable[[], str]] = {
    "front.run": _front(front.run_line),
    "front.targets": _front(front.targets_table),
    "front.sweep": _front(front.sweep_table),
    "front.costs": _front(front.costs_table),
    "front.delay": _front(front.delay_table),
    "front.stages": _front(front.stages_table),
    "front.profile_self": _front(lambda d: front.profile_table(d, "self")),
    "front.profile_inclusive": _front(lambda d: front.profile_table(d, "inclusive")),
    "front.workers": _front(front.workers_table),
    "front.parse": _front(front.parse_table),
    "front.handoff": _front(front.handoff_table),
    "scaleout.run": _scaleout_run,
    "scaleout.routing": lambda: table(_load("scaleout")["routing"], scaleout.COLUMNS["routing"]),
    "scaleout.kill": _scaleout_kill,
    "scaleout.hop": _scaleout_hop,
    "scaleout.affinity": _scaleout_affinity,
    "scaleout.fronts": lambda: table(_load("scaleout_fronts")["cases"], scaleout.COLUMNS["fronts"]),
    "learning.summary": _learning_summary,
    "learning.paired": _learning_paired,
    "learning.histograms": _learning_histograms,
    **{f"learning.{name}": _learning_by_setting(*spec) for name, spec in learning.TABLES.items()},
    "learning.targets": _learning_targets,
    "episodes.settings": _episodes_settings,
    "http_hop.run": lambda: http_hop.run_line(_load("http_hop")),
    "http_hop.results": lambda: http_hop.results_table(_load("http_hop")),
    "http_hop.targets": lambda: http_hop.targets_table(_load("http_hop")),
    "judge.run": lambda: judge.run_line(_load("judge")),
    "restart.summary": lambda: restart.summary(_load("restart")),
    "restart.kills": lambda: restart.kills_table(_load("restart")),
    "judge.results": lambda: judge.results_table(_load("judge")),
    "sessions.run": lambda: sessions.results_run_line(_load("sessions")),
    "sessions.results": lambda: sessions.results_table(_load("sessions")),
    "episodes.toy": lambda: episodes.toy_table(_load("episodes")["toy"]),
    "episodes.sim": lambda: episodes.sim_table(_load("episodes")["sim"]),
    "step_time.settings": _step_settings,
    "step_time.checks": _step_checks,
    "step_time.targets": _step_targets,
    "step_time.staleness": _step_staleness,
    "step_time.continue": _step_continue,
    "step_time.exact": _step_exact,
    "step_time.floor": _step_floor,
    "step_time.widths": _step_widths,
    "step_time.difficulty": lambda: _step_table("difficulty"),
    "step_time.flat": lambda: _step_table("flat"),
}


def docs() -> list[Path]:
    """Every page with rendered tables: BENCHMARKS.md, then the benchmarks' notes."""
    return [DOC, *sorted(NOTES.glob("*.md"))]


def render(text: str) -> str:
    """`text` with every marked block replaced by its freshly rendered table."""

    def one(match: re.Match[str]) -> str:
        body = RENDERERS[match["name"]]().rstrip("\n") + "\n"
        return match.group(1) + body + match.group(4)

    return _BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only report whether it is up to date")
    args = p.parse_args(argv)
    stale = []
    for doc in docs():
        text = doc.read_text()
        fresh = render(text)
        if fresh == text:
            continue
        stale.append(doc)
        if not args.check:
            doc.write_text(fresh)
    if args.check and stale:
        for doc in stale:
            print(f"{doc} is out of date: run python -m bench.render", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
