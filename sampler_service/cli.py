"""`adaptive-rollout`: one console script for the sampler, the toy task and the trainer.

The dispatcher (`main`, `COMMANDS`) lives here, at the console script's entry point, and
registers every subcommand by the module that defines it: only the standard library is
imported at the top, and a subcommand's module (the trainer's come from `trainer_client`)
is imported only when that subcommand is parsed. So a trainer node's install, which has
no FastAPI and no engine, runs `train`, `config`, `stats` and `events`; a subcommand whose
extra is missing says which one to install. `serve` is defined here too.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import sys
import threading
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from sampler_service import package_version


def _load_config_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`serve`'s flags: one per ServeSettings field, in its help section, plus the
    initial sampler config."""
    from sampler_service.config import ServeSettings
    from trainer_client.contract.flags import add_model_arguments, add_sections

    sections = add_sections(p, ServeSettings.CLI_SECTIONS)
    add_model_arguments(p, ServeSettings, sections=sections)
    core = sections[""]
    core.add_argument(
        "--config",
        type=Path,
        help="initial sampler config (.json or .toml, the keys of GET /v1/config)",
    )
    core.add_argument(
        "--set",
        dest="config_set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="initial sampler config key, over --config (value parsed as JSON if it can be; "
        "dotted keys nest, e.g. est.n_min=4); repeatable. A config saved in --state-dir by an "
        "earlier run wins over both, with a warning naming each key it overrides",
    )
    core.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    p.set_defaults(func=serve, parser=p)


def initial_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, replicas: int = 1
) -> Any:
    """The initial sampler config: --set over --config over the defaults, validated
    (the saved state, when there is one, wins over all three in the service). With
    several engine replicas admission scales with them unless the config says otherwise."""
    from sampler_service.config import ConfigError, merge_patch, validate_config
    from trainer_client.contract.flags import parse_key_values

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


def _reachable_url(address: Any) -> str:
    """This host's URL of a listening address (a wildcard address is reached on loopback)."""
    host, port = address[:2]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


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
    from sampler_service.startup import StartupError, prepare
    from trainer_client.contract.flags import model_from_args

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # `python:` specs (environments, verifiers) import from the working directory, as
    # under `python -m`; a console script's sys.path starts at its own bin directory.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    settings = model_from_args(args.parser, ServeSettings, args)
    if not settings.model.is_dir():
        args.parser.error(f"--model {settings.model}: no such model directory")
    initial, given = initial_config(args.parser, args, settings.replica.count)
    try:  # the data, the config against the model, and the state dir, before any loading
        prepared = prepare(settings, initial, frozenset(given))
    except StartupError as exc:
        args.parser.exit(2, f"adaptive-rollout serve: {exc}\n")
    if settings.torch_threads > 0:
        import torch

        torch.set_num_threads(settings.torch_threads)
    app = create_app(settings, functools.partial(SamplerService.build, settings, prepared=prepared))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        lifespan="on",
        # uvicorn's hint says int; it waits any number of seconds.
        timeout_graceful_shutdown=settings.shutdown_timeout_s / 2,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)

    original_shutdown = server.shutdown

    async def shutdown(sockets: Any = None) -> None:
        # uvicorn waits for open connections before stopping the app, and a stream never
        # ends by itself: end them first, and bound the whole stop whatever hangs.
        timer = threading.Timer(settings.shutdown_timeout_s, _exit_now, [settings])
        timer.daemon = True
        timer.start()
        service = app.state.service  # built: a shutdown follows a start that succeeded
        service.begin_shutdown()
        await original_shutdown(sockets=sockets)  # the app's lifespan ends in here
        if service.shutdown_summary:  # uvicorn then re-raises the signal: say it now
            print(service.shutdown_summary, flush=True)

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
            "effective config: %s",
            json.dumps(app.state.service.control.get_config(), sort_keys=True),
        )

    server.startup = startup  # type: ignore[method-assign]
    # Bind before the engine loads, so that a busy port is reported at once.
    try:
        sock = config.bind_socket()
    except SystemExit as exc:
        raise SystemExit(f"cannot listen on {settings.host}:{settings.port}") from exc
    if prepared.sessions is not None:  # the harnesses it starts reach it here
        prepared.sessions.hub.server_url = _reachable_url(sock.getsockname())
    server.run(sockets=[sock])


