"""`adaptive-rollout train` and `adaptive-rollout demo` (added to the console script).

`sampler_service.cli:main` calls `add_trainer_commands(subparsers)`. Only argparse is
imported here; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse


def train_command(args: argparse.Namespace) -> None:
    from trainer_client.client import SamplerError
    from trainer_client.config_cli import model_from_args
    from trainer_client.grpo import train
    from trainer_client.train_config import TrainConfig

    cfg = model_from_args(args.parser, TrainConfig, args)
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

    from trainer_client.config_cli import add_model_arguments
    from trainer_client.demo import DemoSettings

    add_model_arguments(p, DemoSettings, skip={"sampler"})
    defaults = DemoSettings().sampler
    p.add_argument(
        "--set",
        dest="sampler_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a sampler config key for the demo (value parsed as JSON if it can be), "
        'e.g. --set n_max=32 --set \'mixing={"name": "reward_gap"}\'. Defaults: '
        + ", ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in defaults.items()),
    )


def demo_command(args: argparse.Namespace) -> None:
    from trainer_client.client import SamplerError
    from trainer_client.config_cli import model_from_args, parse_key_values
    from trainer_client.demo import DemoSettings, run_demo

    try:
        overrides = parse_key_values(args.sampler_overrides, "--set")
    except argparse.ArgumentTypeError as exc:
        args.parser.error(str(exc))
    settings = model_from_args(args.parser, DemoSettings, args)
    settings.sampler.update(overrides)
    try:
        code = run_demo(settings)
    except SamplerError as exc:
        raise SystemExit(
            f"adaptive-rollout demo: {exc} (sampler log: {settings.out_dir / 'sampler.log'})"
        ) from exc
    raise SystemExit(code)


def add_trainer_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from trainer_client.config_cli import add_model_arguments
    from trainer_client.train_config import TrainConfig

    p_train = sub.add_parser("train", help="run the reference GRPO trainer against a sampler")
    add_model_arguments(p_train, TrainConfig)
    p_train.set_defaults(func=train_command, parser=p_train)

    p_demo = sub.add_parser(
        "demo",
        help="toy model + sampler + trainer on this machine: before/after accuracy and a report",
    )
    add_demo_arguments(p_demo)
    p_demo.set_defaults(func=demo_command, parser=p_demo)
