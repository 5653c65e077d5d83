"""Operate a live sampler over HTTP: `adaptive-rollout config|stats|events`.

    adaptive-rollout config get
    adaptive-rollout config set k_pos=4 n_max=48      # one PATCH; prints the diff
    adaptive-rollout config schedule schedule.json
    adaptive-rollout stats --watch
    adaptive-rollout events --follow

The sampler is `--url` (default: env ADAPTIVE_ROLLOUT_URL, else http://127.0.0.1:8000);
the API key, when it has one, comes from env ADAPTIVE_ROLLOUT_API_KEY (never a flag, so
it stays out of shell history and process lists). A refused request prints the
server's message and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from trainer_client.contract.flags import parse_key_values
from trainer_client.contract.protocol import DEFAULT_URL, URL_ENV
from trainer_client.report import stale_by_bin, token_rows


# -- arguments ---------------------------------------------------------------------------
def load_schedule(path: Path) -> dict[str, Any]:
    """A schedule file as one config patch: a JSON list of steps, or a JSON/TOML config
    with a `schedule` list, whose other keys (the knobs the schedule starts from, as
    `serve --config` reads the same file) are applied with it, never dropped."""
    text = path.read_text(encoding="utf-8")
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    if isinstance(data, list):
        return {"schedule": data}
    if not isinstance(data, dict) or not isinstance(data.get("schedule"), list):
        raise SystemExit(f"{path}: expected a list of steps or an object with a 'schedule' list")
    return data


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ, config_version aside."""
    return {
        k: (old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if k != "config_version" and old.get(k) != new.get(k)
    }


def _compact(value: Any) -> str:
    return (
        json.dumps(value, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)
    )


# -- rendering ---------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _labelled(title: str, rows: list[tuple[str, Any]]) -> Any:
    """A table of labelled values, without a header."""
    from rich.table import Table

    table = Table(title=title, show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for label, value in rows:
        table.add_row(label, _fmt(value))
    return table


def _episode_rows(episodes: dict[str, Any]) -> list[tuple[str, Any]]:
    """What multi-turn episodes cost (`/v1/stats` `episodes`), as the dashboard shows it."""
    model, observation = episodes.get("model_tokens", 0), episodes.get("observation_tokens", 0)
    share = f"{observation / (model + observation):.0%}" if model + observation else "-"
    last = episodes.get("last_env_error")
    return [
        ("episodes", episodes.get("episodes")),
        ("turns per episode", _fmt(episodes.get("turns_per_episode"))),
        (
            "environment errors",
            f"{episodes.get('env_errors')}" + (f" (last: {last})" if last else ""),
        ),
        ("environment seconds", _fmt(episodes.get("env_seconds"), 1)),
        ("model / observation tokens", f"{model} / {observation} ({share} observation)"),
    ]


def _weight_updates(stats: dict[str, Any]) -> str:
    """What a weight update does to running answers, and what `continue` kept so far."""
    updates = stats.get("weight_updates") or {}
    kept = stats.get("continue") or {}
    mode = updates.get("mode", "-")
    if mode != "continue" and not kept.get("spanning_answers"):
        return str(mode)
    # Answers an update ran across, and the tokens they had decoded by then.
    return (
        f"{mode} (kv {updates.get('kv')}): {kept.get('spanning_answers', 0)} answers / "
        f"{kept.get('continued_tokens', 0)} tokens kept"
    )


def stats_frame(health: dict[str, Any], stats: dict[str, Any]) -> Any:
    """One screen of `stats`: a rich renderable built from /health and /v1/stats."""
    from rich.console import Group
    from rich.table import Table

    rates = stats.get("rates", {})
    queue = stats.get("queue", {})
    staleness = stats.get("staleness", {})
    rows = [
        ("health", health.get("status")),
        (
            "policy / config version",
            f"{stats.get('policy_version')} / {stats.get('config_version')}",
        ),
        ("groups/s (60 s)", _fmt(rates.get("groups_per_s"))),
        ("answers/s (60 s)", _fmt(rates.get("samples_per_s"))),
        ("tokens/s (60 s)", _fmt(rates.get("tokens_per_s"), 1)),
        ("READY / LEASED", f"{queue.get('ready')} / {queue.get('leased')}"),
        ("active prompts", queue.get("active_prompts")),
        (
            "staleness last / mean / max",
            f"{_fmt(staleness.get('last'), 0)} / {_fmt(staleness.get('mean'), 1)} / "
            f"{_fmt(staleness.get('max'), 0)} (bound {_fmt(staleness.get('max_staleness'))})",
        ),
        ("trained groups", stats.get("trained_groups")),
        ("weight updates", _weight_updates(stats)),
    ]
    parts: list[Any] = [_labelled("sampler", rows)]
    if warnings := health.get("warnings"):
        shown = Table(title="warnings", show_header=False, box=None, pad_edge=False)
        shown.add_column(style="yellow")
        for warning in warnings:
            shown.add_row(warning)
        parts.append(shown)

    domains = Table(title="domains")
    for col in ("domain", "pass rate", "target", "admitted", "emitted", "groups"):
        domains.add_column(col, justify="left" if col == "domain" else "right")
    for name, d in sorted(stats.get("domains", {}).items()):
        domains.add_row(
            name,
            _fmt(d.get("pass_rate")),
            _fmt(d.get("target_share")),
            _fmt(d.get("admitted_share")),
            _fmt(d.get("emitted_share")),
            _fmt(d.get("emitted")),
        )
    parts.append(domains)

    counts = Table(title="counts")
    counts.add_column("kind")
    counts.add_column("key")
    counts.add_column("count", justify="right")
    for kind, key in (
        ("stop reason", "stop_reasons"),
        ("dropped", "dropped"),
        ("answers/group", "samples_per_group"),
        ("restart", "restart"),
    ):
        for name, n in stats.get(key, {}).items():
            counts.add_row(kind, str(name), str(n))
    parts.append(counts)

    if waste := stats.get("waste"):
        rows = token_rows(waste)
        if stale := stale_by_bin(stats):
            rows.append(("stale by pass-rate bin (q1 hardest)", stale))
        parts.append(_labelled("decoded tokens", rows))

    # Multi-turn episodes: shown once the sampler has run any.
    episodes = stats.get("episodes") or {}
    if episodes.get("episodes"):
        parts.append(_labelled("episodes", _episode_rows(episodes)))

    replicas = stats.get("replicas")
    if isinstance(replicas, list) and replicas and all(isinstance(r, dict) for r in replicas):
        table = Table(title="replicas")
        columns = list(dict.fromkeys(k for r in replicas for k in r))
        for col in columns:
            table.add_column(col)
        for r in replicas:
            table.add_row(*(_fmt(r.get(col)) for col in columns))
        parts.append(table)
    return Group(*parts)


def event_line(event: dict[str, Any]) -> str:
    """One event as a line: `#seq time kind source summary`."""
    data = event.get("data", {})
    when = datetime.fromtimestamp(event.get("time", 0)).strftime("%Y-%m-%d %H:%M:%S")
    if event.get("kind") == "config":
        changes = ", ".join(
            f"{k} {_compact(old)} -> {_compact(new)}"
            for k, (old, new) in data.get("diff", {}).items()
        )
        summary = f"v{data.get('config_version')}: {changes or 'no change'}"
        if "step" in data:
            summary += f" (step {data['step']} at {_compact(data.get('at'))})"
    elif event.get("kind") == "weights":
        summary = (
            f"v{data.get('version')} via {data.get('transport')} in {_fmt(data.get('seconds'))} s "
            f"(paused {_fmt(data.get('paused_s'))} s)"
        )
    else:
        summary = _compact(data)
    return f"#{event.get('seq')} {when} {event.get('kind')} {event.get('source')} {summary}"


# -- commands ----------------------------------------------------------------------------
def _client(args: argparse.Namespace) -> Any:
    from trainer_client.client import SamplerClient

    return SamplerClient(
        args.url,
        api_key=os.environ.get("ADAPTIVE_ROLLOUT_API_KEY") or None,
        watchdog_s=args.timeout_s,
        timeout_s=args.timeout_s,
    )


def _refreshes(args: argparse.Namespace, repeat: bool) -> Iterator[int]:
    """Refresh numbers 0, 1, ...: one without `repeat`, else `--count` (0 = until Ctrl-C)."""
    i = 0
    while True:
        yield i
        i += 1
        if not repeat or (args.count and i >= args.count):
            return
        time.sleep(args.interval)


def config_command(args: argparse.Namespace) -> None:
    with _client(args) as client:
        if args.action == "get":
            print(json.dumps(client.get_config(), indent=2, sort_keys=True))
            return
        if args.action == "set":
            try:  # the same KEY=VALUE reading as `serve --set`
                patch = parse_key_values(args.values, "config set")
            except argparse.ArgumentTypeError as exc:
                raise SystemExit(str(exc)) from exc
        else:
            patch = load_schedule(Path(args.file))
        old = client.get_config()
        # One PATCH, refused (409) if someone else changed the config since it was read.
        new = client.update_config(expected_version=old["config_version"], **patch)
        for key, (before, after) in config_diff(old, new).items():
            print(f"{key}: {_compact(before)} -> {_compact(after)}")
        print(f"config_version: {old['config_version']} -> {new['config_version']}")


def stats_command(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.live import Live
    from rich.rule import Rule

    console = Console()
    with _client(args) as client:

        def frame() -> Any:
            return stats_frame(client.health().model_dump(), client.stats())

        if args.watch and console.is_terminal:
            with Live(frame(), console=console, auto_refresh=False) as live:
                for _ in _refreshes(args, True):
                    live.update(frame(), refresh=True)
            return
        # Without a terminal (a pipe, a log file): one frame per refresh, one after another.
        for _ in _refreshes(args, args.watch):
            screen = frame()
            console.print(Rule(f"stats at {datetime.now():%H:%M:%S}"))
            console.print(screen)
            sys.stdout.flush()


def events_command(args: argparse.Namespace) -> None:
    with _client(args) as client:
        since = args.since
        for _ in _refreshes(args, args.follow):
            while True:
                page = client.events(since=since, limit=1000, kinds=args.kind)
                for event in page["events"]:
                    print(event_line(event))
                since = page["last_seq"]
                if len(page["events"]) < 1000:
                    break
            sys.stdout.flush()


#: How long a first connection may take before the sampler is reported unreachable.
CONNECT_TIMEOUT_S = 2.0


def _check_reachable(url: str) -> None:
    """Say at once when nothing answers at `url`: the client's retries are for a sampler
    that is starting or restarting (it answers, with 503), not for one that is not there."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=CONNECT_TIMEOUT_S)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        reason = (
            "connection refused"
            if isinstance(exc, httpx.ConnectError)
            else f"no answer within {CONNECT_TIMEOUT_S:g} s"
        )
        print(
            f"error: no sampler at {url} ({reason}); is "
            "`adaptive-rollout serve` running there? --url or ADAPTIVE_ROLLOUT_URL names it",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    except httpx.HTTPError:
        pass  # it answered somehow: the command's own requests report what is wrong


def _run(command: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """A command whose client errors print the server's message and exit with status 1."""

    def run(args: argparse.Namespace) -> None:
        from trainer_client.exceptions import SamplerError

        try:
            _check_reachable(args.url)
            command(args)
        except SamplerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(1) from exc
        except KeyboardInterrupt:
            raise SystemExit(130) from None

    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"sampler URL (default: env {URL_ENV}, else {DEFAULT_URL}); "
        "the API key comes from env ADAPTIVE_ROLLOUT_API_KEY",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=15.0,
        help="give up on an unreachable or starting sampler after this many seconds (default: 15)",
    )


def _repeating(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)"
    )
    p.add_argument(
        "--count", type=int, default=0, help="stop after this many refreshes (default: 0, never)"
    )


def add_config_arguments(p_config: argparse.ArgumentParser) -> None:
    actions = p_config.add_subparsers(dest="action", required=True)
    p_get = actions.add_parser("get", help="print the live config with its config_version")
    p_set = actions.add_parser(
        "set",
        help="change knobs in one PATCH, e.g. k_pos=4 n_max=48 (values JSON, else strings; "
        "dotted keys nest: mixing.name=static); prints the diff and the new version",
    )
    p_set.add_argument("values", nargs="+", metavar="KEY=VALUE")
    p_schedule = actions.add_parser(
        "schedule",
        help="replace the schedule with FILE's (a JSON list of steps, or a JSON/TOML config "
        "with a 'schedule' list, whose other knobs are set in the same PATCH); steps already "
        "due apply at once",
    )
    p_schedule.add_argument("file", metavar="FILE")
    for p in (p_get, p_set, p_schedule):
        _common(p)
        p.set_defaults(func=_run(config_command))


def add_stats_arguments(p_stats: argparse.ArgumentParser) -> None:
    _common(p_stats)
    _repeating(p_stats)
    p_stats.add_argument(
        "--watch", action="store_true", help="refresh until Ctrl-C or --count (default: off)"
    )
    p_stats.set_defaults(func=_run(stats_command))


def add_events_arguments(p_events: argparse.ArgumentParser) -> None:
    _common(p_events)
    _repeating(p_events)
    p_events.add_argument(
        "--since", type=int, default=0, help="print events after this seq (default: 0)"
    )
    p_events.add_argument(
        "--follow", action="store_true", help="keep printing new events (default: off)"
    )
    p_events.add_argument(
        "--kind",
        action="append",
        default=[],
        metavar="KIND",
        help="print only events of this kind: config, weights, schedule_skipped, "
        "engine_failed or replica (repeatable; default: every kind)",
    )
    p_events.set_defaults(func=_run(events_command))
