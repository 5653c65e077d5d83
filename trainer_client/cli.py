"""`adaptive-rollout train` and `adaptive-rollout demo` (added to the console script).

`sampler_service.cli:main` calls `add_trainer_commands(subparsers)`. Only argparse is
imported here; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def _positive_float_or_none(text: str) -> float | None:
    value = float(text)
    return value if value > 0 else None


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="sampler service URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        help="Hugging Face model directory the sampler started from (or one of our checkpoints, to resume)",
    )
    p.add_argument(
        "--out", type=Path, default=Path("runs/train"), help="log and checkpoint directory"
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("ADAPTIVE_ROLLOUT_API_KEY"),
        help="bearer key for the sampler (default: env ADAPTIVE_ROLLOUT_API_KEY)",
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (batches) to train")
    p.add_argument(
        "--batch-groups",
        type=int,
        default=8,
        help="groups per batch; the sampler's batch_groups is set to match",
    )
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument(
        "--advantage",
        choices=["server", "grpo"],
        default="server",
        help="use the service's advantages, or recompute GRPO's per group",
    )
    p.add_argument("--clip-low", type=float, default=0.2)
    p.add_argument("--clip-high", type=float, default=0.28)
    p.add_argument(
        "--tis-cap",
        type=_positive_float_or_none,
        default=None,
        help="truncated importance correction min(pi_old/pi_sampler, CAP) (0 or unset: off)",
    )
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per epoch")
    p.add_argument(
        "--sync-every", type=int, default=1, help="push weights to the sampler every N steps"
    )
    p.add_argument(
        "--save-every", type=int, default=0, help="checkpoint every N steps (0: final only)"
    )
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument(
        "--consumer",
        default=None,
        help="stream consumer name, one per trainer (default: <host>-<pid>-<6 hex>)",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        default=120.0,
        help="fail if the sampler sends no heartbeat or group for this long",
    )
    p.add_argument(
        "--max-unacked", type=int, default=None, help="stream credits (default 2 x batch groups)"
    )
    p.add_argument(
        "--no-configure-sampler",
        dest="configure_sampler",
        action="store_false",
        help="do not PATCH the sampler's batch_groups to --batch-groups",
    )
    p.add_argument(
        "--eval",
        dest="eval_files",
        type=Path,
        action="append",
        default=[],
        help="held-out prompt file for greedy accuracy before and after (repeatable)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def train_command(args: argparse.Namespace) -> None:
    from trainer_client.grpo import TrainConfig, train

    cfg = TrainConfig(
        url=args.url,
        model=args.model,
        out_dir=args.out,
        steps=args.steps,
        batch_groups=args.batch_groups,
        lr=args.lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        advantage=args.advantage,
        clip_low=args.clip_low,
        clip_high=args.clip_high,
        tis_cap=args.tis_cap,
        ppo_epochs=args.ppo_epochs,
        minibatches=args.minibatches,
        sync_every=args.sync_every,
        save_every=args.save_every,
        device=args.device,
        consumer=args.consumer,
        api_key=args.api_key,
        watchdog_s=args.watchdog_s,
        max_unacked=args.max_unacked,
        configure_sampler=args.configure_sampler,
        seed=args.seed,
        progress=args.progress,
        eval_files=args.eval_files,
    )
    from trainer_client.client import SamplerError

    try:
        trainer = train(cfg)
    except SamplerError as exc:  # the sampler died, refused a request, or stayed silent
        raise SystemExit(f"adaptive-rollout train: {exc}") from exc
    print(
        f"trained {trainer.step} steps; sampler serves policy v{trainer.version}; "
        f"log {cfg.out_dir / 'train_log.jsonl'}; final weights {cfg.out_dir / 'final'}"
    )


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    import json

    from trainer_client.demo import DemoSettings  # stdlib imports only: cheap

    d = DemoSettings()
    p.add_argument("--out", type=Path, default=d.out_dir, help="output directory [%(default)s]")
    p.add_argument("--steps", type=int, default=None, help=f"training steps [{d.steps}]")
    p.add_argument(
        "--seed", type=int, default=0, help="seed for the toy data and the run [%(default)s]"
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument(
        "--batch-groups",
        type=int,
        default=None,
        help=f"groups per training batch [{d.batch_groups}]",
    )
    p.add_argument("--lr", type=float, default=None, help=f"learning rate [{d.lr}]")
    p.add_argument(
        "--sync-every", type=int, default=None, help=f"push weights every N steps [{d.sync_every}]"
    )
    p.add_argument(
        "--set",
        dest="sampler_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a sampler config key for the demo (value parsed as JSON if it can be), "
        'e.g. --set n_max=32 --set \'mixing={"name": "reward_gap"}\'. Defaults: '
        + ", ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in d.sampler.items()),
    )
    p.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="training time budget in seconds [what is left of 3.5 minutes after start-up]",
    )


def demo_command(args: argparse.Namespace) -> None:
    import json

    from trainer_client.demo import DemoSettings, run_demo

    settings = DemoSettings(
        out_dir=args.out, seed=args.seed, progress=args.progress, time_limit_s=args.time_limit_s
    )
    for name in ("steps", "batch_groups", "lr", "sync_every"):
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    for pair in args.sampler_overrides:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            settings.sampler[key] = json.loads(value)
        except json.JSONDecodeError:
            settings.sampler[key] = value
    from trainer_client.client import SamplerError

    try:
        code = run_demo(settings)
    except SamplerError as exc:
        raise SystemExit(
            f"adaptive-rollout demo: {exc} (sampler log: {settings.out_dir / 'sampler.log'})"
        ) from exc
    raise SystemExit(code)


def add_trainer_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p_train = sub.add_parser("train", help="run the reference GRPO trainer against a sampler")
    add_train_arguments(p_train)
    p_train.set_defaults(func=train_command)

    p_demo = sub.add_parser(
        "demo",
        help="toy model + sampler + trainer on this machine: before/after accuracy and a report",
    )
    add_demo_arguments(p_demo)
    p_demo.set_defaults(func=demo_command)
