"""Text tables and the PNG report of a training run (the demo's output).

Inputs are plain data: the trainer's per-step log records (`train_log.jsonl`), the
before/after greedy accuracies, and the sampler's `GET /v1/stats`.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def read_log(path: Path) -> list[dict[str, Any]]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _rolling(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def answers_per_group_by_domain(history: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean answers generated per emitted (and trained-on) group, per domain."""
    generated: Counter[str] = Counter()
    groups: Counter[str] = Counter()
    for rec in history:
        generated.update(rec.get("domain_generated", {}))
        groups.update(rec.get("domains", {}))
    return {d: generated[d] / groups[d] for d in sorted(groups)}


def accuracy_table(before: dict[str, float], after: dict[str, float]) -> str:
    domains = list(before)
    lines = [f"{'domain':<10}{'before':>9}{'after':>9}{'change':>9}"]
    for d in domains:
        lines.append(f"{d:<10}{before[d]:>9.3f}{after[d]:>9.3f}{after[d] - before[d]:>+9.3f}")
    mb = sum(before.values()) / len(before)
    ma = sum(after[d] for d in domains) / len(domains)
    lines.append(f"{'mean':<10}{mb:>9.3f}{ma:>9.3f}{ma - mb:>+9.3f}")
    return "\n".join(lines)


def token_rows(waste: dict[str, Any]) -> list[tuple[str, Any]]:
    """Where the decoded tokens went (`/v1/stats` `waste`), as the dashboard shows it."""
    decoded = waste.get("decoded") or 0

    def share(value: int) -> str:
        return f"{value} ({value / decoded:.1%})" if decoded else str(value)

    rows: list[tuple[str, Any]] = [
        ("decoded", decoded),
        ("trained", share(waste.get("trained", 0))),
        ("downsampled", share(waste.get("downsampled", 0))),
    ]
    rows += [(f"waste: {cause}", share(v)) for cause, v in waste.get("waste", {}).items()]
    rows.append(("pending (not yet acked)", share(waste.get("pending", 0))))
    redrawn = ", ".join(f"{cause} {n}" for cause, n in waste.get("redrawn", {}).items())
    rows.append(("answers drawn again", redrawn or "none"))
    return rows


def stale_by_bin(stats: dict[str, Any]) -> str | None:
    """Stale-dropped tokens by the prompts' pass-rate bin (`/v1/stats`
    `waste_by_quartile`): whether the staleness bound falls on the hard prompts."""
    by_bin = stats.get("waste_by_quartile")
    if not by_bin:
        return None
    return ", ".join(f"{name} {causes.get('stale', 0)}" for name, causes in by_bin.items())


def sampling_tables(history: Sequence[dict[str, Any]], stats: dict[str, Any]) -> str:
    """Answers per emitted group by domain, stop reasons and mixing shares, as text."""
    out = []
    per_domain = answers_per_group_by_domain(history)
    trained: Counter[str] = Counter()
    for rec in history:
        trained.update(rec.get("domains", {}))
    out.append("answers generated per emitted group (groups the trainer used):")
    out.append(f"  {'domain':<10}{'groups':>8}{'answers/group':>15}")
    for d, v in per_domain.items():
        out.append(f"  {d:<10}{trained[d]:>8}{v:>15.2f}")
    hist = stats.get("samples_per_group", {})
    if hist:
        total = sum(hist.values())
        mean = sum(int(k) * v for k, v in hist.items()) / max(total, 1)
        out.append(
            f"  every prompt the sampler finished: {total}, mean {mean:.2f} "
            "answers/prompt; histogram "
            + " ".join(f"{k}:{v}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
        )
    reasons = stats.get("stop_reasons", {})
    if reasons:
        total = sum(reasons.values())
        out.append(
            "stop reasons (sampler): "
            + ", ".join(
                f"{k} {v} ({v / total:.0%})"
                for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])
            )
        )
    emitted = stats.get("groups_emitted", 0)
    # Stale drops are groups generated and thrown away: each with its share of what the
    # sampler emitted, so the cost of the staleness bound is read off one line, a run
    # that dropped none included.
    dropped = {"stale": 0, **stats.get("dropped", {})} if emitted else stats.get("dropped", {})
    if dropped:
        out.append(
            "dropped groups: "
            + ", ".join(
                f"{k} {v}" + (f" ({v / emitted:.1%} of {emitted} emitted)" if emitted else "")
                for k, v in dropped.items()
            )
        )
    if waste := stats.get("waste"):
        # Every decoded token's fate, so what the run threw away is read in tokens too.
        out.append("decoded tokens: " + "; ".join(f"{k} {v}" for k, v in token_rows(waste)))
    if stale := stale_by_bin(stats):
        out.append(f"stale tokens by pass-rate bin (q1 hardest): {stale}")
    domains = stats.get("domains", {})
    if domains:
        out.append("mixing shares (sampler, recent window):")
        out.append(f"  {'domain':<10}{'target':>8}{'admitted':>10}{'emitted':>9}{'pass rate':>11}")
        for d, s in domains.items():
            pr = s.get("pass_rate")
            out.append(
                f"  {d:<10}{s.get('target_share', 0):>8.2f}{s.get('admitted_share', 0):>10.2f}"
                f"{s.get('emitted_share', 0):>9.2f}{(f'{pr:.2f}' if pr is not None else '-'):>11}"
            )
    return "\n".join(out)


