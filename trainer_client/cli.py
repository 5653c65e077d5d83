"""The trainer side's subcommands of `adaptive-rollout`: `train`, `demo` and `toy`.

The dispatcher (`sampler_service.cli`) names each `add_*_arguments` here and imports this
module only when one of them is used. Only argparse is imported at the top; each command
imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def train_command(args: argparse.Namespace) -> None:
    from trainer_client.checkpoints import StartError
    from trainer_client.contract.flags import model_from_args
    from trainer_client.exceptions import SamplerError
    from trainer_client.grpo import TrainingStopped, train
    from trainer_client.train_config import TrainConfig

    cfg = model_from_args(args.parser, TrainConfig, args)
    # Each exit below follows a saved checkpoint and the command that resumes from it.
    try:
        trainer = train(cfg)
    except StartError as exc:  # nothing trained: --out holds a run this start cannot continue
        args.parser.exit(2, f"adaptive-rollout train: {exc}\n")
    except TrainingStopped as exc:  # Ctrl-C or SIGTERM: the step under way was finished
        raise SystemExit(128 + exc.signum) from None
    except KeyboardInterrupt:  # a second Ctrl-C
        raise SystemExit(130) from None
    except SamplerError as exc:  # the sampler died, refused a request, or stayed silent
        raise SystemExit(f"adaptive-rollout train: {exc}") from exc
    print(
        f"trained {trainer.step} steps; sampler serves policy v{trainer.version}; "
        f"log {cfg.out_dir / 'train_log.jsonl'}; final weights {cfg.out_dir / 'final'}"
    )


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from trainer_client.contract.flags import add_model_arguments
    from trainer_client.train_config import TrainConfig

    add_model_arguments(p, TrainConfig)
    p.set_defaults(func=train_command, parser=p)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    import json

    from trainer_client.contract.flags import add_model_arguments
    from trainer_client.demo import CALCULATOR_SAMPLER, DemoSettings, default_sampler

    add_model_arguments(p, DemoSettings, skip={"sampler"})
    defaults = default_sampler("arithmetic")
    p.add_argument(
        "--set",
        dest="sampler_overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a sampler config key for the demo (value parsed as JSON if it can be), "
        'e.g. --set n_max=32 --set \'mixing={"name": "reward_gap"}\'. Defaults: '
        + ", ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in defaults.items())
        + "; --task calculator sets "
        + ", ".join(
            f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in CALCULATOR_SAMPLER.items()
        ),
    )
    p.set_defaults(func=demo_command, parser=p)


def demo_command(args: argparse.Namespace) -> None:
    from trainer_client.contract.flags import model_from_args, parse_key_values
    from trainer_client.demo import DemoSettings, run_demo
    from trainer_client.exceptions import SamplerError
    from trainer_client.grpo import TrainingStopped

    try:
        overrides = parse_key_values(args.sampler_overrides, "--set")
    except argparse.ArgumentTypeError as exc:
        args.parser.error(str(exc))
    settings = model_from_args(args.parser, DemoSettings, args)
    settings.sampler = {**settings.sampler_config(), **overrides}
    try:
        code = run_demo(settings)
    except TrainingStopped as exc:
        raise SystemExit(128 + exc.signum) from None
    except SamplerError as exc:
        raise SystemExit(
            f"adaptive-rollout demo: {exc} (sampler log: {settings.out_dir / 'sampler.log'})"
        ) from exc
    raise SystemExit(code)


def add_toy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=Path("toy"), help="output directory (default: toy)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the data's split and order (default: 0)"
    )
    p.add_argument(
        "--task",
        choices=("arithmetic", "calculator"),
        default="arithmetic",
        help="arithmetic: single answers; calculator: tool-call episodes (rows name the "
        "calculator environment) (default: arithmetic)",
    )
    p.set_defaults(func=toy_command)


def toy_command(args: argparse.Namespace) -> None:
    from trainer_client.toy import build_toy

    paths = build_toy(args.out, seed=args.seed, toy_task=args.task)
    print(f"model: {paths.model_dir}")
    for f in paths.data_files:
        print(f"data:  {f}")
    for f in paths.eval_files:
        print(f"eval:  {f}")
