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
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        help="Hugging Face model directory (weights + tokenizer)",
    )
    p.add_argument(
        "--data",
        type=Path,
        action="append",
        required=True,
        help="prompt file (.jsonl or .parquet); repeat for several domains (domain = file stem unless a row says)",
    )
    p.add_argument(
        "--verifier",
        default="exact",
        help="default verifier for rows without one: exact | math | python:module:function",
    )
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="inference engine")
    p.add_argument(
        "--hf-engine",
        choices=["process", "thread"],
        default="process",
        help="run the hf backend in its own process (the service's work then never waits on the "
        "engine's GIL) or on a thread of the server process",
    )
    p.add_argument("--device", default="cpu", help="torch device for the hf backend")
    p.add_argument("--dtype", default="float32", help="engine dtype (float32, bfloat16, float16)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0 picks a free one)")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path("sampler_state"),
        help="directory for the SQLite store (groups, config, mixer state) and accepted weights",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("ADAPTIVE_ROLLOUT_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: env ADAPTIVE_ROLLOUT_API_KEY)",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="initial sampler config (.json or .toml, the keys of GET /v1/config); a config saved "
        "in the state dir by an earlier run wins",
    )
    p.add_argument("--heartbeat-s", type=float, default=5.0, help="stream heartbeat interval")
    p.add_argument(
        "--verifier-timeout-s", type=float, default=10.0, help="time limit per verification"
    )
    p.add_argument("--verifier-workers", type=int, default=2, help="verifier processes")
    p.add_argument(
        "--store-checkpoint-s",
        type=float,
        default=0.5,
        help="seconds between SQLite WAL checkpoints, run off the write path; 0 = SQLite's default (inside commits)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for data order and sampling")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="CPU threads for torch in the server (1 suits small models: more threads spin "
        "against the verifier and HTTP work on few cores; 0 leaves torch's default)",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine argument passed to vLLM, e.g. tensor_parallel_size=2 (value parsed as JSON if it can be)",
    )
    p.add_argument(
        "--max-lease-wait-s",
        type=float,
        default=300.0,
        help="longest wait of a lease call for groups (its wait_s is capped to this)",
    )
    p.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C, open streams end at once, finished groups are stored, and "
        "the process exits within this many seconds",
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas, each a Ray actor (a local Ray unless --ray-address); 1 keeps "
        "the engine beside the server and never imports Ray",
    )
    p.add_argument(
        "--ray-address",
        help="Ray cluster to run the replicas on (auto, or host:port); replicas outlive the "
        "sampler there, so a restarted sampler re-attaches to them",
    )
    p.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica")
    p.add_argument(
        "--replica-max-restarts",
        type=int,
        default=3,
        help="restarts of a failed replica before it is given up",
    )
    p.add_argument(
        "--replica-max-inflight",
        type=int,
        help="samples in flight per replica (default 384, 1.5 x vLLM's 256 sequences)",
    )
    p.add_argument(
        "--route",
        choices=["sticky", "least-loaded"],
        default="sticky",
        help="sticky: a prompt's next wave goes to its last replica (prefix cached) unless "
        "that one is overloaded; least-loaded: always the replica with the fewest samples",
    )
    p.add_argument(
        "--replica-probe-s", type=float, default=5.0, help="seconds between replica health probes"
    )
    p.add_argument(
        "--replica-probe-timeout-s",
        type=float,
        default=30.0,
        help="a replica that does not answer a probe this long is killed and restarted",
    )
    p.add_argument(
        "--replica-wait-s",
        type=float,
        default=300.0,
        help="how long a wave waits for a routable replica before it counts as failed",
    )
    p.add_argument(
        "--replicas-on-exit",
        choices=["keep", "kill"],
        default="kill",
        help="on a clean exit, kill the replicas or keep them warm for the next sampler",
    )
    p.add_argument("--log-level", default="INFO", help="logging level")


def _parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--vllm-arg expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _exit_now(settings: Any) -> None:
    logging.getLogger("sampler_service").error(
        "shutdown took longer than %g s: exiting now (stored groups are safe)",
        settings.shutdown_timeout_s,
    )
    os._exit(1)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from sampler_service.app import create_app
    from sampler_service.config import ConfigError, ServeSettings, validate_config
    from sampler_service.service import SamplerService

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    settings = ServeSettings(
        model=args.model,
        data=args.data,
        verifier=args.verifier,
        backend=args.backend,
        hf_engine=args.hf_engine,
        torch_threads=args.torch_threads,
        device=args.device,
        dtype=args.dtype,
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        api_key=args.api_key,
        heartbeat_s=args.heartbeat_s,
        verifier_timeout_s=args.verifier_timeout_s,
        verifier_workers=args.verifier_workers,
        store_checkpoint_s=args.store_checkpoint_s,
        seed=args.seed,
        vllm=_parse_engine_args(args.vllm_arg),
        shutdown_timeout_s=args.shutdown_timeout_s,
        max_lease_wait_s=args.max_lease_wait_s,
        replicas=args.replicas,
        ray_address=args.ray_address,
        replica_gpus=args.replica_gpus,
        replica_cpus=args.replica_cpus,
        replica_max_restarts=args.replica_max_restarts,
        replica_max_inflight=args.replica_max_inflight,
        route=args.route,
        replica_probe_s=args.replica_probe_s,
        replica_probe_timeout_s=args.replica_probe_timeout_s,
        replica_wait_s=args.replica_wait_s,
        replicas_on_exit=args.replicas_on_exit,
    )
    if not args.model.is_dir():
        raise SystemExit(f"--model {args.model}: no such model directory")
    try:
        raw = _load_config_file(args.config) if args.config else {}
        if settings.replicas > 1:
            # Admission scales with the engines unless the config says otherwise.
            raw.setdefault("max_active_prompts", 64 * settings.replicas)
        initial = validate_config(raw)
    except (ConfigError, OSError, ValueError) as exc:  # unreadable, not JSON/TOML, invalid
        raise SystemExit(f"--config {args.config}: {exc}") from exc
    service = SamplerService(settings, initial_config=initial)
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
    p_serve.set_defaults(func=serve)

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