def plot_report(
    path: Path,
    history: Sequence[dict[str, Any]],
    stats: dict[str, Any] | None = None,
    before: dict[str, float] | None = None,
    after: dict[str, float] | None = None,
    title: str = "adaptive-rollout",
    score_name: str = "greedy accuracy",
) -> Path:
    """Write a 2x4 PNG. Top: reward and pass rate, samples per group and domain shares per
    step, the held-out score (`score_name`) before/after. Bottom: the sampler's answers-per-group histogram,
    answers per group by domain, stop reasons, and mixing shares (target/admitted/emitted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = stats or {}
    steps = [r["step"] for r in history]
    window = max(1, len(history) // 15)
    domains = sorted(
        {d for r in history for d in r.get("domains", {})} | set(stats.get("domains", {}))
    )
    color = {d: f"C{i + 3}" for i, d in enumerate(domains)}
    fig, axes = plt.subplots(2, 4, figsize=(21, 8.5))
    fig.suptitle(title)

    ax = axes[0, 0]
    if history:
        for key, c, label in (
            ("reward_mean", "C0", "reward of trained samples"),
            ("pass_rate", "C1", "pass rate of all answers generated"),
        ):
            ys = [r[key] for r in history]
            ax.plot(steps, ys, alpha=0.2, color=c)
            ax.plot(steps, _rolling(ys, window), color=c, label=label)
        for d in domains:
            pts = [
                (r["step"], r["domain_reward"][d])
                for r in history
                if d in r.get("domain_reward", {})
            ]
            if pts:
                ax.plot(
                    [x for x, _ in pts],
                    _rolling([y for _, y in pts], window * 2),
                    ls="--",
                    lw=1,
                    color=color[d],
                    label=f"pass rate {d}",
                )
    ax.set(title="reward / pass rate per step", xlabel="step", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)

    ax = axes[0, 1]
    if history:
        ys = [r["samples_per_group"] for r in history]
        ax.plot(steps, ys, alpha=0.3, color="C2")
        ax.plot(steps, _rolling(ys, window), color="C2", label="answers generated / group")
        ax.plot(
            steps,
            [r["samples"] / max(r["groups"], 1) for r in history],
            color="C9",
            label="answers kept / group",
        )
        ax.set_ylim(0, max(ys) * 1.1)
    ax.set(title="samples per group", xlabel="step")
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[0, 2]
    if history and domains:
        shares = [
            _rolling(
                [r.get("domains", {}).get(d, 0) / max(r["groups"], 1) for r in history], window * 2
            )
            for d in domains
        ]
        ax.stackplot(steps, shares, labels=domains, colors=[color[d] for d in domains], alpha=0.8)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, loc="lower left")
    ax.set(title="domain shares of trained groups", xlabel="step")

    ax = axes[0, 3]
    if before and after:
        names = list(before)
        x = list(range(len(names)))
        ax.bar(
            [i - 0.2 for i in x], [before[n] for n in names], width=0.4, label="before", color="C7"
        )
        ax.bar(
            [i + 0.2 for i in x], [after[n] for n in names], width=0.4, label="after", color="C0"
        )
        for i, n in enumerate(names):
            ax.text(
                i + 0.2, after[n] + 0.01, f"{after[n] - before[n]:+.2f}", ha="center", fontsize=8
            )
        ax.set_xticks(x, names)
        ax.legend(fontsize=8)
    ax.set(title=f"{score_name}, held-out split", ylim=(0, 1.05))

    ax = axes[1, 0]
    hist = stats.get("samples_per_group", {})
    if hist:
        ks = sorted(hist, key=int)
        ax.bar([int(k) for k in ks], [hist[k] for k in ks], color="C2")
    ax.set(title="answers generated per emitted group (sampler)", xlabel="answers", ylabel="groups")

    ax = axes[1, 1]
    per_domain = answers_per_group_by_domain(history)
    if per_domain:
        names = list(per_domain)
        ax.bar(names, [per_domain[n] for n in names], color=[color.get(n, "C2") for n in names])
    ax.set(title="answers generated per trained group, by domain", ylabel="answers")

    ax = axes[1, 2]
    reasons = stats.get("stop_reasons", {})
    if reasons:
        ax.bar(list(reasons), list(reasons.values()), color="C8")
    ax.set(title="stop reasons (sampler)", ylabel="groups")

    ax = axes[1, 3]
    dom_stats = stats.get("domains", {})
    if dom_stats:
        names = list(dom_stats)
        x = list(range(len(names)))
        for j, kind in enumerate(("target_share", "admitted_share", "emitted_share")):
            ax.bar(
                [i + (j - 1) * 0.27 for i in x],
                [dom_stats[n].get(kind, 0) for n in names],
                width=0.27,
                label=kind.split("_")[0],
                color=f"C{j}",
            )
        ax.set_xticks(x, names)
        ax.legend(fontsize=8)
    ax.set(title="mixing shares (sampler, recent window)", ylim=(0, 1))

    fig.tight_layout()
    save_figure(fig, path, dpi=80)
    plt.close(fig)
    return path


def save_figure(fig: Any, path: Path, dpi: int) -> Path:
    """A matplotlib figure as a PNG of at most 256 colours: a line or bar chart loses
    nothing visible and takes a third of the bytes (the repository carries its plots, and
    a GPU check carries the repository)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        paletted = image.convert("RGB").quantize(
            256, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
        )
        paletted.save(path, format="PNG", optimize=True)
    return path