@dataclass(frozen=True)
class Command:
    """A subcommand: its help line, the function that adds its arguments (``module:name``,
    imported only when the subcommand is used) and the extra its run needs."""

    help: str
    arguments: str
    extra: str | None = None


COMMANDS: dict[str, Command] = {
    "serve": Command(
        "run the sampler service", "sampler_service.cli:add_serve_arguments", "server"
    ),
    "toy": Command(
        "write the toy model and arithmetic data", "trainer_client.cli:add_toy_arguments", "trainer"
    ),
    "train": Command(
        "run the reference GRPO trainer against a sampler",
        "trainer_client.cli:add_train_arguments",
        "trainer",
    ),
    "demo": Command(
        "toy model + sampler + trainer on this machine: before/after accuracy and a report",
        "trainer_client.cli:add_demo_arguments",
        "server,trainer",
    ),
    "config": Command(
        "read or change a live sampler's config over HTTP",
        "trainer_client.ops_cli:add_config_arguments",
    ),
    "stats": Command(
        "a live sampler's throughput, queues and domains",
        "trainer_client.ops_cli:add_stats_arguments",
        "ops",
    ),
    "events": Command(
        "a live sampler's event log (config, weights, ...)",
        "trainer_client.ops_cli:add_events_arguments",
    ),
}


def _load(spec: str) -> Callable[[argparse.ArgumentParser], None]:
    module, _, name = spec.partition(":")
    function: Callable[[argparse.ArgumentParser], None] = getattr(
        importlib.import_module(module), name
    )
    return function


class _Parser(argparse.ArgumentParser):
    """A usage error is one line naming the command and the flag, with where to look: not
    argparse's usage block of every flag first (forty lines for `serve`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


class _CommandParser(_Parser):
    """A subcommand's parser that adds its arguments the first time it is used (parsed or
    asked for help), so that only the chosen subcommand's module is imported."""

    def __init__(self, *args: Any, arguments: str | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._arguments = arguments

    def configure(self) -> argparse.ArgumentParser:
        if self._arguments is not None:
            spec, self._arguments = self._arguments, None
            _load(spec)(self)
        return self

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        self.configure()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.configure()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    """The `adaptive-rollout` argument parser with every subcommand; parsing runs nothing
    (deployment checks parse the command lines of the manifests with it)."""
    parser = _Parser(prog="adaptive-rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, arguments=command.arguments)
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one subcommand, with its arguments, as `build_parser` makes it."""
    command = COMMANDS[name]
    parser = _CommandParser(
        prog=f"adaptive-rollout {name}", description=command.help, arguments=command.arguments
    )
    return parser.configure()


_OURS = ("strategies", "sampler_service", "trainer_client")
#: Extras named by the module that is missing rather than by the subcommand.
_EXTRA_OF_MODULE = {"vllm": "vllm", "ray": "ray", "verl": "verl", "rich": "ops"}


# Nothing this program starts phones home: no hub downloads, no usage statistics from
# vLLM or Ray. A user who wants either sets the variable explicitly.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except BrokenPipeError:
        # The reader went away (`config get | head`): what it did not read is not an error
        # to report. Later writes (the interpreter's last flush) go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(141) from None  # 128 + SIGPIPE, as a shell reports it
    except ModuleNotFoundError as exc:
        # A dependency this install lacks (not a module of ours): say which extra has it.
        root = (exc.name or "").partition(".")[0]
        name = next((arg for arg in argv if arg in COMMANDS), None)
        extra = _EXTRA_OF_MODULE.get(root) or (COMMANDS[name].extra if name else None)
        if not root or root in _OURS or extra is None:
            raise
        raise SystemExit(
            f"adaptive-rollout {name}: this install has no {root!r}; "
            f"install the [{extra}] extra: pip install 'adaptive-rollout[{extra}]'"
        ) from exc


if __name__ == "__main__":
    main()
