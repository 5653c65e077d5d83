"""`adaptive-rollout`: one console script for the sampler, the toy task and the trainer.

Only argparse is imported at the top, so `adaptive-rollout train` on a trainer node
never imports the server's dependencies; each subcommand imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import tomllib
from pathlib import Path
from typing import Any

from sampler_service import package_version


def _load_config_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`serve`'s flags: one per ServeSettings field, plus the initial sampler config."""
    from sampler_service.config import ServeSettings
    from trainer_client.config_cli import add_model_arguments

    add_model_arguments(p, ServeSettings)
    p.add_argument(
        "--config",
        type=Path,
        help="initial sampler config (.json or .toml, the keys of GET /v1/config)",
    )
    p.add_argument(
        "--set",
        dest="config_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="initial sampler config key, over --config (value parsed as JSON if it can be; "
        "dotted keys nest, e.g. est.n_min=4); repeatable. A config saved in --state-dir by an "
        "earlier run wins over both, with a warning naming each key it overrides",
    )
    p.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")


def initial_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, replicas: int = 1
) -> Any:
    """The initial sampler config: --set over --config over the defaults, validated
    (the saved state, when there is one, wins over all three in the service). With
    several engine replicas admission scales with them unless the config says otherwise."""
    from sampler_service.config import ConfigError, merge_patch, validate_config
    from trainer_client.config_cli import parse_key_values

    try:
        given = _load_config_file(args.config) if args.config else {}
        given = merge_patch(given, parse_key_values(args.config_set, "--set"))
    except (OSError, ValueError, argparse.ArgumentTypeError) as exc:
        parser.error(f"--config/--set: {exc}")
    defaults = {"max_active_prompts": 64 * replicas} if replicas > 1 else {}
    try:
        return validate_config({**defaults, **given}), given
    except ConfigError as exc:
        parser.error(f"--config/--set: {exc}")


def _exit_now(settings: Any) -> None:
    logging.getLogger("sampler_service").error(
        "shutdown took longer than %g s: exiting now (stored groups are safe)",
        settings.shutdown_timeout_s,
    )
    os._exit(1)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from sampler_service.app import create_app
    from sampler_service.config import ServeSettings
    from sampler_service.service import SamplerService
    from trainer_client.config_cli import model_from_args

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = model_from_args(args.parser, ServeSettings, args)
    if not settings.model.is_dir():
        args.parser.error(f"--model {settings.model}: no such model directory")
    initial, given = initial_config(args.parser, args, settings.replicas)
    if settings.torch_threads > 0:
        import torch

        torch.set_num_threads(settings.torch_threads)
    service = SamplerService(settings, initial_config=initial, given=frozenset(given))
    app = create_app(service)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_timeout_s / 2,
    )
    server = uvicorn.Server(config)

    original_shutdown = server.shutdown

    async def shutdown(sockets: Any = None) -> None:
        # uvicorn waits for open connections before stopping the app, and a stream never
        # ends by itself: end them first, and bound the whole stop whatever hangs.
        timer = threading.Timer(settings.shutdown_timeout_s, _exit_now, [settings])
        timer.daemon = True
        timer.start()
        service.begin_shutdown()
        await original_shutdown(sockets=sockets)

    server.shutdown = shutdown  # type: ignore[method-assign]

    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets=sockets)
        for srv in server.servers:
            for sock in srv.sockets:
                host, port = sock.getsockname()[:2]
                # The one line scripts wait for: where the sampler listens.
                print(f"adaptive-rollout sampler listening on http://{host}:{port}", flush=True)
        logging.getLogger("sampler_service").info(
            "effective config: %s", json.dumps(service.get_config(), sort_keys=True)
        )

    server.startup = startup  # type: ignore[method-assign]
    # Bind before the engine loads, so that a busy port is reported at once.
    try:
        sock = config.bind_socket()
    except SystemExit as exc:
        raise SystemExit(f"cannot listen on {settings.host}:{settings.port}") from exc
    server.run(sockets=[sock])


def toy(args: argparse.Namespace) -> None:
    from sampler_service.toy import build_toy

    paths = build_toy(args.out, seed=args.seed)
    print(f"model: {paths.model_dir}")
    for f in paths.data_files:
        print(f"data:  {f}")
    for f in paths.eval_files:
        print(f"eval:  {f}")


# Nothing this program starts phones home: no hub downloads, no usage statistics from
# vLLM or Ray. A user who wants either sets the variable explicitly.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
}


def build_parser() -> argparse.ArgumentParser:
    """The `adaptive-rollout` argument parser with every subcommand; parsing runs nothing
    (deployment checks parse the command lines of the manifests with it)."""
    parser = argparse.ArgumentParser(prog="adaptive-rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p_serve = sub.add_parser("serve", help="run the sampler service")
    add_serve_arguments(p_serve)
    p_serve.set_defaults(func=serve, parser=p_serve)

    p_toy = sub.add_parser("toy", help="write the toy model and arithmetic data")
    p_toy.add_argument("--out", type=Path, default=Path("toy"), help="output directory")
    p_toy.add_argument("--seed", type=int, default=0)
    p_toy.set_defaults(func=toy)

    from trainer_client.cli import add_trainer_commands
    from trainer_client.ops_cli import add_ops_commands

    add_trainer_commands(sub)
    add_ops_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
